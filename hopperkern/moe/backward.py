"""Launchers of the fused_moe backward (public, for callers that build their own pipeline).

::

    plan  = moe_align(topk_ids, E, cfg.gemm1.block_m)
    pre   = torch.empty(plan.max_rows, 2 * I, dtype=hidden.dtype, device=hidden.device)
    inter = gate_up(hidden, w13, plan, config=cfg.gemm1, pre_out=pre)         # forward, saving pre-activations
    out   = down(inter, w2, topk_weights, topk_ids, plan, config=cfg.gemm2)
    d_hidden, d_w13, d_w2, d_tw = moe_backward(d_out, hidden, w13, w2, topk_weights, topk_ids, plan,
                                               pre=pre, config=cfg)

Math and kernels: :mod:`hopperkern.moe._backward_kernels`. Every gradient is formed from fp32 accumulators
and rounded once to its tensor's dtype: d(gate, up) in the epilogue of the dY GEMM; d_hidden as per-slot
rows then the k slots of a token summed in a fixed order in fp32 (``deterministic=False``: fp32 atomics);
d_w13 and d_w2 summed over each expert's rows in fp32 registers and written once (an expert without tokens
gets exact zeros); d_topk_weights summed over column tiles in a fixed order. No host synchronisation.

Two ways to get the pre-activations g, u that the activation gradient needs: ``pre`` (saved by the forward,
[plan.max_rows, 2I]: memory) or ``pre=None`` (recomputed inside the dY GEMM from the sorted hidden rows, with
the same K = H: three times the FLOPs of that GEMM). Either way y = act(g) * u is formed again in the dY
GEMM's epilogue, so the forward's intermediate rows are not kept.
"""

from __future__ import annotations

import torch

from .. import tma as _tma
from .._host import cdiv
from .._validate import dot_precision
from ..tma.launcher import run_steps
from ..tuning import KernelConfig, MoeConfig
from ._backward_kernels import _dgate_up_kernel, _expert_wgrad_kernel, _topk_weight_grad_kernel
from .align import AlignPlan
from .configs import num_programs
from .gemm import ACTIVATIONS, gather_rows_step, plan_env, slot_gemm_sum

__all__ = ["backward_configs", "gather_rows", "moe_backward", "wgrad_config"]

_TW_BLOCK = 256  # rows per program of the topk-weight gradient reduction


def wgrad_config(block_m: int, dtype, interpreter: bool = False) -> KernelConfig:
    """Config of the per-expert weight-gradient GEMMs (M x N tiles, K = rows of one expert in steps of
    block_k, which must divide the plan's block_m)."""
    if interpreter:
        return KernelConfig(block_m=32, block_n=32, block_k=min(16, block_m), group_m=4, num_warps=4, num_stages=1)
    if dtype == torch.float32:
        return KernelConfig(block_m=64, block_n=64, block_k=min(32, block_m), group_m=8, num_warps=4, num_stages=3)
    # 128 x 256 tiles: measured on the H200 (qwen3-30B-A3B / gpt-oss-120B at 16384 tokens) the training step
    # took 10.2 / 28.6 ms against 12.0 / 32.6 ms with 128 x 128 (K is short here: ~T*k/E rows per expert).
    return KernelConfig(block_m=128, block_n=256, block_k=min(64, block_m), group_m=8, num_warps=8, num_stages=3,
                        flatten=True)


def backward_configs(config: MoeConfig, dtype, recompute: bool,
                     interpreter: bool = False) -> tuple[KernelConfig, KernelConfig, KernelConfig]:
    """(dY GEMM, d_hidden GEMM, weight-gradient GEMMs) configs from the forward's ``config``.

    The dY GEMM has the forward GEMM1's M, N, K (sorted rows, I, H) and the d_hidden GEMM GEMM2's M and N (rows,
    H) with K = 2I, so they start from those configs. The dY GEMM's epilogue keeps about six fp32 tiles live
    (dY, g, u, act, act', y): block_n is capped at 32 fp32 values per thread and tile (128 x 64 with 8 warps),
    which ptxas compiles without spills for sm_90 in both the saved and the recomputing variant
    (``python -m benchmarks.compile_moe_sm90``). A forward tile of 128 rows with fewer than 8 warps (two programs
    per SM in the forward) gives the dY GEMM 8 warps: with 4 its epilogue spills."""
    g1, g2 = config.gemm1, config.gemm2
    if g1.block_m >= 128 and g1.num_warps < 8:
        g1 = g1.model_copy(update={"num_warps": 8})
    cap = max(16, 32 * 32 * g1.num_warps // g1.block_m)
    if g1.block_n > cap:
        g1 = g1.model_copy(update={"block_n": cap})
    # Shared memory per stage: the gathered dOut tile and one w2 tile per half; recomputing adds the gathered
    # hidden tile and the gate and up tiles of w13. Keep the stages within ~200 KiB with the epilogue buffers.
    es = dtype.itemsize
    halves = 1 if recompute else 2
    per_stage = ((2 if recompute else 1) * g1.block_m + (3 if recompute else halves) * g1.block_n) * g1.block_k * es
    stages = max(1, min(g1.num_stages, (200 * 1024 - 2 * g1.block_m * g1.block_n * es) // per_stage))
    if stages != g1.num_stages:
        g1 = g1.model_copy(update={"num_stages": stages})
    return g1, g2, wgrad_config(g1.block_m, dtype, interpreter)


def _check_saved(name: str, t: torch.Tensor, shape: tuple, dtype) -> None:
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.stride(-1) != 1:
        raise ValueError(f"{name} must be {tuple(shape)} {dtype} with unit inner stride (from the forward), got "
                         f"{tuple(t.shape)} {t.dtype} strides {tuple(t.stride())}")


def moe_backward(d_out: torch.Tensor, hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                 topk_weights: torch.Tensor, topk_ids: torch.Tensor, plan: AlignPlan, *, config: MoeConfig,
                 pre: torch.Tensor | None = None, activation: str = "silu",
                 tma: str = "auto", deterministic: bool = True, need_hidden: bool = True, need_w13: bool = True,
                 need_w2: bool = True, need_topk_weights: bool = True):
    """Gradients ``(d_hidden [T, H], d_w13 [E, 2I, H], d_w2 [E, H, I], d_topk_weights [T, k])`` of
    :func:`hopperkern.moe.fused_moe` for the upstream gradient ``d_out`` [T, H]; a gradient that is not needed
    comes back as None.

    ``plan`` is the forward's sorted plan (:func:`hopperkern.moe.moe_align`, not a direct plan); ``pre`` the
    forward's saved pre-activations (``gate_up(..., pre_out=pre)``), or None to recompute them here. ``config``:
    the forward's :class:`~hopperkern.tuning.MoeConfig` (both GEMMs' block_m must be the plan's). Gradients come
    contiguous, in the dtype of their input; ``deterministic=False`` sums d_hidden with fp32 atomics (bits may
    vary run to run). The plan and shapes are checked against the inputs here; the inputs themselves must be
    validated already (:func:`hopperkern.moe.fused_moe` does).
    """
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    k = topk_ids.shape[1]
    dev, dt = hidden.device, hidden.dtype
    if plan.direct:
        raise ValueError("moe_backward needs a sorted plan (moe_align), got a direct plan")
    if (plan.num_slots, plan.top_k, plan.num_experts) != (T * k, k, E):
        raise ValueError(f"plan must be built from topk_ids {tuple(topk_ids.shape)} for {E} experts, got a plan of "
                         f"{plan.num_slots} slots, top_k {plan.top_k}, {plan.num_experts} experts")
    if tuple(w2.shape) != (E, H, I) or tuple(topk_weights.shape) != (T, k):
        raise ValueError(f"w2 must be {(E, H, I)} and topk_weights {(T, k)}, got {tuple(w2.shape)} and "
                         f"{tuple(topk_weights.shape)}")
    if tuple(d_out.shape) != (T, H) or d_out.dtype != dt:
        raise ValueError(f"d_out must be [{T}, {H}] {dt}, got {tuple(d_out.shape)} {d_out.dtype}")
    # Contiguous gradients (the custom op's fake implementation promises them, whatever the inputs' strides).
    # Dropped slots keep 0; a slot whose id is outside [-1, E) gets NaN (its token's output was NaN).
    d_tw = (torch.zeros(topk_weights.shape, dtype=topk_weights.dtype, device=dev)
            .masked_fill_((topk_ids < -1) | (topk_ids >= E), float("nan")) if need_topk_weights else None)
    if plan.max_blocks == 0 or T * k == 0 or H == 0 or I == 0:
        zeros = [torch.zeros(t.shape, dtype=t.dtype, device=dev) if need else None
                 for t, need in ((hidden, need_hidden), (w13, need_w13), (w2, need_w2))]
        return (*zeros, d_tw)
    for name, g in (("gemm1", config.gemm1), ("gemm2", config.gemm2)):
        if g.block_m != plan.block_m:
            raise ValueError(f"config.{name}.block_m must be {plan.block_m} (the plan's block_m), got {g.block_m}")
    recompute = pre is None
    if not recompute:
        _check_saved("pre", pre, (plan.max_rows, 2 * I), dt)
    d_h = d_w13 = d_w2 = None
    interp = _tma.interpreter_active()
    if interp and need_topk_weights:
        # d_topk_weights is written in topk_weights' dtype, which may differ from hidden's: the interpreter must
        # round it right too (UnsupportedError, never a truncated gradient).
        _tma.check_interpreter(topk_weights.dtype, "moe.backward")
    c1, c2, cw = backward_configs(config, dt, recompute, interp)
    rows = plan.max_rows
    bm, bn, bk = c1.block_m, c1.block_n, c1.block_k
    with _tma.launch_context(hidden, "moe.backward"):
        # 1) Sorted copies of the upstream-gradient rows (and of the hidden rows when recomputing): every GEMM
        #    below reads contiguous row tiles instead of gathering inside its K loop.
        d_sorted = gather_rows(d_out, plan)
        x_sorted = gather_rows(hidden, plan) if recompute else None
        # 2) dY = Ds @ w2[e] with the activation backward: d(gate, up), Yw = w y, partial <dY, y>.
        dgu = torch.empty((rows, 2 * I), dtype=dt, device=dev)
        y_w = torch.empty((rows, I), dtype=dt, device=dev)
        pg, pu = (y_w, y_w) if recompute else (pre[:, :I], pre[:, I:])
        dg, du = dgu[:, :I], dgu[:, I:]
        ops = {"d_out_sorted": (d_sorted, (bm, bk)), "w2": (w2, (1, bk, bn)), "d_gate": (dg, (bm, bn)),
               "d_up": (du, (bm, bn)), "y_weighted": (y_w, (bm, bn))}
        if recompute:
            ops.update(hidden_sorted=(x_sorted, (bm, bk)), w13=(w13, (1, bn, bk)))
        else:
            ops.update(pre_gate=(pg, (bm, bn)), pre_up=(pu, (bm, bn)))
        d = _tma.decide(tma, ops, op="moe.backward.dgate_up")
        del ops  # it references Ds and Yw: they must be freed below
        # Two accumulators per tile (see _dgate_up_kernel) where the epilogue's tiles come through TMA: with
        # pointer loads and stores that epilogue spills registers (ptxas, sm_90), so those launches keep one.
        halves = 2 if not recompute and I > bn and all(d.use.values()) else 1
        num_n = cdiv(I, halves * bn)
        part = torch.empty((num_n, rows), dtype=torch.float32, device=dev)
        x_arg = x_sorted if recompute else d_sorted
        progs = num_programs(c1, dt.itemsize, 3 if recompute else halves, dev)
        grid = (min(plan.max_blocks * num_n, progs),)
        _dgate_up_kernel[grid](
            d_sorted, w2, x_arg, w13, pg, pu, y_w, dg, du, part, topk_weights, plan.sorted_slots,
            plan.block_expert, plan.num_blocks,
            E, H, I, rows, plan.num_slots, k, plan.max_blocks,
            d_sorted.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), x_arg.stride(0), w13.stride(0),
            w13.stride(1), w13.stride(2), pg.stride(0), y_w.stride(0), dgu.stride(0), topk_weights.stride(0),
            topk_weights.stride(1),
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=c1.group_m, ACT=ACTIVATIONS[activation],
            RECOMPUTE=recompute, HALVES=halves, D_TMA=d["d_out_sorted"], X_TMA=recompute and d["hidden_sorted"],
            W2_TMA=d["w2"], W13_TMA=recompute and d["w13"], PG_TMA=not recompute and d["pre_gate"],
            PU_TMA=not recompute and d["pre_up"], Y_TMA=d["y_weighted"], DG_TMA=d["d_gate"], DU_TMA=d["d_up"],
            DOT_PRECISION=dot_precision(dt), NUM_PROGRAMS=progs, FLATTEN=c1.flatten, num_warps=c1.num_warps,
            num_stages=c1.num_stages,
        )
        # 3) d_topk_weights: the column-tile partials summed in order.
        if need_topk_weights:
            _topk_weight_grad_kernel[(cdiv(rows, _TW_BLOCK),)](
                part, plan.sorted_slots, plan.num_blocks, d_tw, rows, plan.num_slots, k, d_tw.stride(0),
                d_tw.stride(1), NUM_N=num_n, ROWS_PER_BLOCK=plan.block_m, BLOCK=_TW_BLOCK, num_warps=4,
            )
        # Buffers are dropped as soon as their last reader is queued (the caching allocator hands their blocks
        # to the next same-sized buffer), and each weight gradient is allocated right before its GEMM: the
        # peak stays near max(Ds + Yw, per-slot d_hidden rows, Xs) on top of d(gate, up) and the gradients.
        # 4) d_w2[e] = Ds_e^T Yw_e; the weight-gradient kernels write every element (zeros for experts without
        #    tokens): no memset.
        if need_w2:
            d_w2 = torch.empty(w2.shape, dtype=w2.dtype, device=dev)
            _expert_wgrad(d_sorted, y_w, d_w2, plan, cw, tma, "moe.backward.d_w2")
        del d_sorted, y_w, part, x_arg, pg, pu
        # 5) d_hidden = sum_j d(gate, up)[row(t, j)] @ w13[e]: the forward's down GEMM with w13 as [E, K, N].
        if need_hidden:
            dx = _tma.decide(tma, {"d_gate_up": (dgu, (c2.block_m, c2.block_k)), "w13": (w13, (1, c2.block_k,
                                                                                             c2.block_n))},
                             op="moe.backward.d_hidden")
            d_h = slot_gemm_sum(dgu, w13, None, topk_ids, plan, c2, dx["d_gate_up"], dx["w13"], deterministic, dt,
                                "moe.backward", w_kn=True)
        # 6) d_w13[e] = d(gate, up)_e^T Xs_e.
        if need_w13:
            x_sorted = x_sorted if x_sorted is not None else gather_rows(hidden, plan)
            d_w13 = torch.empty(w13.shape, dtype=w13.dtype, device=dev)
            _expert_wgrad(dgu, x_sorted, d_w13, plan, cw, tma, "moe.backward.d_w13")
    return d_h, d_w13, d_w2, d_tw


def gather_rows(src: torch.Tensor, plan: AlignPlan) -> torch.Tensor:
    """[plan.max_rows, H] copy of the token rows of ``src`` [T, H] in the plan's sorted order (zeros in the
    padding rows; rows past the live blocks are left unwritten and are never read). Sorted plans only."""
    if plan.direct:
        raise ValueError("gather_rows needs a sorted plan (moe_align), got a direct plan")
    if plan.num_slots != src.shape[0] * plan.top_k:
        raise ValueError(f"src must have {plan.num_slots // max(plan.top_k, 1)} rows (the plan's tokens), got "
                         f"shape {tuple(src.shape)}")
    out = torch.empty((plan.max_rows, src.shape[1]), dtype=src.dtype, device=src.device)
    env = dict(hidden=src, xs=out, **plan_env(plan))
    run_steps([gather_rows_step(env, plan)], env)
    return out


def _expert_wgrad(a, b, out, plan: AlignPlan, cfg: KernelConfig, tma: str, op: str) -> None:
    """out[e] = sum over expert e's sorted rows of A[r]^T B[r] (both operands sorted, padding rows zero)."""
    E, M, N = out.shape
    if plan.block_m % cfg.block_k:
        raise ValueError(f"{op}: block_k {cfg.block_k} must divide the plan's block_m {plan.block_m}")
    d = _tma.decide(tma, {"a": (a, (cfg.block_k, cfg.block_m)), "b": (b, (cfg.block_k, cfg.block_n)),
                          "out": (out, (1, cfg.block_m, cfg.block_n))}, op=op)
    progs = num_programs(cfg, a.element_size(), 1, a.device)
    grid = (min(E * cdiv(M, cfg.block_m) * cdiv(N, cfg.block_n), progs),)
    _expert_wgrad_kernel[grid](
        a, b, out, plan.expert_offsets, E, M, N, plan.max_rows, a.stride(0), b.stride(0), out.stride(0),
        out.stride(1), out.stride(2),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, A_TMA=d["a"],
        B_TMA=d["b"], O_TMA=d["out"], DOT_PRECISION=dot_precision(a.dtype), NUM_PROGRAMS=progs,
        FLATTEN=cfg.flatten, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
