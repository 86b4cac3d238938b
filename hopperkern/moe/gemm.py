"""Launchers of the grouped GEMMs of fused_moe (public, for callers that build their own pipeline).

::

    plan  = moe_align(topk_ids, E, cfg.gemm1.block_m)
    inter = gate_up(hidden, w13, plan, config=cfg.gemm1)                  # [plan.max_rows, I], sorted rows
    out   = down(inter, w2, topk_weights, topk_ids, plan, config=cfg.gemm2)  # [T, H]

These launchers check only what the kernels need to be memory-safe (shapes agree with the plan, block sizes);
:func:`hopperkern.moe.fused_moe` does the full input validation. Each records its TMA decision under the op
names ``"moe.gemm1"`` / ``"moe.gemm2"`` (see :func:`hopperkern.tma.last_decision`).
"""

from __future__ import annotations

import torch

from .. import tma as _tma
from .._host import cdiv, next_power_of_2
from .._validate import check_choice, dot_precision
from ..tuning import KernelConfig, MoeConfig
from ._gemm_kernels import (ACT_GELU_TANH, ACT_SILU, _down_direct_kernel, _down_kernel, _gate_up_down_kernel,
                            _gate_up_kernel, _gather_rows_kernel, _partial_topk_sum_kernel, _topk_sum_kernel)
from ..tma.launcher import Launch, run_steps
from .align import AlignPlan, flat_ids
from .configs import atomic_config, chain_decode, num_programs

__all__ = ["ACTIVATIONS", "down", "gate_up", "slot_gemm_sum", "topk_sum"]

ACTIVATIONS = {"silu": ACT_SILU, "gelu_tanh": ACT_GELU_TANH}


def _check_shape(what: str, name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{what}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_plan(plan: AlignPlan, config: KernelConfig, what: str) -> None:
    if config.block_m != plan.block_m:
        raise ValueError(f"{what}: config.block_m must be {plan.block_m} (the plan's block_m), got {config.block_m}")
    for name in ("block_n", "block_k"):
        if getattr(config, name) < 16:
            raise ValueError(f"{what}: config.{name} must be >= 16 (tl.dot minimum), got {getattr(config, name)}")


def gate_up(hidden: torch.Tensor, w13: torch.Tensor, plan: AlignPlan, *, config: KernelConfig,
            activation: str = "silu", tma: str = "auto", out: torch.Tensor | None = None,
            pre_out: torch.Tensor | None = None) -> torch.Tensor:
    """GEMM1 of fused_moe over the sorted rows of ``plan``.

    hidden [T, H]; w13 [E, 2*I, H]. Returns ``y`` [plan.max_rows, I] in hidden's dtype where, for each live
    sorted row r holding slot s = t*k + j of expert e: ``y[r] = act(hidden[t] @ w13[e, :I].T) *
    (hidden[t] @ w13[e, I:].T)`` (fp32 accumulation, one rounding at the store); padding rows hold 0, rows past
    the live blocks are not written. ``out`` (optional) is a preallocated ``y`` with unit inner stride.
    An empty problem (no row blocks, or I == 0) returns ``out`` before the TMA decision, so ``tma="always"``
    does not refuse it.

    ``pre_out`` (training; sorted plans only): a [plan.max_rows, 2*I] buffer (unit inner stride) that also
    receives the gate (columns 0..I-1) and up (I..2I-1) pre-activations of every live row block, rounded once
    to its dtype; the backward (:mod:`hopperkern.moe.backward`) reads them instead of recomputing.
    """
    _check_plan(plan, config, "gate_up")
    check_choice("activation", activation, tuple(ACTIVATIONS))
    E, two_i, H = w13.shape
    I = two_i // 2  # noqa: E741 - MoE intermediate size
    _check_shape("gate_up", "hidden", hidden, (plan.num_slots // max(plan.top_k, 1), H))
    if E != plan.num_experts:
        raise ValueError(f"gate_up: w13 must have {plan.num_experts} experts (the plan's), got {E}")
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    if out is None:
        out = torch.empty((plan.max_rows, I), dtype=hidden.dtype, device=hidden.device)
    _check_shape("gate_up", "out", out, (plan.max_rows, I))
    if out.stride(-1) != 1:
        raise ValueError(f"gate_up: out must have unit inner stride, got strides {tuple(out.stride())}")
    save = pre_out is not None
    if save:
        if plan.direct:
            raise ValueError("gate_up: pre_out needs a sorted plan (moe_align), got a direct plan")
        _check_shape("gate_up", "pre_out", pre_out, (plan.max_rows, 2 * I))
        if pre_out.stride(-1) != 1 or pre_out.dtype != hidden.dtype:
            raise ValueError(f"gate_up: pre_out must have unit inner stride and hidden's dtype, got strides "
                             f"{tuple(pre_out.stride())} and {pre_out.dtype}")
    if plan.max_blocks == 0 or I == 0:
        return out  # nothing to launch; before decide(): "always" would refuse the zero-size operands
    operands = {"w13": (w13, (1, bn, bk)), "inter": (out, (bm, bn))}
    if save:
        operands.update(pre_gate=(pre_out[:, :I], (bm, bn)), pre_up=(pre_out[:, I:], (bm, bn)))
    d = _tma.decide(tma, operands, op="moe.gemm1", auto_pointer=direct_pointer_reason(plan))
    env = dict(hidden=hidden, w13=w13, inter=out, **plan_env(plan))
    env["pre_gate"], env["pre_up"] = (pre_out[:, :I], pre_out[:, I:]) if save else (out, out)
    with _tma.launch_context(hidden, "moe.gate_up"):
        run_steps([gate_up_step(env, plan, config, activation, d, save)], env)
    return out


def direct_pointer_reason(plan: AlignPlan) -> str | None:
    """Why ``tma="auto"`` reads a DIRECT plan's operands with pointer loads (None for a sorted plan): each
    program of those GEMMs streams one or two tiles, so building its device-side TMA descriptors at the start
    is not hidden; on the H200 the pointer path is 2.5-3.5 us faster per decode call (``bench_moe``'s
    hopperkern-ptr rows at M = 1). ``tma="always"`` still takes TMA."""
    if not plan.direct:
        return None
    return "direct plan (tiny batch): pointer loads beat per-program device-side descriptors here"


def plan_env(plan: AlignPlan) -> dict:
    """The plan's tensors under the names the GEMM steps use (a direct plan's ids stand in for the rest)."""
    if plan.direct:
        return dict(slots=plan.direct_ids, block_expert=plan.direct_ids, num_blocks=plan.direct_ids)
    return dict(slots=plan.sorted_slots, block_expert=plan.block_expert, num_blocks=plan.num_blocks)


def gate_up_step(env: dict, plan: AlignPlan, config: KernelConfig, activation: str, d, save: bool,
                 sorted_rows: bool = False):
    """The launch of :func:`gate_up` as a ``(Launch, tensor names)`` step over ``env`` (hidden, w13, inter,
    pre_gate, pre_up and :func:`plan_env`'s names); ``d`` is its TMA decision. ``sorted_rows``: the A rows are
    ``env["xs"]``, :func:`gather_rows_step`'s sorted copy of the token rows, read with 2-D TMA."""
    w13, out, pg = env["w13"], env["inter"], env["pre_gate"]
    x_name = "xs" if sorted_rows else "hidden"
    x = env[x_name]
    E, two_i, H = w13.shape
    I = two_i // 2  # noqa: E741
    bn = config.block_n
    progs = num_programs(config, x.element_size(), 2, x.device)
    names = (x_name, "w13", "inter", "pre_gate", "pre_up", "slots", "block_expert", "num_blocks")
    return Launch(
        _gate_up_kernel, (min(plan.max_blocks * cdiv(I, bn), progs),), *[env[n] for n in names],
        E, H, I, plan.max_rows, plan.num_slots, plan.top_k, plan.max_blocks,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), out.stride(0),
        pg.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=bn, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        ACT=ACTIVATIONS[activation], W_TMA=d["w13"], Y_TMA=d["inter"], DOT_PRECISION=dot_precision(x.dtype),
        DIRECT=plan.direct, NUM_PROGRAMS=progs, FLATTEN=config.flatten, SAVE_PRE=save,
        PG_TMA=save and d["pre_gate"], PU_TMA=save and d["pre_up"], X_SORTED=sorted_rows,
        num_warps=config.num_warps, num_stages=config.num_stages,
    ), names


_GATHER_BLOCK_R, _GATHER_BLOCK_H = 16, 512  # rows x columns per program of the sorted row copies


def gather_rows_step(env: dict, plan: AlignPlan, src: str = "hidden", dst: str = "xs"):
    """The copy of the token rows ``env[src]`` [T, H] into the plan's sorted order ``env[dst]`` [plan.max_rows, H]
    (unit inner stride) as a step over ``env`` (and :func:`plan_env`'s names): dst[r] = src[slot(r) // k] for the
    live sorted rows, zeros for padding rows, rows past the live blocks untouched. Sorted plans only."""
    t, out = env[src], env[dst]
    H = t.shape[1]
    bh = min(_GATHER_BLOCK_H, next_power_of_2(max(H, 1)))
    names = (src, "slots", "num_blocks", dst)
    return Launch(
        _gather_rows_kernel, (cdiv(plan.max_rows, _GATHER_BLOCK_R), cdiv(H, bh)), *[env[n] for n in names],
        plan.max_rows, plan.num_slots, plan.top_k, H, t.stride(0), t.stride(1), out.stride(0),
        ROWS_PER_BLOCK=plan.block_m, BLOCK_R=_GATHER_BLOCK_R, BLOCK_H=bh, num_warps=4,
    ), names


def down(inter: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
         plan: AlignPlan, *, config: KernelConfig, tma: str = "auto", deterministic: bool = True,
         out_dtype=None, fused_topk: bool = False) -> torch.Tensor:
    """GEMM2 of fused_moe plus the routed-weight multiply and the reduction over top-k.

    inter [plan.max_rows, I] (from :func:`gate_up`, unit inner stride); w2 [E, H, I]; topk_weights and
    topk_ids [T, k]. Returns ``out`` [T, H] (``out_dtype``, default inter's dtype) with
    ``out[t] = sum_j topk_weights[t, j] * inter[row(t, j)] @ w2[topk_ids[t, j]].T`` over the live slots.

    ``deterministic=False``: fp32 atomic adds into a [T, H] fp32 buffer (then one cast unless out_dtype is
    fp32); the add order varies, so bits can differ run to run. ``deterministic=True``: each slot's weighted
    row is stored once ([T*k, H] in out_dtype, rounded once) and :func:`topk_sum` adds them in order j = 0..k-1;
    bitwise reproducible, costs a write and a read of T*k*H elements.

    ``fused_topk=True`` with a DIRECT plan (:func:`direct_plan`, tiny batches; ignored otherwise, and then
    ``deterministic`` does not apply): one program per (token, BLOCK_N columns) walks the token's k experts and
    sums them in registers (fp32, j in order, one rounding at the store): deterministic, no buffer, no second
    launch, but k times fewer programs. Measured on the H200, it wins where those few
    programs still cover the GPU with short K (DeepSeek-V3 TP8, H = 7168, I = 256) and loses elsewhere; the
    tuner decides per shape (``MoeConfig.fused_topk``).

    An empty problem (no row blocks, H == 0 or I == 0) returns zeros before the TMA decision, so
    ``tma="always"`` does not refuse it.
    """
    _check_plan(plan, config, "down")
    if inter.stride(-1) != 1:
        raise ValueError(f"inter must have unit inner stride, got strides {tuple(inter.stride())}")
    E, H, I = w2.shape  # noqa: E741
    T, k = topk_ids.shape
    _check_shape("down", "inter", inter, (plan.max_rows, I))
    _check_shape("down", "topk_ids", topk_ids, (plan.num_slots // max(plan.top_k, 1), plan.top_k))
    _check_shape("down", "topk_weights", topk_weights, (T, k))
    if E != plan.num_experts:
        raise ValueError(f"down: w2 must have {plan.num_experts} experts (the plan's), got {E}")
    out_dtype = inter.dtype if out_dtype is None else out_dtype
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    dev = inter.device
    if plan.max_blocks == 0 or H == 0 or I == 0:
        # Every output is an empty sum; before decide(): "always" would refuse the zero-size operands.
        return torch.zeros((T, H), dtype=out_dtype, device=dev)
    d = _tma.decide(tma, {"inter": (inter, (bm, bk)), "w2": (w2, (1, bn, bk))}, op="moe.gemm2",
                    auto_pointer=direct_pointer_reason(plan))
    if plan.direct and fused_topk:
        return _down_direct(inter, w2, topk_weights, topk_ids, plan, config, d, out_dtype)
    return slot_gemm_sum(inter, w2, topk_weights, topk_ids, plan, config, d["inter"], d["w2"], deterministic,
                         out_dtype, "moe.down")


def slot_gemm_sum(a: torch.Tensor, w: torch.Tensor, topk_weights: torch.Tensor | None, topk_ids: torch.Tensor,
                  plan: AlignPlan, config: KernelConfig, a_tma: bool, w_tma: bool, deterministic: bool, out_dtype,
                  what: str, *, w_kn: bool = False) -> torch.Tensor:
    """``out[t] = sum_j scale(t, j) * a[row(t, j)] @ W[e]`` over live slots: the down GEMM of the forward
    (``w`` = w2 [E, N, K], W[e] = w2[e]^T, scale = the routed weight) and the d_hidden GEMM of the backward
    (``w_kn``: ``w`` = w13 [E, K, N] used as is, ``topk_weights=None``: no scale). The top-k reduction is
    deterministic (per-slot rows, then :func:`topk_sum`) or fp32 atomics; see :func:`down`. A token with an id
    outside [-1, E) gets a NaN row. TMA flags are decided by the caller."""
    _check_plan(plan, config, what)
    n_out = w.shape[2] if w_kn else w.shape[1]
    T, k = topk_ids.shape
    env = dict(inter=a, w2=w, tw=topk_weights if topk_weights is not None else a, ids=flat_ids(topk_ids),
               **plan_env(plan))
    env["buf"] = torch.empty(slot_buffer_shape(T, k, n_out, deterministic), dtype=out_dtype if deterministic
                             else torch.float32, device=a.device)
    env["out"] = torch.empty((T, n_out), dtype=out_dtype, device=a.device) if deterministic else env["buf"]
    with _tma.launch_context(a, what):
        steps = slot_steps(env, plan, config, a_tma, w_tma, deterministic, w_kn=w_kn, scale=topk_weights is not None)
        run_steps(chain_decode(steps, T, a.device), env)
    out = env["out"]
    return out if deterministic or out_dtype == torch.float32 else out.to(out_dtype)


def slot_buffer_shape(T: int, k: int, n_out: int, deterministic: bool) -> tuple:
    """Per-slot rows [T*k, N] (deterministic) or the fp32 atomic sum [T, N]."""
    return (T * k, n_out) if deterministic else (T, n_out)


def slot_steps(env: dict, plan: AlignPlan, config: KernelConfig, a_tma: bool, w_tma: bool, deterministic: bool, *,
               w_kn: bool = False, scale: bool = True) -> list:
    """:func:`slot_gemm_sum`'s launches as steps over ``env`` (inter = the A rows, w2 = the weights, tw, ids =
    flat topk_ids, buf (:func:`slot_buffer_shape`), out [T, N], and :func:`plan_env`'s names): deterministic,
    the GEMM into per-slot rows then :func:`topk_sum`; else the zero (NaN for a bad id) fill of the fp32 sum, then
    the GEMM's atomic adds into it."""
    a, w, tw, buf = env["inter"], env["w2"], env["tw"], env["buf"]
    E = w.shape[0]
    n_out, k_dim = (w.shape[2], w.shape[1]) if w_kn else (w.shape[1], w.shape[2])
    T = buf.shape[0] // plan.top_k if deterministic else buf.shape[0]
    if not deterministic:  # the fp32 epilogue of the atomic sum needs more shared memory than the tuned store
        config = atomic_config(config, a.element_size())
    progs = num_programs(config, a.element_size(), 1, a.device, out_elem_size=None if deterministic else 4)
    # _down_kernel's names: N stride "stride_wh", K stride "stride_wi".
    w_n_stride, w_k_stride = (w.stride(2), w.stride(1)) if w_kn else (w.stride(1), w.stride(2))
    tw_strides = (tw.stride(0), tw.stride(1)) if scale else (0, 0)
    names = ("inter", "w2", "buf", "tw", "slots", "block_expert", "num_blocks")
    gemm = Launch(
        _down_kernel, (min(plan.max_blocks * cdiv(n_out, config.block_n), progs),), *[env[n] for n in names],
        E, n_out, k_dim, plan.max_rows, plan.num_slots, plan.top_k, plan.max_blocks,
        a.stride(0), w.stride(0), w_n_stride, w_k_stride, *tw_strides, buf.stride(0), buf.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        Y_TMA=a_tma, W_TMA=w_tma, ATOMIC=not deterministic, DOT_PRECISION=dot_precision(a.dtype),
        DIRECT=plan.direct, NUM_PROGRAMS=progs, FLATTEN=config.flatten, B_KN=w_kn,
        SCALE=scale, num_warps=config.num_warps, num_stages=config.num_stages,
    ), names
    if deterministic:
        return [gemm, topk_sum_step(env, "buf", "out", E, T, plan.top_k, n_out)]
    return [topk_sum_step(env, "buf", "buf", E, T, plan.top_k, n_out, fill=True), gemm]


def _down_direct(inter, w2, topk_weights, topk_ids, plan, config, d, out_dtype):
    """Down GEMM of a DIRECT plan with the top-k sum in the same kernel (:func:`_down_direct_kernel`): one
    program per (token, column tile) walks the token's k experts, so there is no per-slot buffer and no
    second launch. Deterministic (no atomics)."""
    T, H = topk_ids.shape[0], w2.shape[1]
    env = dict(inter=inter, w2=w2, tw=topk_weights, ids=plan.direct_ids,
               out=torch.empty((T, H), dtype=out_dtype, device=inter.device))
    with _tma.launch_context(inter, "moe.down"):
        run_steps([down_direct_step(env, plan, config, d)], env)
    return env["out"]


def down_direct_step(env: dict, plan: AlignPlan, config: KernelConfig, d):
    """:func:`_down_direct`'s launch as a step over ``env`` (inter, w2, tw, ids = flat topk_ids, out [T, H])."""
    inter, w2, tw, out = env["inter"], env["w2"], env["tw"], env["out"]
    E, H, I = w2.shape  # noqa: E741
    T, k = out.shape[0], plan.top_k
    bn = config.block_n
    progs = num_programs(config, inter.element_size(), 1, inter.device)
    names = ("inter", "w2", "out", "tw", "ids")
    return Launch(
        _down_direct_kernel, (min(T * cdiv(H, bn), progs),), *[env[n] for n in names],
        E, H, I, plan.max_rows, T, k,
        inter.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), tw.stride(0), tw.stride(1), out.stride(0),
        out.stride(1),
        BLOCK_M=config.block_m, BLOCK_N=bn, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        TOP_K_P=next_power_of_2(k), Y_TMA=d["inter"], W_TMA=d["w2"], DOT_PRECISION=dot_precision(inter.dtype),
        NUM_PROGRAMS=progs, FLATTEN=config.flatten, num_warps=config.num_warps, num_stages=config.num_stages,
    ), names


def partial_rows(num_slots: int, I: int, block_i: int) -> int:  # noqa: E741
    """Rows of the fp32 partial sums of :func:`fused_mlp_steps`: one per (slot, slice of ``block_i`` columns
    of I)."""
    return num_slots * cdiv(I, block_i)


_PARTIAL_SUM_ELEMS = 2048  # elements of one block (rows x columns) of the partial sum: 32 columns of 64 rows


def fused_mlp_steps(env: dict, plan: AlignPlan, config: MoeConfig, activation: str, d1, d2) -> list:
    """The launches of ``MoeConfig.fused_mlp`` on a DIRECT plan as steps over ``env`` (hidden, w13, w2, tw, ids =
    flat topk_ids, part = fp32 [:func:`partial_rows`, H], out [T, H]): :func:`_gate_up_down_kernel` (both GEMMs,
    one program per slot and slice of I) and :func:`_partial_topk_sum_kernel` (each token's partial rows added in a
    fixed order, one rounding). ``d1`` / ``d2``: the TMA decisions of w13 and w2. ``part`` is contiguous (row
    pitch H); calls after the first may pass it as a flat view."""
    x, w13, w2, tw, part, out = env["hidden"], env["w13"], env["w2"], env["tw"], env["part"], env["out"]
    E, two_i, H = w13.shape
    I, k = two_i // 2, plan.top_k  # noqa: E741
    g1, g2 = config.gemm1, config.gemm2
    num_i = cdiv(I, g1.block_n)
    names = ("hidden", "w13", "w2", "part", "tw", "ids")
    mlp = Launch(
        _gate_up_down_kernel, (plan.num_slots * num_i,), *[env[n] for n in names],
        E, H, I, plan.num_slots, k,
        x.stride(0), x.stride(1), w13.stride(0), w13.stride(1), w13.stride(2), w2.stride(0), w2.stride(1),
        w2.stride(2), tw.stride(0), tw.stride(1), H,
        BLOCK_M=g1.block_m, BLOCK_I=g1.block_n, BLOCK_K=g1.block_k, BLOCK_H=g2.block_n, STAGES_1=g1.num_stages,
        STAGES_2=g2.num_stages, ACT=ACTIVATIONS[activation], W1_TMA=d1["w13"], W2_TMA=d2["w2"],
        DOT_PRECISION=dot_precision(x.dtype), num_warps=g1.num_warps, num_stages=g1.num_stages,
    ), names
    rows = k * num_i
    chunk = min(next_power_of_2(rows), 64)
    bh = max(16, min(next_power_of_2(H), _PARTIAL_SUM_ELEMS // chunk))
    T = plan.num_slots // max(k, 1)
    names2 = ("part", "ids", "out")
    total = Launch(
        _partial_topk_sum_kernel, (T, cdiv(H, bh)), *[env[n] for n in names2],
        E, H, H, out.stride(0), out.stride(1),
        TOP_K=k, NUM_I=num_i, ROWS=chunk, CHUNKS=cdiv(rows, chunk), BLOCK_H=bh, num_warps=4,
    ), names2
    return [mlp, total]


def topk_sum(slot_rows: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *, out_dtype=None,
             block_h: int = 1024) -> torch.Tensor:
    """``out[t] = sum_j slot_rows[t*k + j]`` (fp32, j in order) over slots with ids in [0, num_experts); a
    token with an id outside [-1, num_experts) gets NaN.

    slot_rows [T*k, H] with unit inner stride; topk_ids [T, k]. Returns [T, H] in ``out_dtype`` (default
    slot_rows' dtype). Rows of dropped slots are never read, so they may hold garbage."""
    T, k = topk_ids.shape
    H = slot_rows.shape[1]
    if slot_rows.shape[0] != T * k or slot_rows.stride(-1) != 1:
        raise ValueError(f"slot_rows must be [{T * k}, H] with unit inner stride, got shape "
                         f"{tuple(slot_rows.shape)} strides {tuple(slot_rows.stride())}")
    out = torch.empty((T, H), dtype=out_dtype or slot_rows.dtype, device=slot_rows.device)
    if T == 0 or H == 0:
        return out
    env = dict(buf=slot_rows, ids=flat_ids(topk_ids), out=out)
    with _tma.launch_context(slot_rows, "moe.topk_sum"):
        run_steps([topk_sum_step(env, "buf", "out", num_experts, T, k, H, block_h=block_h)], env)
    return out


def topk_sum_step(env: dict, src: str, dst: str, E: int, T: int, k: int, H: int, *, fill: bool = False,
                  block_h: int = 1024):
    """:func:`topk_sum` from ``env[src]`` into ``env[dst]`` (``ids`` = flat topk_ids) as a step; ``fill``:
    ``dst`` gets zeros, NaN rows for tokens with a bad id (src is not read)."""
    bh = min(block_h, next_power_of_2(H))
    names = (src, "ids", dst)
    return Launch(_topk_sum_kernel, (T, cdiv(H, bh)), *[env[n] for n in names], E, H, env[src].stride(0),
                  env[dst].stride(0), env[dst].stride(1), TOP_K=k, BLOCK_H=bh, FILL=fill, num_warps=4), names
