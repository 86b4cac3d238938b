"""Triton kernels of the fused_moe backward (the forward's kernels are in :mod:`._gemm_kernels`).

With ``dOut`` [T, H] the upstream gradient and, for the sorted row r holding slot s = t*k + j of expert e,
``g, u`` the gate and up pre-activations, ``y = act(g) * u`` and ``w = topk_weights[t, j]``::

    Xs[r], Ds[r] = hidden[t], dOut[t]                  (sorted copies, zero padding rows) -> _gather_rows_kernel
    dY[r]        = Ds[r] @ w2[e]                        (unweighted, [I])                  -> _dgate_up_kernel
    d_tw[t, j]   = <dY[r], y[r]>                        partial sums per column tile, then  _topk_weight_grad_kernel
    dG, dU       = w dY act'(g) u,  w dY act(g);  Yw = w y   (epilogue)                    -> _dgate_up_kernel
    d_x[slot]    = [dG, dU] @ w13[e]                    (K = 2I)                            -> _down_kernel with B_KN
    d_hidden[t]  = sum_j d_x[t*k + j]                   (fp32, j in order)                  -> _topk_sum_kernel
    d_w13[e]     = [dG, dU]_e^T Xs_e,   d_w2[e] = Ds_e^T Yw_e                               -> _expert_wgrad_kernel

The row layout is the forward's :class:`~hopperkern.moe.align.AlignPlan` (sorted, padded to BLOCK_M per
expert); padding rows of every sorted buffer hold zeros, so they add nothing to any sum. Every GEMM reads its
row operands as sorted, contiguous tiles (2-D TMA where eligible): measured on the H200, the weight-gradient
GEMMs ran at 280-330 TF/s with a gathered operand and 500-700 TF/s with sorted ones, while the two sorted
copies cost 0.2-0.3 ms. Nothing reads a count on the host: tile loops are bounded by ``num_blocks`` /
``expert_offsets`` on the device (CUDA-graph safe). Each kernel has ONE body for both memory paths (``*_TMA``
constexprs, :mod:`hopperkern.tma.jit`).
"""

import triton
import triton.language as tl

from ..tma.jit import grouped_tile, load_2d, load_3d, store_2d, store_3d, tile_source_2d, tile_source_3d
from ._gemm_kernels import _RUNTIME_INTS, _block_slots, _sigmoid


@triton.jit
def _activation_and_grad(g, ACT: tl.constexpr):
    """(act(g), d act / d g) in fp32. silu: s = sigmoid(g), act = g s, act' = s (1 + g (1 - s)).
    gelu_tanh: act = g sigmoid(2v), v = c (g + 0.044715 g^3), c = sqrt(2/pi);
    act' = s + 2 g s (1 - s) c (1 + 3 * 0.044715 g^2) with s = sigmoid(2v)."""
    if ACT == 0:
        s = _sigmoid(g)
        d = s * (1.0 + g * (1.0 - s))
    else:
        s = _sigmoid(1.5957691216057308 * (g + 0.044715 * g * g * g))
        d = s + g * s * (1.0 - s) * 1.5957691216057308 * (1.0 + 0.134145 * g * g)
    return g * s, d


@triton.jit
def _dgate_up_epilogue(acc, g, u, wt, ACT: tl.constexpr):
    """From dY (``acc``), g, u (fp32 tiles) and the rows' routed weights: (dG, dU, Yw, per-row <dY, y>)."""
    a, da = _activation_and_grad(g, ACT)
    y = a * u
    dy = acc * wt[:, None]
    return dy * u * da, dy * a, y * wt[:, None], tl.sum(acc * y, 1)


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _dgate_up_kernel(
    dout_ptr,         # [num_rows, H] sorted upstream-gradient rows Ds (unit inner stride), hidden's dtype
    w2_ptr,           # [E, H, I]
    x_ptr,            # RECOMPUTE: [num_rows, H] sorted hidden rows Xs (unit inner stride)
    w13_ptr,          # RECOMPUTE: [E, 2*I, H]
    pg_ptr, pu_ptr,   # not RECOMPUTE: [num_rows, I] views (row stride stride_pm): saved gate / up pre-activations
    y_ptr,            # [num_rows, I] out: Yw = routed weight * act(gate) * up per sorted row (for d_w2)
    dg_ptr, du_ptr,   # [num_rows, I] views (row stride stride_gm) out: d gate, d up (hidden's dtype)
    part_ptr,         # [cdiv(I, HALVES*BLOCK_N), num_rows] fp32 out: <dY, y> over one column tile per sorted row
    tw_ptr,           # [T, top_k] routing weights, any float dtype and strides
    slots_ptr,        # [max_blocks*BLOCK_M] int32 sorted slots (sentinel num_slots in padding)
    block_expert_ptr, # [max_blocks] int32
    num_blocks_ptr,   # [1] int32 live blocks
    E, H, I, num_rows, num_slots, top_k, max_blocks,
    stride_dm, stride_w2e, stride_w2h, stride_w2i, stride_xm, stride_w13e, stride_w13n, stride_w13h, stride_pm,
    stride_ym, stride_gm, stride_twt, stride_twk,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, RECOMPUTE: tl.constexpr, HALVES: tl.constexpr, D_TMA: tl.constexpr, X_TMA: tl.constexpr,
    W2_TMA: tl.constexpr, W13_TMA: tl.constexpr, PG_TMA: tl.constexpr, PU_TMA: tl.constexpr, Y_TMA: tl.constexpr,
    DG_TMA: tl.constexpr, DU_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FLATTEN: tl.constexpr,
):
    """dY = Ds[r] @ w2[e] (M = sorted rows, N = I, K = H) with the activation backward in the epilogue.

    Persistent grid (<= NUM_PROGRAMS,) over (row block, HALVES * BLOCK_N columns of I) tiles, as the forward's
    GEMM1. HALVES = 2 keeps two [BLOCK_M, BLOCK_N] accumulators that share each gathered dOut tile (twice the
    work per gathered byte) and runs the epilogue one half at a time (half the live registers of one wide
    tile). The epilogue needs g and u: loaded from the forward's saved pre-activations, or (RECOMPUTE, one
    half) computed in the same K loop as dY from the sorted hidden rows (both GEMMs have K = H). It writes
    dG = w dY act'(g) u, dU = w dY act(g) and Yw = w y (the B operand of d_w2), each formed in fp32 and rounded
    once, and the per-row partial <dY, y> of its columns (summed over column tiles by
    :func:`_topk_weight_grad_kernel`, in a fixed order). Padding rows of Ds are zero: all their outputs are
    zero."""
    tl.static_assert(HALVES == 1 or (HALVES == 2 and not RECOMPUTE), "recomputing keeps one half")
    d_src = tile_source_2d(dout_ptr, num_rows, H, stride_dm, BLOCK_M, BLOCK_K, D_TMA)
    w2_src = tile_source_3d(w2_ptr, E, H, I, stride_w2e, stride_w2h, BLOCK_K, BLOCK_N, W2_TMA)
    dg_dst = tile_source_2d(dg_ptr, num_rows, I, stride_gm, BLOCK_M, BLOCK_N, DG_TMA)
    du_dst = tile_source_2d(du_ptr, num_rows, I, stride_gm, BLOCK_M, BLOCK_N, DU_TMA)
    y_dst = tile_source_2d(y_ptr, num_rows, I, stride_ym, BLOCK_M, BLOCK_N, Y_TMA)
    if RECOMPUTE:
        x_src = tile_source_2d(x_ptr, num_rows, H, stride_xm, BLOCK_M, BLOCK_K, X_TMA)
        w13_src = tile_source_3d(w13_ptr, E, 2 * I, H, stride_w13e, stride_w13n, BLOCK_N, BLOCK_K, W13_TMA)
    else:
        g_src = tile_source_2d(pg_ptr, num_rows, I, stride_pm, BLOCK_M, BLOCK_N, PG_TMA)
        u_src = tile_source_2d(pu_ptr, num_rows, I, stride_pm, BLOCK_M, BLOCK_N, PU_TMA)
    num_m = tl.load(num_blocks_ptr)
    num_n = tl.cdiv(I, HALVES * BLOCK_N)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_PROGRAMS, flatten=FLATTEN):
        pid_m, pid_n = grouped_tile(tile, num_m, num_n, GROUP_M)
        e, k_steps, slot, live, tok = _block_slots(pid_m, slots_ptr, block_expert_ptr, E, num_slots, top_k, H,
                                                   BLOCK_M, BLOCK_K, False)
        row0 = pid_m * BLOCK_M
        n0 = pid_n * (HALVES * BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if HALVES == 2:
            acc_hi = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if RECOMPUTE:
            acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_steps):
            k0 = kk * BLOCK_K
            d = load_2d(d_src, row0, k0, num_rows, H, stride_dm, 1, BLOCK_M, BLOCK_K, D_TMA)
            w = load_3d(w2_src, e, k0, n0, H, I, stride_w2e, stride_w2h, stride_w2i, BLOCK_K, BLOCK_N, W2_TMA)
            acc = tl.dot(d, w, acc, input_precision=DOT_PRECISION)
            if HALVES == 2:
                w = load_3d(w2_src, e, k0, n0 + BLOCK_N, H, I, stride_w2e, stride_w2h, stride_w2i, BLOCK_K, BLOCK_N,
                            W2_TMA)
                acc_hi = tl.dot(d, w, acc_hi, input_precision=DOT_PRECISION)
            if RECOMPUTE:
                x = load_2d(x_src, row0, k0, num_rows, H, stride_xm, 1, BLOCK_M, BLOCK_K, X_TMA)
                wg = load_3d(w13_src, e, n0, k0, 2 * I, H, stride_w13e, stride_w13n, stride_w13h, BLOCK_N, BLOCK_K,
                             W13_TMA)
                wu = load_3d(w13_src, e, I + n0, k0, 2 * I, H, stride_w13e, stride_w13n, stride_w13h, BLOCK_N,
                             BLOCK_K, W13_TMA)
                acc_g = tl.dot(x, tl.trans(wg), acc_g, input_precision=DOT_PRECISION)
                acc_u = tl.dot(x, tl.trans(wu), acc_u, input_precision=DOT_PRECISION)
        wt = tl.load(tw_ptr + tok.to(tl.int64) * stride_twt + (slot - tok * top_k) * stride_twk, mask=live,
                     other=0.0).to(tl.float32)
        if RECOMPUTE:
            # Gate columns past I read up rows of w13: zero them so they add nothing to <dY, y>.
            col_ok = ((n0 + tl.arange(0, BLOCK_N)) < I)[None, :]
            g = tl.where(col_ok, acc_g, 0.0)
            u = tl.where(col_ok, acc_u, 0.0)
        else:
            g = load_2d(g_src, row0, n0, num_rows, I, stride_pm, 1, BLOCK_M, BLOCK_N, PG_TMA).to(tl.float32)
            u = load_2d(u_src, row0, n0, num_rows, I, stride_pm, 1, BLOCK_M, BLOCK_N, PU_TMA).to(tl.float32)
        dg, du, yw, part = _dgate_up_epilogue(acc, g, u, wt, ACT)
        store_2d(y_dst, yw.to(y_ptr.dtype.element_ty), row0, n0, num_rows, I, stride_ym, 1, BLOCK_M, BLOCK_N, Y_TMA)
        store_2d(dg_dst, dg.to(dg_ptr.dtype.element_ty), row0, n0, num_rows, I, stride_gm, 1, BLOCK_M, BLOCK_N,
                 DG_TMA)
        store_2d(du_dst, du.to(du_ptr.dtype.element_ty), row0, n0, num_rows, I, stride_gm, 1, BLOCK_M, BLOCK_N,
                 DU_TMA)
        if HALVES == 2:
            n1 = n0 + BLOCK_N
            g = load_2d(g_src, row0, n1, num_rows, I, stride_pm, 1, BLOCK_M, BLOCK_N, PG_TMA).to(tl.float32)
            u = load_2d(u_src, row0, n1, num_rows, I, stride_pm, 1, BLOCK_M, BLOCK_N, PU_TMA).to(tl.float32)
            dg, du, yw, part_hi = _dgate_up_epilogue(acc_hi, g, u, wt, ACT)
            part += part_hi
            store_2d(y_dst, yw.to(y_ptr.dtype.element_ty), row0, n1, num_rows, I, stride_ym, 1, BLOCK_M, BLOCK_N,
                     Y_TMA)
            store_2d(dg_dst, dg.to(dg_ptr.dtype.element_ty), row0, n1, num_rows, I, stride_gm, 1, BLOCK_M, BLOCK_N,
                     DG_TMA)
            store_2d(du_dst, du.to(du_ptr.dtype.element_ty), row0, n1, num_rows, I, stride_gm, 1, BLOCK_M, BLOCK_N,
                     DU_TMA)
        rows = row0 + tl.arange(0, BLOCK_M)
        tl.store(part_ptr + pid_n.to(tl.int64) * num_rows + rows, part, mask=rows < num_rows)


@triton.jit(do_not_specialize=["num_rows", "num_slots", "top_k"])
def _topk_weight_grad_kernel(
    part_ptr,         # [num_n, num_rows] fp32 partial <dY, y> per column tile
    slots_ptr,        # [num_rows] int32 sorted slots (sentinel num_slots in padding)
    num_blocks_ptr,   # [1] int32 live blocks
    dtw_ptr,          # [T, top_k] out (zero-filled: dropped slots keep 0), any float dtype
    num_rows, num_slots, top_k, stride_dt, stride_dk,
    NUM_N: tl.constexpr, ROWS_PER_BLOCK: tl.constexpr, BLOCK: tl.constexpr,
):
    """d_tw[t, j] = sum over the NUM_N column tiles of the partials of the row holding slot t*k + j, in
    order (deterministic). Grid (cdiv(num_rows, BLOCK),); rows past the live blocks are skipped."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < tl.load(num_blocks_ptr) * ROWS_PER_BLOCK
    slot = tl.load(slots_ptr + rows, mask=ok, other=num_slots)
    live = ok & (slot < num_slots)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for n in range(0, NUM_N):
        acc += tl.load(part_ptr + tl.cast(n, tl.int64) * num_rows + rows, mask=live, other=0.0)
    tok = slot // top_k
    ptrs = dtw_ptr + tok.to(tl.int64) * stride_dt + (slot - tok * top_k) * stride_dk
    tl.store(ptrs, acc.to(dtw_ptr.dtype.element_ty), mask=live)


@triton.jit(do_not_specialize=["E", "num_rows"])
def _expert_wgrad_kernel(
    a_ptr,            # [num_rows, M] sorted rows (unit inner stride)
    b_ptr,            # [num_rows, N] sorted rows (unit inner stride)
    out_ptr,          # [E, M, N] out (weight dtype), every element written once
    offsets_ptr,      # [E + 1] int32 first sorted row of each expert (multiples of the plan's block_m)
    E, M, N, num_rows, stride_a, stride_b, stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, O_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
):
    """Per-expert weight gradient out[e] = sum over expert e's sorted rows r of A[r]^T B[r] (M x N), a
    "k-grouped" GEMM: K = the expert's own row count, read from ``offsets`` on the device.
    d_w13: A = [dG, dU] (M = 2I), B = Xs (N = H); d_w2: A = Ds (M = H), B = Yw (N = I).

    Persistent grid (<= NUM_PROGRAMS,) over (expert, BLOCK_M x BLOCK_N) tiles, expert-major (the tiles of one
    expert run together and share its rows in L2). Each tile sums its expert's rows in fp32 registers and is
    stored once: deterministic, no atomics, and an expert without tokens gets exact zeros. BLOCK_K divides the
    plan's block_m, so a K step never crosses into the next expert; padding rows are zero in both operands."""
    a_src = tile_source_2d(a_ptr, num_rows, M, stride_a, BLOCK_K, BLOCK_M, A_TMA)
    b_src = tile_source_2d(b_ptr, num_rows, N, stride_b, BLOCK_K, BLOCK_N, B_TMA)
    o_dst = tile_source_3d(out_ptr, E, M, N, stride_oe, stride_om, BLOCK_M, BLOCK_N, O_TMA)
    num_mt = tl.cdiv(M, BLOCK_M)
    num_nt = tl.cdiv(N, BLOCK_N)
    per_e = num_mt * num_nt
    for tile in tl.range(tl.program_id(0), E * per_e, NUM_PROGRAMS, flatten=FLATTEN):
        e = tile // per_e
        pid_m, pid_n = grouped_tile(tile - e * per_e, num_mt, num_nt, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        r_begin = tl.load(offsets_ptr + e)
        k_steps = (tl.load(offsets_ptr + e + 1) - r_begin) // BLOCK_K
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, k_steps):  # a zero-based trip count, like every K loop here: FLATTEN pipelines it
            r0 = r_begin + kk * BLOCK_K
            a = load_2d(a_src, r0, m0, num_rows, M, stride_a, 1, BLOCK_K, BLOCK_M, A_TMA)
            b = load_2d(b_src, r0, n0, num_rows, N, stride_b, 1, BLOCK_K, BLOCK_N, B_TMA)
            acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
        # With TMA the store is asynchronous: it drains while the next tile's loads are in flight.
        store_3d(o_dst, acc.to(out_ptr.dtype.element_ty), e, m0, n0, M, N, stride_oe, stride_om, stride_on,
                 BLOCK_M, BLOCK_N, O_TMA)
