"""The 3-pass forward + backward of per-token log-probs and entropies (RL): launchers and the rule that picks it.

The 4-pass path (:func:`.launch.lce_backward`) recomputes every logit in the backward, because the per-token
upstream gradients of the log-probs and entropies (PPO/GRPO advantages, an entropy bonus) only arrive then. This
path keeps instead what the forward's log-sum-exp computes anyway: for every logit e = exp(z - m), m the row's
running max after its vocab tile, in the inputs' dtype, and m per tile in fp32 (:func:`.launch.lce_forward` with
``e_out``, as the SFT path of :mod:`.sft`). The backward then forms d(logits) in place over e
(``lce_exp_dlogits_kernel``: p = e exp(m - lse), z = m + log e, the label's p and z from the forward's fp32
log-prob) and runs the two gradient GEMMs of :func:`.sft.lce_sft_backward` with an upstream gradient of 1: three
passes over the vocab (logits, d_hidden, d_weight) plus one streaming pass over the kept N x V buffer.

Precision (bf16): e carries a relative error of 2^-9, so p does too and z an absolute one of 2^-9 (the entropy
term p (E - z) g_entropy); d(logits) is rounded once more. The GPU tests bound the result against fp64 and plain
PyTorch. fp16 inputs keep the 4-pass path (fp16 e loses its relative precision below 6.1e-5), and so do calls
with a ``process_group`` (vocab-parallel).

In eager mode the backward mutates the kept buffers (e becomes d(logits), the maxima NaN): a second backward
through the same graph (``retain_graph=True``) raises autograd's error about a saved tensor modified in place;
``grad_path="4pass"`` allows it. A backward traced by torch.compile writes d(logits) to a buffer of its own
instead (N x V more memory during the backward, and any number of backwards), since a traced in-place update
would be written back over the kept buffer without a version check. Each differentiable forward holds its N x V
buffer until its backward: several forwards before one backward (micro-batches) hold one each. The same holds for
the mixed path below, with its S x V buffer.

Rule (``grad_path="auto"``): bf16 and fp32 inputs from ``sft.MIN_TOKENS_3PASS`` tokens and ``MIN_HIDDEN_3PASS``
hidden units (below it nothing was measured), when :func:`extra_bytes` (the
kept N x V buffer, the per-tile maxima, the backward's fp32 d_hidden) is at most :func:`.sft.budget_bytes` =
V x H x 4 bytes + 512 MiB: the SFT path's memory budget.

The mixed path (:func:`stored_rows`; "auto" only, from ``MIN_HIDDEN_MIXED`` hidden units): where the whole
batch's exponentials exceed that budget, the first S tokens (whole blocks of ``MIXED_ROW_STEP`` rows, at least
``MIN_STORED_ROWS``, as many as :func:`mixed_extra_bytes` lets fit the budget) take this path and the other N - S
tokens the 4-pass path: two
forwards (the first storing), then the S rows' d(logits) in place and their d_hidden rows in one GEMM, and the
4-pass backward of the rest, whose per-slice d_weight GEMMs also add the S tokens' products (the same d(logits)
columns) to the same fp32 sums (:func:`.launch.lce_backward`'s ``extra_weight_grad``): every d_weight entry is one
fp32 sum over all N tokens, rounded once. Each stored token saves its share of the recomputed logits.
"""

from __future__ import annotations

import torch

from .. import tma as _tma
from .._host import cdiv
from .._validate import check_choice
from ..tma.launcher import Launch, state_key, tensors_key
from ..tuning import KernelConfig
from ._kernels import lce_exp_dlogits_kernel
from .launch import DLOGITS_BUDGET, LceOptions, _dw_rows, lce_backward, lce_forward, pick_config
from . import sft as _sft
from .sft import budget_bytes, lce_sft_backward, padded_cols

__all__ = ["GRAD_PATHS", "MIN_HIDDEN_3PASS", "MIN_HIDDEN_MIXED", "MIN_TOKENS_NARROW_TILES", "MIXED_ROW_STEP",
           "MIN_STORED_ROWS", "check_grad_path", "use_3pass", "stored_rows", "extra_bytes", "mixed_extra_bytes",
           "forward_config", "lce_rl_forward", "lce_rl_backward", "forward_block_v"]

GRAD_PATHS = ("auto", "3pass", "4pass")
# "auto" takes the 3-pass path from this hidden size. It trades the backward's recomputed logits (2 N V H FLOPs)
# for streaming the kept N x V buffer (written by the forward, read and rewritten by the backward), which pays
# more the larger H is. Measured on the H200 (bf16, benchmarks/bench_lce.py), forward + backward / 4G, 3-pass vs
# 4-pass: 0.84 to 0.91 vs 1.08 to 1.11 at H = 4096, 3584 and 2304, 0.94 vs 1.17 at 1937 x 3584 x 152064. At
# 2169 x 896 x 151936, with the pass over e taking its logarithm through lg2.approx (tma.jit.log_approx), 1.06 vs
# 1.14 (H100, same run; 1.16 vs 1.16 on the H200 with libdevice's log). Below 896 nothing was measured.
MIN_HIDDEN_3PASS = 896
# The mixed path (stored_rows) was measured from H = 2304 only: below this it is not taken.
MIN_HIDDEN_MIXED = 2048
# The forward that stores its exponentials and entropy terms runs at 128 x 128 x 64 tiles with 8 warps and 4 stages
# from this many tokens. Measured on the H200 (bf16, one run) against the tuned 128 x 256 tiles when those spilled
# 690-750 bytes per thread (they spill none in the shipped kernel: 243 registers per thread on sm_90,
# benchmarks/compile_lce_sm90.py, store=et), forward + backward / 4G with the narrower tiles instead of the wider:
# 0.90 vs 0.94 at 8192 x 4096, 0.91 vs 0.94 at 16384 x 3584, 0.97 vs 1.01 at 8192 x 2304, level at 32768 x 4096,
# but 0.85 vs 0.82 at 1937 x 3584: taken from this many tokens. With the wider tiles spilling none, a same-run A/B
# at 8192 x 4096 (H200, two rounds) gave 0.824 and 0.833 x 4G at 128 x 256 against 0.838 and 0.841 at 128 x 128.
MIN_TOKENS_NARROW_TILES = 4096
# The mixed path (:func:`stored_rows`) stores whole row blocks of tokens, and at least this many: a choice, not a
# measurement (each stored token saves ~1/4 of its recomputed logits, and the second forward launch and the split
# d_weight GEMMs cost a few per cent of a forward: below ~1000 tokens the saving would not clearly pay for them).
MIXED_ROW_STEP = 128
MIN_STORED_ROWS = 1024
_RL_OP = "lce.rl_dlogits"  # the in-place d(logits) launch's name in tma.last_decision
# The in-place pass's tiles: as the SFT fix-up's (same bytes per logit), measured there on the H200.
_BLOCKS, _BLOCKS_INTERPRETED = (32, 128), (16, 32)
_EXP_POINTER = "tma='auto': pointer loads are faster for the in-place d(logits) pass (measured on the H200)"
# Registers per thread of that pass (ptxas' .maxnreg): 64 keeps four 256-thread programs per SM; without the cap
# ptxas takes 72 to 80 (three programs) for the same code, and spills nothing at 64 (sm_90, both memory paths).
_EXP_MAXNREG = 64


def check_grad_path(grad_path, dtype: torch.dtype, *, sharded: bool = False) -> None:
    """ValueError for an unknown ``grad_path`` or "3pass" with a ``process_group``; TypeError for "3pass" with fp16
    inputs (the stored exponentials need bf16's or fp32's exponent range)."""
    check_choice("grad_path", grad_path, GRAD_PATHS)
    if grad_path != "3pass":
        return
    if sharded:
        raise ValueError("grad_path must be 'auto' or '4pass' with a process_group (vocab-parallel), got '3pass' "
                         "(the 3-pass path is for an unsharded head)")
    if dtype == torch.float16:
        raise TypeError("grad_path='3pass' needs bfloat16 or float32 inputs, got float16 (after autocast, if it is "
                        "on; fp16 exponentials lose their relative precision below 6.1e-5); use 'auto' or '4pass'")


def use_3pass(grad_path: str, N: int, V: int, H: int, dtype: torch.dtype) -> bool:
    """Whether a differentiable call takes the 3-pass path for all its tokens: ``"3pass"`` for bf16 and fp32
    inputs (fp16 is refused first, :func:`check_grad_path`), ``"4pass"`` never, ``"auto"`` for bf16 and fp32
    inputs from ``sft.MIN_TOKENS_3PASS`` tokens and ``MIN_HIDDEN_3PASS`` hidden units when :func:`extra_bytes` <=
    :func:`.sft.budget_bytes`."""
    check_choice("grad_path", grad_path, GRAD_PATHS)
    if dtype == torch.float16 or grad_path == "4pass":
        return False
    if grad_path == "3pass":
        return True
    if H < MIN_HIDDEN_3PASS:
        return False
    return N >= _sft.MIN_TOKENS_3PASS and extra_bytes(N, V, H, torch.finfo(dtype).bits // 8) <= budget_bytes(V, H)


def stored_rows(grad_path: str, N: int, V: int, H: int, dtype: torch.dtype) -> int:
    """How many leading tokens of a differentiable call keep their exponentials (0: the 4-pass path for all): N
    where :func:`use_3pass` says so; under ``"auto"``, where the whole batch's exponentials exceed the budget but
    the thresholds hold (``MIN_HIDDEN_MIXED`` in place of ``MIN_HIDDEN_3PASS``), the most rows (a multiple of
    ``MIXED_ROW_STEP``, at least ``MIN_STORED_ROWS``) whose :func:`mixed_extra_bytes` fit :func:`.sft.budget_bytes`:
    those take the 3-pass path and the other tokens the 4-pass path (the mixed path); else 0."""
    if use_3pass(grad_path, N, V, H, dtype):
        return N
    if grad_path != "auto" or dtype == torch.float16 or H < MIN_HIDDEN_MIXED or N < _sft.MIN_TOKENS_3PASS:
        return 0
    return _mixed_rows(N, V, H, torch.finfo(dtype).bits // 8, budget_bytes(V, H))


def _mixed_rows(N: int, V: int, H: int, elem: int, budget: int) -> int:
    """:func:`stored_rows` of the mixed path: a few dozen integer steps at most, beside a call of 100 ms or more
    of GPU work, so not cached (the memory terms read module constants that tests change)."""
    per_row = padded_cols(V) * elem + 2 * _max_tiles(V) * 4
    rows = max(0, budget - mixed_extra_bytes(N, 0, V, H, elem)) // per_row // MIXED_ROW_STEP * MIXED_ROW_STEP
    top = (N - 1) // MIXED_ROW_STEP * MIXED_ROW_STEP
    rows = min(rows, top)
    while rows >= MIN_STORED_ROWS and mixed_extra_bytes(N, rows, V, H, elem) > budget:
        rows -= MIXED_ROW_STEP
    # The estimate counted the 4-pass part's fp32 d_hidden for all N rows: more rows may fit.
    while rows + MIXED_ROW_STEP <= top and mixed_extra_bytes(N, rows + MIXED_ROW_STEP, V, H, elem) <= budget:
        rows += MIXED_ROW_STEP
    return rows if rows >= MIN_STORED_ROWS else 0


def mixed_extra_bytes(N: int, S: int, V: int, H: int, elem: int) -> int:
    """Peak extra memory of the mixed path with ``S`` of ``N`` tokens stored, beyond inputs, outputs and
    gradients: the kept exponentials and per-tile maxima of the S rows (the maxima counted twice, as in
    :func:`extra_bytes`), plus the backward's fp32 d_hidden sum of the larger part (the S rows', then the other
    rows': one at a time, each rounded into its rows of the one gradient), the 4-pass part's d(logits) slice
    (``launch.DLOGITS_BUDGET``) and its fp32 d_weight sum (``launch._dw_rows`` rows). Eager calls on the
    cuBLAS path (:func:`.launch.fast_mm_f32`); a traced backward adds a d(logits) buffer of S rows."""
    # The slice is at most DLOGITS_BUDGET / row bytes columns, or one tile (<= 256) where that is fewer; its fp32
    # d_weight sum at most DW_SLICE_BUDGET bytes (16-bit inputs; fp32 d_weight is its own sum).
    cols = max(256, DLOGITS_BUDGET // (max(1, N - S) * elem))
    acc_w = min(cols, _dw_rows(H)) * H * 4 if elem != 4 else 0
    return (S * (padded_cols(V) * elem + 2 * _max_tiles(V) * 4) + max(S, N - S) * H * 4 + DLOGITS_BUDGET
            + acc_w)


def _max_tiles(V: int) -> int:
    """Columns of the per-tile maxima counted by :func:`extra_bytes`: vocab tiles of 64 columns (the tuned GPU
    configs' tiles are 128 or 256 wide; the array is 1/32 of a bf16 d(logits) at 64)."""
    return cdiv(V, 64)


def extra_bytes(N: int, V: int, H: int, elem: int) -> int:
    """Peak extra memory of the 3-pass path beyond its inputs, outputs and gradients: the kept N x V buffer plus the
    larger of the forward's per-tile maxima (:func:`_max_tiles`) and the backward's fp32 d_hidden (and for fp32
    inputs a d_weight slice), plus the per-tile maxima once more, which the backward reads beside its fp32
    d_hidden."""
    tiles = N * _max_tiles(V) * 4
    backward = N * H * 4 + (_sft._slice_rows(V, H) * H * 4 if elem == 4 else 0)
    return N * padded_cols(V) * elem + max(tiles, backward) + tiles


def forward_config(cfg: KernelConfig, N: int) -> KernelConfig:
    """The 3-pass forward's launch config from the tuned forward config ``cfg``: from ``MIN_TOKENS_NARROW_TILES``
    tokens, tiles of 128 x 256 or more run as 128 x 128 x 64 with 8 warps and 4 stages (no register spills with the
    stores); otherwise, and for smaller tiles (fp32 inputs, the interpreter), as tuned."""
    return cfg if N < MIN_TOKENS_NARROW_TILES else _sft.narrow_tiles(cfg, 128 * 256)


def forward_block_v(V: int, num_tiles: int) -> int:
    """The forward's vocab tile width behind per-tile maxima of ``num_tiles`` columns: the smallest power of two
    (at least 16) with cdiv(V, width) == num_tiles. Tile widths are powers of two, and two of them give the same
    count only when it is 1, where any width >= V reads the same column."""
    if num_tiles < 1 or V < 1:
        raise ValueError(f"mt must have at least one column for V = {V}, got {num_tiles}")
    width = 16
    while cdiv(V, width) > num_tiles:
        width *= 2
    if cdiv(V, width) != num_tiles:
        raise ValueError(f"mt has {num_tiles} columns, which no power-of-two vocab tile of V = {V} gives")
    return width


def stored_config(dtype: torch.dtype, S: int, H: int, device) -> KernelConfig:
    """The config of the forward that stores the exponentials of ``S`` tokens (its ``block_n`` is the width of
    the per-tile maxima's tiles)."""
    return forward_config(pick_config("forward", dtype, S, H, device), S)


def lce_rl_forward(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, opts: LceOptions,
                   stored: int | None = None):
    """``(loss, logprob, entropy, lse, e, mt)``: the per-token fp32 outputs of :func:`.launch.lce_forward` (label
    logit as the tiles computed it, entropy computed) and what the backward keeps: ``e`` [S, padded_cols(V)] in the
    inputs' dtype (columns >= V unused) and ``mt`` fp32 [S, cdiv(V, block_n)] for the first S = ``stored`` tokens
    (default and at most N: all). With S < N (the mixed path) the other tokens' outputs come from a forward of
    their own that stores nothing; their backward recomputes the logits. Inputs must be validated already."""
    _tma.check_interpreter(hidden2d.dtype, "lce.forward")
    N, H = hidden2d.shape
    V = weight.shape[0]
    S = N if stored is None else max(0, min(int(stored), N))
    dev = hidden2d.device
    cfg = stored_config(hidden2d.dtype, S, H, dev)
    e = torch.empty((S, padded_cols(V)), dtype=hidden2d.dtype, device=dev)
    mt = torch.empty((S, cdiv(V, cfg.block_n)), dtype=torch.float32, device=dev)
    if N == 0:
        return (*lce_forward(hidden2d, weight, labels1d, None, opts), e, mt)
    out = lce_forward(hidden2d[:S], weight, labels1d[:S], None, opts, need_entropy=True, config=cfg, pick_label=True,
                      e_out=(e, mt)) if S else None
    if S < N:
        rest = lce_forward(hidden2d[S:], weight, labels1d[S:], None, opts, need_entropy=True, pick_label=True)
        out = rest if out is None else tuple(torch.cat(pair) for pair in zip(out, rest))
    return (*out, e, mt)


def lce_rl_backward(hidden2d, weight, labels1d, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy, g_lse,
                    opts: LceOptions, *, need_hidden_grad: bool = True, need_weight_grad: bool = True,
                    in_place: bool = True):
    """``(d_hidden [N, H], d_weight [V, H])`` in the inputs' dtype (None where not needed) from what
    :func:`lce_rl_forward` kept and fp32 [N] upstream gradients of its per-token outputs (None for zero).
    ``in_place``: overwrites ``e`` with d(logits) and ``mt`` with NaN (the pair serves one backward; extra
    memory: fp32 [N, H] for d_hidden); otherwise d(logits) goes to a new buffer like ``e`` (extra memory: that
    buffer too) and ``e``, ``mt`` stay as they are. Where ``e`` holds fewer rows than N (the mixed path) the other
    tokens go through the 4-pass backward (extra memory: :func:`mixed_extra_bytes` beyond the kept pair)."""
    N, H = hidden2d.shape
    V = weight.shape[0]
    dev, dt = hidden2d.device, hidden2d.dtype
    grads = (g_loss, g_logprob, g_entropy, g_lse)
    if N == 0 or all(g is None for g in grads):
        d_h = torch.zeros_like(hidden2d) if need_hidden_grad else None
        d_w = torch.zeros(weight.shape, dtype=dt, device=dev) if need_weight_grad else None
        return d_h, d_w
    S = e.shape[0]
    if S < N:
        return _mixed_backward(hidden2d, weight, labels1d, e, mt, lse, entropy, logprob, grads, opts,
                               need_hidden_grad, need_weight_grad, in_place)
    dl = _exp_dlogits(e, mt, labels1d, lse, entropy, logprob, grads, opts, V, in_place)
    one = torch.ones((), dtype=torch.float32, device=dev)
    d_h, d_w, _ = lce_sft_backward(hidden2d, weight, None, dl, one, need_hidden_grad=need_hidden_grad,
                                   need_weight_grad=need_weight_grad, tma=opts.tma)
    return d_h, d_w


def _exp_dlogits(e, mt, labels1d, lse, entropy, logprob, grads, opts: LceOptions, V: int, in_place: bool):
    """d(logits) of the first e.shape[0] tokens from their kept exponentials (one ``lce_exp_dlogits_kernel``
    launch), in ``e`` itself with ``in_place`` (``mt`` then NaN), else in a new buffer like ``e``."""
    N = e.shape[0]
    dl = e if in_place else torch.empty_like(e)
    flags = tuple(g is not None for g in grads)
    tensors = (e, dl, mt, labels1d, lse, entropy, *(g if g is not None else entropy for g in grads), logprob)
    key = ("rl_dlogits", e.device, N, V, e.stride(0), dl.stride(0), mt.stride(0), mt.shape[1], flags, opts,
           *state_key(), *tensors_key(tensors))
    _sft.cached_launch(key, lambda: _exp_dlogits_launch(tensors, N, V, flags, opts))(*tensors)
    if in_place:
        # mt has served: poisoned, so that a second use of the pair gives NaN gradients, never plausible ones.
        mt.fill_(float("nan"))
    return dl


def _exp_dlogits_launch(tensors, N: int, V: int, flags: tuple, opts: LceOptions):
    """:func:`~.sft.cached_launch`'s build of ``lce_exp_dlogits_kernel`` (see :func:`_exp_dlogits`)."""
    e, dl, mt = tensors[:3]
    bn, bv = _BLOCKS_INTERPRETED if _tma.interpreter_active() else _BLOCKS
    fwd_bv = forward_block_v(V, mt.shape[1])
    bv = min(bv, fwd_bv)
    d = _tma.decide(opts.tma, {"dlogits": (e, (bn, bv))}, op=_RL_OP, auto_pointer=_EXP_POINTER, record=False)
    launch = Launch(lce_exp_dlogits_kernel, (cdiv(N, bn), cdiv(V, bv)), *tensors, N, V, e.stride(0), dl.stride(0),
                    mt.stride(0), opts.ignore_index, float(opts.label_smoothing), float(opts.z_loss), opts.inv_temp,
                    BLOCK_N=bn, BLOCK_V=bv, FWD_BLOCK_V=fwd_bv,
                    **dict(zip(("HAS_GL", "HAS_GP", "HAS_GE", "HAS_GZ"), flags)), D_TMA=d["dlogits"],
                    APPROX_MATH=_tma.ptx_approx_math(), num_warps=_sft.DLOGITS_WARPS, maxnreg=_EXP_MAXNREG)
    return launch, d


def _mixed_backward(hidden2d, weight, labels1d, e, mt, lse, entropy, logprob, grads, opts: LceOptions,
                    need_hidden_grad: bool, need_weight_grad: bool, in_place: bool):
    """The mixed path's backward: the first S = e.shape[0] tokens' d(logits) from their exponentials, their
    d_hidden rows in one fp32 GEMM (:func:`.sft.lce_sft_backward`); the other tokens through the 4-pass backward
    (:func:`.launch.lce_backward`), whose d_weight slice GEMMs also add the S tokens' products to the same fp32
    sums, so every d_weight entry is one fp32 sum over all N tokens, rounded once."""
    S, V = e.shape[0], weight.shape[0]
    dl = _exp_dlogits(e, mt, labels1d, lse, entropy, logprob, grads, opts, V, in_place) if S else e
    d_h = torch.empty_like(hidden2d, memory_format=torch.contiguous_format) if need_hidden_grad else None
    if need_hidden_grad and S:
        one = torch.ones((), dtype=torch.float32, device=hidden2d.device)
        lce_sft_backward(hidden2d[:S], weight, None, dl, one, need_hidden_grad=True, need_weight_grad=False,
                         tma=opts.tma, hidden_grad_out=d_h[:S])
    rest = [g[S:] if g is not None else None for g in grads]
    _, d_w, _ = lce_backward(hidden2d[S:], weight, labels1d[S:], None, lse[S:], entropy[S:], *rest, opts,
                             logprob=logprob[S:], need_weight_grad=need_weight_grad, need_hidden_grad=need_hidden_grad,
                             extra_weight_grad=(dl[:, :V], hidden2d[:S]) if S and need_weight_grad else None,
                             hidden_grad_out=d_h[S:] if need_hidden_grad else None)
    return d_h, d_w
