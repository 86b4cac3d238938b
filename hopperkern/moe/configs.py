"""Launch configs of fused_moe: the tuning file when it has this shape, else heuristics.

Lookup (:func:`moe_launch_config`): under Triton's interpreter a small fixed config (CPU CI pays per tile);
otherwise ``hopperkern.tuning.load_config().moe_config(E, H, I, dtype, T)`` (nearest token bucket), and when
that is None, :func:`heuristic_config`. A tuning file that exists but lacks the shape warns once per shape key
(the loader itself warns once when no file exists). Tune with ``python -m benchmarks.tune_moe``.
"""

from __future__ import annotations

import warnings

from ..tma import capability, interpreter_active
from ..tuning import KernelConfig, MoeConfig, load_config, moe_key
from .align import max_blocks_for

__all__ = ["INTERPRETER_CONFIG", "heuristic_config", "moe_launch_config", "pick_block_m"]

INTERPRETER_CONFIG = MoeConfig(
    gemm1=KernelConfig(block_m=16, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1),
    gemm2=KernelConfig(block_m=16, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1),
)

_WARNED_KEYS: set = set()


def pick_block_m(T: int, top_k: int, E: int) -> int:
    """Rows per block from the mean slots per expert: 16 for decode (padding waste dominates), up to 128 for
    prefill (wgmma-sized tiles)."""
    per_expert = T * top_k / max(E, 1)
    if per_expert <= 16:
        return 16
    if per_expert <= 32:
        return 32
    if per_expert <= 96:
        return 64
    return 128


def _narrow_n(N: int, blocks: int, sms: int, widest: int) -> int:
    """Widest block_n <= ``widest`` that still gives >= 2 programs per SM over ``blocks`` row blocks (tiny
    batches are weight-bandwidth bound: every SM must stream weights)."""
    bn = widest
    while bn > 16 and blocks * -(-N // bn) < 2 * sms:
        bn //= 2
    return bn


def heuristic_config(E: int, H: int, I: int, T: int, top_k: int, sm_count: int | None = None) -> MoeConfig:  # noqa: E741
    """A reasonable untuned config for (E, H, I) at T tokens with top_k experts per token."""
    sms = sm_count or 132
    bm = pick_block_m(T, top_k, E)
    if bm <= 32:
        # Decode: weight-bandwidth bound. Estimated live blocks ~ one per active expert.
        blocks = max(1, min(max_blocks_for(T * top_k, E, bm), E))
        g1 = KernelConfig(block_m=bm, block_n=_narrow_n(I, blocks, sms, 64), block_k=128, group_m=1,
                          num_warps=4, num_stages=4)
        g2 = KernelConfig(block_m=bm, block_n=_narrow_n(H, blocks, sms, 64), block_k=128, group_m=1,
                          num_warps=4, num_stages=4)
    elif bm == 64:
        g1 = KernelConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)
        g2 = KernelConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)
    else:
        # Two [128, 128] fp32 accumulators (gate and up) in GEMM1: 8 warps; 3 stages of 48 KiB fit in smem.
        g1 = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)
        g2 = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4)
    return MoeConfig(gemm1=g1, gemm2=g2)


def moe_launch_config(E: int, H: int, I: int, dtype, T: int, top_k: int) -> tuple[MoeConfig, str]:  # noqa: E741
    """(config, where it came from) for fused_moe on (E, H, I, dtype) with T tokens."""
    if interpreter_active():
        return INTERPRETER_CONFIG, "interpreter"
    tuning = load_config()
    cfg = tuning.moe_config(E, H, I, dtype, T)
    if cfg is not None:
        return cfg, tuning.origin
    if not tuning.is_default:
        key = (tuning.origin, moe_key(E, H, I, dtype))
        if key not in _WARNED_KEYS:
            _WARNED_KEYS.add(key)
            warnings.warn(
                f"hopperkern: tuning file {tuning.origin} has no MoE entry {key[1]}; using heuristics. "
                f"Tune it with: python -m benchmarks.tune_moe",
                stacklevel=3,
            )
    return heuristic_config(E, H, I, T, top_k, capability().sm_count), "heuristics"
