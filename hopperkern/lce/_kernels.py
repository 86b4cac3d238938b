"""Triton kernels of the fused linear cross-entropy (LCE).

Letters: ``N`` tokens, ``H`` hidden, ``V`` vocab. As a GEMM the logits are ``[N, V] = h[N, H] @ w[V, H]^T``
(GEMM M = N, N = V, K = H); ``BLOCK_N`` tiles tokens, ``BLOCK_V`` the vocab and ``BLOCK_K`` the hidden dim.
Final logits ``z = softcap * tanh((h @ w^T + b) / softcap) / temperature`` (softcap optional).

Each kernel has ONE body for both memory paths: operands come from :mod:`hopperkern.tma.jit` helpers that
take a descriptor or a pointer depending on a ``*_TMA`` constexpr.
"""

import triton
import triton.language as tl

from ..tma.jit import grouped_tile, load_2d, load_rows, log_approx, store_2d, tile_source_2d


@triton.jit
def _tanh(x, SOFTCAP: tl.constexpr):
    """tanh through exp (libdevice calls do not run in the interpreter); saturates correctly at +-inf. Near 0,
    1 - 2 / (e^2x + 1) cancels: its absolute error stays ~1e-7, so the final logit softcap * tanh is off by ~1e-7 x
    softcap. SOFTCAP == 2 (softcaps above ``launch.EXACT_TANH_SOFTCAP``) takes |x| < 0.5 from tanh's odd Taylor
    series to x^15 instead: within 4 ulp of tanh everywhere (measured in fp32 against fp64)."""
    t = 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)
    if SOFTCAP == 2:
        x2 = x * x
        p = -929569.0 / 638512875.0
        p = p * x2 + 21844.0 / 6081075.0
        p = p * x2 - 1382.0 / 155925.0
        p = p * x2 + 62.0 / 2835.0
        p = p * x2 - 17.0 / 315.0
        p = p * x2 + 2.0 / 15.0
        p = p * x2 - 1.0 / 3.0
        t = tl.where(tl.abs(x) < 0.5, x + x * x2 * p, t)
    return t


@triton.jit
def _logits_tile(h_src, w_src, b_ptr, row0, col0, N, V, H, stride_hn, stride_hk, stride_wv, stride_wk,
                 softcap, inv_temp,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, H_TMA: tl.constexpr, W_TMA: tl.constexpr,
                 DOT_PRECISION: tl.constexpr):
    """fp32 logits z of rows row0.. and vocab columns col0.. (columns >= V hold garbage-free finite values:
    both paths read zero weights there; callers mask them)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        # Hidden tail (k >= H) reads zeros on both paths: adds nothing.
        h = load_2d(h_src, row0, k * BLOCK_K, N, H, stride_hn, stride_hk, BLOCK_N, BLOCK_K, H_TMA)
        w = load_2d(w_src, col0, k * BLOCK_K, V, H, stride_wv, stride_wk, BLOCK_V, BLOCK_K, W_TMA)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
    cols = col0 + tl.arange(0, BLOCK_V)
    return _final_logits(acc, b_ptr, cols, cols < V, softcap, inv_temp, HAS_BIAS, SOFTCAP)


@triton.jit
def _final_logits(acc, b_ptr, cols, col_ok, softcap, inv_temp, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """The final logits of a tile of dot products ``acc`` [R, C] whose column c belongs to vocab row ``cols[c]``:
    + bias, softcap, / temperature. One body for the forward's tiles and lce_label_mma_kernel's, so both round
    every step the same way."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if SOFTCAP:
        acc = softcap * _tanh(acc / softcap, SOFTCAP)
    return acc * inv_temp


@triton.jit
def _exp_sums(e, zv, m_new, NEED_T: tl.constexpr):
    """Per row of a tile of e = exp(z - m_new): (sum e, sum e (z - m_new)), the second 0 without NEED_T. ``zv``:
    the logits with a vocab tail's masked columns (e = 0 there) at a finite value."""
    tile_s = tl.sum(e, 1)
    tile_t = tl.zeros_like(tile_s)
    if NEED_T:
        tile_t = tl.sum(e * (zv - m_new[:, None]), 1)
    return tile_s, tile_t


@triton.jit
def _tile_stats(z, m, c_ref, labels, col0, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, NEED_T: tl.constexpr,
                NEED_SUMZ: tl.constexpr, PICK_LABEL: tl.constexpr, LABEL_OUT: tl.constexpr, E_REF: tl.constexpr,
                E_CLAMP: tl.constexpr):
    """One vocab tile's part of lce_forward_kernel's statistics: (m_new, e = exp(z - m_new), sum e,
    sum e (z - m_new), the label's logit where the tile holds it, sum z) of the tile's logits ``z``, finite."""
    if E_REF:
        m_new = tl.maximum(m, tl.maximum(tl.max(z, 1) - E_CLAMP, c_ref))  # the sum's reference r (see the kernel)
    else:
        m_new = tl.maximum(m, tl.max(z, 1))
    e = tl.exp(z - m_new[:, None])
    picked = tl.zeros((BLOCK_N,), tl.float32)
    if PICK_LABEL:
        # Only the tiles that hold a row's label pay for the compare-select-sum (at 128 rows and 256-column
        # tiles over V = 128256, about one tile in four): a row-vector test decides for the whole tile.
        # (The branches yield fresh values, not the loop-carried zl, s, t: triton 3.6's nested-loop fusion
        # rejects an scf.if that yields a value carried by the flattened loop.)
        local = labels - col0
        if tl.max(((local >= 0) & (local < BLOCK_V)).to(tl.int32), 0) != 0:
            hit = tl.arange(0, BLOCK_V)[None, :] == local[:, None]
            picked = tl.sum(tl.where(hit, z, 0.0), 1)
            if LABEL_OUT:
                tile_s, tile_t = _exp_sums(tl.where(hit, 0.0, e), z, m_new, NEED_T)
            else:
                tile_s, tile_t = _exp_sums(e, z, m_new, NEED_T)
        else:
            tile_s, tile_t = _exp_sums(e, z, m_new, NEED_T)
    else:
        tile_s, tile_t = _exp_sums(e, z, m_new, NEED_T)
    tile_sumz = tl.zeros((BLOCK_N,), tl.float32)
    if NEED_SUMZ:
        tile_sumz = tl.sum(z, 1)
    return m_new, e, tile_s, tile_t, picked, tile_sumz


@triton.jit
def lce_forward_kernel(
    h_ptr,  # [N, H] fp16/bf16/fp32
    w_ptr,  # [V, H] same dtype
    b_ptr,  # [V] or dummy
    labels_ptr,  # [N] int
    m_ptr, s_ptr, t_ptr, sumz_ptr,  # [S, N] fp32 per-split running max m, sum exp(z-m), sum exp(z-m)(z-m), sum z
    #                                 (s and t without the label's own term with LABEL_OUT)
    zl_ptr,  # [S, N] fp32 the label's logit where this split holds the label, else 0
    z_ptr,  # [N, ld_z] out: fp32 final logits (STORE_Z), or exp(z - running max) in the inputs' dtype (STORE_E)
    mt_ptr,  # [N, ld_mt] fp32 out (STORE_E): the running max of row n after vocab tile vt, at [n, vt];
    #          with E_REF, [N] fp32 in: each row's reference logit r (c = r + E_OFFSET, see below)
    N, V, H, S, tiles_per_split,
    stride_hn, stride_hk, stride_wv, stride_wk, stride_zn, stride_mt,
    softcap, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, NEED_T: tl.constexpr, NEED_SUMZ: tl.constexpr,
    FLATTEN: tl.constexpr, H_TMA: tl.constexpr, W_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PICK_LABEL: tl.constexpr, STORE_Z: tl.constexpr = False, STORE_E: tl.constexpr = False,
    E_TMA: tl.constexpr = False, E_REF: tl.constexpr = False, E_OFFSET: tl.constexpr = 0.0,
    E_CLAMP: tl.constexpr = 0.0, LABEL_OUT: tl.constexpr = False,
):
    """Per-split online log-sum-exp statistics.

    Grid (cdiv(N, BLOCK_N) * S,); one program = one row block x one vocab split of ``tiles_per_split``
    BLOCK_V tiles, keeping m/s/t/sumz in registers across its tiles. Programs are ordered GROUP_N row blocks
    per split sweep (see ``hopperkern.tma.jit.grouped_tile``).

    NEED_T: t = sum exp(z - m) (z - m) against the same reference m as s, not sum exp(z - m) z: the entropy is then
    log s - t / s (lce_combine_kernel), a sum of small terms, where lse - (sum e z) / s would be the difference of
    two numbers of the logits' size, each rounded to its ulp (~4e-6 at 50), more than all of a confident
    prediction's entropy.

    PICK_LABEL (when a backward will follow, where lce_label_mma_kernel does not stand in: tiles narrower than
    128 x 256, the interpreter, fp32 inputs, GPUs other than Hopper): the label's logit is picked from the same
    tiles that feed the log-sum-exp (a compare-select-sum per tile): log p = z_label - lse is then the difference
    of two numbers with the same rounding of the logits, and for a confident prediction p - 1 (the whole gradient
    at the label) keeps its precision. A label logit from a separate fp32 dot product (lce_label_logit_kernel, the
    no-grad path) differs from the tile's by the fp32 summation error (~1e-6): harmless in log p itself, but a
    relative error of ~1e-6 / (1 - p) in p - 1, 1 % at p = 0.9999, more than one bf16 rounding.

    LABEL_OUT (with PICK_LABEL): the tile that holds a row's label column (any label in [0, V), an ignored token's
    too) sums every column but the label's into s and t; lce_combine_kernel adds exp(z_label - m) back in fp64.
    For a confident prediction s = 1 + (1 - p) / p: summed in fp32 with the label's 1 in it, the rounding of s near
    1 (~1e-7, a few of them over a tile's tree sum) would be all the precision 1 - p, the loss and p - 1 keep;
    without it they keep the sum's relative precision.
    lce_label_mma_kernel gives the tile's own value without touching the tiles: at 128 x 256 tiles on sm_90 the
    pick (in the tiles that hold a label of their rows) takes the forward from 173-191 registers per thread
    without spills to 255 with 332-636 bytes of spills, and 8-11 % of its time on the H200.

    STORE_Z (the 3-pass SFT path with softcap, :mod:`hopperkern.lce.sft`): every tile's final fp32 logits are
    also written to ``z`` (columns >= V clipped), from which lce_sft_dlogits_kernel forms d(logits) once the LSE
    is known.

    STORE_E (the 3-pass SFT path without softcap, and the 3-pass path of log-probs and entropies,
    :mod:`hopperkern.lce.rl`): every tile's e = exp(z - m), the exponentials the running sum takes anyway, with m
    the row's running max after this tile, is written to ``z`` in its dtype (the inputs': bf16 keeps 8 bits of e
    in [1e-38, 1], a relative error of 2^-9 at every size), and m to ``mt[n, vt]``. Then p = e exp(m - lse) once
    the LSE is known (lce_exp_dlogits_kernel, in place): 2 bytes per logit each way, and
    the tile of 16-bit values is staged through shared memory at the forward's own tiling (an fp32 tile at
    128 x 256 would not fit beside the operand pipeline).

    STORE_E with E_REF (the 3-pass SFT path without softcap): e = exp(z - c) with one reference c = r + E_OFFSET per
    row known before the forward (r: the label's logit), so that p = e exp(c - lse) with ONE factor per row and
    d(logits) is a row scaling of e that the gradient GEMMs can apply to their small operands
    (:mod:`hopperkern.lce.sft`). The running sum itself takes r = max(c, m - E_CLAMP) as its reference in place
    of the running max m, so the exponentials it sums are the stored ones (no second exp, no rescaling): r = c
    on every row whose logits stay within c + E_CLAMP, and every stored value stays finite (at most
    exp(E_CLAMP)); a row whose logits exceed c + E_CLAMP (the caller flags it from its LSE) is formed again by
    other means. The statistics then hold r for m (lse = r + log s); s > 0 on every kept row with a label in
    [0, V), since its largest logit M gives exp(M - r) >= exp(-E_OFFSET).
    """
    tl.static_assert(not (STORE_Z and STORE_E), "one of STORE_Z and STORE_E")
    pid = tl.program_id(0)
    rb, split = grouped_tile(pid, tl.cdiv(N, BLOCK_N), S, GROUP_N)
    row0 = rb * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N

    h_src = tile_source_2d(h_ptr, N, H, stride_hn, BLOCK_N, BLOCK_K, H_TMA)
    w_src = tile_source_2d(w_ptr, V, H, stride_wv, BLOCK_V, BLOCK_K, W_TMA)
    if STORE_E:
        e_dst = tile_source_2d(z_ptr, N, V, stride_zn, BLOCK_N, BLOCK_V, E_TMA)

    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    t = tl.zeros((BLOCK_N,), tl.float32)
    sumz = tl.zeros((BLOCK_N,), tl.float32)
    zl = tl.zeros((BLOCK_N,), tl.float32)
    c_ref = tl.zeros((BLOCK_N,), tl.float32)  # (read only with E_REF, labels only with PICK_LABEL)
    labels = tl.zeros((BLOCK_N,), tl.int32)
    if E_REF:
        c_ref = tl.load(mt_ptr + rows, mask=row_ok, other=0.0) + E_OFFSET
    if PICK_LABEL:
        # An ignored or out-of-range label picks nothing that matters: the combine kernel turns a label outside
        # [0, V) into NaN. So the labels can be narrowed to int32 (fewer registers in the hot loop). A label outside
        # [0, V) (another vocab shard's, for stats_only) picks 0: it is mapped to -1, held by no tile (the vocab
        # tail's columns >= V hold finite stand-ins, not logits).
        labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
        labels = tl.where((labels >= 0) & (labels < V), labels, -1).to(tl.int32)
    num_vt = tl.cdiv(V, BLOCK_V)
    vt_begin = split * tiles_per_split
    vt_end = tl.minimum(vt_begin + tiles_per_split, num_vt)
    for vt in tl.range(vt_begin, vt_end, flatten=FLATTEN):
        col0 = vt * BLOCK_V
        z = _logits_tile(h_src, w_src, b_ptr, row0, col0, N, V, H, stride_hn, stride_hk, stride_wv, stride_wk,
                         softcap, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, HAS_BIAS, SOFTCAP, H_TMA, W_TMA,
                         DOT_PRECISION)
        if STORE_Z:
            # Pointer stores on both paths: a TMA store would stage the fp32 tile in shared memory (128 KB at
            # 128 x 256), beside the operand pipeline's stages, over the sm_90 limit of 227 KB.
            store_2d(z_ptr, z, row0, col0, N, V, stride_zn, 1, BLOCK_N, BLOCK_V, False)
        # The statistics of the vocab tail's tile and of a full tile are formed inside the branches, so that only
        # fresh row vectors and one tile (e) leave them: a branch that yielded the logits twice (masked for the max
        # and the exponentials, zeroed for the sums) kept two tiles live across the join (255 registers and
        # spills at 128 x 256 on sm_90).
        if col0 + BLOCK_V > V:
            # Vocab tail: TMA pads with zeros, which would be logits of 0 (verl #2656). The columns >= V are left
            # out of the sum of logits and take a finite value at least 200 below every kept logit of their row
            # (200 + E_CLAMP with E_REF, whose reference may sit E_CLAMP below them): their exponential is exactly
            # 0 in fp32 and adds nothing to s or t (0 times a finite z - m). One tile stays live, where a -inf mask
            # for the exponentials and a 0 mask for the sums would keep two.
            col_ok = (col0 + tl.arange(0, BLOCK_V))[None, :] < V
            tail_sumz = tl.zeros((BLOCK_N,), tl.float32)
            if NEED_SUMZ:
                tail_sumz = tl.sum(tl.where(col_ok, z, 0.0), 1)
            row_max = tl.max(tl.where(col_ok, z, float("-inf")), 1)
            z = tl.where(col_ok, z, (-2.0 * tl.abs(row_max) - (200.0 + E_CLAMP))[:, None])
            m_new, e, tile_s, tile_t, picked, tile_sumz = _tile_stats(
                z, m, c_ref, labels, col0, BLOCK_N, BLOCK_V, NEED_T, False, PICK_LABEL, LABEL_OUT, E_REF, E_CLAMP)
            tile_sumz = tail_sumz
        else:
            m_new, e, tile_s, tile_t, picked, tile_sumz = _tile_stats(
                z, m, c_ref, labels, col0, BLOCK_N, BLOCK_V, NEED_T, NEED_SUMZ, PICK_LABEL, LABEL_OUT, E_REF,
                E_CLAMP)
        alpha = tl.exp(m - m_new)
        if PICK_LABEL:
            zl += picked
        if NEED_T:
            # t = sum e (z - m) against the sum's own reference m (see the docstring): moving the reference from m
            # to m_new adds (m - m_new) s to the old terms; s = 0 (no tile yet, m = -inf) adds nothing.
            t = (t + tl.where(s > 0.0, m - m_new, 0.0) * s) * alpha + tile_t
        s = s * alpha + tile_s
        if STORE_E:
            # Columns >= V (e = 0 there) and rows >= N are clipped by the store on both paths.
            store_2d(e_dst, e.to(z_ptr.dtype.element_ty), row0, col0, N, V, stride_zn, 1, BLOCK_N, BLOCK_V, E_TMA)
            if not E_REF:
                tl.store(mt_ptr + rows.to(tl.int64) * stride_mt + vt, m_new, mask=row_ok)
        if NEED_SUMZ:
            sumz += tile_sumz
        m = m_new

    out = split.to(tl.int64) * N + rows
    if PICK_LABEL:
        tl.store(zl_ptr + out, zl, mask=row_ok)
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(s_ptr + out, s, mask=row_ok)
    if NEED_T:
        tl.store(t_ptr + out, t, mask=row_ok)
    if NEED_SUMZ:
        tl.store(sumz_ptr + out, sumz, mask=row_ok)


@triton.jit
def lce_label_logit_kernel(
    h_ptr,  # [N, H]
    w_ptr,  # [V, H]
    b_ptr,  # [V] or dummy
    labels_ptr,  # [N] int
    zlab_ptr,  # [N] fp32 out: final logit z of the label (0 where the label is ignored or out of range)
    N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, softcap, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """z[n, label[n]] as a row-wise dot of h[n] with the gathered row w[label[n]]. Grid (cdiv(N, BLOCK_N),).

    O(N*H) work, against O(N*V*H) for the logits. A forward that a backward follows needs the tiles' own value
    instead (lce_label_mma_kernel, or the forward kernel's PICK_LABEL; see lce_forward_kernel)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
    lab_ok = row_ok & (labels >= 0) & (labels < V)
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        h = load_rows(h_ptr, rows, row_ok, k * BLOCK_K, H, stride_hn, stride_hk, BLOCK_K, False)
        w = load_rows(w_ptr, labels, lab_ok, k * BLOCK_K, H, stride_wv, stride_wk, BLOCK_K, False)
        acc += tl.sum(h.to(tl.float32) * w.to(tl.float32), 1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + labels, mask=lab_ok, other=0.0).to(tl.float32)
    if SOFTCAP:
        acc = softcap * _tanh(acc / softcap, SOFTCAP)
    tl.store(zlab_ptr + rows, tl.where(lab_ok, acc * inv_temp, 0.0), mask=row_ok)


@triton.jit
def lce_label_mma_kernel(
    h_ptr,  # [N, H] fp16/bf16
    w_ptr,  # [V, H] same dtype
    b_ptr,  # [V] or dummy
    labels_ptr,  # [N] int
    zlab_ptr,  # [N] fp32 out: final logit z of the label (0 where the label is ignored or outside [0, V))
    N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, softcap, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    H_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """z[n, label[n]] for a forward that a backward follows, bit for bit the logit lce_forward_kernel's tiles give
    that entry (16-bit inputs on the GPU). Grid (cdiv(N, BLOCK_N),).

    One program takes BLOCK_N rows and the BLOCK_N weight rows of their labels (gathered) and runs the same
    tensor-core products as the forward's tiles: a [BLOCK_N, BLOCK_N] tile of h . w[label] over the whole hidden
    size in the same K order with fp32 accumulation, then :func:`_final_logits`; row r keeps its diagonal entry.
    A tensor-core product of one entry depends on that entry's row and column alone, not on the tile around it,
    so the result equals the forward's own logit (the GPU tests check this bitwise), and log p = z_label - lse
    keeps the precision of a confident prediction's p - 1. It stands in for the in-tile pick (PICK_LABEL) at wide
    tiles, where the pick's compare-select-sum raises the forward's register use over sm_90's 255 per thread
    (see hopperkern.lce.launch.label_by_mma). The work is O(N * BLOCK_N * H), 1 / (V / BLOCK_N) of the forward's;
    the loop over H is serial (splitting it would change the order of the sums)."""
    row0 = tl.program_id(0) * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    lab_ok = row_ok & (labels >= 0) & (labels < V)  # in the labels' dtype: narrowing first could wrap
    labels = tl.where(lab_ok, labels, 0)
    h_src = tile_source_2d(h_ptr, N, H, stride_hn, BLOCK_N, BLOCK_K, H_TMA)
    acc = tl.zeros((BLOCK_N, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        # Hidden tail (k >= H) reads zeros from both operands, as in _logits_tile.
        h = load_2d(h_src, row0, k * BLOCK_K, N, H, stride_hn, stride_hk, BLOCK_N, BLOCK_K, H_TMA)
        w = load_rows(w_ptr, labels, lab_ok, k * BLOCK_K, H, stride_wv, stride_wk, BLOCK_K, False)
        acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
    z = _final_logits(acc, b_ptr, labels, lab_ok, softcap, inv_temp, HAS_BIAS, SOFTCAP)
    diag = tl.arange(0, BLOCK_N)[:, None] == tl.arange(0, BLOCK_N)[None, :]
    zlab = tl.sum(tl.where(diag, z, 0.0), 1)
    tl.store(zlab_ptr + rows, tl.where(lab_ok, zlab, 0.0), mask=row_ok)


@triton.jit
def lce_combine_kernel(
    m_ptr, s_ptr, t_ptr, sumz_ptr,  # [S, N] fp32 partial statistics (lce_forward_kernel's)
    zl_ptr,  # [S_ZL, N] fp32 label logit: per split (0 where the split lacks it), or one row from a label kernel
    labels_ptr,  # [N] int
    loss_ptr, logprob_ptr, entropy_ptr,  # [N] fp32 outputs
    lse_ptr,  # [N] fp64 (or fp32) output: the LSE, kept to fp64 for the backward's z - lse (see _load_lse)
    N, V, S, S_ZL, ignore_index, label_smoothing, z_loss,
    BLOCK: tl.constexpr, NEED_T: tl.constexpr, NEED_SUMZ: tl.constexpr, LABEL_OUT: tl.constexpr = False,
):
    """Merge the S splits into per-token loss, log-prob, entropy and LSE. Grid (cdiv(N, BLOCK),).

    loss = lse - (1-eps) z_label - eps/V sum(z) + z_loss lse^2 on kept tokens (0 on ignored ones);
    logprob = z_label - lse on kept tokens (formed without rounding lse first, see below); entropy = lse - E_p[z]
    on all tokens (0 without NEED_T). A label outside [0, V) that is not ignore_index makes all four NaN for its
    token. LABEL_OUT: the splits' s and t lack the label's own term (lce_forward_kernel's LABEL_OUT), added here.
    """
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < N
    mx = tl.full((BLOCK,), float("-inf"), tl.float32)
    for sp in range(0, S):
        mx = tl.maximum(mx, tl.load(m_ptr + sp * N + rows, mask=ok, other=0.0))
    s_tot = tl.zeros((BLOCK,), tl.float32)
    t_tot = tl.zeros((BLOCK,), tl.float32)
    sz_tot = tl.zeros((BLOCK,), tl.float32)
    zlab = tl.zeros((BLOCK,), tl.float32)
    for sp in range(0, S_ZL):  # exact: one split holds the label, the rest add 0
        zlab += tl.load(zl_ptr + sp * N + rows, mask=ok, other=0.0)
    for sp in range(0, S):
        idx = sp * N + rows
        m_sp = tl.load(m_ptr + idx, mask=ok, other=0.0)
        s_sp = tl.load(s_ptr + idx, mask=ok, other=0.0)
        scale = tl.exp(m_sp - mx)
        s_tot += scale * s_sp
        if NEED_T:
            # Each split's t is taken against its own m: against mx it is t + (m - mx) s (an empty split, s = 0
            # and m = -inf, adds nothing).
            t_sp = tl.load(t_ptr + idx, mask=ok, other=0.0) + tl.where(s_sp > 0.0, m_sp - mx, 0.0) * s_sp
            t_tot += scale * t_sp
        if NEED_SUMZ:
            sz_tot += tl.load(sumz_ptr + idx, mask=ok, other=0.0)
    labels = tl.load(labels_ptr + rows, mask=ok, other=ignore_index).to(tl.int64)
    kept = labels != ignore_index
    bad = kept & ((labels < 0) | (labels >= V))
    # From here in fp64 (O(N) work): log p = z_label - lse is formed without lse, which is rounded to its own ulp
    # (~4e-6 at 46), all of 1 - p for a confident prediction, as (z_label - mx) - log s. With LABEL_OUT the sum s
    # adds the label's term exp(z_label - mx) (1 where the label holds the max) to the others' sum in fp64, so that
    # log s, 1 - p and the entropy keep the others' relative precision, not the fp32 rounding of s near 1.
    dl = zlab.to(tl.float64) - mx.to(tl.float64)
    s64 = s_tot.to(tl.float64)
    if NEED_T:
        t64 = t_tot.to(tl.float64)
    if LABEL_OUT:
        lab_term = tl.where((labels >= 0) & (labels < V), tl.exp(dl), 0.0)  # ignored or not, as the forward
        s64 += lab_term
        if NEED_T:
            t64 += lab_term * dl
    s_safe = tl.where(ok, s64, 1.0)
    log_s = tl.log(s_safe)
    lse64 = mx.to(tl.float64) + log_s
    lse = lse64.to(tl.float32)
    lp_all = tl.minimum(dl - log_s, 0.0).to(tl.float32)
    lp = tl.where(kept, lp_all, 0.0)
    # lse - (1 - eps) z_label - eps / V sum(z) = -(1 - eps) log p + eps (lse - sum(z) / V): two terms that are
    # +inf, never inf - inf, where a logit is -inf (a masked column; the label's, or any under smoothing)
    loss = -(1.0 - label_smoothing) * lp_all + z_loss * lse * lse
    if NEED_SUMZ:  # against the fp64 LSE, as the label's term -(1 - eps) log p (no rounding of the LSE in it)
        loss += label_smoothing * (lse64 - sz_tot.to(tl.float64) / V).to(tl.float32)
    loss = tl.where(kept, loss, 0.0)
    # A bad label poisons every output of its token, the LSE included, so a backward that reads it makes the
    # token's gradients NaN too (never a finite, plausible-looking wrong number).
    nan = float("nan")
    tl.store(loss_ptr + rows, tl.where(bad, nan, loss), mask=ok)
    tl.store(logprob_ptr + rows, tl.where(bad, nan, lp), mask=ok)
    tl.store(lse_ptr + rows, tl.where(bad, nan, lse64).to(lse_ptr.dtype.element_ty), mask=ok)
    if NEED_T:
        # entropy = lse - E_p[z] = log s - E_p[z - mx], t = s E_p[z - mx] (see lce_forward_kernel's NEED_T)
        tl.store(entropy_ptr + rows, tl.where(bad, nan, (log_s - t64 / s_safe).to(tl.float32)), mask=ok)
    else:
        tl.store(entropy_ptr + rows, tl.zeros((BLOCK,), tl.float32), mask=ok)


@triton.jit
def _load_lse(lse_ptr, rows, mask):
    """The forward's LSE of ``rows`` as an fp32 pair ``(hi, lo)``, hi + lo = lse: from an fp64 LSE (the forward's
    own, lce_combine_kernel) lo holds what fp32 rounds off (|lo| <= ulp(hi) / 2, ~2e-6 at 46), from an fp32 one lo
    is 0. z - lse is then taken as (z - hi) - lo: for a logit near the LSE (a confident prediction) z - hi is exact,
    and log p keeps its own precision instead of the LSE's rounding, which the entropy term p (entropy + log p)
    would otherwise carry in full (that sum is small where the prediction is confident). An infinite or NaN LSE
    gives lo = 0 (hi carries it)."""
    x = tl.load(lse_ptr + rows, mask=mask, other=0.0)
    hi = x.to(tl.float32)
    lo = (x - hi.to(x.dtype)).to(tl.float32)
    return hi, tl.where(tl.abs(lo) < 1.0, lo, 0.0)


@triton.jit
def _loss_coefficients(gl, lse, label_smoothing, z_loss, V_total):
    """The (A, C, D) terms of dz = p (A + B (z - lse)) + C [j == label] + D from an upstream gradient ``gl`` of the
    per-token loss (0 at ignored tokens): A = gl (1 + 2 z_loss lse), C = -gl (1 - eps), D = -gl eps / V_total."""
    return gl * (1.0 + 2.0 * z_loss * lse), -gl * (1.0 - label_smoothing), -gl * (label_smoothing / V_total)


@triton.jit
def _dz(p, z, zc, a_t, b_t, d_t, softcap, inv_temp, SOFTCAP: tl.constexpr):
    """d loss / d raw logit, in fp32: p (A + B (z - lse)) / T + D / T, times (1 - tanh^2) with softcap. ``a_t``,
    ``b_t``, ``d_t`` are A / T, B / T and the constant term / T (broadcast to p's shape by the caller); z is the
    final logit, so z T / softcap is the tanh, and zc = z - lse (log p). A logit of -inf (a -inf bias) has p = 0
    and zc = -inf: zc is clamped to -2^14 beside B, so its term is 0, never 0 * inf (a NaN p, from a NaN LSE,
    keeps its NaN); a clamp costs fewer registers than a select on p."""
    dz = p * (a_t + b_t * tl.maximum(zc, -16384.0)) + d_t
    if SOFTCAP:
        th = z / (softcap * inv_temp)
        dz = dz * (1.0 - th * th)
    return dz


@triton.jit
def _row_coefficients(rows, row_ok, labels_ptr, lse_ptr, ent_ptr, gl_ptr, gp_ptr, ge_ptr, gz_ptr, ignore_index,
                      label_smoothing, z_loss, V_total, BLOCK_N: tl.constexpr, HAS_GL: tl.constexpr,
                      HAS_GP: tl.constexpr, HAS_GE: tl.constexpr, HAS_GZ: tl.constexpr):
    """Per-token ``(labels, lse, lse_lo, A, B, A + C, C, D)`` of dz = p (A + B (z - lse)) + C [j == label] + D (see
    lce_dlogits_kernel), the LSE as :func:`_load_lse`'s pair (A takes its fp32 part). ``V_total`` is the size of the
    whole vocabulary, over which label smoothing spreads eps (a vocab shard's V is smaller). A + C, the label entry's
    constant beside (p - 1) (A + B log p), is formed from the terms that do not cancel (g_logprob and the loss
    gradient's 1 cancel exactly): as a + c in fp32 it would keep only ~1e-7 |g_logprob| of a confident prediction's
    g_entropy entropy term (~1e-5 g_entropy here). C is formed from its own terms too, not as (A + C) - A, which would
    keep ~ulp(g_entropy entropy) of it."""
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    kept = (labels != ignore_index).to(tl.float32)
    lse, lse_lo = _load_lse(lse_ptr, rows, row_ok)
    a = tl.zeros((BLOCK_N,), tl.float32)
    b = tl.zeros((BLOCK_N,), tl.float32)
    ac = tl.zeros((BLOCK_N,), tl.float32)
    c = tl.zeros((BLOCK_N,), tl.float32)
    d = tl.zeros((BLOCK_N,), tl.float32)
    if HAS_GL:
        gl = tl.load(gl_ptr + rows, mask=row_ok, other=0.0) * kept
        ga, gc, gd = _loss_coefficients(gl, lse, label_smoothing, z_loss, V_total)
        a += ga
        ac += gl * (label_smoothing + 2.0 * z_loss * lse)  # A + C = gl (1 + 2 z_loss lse) - gl (1 - eps)
        c += gc
        d += gd
    if HAS_GP:
        gp = tl.load(gp_ptr + rows, mask=row_ok, other=0.0) * kept
        a -= gp  # C += g_logprob: nothing in A + C
        c += gp
    if HAS_GE:
        # g_entropy p (E - z) = g_entropy p (-entropy - (z - lse)): no term of the logits' size to cancel
        ge = tl.load(ge_ptr + rows, mask=row_ok, other=0.0)
        ge_ent = ge * tl.load(ent_ptr + rows, mask=row_ok, other=0.0)
        a -= ge_ent
        ac -= ge_ent
        b -= ge
    if HAS_GZ:
        gz = tl.load(gz_ptr + rows, mask=row_ok, other=0.0)
        a += gz
        ac += gz
    return labels, lse, lse_lo, a, b, ac, c, d


@triton.jit
def lce_dlogits_kernel(
    h_ptr,  # [N, H]
    w_ptr,  # [V, H]
    b_ptr,  # [V] or dummy
    labels_ptr,  # [N] int
    lse_ptr, ent_ptr,  # [N] fp32 from the forward (ent only read when HAS_GE)
    gl_ptr, gp_ptr, ge_ptr, gz_ptr,  # [N] fp32 upstream grads of loss, logprob, entropy, lse (each optional)
    d_ptr,  # [N, ld_d] out: d loss / d (h @ w^T + b) for vocab columns col_begin .. col_begin + ncols
    N, V, V_total, H, col_begin, ncols,  # V: weight's rows; V_total: the whole vocabulary (> V for a vocab shard)
    stride_hn, stride_hk, stride_wv, stride_wk, stride_dn,
    ignore_index, label_smoothing, z_loss, softcap, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_N: tl.constexpr,
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_GL: tl.constexpr, HAS_GP: tl.constexpr, HAS_GE: tl.constexpr, HAS_GZ: tl.constexpr,
    NUM_PROGRAMS: tl.constexpr, FLATTEN: tl.constexpr,
    H_TMA: tl.constexpr, W_TMA: tl.constexpr, D_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Gradient w.r.t. the raw logits of one vocab slice, recomputed tile by tile, WITHOUT the one-hot term.

    Persistent grid (NUM_PROGRAMS,); each program loops over [BLOCK_N, BLOCK_V] tiles pid, pid + NUM_PROGRAMS,
    ... in grouped order. With p the
    softmax of z and E = E_p[z] = lse - entropy, the gradient w.r.t. z is
        dz = p * (A + B (z - lse)) + C [j == label] + D,
        A = kept (g_loss (1 + 2 z_loss lse) - g_logprob) - g_entropy entropy + g_lse,   B = -g_entropy,
        C = kept (g_logprob - g_loss (1 - eps)),                           D = -kept g_loss eps / V_total,
    then d raw = dz / temperature * (1 - tanh^2) (the tanh factor only with softcap), formed in fp32 and rounded
    once to d's dtype. The C term touches one column per row: rather than a compare-select in every tile, the label
    column gets p (A + B (z - lse)) + D here and lce_onehot_kernel overwrites it afterwards (when C can be
    nonzero). The entropy term p (E - z) is taken as -p (entropy + (z - lse)): z - lse is the exponent p needs anyway,
    and no two numbers of the logits' size cancel (g_entropy E - g_entropy z would lose ~ulp(lse) of a confident
    prediction's E - z). z - lse itself is (z - hi) - lo against the fp64 LSE's pair (:func:`_load_lse`): one fp32
    LSE would put its rounding (~ulp(lse) / 2) into log p of every column, all of entropy + log p's precision at a
    confident class.
    """
    tl.static_assert(BLOCK_V >= 16 and BLOCK_N >= 16, "tl.dot needs tiles of at least 16")
    h_src = tile_source_2d(h_ptr, N, H, stride_hn, BLOCK_N, BLOCK_K, H_TMA)
    w_src = tile_source_2d(w_ptr, V, H, stride_wv, BLOCK_V, BLOCK_K, W_TMA)
    d_dst = tile_source_2d(d_ptr, N, ncols, stride_dn, BLOCK_N, BLOCK_V, D_TMA)
    num_rb = tl.cdiv(N, BLOCK_N)
    num_tiles = num_rb * tl.cdiv(ncols, BLOCK_V)
    # Persistent: NUM_PROGRAMS programs stride over the tiles; with FLATTEN the compiler pipelines the next
    # tile's loads under this tile's epilogue.
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        rb, vt = grouped_tile(tile, num_rb, tl.cdiv(ncols, BLOCK_V), GROUP_N)
        row0 = rb * BLOCK_N
        col0 = col_begin + vt * BLOCK_V
        rows = row0 + tl.arange(0, BLOCK_N)
        row_ok = rows < N
        z = _logits_tile(h_src, w_src, b_ptr, row0, col0, N, V, H, stride_hn, stride_hk, stride_wv, stride_wk,
                         softcap, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, HAS_BIAS, SOFTCAP, H_TMA, W_TMA,
                         DOT_PRECISION)
        _, lse, lse_lo, a, b, _ac, _c, d = _row_coefficients(rows, row_ok, labels_ptr, lse_ptr, ent_ptr, gl_ptr, gp_ptr,
                                                             ge_ptr, gz_ptr, ignore_index, label_smoothing, z_loss,
                                                             V_total, BLOCK_N, HAS_GL, HAS_GP, HAS_GE, HAS_GZ)
        # Fold 1/temperature into the per-row coefficients (one multiply per row, not per element).
        zc = (z - lse[:, None]) - lse_lo[:, None]
        dz = _dz(tl.exp(zc), z, zc, (a * inv_temp)[:, None], (b * inv_temp)[:, None], (d * inv_temp)[:, None],
                 softcap, inv_temp, SOFTCAP)
        # Columns >= ncols (and rows >= N) are clipped by the store on both paths.
        store_2d(d_dst, dz.to(d_ptr.dtype.element_ty), row0, vt * BLOCK_V, N, ncols, stride_dn, 1, BLOCK_N,
                 BLOCK_V, D_TMA)


@triton.jit
def _pm1(logp):
    """p - 1 = expm1(log p) of fp32 log-probs, formed in fp64 and rounded once to fp32: for a confident
    prediction the whole label gradient, which fp32's exp(log p) - 1 would round to a multiple of 2^-24."""
    return (tl.exp(logp.to(tl.float64)) - 1.0).to(tl.float32)


@triton.jit
def _label_entry(logp, b, ac, c):
    """``(p', k)`` such that the label entry p (A + B log p) + C is p' (A + B log p) + k, from the label's fp32
    log-prob: for a likely label (p >= 1/2) p' = p - 1 (:func:`_pm1`) and k = A + C + B log p, which a confident
    prediction needs (for a plain loss gradient A + C = 0 exactly and the entry is (p - 1) A from p - 1 itself);
    for an unlikely one p' = p and k = C, which keeps p (A + B log p) to its own precision where (p - 1) X + X would
    leave ~ulp(X) of it (an entropy gradient at a label of p ~ 1e-4: 1e-3 of the entry)."""
    likely = logp >= -0.6931471805599453
    e = tl.exp(logp.to(tl.float64))  # one exponential for both forms (as _pm1's, rounded once)
    return tl.where(likely, e - 1.0, e).to(tl.float32), tl.where(likely, ac + b * logp, c)


@triton.jit
def lce_onehot_kernel(
    labels_ptr, lse_ptr, ent_ptr, gl_ptr, gp_ptr, ge_ptr, gz_ptr,  # as in lce_dlogits_kernel
    logprob_ptr,  # [N] fp32 log p of the label from the forward (z_label - lse, formed once in fp32)
    d_ptr,  # [N, ld_d] the slice written by lce_dlogits_kernel; its label entries are overwritten
    N, V_total, col_begin, ncols, stride_dn, ignore_index, label_smoothing, z_loss, softcap, inv_temp,
    BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_GL: tl.constexpr, HAS_GP: tl.constexpr, HAS_GE: tl.constexpr, HAS_GZ: tl.constexpr,
):
    """Write the whole label entry d[n, label[n] - col_begin] = (p (A + B (z - lse)) + C + D) / temperature
    (* (1 - tanh^2) with softcap) of each kept token whose label lies in this slice, formed in fp32 from the
    forward's per-token statistics and rounded ONCE to d's dtype. Grid (cdiv(N, BLOCK_N),); one program = BLOCK_N
    rows, each touching at most one element.

    Why overwrite rather than add C to the entry that lce_dlogits_kernel stored: that entry is already rounded,
    and for a confident prediction (p -> 1, C = -g) round(p) - 1 keeps little or nothing of p - 1, the whole
    gradient at the label (the spacing just below 1 is 4.9e-4 in fp16, 3.9e-3 in bf16). p = exp(logprob) takes
    the forward's fp32 log-prob rather than exp(z - lse) of a re-added z, so p - 1 does not inherit the rounding
    of logprob + lse; z = logprob + lse only feeds the softcap factor, where its ~ulp(lse) error is harmless, and
    the entropy term takes z - lse = logprob itself. What remains is the log-prob's own error: lce_combine_kernel
    forms it as (z_label - m) - log s in fp64, not as z_label - lse (rounded to ulp(lse), ~4e-6 at 46, which can
    hold all of 1 - p). Where the forward picks the label in its tiles (lce_forward_kernel's LABEL_OUT) s is the
    other columns' fp32 sum plus the label's term in fp64, and 1 - p keeps the relative precision of that sum;
    elsewhere s is one fp32 sum near 1, whose rounding (~1e-7, as in PyTorch's fp32 softmax) is a relative error
    of ~1e-7 / (1 - p) in p - 1.
    """
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels, lse, _, a, b, ac, c, d = _row_coefficients(rows, row_ok, labels_ptr, lse_ptr, ent_ptr, gl_ptr, gp_ptr,
                                                    ge_ptr, gz_ptr, ignore_index, label_smoothing, z_loss, V_total,
                                                    BLOCK_N, HAS_GL, HAS_GP, HAS_GE, HAS_GZ)
    col = labels - col_begin
    # A label outside this slice touches nothing, and so does a negative id: on a vocab shard, a label that
    # another rank's shard holds (hopperkern.lce.distributed).
    here = row_ok & (labels != ignore_index) & (col >= 0) & (col < ncols)
    logp = tl.load(logprob_ptr + rows, mask=here, other=0.0)
    z = logp + lse
    # The tile kernel's expression (1/temperature folded into the coefficients) plus C, all in fp32, in the form
    # that keeps the entry's precision (_label_entry).
    p, k = _label_entry(logp, b, ac, c)
    dz = _dz(p, z, logp, a * inv_temp, b * inv_temp, (k + d) * inv_temp, softcap, inv_temp, SOFTCAP)
    tl.store(d_ptr + rows.to(tl.int64) * stride_dn + col, dz.to(d_ptr.dtype.element_ty), mask=here)


@triton.jit
def _sft_rows(row0, N, V, labels_ptr, lse_ptr, logprob_ptr, scale_ptr, ignore_index, label_smoothing, z_loss,
              BLOCK_N: tl.constexpr):
    """Per-row inputs of a 3-pass d(logits) tile: rows, row_ok, labels, kept, lse and lse_lo (:func:`_load_lse`'s
    pair), logp (the forward's fp32 log-prob of the label) and the (A, C, D) terms of an upstream gradient ``scale``
    on every kept token's loss."""
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    kept = row_ok & (labels != ignore_index)
    lse, lse_lo = _load_lse(lse_ptr, rows, row_ok)
    logp = tl.load(logprob_ptr + rows, mask=kept, other=0.0)
    gl = tl.where(kept, tl.load(scale_ptr), 0.0)
    a, c, d = _loss_coefficients(gl, lse, label_smoothing, z_loss, V)
    return rows, row_ok, labels, kept, lse, lse_lo, logp, a, c, d


@triton.jit
def _sft_dz(p, z, col0, labels, kept, logp, a, c, d, softcap, inv_temp, BLOCK_V: tl.constexpr,
            SOFTCAP: tl.constexpr):
    """dz = (p A + C [j == label] + D) / T (* (1 - tanh^2)) of a 3-pass tile in fp32, with p at the label taken
    from the fp32 log-prob (so that p - 1 of a confident prediction keeps its precision)."""
    at_label = kept[:, None] & ((col0 + tl.arange(0, BLOCK_V))[None, :] == labels[:, None])
    a_t = (a * inv_temp)[:, None]
    # At the label p A = (p - 1) A + A (see lce_onehot_kernel): A + C there.
    p = tl.where(at_label, _pm1(logp)[:, None], p)
    d_t = (d * inv_temp)[:, None] + tl.where(at_label, a_t + (c * inv_temp)[:, None], 0.0)
    return _dz(p, z, z, a_t, 0.0, d_t, softcap, inv_temp, SOFTCAP)


@triton.jit
def lce_sft_dlogits_kernel(
    z_ptr,  # [N, ld_z] fp32 final logits, stored by lce_forward_kernel (STORE_Z)
    labels_ptr,  # [N] int
    lse_ptr, logprob_ptr,  # [N] fp32 from the forward's combine (log p of the label: z_label - lse)
    scale_ptr,  # [1] fp32 the upstream gradient of every kept token's loss: 1 (sum) or 1 / kept tokens (mean)
    d_ptr,  # [N, ld_d] out: d loss / d (h @ w^T + b), in the inputs' dtype
    N, V, stride_zn, stride_dn, ignore_index, label_smoothing, z_loss, softcap, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, SOFTCAP: tl.constexpr, Z_TMA: tl.constexpr,
    D_TMA: tl.constexpr,
):
    """d(logits) of a sum or mean loss from the stored fp32 logits: the 3-pass SFT path. Grid
    (cdiv(N, BLOCK_N), cdiv(V, BLOCK_V)); one program = one [BLOCK_N, BLOCK_V] tile.

    The same gradient as lce_dlogits_kernel + lce_onehot_kernel with upstream gradient ``scale`` on every kept
    token's loss and none on the other outputs, dz = (p A + C [j == label] + D) / T (* (1 - tanh^2)), formed in
    fp32 and rounded once. At the label, p comes from the forward's fp32 log-prob (as in lce_onehot_kernel), so
    that p - 1 of a confident prediction keeps its precision; the softcap factor there takes the stored z.
    """
    row0 = tl.program_id(0) * BLOCK_N
    col0 = tl.program_id(1) * BLOCK_V
    rows, row_ok, labels, kept, lse, lse_lo, logp, a, c, d = _sft_rows(
        row0, N, V, labels_ptr, lse_ptr, logprob_ptr, scale_ptr, ignore_index, label_smoothing, z_loss, BLOCK_N)
    z_src = tile_source_2d(z_ptr, N, V, stride_zn, BLOCK_N, BLOCK_V, Z_TMA)
    d_dst = tile_source_2d(d_ptr, N, V, stride_dn, BLOCK_N, BLOCK_V, D_TMA)
    z = load_2d(z_src, row0, col0, N, V, stride_zn, 1, BLOCK_N, BLOCK_V, Z_TMA)
    dz = _sft_dz(tl.exp((z - lse[:, None]) - lse_lo[:, None]), z, col0, labels, kept, logp, a, c, d, softcap,
                 inv_temp, BLOCK_V, SOFTCAP)
    # Rows >= N and columns >= V (zeros read there) are clipped by the store on both paths.
    store_2d(d_dst, dz.to(d_ptr.dtype.element_ty), row0, col0, N, V, stride_dn, 1, BLOCK_N, BLOCK_V, D_TMA)


@triton.jit
def _sft_ref_rows(rows, row_ok, labels_ptr, lse_ptr, ref_ptr, ignore_index, z_loss, E_OFFSET: tl.constexpr,
                  E_CLAMP: tl.constexpr):
    """Per-row terms of the 3-pass path over e = exp(z - c) (lce_forward_kernel's STORE_E with E_REF): labels,
    kept, lse and lse_lo (:func:`_load_lse`'s pair), c = r + E_OFFSET, a = 1 + 2 z_loss lse (the loss gradient's factor
    on p), and ``flagged``: a kept row that the row scaling cannot serve, whose LSE lies more than E_CLAMP above c (the
    forward clamped its e) or whose a is ~0 (the label entry's (p - 1 / a) would blow up). A NaN LSE (an out-of-range
    label) is not flagged: its NaN reaches the row's factor."""
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=ignore_index).to(tl.int64)
    kept = row_ok & (labels != ignore_index)
    lse, lse_lo = _load_lse(lse_ptr, rows, row_ok)
    c = tl.load(ref_ptr + rows, mask=row_ok, other=0.0) + E_OFFSET
    a = 1.0 + 2.0 * z_loss * lse
    flagged = kept & ((lse - c > E_CLAMP) | (tl.abs(a) < 0.0009765625))
    return labels, kept, lse, lse_lo, c, a, flagged


@triton.jit
def lce_sft_rowscale_kernel(
    e_ptr,  # [N, ld_e] e = exp(z - c) from lce_forward_kernel (STORE_E, E_REF); each kept row's label entry rewritten
    rho_ptr,  # [N] fp32 out: the row factors, d(logits) = rho[:, None] * e
    ref_ptr,  # [N] fp32 the reference logits r the forward took (c = r + E_OFFSET)
    labels_ptr,  # [N] int
    lse_ptr, logprob_ptr,  # [N] fp32 from the forward's combine (log p of the label: z_label - lse)
    scale_ptr,  # [1] fp32 the upstream gradient of every kept token's loss: 1 (sum) or 1 / kept tokens (mean)
    lab_ptr,  # [N] fp32 out, with SPLIT_LABEL: each row's label term of d(logits) (0 where there is none)
    N, V, stride_en, ignore_index, z_loss, inv_temp,
    BLOCK: tl.constexpr, E_OFFSET: tl.constexpr, E_CLAMP: tl.constexpr, SPLIT_LABEL: tl.constexpr = False,
):
    """The row factors of the 3-pass SFT path without softcap: d(logits) = rho[:, None] * e', with e' the forward's
    e = exp(z - c) except at each kept row's label. Grid (cdiv(N, BLOCK),); O(N) work.

    With SPLIT_LABEL (16-bit e) the label entry of e' becomes 0 and the label's whole d(logits) entry,
    L = g (a p - 1) / T, goes to ``lab`` in fp32: the gradient GEMMs add L times the label's weight row (d_hidden)
    or the token's hidden row (d_weight) in fp32, so the label term, the largest of each row, takes no rounding
    of its own before the gradients' one (a 16-bit entry times 16-bit rho-scaled hidden rows would carry two).

    Away from the label, dz = g a p / T with p = e exp(c - lse), so rho = g a exp(c - lse) / T (g: ``scale``;
    a = 1 + 2 z_loss lse). At the label dz = g (a p - 1) / T, so the entry becomes (p - 1 / a) exp(lse - c), formed
    in fp32 with p from the forward's fp32 log-prob, so that p - 1 of a confident prediction keeps its precision,
    and rounded once. Ignored rows get rho = 0 (their e is finite: the forward clamps it), a NaN LSE a NaN rho.
    A flagged row (see :func:`_sft_ref_rows`) gets rho = 1 and its label entry is left alone:
    lce_sft_rows_kernel writes its whole d(logits) row."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    row_ok = rows < N
    labels, kept, lse, lse_lo, c, a, flagged = _sft_ref_rows(rows, row_ok, labels_ptr, lse_ptr, ref_ptr,
                                                             ignore_index, z_loss, E_OFFSET, E_CLAMP)
    g = tl.load(scale_ptr)
    rho = tl.where(kept, g * a * inv_temp * tl.exp(tl.where(kept, (c - lse) - lse_lo, 0.0)), 0.0)
    tl.store(rho_ptr + rows, tl.where(flagged, 1.0, rho), mask=row_ok)
    here = kept & (~flagged) & (labels >= 0) & (labels < V)
    pm1 = _pm1(tl.load(logprob_ptr + rows, mask=here, other=0.0))
    if SPLIT_LABEL:
        # a p - 1 = a (p - 1) + (a - 1): p - 1 of a confident prediction keeps its precision, and so does a - 1 =
        # 2 z_loss lse, formed from its terms (a - 1 would keep ~ulp(1) of a small z-loss term).
        lab = tl.where(here, g * inv_temp * (a * pm1 + 2.0 * z_loss * lse), 0.0)
        tl.store(lab_ptr + rows, lab, mask=row_ok)
        entry = tl.zeros((BLOCK,), tl.float32)
    else:
        # p - 1 / a = (p - 1) + (a - 1) / a, a - 1 = 2 z_loss lse from its terms (as above)
        entry = (pm1 + 2.0 * z_loss * lse / tl.where(here, a, 1.0)) * tl.exp(tl.where(here, (lse - c) + lse_lo, 0.0))
    tl.store(e_ptr + rows.to(tl.int64) * stride_en + labels, entry.to(e_ptr.dtype.element_ty), mask=here)


@triton.jit
def lce_sft_dhidden_kernel(acc_ptr, rho_ptr, lab_ptr, labels_ptr, w_ptr, g_ptr, out_ptr, N, V, H, stride_an,
                           stride_wv, stride_wk, stride_on, BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr,
                           HAS_G: tl.constexpr = True):
    """d_hidden = round(g * (rho[:, None] * acc + lab[:, None] * w[labels])): the fp32 product acc = e' @ w of the
    3-pass path's kept exponentials (label entries 0) scaled by the row factors, plus each row's label term times
    its label's weight row in fp32 (lce_sft_rowscale_kernel's SPLIT_LABEL), times the upstream gradient (1 without
    HAS_G), rounded once. Rows whose label term is 0 read no weight row. Grid (cdiv(N, BLOCK_N), cdiv(H, BLOCK_H))."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok = rows < N
    ok = row_ok[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(acc_ptr + r64 * stride_an + cols[None, :], mask=ok, other=0.0)
    rho = tl.load(rho_ptr + rows, mask=row_ok, other=0.0)
    lab = tl.load(lab_ptr + rows, mask=row_ok, other=0.0)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    use = (lab != 0.0) & (labels >= 0) & (labels < V)
    wrow = tl.load(w_ptr + labels[:, None] * stride_wv + cols[None, :] * stride_wk, mask=ok & use[:, None],
                   other=0.0).to(tl.float32)
    x = x * rho[:, None] + lab[:, None] * wrow
    if HAS_G:
        x = x * tl.load(g_ptr)
    tl.store(out_ptr + r64 * stride_on + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def lce_label_sums_kernel(off_ptr, perm_ptr, lab_ptr, out_ptr, V, BLOCK: tl.constexpr, STEP: tl.constexpr):
    """out[v] += the sum of the label terms ``lab`` of the tokens whose label is v (the d_bias part of
    lce_sft_rowscale_kernel's SPLIT_LABEL): ``perm`` lists the tokens sorted stably by label, ``off[v]`` is where
    label v's tokens start in it ([V + 1]). Each label's tokens are read STEP at a time in token order, so a label
    that many tokens share (a skewed batch) takes count / STEP dependent steps, not count; the fixed order keeps
    the sums reproducible. Grid (cdiv(V, BLOCK),)."""
    v = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = v < V
    start = tl.load(off_ptr + v, mask=ok, other=0)
    count = tl.load(off_ptr + v + 1, mask=ok, other=0) - start
    acc = tl.zeros((BLOCK, STEP), tl.float32)
    for k in range(0, tl.max(count, 0), STEP):
        j = k + tl.arange(0, STEP)[None, :]
        more = j < count[:, None]
        n = tl.load(perm_ptr + start[:, None] + j, mask=more, other=0)
        acc += tl.load(lab_ptr + n, mask=more, other=0.0)
    tl.store(out_ptr + v, tl.load(out_ptr + v, mask=ok, other=0.0) + tl.sum(acc, 1), mask=ok)


@triton.jit
def lce_sft_rows_kernel(
    h_ptr,  # [N, H]
    w_ptr,  # [V, H]
    b_ptr,  # [V] or dummy
    d_ptr,  # [N, ld_d] out: the d(logits) rows of flagged tokens (others untouched)
    ref_ptr,  # [N] fp32 the reference logits of lce_sft_rowscale_kernel
    labels_ptr,  # [N] int
    lse_ptr, logprob_ptr,  # [N] fp32 from the forward's combine
    scale_ptr,  # [1] fp32 the upstream gradient of every kept token's loss
    N, V, H, stride_hn, stride_hk, stride_wv, stride_wk, stride_dn, ignore_index, z_loss, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, E_OFFSET: tl.constexpr, E_CLAMP: tl.constexpr,
):
    """The whole d(logits) rows of the tokens lce_sft_rowscale_kernel flagged (rho = 1), from logits recomputed
    tile by tile: dz = (p A + C [j == label]) / T in fp32 as in lce_sft_dlogits_kernel, rounded once. Grid
    (cdiv(N, BLOCK_N), cdiv(V, BLOCK_V)); a program whose rows hold no flagged token returns at once (the
    usual case: a flagged token has log p < -(E_OFFSET + E_CLAMP) or a z-loss factor of ~0)."""
    row0 = tl.program_id(0) * BLOCK_N
    col0 = tl.program_id(1) * BLOCK_V
    rows, row_ok, labels, kept, lse, lse_lo, logp, a, c, d = _sft_rows(
        row0, N, V, labels_ptr, lse_ptr, logprob_ptr, scale_ptr, ignore_index, 0.0, z_loss, BLOCK_N)
    _, _, _, _, _, _, flagged = _sft_ref_rows(rows, row_ok, labels_ptr, lse_ptr, ref_ptr, ignore_index, z_loss,
                                           E_OFFSET, E_CLAMP)
    if tl.max(flagged.to(tl.int32), 0) != 0:
        h_src = tile_source_2d(h_ptr, N, H, stride_hn, BLOCK_N, BLOCK_K, False)
        w_src = tile_source_2d(w_ptr, V, H, stride_wv, BLOCK_V, BLOCK_K, False)
        z = _logits_tile(h_src, w_src, b_ptr, row0, col0, N, V, H, stride_hn, stride_hk, stride_wv, stride_wk,
                         1.0, inv_temp, BLOCK_N, BLOCK_V, BLOCK_K, HAS_BIAS, False, False, False, DOT_PRECISION)
        dz = _sft_dz(tl.exp((z - lse[:, None]) - lse_lo[:, None]), z, col0, labels, kept, logp, a, c, d, 1.0,
                     inv_temp, BLOCK_V, False)
        cols = col0 + tl.arange(0, BLOCK_V)
        tl.store(d_ptr + rows.to(tl.int64)[:, None] * stride_dn + cols[None, :], dz.to(d_ptr.dtype.element_ty),
                 mask=flagged[:, None] & (cols[None, :] < V))


@triton.jit
def lce_row_scale_kernel(x_ptr, rho_ptr, out_ptr, N, H, stride_xn, stride_xk, stride_on,
                         BLOCK_N: tl.constexpr, BLOCK_H: tl.constexpr):
    """out = round(rho[:, None] * x): the product of x's element and the fp32 row factor in fp32, rounded once
    to out's dtype (the operand of the 3-pass path's d_weight GEMM, :func:`hopperkern.lce.sft.lce_sft_backward`).
    Grid (cdiv(N, BLOCK_N), cdiv(H, BLOCK_H))."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = (rows < N)[:, None] & (cols < H)[None, :]
    r64 = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + r64 * stride_xn + cols[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
    rho = tl.load(rho_ptr + rows, mask=rows < N, other=0.0)
    tl.store(out_ptr + r64 * stride_on + cols[None, :], (x * rho[:, None]).to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def lce_exp_dlogits_kernel(
    d_ptr,  # [N, ld_d] e = exp(z - m) from lce_forward_kernel (STORE_E)
    out_ptr,  # [N, ld_o] out: d(logits); d_ptr itself (in place) or another buffer
    mt_ptr,  # [N, ld_mt] fp32: the running max m behind each vocab tile's e (STORE_E)
    labels_ptr, lse_ptr, ent_ptr, gl_ptr, gp_ptr, ge_ptr, gz_ptr,  # as in lce_dlogits_kernel
    logprob_ptr,  # [N] fp32 log p of the label from the forward's combine (z_label - lse)
    N, V, stride_dn, stride_on, stride_mt, ignore_index, label_smoothing, z_loss, inv_temp,
    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, FWD_BLOCK_V: tl.constexpr,
    HAS_GL: tl.constexpr, HAS_GP: tl.constexpr, HAS_GE: tl.constexpr, HAS_GZ: tl.constexpr,
    D_TMA: tl.constexpr, APPROX_MATH: tl.constexpr = False,
):
    """d(logits) under per-token upstream gradients from the forward's stored exponentials, in place or into
    ``out``: the 3-pass path of per-token outputs (log-probs and entropies, :mod:`hopperkern.lce.rl`). Grid
    (cdiv(N, BLOCK_N), cdiv(V, BLOCK_V)); one program = one [BLOCK_N, BLOCK_V] tile within one of the forward's
    FWD_BLOCK_V-wide vocab tiles (BLOCK_V divides FWD_BLOCK_V).

    The gradient of lce_dlogits_kernel + lce_onehot_kernel, dz = (p (A + B (z - lse)) + C [j == label] + D) / T,
    with p = e exp(m - lse) and z - lse = (m - lse) + log e formed in fp32, m - lse against the fp64 LSE's pair
    (:func:`_load_lse`; only where the entropy term B = -g_entropy needs it; a logit whose e underflowed to 0 has
    p = 0 and contributes nothing, and one whose e is subnormal takes z - lse = 0 beside its p < 2^-126), rounded
    once. At the label, p and z - lse come from the forward's fp32 log-prob, as in lce_onehot_kernel
    (:func:`_label_entry`), so that the entry of a confident or an unlikely label keeps its precision. A token whose LSE
    is NaN (an out-of-range label) gets a NaN row. No softcap: its tanh factor needs each logit to more than e's
    precision. APPROX_MATH (on a GPU): log e through :func:`~hopperkern.tma.jit.log_approx`, whose error (< 2^-22 in
    log2) is far below that of the stored e (2^-9 in bf16), and which costs one special-function instruction an element
    instead of about twenty.
    """
    tl.static_assert(FWD_BLOCK_V % BLOCK_V == 0, "a d(logits) tile must lie within one forward vocab tile")
    row0 = tl.program_id(0) * BLOCK_N
    col0 = tl.program_id(1) * BLOCK_V
    rows = row0 + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels, lse, lse_lo, a, b, ac, c, d = _row_coefficients(rows, row_ok, labels_ptr, lse_ptr, ent_ptr, gl_ptr, gp_ptr,
                                                            ge_ptr, gz_ptr, ignore_index, label_smoothing, z_loss, V,
                                                            BLOCK_N, HAS_GL, HAS_GP, HAS_GE, HAS_GZ)
    kept = row_ok & (labels != ignore_index)
    logp = tl.load(logprob_ptr + rows, mask=kept, other=0.0)
    mt = tl.load(mt_ptr + rows.to(tl.int64) * stride_mt + col0 // FWD_BLOCK_V, mask=row_ok, other=0.0)
    mc = (mt - lse) - lse_lo  # m - lse, with the LSE's fp64 part (see _load_lse)
    d_src = tile_source_2d(d_ptr, N, V, stride_dn, BLOCK_N, BLOCK_V, D_TMA)
    e = load_2d(d_src, row0, col0, N, V, stride_dn, 1, BLOCK_N, BLOCK_V, D_TMA).to(tl.float32)
    at_label = kept[:, None] & ((col0 + tl.arange(0, BLOCK_V))[None, :] == labels[:, None])
    # At the label p coef + C = p' coef + k (_label_entry).
    p_lab, k_lab = _label_entry(logp, b, ac, c)
    p = tl.where(at_label, p_lab[:, None], e * tl.exp(mc)[:, None])
    coef = a[:, None]
    if HAS_GE:
        # Only normal e take the logarithm (log_approx's domain; compiled tl.log takes libdevice's flush-to-zero
        # path, and a -inf there would make p z a NaN). A subnormal e, a logit 87 to 92 below its tile's running max
        # should the forward store one, has p < 2^-126: its terms vanish with z = 0 as with the exact z.
        normal = e >= 1.1754943508222875e-38
        zc = tl.where(normal, mc[:, None] + log_approx(tl.where(normal, e, 1.0), APPROX_MATH), 0.0)
        zc = tl.where(at_label, logp[:, None], zc)
        coef = coef + b[:, None] * zc
    dz = (p * coef + d[:, None] + tl.where(at_label, k_lab[:, None], 0.0)) * inv_temp
    # Rows >= N and columns >= V are clipped by the store on both paths.
    o_dst = tile_source_2d(out_ptr, N, V, stride_on, BLOCK_N, BLOCK_V, D_TMA)
    store_2d(o_dst, dz.to(out_ptr.dtype.element_ty), row0, col0, N, V, stride_on, 1, BLOCK_N, BLOCK_V, D_TMA)


@triton.jit
def _join_f32(hi, lo):
    """The fp32 numbers whose upper and lower 16 bits are the int16 tiles ``hi`` and ``lo``."""
    return ((hi.to(tl.int32) << 16) | (lo.to(tl.int32) & 0xFFFF)).to(tl.float32, bitcast=True)


@triton.jit
def _split_f32(x):
    """(upper, lower) 16 bits of fp32 ``x`` as int16 tiles: an exact fp32 value in two 16-bit buffers."""
    bits = x.to(tl.int32, bitcast=True)
    return (bits >> 16).to(tl.int16), bits.to(tl.int16)


@triton.jit
def _dweight_epilogue(acc, o_dst, l_dst, out_ptr, g_ptr, v0, h0, V, H, stride_on, BLOCK_V: tl.constexpr,
                      BLOCK_H: tl.constexpr, O_TMA: tl.constexpr, SPLIT: tl.constexpr):
    """Store one [BLOCK_V, BLOCK_H] slice of lce_dweight_kernel's fp32 sum at (v0, h0) through ``o_dst`` /
    ``l_dst`` (descriptors or pointers): round(g * acc) in out_ptr's dtype for SPLIT 0, else acc (plus the sum
    held so far for SPLIT 2) as int16 upper and lower halves."""
    if SPLIT == 0:
        out = acc * tl.load(g_ptr)
        store_2d(o_dst, out.to(out_ptr.dtype.element_ty), v0, h0, V, H, stride_on, 1, BLOCK_V, BLOCK_H, O_TMA)
    else:
        if SPLIT == 2:
            hi = load_2d(o_dst, v0, h0, V, H, stride_on, 1, BLOCK_V, BLOCK_H, O_TMA)
            lo = load_2d(l_dst, v0, h0, V, H, stride_on, 1, BLOCK_V, BLOCK_H, O_TMA)
            acc += _join_f32(hi, lo)
        hi, lo = _split_f32(acc)
        store_2d(o_dst, hi, v0, h0, V, H, stride_on, 1, BLOCK_V, BLOCK_H, O_TMA)
        store_2d(l_dst, lo, v0, h0, V, H, stride_on, 1, BLOCK_V, BLOCK_H, O_TMA)


@triton.jit
def _halves(x, BLOCK_V: tl.constexpr, HALF: tl.constexpr):
    """The left and right [BLOCK_V, HALF] column halves of tile x [BLOCK_V, 2 * HALF] (register-only)."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_V, 2, HALF)), (0, 2, 1)))


@triton.jit
def _label_term(acc, r_ptr, labels_ptr, perm_ptr, off_ptr, lab_ptr, v0, h0, V, H, stride_rn, stride_rk,
                BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """acc [BLOCK_V, BLOCK_H] (rows v0.., columns h0.. of a d_weight tile) + the label terms of the tokens whose
    label lies in the tile's rows: sum over those tokens n of lab[n] * r[n, :] (lce_sft_rowscale_kernel's
    SPLIT_LABEL). ``perm`` lists the tokens sorted stably by label and ``off[v]`` is where label v's tokens start
    in it, so the tile's tokens are one stretch of ``perm``, taken 16 at a time in token order. Each lab[n] is
    split into two 16-bit numbers (hi + lo, 16 significant bits), whose products with the 16-bit hidden rows the
    tensor cores form exactly and add in fp32: each term keeps ~2^-17 of itself, far below the gradient's one
    rounding."""
    LB: tl.constexpr = 16
    start = tl.load(off_ptr + v0)
    stop = tl.load(off_ptr + tl.minimum(v0 + BLOCK_V, V))
    cols = h0 + tl.arange(0, BLOCK_H)
    vs = v0 + tl.arange(0, BLOCK_V)
    for j0 in range(start, stop, LB):
        j = j0 + tl.arange(0, LB)
        more = j < stop
        n = tl.load(perm_ptr + j, mask=more, other=0).to(tl.int64)
        lab = tl.load(lab_ptr + n, mask=more, other=0.0)
        col = tl.load(labels_ptr + n, mask=more, other=-1).to(tl.int64)
        onehot = tl.where(col[:, None] == vs[None, :], lab[:, None], 0.0)  # [LB, BLOCK_V] fp32
        hi = onehot.to(r_ptr.dtype.element_ty)
        lo = (onehot - hi.to(tl.float32)).to(r_ptr.dtype.element_ty)
        rows = tl.load(r_ptr + n[:, None] * stride_rn + cols[None, :] * stride_rk,
                       mask=more[:, None] & (cols < H)[None, :], other=0.0)
        acc = tl.dot(tl.trans(hi), rows, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(tl.trans(lo), rows, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def _dweight_tile(tile, d_src, h_src, o_dst, l_dst, out_ptr, g_ptr, N, V, H, stride_dn, stride_hn, stride_hk,
                  stride_on, r_ptr, labels_ptr, perm_ptr, off_ptr, lab_ptr, stride_rn, stride_rk,
                  BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
                  D_TMA: tl.constexpr, H_TMA: tl.constexpr, O_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
                  SPLIT: tl.constexpr, EPI_SUB: tl.constexpr, HAS_LABELS: tl.constexpr):
    """One [BLOCK_V, BLOCK_H] tile of lce_dweight_kernel: the K loop over all N tokens (and with HAS_LABELS the
    tile's label terms, :func:`_label_term`), then its epilogue in EPI_SUB column slices."""
    vb, hb = grouped_tile(tile, tl.cdiv(V, BLOCK_V), tl.cdiv(H, BLOCK_H), GROUP_V)
    acc = tl.zeros((BLOCK_V, BLOCK_H), dtype=tl.float32)
    for k in range(0, tl.cdiv(N, BLOCK_K)):
        # Token tail (rows >= N) reads zeros from both operands; columns >= V of d read zeros too.
        a = load_2d(d_src, k * BLOCK_K, vb * BLOCK_V, N, V, stride_dn, 1, BLOCK_K, BLOCK_V, D_TMA)
        b = load_2d(h_src, k * BLOCK_K, hb * BLOCK_H, N, H, stride_hn, stride_hk, BLOCK_K, BLOCK_H, H_TMA)
        acc = tl.dot(tl.trans(a), b, acc, input_precision=DOT_PRECISION)
    v0 = vb * BLOCK_V
    h0 = hb * BLOCK_H
    if HAS_LABELS:
        acc = _label_term(acc, r_ptr, labels_ptr, perm_ptr, off_ptr, lab_ptr, v0, h0, V, H, stride_rn, stride_rk,
                          BLOCK_V, BLOCK_H, DOT_PRECISION)
    if EPI_SUB == 1:
        _dweight_epilogue(acc, o_dst, l_dst, out_ptr, g_ptr, v0, h0, V, H, stride_on, BLOCK_V, BLOCK_H, O_TMA,
                          SPLIT)
    else:
        # Column slices: the sum held so far and its halves are live for one slice at a time (no spills at
        # 128 x 256 with SPLIT 2, where the whole tile spills 660 bytes per thread).
        SUB: tl.constexpr = BLOCK_H // EPI_SUB
        a0, a1 = _halves(acc, BLOCK_V, BLOCK_H // 2)
        if EPI_SUB == 2:
            _dweight_epilogue(a0, o_dst, l_dst, out_ptr, g_ptr, v0, h0, V, H, stride_on, BLOCK_V, SUB, O_TMA,
                              SPLIT)
            _dweight_epilogue(a1, o_dst, l_dst, out_ptr, g_ptr, v0, h0 + SUB, V, H, stride_on, BLOCK_V, SUB,
                              O_TMA, SPLIT)
        else:
            tl.static_assert(EPI_SUB == 4, "EPI_SUB is 1, 2 or 4")
            a00, a01 = _halves(a0, BLOCK_V, SUB)
            a10, a11 = _halves(a1, BLOCK_V, SUB)
            _dweight_epilogue(a00, o_dst, l_dst, out_ptr, g_ptr, v0, h0, V, H, stride_on, BLOCK_V, SUB, O_TMA,
                              SPLIT)
            _dweight_epilogue(a01, o_dst, l_dst, out_ptr, g_ptr, v0, h0 + SUB, V, H, stride_on, BLOCK_V, SUB,
                              O_TMA, SPLIT)
            _dweight_epilogue(a10, o_dst, l_dst, out_ptr, g_ptr, v0, h0 + 2 * SUB, V, H, stride_on, BLOCK_V, SUB,
                              O_TMA, SPLIT)
            _dweight_epilogue(a11, o_dst, l_dst, out_ptr, g_ptr, v0, h0 + 3 * SUB, V, H, stride_on, BLOCK_V, SUB,
                              O_TMA, SPLIT)


@triton.jit
def lce_dweight_kernel(
    d_ptr,  # [N, ld_d] d(logits), in the inputs' dtype
    h_ptr,  # [N, H] hidden
    g_ptr,  # [1] fp32 upstream gradient of the loss
    out_ptr,  # [V, H] out: d_weight in the inputs' dtype; with SPLIT, int16: the upper halves of an fp32 sum
    lo_ptr,  # [V, H] int16, with SPLIT: the lower halves (strides of out)
    r_ptr,  # [N, H] with HAS_LABELS: the hidden rows the label terms multiply (h itself may be row-scaled)
    labels_ptr, perm_ptr, off_ptr,  # with HAS_LABELS: [N] labels, [N] tokens sorted by label, [V + 1] offsets
    lab_ptr,  # [N] fp32 with HAS_LABELS: the label terms (lce_sft_rowscale_kernel's SPLIT_LABEL)
    N, V, H, stride_dn, stride_hn, stride_hk, stride_on, stride_rn, stride_rk,
    BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_V: tl.constexpr,
    D_TMA: tl.constexpr, H_TMA: tl.constexpr, O_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SPLIT: tl.constexpr = 0, EPI_SUB: tl.constexpr = 1, NUM_PROGRAMS: tl.constexpr = 0,
    FLATTEN: tl.constexpr = False, HAS_LABELS: tl.constexpr = False,
):
    """d_weight = round(g * (d^T @ h)): one GEMM over all N tokens (K = N) with fp32 accumulation, the upstream
    gradient applied to the fp32 sum and a single rounding to the output dtype (the 3-pass SFT backward). Tiles
    in grouped order, GROUP_V vocab blocks per sweep of the hidden blocks. Both operands are read K-row by K-row
    ([BLOCK_K, BLOCK_V] of d, [BLOCK_K, BLOCK_H] of h); the d tile is transposed on chip.

    Grid: (cdiv(V, BLOCK_V) * cdiv(H, BLOCK_H),), one program a tile, for NUM_PROGRAMS 0; else (NUM_PROGRAMS,)
    persistent programs looping over the tiles, FLATTEN fusing that loop with the K loop so that the next
    tile's first operand loads are issued under this tile's epilogue. EPI_SUB: the epilogue in 1, 2 or 4
    column slices of BLOCK_H / EPI_SUB (O_TMA descriptors have boxes of that width).

    SPLIT (the chunked 3-pass variant, one launch per token chunk; g not applied): 1 stores the fp32 product
    d^T @ h, 2 adds it to the fp32 sum held so far, each fp32 number kept exactly as its upper 16 bits in
    ``out`` and its lower 16 bits in ``lo`` (an fp32 sum in the memory of the 16-bit gradient plus as much
    again; :func:`lce_split_finalize_kernel` applies g and rounds).

    HAS_LABELS adds, before the epilogue, sum over tokens n with label v of lab[n] * r[n, :] to row v of the fp32
    sum (:func:`_label_term`): d(logits)'s label entries kept apart in fp32 by lce_sft_rowscale_kernel.
    """
    if SPLIT != 0:
        tl.static_assert(out_ptr.dtype.element_ty == tl.int16, "SPLIT stores int16 halves")
        tl.static_assert(lo_ptr.dtype.element_ty == tl.int16, "SPLIT stores int16 halves")
    d_src = tile_source_2d(d_ptr, N, V, stride_dn, BLOCK_K, BLOCK_V, D_TMA)
    h_src = tile_source_2d(h_ptr, N, H, stride_hn, BLOCK_K, BLOCK_H, H_TMA)
    o_dst = tile_source_2d(out_ptr, V, H, stride_on, BLOCK_V, BLOCK_H // EPI_SUB, O_TMA)
    if SPLIT != 0:
        l_dst = tile_source_2d(lo_ptr, V, H, stride_on, BLOCK_V, BLOCK_H // EPI_SUB, O_TMA)
    else:
        l_dst = o_dst
    if NUM_PROGRAMS == 0:
        _dweight_tile(tl.program_id(0), d_src, h_src, o_dst, l_dst, out_ptr, g_ptr, N, V, H, stride_dn, stride_hn,
                      stride_hk, stride_on, r_ptr, labels_ptr, perm_ptr, off_ptr, lab_ptr, stride_rn, stride_rk,
                      BLOCK_V, BLOCK_H, BLOCK_K, GROUP_V, D_TMA, H_TMA, O_TMA, DOT_PRECISION, SPLIT, EPI_SUB,
                      HAS_LABELS)
    else:
        num_tiles = tl.cdiv(V, BLOCK_V) * tl.cdiv(H, BLOCK_H)
        for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
            _dweight_tile(tile, d_src, h_src, o_dst, l_dst, out_ptr, g_ptr, N, V, H, stride_dn, stride_hn, stride_hk,
                          stride_on, r_ptr, labels_ptr, perm_ptr, off_ptr, lab_ptr, stride_rn, stride_rk,
                          BLOCK_V, BLOCK_H, BLOCK_K, GROUP_V, D_TMA, H_TMA, O_TMA, DOT_PRECISION, SPLIT, EPI_SUB,
                          HAS_LABELS)


@triton.jit
def lce_split_finalize_kernel(hi_ptr, lo_ptr, g_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = round(g * x) for the n fp32 numbers x held as int16 upper (``hi``) and lower (``lo``) halves (see
    lce_dweight_kernel's SPLIT), flat and contiguous; ``out`` may be ``hi``'s own memory (each element is read
    before it is written, by the same program). Grid (cdiv(n, BLOCK),)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = _join_f32(tl.load(hi_ptr + offs, mask=mask, other=0), tl.load(lo_ptr + offs, mask=mask, other=0))
    tl.store(out_ptr + offs, (x * tl.load(g_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def lce_loss_scale_kernel(labels_ptr, scale_ptr, N, ignore_index, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """scale[0] = the upstream gradient of every kept token's loss when the reduced loss has gradient 1:
    1 / max(1, kept tokens) for a mean (labels != ignore_index, counted exactly in int32), 1 for a sum. One
    program (grid (1,)), on the device: no host sync. 1 / count is an fp64 division rounded to fp32 (a GPU's fp32
    division in Triton is approximate: 1 ulp off for some counts)."""
    count = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, N, BLOCK):
        offs = tl.arange(0, BLOCK).to(tl.int64) + start
        lab = tl.load(labels_ptr + offs, mask=offs < N, other=0)
        count += ((lab != ignore_index) & (offs < N)).to(tl.int32)
    if MEAN:
        scale = (1.0 / tl.maximum(tl.sum(count, 0), 1).to(tl.float64)).to(tl.float32)
    else:
        scale = 1.0
    tl.store(scale_ptr, scale)


@triton.jit
def lce_loss_total_kernel(loss_ptr, scale_ptr, out_ptr, share_ptr, N, HAS_SCALE: tl.constexpr,
                          SHARE: tl.constexpr, BLOCK: tl.constexpr):
    """out[0] = scale * (the fp32 sum of the N per-token losses), summed in a fixed order (bitwise reproducible),
    scale = scale[0] with HAS_SCALE, else 1; with SHARE, also share[n] = scale for every token (each token's part
    of the reduced loss's upstream gradient, the per-token gradient the backward reads). One program (grid (1,))."""
    if HAS_SCALE:
        scale = tl.load(scale_ptr)
    else:
        scale = 1.0
    acc = tl.zeros((BLOCK,), tl.float32)
    part = tl.zeros((BLOCK,), tl.float32) + scale
    for start in range(0, N, BLOCK):
        offs = tl.arange(0, BLOCK).to(tl.int64) + start
        acc += tl.load(loss_ptr + offs, mask=offs < N, other=0.0)
        if SHARE:
            tl.store(share_ptr + offs, part, mask=offs < N)
    tl.store(out_ptr, tl.sum(acc, 0) * scale)
