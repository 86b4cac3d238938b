"""Launchers of the fused linear cross-entropy: validation, configs, TMA decisions, launches.

Lower-level public entry points (documented here, used by :mod:`hopperkern.lce.api` through torch custom ops):

* :func:`lce_forward` -> per-token ``(loss, logprob, entropy, lse)``, O(N) extra memory.
* :func:`lce_backward` -> ``(d_hidden, d_weight, d_bias)`` for arbitrary per-token upstream gradients.

Backward strategy: the vocab is cut into slices of ``Vs`` columns. For each slice a Triton kernel recomputes
the logits tile by tile and writes d(logits) for all N tokens into a bounded buffer ([N, Vs], at most
``DLOGITS_BUDGET`` bytes), each entry formed in fp32 and rounded once (a second small kernel rewrites the label
column from the forward's log-prob); then ``d_weight[slice] = dlogits^T @ h`` is ONE GEMM over all tokens (fp32
accumulation inside the GEMM, written once; with the mixed RL path's other tokens, two GEMMs into one fp32 sum,
written once), and ``d_hidden += dlogits @ w[slice]`` accumulates in an fp32 [N, H] buffer. No gradient piece is
ever summed in bf16/fp16.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .. import tma as _tma
from .. import tuning as _tuning
from .._host import cdiv, round_up
from .._validate import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_choice,
    check_dtype,
    check_float,
    check_same_device,
    check_same_dtype,
    dot_precision,
)
from ..tma.launcher import PIECE_ALIGN, Launch, Plan, PlanCache, alignment_key, env_key, launch_at, launch_state
from ..tma.launcher import scratch_offsets
from ..tuning import KernelConfig
from ._kernels import (
    lce_combine_kernel,
    lce_dlogits_kernel,
    lce_forward_kernel,
    lce_label_logit_kernel,
    lce_label_mma_kernel,
    lce_onehot_kernel,
)

__all__ = ["LceOptions", "lce_forward", "lce_backward", "check_labels", "combine_stats", "validate_inputs",
           "forward_plan"]

DLOGITS_BUDGET = 128 * 2**20  # bytes of the per-slice d(logits) buffer
# Rows of each piece of the mixed RL path's fp32 d_weight sums: pieces of a d(logits) slice then start 256-byte
# aligned. cuBLAS's fast GEMMs need aligned operands: at 16384 x 3584 x 152064 on the H200, pieces of 2340 columns
# (4680-byte offsets) made the whole step 1.35 x 4G; aligned ones take 0.92 x the 4-pass path's time.
DW_ROWS_ALIGN = 128
STATS_BUDGET = 8 * 2**20  # bytes of the forward's per-split statistics (5 fp32 [S, N] arrays)
_COMBINE_BLOCK = 128
_TARGET_WAVES = 20
_ROW_BLOCK = 32  # rows per program of the O(N*H) label-logit kernel (no-grad forwards)
_ROW_BLOCK_K = 128
# lce_label_mma_kernel's launch: rows (and gathered label rows) per program, warps, pipeline stages.
_LABEL_MMA_ROWS, _LABEL_MMA_WARPS, _LABEL_MMA_STAGES = 64, 4, 4
_LABEL_MMA: bool | None = None  # tests: True / False force the label kernel / the in-tile pick (None: label_by_mma)
# The 3-pass SFT forward's exponentials e = exp(z - c), c = (the label's logit) + E_OFFSET, with z - c clamped to
# E_CLAMP (lce_forward_kernel's E_REF): every stored e <= exp(60) ~ 1e26, so a row of them times the weight stays far
# from fp32's overflow; a row whose LSE exceeds c + E_CLAMP (log p of its label < -80) is formed again by
# lce_sft_rows_kernel. Underflow: e below fp32's least normal number, exp(-87), is lost, a probability
# p = e exp(c - lse) <= e exp(E_OFFSET) below exp(-67) ~ 1e-29 at most (where the label is likely).
E_OFFSET = 20.0
E_CLAMP = 60.0
_LABEL_MMA_MIN_TILE = 128 * 256  # BLOCK_N x BLOCK_V from which label_by_mma takes the label kernel
_MIN_SPLIT_COLS = 4096  # vocab columns per forward program at least (a split's start-up and stores amortised)
_PROGRAM_COST = 0.5  # a forward program's start-up and statistics stores, in vocab tiles' time (forward_plan)
_FEW_WAVES = 5  # forward_plan weighs the last wave's fill where the cap's plan runs in at most this many waves


@dataclass(frozen=True)
class LceOptions:
    """Non-tensor options of one LCE call (travels as one object through autograd)."""

    ignore_index: int = -100
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float = 0.0  # 0 = no softcap
    temperature: float = 1.0
    tma: str = "auto"

    @property
    def inv_temp(self) -> float:
        return 1.0 / self.temperature


_FP32_MAX = torch.finfo(torch.float32).max
_NO_REDUCTION = object()  # validate_inputs' reduction for ops that take none (log-probs and entropies)


# Softcaps up to this value (Gemma 2's and Grok-1's 30) form tanh as 1 - 2 / (e^2x + 1), whose absolute error near 0,
# ~1e-7 x softcap in the final logit, is that of the logits' own fp32 rounding where they reach the cap's scale
# (with logits of ~1 at softcap 30, d_hidden's error against fp64 is 1.5 x fp32 PyTorch's, 3 x at 64). Larger ones
# take tanh's series near 0 (SOFTCAP == 2 in the kernels: nine more operations per logit) so that the error stays
# within a few ulp of the logit however far below the cap the logits lie. That costs registers (sm_90, 128 x 256 x 64,
# TMA, compile_lce_sm90): the no-grad forward 255 instead of 192, the 4-pass backward's pass 688 bytes of spills
# instead of 172; not timed on a GPU.
EXACT_TANH_SOFTCAP = 32.0


def softcap_mode(softcap) -> int:
    """The kernels' SOFTCAP constexpr: 0 none, 1 the exp form of tanh, 2 with its series near 0."""
    if not softcap:
        return 0
    return 1 if softcap <= EXACT_TANH_SOFTCAP else 2


def check_scalar_options(*, label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0) -> None:
    """The numeric options of the LCE ops (ValueError / TypeError): label_smoothing in [0, 1]; z_loss finite and
    >= 0; softcap None or finite and > 0 (an infinite one is no softcap: pass None); temperature > 0 with a
    reciprocal finite in fp32 (the kernels scale by it), infinity allowed (the uniform limit)."""
    check_float("label_smoothing", label_smoothing, low=0.0, high=1.0)
    check_float("z_loss", z_loss, low=0.0, finite=True)
    check_float("temperature", temperature, low=0.0, low_open=True)
    if 1.0 / float(temperature) > _FP32_MAX:
        raise ValueError(f"temperature must be at least {1.0 / _FP32_MAX:.4g} (the kernels scale by its reciprocal "
                         f"in fp32), got {temperature}")
    if softcap is not None:
        if softcap == float("inf"):
            raise ValueError("softcap must be finite, got inf (pass softcap=None for no softcap)")
        check_float("softcap", softcap, low=0.0, low_open=True)


def validate_inputs(hidden, weight, labels, bias, *, ignore_index, label_smoothing=0.0, z_loss=0.0, softcap=None,
                    temperature=1.0, tma="auto", reduction=_NO_REDUCTION, vocab_shard=False) -> None:
    """Check dtypes, shapes and options before anything is launched (TypeError / ValueError). ``vocab_shard``:
    ``weight`` is one rank's shard of a vocab-parallel head, which may have no rows. ``reduction``: checked
    unless left out (an op without one)."""
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_same_dtype("weight", weight, "hidden", hidden)
    check_dtype("labels", labels, INDEX_DTYPES)
    if bias is not None:
        check_dtype("bias", bias, FLOAT_DTYPES)
        check_same_dtype("bias", bias, "weight", weight)
    check_same_device({"hidden": hidden, "weight": weight, "labels": labels, "bias": bias})
    if hidden.dim() < 1:
        raise ValueError(f"hidden must have at least 1 dim [..., H], got shape {tuple(hidden.shape)}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H], got shape {tuple(weight.shape)}")
    V, H = weight.shape
    if (V == 0 and not vocab_shard) or H == 0:
        raise ValueError(f"weight must have V >= 1 rows and H >= 1 columns, got shape {tuple(weight.shape)}")
    if hidden.shape[-1] != H:
        raise ValueError(f"hidden must have last dim {H} (weight.shape[1]), got shape {tuple(hidden.shape)}")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"labels must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), "
                         f"got {tuple(labels.shape)}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must have shape ({V},), got {tuple(bias.shape)}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    bounds = torch.iinfo(labels.dtype)
    if not bounds.min <= ignore_index <= bounds.max:
        raise ValueError(f"ignore_index must be within the range of the labels' dtype {labels.dtype} "
                         f"[{bounds.min}, {bounds.max}], got {ignore_index}")
    check_scalar_options(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, temperature=temperature)
    if reduction is not _NO_REDUCTION:
        check_choice("reduction", reduction, ("none", "mean", "sum"))
    _tma.resolve_mode(tma)  # ValueError for an unknown mode, before any launch


def check_labels(labels: torch.Tensor, V: int, ignore_index: int) -> None:
    """Raise ValueError naming the labels outside [0, V) that are not ``ignore_index``.

    Cost: one elementwise pass over the N labels plus ONE device->host synchronisation: the public functions run
    it with ``check_labels=True``, and with the default ``"auto"`` only where it needs no sync (CPU tensors).
    Unchecked, an invalid label makes its token's outputs and gradients NaN instead of a wrong number.
    """
    if labels.numel() == 0:
        return
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= V))
    if bool(bad.any()):
        pos = bad.nonzero().flatten()[:8].tolist()
        vals = labels.flatten()[bad.flatten()][:8].tolist()
        raise ValueError(f"labels must be in [0, {V}) or ignore_index={ignore_index}; got {vals} at flat "
                         f"positions {pos}" + (" (first 8 shown)" if int(bad.sum()) > 8 else ""))


def _interp_config() -> KernelConfig:
    # Small tiles keep the interpreter fast (cost is per tile visited, not per FLOP).
    return KernelConfig(block_m=16, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1)


def _default_config(dtype) -> KernelConfig:
    if dtype == torch.float32:
        return KernelConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
    return KernelConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, flatten=True)


def pick_config(phase: str, dtype, N: int, H: int, device=None) -> KernelConfig:
    """Launch config for ``phase`` ("forward"/"backward") on ``device`` (the inputs' GPU; None = the current
    one): that GPU's tuning file, else built-in defaults."""
    if _tma.interpreter_active():
        return _interp_config()
    cfg = _tuning.device_config(device).lce_config(phase, dtype, N, H)
    return cfg if cfg is not None else _default_config(dtype)


def forward_plan(N: int, V: int, cfg: KernelConfig, sm_count: int, weigh_waves: bool = True) -> tuple[int, int]:
    """(S, tiles_per_split): vocab splits per row block.

    Programs are long (tiles_per_split tiles each). The cap on S: at most ``_TARGET_WAVES`` waves of programs,
    statistics within ``STATS_BUDGET``, and at least ``_MIN_SPLIT_COLS`` vocab columns per program (each pays a
    pipeline fill and its statistics stores). Without ``weigh_waves`` (the 3-pass paths' forwards, which store
    every exponential or logit; the interpreter's single "SM") the plan is the cap's.

    With ``weigh_waves`` (forwards that store nothing per logit), the column rule gives way where it would leave
    SMs without a program (few row blocks), and where the cap's plan needs at most ``_FEW_WAVES`` waves a partly
    filled last wave costs a large share of the time (at the tuned tiles one program fills an SM): S is then the
    split count from the cap down to half of it that minimises ``waves * (tiles_per_split + _PROGRAM_COST)``,
    waves = cdiv(row blocks * S, SMs), the larger S on a tie. At 1937 x 3584 x 152064 (16 row blocks of 128)
    that is 33 splits of 36 tiles, four full waves on 132 SMs, where the cap's 36 splits of 33 tiles need a fifth
    wave for 48 of their 576 programs.

    Measured on the H200 (bf16, same-run A/B of the no-grad forward against the cap's plan, 5 rounds): 0.62 x
    the time at 256 x 4096 x 128256 (126 programs instead of 62), 0.95 x at 1024 x 4096 x 128256, 0.89 x at
    1937 x 3584 x 152064, 0.90 x at 2048 x 4096 x 128256, 0.95 x at 2169 x 896 x 151936. Where the estimate
    gained 1 to 5 % with more waves (from 8192 tokens) the A/B was level to 1.4 % slower, and the SFT and RL steps
    whose 3-pass forwards store every exponential took 0.98 to 1.02 x at ~2k tokens: both keep the cap's plan.
    Earlier: at 2169 x 896 and 1937 x 3584, 4 waves of ~4.8k-column splits beat 20 waves of 1k-column ones by
    7-10 %; at 8192 x 4096, 12 and 30 tiles of 256 per split were within 1.3 %. On the H100 (same run, power-capped
    at ~700 W, where cuBLAS slows alike), 16 to 45 splits instead of the cap's 11 at 32768 x 4096 x 128256, and 31
    or 45 instead of 21 at 16384 x 3584 x 152064, took 0.97 to 1.02 x the cap's time: its gap to cuBLAS there does
    not come from the split count.
    """
    num_rb = cdiv(N, cfg.block_m)
    num_vt = cdiv(V, cfg.block_n)
    s_max = max(1, min(num_vt, STATS_BUDGET // max(1, 20 * N)))
    s_cols = max(1, V // _MIN_SPLIT_COLS)
    weigh_waves = weigh_waves and sm_count > 1  # one "SM" (the interpreter's stand-in): nothing to fill
    fill = cdiv(sm_count, num_rb) if weigh_waves else 1  # splits that give every SM a program (few tokens)
    cap = max(1, min(s_max, max(s_cols, fill), cdiv(_TARGET_WAVES * sm_count, num_rb)))

    def plan(s):  # (S, tiles per split) for at most s splits, none of them empty
        tps = cdiv(num_vt, s)
        return cdiv(num_vt, tps), tps

    def cost(p):
        return cdiv(num_rb * p[0], sm_count) * (p[1] + _PROGRAM_COST)

    S, tps = plan(cap)
    if not weigh_waves or cdiv(num_rb * S, sm_count) > _FEW_WAVES:
        return S, tps  # the cap's plan
    return min((plan(s) for s in range(cap, (cap - 1) // 2, -1)), key=cost)  # the first (larger S) on a tie


def label_by_mma(dtype, device, cfg: KernelConfig) -> bool:
    """Whether a forward that a backward follows, at tiles ``cfg`` on ``device``, takes its labels' logits from
    ``lce_label_mma_kernel`` (tensor-core products, the same bit for bit as the forward's tiles) rather than picking
    them out of the tiles (``PICK_LABEL``): for 16-bit inputs on a Hopper GPU
    (:attr:`hopperkern.tma.Capability.hopper_mma`, where that equality holds) at tiles of 128 x 256 or more, where
    the pick's compare-select-sum spills registers (8-11 % of the forward on the H200). Narrower tiles keep the
    pick, which costs them little, while the label kernel's serial K loop takes ~60 us whatever N (at 256 tokens a
    differentiable forward took 1.11 x as long with it); the interpreter's dot (numpy), fp32 inputs' FMA dot and
    other GPUs promise no bitwise equality, so they keep the pick."""
    if _LABEL_MMA is not None:
        return _LABEL_MMA
    return (dtype in (torch.float16, torch.bfloat16) and cfg.block_m * cfg.block_n >= _LABEL_MMA_MIN_TILE
            and _tma.capability(device).hopper_mma)


def _sm_count(device) -> int:
    cap = _tma.capability(device)
    if cap.interpreter or not cap.sm_count:
        return 1  # interpreter: one "SM", so small test shapes get several splits of several tiles each
    return cap.sm_count


class _ForwardPlan(Plan):
    """What :func:`lce_forward` decides once per problem (see :mod:`hopperkern.tma.launcher`): config, TMA
    decision, vocab splits, and the three launches (label logit when not picked, forward, combine)."""

    __slots__ = ("decision", "stat_rows", "stat_at", "stat_bytes", "direct_layout", "need_t", "need_sumz", "label",
                 "forward", "combine", "num_vt", "zl_is_ref")


_FORWARD_PLANS = PlanCache("lce.forward")


def _forward_key(hidden2d, weight, labels1d, bias, opts: LceOptions, need_entropy: bool, pick_label: bool,
                 config: KernelConfig | None, z_out, e_out, keep_label_term: bool):
    store = z_out if e_out is None else e_out[0]
    return (hidden2d.device, hidden2d.dtype, hidden2d.shape, hidden2d.stride(), weight.shape, weight.stride(),
            labels1d.dtype, None if bias is None else bias.dtype, opts, need_entropy, pick_label, keep_label_term,
            _LABEL_MMA, env_key(),
            alignment_key(hidden2d, weight, labels1d, bias, store), None if config is None else config_key(config),
            None if store is None else (e_out is None, store.dtype, store.stride(),
                                        None if e_out is None else e_out[1].stride()))


def config_key(cfg: KernelConfig) -> tuple:
    """A KernelConfig's values as a plan-key tuple."""
    return (cfg.block_m, cfg.block_n, cfg.block_k, cfg.group_m, cfg.num_warps, cfg.num_stages, cfg.flatten)


def _stats(plan: _ForwardPlan, N: int, dev):
    """The forward's per-split statistics (m, s, t, sumz, zl), [S, N] fp32 each (zl [1, N] where the tiles do not
    pick the label): views of one allocation."""
    rows = torch.empty((sum(plan.stat_rows), N), dtype=torch.float32, device=dev).split(plan.stat_rows)
    m, s = rows[0], rows[1]
    t = rows[2] if plan.need_t else m
    sumz = rows[2 + plan.need_t] if plan.need_sumz else m
    return m, s, t, sumz, rows[-1]


def _build_forward_plan(hidden2d, weight, labels1d, bias, opts: LceOptions, need_entropy: bool, pick_label: bool,
                        config: KernelConfig | None, z_out=None, e_out=None,
                        keep_label_term: bool = False) -> _ForwardPlan:
    N = hidden2d.shape[0]
    V, H = weight.shape
    dev = hidden2d.device
    plan = _ForwardPlan()
    plan.bind_source(None if config is not None or _tma.interpreter_active() else _tuning.device_config(dev), dev)
    cfg = config or pick_config("forward", hidden2d.dtype, N, H, dev)
    operands = {"hidden": (hidden2d, (cfg.block_m, cfg.block_k)), "weight": (weight, (cfg.block_n, cfg.block_k))}
    if e_out is not None:
        operands["exp_logits"] = (e_out[0], (cfg.block_m, cfg.block_n))
    d = _tma.decide(opts.tma, operands, op="lce.forward", record=False)
    plan.decision = d
    store_z, store_e = z_out is not None, e_out is not None
    S, tps = forward_plan(N, V, cfg, _sm_count(dev), not (store_z or store_e))
    plan.num_vt = cdiv(V, cfg.block_n)
    need_sumz = opts.label_smoothing > 0
    # The label's logit: picked out of the tiles (one zl row per split), or from a launch of its own (one row).
    in_tiles = pick_label and not label_by_mma(hidden2d.dtype, dev, cfg)
    # A label picked in the tiles also leaves its own term out of the sums s and t, for the combine to add back in
    # fp64 (lce_forward_kernel's LABEL_OUT); statistics merged elsewhere (stats_only) keep it in.
    label_out = in_tiles and not keep_label_term
    plan.stat_rows = [S] * (2 + need_entropy + need_sumz) + [S if in_tiles else 1]
    plan.need_t, plan.need_sumz = need_entropy, need_sumz
    # Byte offsets of m, s, t, sumz, zl, and of a loss and an fp64 LSE row, in one allocation of a direct call (see
    # _forward_direct): each piece starts 128-byte aligned, as the separate tensors the launches were bound with
    # may have been (a binary specialised for a 16-byte aligned pointer must never get another). t and sumz fall
    # back on m when not asked for.
    offsets, at = [], 0
    for rows in plan.stat_rows + [1, 2]:  # the LSE's fp64 row: two fp32 rows' bytes
        offsets.append(at)
        at += round_up(rows * N * 4, PIECE_ALIGN)
    plan.stat_at = (offsets[0], offsets[1], offsets[2] if need_entropy else 0,
                    offsets[2 + need_entropy] if need_sumz else 0, offsets[-3], offsets[-2], offsets[-1])
    plan.stat_bytes = at
    plan.direct_layout = None  # descriptor scratch offsets and total bytes, once every launch is bound
    f32 = dict(dtype=torch.float32, device=dev)
    one = torch.empty((1, N), **f32)  # stands for every [S, N] / [N] buffer: Launch keeps only dtypes
    has_bias, softcap = bias is not None, float(opts.softcap or 1.0)
    b_arg = bias if has_bias else weight
    label_args = (hidden2d, weight, b_arg, labels1d, one, N, V, H, hidden2d.stride(0), hidden2d.stride(1),
                  weight.stride(0), weight.stride(1), softcap, opts.inv_temp)
    if in_tiles:
        plan.label = None
    elif pick_label:
        # The tiles' own products (same K step, same dot precision) without their compare-select-sum.
        plan.label = Launch(
            lce_label_mma_kernel, (cdiv(N, _LABEL_MMA_ROWS),), *label_args,
            BLOCK_N=_LABEL_MMA_ROWS, BLOCK_K=cfg.block_k, HAS_BIAS=has_bias, SOFTCAP=softcap_mode(opts.softcap),
            H_TMA=d["hidden"], DOT_PRECISION=dot_precision(hidden2d.dtype),
            num_warps=_LABEL_MMA_WARPS, num_stages=_LABEL_MMA_STAGES,
        )
    else:
        plan.label = Launch(
            lce_label_logit_kernel, (cdiv(N, _ROW_BLOCK),), *label_args,
            BLOCK_N=_ROW_BLOCK, BLOCK_K=_ROW_BLOCK_K, HAS_BIAS=has_bias, SOFTCAP=softcap_mode(opts.softcap),
        )
    z_arg, mt_arg = _store_args(z_out, e_out) or (one, one)
    e_ref = store_e and mt_arg.dim() == 1
    # With E_REF and a label launch of its own, the label's logit is the reference itself: the label launch writes
    # the caller's ref row, which the forward and the combine then read as their zl row.
    plan.zl_is_ref = e_ref and plan.label is not None
    plan.forward = Launch(
        lce_forward_kernel, (cdiv(N, cfg.block_m) * S,),
        hidden2d, weight, b_arg, labels1d, one, one, one, one, one, z_arg, mt_arg,
        N, V, H, S, tps, hidden2d.stride(0), hidden2d.stride(1), weight.stride(0), weight.stride(1),
        z_arg.stride(0) if store_z or store_e else 0, mt_arg.stride(0) if store_e and not e_ref else 0, softcap,
        opts.inv_temp,
        BLOCK_N=cfg.block_m, BLOCK_V=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_m,
        HAS_BIAS=has_bias, SOFTCAP=softcap_mode(opts.softcap), NEED_T=need_entropy, NEED_SUMZ=need_sumz,
        FLATTEN=cfg.flatten, H_TMA=d["hidden"], W_TMA=d["weight"], DOT_PRECISION=dot_precision(hidden2d.dtype),
        PICK_LABEL=in_tiles, LABEL_OUT=label_out, STORE_Z=store_z, STORE_E=store_e,
        E_TMA=d.use.get("exp_logits", False),
        E_REF=e_ref, E_OFFSET=E_OFFSET, E_CLAMP=E_CLAMP,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    plan.combine = _combine_launch(S, N, S if in_tiles else 1, labels1d, V, opts, need_entropy, need_sumz, one,
                                   one.new_empty((1, N), dtype=torch.float64), label_out)
    return plan


def forward_plan_for(hidden2d, weight, labels1d, bias, opts: LceOptions, *, need_entropy: bool = True,
                     pick_label: bool = True, config: KernelConfig | None = None, z_out=None,
                     e_out=None, keep_label_term: bool = False) -> _ForwardPlan:
    """The cached launch plan of :func:`lce_forward` for these inputs (built on a miss, or when the tuning file
    it came from changed); ``config`` overrides the tuning file's, ``z_out`` / ``e_out`` ask for a store;
    ``keep_label_term``: statistics for a merge elsewhere (``stats_only``), with the label's own term in s and t."""
    key = _forward_key(hidden2d, weight, labels1d, bias, opts, need_entropy, pick_label, config, z_out, e_out,
                       keep_label_term)
    plan = _FORWARD_PLANS.get(key)
    if plan is None or not plan.fresh():
        plan = _FORWARD_PLANS.put(key, _build_forward_plan(hidden2d, weight, labels1d, bias, opts, need_entropy,
                                                           pick_label, config, z_out, e_out, keep_label_term))
    return plan


def lce_forward(hidden2d: torch.Tensor, weight: torch.Tensor, labels1d: torch.Tensor, bias, opts: LceOptions,
                *, need_entropy: bool = True, config: KernelConfig | None = None, pick_label: bool = True,
                stats_only: bool = False, shared_out: bool = False, z_out: torch.Tensor | None = None,
                e_out: tuple[torch.Tensor, torch.Tensor] | None = None):
    """Per-token ``(loss, logprob, entropy, lse)``, fp32 [N] each but the LSE, fp64 [N] (the backward takes z - lse
    to fp64's precision of the LSE, see ``_load_lse``), for 2-D hidden [N, H] and labels [N] (``shared_out``: views
    of one allocation instead of four).

    loss includes label smoothing and z-loss (0 at ignored tokens); logprob is 0 at ignored tokens; entropy
    is computed for every token (zeros when ``need_entropy`` is False). A kept label outside [0, V) makes all
    four NaN for its token (and so its gradients, which read the LSE). Inputs must be validated already.
    Extra memory: 5 fp32 [S, N] statistics, S chosen within 8 MiB.

    ``pick_label`` (for a forward that a backward will follow): the label's logit is bit for bit the one the
    log-sum-exp's tiles computed, so p - 1 of a confident prediction keeps its precision in the backward: from
    ``lce_label_mma_kernel`` (the same tensor-core products for 16-bit inputs on a Hopper GPU at tiles of 128 x 256
    or more: one extra launch, O(N * 64 * H) work) or picked out of the tiles that hold a label (elsewhere; see
    :func:`label_by_mma` and ``lce_forward_kernel``); False takes it from a separate
    O(N*H) fp32 dot product, with log p itself as accurate (~1e-6 absolute).

    ``stats_only`` (N >= 1; the vocab-parallel path, :mod:`.distributed`, merges them across ranks): return the
    per-split statistics ``(m, s, t, sumz, zl)`` instead, each fp32 [S, N] (zl [1, N] unless the tiles pick it),
    as :func:`combine_stats` takes them; t (sumz) is ``m`` itself when entropy (label smoothing) is not asked for.

    ``z_out`` (with ``pick_label``; the 3-pass SFT path, :mod:`.sft`): an fp32 [N, >= V] buffer with unit column
    stride that receives the final logits of every token, written by the same kernel.

    ``e_out`` (with ``pick_label``, not with ``z_out``; the 3-pass paths without softcap): ``(e, mt)``, e an
    [N, >= V] buffer in the inputs' dtype with unit column stride that receives exp(z - m) of every logit, m the
    row's running max after each vocab tile of the config's ``block_n`` columns, written to the fp32 [N, >= that
    many tiles] ``mt`` (see ``lce_forward_kernel``'s STORE_E); or ``(e, ref)`` with ref an fp32 [>= N] of
    reference logits r read by the forward, when e receives exp(z - c) with c = r + ``E_OFFSET``, z - c clamped
    to ``E_CLAMP`` (STORE_E with E_REF). Where a label launch of its own runs (:func:`label_by_mma`), that launch
    writes ref (the label's logit, 0 at ignored tokens) before the forward reads it; elsewhere ref must be filled
    by the caller.

    The config, TMA decision and launches come from a cached plan (:func:`forward_plan_for`).
    """
    if not hidden2d.is_cuda:
        _tma.check_interpreter(hidden2d.dtype, "lce.forward")  # no launch the interpreter gets wrong
    N = hidden2d.shape[0]
    dev = hidden2d.device
    if N == 0:
        if hidden2d.is_cuda and _tma.interpreter_active():
            _tma.check_interpreter(hidden2d.dtype, "lce.forward")  # as any call would under the interpreter
        return _outputs(0, dev, False)
    _check_store(hidden2d, weight, z_out, e_out, pick_label)
    plan = forward_plan_for(hidden2d, weight, labels1d, bias, opts, need_entropy=need_entropy, pick_label=pick_label,
                            config=config, z_out=z_out, e_out=e_out, keep_label_term=stats_only)
    if e_out is not None and e_out[1].dim() == 2 and e_out[1].shape[1] < plan.num_vt:
        raise ValueError(f"lce_forward: mt must have at least {plan.num_vt} columns (vocab tiles of the config's "
                         f"block_n), got {e_out[1].shape[1]}")
    store = _store_args(z_out, e_out)
    if plan.interpreted:
        _tma.check_interpreter(hidden2d.dtype, "lce.forward")
    _tma.record_decision(plan.decision)
    b_arg = bias if bias is not None else weight
    if not stats_only:
        stream = plan.direct_stream((plan.label, plan.forward, plan.combine))
        if stream is not None:
            out = _forward_direct(plan, stream, hidden2d, weight, b_arg, labels1d, store, shared_out)
            if out is not None:
                return out
    m, s, t, sumz, zl = _stats(plan, N, dev)
    if plan.zl_is_ref:
        zl = store[1]
    if plan.label is not None:
        plan.label(hidden2d, weight, b_arg, labels1d, zl)
    plan.forward(hidden2d, weight, b_arg, labels1d, m, s, t, sumz, zl, *(store or (m, m)))
    if stats_only:
        return m, s, t, sumz, zl
    # The combine kernel writes every row of all four outputs (entropy 0 without need_entropy): no fills.
    out = _outputs(N, dev, shared_out)
    plan.combine(m, s, t, sumz, zl, labels1d, *out)
    return out


def _outputs(N: int, dev, shared: bool):
    """(loss, logprob, entropy, lse), fp32 [N] each but the LSE, fp64 [N]: views of one allocation when ``shared``,
    each 128-byte aligned (a launch bound with aligned outputs refuses others, and the direct forward would then
    run again)."""
    if shared:
        pitch = round_up(N, PIECE_ALIGN // 4)
        buf = torch.empty(5 * pitch, dtype=torch.float32, device=dev)  # the LSE takes the last two rows' bytes
        return (*buf[:3 * pitch].view(3, pitch)[:, :N].unbind(0), buf[3 * pitch:].view(torch.float64)[:N])
    loss, logprob, entropy = (torch.empty(N, dtype=torch.float32, device=dev) for _ in range(3))
    return loss, logprob, entropy, torch.empty(N, dtype=torch.float64, device=dev)


def _store_args(z_out, e_out):
    """The forward kernel's (z, mt) tensors for a store of the logits or their exponentials; None for no store."""
    return (z_out, z_out) if z_out is not None else e_out


def _check_store(hidden2d, weight, z_out, e_out, pick_label: bool) -> None:
    """ValueError / TypeError for a ``z_out`` or ``e_out`` that the forward kernel could not write as documented."""
    if z_out is None and e_out is None:
        return
    if z_out is not None and e_out is not None:
        raise ValueError("lce_forward: z_out and e_out are exclusive")
    if not pick_label:
        raise ValueError("lce_forward: z_out / e_out need pick_label=True (a backward follows)")
    N, V = hidden2d.shape[0], weight.shape[0]
    if e_out is not None:
        if not (isinstance(e_out, tuple) and len(e_out) == 2):
            raise TypeError("lce_forward: e_out must be a tuple (e, mt)")
        e, mt = e_out
        check_dtype("e_out[1] (mt or ref)", mt, (torch.float32,))
        if mt.dim() == 1:
            if mt.shape[0] < N or (N > 1 and mt.stride(0) != 1):
                raise ValueError(f"lce_forward: ref must be [>= N={N}] with unit stride, got shape "
                                 f"{tuple(mt.shape)} and strides {tuple(mt.stride())}")
        elif mt.dim() != 2 or mt.shape[0] < N or (mt.shape[1] > 1 and mt.stride(1) != 1):
            raise ValueError(f"lce_forward: mt must be [>= N={N}, tiles] with unit column stride, got shape "
                             f"{tuple(mt.shape)} and strides {tuple(mt.stride())}")
        want, what = hidden2d.dtype, "e_out[0] (e)"
    else:
        e, want, what = z_out, torch.float32, "z_out"
    if e.dtype != want:
        raise TypeError(f"lce_forward: {what} must be {want}, got {e.dtype}")
    if e.dim() != 2 or e.shape[0] < N or e.shape[1] < V or e.stride(1) != 1:
        raise ValueError(f"lce_forward: {what} must be [>= N={N}, >= V={V}] with unit column stride, got shape "
                         f"{tuple(e.shape)} and strides {tuple(e.stride())}")


def _forward_direct(plan: _ForwardPlan, stream: int, hidden2d, weight, b_arg, labels1d, store, shared_out: bool):
    """:func:`lce_forward` with every launch bound: the statistics and the launches' descriptor scratch as
    addresses in one allocation, each launch through its C launcher. The outputs, or None when a launch refused
    its tensors (the caller then runs the whole forward again the usual way: it recomputes every statistic)."""
    base, held, scratch = _direct_allocation(plan, hidden2d.device)  # held until every launch is enqueued
    m, s, t, sumz, zl = (base + offset for offset in plan.stat_at[:5])
    if plan.zl_is_ref:
        zl = store[1]
    if not _forward_launches(plan, stream, hidden2d, weight, b_arg, labels1d, store, m, s, t, sumz, zl, scratch):
        return None
    out = _outputs(hidden2d.shape[0], hidden2d.device, shared_out)
    if not plan.combine.direct(stream, (m, s, t, sumz, zl, labels1d, *out), scratch[2]):
        return None
    return out


def _direct_allocation(plan: _ForwardPlan, dev):
    """One allocation for a direct call: ``(base address, the tensor, descriptor scratch address per launch)``,
    the tensor to be held until every launch is enqueued."""
    layout = plan.direct_layout
    if layout is None:
        layout = plan.direct_layout = scratch_offsets((plan.label, plan.forward, plan.combine), plan.stat_bytes)
    offsets, total = layout
    buf = torch.empty(total // 4, dtype=torch.float32, device=dev)  # total: a multiple of 128 bytes
    base = buf.data_ptr()
    return base, buf, [None if at is None else base + at for at in offsets]


def _forward_launches(plan, stream, hidden2d, weight, b_arg, labels1d, store, m, s, t, sumz, zl, scratch) -> bool:
    """The label-logit (when not picked) and forward launches of a direct call; False when one refused."""
    if plan.label is not None and not plan.label.direct(stream, (hidden2d, weight, b_arg, labels1d, zl), scratch[0]):
        return False
    return plan.forward.direct(stream, (hidden2d, weight, b_arg, labels1d, m, s, t, sumz, zl, *(store or (m, m))),
                               scratch[1])


def logprobs_direct(plan: _ForwardPlan, hidden2d, weight, labels1d):
    """``(logprob, entropy)``, fp32 [N] each, of a forward without bias served by ``plan`` with every launch
    direct; None where that cannot be (a launch not yet bound, another device current, a launch hook installed,
    a tensor that does not match its binding: the caller then takes :func:`lce_forward`). The loss and LSE rows
    the kernels also write go to the statistics allocation; the two results are slices of one allocation, each
    128-byte aligned.

    The caller vouches for the three inputs: they match the call ``plan`` was made for in device, dtype and
    16-byte alignment (the no-grad call key holds all three), so the launches take their addresses unchecked;
    the callers hold the tensors until this returns."""
    stream = plan.direct_stream((plan.label, plan.forward, plan.combine))
    if stream is None:
        return None
    N = hidden2d.shape[0]
    h, w, y = hidden2d.data_ptr(), weight.data_ptr(), labels1d.data_ptr()
    base, held, scratch = _direct_allocation(plan, hidden2d.device)  # held until every launch is enqueued
    m, s, t, sumz, zl, loss, lse = (base + offset for offset in plan.stat_at)
    if not _forward_launches(plan, stream, h, w, w, y, None, m, s, t, sumz, zl, scratch):
        return None
    pitch = round_up(N, PIECE_ALIGN // 4)
    out = torch.empty(pitch + N, dtype=torch.float32, device=hidden2d.device)
    logprob = out.data_ptr()
    if not plan.combine.direct(stream, (m, s, t, sumz, zl, y, loss, logprob, logprob + 4 * pitch, lse),
                               scratch[2]):
        return None
    _tma.record_decision(plan.decision)  # once per call, as on the full path (which runs when this returns None)
    return out[:N], out[pitch:]


def _combine_launch(S: int, N: int, S_zl: int, labels1d, V: int, opts: LceOptions, need_entropy: bool,
                    need_sumz: bool, f32_like, lse_like, label_out: bool = False) -> Launch:
    return Launch(
        lce_combine_kernel, (cdiv(N, _COMBINE_BLOCK),),
        f32_like, f32_like, f32_like, f32_like, f32_like, labels1d, f32_like, f32_like, f32_like, lse_like,
        N, V, S, S_zl, opts.ignore_index, float(opts.label_smoothing), float(opts.z_loss),
        BLOCK=_COMBINE_BLOCK, NEED_T=need_entropy, NEED_SUMZ=need_sumz, LABEL_OUT=label_out,
    )


def combine_stats(m, s, t, sumz, zl, labels1d, V: int, opts: LceOptions, out, *, need_entropy: bool,
                  need_sumz: bool) -> None:
    """Merge per-split statistics into ``out = (loss, logprob, entropy, lse)``, [N] each (lce_combine_kernel): fp32,
    the LSE fp64 (or fp32, then rounded: the backward's log-probs then carry its rounding).

    m, s, t, sumz: fp32 [S, N] (t read only with ``need_entropy``, sumz only with ``need_sumz``); zl: fp32 [S_ZL, N],
    the label's logit where a split holds it and 0 elsewhere. ``V`` is the whole vocabulary's size: label smoothing's
    eps / V, and a kept label outside [0, V) gives NaN. :func:`lce_forward` ends with it; the vocab-parallel path
    (:mod:`.distributed`) calls it with S = 1 on statistics already summed across ranks.
    """
    S, N = m.shape
    _combine_launch(S, N, zl.shape[0], labels1d, V, opts, need_entropy, need_sumz, m, out[3])(
        m, s, t, sumz, zl, labels1d, *out)


def _slice_cols(N: int, V: int, block_v: int, elem: int) -> int:
    cols = DLOGITS_BUDGET // max(1, N * elem)
    cols = max(block_v, (cols // block_v) * block_v)
    return min(cols, cdiv(V, block_v) * block_v)


def _dw_rows(H: int) -> int:
    """Rows of an fp32 [rows, H] d_weight sum within ``sft.DW_SLICE_BUDGET`` bytes, a multiple of
    ``DW_ROWS_ALIGN`` (at least that many)."""
    from .sft import DW_SLICE_BUDGET

    return max(DW_ROWS_ALIGN, DW_SLICE_BUDGET // (4 * max(1, H)) // DW_ROWS_ALIGN * DW_ROWS_ALIGN)


def fast_mm_f32(a: torch.Tensor) -> bool:
    """Whether :func:`_acc_mm_f32` runs ``a`` (an fp32 or 16-bit GEMM operand) without fp32 copies of it."""
    return a.dtype == torch.float32 or (a.is_cuda and _tma.torch_mm_out_dtype(a.device, a.dtype))


def _acc_mm_f32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: int = 1,
                out_dtype_mm: bool | None = None) -> None:
    """acc (fp32) = beta * acc + a @ b with fp32 accumulation and no low-precision partial sum (beta 0 or 1; with
    0 whatever acc held, NaN included, is ignored). ``out_dtype_mm``: :func:`fast_mm_f32` of ``a`` when the
    caller knows it (asked when None)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b, beta=beta)
    elif out_dtype_mm if out_dtype_mm is not None else fast_mm_f32(a):
        # cuBLAS: bf16/fp16 inputs, fp32 accumulate and fp32 C.
        torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    else:
        # CPU (tests), or a torch without out_dtype: the same arithmetic through fp32 copies of the operands,
        # which callers bound by slicing (DLOGITS_BUDGET for ``a`` here; ``b`` is a slice's [Vs, H] weight rows;
        # the mixed RL path, which would copy whole hidden rows per slice, is not taken there: rl.stored_rows).
        acc.addmm_(a.float(), b.float(), beta=beta)


def _check_token_vector(name: str, t, N: int, dtypes: tuple) -> None:
    """TypeError / ValueError unless ``t`` is a contiguous (N,) tensor of one of ``dtypes`` (the first: the
    forward's own, checked first and alone in the common case)."""
    if type(t) is torch.Tensor and t.dtype == dtypes[0] and t.shape == (N,) and (N <= 1 or t.stride(0) == 1):
        return
    check_dtype(name, t, dtypes)
    if tuple(t.shape) != (N,) or (N > 1 and t.stride(0) != 1):
        raise ValueError(f"{name} must be a contiguous ({N},) tensor (one per token), got shape {tuple(t.shape)} "
                         f"and strides {tuple(t.stride())}")


def _check_logprob(logprob, N: int) -> None:
    if logprob is None:
        raise ValueError("logprob must be given when g_loss or g_logprob is (the forward's fp32 log-prob: the "
                         "label column of d(logits) is formed from it), got None")
    _check_token_vector("logprob", logprob, N, (torch.float32,))


def lce_backward(hidden2d, weight, labels1d, bias, lse, entropy, g_loss, g_logprob, g_entropy, g_lse,
                 opts: LceOptions, *, logprob=None, zlab=None, need_weight_grad: bool = True,
                 need_hidden_grad: bool = True, config: KernelConfig | None = None, vocab_total: int | None = None,
                 fp32_hidden_grad: bool = False, extra_weight_grad: tuple[torch.Tensor, torch.Tensor] | None = None,
                 hidden_grad_out: torch.Tensor | None = None):
    """``(d_hidden [N, H], d_weight [V, H], d_bias [V] or None)`` in the input dtype.

    ``lse``, ``entropy`` and ``logprob`` are the forward's [N] outputs (see :func:`lce_forward`: the LSE fp64, or
    fp32 at the price of its rounding in every log-prob, the others fp32); ``g_*``
    are fp32 [N] upstream gradients of its per-token outputs, or None for zero. The gradient w.r.t. the final
    logits z is, as plain PyTorch in fp32 (per-token vectors broadcast over the vocab; p = softmax(z),
    E = lse - entropy, eps = label smoothing)::

        kept = labels != ignore_index
        gl, gp = g_loss * kept, g_logprob * kept
        dz = p * (gl * (1 + 2 * z_loss * lse) - gp + g_entropy * (E - z) + g_lse) - gl * eps / V
        dz[kept, labels[kept]] += (gp - gl * (1 - eps))[kept]

    then / temperature and * (1 - tanh^2) with softcap; every entry is rounded once to the input dtype.

    ``logprob`` is required when ``g_loss`` or ``g_logprob`` is given. At a confident prediction (p -> 1) the
    label's entry is ~g (p - 1), lost if p were rounded before the one-hot term is added, so the label column is
    formed on its own from p = exp(logprob), the forward's fp32 log-prob, and rounded once; so is it under
    ``g_entropy`` alone when ``logprob`` is given (its E - z_label = -logprob - entropy is then below the LSE's own
    rounding, which z - lse would carry). ``zlab`` is deprecated
    and ignored: the label's final logit (for the softcap factor) is ``logprob + lse``.
    Extra memory: fp32 [N, H] for d_hidden's sum over vocab slices plus one [N, Vs] d(logits) slice
    (<= ``DLOGITS_BUDGET`` bytes).

    For one rank's vocab shard (:mod:`.distributed`): ``vocab_total`` is the whole vocabulary's size (the V of
    eps / V above; default ``weight.shape[0]``), labels are shard-local column ids, any negative id other than
    ``ignore_index`` meaning "held by another shard" (its token keeps every term but the label column's C), and
    ``fp32_hidden_grad`` returns d_hidden as the fp32 sum itself, to be summed across ranks before one rounding.

    ``extra_weight_grad`` (the mixed RL path, :mod:`.rl`): ``(d2, h2)``, the d(logits) [S, V] (unit column
    stride) and hidden rows [S, H] of other tokens, whose product d2^T @ h2 is added to d_weight: each vocab
    slice's two GEMMs accumulate, piece by piece of ``_dw_rows(H)`` columns, into one fp32 buffer, rounded once
    (extra memory: that buffer, at most ``sft.DW_SLICE_BUDGET`` bytes; fp32 inputs sum into d_weight itself).
    """
    if not hidden2d.is_cuda:
        _tma.check_interpreter(hidden2d.dtype, "lce.backward")  # no launch the interpreter gets wrong
    N, H = hidden2d.shape
    V = weight.shape[0]
    dev, dt = hidden2d.device, hidden2d.dtype
    _check_token_vector("lse", lse, N, (torch.float64, torch.float32))
    label_term = g_loss is not None or g_logprob is not None
    if label_term:
        _check_logprob(logprob, N)
    # The entropy term at the label takes z - lse = log p from the forward's log-prob where one is given.
    label_term = label_term or (g_entropy is not None and logprob is not None)
    if zlab is not None:
        warnings.warn("lce_backward: zlab is deprecated and ignored (the label's logit is logprob + lse)",
                      DeprecationWarning, stacklevel=2)
    if extra_weight_grad is not None and (bias is not None or fp32_hidden_grad):
        raise ValueError("lce_backward: extra_weight_grad is for the mixed RL path (no bias, no fp32 d_hidden)")
    if hidden_grad_out is not None and fp32_hidden_grad:
        raise ValueError("lce_backward: hidden_grad_out receives d_hidden in the inputs' dtype, not with "
                         "fp32_hidden_grad")
    if N == 0 or all(g is None for g in (g_loss, g_logprob, g_entropy, g_lse)):
        d_h = None
        if need_hidden_grad:
            d_h = torch.zeros_like(hidden2d) if hidden_grad_out is None else hidden_grad_out.zero_()
        d_w = torch.zeros(weight.shape, dtype=weight.dtype, device=dev) if need_weight_grad else None
        if extra_weight_grad is not None and need_weight_grad:
            torch.mm(extra_weight_grad[0].t(), extra_weight_grad[1], out=d_w)  # fp32 accumulation, one rounding
        return d_h, d_w, torch.zeros_like(bias) if bias is not None else None
    flags = (g_loss is not None, g_logprob is not None, g_entropy is not None, g_lse is not None)
    V_total = V if vocab_total is None else int(vocab_total)
    if config is None:
        key = (hidden2d.device, dt, hidden2d.shape, hidden2d.stride(), weight.shape, weight.stride(), labels1d.dtype,
               None if bias is None else bias.dtype, lse.dtype, opts, flags, V_total, env_key(),
               alignment_key(hidden2d, weight, labels1d, bias))
        plan = _BACKWARD_PLANS.get(key)
        if plan is None or not plan.fresh():
            plan = _BACKWARD_PLANS.put(key, _build_backward_plan(hidden2d, weight, labels1d, bias, lse, opts, flags,
                                                                 V_total, None))
    else:
        plan = _build_backward_plan(hidden2d, weight, labels1d, bias, lse, opts, flags, V_total, config)
    if plan.interpreted:
        _tma.check_interpreter(dt, "lce.backward")
    _tma.record_decision(plan.decision)
    # Every vocab slice of d_weight and d_bias is written once below: no memset of the [V, H] gradient.
    d_w = torch.empty(weight.shape, dtype=weight.dtype, device=dev) if need_weight_grad else None
    d_b = torch.empty(V, dtype=torch.float32, device=dev) if bias is not None else None
    dbuf = torch.empty((N, plan.ld), dtype=dt, device=dev)
    # The first slice's GEMM writes acc_h with beta = 0: no fill.
    acc_h = torch.empty((N, H), dtype=torch.float32, device=dev) if need_hidden_grad else None
    grads = [g if g is not None else entropy for g in (g_loss, g_logprob, g_entropy, g_lse)]
    b_arg = bias if bias is not None else weight
    acc_w = None
    if extra_weight_grad is not None and need_weight_grad and dt != torch.float32:
        # fp32 sums of at most DW_SLICE_BUDGET bytes (the slice's columns in pieces); fp32 d_weight is its own sum.
        acc_w = torch.empty((min(plan.slices[0][1], _dw_rows(H)), H), dtype=torch.float32, device=dev)
    here = None if plan.interpreted else launch_state()  # device and stream, read once for every launch below
    for col_begin, ncols, dlogits, onehot in plan.slices:
        launch_at(dlogits, here, (hidden2d, weight, b_arg, labels1d, lse, entropy, *grads, dbuf))
        if label_term:
            # Overwrites the label entries just written (same stream): p (A + B (z - lse)) + C + D from the forward's
            # fp32 log-prob, rounded once (z - lse of a confident prediction is below the LSE's own rounding).
            launch_at(onehot, here, (labels1d, lse, entropy, *grads, logprob, dbuf))
        whole = ncols == V  # one slice: the whole tensors, no views to make
        dl = dbuf if whole and plan.ld == V else dbuf[:, :ncols]
        if extra_weight_grad is not None and need_weight_grad:
            # Both token sets' products in one fp32 sum per entry, then one rounding (none for fp32 inputs).
            d2, h2 = extra_weight_grad
            step = ncols if acc_w is None else acc_w.shape[0]
            for c0 in range(0, ncols, step):
                c1 = min(ncols, c0 + step)
                out = d_w[col_begin + c0:col_begin + c1]
                aw = out if acc_w is None else acc_w[:c1 - c0]
                _acc_mm_f32(aw, dl[:, c0:c1].t(), hidden2d, beta=0, out_dtype_mm=plan.mm_out_dtype)
                _acc_mm_f32(aw, d2[:, col_begin + c0:col_begin + c1].t(), h2, out_dtype_mm=plan.mm_out_dtype)
                if acc_w is not None:
                    out.copy_(aw)
        elif need_weight_grad:
            # One GEMM over all N tokens: fp32 accumulation inside cuBLAS, written once in the weight dtype.
            torch.mm(dl.t(), hidden2d, out=d_w if whole else d_w[col_begin:col_begin + ncols])
        if need_hidden_grad:
            _acc_mm_f32(acc_h, dl, weight if whole else weight[col_begin:col_begin + ncols], beta=int(col_begin > 0),
                        out_dtype_mm=plan.mm_out_dtype)
        if d_b is not None:
            d_b[col_begin:col_begin + ncols] = dl.sum(0, dtype=torch.float32)
    d_h = None
    if need_hidden_grad and fp32_hidden_grad:
        d_h = acc_h
    elif need_hidden_grad:
        d_h = acc_h.to(dt) if hidden_grad_out is None else hidden_grad_out.copy_(acc_h)
    return d_h, d_w, d_b.to(bias.dtype) if d_b is not None else None


class _BackwardPlan(Plan):
    """What :func:`lce_backward` decides once per problem: config, TMA decision, the d(logits) slice buffer's
    pitch, and per vocab slice its two launches."""

    __slots__ = ("decision", "ld", "slices", "mm_out_dtype")


_BACKWARD_PLANS = PlanCache("lce.backward")


def _build_backward_plan(hidden2d, weight, labels1d, bias, lse, opts: LceOptions, flags, V_total: int,
                         config: KernelConfig | None) -> _BackwardPlan:
    N, H = hidden2d.shape
    V = weight.shape[0]
    dev, dt = hidden2d.device, hidden2d.dtype
    plan = _BackwardPlan()
    plan.bind_source(None if config is not None or _tma.interpreter_active() else _tuning.device_config(dev), dev)
    cfg = config or pick_config("backward", dt, N, H, dev)
    vs = _slice_cols(N, V, cfg.block_n, hidden2d.element_size())
    plan.ld = cdiv(vs, 64) * 64  # row pitch of the slice buffer: 128-byte aligned rows for TMA stores
    dbuf = torch.empty((N, plan.ld), dtype=dt, device=dev)
    d = _tma.decide(opts.tma, {"hidden": (hidden2d, (cfg.block_m, cfg.block_k)),
                               "weight": (weight, (cfg.block_n, cfg.block_k)),
                               "dlogits": (dbuf, (cfg.block_m, cfg.block_n))}, op="lce.backward", record=False)
    plan.decision = d
    plan.mm_out_dtype = dt != torch.float32 and hidden2d.is_cuda and _tma.torch_mm_out_dtype(dev, dt)
    has = dict(zip(("HAS_GL", "HAS_GP", "HAS_GE", "HAS_GZ"), flags))
    scal = (opts.ignore_index, float(opts.label_smoothing), float(opts.z_loss), float(opts.softcap or 1.0),
            opts.inv_temp)
    b_arg = bias if bias is not None else weight
    f32 = torch.empty(1, dtype=torch.float32, device=dev)  # stands for the fp32 [N] vectors: Launch keeps dtypes
    sms = _sm_count(dev)
    plan.slices = []
    for col_begin in range(0, V, vs):
        ncols = min(vs, V - col_begin)
        num_tiles = cdiv(N, cfg.block_m) * cdiv(ncols, cfg.block_n)
        progs = min(num_tiles, sms)
        dlogits = Launch(
            lce_dlogits_kernel, (progs,),
            hidden2d, weight, b_arg, labels1d, lse, f32, f32, f32, f32, f32, dbuf, N, V, V_total, H, col_begin,
            ncols, hidden2d.stride(0), hidden2d.stride(1), weight.stride(0), weight.stride(1), dbuf.stride(0), *scal,
            BLOCK_N=cfg.block_m, BLOCK_V=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_N=cfg.group_m,
            HAS_BIAS=bias is not None, SOFTCAP=softcap_mode(opts.softcap), **has, NUM_PROGRAMS=progs,
            FLATTEN=cfg.flatten,
            H_TMA=d["hidden"], W_TMA=d["weight"], D_TMA=d["dlogits"], DOT_PRECISION=dot_precision(dt),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
        onehot = Launch(
            lce_onehot_kernel, (cdiv(N, _COMBINE_BLOCK),),
            labels1d, lse, f32, f32, f32, f32, f32, f32, dbuf, N, V_total, col_begin, ncols,
            dbuf.stride(0), *scal, BLOCK_N=_COMBINE_BLOCK, SOFTCAP=softcap_mode(opts.softcap), **has,
        )
        plan.slices.append((col_begin, ncols, dlogits, onehot))
    return plan
