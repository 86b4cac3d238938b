"""Triton kernels of the two grouped GEMMs of fused_moe and the top-k reduction.

Both GEMMs walk the sorted rows of an :class:`~hopperkern.moe.align.AlignPlan`: row block ``b`` (rows
``b*BLOCK_M ..``) belongs to expert ``block_expert[b]``. Both are persistent: ``NUM_PROGRAMS`` programs stride
over the (row block, N tile) tiles, whose count is read on the device (``num_blocks * cdiv(N, BLOCK_N)``), so
blocks past the live count cost nothing and the host never synchronises (CUDA-graph safe). Descriptors are
built once per program; with ``FLATTEN`` the pipeliner prefetches the next tile's K loads under this tile's
epilogue. Inside each kernel the GEMM letters are ``M`` = sorted rows, ``N`` = output columns, ``K`` =
reduction dim.

ONE body per GEMM serves both memory paths: weights come through 3-D tensor descriptors (boxes [1, BN, BK])
or pointer loads, switched by constexpr flags chosen on the host by :func:`hopperkern.tma.decide`.

Decode (direct plans) streams each routed expert's weights once, gate/up then down. Asking L2 for the down
weights from the gate/up kernel (sm_90's bulk prefetch of each expert's w2 slab, dealt over its programs, with or
without the evict-last hint) made 1- and 4-token calls 1.09-1.21 x slower on the H100 at all five PERF.md shapes,
bitwise the same outputs: the gate/up stream already takes the memory bandwidth, so what the down GEMM gains from
L2 the gate/up GEMM loses. The kernels do not prefetch.
"""

import triton
import triton.language as tl

from ..tma.jit import (chain_start, grouped_tile, load_2d, load_3d, load_halves, load_rows, store_2d, tile_source_2d,
                       tile_source_3d, tile_source_halves)

ACT_SILU = 0
ACT_GELU_TANH = 1

# Token-count-dependent ints: not specialised (divisibility by 16, == 1), so one compiled variant serves every
# batch size of a shape. H, I and the strides stay specialised (alignment of the vector loads).
_RUNTIME_INTS = ["E", "num_slots", "top_k", "max_blocks"]


@triton.jit
def _sigmoid(x):
    # exp of a large positive argument gives inf and 1/inf = 0: no NaN for any finite x.
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _activation(g, ACT: tl.constexpr):
    """silu(g) = g * sigmoid(g); gelu_tanh(g) = 0.5 g (1 + tanh(u)) = g * sigmoid(2u), u = sqrt(2/pi)(g +
    0.044715 g^3). The sigmoid form avoids libdevice tanh (which the interpreter cannot run)."""
    if ACT == 0:
        out = g * _sigmoid(g)
    else:
        out = g * _sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
    return out


@triton.jit
def _row_blocks(num_blocks_ptr, max_blocks, DIRECT: tl.constexpr):
    """Row blocks to visit: the plan's device-side live count; a DIRECT plan has one block per slot."""
    if DIRECT:
        num_m = max_blocks
    else:
        num_m = tl.load(num_blocks_ptr)
    return num_m


@triton.jit
def _block_slots(pid_m, slots_ptr, block_expert_ptr, E, num_slots, top_k, K, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, DIRECT: tl.constexpr):
    """Row block pid_m (< the live count): (expert, K steps, and per row: slot, live (not padding), token =
    slot // top_k).

    Sorted plan: rows from the plan. DIRECT plan (tiny batches, no alignment launch): block b is slot b alone
    (row 0; rows 1.. are padding), ``slots_ptr`` holds the flattened topk_ids, and a slot whose id is outside
    [0, E) (-1: dropped) gets zero K steps and no live row. A zero trip count rather than an ``if`` around the
    tile keeps the tile loop a plain loop nest, which FLATTEN needs; no weight of the bad id is ever read."""
    k_steps = tl.cdiv(K, BLOCK_K)
    if DIRECT:
        e = tl.load(slots_ptr + pid_m)
        ok = (e >= 0) & (e < E)  # in the ids' dtype: narrowing an int64 id first could make it look valid
        e = tl.where(ok, e, 0).to(tl.int32)  # a bad id's block runs no K steps; 0 keeps e in range anyway
        slot = tl.where((tl.arange(0, BLOCK_M) == 0) & ok, pid_m, num_slots)
        k_steps = tl.where(ok, k_steps, 0)
    else:
        slot = tl.load(slots_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        e = tl.load(block_expert_ptr + pid_m)
    return e, k_steps, slot, slot < num_slots, slot // top_k


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _gate_up_kernel(
    x_ptr,            # [T, H] hidden (any strides), fp16/bf16/fp32
    w_ptr,            # [E, 2*I, H] w13: rows 0..I-1 gate, I..2I-1 up
    y_ptr,            # [max_blocks*BLOCK_M, I] out, hidden dtype: act(gate) * up per sorted row
    pg_ptr, pu_ptr,   # SAVE_PRE: [num_rows, I] views (row stride stride_pm) out: gate / up pre-activations
    slots_ptr,        # [max_blocks*BLOCK_M] int32 sorted slots (sentinel num_slots in padding); DIRECT: ids
    block_expert_ptr, # [max_blocks] int32 (unused when DIRECT)
    num_blocks_ptr,   # [1] int32 live blocks (unused when DIRECT)
    E, H, I, num_rows, num_slots, top_k, max_blocks,
    stride_xt, stride_xh, stride_we, stride_wn, stride_wh, stride_ym, stride_pm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, W_TMA: tl.constexpr, Y_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    SAVE_PRE: tl.constexpr = False, PG_TMA: tl.constexpr = False, PU_TMA: tl.constexpr = False,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False, X_SORTED: tl.constexpr = False,
):
    """GEMM1: y[r, n] = act(x[tok(r)] . w13[e, n]) * (x[tok(r)] . w13[e, I + n]), M = sorted rows, N = I,
    K = H. Persistent grid (<= NUM_PROGRAMS,); one tile = one row block x BLOCK_N columns of BOTH the gate and
    the up half, so the 2*I-wide pre-activation never reaches HBM; a program takes tiles pid, pid + NUM_PROGRAMS,
    ... (a grid smaller than NUM_PROGRAMS means at most one tile each). Each K step loads the gate and up rows
    as one [2*BLOCK_N, BLOCK_K] tile (:func:`hopperkern.tma.jit.load_halves`) and runs ONE dot into a
    [BLOCK_M, 2*BLOCK_N] accumulator, split into its gate and up halves in the epilogue: on sm_90 at 128 x 128
    tiles that is one m64n256 wgmma instead of two m64n128 ones (the hidden tile is read from shared memory once
    per K step, not twice); the sums are the same, element by element.

    Token rows are gathered by index (pointer loads; TMA gather is sm_100 only). Padding rows gather nothing
    (masked to zero) and store act(0) * 0 = 0.

    SAVE_PRE (training): also store the gate and up pre-activations, rounded once to hidden's dtype, for the
    backward's activation gradient (:mod:`hopperkern.moe._backward_kernels`); padding rows store zeros."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    w_src = tile_source_halves(w_ptr, E, I, H, stride_we, stride_wn, BLOCK_N, BLOCK_K, W_TMA)
    y_dst = tile_source_2d(y_ptr, num_rows, I, stride_ym, BLOCK_M, BLOCK_N, Y_TMA)
    if X_SORTED:
        x_src = tile_source_2d(x_ptr, num_rows, H, stride_xt, BLOCK_M, BLOCK_K, True)
    if SAVE_PRE:
        tl.static_assert(not DIRECT, "saving pre-activations needs a sorted plan (the backward walks its segments)")
        g_dst = tile_source_2d(pg_ptr, num_rows, I, stride_pm, BLOCK_M, BLOCK_N, PG_TMA)
        u_dst = tile_source_2d(pu_ptr, num_rows, I, stride_pm, BLOCK_M, BLOCK_N, PU_TMA)
    num_m = _row_blocks(num_blocks_ptr, max_blocks, DIRECT)
    num_n = tl.cdiv(I, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        e, k_steps, slot, live, tok = _block_slots(pid_m, slots_ptr, block_expert_ptr, E, num_slots, top_k, H,
                                                   BLOCK_M, BLOCK_K, DIRECT)
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_steps):
            k0 = kk * BLOCK_K
            # K tail: both paths read zeros past H; so do columns past I (when I % BLOCK_N != 0), which are
            # never stored.
            if X_SORTED:
                x = load_2d(x_src, pid_m * BLOCK_M, k0, num_rows, H, stride_xt, 1, BLOCK_M, BLOCK_K, True)
            else:
                x = load_rows(x_ptr, tok, live, k0, H, stride_xt, stride_xh, BLOCK_K, False)
            w = load_halves(w_src, e, n0, k0, I, H, stride_we, stride_wn, stride_wh, BLOCK_N, BLOCK_K, W_TMA)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
        acc_g, acc_u = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_N).permute(0, 2, 1))
        # A DIRECT block with a dropped id ran no K steps: it stores act(0) * 0 = 0, like a padding row.
        y = _activation(acc_g, ACT) * acc_u
        store_2d(y_dst, y.to(y_ptr.dtype.element_ty), pid_m * BLOCK_M, n0, num_rows, I, stride_ym, 1,
                 BLOCK_M, BLOCK_N, Y_TMA)
        if SAVE_PRE:
            store_2d(g_dst, acc_g.to(pg_ptr.dtype.element_ty), pid_m * BLOCK_M, n0, num_rows, I, stride_pm, 1,
                     BLOCK_M, BLOCK_N, PG_TMA)
            store_2d(u_dst, acc_u.to(pu_ptr.dtype.element_ty), pid_m * BLOCK_M, n0, num_rows, I, stride_pm, 1,
                     BLOCK_M, BLOCK_N, PU_TMA)


@triton.jit
def _store_cols(rows, vals, cols, live, H, stride_on):
    """Store ``vals`` [R, C] at row pointers ``rows`` [R, 1] and columns ``cols`` [C]: live rows, columns < H."""
    tl.store(rows + cols[None, :] * stride_on, vals, mask=live[:, None] & (cols[None, :] < H))


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _down_kernel(
    y_ptr,            # [max_blocks*BLOCK_M, I] sorted intermediate rows (unit inner stride)
    w_ptr,            # [E, H, I] w2 (B_KN: [E, I, H], e.g. w13 for the backward's d_hidden with I = 2*I_moe)
    out_ptr,          # ATOMIC: [T, H] fp32, zero-filled; else [T*top_k, H] one row per slot
    tw_ptr,           # [T, top_k] routing weights, any float dtype and strides (read only with SCALE)
    slots_ptr,        # [max_blocks*BLOCK_M] int32 sorted slots; DIRECT: [T*top_k] flattened ids
    block_expert_ptr, # [max_blocks] int32 (unused when DIRECT)
    num_blocks_ptr,   # [1] int32 (unused when DIRECT)
    E, H, I, num_rows, num_slots, top_k, max_blocks,
    stride_ym, stride_we, stride_wh, stride_wi, stride_twt, stride_twk, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    Y_TMA: tl.constexpr, W_TMA: tl.constexpr, ATOMIC: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr, NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    B_KN: tl.constexpr = False, SCALE: tl.constexpr = True,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """GEMM2: z[r, n] = weight(slot(r)) * (y[r] . w2[e, n]), M = sorted rows, N = H, K = I. Persistent
    grid (<= NUM_PROGRAMS,) as in :func:`_gate_up_kernel`; one tile = one row block x BLOCK_N output columns.

    The backward's d_hidden is the same GEMM on other operands: B_KN reads the weights as [E, K, N] (w13
    [E, 2I, H] against d(gate, up) rows [*, 2I]; ``stride_wi`` is then the K stride, ``stride_wh`` the N
    stride) and SCALE=False leaves out the routed weight.

    The sorted rows are contiguous, so they load with 2-D TMA. ATOMIC: fp32 atomic adds into out[token]
    (the top-k reduction happens here; the order of the adds varies run to run). Otherwise each slot's row
    is stored once into out[slot] and :func:`_topk_sum_kernel` adds the k rows in a fixed order (a DIRECT plan
    can instead sum inside :func:`_down_direct_kernel`)."""
    chain_start(PDL_WAIT, PDL_TRIGGER)  # before the descriptors: their scratch may be memory the previous kernel used
    y_src = tile_source_2d(y_ptr, num_rows, I, stride_ym, BLOCK_M, BLOCK_K, Y_TMA)
    if B_KN:
        w_src = tile_source_3d(w_ptr, E, I, H, stride_we, stride_wi, BLOCK_K, BLOCK_N, W_TMA)
    else:
        w_src = tile_source_3d(w_ptr, E, H, I, stride_we, stride_wh, BLOCK_N, BLOCK_K, W_TMA)
    num_m = _row_blocks(num_blocks_ptr, max_blocks, DIRECT)
    num_n = tl.cdiv(H, BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        e, k_steps, slot, live, tok = _block_slots(pid_m, slots_ptr, block_expert_ptr, E, num_slots, top_k, I,
                                                   BLOCK_M, BLOCK_K, DIRECT)
        n0 = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_steps):
            k0 = kk * BLOCK_K
            a = load_2d(y_src, pid_m * BLOCK_M, k0, num_rows, I, stride_ym, 1, BLOCK_M, BLOCK_K, Y_TMA)
            if B_KN:
                b = load_3d(w_src, e, k0, n0, I, H, stride_we, stride_wi, stride_wh, BLOCK_K, BLOCK_N, W_TMA)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            else:
                b = load_3d(w_src, e, n0, k0, H, I, stride_we, stride_wh, stride_wi, BLOCK_N, BLOCK_K, W_TMA)
                acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        if SCALE:
            wt = tl.load(tw_ptr + tok.to(tl.int64) * stride_twt + (slot - tok * top_k) * stride_twk, mask=live,
                         other=0.0)
            acc = acc * wt.to(tl.float32)[:, None]
        if ATOMIC:
            cols = n0 + tl.arange(0, BLOCK_N)
            ptrs = out_ptr + tok[:, None].to(tl.int64) * stride_om + cols[None, :] * stride_on
            tl.atomic_add(ptrs, acc, mask=live[:, None] & (cols[None, :] < H), sem="relaxed")
        elif BLOCK_M * BLOCK_N >= 128 * 256:
            # Stored as four column quarters, one after the other: a quarter of the row addresses is live at a time
            # (on sm_90 at 128 x 256 tiles, 195 registers per thread instead of 255 for one whole-tile store).
            lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
            q0, q1 = tl.split(tl.permute(tl.reshape(lo, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
            q2, q3 = tl.split(tl.permute(tl.reshape(hi, (BLOCK_M, 2, BLOCK_N // 4)), (0, 2, 1)))
            rows = out_ptr + slot[:, None].to(tl.int64) * stride_om
            quarter = n0 + tl.arange(0, BLOCK_N // 4)
            dt = out_ptr.dtype.element_ty
            _store_cols(rows, q0.to(dt), quarter, live, H, stride_on)
            _store_cols(rows, q1.to(dt), quarter + BLOCK_N // 4, live, H, stride_on)
            _store_cols(rows, q2.to(dt), quarter + BLOCK_N // 2, live, H, stride_on)
            _store_cols(rows, q3.to(dt), quarter + 3 * (BLOCK_N // 4), live, H, stride_on)
        else:
            _store_cols(out_ptr + slot[:, None].to(tl.int64) * stride_om, acc.to(out_ptr.dtype.element_ty),
                        n0 + tl.arange(0, BLOCK_N), live, H, stride_on)


@triton.jit(do_not_specialize=["E", "top_k", "num_rows", "num_tokens"])
def _down_direct_kernel(
    y_ptr,            # [T*top_k*BLOCK_M, I] intermediate rows of a DIRECT plan: slot s in row s*BLOCK_M
    w_ptr,            # [E, H, I] w2
    out_ptr,          # [T, H] out (any float dtype)
    tw_ptr,           # [T, top_k] routing weights, any float dtype and strides
    ids_ptr,          # [T*top_k] flattened topk_ids (int32/int64)
    E, H, I, num_rows, num_tokens, top_k,
    stride_ym, stride_we, stride_wh, stride_wi, stride_twt, stride_twk, stride_ot, stride_oh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TOP_K_P: tl.constexpr, Y_TMA: tl.constexpr, W_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """GEMM2 of a DIRECT plan with the top-k sum fused: out[t, n] = sum_j weight[t, j] * (y[slot t*k+j] .
    w2[ids[t, j], n]), j in order, in fp32, rounded once at the store. Deterministic, and no [T*k, H] round
    trip or second launch (what :func:`_topk_sum_kernel` costs the sorted path).

    Persistent grid (<= NUM_PROGRAMS,) over (token, BLOCK_N columns) tiles; a tile runs ONE loop of
    top_k * cdiv(I, BLOCK_K) K steps, expert after expert, so the load pipeline never drains between the
    token's experts. The expert ids and weights of the token sit in registers (TOP_K_P >= top_k lanes). A
    dropped id (outside [0, E), e.g. -1) reads its weight tile from rows past H: both memory paths return
    zeros there without touching memory, and its routing weight is taken as 0."""
    chain_start(PDL_WAIT, PDL_TRIGGER)  # before the descriptors: their scratch may be memory the previous kernel used
    y_src = tile_source_2d(y_ptr, num_rows, I, stride_ym, BLOCK_M, BLOCK_K, Y_TMA)
    w_src = tile_source_3d(w_ptr, E, H, I, stride_we, stride_wh, BLOCK_N, BLOCK_K, W_TMA)
    num_n = tl.cdiv(H, BLOCK_N)
    k_steps = tl.cdiv(I, BLOCK_K)
    lanes = tl.arange(0, TOP_K_P)
    rows = tl.arange(0, BLOCK_M)
    for tile in tl.range(tl.program_id(0), num_tokens * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        t, pid_n = grouped_tile(tile, num_tokens, num_n, GROUP_M)
        n0 = pid_n * BLOCK_N
        t64 = t.to(tl.int64)
        ids = tl.load(ids_ptr + t64 * top_k + lanes, mask=lanes < top_k, other=-1)
        ok = (ids >= 0) & (ids < E)  # in the ids' dtype, before narrowing
        bad = tl.sum(((ids < -1) | (ids >= E)).to(tl.int32))  # an id outside [-1, E): the token's row is NaN
        ids = tl.where(ok, ids, 0).to(tl.int32)
        wts = tl.load(tw_ptr + t64 * stride_twt + lanes * stride_twk, mask=ok, other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, top_k * k_steps):
            j = step // k_steps
            k0 = (step - j * k_steps) * BLOCK_K
            e = tl.sum(tl.where(lanes == j, ids, 0))
            live = tl.sum(tl.where(lanes == j, ok.to(tl.int32), 0)) != 0
            a = load_2d(y_src, (t * top_k + j) * BLOCK_M, k0, num_rows, I, stride_ym, 1, BLOCK_M, BLOCK_K, Y_TMA)
            b = load_3d(w_src, e, tl.where(live, n0, H), k0, H, I, stride_we, stride_wh, stride_wi, BLOCK_N,
                        BLOCK_K, W_TMA)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
            last = k0 + BLOCK_K >= I
            wj = tl.sum(tl.where(lanes == j, wts, 0.0))
            total = tl.where(last, total + acc * wj, total)
            acc = tl.where(last, 0.0, acc)
        cols = n0 + tl.arange(0, BLOCK_N)
        total = tl.where((rows[:, None] * 0 + bad) > 0, float("nan"), total)
        ptrs = out_ptr + t64 * stride_ot + rows[:, None] * 0 + cols[None, :] * stride_oh
        tl.store(ptrs, total.to(out_ptr.dtype.element_ty), mask=(rows[:, None] == 0) & (cols[None, :] < H))


@triton.jit(do_not_specialize=["E", "num_slots", "top_k"])
def _gate_up_down_kernel(
    x_ptr,            # [T, H] hidden (any strides)
    w13_ptr,          # [E, 2*I, H] w13: rows 0..I-1 gate, I..2I-1 up
    w2_ptr,           # [E, H, I] w2
    part_ptr,         # [num_slots * cdiv(I, BLOCK_I), H] fp32 out: one partial row per (slot, slice of I)
    tw_ptr,           # [T, top_k] routing weights, any float dtype and strides
    ids_ptr,          # [num_slots] flattened topk_ids (int32/int64)
    E, H, I, num_slots, top_k,
    stride_xt, stride_xh, stride_w1e, stride_w1n, stride_w1h, stride_w2e, stride_w2h, stride_w2i,
    stride_twt, stride_twk, stride_p,
    BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_H: tl.constexpr,
    STAGES_1: tl.constexpr, STAGES_2: tl.constexpr, ACT: tl.constexpr, W1_TMA: tl.constexpr,
    W2_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """Both GEMMs of a DIRECT plan in one kernel, split over the intermediate size: program ``p`` = (slot s,
    slice i of BLOCK_I columns of I) computes ``y = act(x[tok] . w13[e, gate slice]) * (x[tok] . w13[e, up
    slice])`` (fp32 sums over H, rounded once to hidden's dtype, as the two-kernel path stores it), then
    ``part[p] = weight(s) * (y . w2[e, :, slice])`` over all of H in BLOCK_H chunks, in fp32.
    :func:`_partial_topk_sum_kernel` adds each token's k * cdiv(I, BLOCK_I) partial rows in a fixed order.

    Every routed expert's gate/up and down weights stream through one kernel, each weight element once, with
    no intermediate rows in memory between two launches. Row 0 of the [BLOCK_M, *] tiles is the slot's token,
    the other rows are zeros (the dots' minimum M). A slot whose id is outside [0, E) (-1: dropped) runs no
    step and writes no partial row; the sum skips its rows."""
    chain_start(PDL_WAIT, PDL_TRIGGER)  # before the descriptors: their scratch may be memory the previous kernel used
    w1_src = tile_source_halves(w13_ptr, E, I, H, stride_w1e, stride_w1n, BLOCK_I, BLOCK_K, W1_TMA)
    w2_src = tile_source_3d(w2_ptr, E, H, I, stride_w2e, stride_w2h, BLOCK_H, BLOCK_I, W2_TMA)
    num_i = tl.cdiv(I, BLOCK_I)
    pid = tl.program_id(0)
    slot = pid // num_i
    i0 = (pid - slot * num_i) * BLOCK_I
    tok = slot // top_k
    e = tl.load(ids_ptr + slot)
    ok = (e >= 0) & (e < E)  # in the ids' dtype: narrowing an int64 id first could make it look valid
    e = tl.where(ok, e, 0).to(tl.int32)
    rows = tl.arange(0, BLOCK_M)
    # Row 0 when the id is valid. (Not `(rows == 0) & ok`: triton >= 3.9's interpreter widens the scalar `ok` to
    # int32 there and rejects the mask.)
    live = rows < tl.where(ok, 1, 0)
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_I), dtype=tl.float32)
    for kk in tl.range(0, tl.where(ok, tl.cdiv(H, BLOCK_K), 0), num_stages=STAGES_1):
        k0 = kk * BLOCK_K
        x = load_rows(x_ptr, rows * 0 + tok, live, k0, H, stride_xt, stride_xh, BLOCK_K, False)
        w = load_halves(w1_src, e, i0, k0, I, H, stride_w1e, stride_w1n, stride_w1h, BLOCK_I, BLOCK_K, W1_TMA)
        acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)
    acc_g, acc_u = tl.split(acc.reshape(BLOCK_M, 2, BLOCK_I).permute(0, 2, 1))
    # Columns past I read zero weights: act(0) * 0 = 0 there, and their w2 columns read zeros too.
    y = (_activation(acc_g, ACT) * acc_u).to(x_ptr.dtype.element_ty)
    wt = tl.load(tw_ptr + tok.to(tl.int64) * stride_twt + (slot - tok * top_k) * stride_twk, mask=ok,
                 other=0.0).to(tl.float32)
    dst = part_ptr + pid.to(tl.int64) * stride_p
    for hh in tl.range(0, tl.where(ok, tl.cdiv(H, BLOCK_H), 0), num_stages=STAGES_2):
        h0 = hh * BLOCK_H
        b = load_3d(w2_src, e, h0, i0, H, I, stride_w2e, stride_w2h, stride_w2i, BLOCK_H, BLOCK_I, W2_TMA)
        z = tl.dot(y, tl.trans(b), input_precision=DOT_PRECISION) * wt
        cols = h0 + tl.arange(0, BLOCK_H)
        tl.store(dst + rows[:, None] * 0 + cols[None, :], z, mask=(rows[:, None] == 0) & (cols[None, :] < H))


@triton.jit(do_not_specialize=["E"])
def _partial_topk_sum_kernel(
    part_ptr,         # [T * top_k * num_i, H] fp32 partial rows of _gate_up_down_kernel (token-major)
    ids_ptr,          # [T * top_k] int32/int64 flattened topk_ids
    out_ptr,          # [T, H] out
    E, H, stride_p, stride_ot, stride_oh,
    TOP_K: tl.constexpr, NUM_I: tl.constexpr, ROWS: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """out[t] = the sum of token t's TOP_K * NUM_I partial rows in fp32, in a fixed order (CHUNKS blocks of ROWS
    rows, each summed by one fixed reduction tree, then the blocks in order), rounded once. Rows of slots whose
    id is -1 (dropped) are never read; a token with an id outside [-1, E) gets NaN. Grid (T, cdiv(H, BLOCK_H))."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    bad = 0
    for c in tl.static_range(CHUNKS):
        r = c * ROWS + tl.arange(0, ROWS)
        in_range = r < TOP_K * NUM_I
        e = tl.load(ids_ptr + t * TOP_K + r // NUM_I, mask=in_range, other=-1)
        ok = in_range & (e >= 0) & (e < E)
        bad += tl.sum((in_range & ((e < -1) | (e >= E))).to(tl.int32))
        vals = tl.load(part_ptr + (t * (TOP_K * NUM_I) + r)[:, None] * stride_p + cols[None, :],
                       mask=ok[:, None] & (cols[None, :] < H), other=0.0)
        acc += tl.sum(vals, axis=0)
    acc = tl.where(cols < tl.where(bad > 0, H, 0), float("nan"), acc)
    tl.store(out_ptr + t * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


@triton.jit
def _topk_sum_kernel(
    src_ptr,          # [T*top_k, H] per-slot rows (rows of dropped slots are never written)
    ids_ptr,          # [T*top_k] int32/int64 flattened topk_ids
    out_ptr,          # [T, H] out
    E, H, stride_s, stride_ot, stride_oh,
    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, FILL: tl.constexpr = False,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """out[t] = sum_j src[t*k + j] in fp32, j = 0..k-1 in order (deterministic); slots whose id is -1 (dropped)
    add nothing, and a token with an id outside [-1, E) gets NaN (never a plausible sum that lacks an expert).
    FILL: src is not read; out[t] = 0, or NaN for such a token (the zero fill the atomic top-k sum adds into).
    Grid (T, cdiv(H, BLOCK_H))."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):  # unrolled: the k loads issue together, the adds stay in order
        s = t.to(tl.int64) * TOP_K + j
        e = tl.load(ids_ptr + s)
        # Masks compare cols against per-slot column limits. (Not `(cols < H) & ok`: triton >= 3.9's interpreter
        # rejects that mask, as it widens the scalar `ok` to int32 when broadcasting.)
        if not FILL:
            limit = tl.where((e >= 0) & (e < E), H, 0)  # a dropped slot reads no column
            acc += tl.load(src_ptr + s * stride_s + cols, mask=cols < limit, other=0.0).to(tl.float32)
        acc = tl.where(cols < tl.where((e < -1) | (e >= E), H, 0), float("nan"), acc)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + cols * stride_oh, acc.to(out_ptr.dtype.element_ty),
             mask=cols < H)


@triton.jit(do_not_specialize=["num_rows", "num_slots", "top_k"])
def _gather_rows_kernel(
    src_ptr,          # [T, H] token rows (any strides)
    slots_ptr,        # [num_rows] int32 sorted slots (sentinel num_slots in padding)
    num_blocks_ptr,   # [1] int32 live blocks
    dst_ptr,          # [num_rows, H] out, unit inner stride: the token row of each live sorted row, zeros in padding
    num_rows, num_slots, top_k, H, stride_st, stride_sh, stride_d,
    ROWS_PER_BLOCK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL_WAIT: tl.constexpr = False, PDL_TRIGGER: tl.constexpr = False,
):
    """dst[r] = src[slot(r) // top_k] for the live rows of the plan (0 for padding): the sorted row copies that
    let a GEMM read its row operand as contiguous tiles (2-D TMA) instead of gathering token rows (the forward's
    gate/up GEMM with ``MoeConfig.sorted_rows``; the backward's weight gradients). Grid (cdiv(num_rows, BLOCK_R),
    cdiv(H, BLOCK_H)); rows past the live blocks are skipped (never read)."""
    chain_start(PDL_WAIT, PDL_TRIGGER)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = rows < tl.load(num_blocks_ptr) * ROWS_PER_BLOCK
    slot = tl.load(slots_ptr + rows, mask=ok, other=num_slots)
    live = ok & (slot < num_slots)
    tok = (slot // top_k).to(tl.int64)
    col_ok = (cols < H)[None, :]
    vals = tl.load(src_ptr + tok[:, None] * stride_st + cols[None, :].to(tl.int64) * stride_sh,
                   mask=live[:, None] & col_ok, other=0.0)
    tl.store(dst_ptr + rows[:, None].to(tl.int64) * stride_d + cols[None, :], vals, mask=ok[:, None] & col_ok)
