"""The 3-pass forward + backward of a sum or mean cross-entropy (SFT): launchers and the rule that picks it.

For a sum or mean loss the upstream gradient of every kept token's loss is the same number, known up to one
scalar factor g at the end of the forward. So the forward can form d(logits) itself and keep it, and the backward
is two GEMMs: three passes over the vocab (logits, d_hidden, d_weight) instead of the 4-pass path's four (logits;
then, in :func:`.launch.lce_backward`, the logits again, d_hidden and d_weight).

Forward (:func:`lce_sft_forward`) of bf16 or fp32 inputs without softcap or label smoothing: an O(N H) fp32 dot gives
each token's label logit r first; one :func:`.launch.lce_forward` over all N tokens with ``e_out=(e, r)`` computes
the statistics and writes, for every logit, e = exp(z - c) with one reference c = r + ``E_OFFSET`` (20) per row
into the [N, V] buffer kept for the backward, in the inputs' dtype (formed from the running sum's own exponentials,
z - c clamped to ``E_CLAMP`` (60) so that every stored e is finite). With the LSE known, d(logits) is a row scaling
of e: dz = rho e with rho = g a exp(c - lse) / T (g: 1 for a sum, 1 / kept tokens for a mean, read from the device:
no host sync; a = 1 + 2 z_loss lse), except at the label, where dz = g (a p - 1) / T. ``lce_sft_rowscale_kernel``
(O(N)) writes rho and, for 16-bit inputs, sets each label entry to 0 and writes the label's whole entry
L = g (a p - 1) / T as an fp32 label term (for fp32 inputs it overwrites the label entry with (p - 1 / a)
exp(lse - c)); p comes from the forward's fp32 log-prob, so that p - 1 of a confident prediction keeps its
precision. No pass over the N x V buffer forms d(logits): the backward applies rho to its GEMMs' small operands
and adds the label terms in fp32. The label entry is the largest of an unconfident row (-1 + p, which rounds
nearly exactly to bf16 where PyTorch rounds d(logits)); as a bf16 entry times bf16 rho-scaled hidden rows it would
carry two roundings, and d_weight's error would be 2.1 to 5.5x that of PyTorch's fp32-accumulated path (measured at
the benchmark's shapes), where the fp32 label terms leave only the gradients' own rounding. A token whose LSE lies more than ``E_CLAMP``
above c (log p of its label below -80: the clamp may have cut its e) or whose a is ~0 is flagged:
``lce_sft_rows_kernel`` writes its whole d(logits) row from recomputed logits, with rho = 1 (its programs return
at once where no row is flagged). bf16 and fp32 keep e's relative precision at every magnitude (bf16: 2^-9 down to
1e-38), where rounded logits would put errors of ulp(z) into p; e of a probability below ~1e-29 underflows to 0.

With fp32 logits instead (:func:`fp32_logits`): with softcap, whose tanh factor needs each logit itself; with label
smoothing, whose constant term -eps/V nearly cancels p A where p is close to eps/V (a difference formed after e's
rounding would keep only a fraction of its bits); and for fp16 inputs, whose e would lose its relative precision
below 6.1e-5 (fp16's smallest normal), the forward runs per chunk of C tokens with ``z_out``: it writes the chunk's final fp32 logits to a [C, V] scratch buffer, from which
``lce_sft_dlogits_kernel`` forms d(logits), rounded once.

Backward (:func:`lce_sft_backward`), g the 0-dim upstream gradient on the device:
``d_hidden = round(g * (dl @ w))`` and ``d_weight = round(g * (dl^T @ h))``, each one GEMM over its whole K dim
with fp32 accumulation, g applied to the fp32 sum and one rounding (no second rounding when g != 1: loss scaling,
1/k gradient accumulation). d_hidden: cuBLAS with fp32 output, then g. d_weight of 16-bit inputs:
``lce_dweight_kernel``, g in its epilogue; of fp32 inputs: cuBLAS in vocab slices of at most ``DW_SLICE_BUDGET``
fp32 bytes. With row factors rho (the exponentials' forward), dl = e' and: d_hidden = round((g rho)[:, None] *
(e' @ w)) from the fp32 product; d_weight = round(g * (e'^T @ round(rho[:, None] * h))), h's rows scaled in fp32
and rounded once (``lce_row_scale_kernel``, O(N H)): a relative error per term like e's own rounding. With label
terms L (16-bit inputs): d_hidden's row n gains L[n] w[label n] in fp32 before its rounding
(``lce_sft_dhidden_kernel``), d_weight's row v the sum over the tokens labelled v of L[n] h[n] (unscaled h), in
token order, inside ``lce_dweight_kernel`` (the tokens sorted by label on the device, each L split into two 16-bit
halves whose products with h the tensor cores form exactly), and d_bias's entry v the sum of those L.

Chunked variant (:func:`lce_sft_chunked_forward`, ``sft_path="chunked"``) where the kept d(logits) would not fit:
the forward takes the tokens in chunks of C tokens at most (:func:`chunk_tokens`, evened out by
:func:`balanced_chunk`); for each chunk it forms d(logits) (or e' and its row factors) as above into
one reused [C, V] buffer and runs both gradient GEMMs on it at once: the chunk's rows of d_hidden (cuBLAS with fp32
output; its K dim, the vocabulary, whole in one GEMM; rounded to the inputs' dtype) and the d_weight sum over the
chunks in fp32 (and d_bias's in fp32 [V]). For 16-bit inputs ``lce_dweight_kernel`` adds each chunk's product to that
sum in its epilogue and keeps every fp32 number exactly, as its upper 16 bits in the memory of the d_weight gradient
and its lower 16 bits in an int16 [V, H] buffer: an fp32 sum for V x H x 2 bytes beyond the gradient; fp32 inputs
sum into the fp32 gradient itself (cuBLAS). The backward only scales them by g, in fp32:
``d_weight = round(g * sum)`` (one rounding of the fp32 sum), ``d_hidden = round(g * d_hidden)``, a second
rounding unless g is a power of two (1 for ``loss.backward()``, 1/2^k gradient accumulation, loss scaling), which
the GPU tests bound within 2x fp32-torch's error. An eager backward scales d_hidden and d_weight in place, so what
the forward keeps is the gradients' own memory and serves one backward (a second one through a retained graph
raises RuntimeError). A weight that needs no gradient (a frozen head) skips the d_weight
GEMM and its sum: two passes over the vocabulary. Extra memory: the sums' lower halves plus one chunk's d(logits) and
scratch, at most :func:`budget_bytes` in eager mode (a backward traced by torch.compile writes new d_hidden and
d_weight buffers beside the kept ones: (N + V) x H x itemsize more).

Memory rule (``sft_path="auto"``): the 3-pass path runs from ``MIN_TOKENS_3PASS`` tokens (``MIN_TOKENS_FP32_LOGITS``
where the forward keeps fp32 logits) when its extra memory, :func:`extra_bytes` (the kept d(logits), N x V in the
inputs' dtype, plus the larger of the forward's scratch (the fp32 logits chunk, or 8 bytes a token) and the
backward's fp32 d_hidden (and, for fp32 inputs, d_weight slice)), is at most :func:`budget_bytes` = V x H x 4
bytes (an fp32 copy of the weight) + ``EXTRA_BUDGET`` (512 MiB); otherwise, or when the weight needs no gradient,
the chunked variant from the same token count when its chunks, sized to that budget, hold at least
``MIN_CHUNK_TOKENS`` tokens (or all of them) (:func:`pick_path`). Otherwise, and always for ``reduction="none"``
and vocab-parallel calls, the 4-pass path runs (extra memory O(N H) + 128 MiB). Per-token log-probs and entropies
(``linear_logprobs_entropy``) have a 3-pass path of their own under the same memory rule, and a mixed path beyond
it (:mod:`.rl`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import tma as _tma
from .._host import cdiv
from .._validate import check_choice, dot_precision
from ..tma.launcher import Launch, LaunchCache, state_key, tensors_key
from ..tuning import KernelConfig
from ._kernels import (lce_dweight_kernel, lce_label_logit_kernel, lce_label_sums_kernel, lce_loss_scale_kernel,
                       lce_loss_total_kernel, lce_row_scale_kernel, lce_sft_dhidden_kernel, lce_sft_dlogits_kernel,
                       lce_sft_rows_kernel, lce_sft_rowscale_kernel, lce_split_finalize_kernel)
from .launch import (_ROW_BLOCK, _ROW_BLOCK_K, E_CLAMP, E_OFFSET, LceOptions, _acc_mm_f32, _sm_count, fast_mm_f32,
                     label_by_mma, lce_forward, pick_config, softcap_mode)

__all__ = ["SFT_PATHS", "EXTRA_BUDGET", "MIN_TOKENS_3PASS", "MIN_CHUNK_TOKENS", "chunk_tokens", "pick_path",
           "balanced_chunk", "lce_sft_chunked_forward", "lce_sft_chunked_backward", "MIN_TOKENS_FP32_LOGITS", "LOGITS_CHUNK_BUDGET", "LOGITS_CHUNK_MAX", "chunk_bytes", "DW_SLICE_BUDGET", "padded_cols", "chunk_rows",
           "fp32_logits", "factor_rows", "extra_bytes", "budget_bytes", "store_z_config", "narrow_tiles", "check_sft_path", "use_3pass", "lce_sft_forward", "lce_sft_backward",
           "loss_scale", "loss_total"]

SFT_PATHS = ("auto", "3pass", "chunked", "4pass")
EXTRA_BUDGET = 512 * 2**20  # bytes beyond an fp32 [V, H]: the 3-pass path's memory allowance
# "auto" takes the 3-pass path from this many tokens. Measured on the H200 (bf16, sum loss, two runs): the 3-pass
# path took 0.81-0.83x the 4-pass path's time at 1937 x 3584 x 152064 and 0.93x at 2169 x 896 x 151936; 0.76-0.78x
# at 8192 and 16384 tokens. The threshold sits below the smallest measured size; fewer than 1536 tokens are not
# measured and keep the 4-pass path.
MIN_TOKENS_3PASS = 1536
# The same where the forward keeps fp32 logits (softcap, fp16): its token chunks took 1.17x and 1.43x the 4-pass
# path's time at those two ~2k-token shapes, 0.83-0.90x from 8192 tokens (H200, bf16, one run), with the d(logits)
# pass at 32 x 256 tiles, 4 warps and TMA; the shipped pass (_DLOGITS_BLOCKS) took a forced 3-pass step at
# 2169 x 896 x 151936 (fp16) to 0.90x, still above the 4-pass path's time by those figures.
MIN_TOKENS_FP32_LOGITS = 4096
# "auto" takes the chunked variant when its chunks hold at least this many tokens. Measured on the H200 (bf16, sum
# loss, one run, time / 3G): 2048-token chunks 1.15-1.20 where the 4-pass path took 1.41-1.47 (32768 x 4096 x
# 128256, 16384 x 3584 x 152064, 8192 x 2304 x 256000); 1024-token chunks 1.20-1.44, no better than the 4-pass
# path at V = 256000 (the fp32 d_weight sum is read and written once per chunk).
MIN_CHUNK_TOKENS = 1536
LOGITS_CHUNK_BUDGET = 256 * 2**20  # bytes of the forward's fp32 [C, V] logits of one token chunk, at least
LOGITS_CHUNK_MAX = 2**30  # and at most: a chunk takes what the memory budget leaves beside the kept d(logits)
DW_SLICE_BUDGET = 32 * 2**20  # bytes of the backward's fp32 [Vs, H] d_weight slice (small enough to stay in L2)
_SFT_OP = "lce.sft_dlogits"  # the d(logits) launch's name in tma.last_decision
# The 3-pass paths' own launches (d(logits) from logits or exponentials, d_weight, the split sum's rounding, and
# rl's d(logits) from exponentials), each bound once per problem (see LaunchCache.launch for what keys hold).
_LAUNCHES = LaunchCache("lce.3pass")
cached_launch = _LAUNCHES.launch
# The device-side reductions of an eager sum or mean loss (:func:`loss_scale`, :func:`loss_total`).
_REDUCE_LAUNCHES = LaunchCache("lce.reduce")


def padded_cols(V: int) -> int:
    """Row pitch of the kept d(logits) and of the logits scratch: 128-byte aligned rows for TMA."""
    return cdiv(V, 64) * 64


def chunk_bytes(N: int, V: int, H: int, elem: int) -> int:
    """Bytes of the forward's fp32 logits chunk: what :func:`budget_bytes` leaves beside the kept d(logits), within
    [``LOGITS_CHUNK_BUDGET``, ``LOGITS_CHUNK_MAX``]. Fewer, larger chunks leave fewer partly filled waves: measured on
    the H200, 1664-token chunks instead of 384 took the 3-pass step at 16384 x 3584 x 152064 from 1.28 to 1.19 x 3G
    (at 8192 x 4096 x 128256, 2048 instead of 512: 1.22 to 1.21)."""
    left = budget_bytes(V, H) - N * padded_cols(V) * elem
    return max(LOGITS_CHUNK_BUDGET, min(LOGITS_CHUNK_MAX, left))


def chunk_rows(V: int, block_m: int, budget: int | None = None) -> int:
    """Tokens per forward chunk: as many whole row blocks as fit ``budget`` bytes of fp32 logits (default
    ``LOGITS_CHUNK_BUDGET``; at least one row block)."""
    rows = (LOGITS_CHUNK_BUDGET if budget is None else budget) // (padded_cols(V) * 4)
    return max(block_m, rows // block_m * block_m)


def _slice_rows(V: int, width: int) -> int:
    """Rows of a vocab slice whose fp32 [rows, width] block fits ``DW_SLICE_BUDGET`` (a multiple of 256)."""
    rows = DW_SLICE_BUDGET // (4 * width)
    return min(V, max(256, rows // 256 * 256))


def fp32_logits(dtype: torch.dtype, softcap, label_smoothing=0.0) -> bool:
    """Whether the 3-pass forward keeps fp32 logits per token chunk rather than the exponentials: with softcap
    (the tanh factor needs each logit), with label smoothing (p A - eps/V would be a difference of nearly equal
    values formed after e's rounding, where p is close to eps/V) and for fp16 inputs (fp16 e loses its relative
    precision below 6.1e-5). Elsewhere p A + D has no such cancellation (D = 0) and e's one extra rounding is
    relative."""
    return bool(softcap) or bool(label_smoothing) or dtype == torch.float16


def extra_bytes(N: int, V: int, H: int, elem: int, *, logits: bool = False) -> int:
    """Peak extra memory of the 3-pass path beyond its inputs and gradients (``elem``: bytes per input element;
    ``logits``: :func:`fp32_logits` of the call): the kept d(logits) (and without ``logits`` the fp32 row factors
    and reference logits) plus the larger of the forward's fp32 logits chunk and the backward's scratch (fp32
    d_hidden, or the row-scaled hidden states, and for fp32 inputs a d_weight slice)."""
    ld = padded_cols(V)
    forward = min(N, chunk_rows(V, 128, chunk_bytes(N, V, H, elem))) * ld * 4 if logits else N * 8
    # 16-bit inputs: the label terms' token order (int64: the keys, the sorted keys and the order [N]; the probes
    # and the offsets [V + 1]) beside the fp32 d_hidden.
    backward = N * H * 4 + (_slice_rows(V, H) * H * 4 if elem == 4 else 24 * N + 16 * (V + 1))
    return N * ld * elem + max(forward, backward)


def budget_bytes(V: int, H: int) -> int:
    """What the 3-pass path may use under ``sft_path="auto"``: V x H x 4 bytes + ``EXTRA_BUDGET``."""
    return V * H * 4 + EXTRA_BUDGET


def check_sft_path(sft_path, reduction: str, *, sharded: bool = False) -> None:
    """ValueError for an unknown ``sft_path``, and for "3pass" or "chunked" where only the 4-pass path applies."""
    check_choice("sft_path", sft_path, SFT_PATHS)
    if sft_path in ("3pass", "chunked") and (reduction == "none" or sharded):
        what = "reduction='none'" if reduction == "none" else "a process_group (vocab-parallel)"
        raise ValueError(f"sft_path must be 'auto' or '4pass' with {what}, got {sft_path!r} (the 3-pass paths "
                         "are for sum and mean losses of an unsharded head)")


def use_3pass(sft_path: str, N: int, V: int, H: int, elem: int, *, logits: bool = False) -> bool:
    """Whether a differentiable sum/mean call takes the 3-pass path: ``"3pass"`` always, ``"4pass"`` never,
    ``"auto"`` when N >= ``MIN_TOKENS_3PASS`` (``MIN_TOKENS_FP32_LOGITS`` with ``logits``, :func:`fp32_logits` of
    the call) and :func:`extra_bytes` <= :func:`budget_bytes`."""
    check_choice("sft_path", sft_path, SFT_PATHS)
    if sft_path != "auto":
        return sft_path == "3pass"
    least = MIN_TOKENS_FP32_LOGITS if logits else MIN_TOKENS_3PASS
    return N >= least and extra_bytes(N, V, H, elem, logits=logits) <= budget_bytes(V, H)


def _chunk_fit(V: int, H: int, elem: int, *, logits: bool, need_hidden_grad: bool, need_weight_grad: bool,
               bias: bool, budget: int | None) -> int:
    """Tokens whose chunk memory fits what ``budget`` leaves beside the fp32 sums (0 or more, not rounded)."""
    # The d_weight sum: fp32 in the gradient's own memory (fp32 inputs), or its lower halves beside the upper ones
    # there (16-bit inputs: V x H x 2 bytes more).
    left = (budget_bytes(V, H) if budget is None else budget) - (V * H * 2 if need_weight_grad and elem == 2 else 0) \
        - (V * 4 if bias else 0)
    ld = padded_cols(V)
    # Per token: its d(logits) row; fp32 logits, or the reference logit, row factor and (for d_weight) scaled
    # hidden row; the fp32 d_hidden row.
    per_token = ld * elem + (ld * 4 if logits else 8 + (H * elem if need_weight_grad else 0)) \
        + (H * 4 if need_hidden_grad else 0)
    return max(0, left // per_token)


def chunk_tokens(V: int, H: int, elem: int, *, logits: bool = False, need_hidden_grad: bool = True,
                 need_weight_grad: bool = True, bias: bool = False, budget: int | None = None) -> int:
    """Tokens per chunk of the chunked variant: whole row blocks of 128 whose d(logits) (``elem`` bytes each), forward
    scratch (row factors and scaled hidden rows, or with ``logits`` fp32 logits) and fp32 d_hidden rows fit what ``budget`` (default
    :func:`budget_bytes`) leaves beside the fp32 d_weight sum's memory beyond the gradient's (V x H x 2 bytes for
    16-bit inputs, none for fp32) and the d_bias sum; at least one row block."""
    fit = _chunk_fit(V, H, elem, logits=logits, need_hidden_grad=need_hidden_grad,
                     need_weight_grad=need_weight_grad, bias=bias, budget=budget)
    return max(128, fit // 128 * 128)


def balanced_chunk(N: int, most: int, multiple: int = 128) -> int:
    """Tokens per chunk when N tokens go in as few chunks of at most ``most`` as possible, sized alike (multiples of
    ``multiple``, never above ``most``): no short last chunk, whose forward would fill the GPU worse."""
    count = cdiv(N, most)
    return min(most, cdiv(cdiv(N, count), multiple) * multiple)


def pick_path(sft_path: str, N: int, V: int, H: int, elem: int, *, logits: bool = False,
              need_hidden_grad: bool = True, need_weight_grad: bool = True, bias: bool = False) -> str:
    """The path a differentiable sum/mean call takes: "3pass", "chunked" or "4pass". A forced one as it is; ``"auto"``:
    below ``MIN_TOKENS_3PASS`` tokens (``MIN_TOKENS_FP32_LOGITS`` with ``logits``) "4pass"; "3pass" where
    :func:`use_3pass` holds and the weight needs a gradient; else "chunked" where its chunks
    (:func:`chunk_tokens`) hold ``MIN_CHUNK_TOKENS`` tokens or all N; else "4pass"."""
    check_choice("sft_path", sft_path, SFT_PATHS)
    if sft_path != "auto":
        return sft_path
    if N < (MIN_TOKENS_FP32_LOGITS if logits else MIN_TOKENS_3PASS):
        return "4pass"
    if need_weight_grad and use_3pass("auto", N, V, H, elem, logits=logits):
        return "3pass"
    fit = _chunk_fit(V, H, elem, logits=logits, need_hidden_grad=need_hidden_grad,
                     need_weight_grad=need_weight_grad, bias=bias, budget=None)
    return "chunked" if fit >= min(N, MIN_CHUNK_TOKENS) else "4pass"


_STORE_Z_TILE = 128 * 128  # BLOCK_N x BLOCK_V from which a forward that stores its logits is re-tiled


def store_z_config(cfg: KernelConfig) -> KernelConfig:
    """The forward's launch config when it also stores its fp32 logits (STORE_Z, with softcap). The store converts each tile
    to a coalesced layout through shared memory (BLOCK_N x BLOCK_V x 4 bytes): at 128 x 256 that is 128 KB
    beside a 3-stage pipeline's 144 KB, over sm_90's 227 KB, and the tile's addresses spill registers (so do
    128 x 128 tiles with 4 warps, and 128 x 128 x 128 with 3 stages needs 256 KB). So tiles of 128 x 128 or more
    run as 128 x 128 x 64 with 8 warps and 4 stages (192 KB, no spills: ``benchmarks/compile_lce_sm90.py``);
    smaller ones (fp32 inputs, the interpreter) as tuned."""
    return narrow_tiles(cfg, _STORE_Z_TILE)


def store_e_config(cfg: KernelConfig, dtype: torch.dtype, device) -> KernelConfig:
    """The forward's launch config when it stores the exponentials (STORE_E) on ``device``: where the label's
    logit of 128 x 256 tiles comes from its own kernel (:func:`.launch.label_by_mma`: 16-bit inputs on a Hopper
    GPU), tiles narrower than that are widened to 128 x 256 x 64 with 8 warps and 3 stages (group and flatten
    kept), at which the forward spills no registers (231 per thread on sm_90: ``benchmarks/compile_lce_sm90.py``).
    The tuned tiles serve the no-grad forward. Measured on the H200
    (whole SFT steps, tuned 128 x 128 forward tiles with the in-tile pick against these, 4 alternating rounds):
    0.967, 0.973 and 0.982 x the time for the chunked variant at 8192 x 2304 x 256000, 16384 x 3584 x 152064 and
    32768 x 4096 x 128256, 0.96 to 0.98 and 0.93 to 0.96 for the 3-pass path at 1937 x 3584 x 152064 and
    2169 x 896 x 151936, 0.975 to 1.023 at 4096 x 4096 x 128256. Elsewhere ``cfg`` as it is."""
    bm, bn, bk, warps, stages = _STORE_E_TILE
    if cfg.block_m * cfg.block_n >= bm * bn:
        return cfg
    wide = cfg.model_copy(update=dict(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages))
    return wide if label_by_mma(dtype, device, wide) else cfg


# store_e_config's tiles: BLOCK_N, BLOCK_V, BLOCK_K, warps, stages.
_STORE_E_TILE = (128, 256, 64, 8, 3)


def narrow_tiles(cfg: KernelConfig, min_tile: int) -> KernelConfig:
    """``cfg`` with tiles of ``min_tile`` (BLOCK_N x BLOCK_V) elements or more re-tiled to 128 x 128 x 64, 8 warps,
    4 stages (group and flatten kept): the tiling at which the forward's stores spill no registers on sm_90
    (:func:`store_z_config`, and ``rl.forward_config`` for stored exponentials); smaller tiles as they are."""
    if cfg.block_m * cfg.block_n < min_tile:
        return cfg
    return cfg.model_copy(update=dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4))


def _row_blocks() -> tuple[int, int]:
    # The d(logits) kernel is memory-bound: wide tiles for the GPU, small ones for the interpreter (cost per tile).
    return _DLOGITS_BLOCKS_INTERPRETED if _tma.interpreter_active() else _DLOGITS_BLOCKS


# lce_sft_dlogits_kernel (fp32 logits in, d(logits) out) on the GPU: 16 x 256 tiles, DLOGITS_WARPS warps, pointer
# loads and stores. H200, same run, time / a copy of the fp32 logits into a bf16 tensor (the same bytes):
# 1.13 / 1.14 / 1.12 x at 2169 x 151936, 2048 x 256000 (softcap) and 4096 x 128256, where 32 x 256 tiles with
# 4 warps and TMA took 2.21 / 1.62 / 2.19 x (the fastest TMA variant of each shape 1.40 to 1.54 x).
_DLOGITS_BLOCKS, _DLOGITS_BLOCKS_INTERPRETED = (16, 256), (16, 32)
_DLOGITS_POINTER = ("tma='auto': pointer loads and stores are faster for the d(logits) pass over fp32 logits "
                    "(measured on the H200)")


# Warps of the passes that form d(logits) from what a 3-pass forward kept (the RL path's lce_exp_dlogits_kernel
# and lce_sft_dlogits_kernel over fp32 logits). H200, bf16, 32 x 128 tiles, pointer loads, same run, time / a bf16
# copy of the same tensor: the RL pass (log-probs and entropies) 2.46 / 2.50 x with 8 warps against 2.88 / 2.85 x
# with 4 (8192 x 128256, 2169 x 151936). lce_sft_dlogits_kernel: with its tiles (above), 8 warps against 4 took
# 0.87 / 0.87 x at 2169 x 151936 and 4096 x 128256 (pointer loads, same run).
DLOGITS_WARPS = 8
# The 3-pass path's O(N) and O(N H) launches over exponentials: the row factors and label entries, the flagged rows'
# d(logits) (GPU, interpreter: BLOCK_N, BLOCK_V; BLOCK_K the forward's), and the row-scaled hidden states of the backward.
_ROWSCALE_BLOCK = 128
_ROWS_TILES, _ROWS_TILES_INTERPRETED = (64, 128), (16, 32)
_SCALE_TILES = (32, 256)


def _sft_scalars(opts: LceOptions) -> tuple:
    return (opts.ignore_index, float(opts.label_smoothing), float(opts.z_loss))


def _reduce_block() -> int:
    # The one-program reductions read this many tokens a step with _REDUCE_WARPS warps (few steps on the
    # interpreter's small tests too).
    return 64 if _tma.interpreter_active() else 4096


_REDUCE_WARPS = 8


def loss_scale(labels1d: torch.Tensor, ignore_index: int, mean: bool) -> torch.Tensor:
    """fp32 [1] on the labels' device: the upstream gradient of every kept token's loss for a reduced loss of
    gradient 1, 1 / max(1, kept tokens) for a mean, 1 for a sum; one launch (``lce_loss_scale_kernel``), no host
    sync. ``labels1d``: flat, contiguous."""
    _check_flat("labels1d", labels1d)
    scale = torch.empty(1, dtype=torch.float32, device=labels1d.device)
    N, block = labels1d.shape[0], _reduce_block()
    tensors = (labels1d, scale)
    key = ("loss_scale", labels1d.device, N, int(ignore_index), bool(mean), block, *state_key(),
           *tensors_key(tensors))
    _REDUCE_LAUNCHES.launch(key, lambda: (Launch(lce_loss_scale_kernel, (1,), *tensors, N, int(ignore_index),
                                                 MEAN=bool(mean), BLOCK=block, num_warps=_REDUCE_WARPS),
                                          None))(*tensors)
    return scale


def loss_total(loss: torch.Tensor, scale: torch.Tensor | None, *, share: bool = False):
    """``(total, share)``: the 0-dim fp32 ``scale[0] * sum(loss)`` of the per-token fp32 losses [N] (contiguous;
    ``scale`` None: 1, a sum), summed in a fixed order (bitwise reproducible), and with ``share`` an fp32 [N] of
    that scale for every token (each token's part of the total's upstream gradient; else None). One launch
    (``lce_loss_total_kernel``)."""
    _check_flat("loss", loss)
    if loss.dtype != torch.float32 or (scale is not None and (scale.dtype != torch.float32 or scale.numel() != 1)):
        raise TypeError("loss_total: fp32 losses and an fp32 [1] scale")
    N, dev, block = loss.shape[0], loss.device, _reduce_block()
    total = torch.empty((), dtype=torch.float32, device=dev)
    part = torch.empty(N, dtype=torch.float32, device=dev) if share else None
    tensors = (loss, total if scale is None else scale, total, part if share else total)
    key = ("loss_total", dev, N, scale is not None, bool(share), block, *state_key(), *tensors_key(tensors))
    _REDUCE_LAUNCHES.launch(key, lambda: (Launch(lce_loss_total_kernel, (1,), *tensors, N,
                                                 HAS_SCALE=scale is not None, SHARE=bool(share), BLOCK=block,
                                                 num_warps=_REDUCE_WARPS),
                                          None))(*tensors)
    return total, part


def _check_flat(name: str, t: torch.Tensor) -> None:
    if t.dim() != 1 or not t.is_contiguous():
        raise ValueError(f"{name} must be a flat contiguous tensor, got shape {tuple(t.shape)} and strides "
                         f"{t.stride()}")


def _joined(losses: list) -> torch.Tensor:
    """One fp32 [N] of the per-chunk losses (the one chunk's own tensor when there is one)."""
    return losses[0] if len(losses) == 1 else torch.cat(losses)


def lce_sft_forward(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, bias, opts: LceOptions,
                    *, mean: bool, config: KernelConfig | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(loss, dlogits, rho)``: the fp32 sum (or mean over kept tokens, 0.0 when none is kept) of the per-token
    loss of :func:`.launch.lce_forward`, and d loss / d (h @ w^T + b) for an upstream gradient of 1 on ``loss``
    as ``rho[:, None] * dlogits``: ``dlogits`` a [N, padded_cols(V)] buffer in the inputs' dtype (columns >= V
    unused), ``rho`` the fp32 [N] row factors, or an empty tensor where ``dlogits`` is d(logits) itself (with
    :func:`fp32_logits`). Inputs must be validated already. Extra memory: the returned buffers, or where
    :func:`fp32_logits` an fp32 [C, padded_cols(V)] logits chunk (:func:`chunk_bytes`) beside them."""
    _tma.check_interpreter(hidden2d.dtype, "lce.forward")
    N = hidden2d.shape[0]
    V, H = weight.shape
    dev, f32 = hidden2d.device, torch.float32
    ld = padded_cols(V)
    dl = torch.empty((N, ld), dtype=hidden2d.dtype, device=dev)
    if N == 0:
        return torch.zeros((), dtype=f32, device=dev), dl, _none(dev)
    # The upstream gradient of each kept token's loss, on the device (no host sync): 1 / kept tokens for "mean".
    scale = loss_scale(labels1d, opts.ignore_index, mean)
    if fp32_logits(hidden2d.dtype, opts.softcap, opts.label_smoothing):
        loss, rho = _forward_logits(hidden2d, weight, labels1d, bias, opts, dl, scale, config), _none(dev)
    else:
        rho = torch.empty(factor_rows(N, hidden2d.dtype), dtype=f32, device=dev)
        loss = _forward_exp(hidden2d, weight, labels1d, bias, opts, dl, scale, config, rho=rho[:N],
                            lab=rho[N:] if rho.numel() > N else None)[0]
    return loss_total(loss, scale)[0], dl, rho


def factor_rows(N: int, dtype: torch.dtype) -> int:
    """Length of the fp32 row-factor vector :func:`lce_sft_forward` returns where it keeps exponentials: the N row
    factors, then for 16-bit inputs the N label terms (``lce_sft_rowscale_kernel``'s SPLIT_LABEL)."""
    return N if dtype == torch.float32 else 2 * N


def _forward_logits(hidden2d, weight, labels1d, bias, opts: LceOptions, dl, scale, config, z=None) -> torch.Tensor:
    """The per-token losses (fp32 [N]), with d(logits) written to ``dl``: per token chunk, a forward that stores
    its fp32 logits, then d(logits) from them (any dtype and options; softcap's tanh factor needs the logits).
    ``z``: the fp32 [C, padded_cols(V)] logits buffer (C tokens a chunk), else one sized by :func:`chunk_bytes`."""
    N, H = hidden2d.shape
    V = weight.shape[0]
    cfg = config or store_z_config(pick_config("forward", hidden2d.dtype, N, H, hidden2d.device))
    if z is None:
        C = min(N, chunk_rows(V, cfg.block_m, chunk_bytes(N, V, H, hidden2d.element_size())))
        z = torch.empty((C, padded_cols(V)), dtype=torch.float32, device=hidden2d.device)
    C = z.shape[0]
    losses = []
    for c0 in range(0, N, C):
        rows = min(C, N - c0)
        lab = labels1d[c0:c0 + rows]
        loss, logprob, _, lse = lce_forward(hidden2d[c0:c0 + rows], weight, lab, bias, opts, need_entropy=False,
                                            config=cfg, pick_label=True, z_out=z)
        out = dl[c0:]
        tensors = (z, lab, lse, logprob, scale, out)
        key = ("dlogits", z.device, rows, V, z.stride(0), out.stride(0), opts, *state_key(),
               *tensors_key(tensors))
        cached_launch(key, lambda: _dlogits_launch(tensors, rows, V, opts))(*tensors)
        losses.append(loss)
    return _joined(losses)


def _dlogits_launch(tensors, rows: int, V: int, opts: LceOptions):
    """:func:`cached_launch`'s build of ``lce_sft_dlogits_kernel`` over ``rows`` tokens of fp32 logits."""
    z, out = tensors[0], tensors[-1]
    bn, bv = _row_blocks()
    d = _tma.decide(opts.tma, {"logits": (z, (bn, bv)), "dlogits": (out, (bn, bv))}, op=_SFT_OP, record=False,
                    auto_pointer=_DLOGITS_POINTER)
    launch = Launch(lce_sft_dlogits_kernel, (cdiv(rows, bn), cdiv(V, bv)), *tensors, rows, V, z.stride(0),
                    out.stride(0), *_sft_scalars(opts), float(opts.softcap or 1.0), opts.inv_temp,
                    BLOCK_N=bn, BLOCK_V=bv, SOFTCAP=softcap_mode(opts.softcap), Z_TMA=d["logits"], D_TMA=d["dlogits"],
                    num_warps=DLOGITS_WARPS)
    return launch, d


def _forward_exp(hidden2d, weight, labels1d, bias, opts: LceOptions, dl, scale, config, ref=None, rho=None,
                 lab=None):
    """``(loss, rho, lab)``: the per-token losses (fp32 [N]), the row factors (fp32 [N]) and, for 16-bit inputs,
    the label terms (fp32 [N]; else None), with ``dl`` holding e' such that d(logits) = rho[:, None] * e' plus, for
    16-bit inputs, lab[n] at each row's label column, whose entry in e' is 0 (bf16 or fp32, no softcap, no label
    smoothing). One forward over all tokens
    that stores e = exp(z - c) per row reference c (``e_out=(dl, ref)``, see ``lce_forward_kernel``'s E_REF), r the
    label's logit: from the forward's own label launch where it has one (:func:`.launch.label_by_mma`), else from
    an O(N H) fp32 dot before it; then ``lce_sft_rowscale_kernel`` (O(N): the factors and the
    label entries) and ``lce_sft_rows_kernel`` (the rows whose logits lie too far above their label's, if any).
    ``ref``, ``rho``, ``lab``: fp32 [>= N] buffers, else new ones."""
    N, H = hidden2d.shape
    V = weight.shape[0]
    dev = hidden2d.device
    split = hidden2d.dtype != torch.float32
    lab = None if not split else torch.empty(N, dtype=torch.float32, device=dev) if lab is None else lab[:N]
    cfg = config or store_e_config(pick_config("forward", hidden2d.dtype, N, H, dev), hidden2d.dtype, dev)
    ref = torch.empty(N, dtype=torch.float32, device=dev) if ref is None else ref[:N]
    rho = torch.empty(N, dtype=torch.float32, device=dev) if rho is None else rho[:N]
    b_arg = weight if bias is None else bias
    if not label_by_mma(hidden2d.dtype, dev, cfg):  # else the forward's own label launch writes ref
        tensors = (hidden2d, weight, b_arg, labels1d, ref)
        key = ("label_ref", dev, N, V, H, hidden2d.stride(), weight.stride(), bias is None, opts.inv_temp,
               *state_key(), *tensors_key(tensors))
        cached_launch(key, lambda: _label_ref_launch(tensors, N, V, H, bias is not None, opts))(*tensors)
    loss, logprob, _, lse = lce_forward(hidden2d, weight, labels1d, bias, opts, need_entropy=False, config=cfg,
                                        pick_label=True, e_out=(dl, ref))
    tensors = (dl, rho, ref, labels1d, lse, logprob, scale, rho if lab is None else lab)
    # Keyed by the scalars they take, not the call's options: no operand of these launches has a memory path.
    scalars = (opts.ignore_index, float(opts.z_loss), opts.inv_temp)
    key = ("rowscale", dev, N, V, dl.stride(0), scalars, split, *state_key(), *tensors_key(tensors))
    cached_launch(key, lambda: _rowscale_launch(tensors, N, V, opts, split))(*tensors)
    tensors = (hidden2d, weight, b_arg, dl, ref, labels1d, lse, logprob, scale)
    key = ("flagged_rows", dev, N, V, H, hidden2d.stride(), weight.stride(), dl.stride(0), bias is None,
           cfg.block_k, scalars, *state_key(), *tensors_key(tensors))
    cached_launch(key, lambda: _rows_launch(tensors, N, V, H, bias is not None, cfg.block_k, opts))(*tensors)
    return loss, rho, lab


def _label_ref_launch(tensors, N: int, V: int, H: int, has_bias: bool, opts: LceOptions):
    """:func:`cached_launch`'s build of ``lce_label_logit_kernel`` writing the reference logits of
    :func:`_forward_exp` (the label's logit; 0 at ignored tokens)."""
    h, w = tensors[:2]
    return Launch(lce_label_logit_kernel, (cdiv(N, _ROW_BLOCK),), *tensors, N, V, H, h.stride(0), h.stride(1),
                  w.stride(0), w.stride(1), 1.0, opts.inv_temp, BLOCK_N=_ROW_BLOCK, BLOCK_K=_ROW_BLOCK_K,
                  HAS_BIAS=has_bias, SOFTCAP=False), None


def _rowscale_launch(tensors, N: int, V: int, opts: LceOptions, split: bool):
    """:func:`cached_launch`'s build of ``lce_sft_rowscale_kernel`` (``split``: SPLIT_LABEL)."""
    return Launch(lce_sft_rowscale_kernel, (cdiv(N, _ROWSCALE_BLOCK),), *tensors, N, V, tensors[0].stride(0),
                  opts.ignore_index, float(opts.z_loss), opts.inv_temp, BLOCK=_ROWSCALE_BLOCK, E_OFFSET=E_OFFSET,
                  E_CLAMP=E_CLAMP, SPLIT_LABEL=split), None


def _label_order(labels1d: torch.Tensor, V: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, off)``: the tokens sorted stably by label (int64 [N]; labels outside [0, V) last) and where the
    tokens of each label v start in that order (int64 [V + 1]), on the device (no host sync): what the label terms
    of the d_weight and d_bias sums read (:func:`_label_term` in ``lce_dweight_kernel``, ``lce_label_sums_kernel``)."""
    key = torch.where((labels1d >= 0) & (labels1d < V), labels1d, V)
    sorted_keys, perm = torch.sort(key, stable=True)
    off = torch.searchsorted(sorted_keys, torch.arange(V + 1, device=labels1d.device, dtype=sorted_keys.dtype))
    return perm, off


def _dhidden(acc: torch.Tensor, rho: torch.Tensor, lab: torch.Tensor, labels1d: torch.Tensor, weight: torch.Tensor,
             g: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = round(g * (rho[:, None] * acc + lab[:, None] * weight[labels])) (``g`` None: 1), one launch of
    ``lce_sft_dhidden_kernel``: d_hidden rows of the exponentials path with its label terms in fp32."""
    N, H = acc.shape
    if N and H and out.stride(1) != 1:  # the kernel writes rows of unit column stride
        out.copy_(_dhidden(acc, rho, lab, labels1d, weight, g, torch.empty((N, H), dtype=out.dtype,
                                                                          device=out.device)))
    elif N and H:
        bn, bh = _SCALE_TILES
        gg = rho if g is None else g.reshape(1)
        tensors = (acc, rho, lab, labels1d, weight, gg, out)
        key = ("dhidden", acc.device, N, H, weight.shape[0], acc.stride(0), weight.stride(), out.stride(0),
               g is None, *state_key(), *tensors_key(tensors))
        cached_launch(key, lambda: (Launch(lce_sft_dhidden_kernel, (cdiv(N, bn), cdiv(H, bh)), *tensors, N,
                                           weight.shape[0], H, acc.stride(0), weight.stride(0), weight.stride(1),
                                           out.stride(0), BLOCK_N=bn, BLOCK_H=bh, HAS_G=g is not None),
                                    None))(*tensors)
    return out


def _add_label_sums(out: torch.Tensor, perm: torch.Tensor, off: torch.Tensor, lab: torch.Tensor) -> torch.Tensor:
    """out[v] += the sum of the label terms of the tokens labelled v (fp32 [V], in place; ``lce_label_sums_kernel``)."""
    V = out.shape[0]
    if V:
        tensors = (off, perm, lab, out)
        key = ("label_sums", out.device, V, *state_key(), *tensors_key(tensors))
        cached_launch(key, lambda: (Launch(lce_label_sums_kernel, (cdiv(V, _LABEL_SUMS_BLOCK),), *tensors, V,
                                           BLOCK=_LABEL_SUMS_BLOCK, STEP=_LABEL_SUMS_STEP), None))(*tensors)
    return out


def _rows_launch(tensors, N: int, V: int, H: int, has_bias: bool, block_k: int, opts: LceOptions):
    """:func:`cached_launch`'s build of ``lce_sft_rows_kernel`` (pointer loads: a rare path) with the forward's K
    step ``block_k``: its logits are then the forward's own, whose LSE it takes (a logit of ~500 summed in another
    order would differ by ~1e-5, and its p by as much relatively)."""
    h, w, _, dl = tensors[:4]
    bn, bv = _ROWS_TILES_INTERPRETED if _tma.interpreter_active() else _ROWS_TILES
    bk = block_k
    return Launch(lce_sft_rows_kernel, (cdiv(N, bn), cdiv(V, bv)), *tensors, N, V, H, h.stride(0), h.stride(1),
                  w.stride(0), w.stride(1), dl.stride(0), opts.ignore_index, float(opts.z_loss), opts.inv_temp,
                  BLOCK_N=bn, BLOCK_V=bv, BLOCK_K=bk, HAS_BIAS=has_bias, DOT_PRECISION=dot_precision(h.dtype),
                  E_OFFSET=E_OFFSET, E_CLAMP=E_CLAMP), None


def _row_scaled(x: torch.Tensor, rho: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """round(rho[:, None] * x) in x's dtype (fp32 product, one rounding): one launch of ``lce_row_scale_kernel``
    into ``out`` (an [N, H] tensor with unit column stride) or a new contiguous tensor."""
    N, H = x.shape
    out = torch.empty((N, H), dtype=x.dtype, device=x.device) if out is None else out
    if N and H:
        bn, bh = _SCALE_TILES
        tensors = (x, rho, out)
        key = ("row_scale", x.device, N, H, x.stride(), out.stride(0), *state_key(), *tensors_key(tensors))
        cached_launch(key, lambda: (Launch(lce_row_scale_kernel, (cdiv(N, bn), cdiv(H, bh)), *tensors, N, H,
                                           x.stride(0), x.stride(1), out.stride(0), BLOCK_N=bn, BLOCK_H=bh),
                                    None))(*tensors)
    return out


def _weighted_cols(dl: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """fp32 [V]: sum over rows n of rho[n] * dl[n, :] (the d_bias sum of a row-scaled d(logits)). 16-bit ``dl``:
    one GEMM with fp32 accumulation against rho split into two 16-bit rows (hi + lo carries rho to ~2^-17)."""
    if dl.dtype == torch.float32:
        return rho @ dl
    hi = rho.to(dl.dtype)
    two = torch.stack((hi, (rho - hi.float()).to(dl.dtype)))
    acc = torch.empty((2, dl.shape[1]), dtype=torch.float32, device=dl.device)
    _acc_mm_f32(acc, two, dl, beta=0)
    return acc.sum(0)


class DwTiles(NamedTuple):
    """One launch shape of ``lce_dweight_kernel``: tiles, tile group, warps, pipeline stages, the epilogue's
    column slices (``epi_sub``), whether one persistent program per SM loops over the tiles (``persistent``,
    with the tile and K loops fused when ``flatten``), and whether the epilogue may use TMA (``epi_tma``; False:
    pointer loads and stores there whatever the call's mode)."""

    block_v: int
    block_h: int
    block_k: int
    group: int
    warps: int
    stages: int
    epi_sub: int = 1
    persistent: bool = False
    flatten: bool = False
    epi_tma: bool = True


# lce_dweight_kernel's launch shapes: 128 x 256 x 64 tiles with a 3-stage pipeline, 256 x 128 where H is no
# multiple of 256 (no half-empty hidden tile); one persistent program per SM with the tile and K loops fused, so
# that the next tile's first operand loads are issued under this tile's epilogue. Measured on the H200 (bf16,
# benchmarks/results/dweight_NVIDIA_H200.csv), time / cuBLAS's bf16 d(logits)^T @ h: 1.02 at 128256 x 4096 x 8192
# tokens, 0.95 at 152064 x 3584 x 1937, 0.99 at 151936 x 896 x 2169 (256 x 128); one program a tile took 1.03,
# 1.19 and 1.17 there.
DW_TILES = DwTiles(128, 256, 64, 8, 8, 3, persistent=True, flatten=True)
DW_TILES_NARROW = DwTiles(256, 128, 64, 8, 8, 3, persistent=True, flatten=True)
# The chunked variant's split launches (the fp32 sum held so far read and written in the epilogue): the same tiles
# and loop, the epilogue in four column slices through pointer loads and stores. A slice's halves and its part of
# the sum are live one slice at a time (the whole 128 x 256 tile at once spills 660 bytes per thread:
# benchmarks/compile_lce_sm90.py). Same run, time / cuBLAS's addmm of the same product into an fp32 C (the same
# bytes): 1.04, 1.08 and 1.10 at the chunks "auto" runs at 32768 x 4096 x 128256, 16384 x 3584 x 152064 and
# 8192 x 2304 x 256000 (5504, 4096 and 2816 tokens); one program a tile with the whole tile's epilogue took 1.10,
# 1.16 and 1.32; TMA loads and stores in the sliced epilogue 1.09 to 1.35 (each slice waits for its loads).
# An L2 prefetch of each tile's rows of the sum (sm_90's bulk prefetch, issued before the tile's K loop) left the
# whole chunked step level: 0.99 to 1.02 x at those three shapes (H100, same run, gradients bitwise equal).
DW_SPLIT_TILES = DwTiles(128, 256, 64, 8, 8, 3, epi_sub=4, persistent=True, flatten=True, epi_tma=False)
DW_SPLIT_TILES_NARROW = DwTiles(256, 128, 64, 8, 8, 3, epi_sub=4, persistent=True, flatten=True, epi_tma=False)
# Under the interpreter: small tiles, and the persistent loop and sliced epilogue over a few programs, so that
# CPU tests walk the branches the GPU shapes take (TMA epilogues: the tests pass tiles of their own).
_DW_TILES_INTERPRETED = DwTiles(16, 32, 16, 4, 4, 1, persistent=True, flatten=True)
_DW_SPLIT_TILES_INTERPRETED = DwTiles(16, 32, 16, 4, 4, 1, epi_sub=2, persistent=True, flatten=True,
                                      epi_tma=False)
_DW_PROGRAMS_INTERPRETED = 3
_DW_OP = "lce.sft_dweight"  # its launch's name in tma.last_decision


def dweight_tiles(H: int, split: bool) -> DwTiles:
    """The launch shape of ``lce_dweight_kernel`` for hidden size ``H``; ``split``: the chunked variant's."""
    if _tma.interpreter_active():
        return _DW_SPLIT_TILES_INTERPRETED if split else _DW_TILES_INTERPRETED
    wide, narrow = (DW_SPLIT_TILES, DW_SPLIT_TILES_NARROW) if split else (DW_TILES, DW_TILES_NARROW)
    return wide if H % wide.block_h == 0 else narrow


def _dweight(dl: torch.Tensor, hidden2d: torch.Tensor, g: torch.Tensor, d_w: torch.Tensor, tma: str, *,
             lo: torch.Tensor | None = None, accumulate: bool = False, tiles: DwTiles | None = None,
             labels: tuple | None = None) -> None:
    """d_w = round(g * (dl^T @ hidden2d)) for 16-bit inputs, one launch of ``lce_dweight_kernel``. With ``lo``
    (int16, d_w's shape; the chunked variant): the fp32 product, or with ``accumulate`` its sum with the fp32
    numbers held so far, kept exactly as upper halves in d_w's memory and lower halves in ``lo`` (g not applied;
    :func:`_finalize_split` does that). ``tiles``: the launch shape, else :func:`dweight_tiles`'s. ``labels``:
    ``(r, labels1d, perm, off, lab)``, the label terms added to the fp32 sum (:func:`_label_term`): the hidden rows
    r they multiply, the labels, :func:`_label_order`'s perm and off, and the fp32 terms."""
    N, H = hidden2d.shape
    V = d_w.shape[0]
    t = tiles or dweight_tiles(H, lo is not None)
    out = d_w if lo is None else d_w.view(torch.int16)
    r, lab_ids, perm, off, lab = labels if labels is not None else (hidden2d, g, g, g, g)
    tensors = (dl, hidden2d, g, out, out if lo is None else lo, r, lab_ids, perm, off, lab)
    key = ("dweight", dl.device, N, V, H, dl.stride(0), hidden2d.stride(), out.stride(0), lo is None,
           bool(accumulate), t, tma, labels is not None, r.stride(), *state_key(), *tensors_key(tensors))
    cached_launch(key, lambda: _dweight_launch(tensors, N, V, H, t, tma, lo is not None, accumulate,
                                               labels is not None))(*tensors)


def _dweight_launch(tensors, N: int, V: int, H: int, t: DwTiles, tma: str, split: bool, accumulate: bool,
                    has_labels: bool = False):
    """:func:`cached_launch`'s build of ``lce_dweight_kernel`` (see :func:`_dweight`)."""
    dl, hidden2d, _, out, lo, r = tensors[:6]
    box = (t.block_v, t.block_h // t.epi_sub)
    operands = {"dlogits": (dl, (t.block_k, t.block_v)), "hidden": (hidden2d, (t.block_k, t.block_h))}
    if t.epi_tma:
        operands["dweight"] = (out, box)
        if split:
            operands["dweight_lo"] = (lo, box)
    d = _tma.decide(tma, operands, op=_DW_OP, record=False)
    o_tma = d.use.get("dweight", False) and d.use.get("dweight_lo", True)
    if split and t.epi_tma and d.use["dweight"] != d.use["dweight_lo"]:
        # One flag serves both halves: pointers for both, and a decision that says so.
        d = _tma.decide(tma, {k: v for k, v in operands.items() if not k.startswith("dweight")}, op=_DW_OP,
                        record=False)
    tiles_total = cdiv(V, t.block_v) * cdiv(H, t.block_h)
    if not t.persistent:
        programs = 0
    elif _tma.interpreter_active():
        programs = min(tiles_total, _DW_PROGRAMS_INTERPRETED)
    else:
        programs = min(tiles_total, _sm_count(dl.device))
    launch = Launch(
        lce_dweight_kernel, (programs or tiles_total,), *tensors, N, V, H, dl.stride(0), hidden2d.stride(0),
        hidden2d.stride(1), out.stride(0), r.stride(0), r.stride(1), HAS_LABELS=has_labels,
        BLOCK_V=t.block_v, BLOCK_H=t.block_h, BLOCK_K=t.block_k, GROUP_V=t.group, D_TMA=d["dlogits"],
        H_TMA=d["hidden"], O_TMA=o_tma, DOT_PRECISION=dot_precision(hidden2d.dtype),
        SPLIT=0 if not split else 1 + accumulate, EPI_SUB=t.epi_sub, NUM_PROGRAMS=programs, FLATTEN=t.flatten,
        num_warps=t.warps, num_stages=t.stages,
    )
    return launch, d


_FINALIZE_BLOCK = 1024
_LABEL_SUMS_BLOCK = 128
_LABEL_SUMS_STEP = 16


def _finalize_split(hi: torch.Tensor, lo: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = round(g * x) for the fp32 numbers x kept as upper halves in ``hi``'s memory (a contiguous 16-bit
    tensor) and lower halves in ``lo`` (int16); ``out`` may be ``hi`` itself. One launch."""
    n = hi.numel()
    if n:
        tensors = (hi.view(torch.int16), lo, g.reshape(1), out)
        key = ("finalize", out.device, n, *state_key(), *tensors_key(tensors))
        cached_launch(key, lambda: (Launch(lce_split_finalize_kernel, (cdiv(n, _FINALIZE_BLOCK),), *tensors, n,
                                           BLOCK=_FINALIZE_BLOCK), None))(*tensors)
    return out


def _scaled(acc: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out = round(g * acc): the product in fp32, one rounding to out's dtype."""
    return torch.mul(acc, g, out=out)


def lce_sft_backward(hidden2d: torch.Tensor, weight: torch.Tensor, bias, dlogits: torch.Tensor, g: torch.Tensor,
                     *, need_hidden_grad: bool = True, need_weight_grad: bool = True, tma: str = "auto",
                     hidden_grad_out: torch.Tensor | None = None, rho: torch.Tensor | None = None,
                     labels: torch.Tensor | None = None):
    """``(d_hidden [N, H], d_weight [V, H], d_bias [V] or None)`` of the 3-pass path in the inputs' dtype, from
    the forward's ``dlogits`` (:func:`lce_sft_forward`) and the 0-dim upstream gradient ``g`` of its loss (read on
    the device); ``tma``: the call's memory-path mode. Each gradient is one fp32-accumulating GEMM over its whole K dim, times g in fp32, rounded once:
    d_hidden through cuBLAS (fp32 output, then g), d_weight of 16-bit inputs in ``lce_dweight_kernel`` (g applied
    in its epilogue), of fp32 inputs through cuBLAS in vocab slices. ``hidden_grad_out``: an [N, H] tensor in the
    inputs' dtype that receives d_hidden (rows of a larger gradient, say), else a new one. ``rho``: fp32 [N] row
    factors of d(logits) = rho[:, None] * dlogits (:func:`lce_sft_forward`; None or empty: none), applied to the
    GEMMs' small operands and results: d_hidden = round((g rho)[:, None] * (dlogits @ w)) from the fp32 product,
    d_weight = round(g * (dlogits^T @ round(rho[:, None] * h))) (h's rows scaled in fp32 and rounded once to the
    inputs' dtype, the same relative error as dlogits' own rounding), d_bias from fp32 sums. ``rho`` of 2N entries
    (:func:`factor_rows`: 16-bit inputs) holds the label terms after the factors, and ``labels`` (the forward's,
    [N]) is required: each row's label term lab[n] is added in fp32, as lab[n] * w[labels[n]] to d_hidden's row
    and lab[n] * h[n] to d_weight's row labels[n] (its entry in dlogits being 0), before the one rounding.
    Extra memory: fp32 [N, H] for d_hidden (and for fp32 inputs one fp32 d_weight slice, ``DW_SLICE_BUDGET``), and
    with ``rho`` the scaled hidden states ([N, H], the inputs' dtype)."""
    N, H = hidden2d.shape
    V = weight.shape[0]
    dev, dt = hidden2d.device, hidden2d.dtype
    dl = dlogits[:, :V]
    g = g.to(device=dev, dtype=torch.float32)
    if rho is not None and rho.numel() == 0:
        rho = None
    lab = None
    if rho is not None and rho.numel() == 2 * N and N:
        if labels is None:
            raise ValueError("lce_sft_backward: row factors with label terms (2N entries) need the labels")
        rho, lab = rho[:N], rho[N:]
    # The factor of d_hidden's fp32 rows: g, or g times each row's factor ([N, 1]).
    g_rows = g if rho is None or lab is not None else (rho * g)[:, None]
    d_h = None
    if need_hidden_grad:
        d_h = torch.empty((N, H), dtype=dt, device=dev) if hidden_grad_out is None else hidden_grad_out
    d_w = torch.empty((V, H), dtype=dt, device=dev) if need_weight_grad else None
    d_b = order = None
    if bias is not None:
        d_b = torch.empty(V, dtype=bias.dtype, device=dev)
        order = _label_order(labels, V) if lab is not None else None
        sums = dl.sum(0, dtype=torch.float32) if rho is None or N == 0 else _weighted_cols(dl, rho)
        _scaled(sums if lab is None else _add_label_sums(sums, *order, lab), g, d_b)
    if N == 0:
        return tuple(t.zero_() if t is not None else None for t in (d_h, d_w, d_b))
    if need_hidden_grad:
        acc = torch.empty((N, H), dtype=torch.float32, device=dev)
        # One GEMM over all V columns where cuBLAS accumulates 16-bit inputs into fp32 output; otherwise vocab
        # slices bound the fp32 copies of d(logits) that the fallback makes.
        step = V if fast_mm_f32(dl) else _slice_rows(V, N)
        for v0 in range(0, V, step):
            _acc_mm_f32(acc, dl[:, v0:v0 + step], weight[v0:v0 + step], beta=int(v0 > 0))
        if lab is None:
            _scaled(acc, g_rows, d_h)
        else:
            _dhidden(acc, rho, lab, labels, weight, g, d_h)
        del acc  # its memory serves the scaled hidden states
    h_w = hidden2d if rho is None or not need_weight_grad else _row_scaled(hidden2d, rho)
    if need_weight_grad and dt != torch.float32:
        terms = None
        if lab is not None:
            terms = (hidden2d, labels, *(order or _label_order(labels, V)), lab)
        _dweight(dl, h_w, g.reshape(1), d_w, tma, labels=terms)
    elif need_weight_grad:
        rows = _slice_rows(V, H)
        acc = torch.empty((min(rows, V), H), dtype=torch.float32, device=dev)
        for v0 in range(0, V, rows):
            n = min(rows, V - v0)
            # d_weight rows of this slice: one GEMM over all N tokens (K = N), fp32 out, then g and one rounding.
            _acc_mm_f32(acc[:n], dl[:, v0:v0 + n].t(), h_w, beta=0)
            _scaled(acc[:n], g, d_w[v0:v0 + n])
    return d_h, d_w, d_b


def lce_sft_chunked_forward(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, bias,
                            opts: LceOptions, *, mean: bool, need_hidden_grad: bool = True,
                            need_weight_grad: bool = True, chunk: int | None = None,
                            config: KernelConfig | None = None):
    """``(loss, d_hidden, d_weight, d_weight_lo, d_bias_sum)`` of the chunked variant for an upstream gradient of 1:
    the fp32 sum (or mean over kept tokens) of the per-token loss; d_hidden [N, H] in the inputs' dtype; the fp32
    d_weight sum over every token, for fp32 inputs as the [V, H] fp32 tensor d_weight, for 16-bit ones held exactly
    as the upper 16 bits of each number in d_weight's memory ([V, H], the inputs' dtype, not a gradient yet) and the
    lower 16 bits in the int16 [V, H] d_weight_lo; the fp32 [V] d_bias sum. One not asked for (``need_*``; d_bias
    without bias; d_weight_lo for fp32) is an empty tensor. ``chunk``: tokens per chunk (default
    :func:`chunk_tokens`). Inputs must be validated already. :func:`lce_sft_chunked_backward` applies the upstream
    gradient."""
    _tma.check_interpreter(hidden2d.dtype, "lce.forward")
    N, H = hidden2d.shape
    V = weight.shape[0]
    dev, dt, f32 = hidden2d.device, hidden2d.dtype, torch.float32
    split = need_weight_grad and dt != f32
    d_h = torch.empty((N, H), dtype=dt, device=dev) if need_hidden_grad else _none(dev)
    d_w = torch.empty((V, H), dtype=dt, device=dev) if need_weight_grad else _none(dev)
    lo = torch.empty((V, H), dtype=torch.int16, device=dev) if split else _none(dev)
    d_b = torch.zeros(V, dtype=f32, device=dev) if bias is not None else _none(dev)
    if N == 0:
        d_w.zero_()  # upper and lower halves of +0.0
        lo.zero_()
        return torch.zeros((), dtype=f32, device=dev), d_h, d_w, lo, d_b
    scale = loss_scale(labels1d, opts.ignore_index, mean)
    logits = fp32_logits(dt, opts.softcap, opts.label_smoothing)
    C = chunk or balanced_chunk(N, chunk_tokens(V, H, hidden2d.element_size(), logits=logits,
                                                need_hidden_grad=need_hidden_grad, need_weight_grad=need_weight_grad,
                                                bias=bias is not None))
    C = min(N, C)
    ld = padded_cols(V)
    dl = torch.empty((C, ld), dtype=dt, device=dev)
    if logits:
        cfg = config or store_z_config(pick_config("forward", dt, C, H, dev))
        scratch = torch.empty((C, ld), dtype=f32, device=dev)
    else:
        cfg = config or store_e_config(pick_config("forward", dt, C, H, dev), dt, dev)
        # The reference logits, the row factors and (16-bit inputs) the label terms.
        scratch = torch.empty((3, C), dtype=f32, device=dev)
        # The chunk's hidden rows scaled by its row factors: the d_weight GEMM's operand.
        h_w = torch.empty((C, H), dtype=dt, device=dev) if need_weight_grad else None
    # fp32 rows of d_hidden where cuBLAS returns 16-bit inputs' products in fp32: one rounding into d_h.
    acc_h = torch.empty((C, H), dtype=f32, device=dev) if need_hidden_grad and dt != f32 else None
    losses = []
    for c0 in range(0, N, C):
        rows = min(C, N - c0)
        h_c, lab, dl_c = hidden2d[c0:c0 + rows], labels1d[c0:c0 + rows], dl[:rows]
        terms = order = None
        if logits:
            losses.append(_forward_logits(h_c, weight, lab, bias, opts, dl_c, scale, cfg, z=scratch[:rows]))
            rho = None
        else:
            loss, rho, terms = _forward_exp(h_c, weight, lab, bias, opts, dl_c, scale, cfg, ref=scratch[0],
                                            rho=scratch[1], lab=scratch[2])
            losses.append(loss)
            if terms is not None and (need_weight_grad or bias is not None):
                order = _label_order(lab, V)
            raw = h_c
            if need_weight_grad:
                h_c = _row_scaled(h_c, rho, h_w[:rows])
        d = dl_c[:, :V]
        if need_hidden_grad and acc_h is None:
            torch.mm(d, weight, out=d_h[c0:c0 + rows])
            if rho is not None:
                d_h[c0:c0 + rows].mul_(rho[:, None])
        elif need_hidden_grad:
            # One GEMM over all V columns where cuBLAS returns 16-bit products in fp32; otherwise vocab slices bound
            # the fp32 copies of the operands that the fallback makes.
            step = V if fast_mm_f32(d) else _slice_rows(V, rows)
            for v0 in range(0, V, step):
                _acc_mm_f32(acc_h[:rows], d[:, v0:v0 + step], weight[v0:v0 + step], beta=int(v0 > 0))
            if rho is None:
                d_h[c0:c0 + rows].copy_(acc_h[:rows])
            elif terms is None:
                torch.mul(acc_h[:rows], rho[:, None], out=d_h[c0:c0 + rows])
            else:
                _dhidden(acc_h[:rows], rho, terms, lab, weight, None, d_h[c0:c0 + rows])
        if split:
            _dweight(d, h_c, scale, d_w, opts.tma, lo=lo, accumulate=c0 > 0,
                     labels=None if terms is None else (raw, lab, *order, terms))
        elif need_weight_grad:
            _acc_mm_f32(d_w, d.t(), h_c, beta=int(c0 > 0))
        if bias is not None:
            d_b += d.sum(0, dtype=f32) if rho is None else _weighted_cols(d, rho)
            if terms is not None:
                _add_label_sums(d_b, *order, terms)
    return loss_total(_joined(losses), scale)[0], d_h, d_w, lo, d_b


def _none(dev) -> torch.Tensor:
    """The placeholder of a gradient not computed: an empty fp32 tensor (custom-op outputs are tensors)."""
    return torch.empty(0, dtype=torch.float32, device=dev)


def lce_sft_chunked_backward(d_hidden: torch.Tensor, d_weight: torch.Tensor, d_weight_lo: torch.Tensor,
                             d_bias_sum: torch.Tensor, g: torch.Tensor, bias_dtype: torch.dtype | None, *,
                             in_place: bool = False):
    """``(d_hidden, d_weight, d_bias)`` of the chunked variant for the 0-dim upstream gradient ``g`` of its loss,
    from :func:`lce_sft_chunked_forward`'s outputs: each fp32 sum times g in fp32, rounded once to its gradient's
    dtype (d_hidden, rounded in the forward already, is rounded again unless g is a power of two). ``in_place``:
    d_hidden and d_weight become the gradients in their own memory (no second buffers; what was kept then serves
    one backward). A gradient the forward did not compute (an empty input; d_bias without ``bias_dtype``) gives
    None."""
    g = g.to(device=d_hidden.device, dtype=torch.float32)
    d_h = d_w = d_b = None
    if d_hidden.dim() == 2:
        d_h = d_hidden if in_place else torch.empty_like(d_hidden, memory_format=torch.contiguous_format)
        # The product in fp32 (a 16-bit operand would round g first), in row slices of <= DW_SLICE_BUDGET bytes.
        step = max(1, DW_SLICE_BUDGET // (4 * max(1, d_hidden.shape[1])))
        for r0 in range(0, d_hidden.shape[0], step):
            _scaled(d_hidden[r0:r0 + step].float(), g, d_h[r0:r0 + step])
    if d_weight.dim() == 2:
        d_w = d_weight if in_place else torch.empty_like(d_weight)
        if d_weight_lo.dim() == 2:
            _finalize_split(d_weight, d_weight_lo, g, d_w)
        else:
            _scaled(d_weight, g, d_w)
    if bias_dtype is not None:
        d_b = _scaled(d_bias_sum, g, torch.empty(d_bias_sum.shape, dtype=bias_dtype, device=g.device))
    return d_h, d_w, d_b
