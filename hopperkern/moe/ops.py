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

from .._host import round_up
from .._validate import _PLAIN_TENSORS, check_local_memory, first_order, sync_check
from ..tma import decide, interpreter_active, launch_context, record_decision
from ..tma.launcher import Plan, PlanCache, alignment_key, env_key, launch_state, run_direct, run_steps
from ..tma.launcher import PIECE_ALIGN, scratch_offsets
from ..tuning import KernelConfig, MoeConfig, device_config
from .align import (AlignPlan, align_steps, direct_plan, empty_plan, flat_ids, moe_align, prefer_direct,
                    scratch_shapes)
from .backward import moe_backward
from .configs import chain_decode, moe_launch_config
from .gemm import (direct_pointer_reason, down_direct_step, fused_mlp_steps, gate_up_step, gather_rows_step,
                   partial_rows, slot_buffer_shape, slot_steps)

__all__ = ["SAVE_NONE", "SAVE_PRE", "SAVE_PLAN", "ForwardPlan", "cached_forward", "check_expert_ids", "config_from_list",
           "config_to_list", "moe_backward_op", "moe_forward_impl", "moe_forward_op", "moe_forward_run", "plan_key"]

SAVE_NONE, SAVE_PRE, SAVE_PLAN = 0, 1, 2  # save: nothing / plan + pre-activations / plan only (recompute)

_KC_FIELDS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "flatten")
_MAX_LISTED_IDS = 8


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """Raise ValueError naming the ids of ``topk_ids`` outside ``[-1, num_experts)``.

    Costs one device->host synchronisation (a boolean reduction read back), i.e. tens of microseconds on a
    GPU and a break in CUDA-graph capture: ``fused_moe`` runs it with ``check_ids=True``, and with the default
    ``"auto"`` only where it needs no sync (CPU tensors). Unchecked, a bad id makes its token's output NaN."""
    bad = (topk_ids < -1) | (topk_ids >= num_experts)
    if bool(bad.any()):
        vals = torch.unique(topk_ids[bad]).tolist()
        listed = ", ".join(str(v) for v in vals[:_MAX_LISTED_IDS]) + (", ..." if len(vals) > _MAX_LISTED_IDS else "")
        raise ValueError(f"topk_ids must be in [-1, {num_experts}) (-1 drops a slot), got expert ids {listed}")


def config_to_list(config: MoeConfig | None) -> list[int] | None:
    """A MoeConfig as the flat int list a custom op can take (None stays None)."""
    if config is None:
        return None
    return ([int(getattr(g, f)) for g in (config.gemm1, config.gemm2) for f in _KC_FIELDS]
            + [int(config.fused_topk), int(config.sorted_rows), int(config.fused_mlp)])


def config_from_list(values) -> MoeConfig:
    n = len(_KC_FIELDS)
    g1, g2 = (dict(zip(_KC_FIELDS, values[i * n:(i + 1) * n])) for i in range(2))
    for g in (g1, g2):
        g["flatten"] = bool(g["flatten"])
    return MoeConfig(gemm1=KernelConfig(**g1), gemm2=KernelConfig(**g2), fused_topk=bool(values[2 * n]),
                     sorted_rows=bool(values[2 * n + 1]), fused_mlp=bool(values[2 * n + 2]))


def _config(hidden, w13, w2, topk_ids, config) -> MoeConfig:
    if config is not None:
        return config_from_list(config)
    E, two_i, H = w13.shape
    return moe_launch_config(E, H, two_i // 2, hidden.dtype, hidden.shape[0], topk_ids.shape[1], hidden.device)[0]


def _empty(hidden, *shape, dtype=None):
    return hidden.new_empty(shape, dtype=dtype)


def moe_forward_impl(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                     activation: str, tma: str, check: bool, deterministic: bool, config: Optional[list[int]],
                     save: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out [T, H], pre [rows, 2I], sorted_slots [rows], block_expert [blocks], expert_offsets [E + 1],
    num_blocks [1]); everything after ``out`` is empty unless ``save`` asks for it.

    The config, alignment and GEMM launches come from a cached :class:`ForwardPlan` (one per problem: shapes,
    dtypes, strides, options, effective TMA mode and tuning file)."""
    outs = moe_forward_run(hidden, w13, w2, topk_weights, topk_ids, activation, tma, check, deterministic, config,
                           save)
    if save != SAVE_NONE:
        return outs
    i32 = dict(dtype=torch.int32)
    # Custom-op outputs may not share storage: one empty tensor each.
    return (outs[0], _empty(hidden, 0, w13.shape[1]), _empty(hidden, 0, **i32), _empty(hidden, 0, **i32),
            _empty(hidden, 0, **i32), _empty(hidden, 0, **i32))


def moe_forward_run(hidden: Tensor, w13: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                    activation: str, tma: str, check: bool, deterministic: bool, config: Optional[list[int]],
                    save: int, validated: bool = False) -> tuple:
    """:func:`moe_forward_impl`'s work; with ``save`` = SAVE_NONE only ``out`` is meaningful (the rest None), so an
    eager inference call (:func:`hopperkern.moe.fused_moe`) allocates nothing it does not return. ``validated``:
    the caller validated these arguments (:func:`cached_forward` may then skip validation for the same key)."""
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    I, k = two_i // 2, topk_ids.shape[1]  # noqa: E741
    if T * k == 0 or H == 0 or I == 0:
        with launch_context(hidden, "moe.fused_moe"):
            return _empty_problem(hidden, w13, topk_ids, config, save)
    key = plan_key(hidden, w13, w2, topk_weights, topk_ids, activation, tma, deterministic, config, save)
    plan = _FORWARD_PLANS.get(key)
    if plan is not None and plan.fresh() and plan.launch_here():
        plan.validated = plan.validated or validated
        if check:
            check_expert_ids(topk_ids, E)
        return plan.run(hidden, w13, w2, topk_weights, topk_ids)
    with launch_context(hidden, "moe.fused_moe"):
        if check:
            check_expert_ids(topk_ids, E)
        if plan is None or not plan.fresh():
            plan = _FORWARD_PLANS.put(key, ForwardPlan(hidden, w13, w2, topk_weights, topk_ids, activation, tma,
                                                       deterministic, config, save))
        plan.validated = plan.validated or validated
        return plan.run(hidden, w13, w2, topk_weights, topk_ids)


def plan_key(hidden, w13, w2, topk_weights, topk_ids, activation, tma, deterministic, config, save) -> tuple:
    """A forward plan's cache key: everything the plan depends on (devices, dtypes, shapes, strides, 16-byte
    alignment, options, the effective ``HOPPERKERN_TMA`` / ``HOPPERKERN_CONFIG`` / ``HOPPERKERN_PDL``), which is also
    everything the validation of ``fused_moe``'s arguments depends on (so a validated plan stands for a validated
    call)."""
    return (hidden.device, w13.get_device(), w2.get_device(), topk_weights.get_device(), topk_ids.get_device(),
            hidden.dtype, w13.dtype, w2.dtype, topk_weights.dtype, topk_ids.dtype, hidden.shape, hidden.stride(),
            w13.shape, w13.stride(), w2.shape, w2.stride(), topk_weights.shape, topk_weights.stride(), topk_ids.shape,
            topk_ids.stride(), activation, tma, deterministic, None if config is None else tuple(config), save,
            env_key(), alignment_key(hidden, w13, w2, topk_weights, topk_ids))


def cached_forward(hidden, w13, w2, topk_weights, topk_ids, activation, tma, check_ids, deterministic):
    """An eager inference call of ``fused_moe`` (no config given) served by a plan whose key an earlier, validated
    call built: ``out``, or None when there is no such plan here (the caller then validates and takes the full
    path). The weights' storage is checked on every call all the same (:func:`check_local_memory`)."""
    if (type(hidden) not in _PLAIN_TENSORS or type(w13) not in _PLAIN_TENSORS or type(w2) not in _PLAIN_TENSORS
            or type(topk_weights) not in _PLAIN_TENSORS or type(topk_ids) not in _PLAIN_TENSORS or hidden.is_meta
            or (deterministic is not True and deterministic is not False)):  # 1.0 == True as a key: full path checks
        return None
    try:
        key = plan_key(hidden, w13, w2, topk_weights, topk_ids, activation, tma, deterministic, None, SAVE_NONE)
        plan = _FORWARD_PLANS.get(key)
    except (RuntimeError, TypeError):  # a layout without strides, an unhashable option: the full path says why
        return None
    if plan is None or not plan.validated or not plan.fresh() or not plan.launch_here():
        return None
    check_local_memory("w13", w13)
    check_local_memory("w2", w2)
    if sync_check("check_ids", check_ids, topk_ids):
        check_expert_ids(topk_ids, plan.E)
    return plan.run(hidden, w13, w2, topk_weights, topk_ids)[0]


def _empty_problem(hidden, w13, topk_ids, config, save):
    """fused_moe's outputs when there is nothing to multiply (no slot, H == 0 or I == 0)."""
    T, H = hidden.shape
    I = w13.shape[1] // 2  # noqa: E741
    out = torch.zeros((T, H), dtype=hidden.dtype, device=hidden.device)
    if save == SAVE_NONE:
        return (out, None, None, None, None, None)
    cfg = _config(hidden, w13, None, topk_ids, config)
    plan = moe_align(topk_ids, w13.shape[0], cfg.gemm1.block_m)
    pre = hidden.new_empty((plan.max_rows, 2 * I)) if save == SAVE_PRE else _empty(hidden, 0, 2 * I)
    return out, pre, plan.sorted_slots, plan.block_expert, plan.expert_offsets, plan.num_blocks


_FORWARD_PLANS = PlanCache("moe.forward")
_ALIGN_ELEMS = 8  # pieces of one allocation start 16-byte aligned (8 elements of 2 bytes or more)


class ForwardPlan(Plan):
    """What one fused_moe problem decides on the host once: the config, direct or sorted alignment, the TMA
    decisions of both GEMMs, buffer shapes and every launch, as ``(Launch, tensor names)`` steps over the
    call's tensors (:func:`hopperkern.tma.launcher.run_steps`)."""

    def __init__(self, hidden, w13, w2, topk_weights, topk_ids, activation, tma, deterministic, config, save):
        self.validated = False  # set by a call whose arguments fused_moe validated (see cached_forward)
        T, H = hidden.shape
        E, two_i, _ = w13.shape
        I, k = two_i // 2, topk_ids.shape[1]  # noqa: E741
        dev = hidden.device
        self.bind_source(None if config is not None or interpreter_active() else device_config(dev), dev)
        cfg = _config(hidden, w13, w2, topk_ids, config)
        self.save, self.E, self.I = save, E, I
        self.direct = save == SAVE_NONE and prefer_direct(T, k, E)
        bm = cfg.gemm1.block_m
        if self.direct:
            sample = direct_plan(topk_ids, E, bm)
            self.i32 = {}
        else:
            sample = empty_plan(topk_ids, E, bm)  # shapes only: its tensors are never read
            shapes = dict(sorted_slots=(sample.max_rows,), block_expert=(sample.max_blocks,),
                          expert_offsets=(E + 1,), expert_counts=(E,), num_blocks=(1,))
            shapes.update(scratch_shapes(T * k, E))
            self.i32 = shapes
            self.i32_sizes = [round_up(_numel(v), _ALIGN_ELEMS) for v in shapes.values()]
            self.i32_total = sum(self.i32_sizes)
        self.rows = sample.max_rows
        self.H = H
        # A sorted copy of the token rows for the gate/up GEMM's TMA loads, where the config asks for it and the
        # copy can be a TMA operand at all (16-byte row pitch); the TMA decision below may still turn it down.
        self.sorted_rows = (not self.direct and cfg.sorted_rows and self.rows > 0
                            and (H * hidden.element_size()) % 16 == 0)
        self.out_shape = (T, H)
        # Both GEMMs in one kernel per (slot, slice of I), the top-k sum over their partial rows (direct plans).
        self.fused_mlp = self.direct and cfg.fused_mlp
        self.part_shape = (partial_rows(T * k, I, cfg.gemm1.block_n), H) if self.fused_mlp else None
        self.fused_topk = self.direct and cfg.fused_topk and not self.fused_mlp
        self.deterministic = deterministic or self.fused_topk or self.fused_mlp
        self.buf_shape = None if self.fused_topk or self.fused_mlp else slot_buffer_shape(T, k, H, deterministic)
        self.ids_flat = topk_ids.is_contiguous()
        per_slot = self.deterministic and not (self.fused_topk or self.fused_mlp)
        self._lay_out(hidden.element_size(), per_slot)
        self.all_bound = False
        env = self._env(hidden, w13, w2, topk_weights, topk_ids)
        if self.fused_mlp:
            reason = direct_pointer_reason(sample)
            d1 = decide(tma, dict(w13=(w13, (1, cfg.gemm1.block_n, cfg.gemm1.block_k))), op="moe.gemm1",
                        record=False, auto_pointer=reason)
            d2 = decide(tma, dict(w2=(w2, (1, cfg.gemm2.block_n, cfg.gemm1.block_n))), op="moe.gemm2",
                        record=False, auto_pointer=reason)
            self.decisions = (d1, d2)
            self.steps = chain_decode(fused_mlp_steps(env, sample, cfg, activation, d1, d2), T, dev)
            return
        ops1 = dict(w13=(w13, (1, cfg.gemm1.block_n, cfg.gemm1.block_k)),
                    inter=(env["inter"], (bm, cfg.gemm1.block_n)))
        if save == SAVE_PRE:
            ops1.update(pre_gate=(env["pre_gate"], (bm, cfg.gemm1.block_n)),
                        pre_up=(env["pre_up"], (bm, cfg.gemm1.block_n)))
        if self.sorted_rows:
            ops1["xs"] = (env["xs"], (bm, cfg.gemm1.block_k))
        d1 = decide(tma, ops1, op="moe.gemm1", record=False, auto_pointer=direct_pointer_reason(sample))
        if self.sorted_rows and not d1["xs"]:
            # No TMA for the copy (tma="never", a GPU without TMA): the GEMM gathers the token rows itself.
            self.sorted_rows = False
            self._lay_out(hidden.element_size(), per_slot)
            del ops1["xs"]
            d1 = decide(tma, ops1, op="moe.gemm1", record=False, auto_pointer=direct_pointer_reason(sample))
        d2 = decide(tma, dict(inter=(env["inter"], (bm, cfg.gemm2.block_k)),
                              w2=(w2, (1, cfg.gemm2.block_n, cfg.gemm2.block_k))), op="moe.gemm2", record=False,
                    auto_pointer=direct_pointer_reason(sample))
        self.decisions = (d1, d2)
        steps = [] if self.direct else align_steps(env, T * k, E, bm, sample.max_blocks)
        if self.sorted_rows:
            steps.append(gather_rows_step(env, sample))
        steps.append(gate_up_step(env, sample, cfg.gemm1, activation, d1, save == SAVE_PRE, self.sorted_rows))
        if self.fused_topk:
            steps.append(down_direct_step(env, sample, cfg.gemm2, d2))
        else:
            steps += slot_steps(env, sample, cfg.gemm2, d2["inter"], d2["w2"], deterministic)
        # Decode sizes: each kernel may start while the one before it drains (programmatic dependent launch); the
        # first waits for the work before the call in plain stream order.
        self.steps = chain_decode(steps, T, dev)

    def _lay_out(self, elem: int, per_slot: bool) -> None:
        """Sizes of the scratch pieces (in elements of hidden's dtype) for calls after the first, and the byte
        layout of direct calls (:meth:`_layout`). The sorted token rows (``xs``) share the per-slot rows' piece:
        the gate/up GEMM has read them before the down GEMM writes the per-slot rows."""
        xs = self.rows * self.H if self.sorted_rows else 0
        slot_rows = self.buf_shape[0] * self.buf_shape[1] if per_slot else 0
        # The fused MLP's fp32 partial rows take the place of the intermediate rows (counted in hidden's elements).
        first = _numel(self.part_shape) * 4 // elem if self.fused_mlp else self.rows * self.I
        sizes = [first] + ([max(slot_rows, xs)] if per_slot or xs else [])
        self.scratch_sizes = [round_up(n, _ALIGN_ELEMS) for n in sizes]
        self.scratch_total = sum(self.scratch_sizes)
        self.layout, self.layout_bytes = self._layout(elem, per_slot)

    def _layout(self, elem: int, per_slot: bool):
        """Where an inference call's scratch lies in one byte allocation when its launches go direct: ``(name,
        byte offset)`` pairs (128-byte aligned pieces: the alignment of the separate tensors the launches were
        bound with, and TMA's) and the total size. Empty for plans whose tensors leave the call (autograd)."""
        if self.save != SAVE_NONE:
            return (), 0
        sizes = [(name, _numel(shape) * 4) for name, shape in self.i32.items()]
        if self.fused_mlp:
            sizes.append(("part", _numel(self.part_shape) * 4))
        else:
            sizes.append(("inter", self.rows * self.I * elem))
        xs = self.rows * self.H * elem if self.sorted_rows else 0
        if per_slot:
            sizes.append(("buf", max(_numel(self.buf_shape) * elem, xs)))
        elif xs:
            sizes.append(("xs", xs))
        layout, offset = [], 0
        for name, nbytes in sizes:
            layout.append((name, offset))
            offset += round_up(max(nbytes, 1), PIECE_ALIGN)
        aliases = (() if self.fused_mlp else (("pre_gate", "inter"), ("pre_up", "inter"))) + (
            () if self.direct else (("slots", "sorted_slots"),))
        if self.sorted_rows and per_slot:
            aliases += (("xs", "buf"),)
        for alias, name in aliases:
            layout.append((alias, dict(layout)[name]))
        return tuple(layout), offset

    def _run_direct(self, stream: int, hidden, w13, w2, topk_weights, topk_ids):
        """An inference call whose launches are all bound: scratch as addresses in one allocation (no tensor views
        to make), every step through its C launcher. The output, or None when a launch refused its tensors
        (nothing of this call is then relied on: the caller runs every step again the usual way)."""
        dev = hidden.device
        ids = topk_ids if self.ids_flat else flat_ids(topk_ids)
        env = dict(hidden=hidden, w13=w13, w2=w2, tw=topk_weights, ids=ids)
        if self.direct:
            env["slots"] = env["block_expert"] = env["num_blocks"] = ids
        # One allocation for the plan's buffers and every launch's descriptor scratch, alive until all are enqueued.
        scratch = torch.empty(self.direct_bytes, dtype=torch.uint8, device=dev)
        base = scratch.data_ptr()
        for name, offset in self.layout:
            env[name] = base + offset
        if self.fused_topk or self.deterministic:
            env["out"] = out = torch.empty(self.out_shape, dtype=hidden.dtype, device=dev)
        else:
            env["buf"] = env["out"] = out = torch.empty(self.buf_shape, dtype=torch.float32, device=dev)
        if not run_direct(self.steps, env, stream, [None if at is None else base + at for at in self.desc_at]):
            return None
        return out if out.dtype == hidden.dtype else out.to(hidden.dtype)

    def _env(self, hidden, w13, w2, topk_weights, topk_ids, *, shaped: bool = True) -> dict:
        """The call's tensors by step name: inputs, and fresh outputs and scratch. ``shaped=False`` (calls after
        the first): scratch as flat views of as few allocations as possible (kernels read base pointers only;
        shapes and strides are fixed in the launches)."""
        dev, dt = hidden.device, hidden.dtype
        ids = topk_ids if self.ids_flat and not shaped else flat_ids(topk_ids)
        env = dict(hidden=hidden, w13=w13, w2=w2, tw=topk_weights, ids=ids)
        if self.direct:
            env.update(slots=ids, block_expert=ids, num_blocks=ids)
        elif self.save == SAVE_NONE and not shaped:
            # One allocation for the plan and the scratch (nothing of it leaves the call).
            env.update(zip(self.i32, torch.empty(self.i32_total, dtype=torch.int32, device=dev).split(self.i32_sizes)))
        else:
            # Returned to autograd: custom-op outputs may not share storage.
            for name, shape in self.i32.items():
                env[name] = torch.empty(shape, dtype=torch.int32, device=dev)
        if not self.direct:
            env["slots"] = env["sorted_slots"]
        out = torch.empty(self.out_shape, dtype=dt, device=dev)
        if self.fused_mlp:
            env["out"] = out
            env["part"] = (torch.empty(self.scratch_total, dtype=dt, device=dev).view(torch.float32) if not shaped
                           else torch.empty(self.part_shape, dtype=torch.float32, device=dev))
            return env
        per_slot = self.deterministic and not self.fused_topk
        if self.save == SAVE_NONE and not shaped:
            # inter and the per-slot rows: one allocation.
            pieces = torch.empty(self.scratch_total, dtype=dt, device=dev).split(self.scratch_sizes)
            env["inter"] = env["pre_gate"] = env["pre_up"] = pieces[0]
            if per_slot:
                env["buf"] = pieces[1]
            if self.sorted_rows:
                env["xs"] = pieces[1]  # shared with the per-slot rows (see _lay_out)
        else:
            env["inter"] = inter = torch.empty((self.rows, self.I), dtype=dt, device=dev)
            if self.save == SAVE_PRE:
                env["pre"] = pre = torch.empty((self.rows, 2 * self.I), dtype=dt, device=dev)
                env["pre_gate"], env["pre_up"] = pre[:, :self.I], pre[:, self.I:]
            else:
                env["pre_gate"] = env["pre_up"] = inter
            if per_slot:
                env["buf"] = torch.empty(self.buf_shape, dtype=dt, device=dev)
            if self.sorted_rows:
                env["xs"] = torch.empty((self.rows, self.H), dtype=dt, device=dev)
        if self.fused_topk or per_slot:
            env["out"] = out
        else:
            env["buf"] = env["out"] = torch.empty(self.buf_shape, dtype=torch.float32, device=dev)
        return env

    def run(self, hidden, w13, w2, topk_weights, topk_ids):
        for d in self.decisions:
            record_decision(d)
        if self.layout_bytes and not self.interpreted:
            here = launch_state()
            if here is not None and here[0] == self.device and (self.all_bound or self._bound()):
                out = self._run_direct(here[1], hidden, w13, w2, topk_weights, topk_ids)
                if out is not None:
                    return out, None, None, None, None, None
        env = self._env(hidden, w13, w2, topk_weights, topk_ids, shaped=self.interpreted)
        run_steps(self.steps, env)
        out = env["out"]
        if out.dtype != hidden.dtype:
            out = out.to(hidden.dtype)
        if self.save == SAVE_NONE:
            return out, None, None, None, None, None  # moe_forward_impl fills in (distinct) empty tensors
        pre = env["pre"] if self.save == SAVE_PRE else _empty(hidden, 0, 2 * self.I)
        return out, pre, env["sorted_slots"], env["block_expert"], env["expert_offsets"], env["num_blocks"]

    def _bound(self) -> bool:
        """Whether every launch of this plan is bound to a compiled kernel on this plan's device (then it stays so)."""
        bound = all(launch.c_launch is not None and launch.device == self.device for launch, _ in self.steps)
        if bound:  # the layout before the flag: another thread may read the flag and go direct at once
            self.desc_at, self.direct_bytes = scratch_offsets([launch for launch, _ in self.steps], self.layout_bytes)
            self.all_bound = True
        return bound


def _numel(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


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


@first_order("hopperkern.moe")
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
