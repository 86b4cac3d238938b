"""torch.library custom ops of fused_moe (forward and backward) with fake implementations and autograd.

Custom ops keep ``torch.compile(fullgraph=True)`` working: dynamo sees two opaque ops with known output
shapes instead of Triton launches, tuning-file lookups and host-side checks.

``hopperkern::moe_forward`` returns the output and, when autograd will need them (``save`` > 0), the tensors
the backward reads: the alignment plan and (``save`` == 1) the gate/up pre-activations in expert-sorted order. Their row count depends on the routing only through worst-case bounds computed from
shapes and the launch config, which the fake implementation cannot see: it declares them as dynamic sizes.
Without autograd (``torch.no_grad()``, inference mode, inputs that need no grad) nothing is saved and the
forward is the inference path (direct plans for tiny batches, fused top-k).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..tma import launch_context
from ..tuning import KernelConfig, MoeConfig
from .align import AlignPlan, direct_plan, moe_align, prefer_direct
from .backward import moe_backward
from .configs import moe_launch_config
from .gemm import down, gate_up

__all__ = ["SAVE_NONE", "SAVE_PRE", "SAVE_PLAN", "check_expert_ids", "config_from_list", "config_to_list",
           "moe_backward_op", "moe_forward_impl", "moe_forward_op"]

SAVE_NONE, SAVE_PRE, SAVE_PLAN = 0, 1, 2  # save: nothing / plan + pre-activations / plan only (recompute)

_KC_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "flatten")
_MAX_LISTED_IDS = 8


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError naming the ids of ``topk_ids`` outside ``[-1, num_experts)``.

    Costs one device->host synchronisation (a boolean reduction read back), i.e. tens of microseconds on a
    GPU and a break in CUDA-graph capture; skip it with ``fused_moe(..., check_ids=False)``."""
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    if bool(bad.any()):
        vals = torch.unique(topk_ids[bad]).tolist()
        listed = ", ".join(str(v) for v in vals[:_MAX_LISTED_IDS]) + (", ..." if len(vals) > _MAX_LISTED_IDS else "")
        raise ValueError(f"topk_ids must be in [-1, {num_experts}) (-1 drops a slot), got expert ids {listed}")


def config_to_list(config: MoeConfig | None) -> list[int] | None:
    """A MoeConfig as the flat int list a custom op can take (None stays None)."""
    if config is None:
        return None
    return [int(getattr(g, f)) for g in (config.gemm1, config.gemm2) for f in _KC_FIELDS] + [int(config.fused_topk)]


def config_from_list(values) -> MoeConfig:
    n = len(_KC_FIELDS)
    g1, g2 = (dict(zip(_KC_FIELDS, values[i * n:(i + 1) * n])) for i in range(2))
    for g in (g1, g2):
        g["flatten"] = bool(g["flatten"])
    return MoeConfig(gemm1=KernelConfig(**g1), gemm2=KernelConfig(**g2), fused_topk=bool(values[2 * n]))


def _config(hidden, w13, w2, topk_ids, config) -> MoeConfig:
    if config is not None:
        return config_from_list(config)
    E, H, I = w2.shape  # noqa: E741
    return moe_launch_config(E, H, I, hidden.dtype, hidden.shape[0], topk_ids.shape[1], hidden.device)[0]


def _empty(hidden, *shape, dtype=None):
    return hidden.new_empty(shape, dtype=dtype)


def moe_forward_impl(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                     activation: str, tma: str, check: bool, deterministic: bool, config: Optional[list[int]],
                     save: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out [T, H], pre [rows, 2I], sorted_slots [rows], block_expert [blocks], expert_offsets [E + 1],
    num_blocks [1]); everything after ``out`` is empty unless ``save`` asks for it."""
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    I, k = two_i // 2, topk_ids.shape[1]  # noqa: E741
    i32 = dict(dtype=torch.int32)
    with launch_context(hidden, "moe.fused_moe"):
        if check and T * k:
            check_expert_ids(topk_ids, E)
        cfg = _config(hidden, w13, w2, topk_ids, config)
        if save == SAVE_NONE and prefer_direct(T, k, E):
            plan = direct_plan(topk_ids, E, cfg.gemm1.block_m)
        else:
            plan = moe_align(topk_ids, E, cfg.gemm1.block_m)
        pre = hidden.new_empty((plan.max_rows, 2 * I)) if save == SAVE_PRE else _empty(hidden, 0, 2 * I)
        if T * k == 0 or H == 0 or I == 0:
            out = torch.zeros((T, H), dtype=hidden.dtype, device=hidden.device)
        else:
            inter = gate_up(hidden, w13, plan, config=cfg.gemm1, activation=activation, tma=tma,
                            pre_out=pre if save == SAVE_PRE else None)
            out = down(inter, w2, topk_weights, topk_ids, plan, config=cfg.gemm2, tma=tma,
                       deterministic=deterministic, out_dtype=hidden.dtype, fused_topk=cfg.fused_topk)
    if save == SAVE_NONE:
        return (out, pre, _empty(hidden, 0, **i32), _empty(hidden, 0, **i32), _empty(hidden, 0, **i32),
                _empty(hidden, 0, **i32))
    return out, pre, plan.sorted_slots, plan.block_expert, plan.expert_offsets, plan.num_blocks


# The custom op runs the same function; an eager call that autograd does not record calls it directly
# (fused_moe), skipping the dispatcher's per-call work.
moe_forward_op = torch.library.custom_op("hopperkern::moe_forward", mutates_args=())(moe_forward_impl)


@moe_forward_op.register_fake
def _(hidden, w13, w2, topk_weights, topk_ids, activation, tma, check, deterministic, config, save):
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    i32 = dict(dtype=torch.int32)
    out = hidden.new_empty((T, H))
    if save == SAVE_NONE:
        return (out, _empty(hidden, 0, 2 * I), _empty(hidden, 0, **i32), _empty(hidden, 0, **i32),
                _empty(hidden, 0, **i32), _empty(hidden, 0, **i32))
    ctx = torch.library.get_ctx()
    rows, blocks = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    return (out, _empty(hidden, rows if save == SAVE_PRE else 0, 2 * I), _empty(hidden, rows, **i32),
            _empty(hidden, blocks, **i32), _empty(hidden, E + 1, **i32), _empty(hidden, 1, **i32))


def _plan(sorted_slots, block_expert, expert_offsets, num_blocks, T, k, E, block_m: int) -> AlignPlan:
    """The forward's plan from its saved tensors; ``block_m`` (the config's) serves an empty plan."""
    max_blocks = block_expert.numel()
    block_m = sorted_slots.numel() // max_blocks if max_blocks else block_m
    return AlignPlan(sorted_slots=sorted_slots, block_expert=block_expert, expert_offsets=expert_offsets,
                     expert_counts=expert_offsets[:0], num_blocks=num_blocks, block_m=block_m, max_blocks=max_blocks,
                     num_slots=T * k, top_k=k, num_experts=E)


@torch.library.custom_op("hopperkern::moe_backward", mutates_args=())
def moe_backward_op(d_out: Tensor, hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                    pre: Tensor, sorted_slots: Tensor, block_expert: Tensor, expert_offsets: Tensor,
                    num_blocks: Tensor, activation: str, tma: str, deterministic: bool, config: Optional[list[int]],
                    needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d_hidden, d_w13, d_w2, d_topk_weights); a gradient that ``needs`` does not ask for is an empty tensor."""
    T, k = topk_ids.shape
    E = w13.shape[0]
    cfg = _config(hidden, w13, w2, topk_ids, config)
    plan = _plan(sorted_slots, block_expert, expert_offsets, num_blocks, T, k, E, cfg.gemm1.block_m)
    if cfg.gemm1.block_m != plan.block_m and plan.max_blocks:
        # The tuning file changed between forward and backward: keep the plan's block_m, heuristic tiles.
        from .configs import heuristic_config

        cfg = heuristic_config(E, hidden.shape[1], w2.shape[2], T, k)
        cfg = MoeConfig(gemm1=cfg.gemm1.model_copy(update={"block_m": plan.block_m}),
                        gemm2=cfg.gemm2.model_copy(update={"block_m": plan.block_m}))
    saved = pre.shape[0] > 0 or plan.max_blocks == 0
    d_out = d_out.to(hidden.dtype)
    with launch_context(hidden, "moe.fused_moe backward"):
        grads = moe_backward(d_out, hidden, w13, w2, topk_weights, topk_ids, plan, config=cfg,
                             pre=pre if saved else None, activation=activation,
                             tma=tma, deterministic=deterministic, need_hidden=needs[0], need_w13=needs[1],
                             need_w2=needs[2], need_topk_weights=needs[3])
    # Custom-op outputs must not alias each other: one fresh empty tensor per missing gradient.
    return tuple(g if g is not None else hidden.new_empty((0,)) for g in grads)


@moe_backward_op.register_fake
def _(d_out, hidden, w13, w2, topk_weights, topk_ids, pre, sorted_slots, block_expert, expert_offsets, num_blocks,
      activation, tma, deterministic, config, needs):
    return tuple(t.new_empty(t.shape) if need else hidden.new_empty((0,))
                 for t, need in zip((hidden, w13, w2, topk_weights), needs))


def _setup_context(ctx, inputs, output):
    hidden, w13, w2, topk_weights, topk_ids, activation, tma, _, deterministic, config, save = inputs
    _, pre, sorted_slots, block_expert, expert_offsets, num_blocks = output
    ctx.save_for_backward(hidden, w13, w2, topk_weights, topk_ids, pre, sorted_slots, block_expert, expert_offsets,
                          num_blocks)
    ctx.opts = (activation, tma, deterministic, config)
    ctx.save_mode = save
    # pre is a float output that no user differentiates: without this, autograd would fill a zero gradient of
    # its [rows, 2I] elements before every backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, d_out, *_unused):
    needs = [bool(ctx.needs_input_grad[i]) for i in range(4)]
    if d_out is None or not any(needs):
        return (None,) * 11
    if ctx.save_mode == SAVE_NONE:
        raise RuntimeError("hopperkern::moe_forward ran with save=0, so nothing was kept for the backward; call "
                           "fused_moe, which keeps what the backward needs whenever an input requires grad")
    saved = ctx.saved_tensors
    activation, tma, deterministic, config = ctx.opts
    grads = moe_backward_op(d_out, *saved, activation, tma, deterministic, config, needs)
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None,) * 7


torch.library.register_autograd("hopperkern::moe_forward", _backward, setup_context=_setup_context)
