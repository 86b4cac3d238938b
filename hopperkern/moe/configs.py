"""Launch configs of fused_moe: the tuning file when it has this shape, else heuristics.

Lookup (:func:`moe_launch_config`): under Triton's interpreter a small fixed config (CPU CI pays per tile);
otherwise ``hopperkern.tuning.load_config(<the inputs' GPU>).moe_config(E, H, I, dtype, T)`` (nearest token
bucket), and when that is None, :func:`heuristic_config` with that GPU's SM count. A tuning file that exists
but lacks the shape warns once per shape key (the loader itself warns once when no file exists). Tune with
``python -m hopperkern.tune --only moe``.
"""

from __future__ import annotations

import warnings

from ..tma import capability, interpreter_active
from ..tma.launcher import chain_launches, pdl_enabled
from ..tuning import KernelConfig, MoeConfig, load_config, moe_key
from .align import max_blocks_for

__all__ = ["INTERPRETER_CONFIG", "PDL_MAX_TOKENS", "atomic_config", "chain_decode", "heuristic_config",
           "moe_launch_config", "num_programs", "pick_block_m",
           "programs_per_sm", "smem_bytes"]

INTERPRETER_CONFIG = MoeConfig(
    gemm1=KernelConfig(block_m=16, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1),
    gemm2=KernelConfig(block_m=16, block_n=32, block_k=32, group_m=4, num_warps=4, num_stages=1),
)

_WARNED_KEYS: set = set()
_CHOSEN: dict = {}  # (tuning file object id, shape, dtype, T, top_k, SMs) -> (the file object, (config, origin))

_SMEM_PER_SM = 228 * 1024     # sm_90: 228 KiB per SM (227 KiB per block), 1 KiB of it reserved per resident block
_SMEM_PER_BLOCK = 227 * 1024
_REGS_PER_SM = 64 * 1024
_THREADS_PER_SM = 2048
_MAX_PROGRAMS_PER_SM = 4      # beyond 4 resident programs the gain in latency hiding is small
_INTERPRETER_PROGRAMS = 2     # CPU tests: few programs, so each one loops over several tiles

# Token counts up to which a plan's launches are chained with programmatic dependent launch. Measured on the H200
# (graph replays, same run): at 1 to 64 tokens every shape gains 0.1-4.5 % (the kernels are short and weight-bound,
# so a kernel's launch overlaps the previous one's drain); from 256 tokens the gain is -0.7 to +2.3 %, and at 1024
# to 16384 tokens chained calls were up to 3 % (graph) and 14 % (eager, DeepSeek-V3 at 4096) slower.
PDL_MAX_TOKENS = 64


def chain_decode(steps, tokens: int, device):
    """``steps`` chained with programmatic dependent launch (:func:`hopperkern.tma.launcher.chain_launches`) when
    the call has at most :data:`PDL_MAX_TOKENS` tokens and PDL is on for ``device``; else left in plain stream
    order. Returns ``steps``."""
    enabled = pdl_enabled(device)  # first: a bad HOPPERKERN_PDL raises at every size, not only where it matters
    return chain_launches(steps, tokens <= PDL_MAX_TOKENS and enabled)


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


def smem_bytes(config: KernelConfig, elem_size: int, b_operands: int, out_elem_size: int | None = None) -> int:
    """Shared memory of one program of a grouped GEMM: ``num_stages`` buffers of the A tile and ``b_operands``
    weight tiles (2 for gate/up) plus one epilogue tile (the store's staging, ``out_elem_size`` bytes per
    element: 4 for the fp32 atomic top-k sum; default ``elem_size``)."""
    stage = (config.block_m + b_operands * config.block_n) * config.block_k * elem_size
    return config.num_stages * stage + config.block_m * config.block_n * (out_elem_size or elem_size)


def atomic_config(config: KernelConfig, elem_size: int) -> KernelConfig:
    """``config`` for the down GEMM's fp32 atomic top-k sum (``deterministic=False``): its epilogue stages an
    fp32 tile, twice the bytes of the per-slot store the configs are tuned with, so pipeline stages are dropped
    while :func:`smem_bytes` stays above the 227 KiB a program may use (a tuned 128 x 128 x 128 tile with 3
    stages needs 256 KiB there, 192 KiB with 2). A tile of fewer than 8 warps whose fp32 accumulator takes 128
    registers per thread or more (128 x 128 with 4 warps) runs with 8 warps: the atomic epilogue's addresses
    beside it would spill (ptxas: 560 to 632 bytes for 128 x 128 x 64 with 4 warps and 2 stages). A flattened
    tile loop whose accumulator takes 128 registers per thread or more (128 x 256 with 8 warps) runs without
    flattening: the next tile's prefetch beside the atomic epilogue spills (ptxas: 428 to 468 bytes)."""
    if config.num_warps < 8 and config.block_m * config.block_n >= 128 * 32 * config.num_warps:
        config = config.model_copy(update={"num_warps": 8})
    if config.flatten and config.block_m * config.block_n >= 128 * 32 * config.num_warps:
        config = config.model_copy(update={"flatten": False})
    while config.num_stages > 1 and smem_bytes(config, elem_size, 1, 4) > _SMEM_PER_BLOCK:
        config = config.model_copy(update={"num_stages": config.num_stages - 1})
    return config


def programs_per_sm(config: KernelConfig, elem_size: int, b_operands: int, out_elem_size: int | None = None) -> int:
    """Programs of one persistent grouped GEMM that stay resident on an SM together, estimated on the high
    side of shared memory and registers so the estimate errs low: a program that does not fit waits for a
    whole resident program (all its tiles) to finish, which doubles the kernel, while one program too few
    only loses some latency hiding.

    Shared memory: :func:`smem_bytes` plus 1 KiB reserved per resident block. Registers: the fp32 accumulators and one K step of the operands
    spread over the threads, plus 160 for addresses, the pipeline and the epilogue, capped at 255. Checked
    against ptxas for every heuristic and tuner config by ``python -m benchmarks.compile_moe_sm90``."""
    threads = 32 * config.num_warps
    stage = (config.block_m + b_operands * config.block_n) * config.block_k * elem_size
    smem = smem_bytes(config, elem_size, b_operands, out_elem_size) + 1024
    acc_regs = b_operands * config.block_m * config.block_n // threads  # one accumulator per weight operand
    operand_regs = stage // (4 * threads)  # one K step of the operands, as mma_v2 (block_m < 64) holds them
    regs = -(-min(255, acc_regs + operand_regs + 160) // 8) * 8  # allocated 8 per thread at a time
    fit = min(_SMEM_PER_SM // smem, _REGS_PER_SM // (regs * threads), _THREADS_PER_SM // threads)
    return max(1, min(_MAX_PROGRAMS_PER_SM, fit))


def num_programs(config: KernelConfig, elem_size: int, b_operands: int, device=None,
                 out_elem_size: int | None = None) -> int:
    """NUM_PROGRAMS of a persistent grouped GEMM: SMs of ``device`` (the operands' device; None = the current
    one) x resident programs per SM (2 under the interpreter).

    Depends on the config and the device only, never on the token count, so one compiled variant serves every
    batch size; the launch grid is ``min(tiles, NUM_PROGRAMS)``, and with fewer tiles than NUM_PROGRAMS each
    program takes at most one tile."""
    if interpreter_active():
        return _INTERPRETER_PROGRAMS
    return (capability(device).sm_count or 132) * programs_per_sm(config, elem_size, b_operands, out_elem_size)


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
        # Prefill: flattened persistent tile loops hide each tile's pipeline refill and epilogue (short K).
        g1 = KernelConfig(block_m=64, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4, flatten=True)
        g2 = KernelConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, flatten=True)
    else:
        # Two [128, 128] fp32 accumulators (gate and up) in GEMM1: 8 warps; 3 stages of 48 KiB fit in smem
        # (176 KiB with the flattened loop's epilogue buffer).
        g1 = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3, flatten=True)
        g2 = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=4, flatten=True)
    return MoeConfig(gemm1=g1, gemm2=g2)


def moe_launch_config(E: int, H: int, I: int, dtype, T: int, top_k: int,  # noqa: E741
                      device=None) -> tuple[MoeConfig, str]:
    """(config, where it came from) for fused_moe on (E, H, I, dtype) with T tokens on ``device`` (the
    inputs' device, whose SM count the heuristics use; None = the current device)."""
    if interpreter_active():
        return INTERPRETER_CONFIG, "interpreter"
    # The tuning file of the inputs' GPU, not of the current one (they differ on a multi-GPU host).
    cap = capability(device)
    tuning = load_config(cap.device_name if device is not None else None)
    # Per call: one lookup in a dict keyed by the parsed file object (load_config returns the same object until
    # the file or HOPPERKERN_CONFIG changes) and the problem's shape.
    key = (id(tuning), E, H, I, dtype, T, top_k, cap.sm_count)
    hit = _CHOSEN.get(key)
    if hit is not None and hit[0] is tuning:
        return hit[1]
    chosen = _choose(tuning, E, H, I, dtype, T, top_k, cap.sm_count)
    if len(_CHOSEN) >= 4096:
        _CHOSEN.clear()
    _CHOSEN[key] = (tuning, chosen)
    return chosen


def _choose(tuning, E, H, I, dtype, T, top_k, sm_count):  # noqa: E741
    cfg = tuning.moe_config(E, H, I, dtype, T)
    if cfg is not None:
        return cfg, tuning.origin
    if not tuning.is_default:
        key = (tuning.origin, moe_key(E, H, I, dtype))
        if key not in _WARNED_KEYS:
            _WARNED_KEYS.add(key)
            warnings.warn(
                f"hopperkern: tuning file {tuning.origin} has no MoE entry {key[1]}; using heuristics. "
                f"Tune it with: python -m hopperkern.tune --only moe",
                stacklevel=4,
            )
    return heuristic_config(E, H, I, T, top_k, sm_count), "heuristics"
