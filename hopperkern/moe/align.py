"""Token-to-expert alignment: which sorted row of the grouped GEMMs holds which (token, top-k) slot.

``moe_align(topk_ids, num_experts, block_m)`` returns an :class:`AlignPlan`. Slots are the flattened
positions of ``topk_ids`` [T, k]: slot ``s = t * k + j`` is token ``t``'s ``j``-th choice. The plan lays the
slots out expert by expert, each expert's segment padded to a multiple of ``block_m`` so one GEMM row block
never mixes experts::

    sorted_slots[r]   slot at sorted row r, for r < num_padded = expert_offsets[E]; padding rows hold the
                      sentinel num_slots (= T * k); rows >= num_padded are not written
    block_expert[b]   expert of row block b (rows b*block_m ...), -1 for b >= num_blocks
    expert_offsets[e] first sorted row of expert e; expert_offsets[E] = num_padded
    expert_counts[e]  real slots routed to expert e
    num_blocks        int32 [1] on the device: num_padded // block_m

Inside an expert, slots appear in increasing slot order, so the plan is deterministic. Slots with id -1 (the
expert-parallel "not on this rank" marker) are dropped; so are ids outside ``[0, E)``, whose tokens the top-k
sums of :func:`hopperkern.moe.fused_moe` then turn into NaN rows (or its ``check_ids`` refuses them first).

:func:`direct_plan` is the no-launch alternative for tiny batches (see its docstring).

Nothing here synchronises with the host: buffers have worst-case sizes computed from shapes only
(``max_blocks = (T*k + min(E, T*k) * (block_m - 1)) // block_m``), and the persistent GEMMs read
``num_blocks`` on the device to bound their tile loops. So the plan (and a decode-size fused_moe) can be
captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .._host import cdiv, next_power_of_2
from ..tma import interpreter_active, launch_context
from ..tma.launcher import Launch, run_steps
from ._align_kernels import _align_count_kernel, _align_place_kernel, _align_scan_kernel, _align_small_kernel

__all__ = ["AlignPlan", "align_steps", "direct_plan", "empty_plan", "flat_ids", "max_blocks_for", "moe_align",
           "plan_tensors", "prefer_direct", "scratch_shapes", "scratch_tensors"]

# Up to this many slots the whole plan is one launch (_one_launch). Measured on the H200 (graph-timed fused_moe,
# same-run A/B): at 2048 slots (256 tokens, top-8) the one launch is 1.3-1.8 % faster than the four (now three) of the
# multi-program path for qwen3-30B-A3B and qwen3-235B-TP4 (level for deepseek-V3-TP8); at 8192 slots it is 6.5-10 %
# slower. Beyond 1024 slots only while the histogram is at most _SMALL_WIDE_E_P bins wide: from 1024 bins (E >= 512)
# the one-launch kernel spills registers at 2048 slots (ptxas: 64 at 1024 bins, 848 at 2048) and was measured
# slower than the four launches of then (E = 1000: 20.4 against 18.2 us; E = 2000: 71.2 against 29.3 us).
_SMALL_MAX_SLOTS = 2048
_SMALL_NARROW_MAX_SLOTS = 1024  # the limit for wider histograms
_SMALL_WIDE_E_P = 512
_CHUNK = 1024            # slots per program of the multi-program path
_BLOCK_B = 16            # row blocks per program when filling block_expert and padding
_TILE_ELEMS = 4096       # size of the one-hot [SUB, E_P] tile of the scatter (registers per program)
_SUB_MAX = 64            # slots per scatter step (a [SUB, SUB] rank tile)
_SCATTER_PROGRAMS = 1024 # the multi-chunk scatter's programs: beyond that, each takes several sub-blocks
_SCAN_TILE_ELEMS = 8192  # [chunks, E_P] counts per step of the one-program scan (16384 spills registers on sm_90)


def _scatter_step(e_p: int) -> int:
    """Slots per scatter program. The interpreter pays per op and per program, not per element, so it takes
    16x bigger tiles (same kernel body, a different constexpr)."""
    scale = 16 if interpreter_active() else 1
    return max(16, min(_SUB_MAX * scale, _TILE_ELEMS * scale // e_p))


def _blocks_per_tile() -> int:
    """Row blocks per block-filling program (16x more under the interpreter, as in :func:`_scatter_step`)."""
    return _BLOCK_B * (16 if interpreter_active() else 1)


@dataclass(frozen=True)
class AlignPlan:
    """Sorted, block-padded layout of the (token, top-k) slots; see the module docstring for each field."""

    sorted_slots: torch.Tensor    # [max_blocks * block_m] int32
    block_expert: torch.Tensor    # [max_blocks] int32
    expert_offsets: torch.Tensor  # [E + 1] int32
    expert_counts: torch.Tensor   # [E] int32
    num_blocks: torch.Tensor      # [1] int32 (device)
    block_m: int
    max_blocks: int
    num_slots: int
    top_k: int
    num_experts: int
    direct_ids: torch.Tensor | None = None  # [T*k] flattened topk_ids for a direct plan, else None

    @property
    def direct(self) -> bool:
        """True for a :func:`direct_plan` (block b = slot b; the sorted-layout tensors are empty)."""
        return self.direct_ids is not None

    @property
    def sentinel(self) -> int:
        """Value of the padding rows in ``sorted_slots`` (one past the last slot)."""
        return self.num_slots

    @property
    def max_rows(self) -> int:
        return self.max_blocks * self.block_m


def max_blocks_for(num_slots: int, num_experts: int, block_m: int) -> int:
    """Worst-case number of row blocks: every non-empty expert wastes at most ``block_m - 1`` padding rows,
    and at most ``min(E, num_slots)`` experts are non-empty."""
    return (num_slots + min(num_experts, num_slots) * (block_m - 1)) // block_m


def prefer_direct(T: int, top_k: int, num_experts: int) -> bool:
    """Whether :func:`direct_plan` beats :func:`moe_align` for T tokens: one token (its k experts are distinct
    under top-k routing) or so few slots (T*k <= E/4) that slots rarely share an expert, so reading an expert's
    weights once per slot costs little extra traffic and saves the alignment launch."""
    return T == 1 or 4 * T * top_k <= num_experts


def flat_ids(topk_ids: torch.Tensor) -> torch.Tensor:
    """``topk_ids`` [T, k] as the flat [T*k] unit-stride vector the kernels index by slot: a view where one
    exists, else a copy (T*k integers). ``reshape(-1)`` alone is not enough: it returns a strided view where the
    strides allow one (a column slice ``ids[:, :1]`` flattens with stride 2), which a kernel reading
    ``ids + slot`` would misread."""
    ids = topk_ids.reshape(-1)
    return ids if ids.numel() <= 1 or ids.stride(0) == 1 else ids.contiguous()


def direct_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignPlan:
    """A plan without alignment: row block b holds slot b alone (row b*block_m; the other rows are padding),
    its expert read from ``topk_ids`` inside the GEMMs (ids outside [0, E), e.g. -1, skip their block).
    No launch, no sorting; weights are read once per slot, so it pays off only for tiny batches
    (:func:`prefer_direct`)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D, got shape {tuple(topk_ids.shape)}")
    T, k = topk_ids.shape
    empty = torch.empty(0, dtype=torch.int32, device=topk_ids.device)
    return AlignPlan(sorted_slots=empty, block_expert=empty, expert_offsets=empty, expert_counts=empty,
                     num_blocks=empty, block_m=block_m, max_blocks=T * k, num_slots=T * k, top_k=k,
                     num_experts=int(num_experts), direct_ids=flat_ids(topk_ids))


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, next_power_of_2(max(int(n), 1)))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignPlan:
    """Build the :class:`AlignPlan` of ``topk_ids`` [T, k] (int32/int64) for ``num_experts`` experts and row
    blocks of ``block_m`` (a power of two >= 16). One launch up to 2048 slots (T*k; 1024 from 512 experts),
    three otherwise; no host sync."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be 2-D, got shape {tuple(topk_ids.shape)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be int32 or int64, got {str(topk_ids.dtype).replace('torch.', '')}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    if block_m < 16 or block_m & (block_m - 1):
        raise ValueError(f"block_m must be a power of two >= 16, got {block_m}")
    plan = empty_plan(topk_ids, num_experts, block_m)
    num_slots, E, max_blocks, dev = plan.num_slots, plan.num_experts, plan.max_blocks, topk_ids.device
    if num_slots == 0:
        plan.expert_offsets.zero_()
        plan.expert_counts.zero_()
        plan.num_blocks.zero_()
        return plan
    with launch_context(topk_ids, "moe.moe_align"):
        ids = flat_ids(topk_ids)
        env = dict(ids=ids, **plan_tensors(plan), **scratch_tensors(num_slots, E, dev))
        run_steps(align_steps(env, num_slots, E, block_m, max_blocks), env)
    return plan


def empty_plan(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignPlan:
    """An :class:`AlignPlan` of ``topk_ids``' shape with its device tensors allocated, not yet written."""
    T, k = topk_ids.shape
    E = int(num_experts)
    max_blocks = max_blocks_for(T * k, E, block_m)
    i32 = dict(dtype=torch.int32, device=topk_ids.device)
    return AlignPlan(sorted_slots=torch.empty(max_blocks * block_m, **i32), block_expert=torch.empty(max_blocks, **i32),
                     expert_offsets=torch.empty(E + 1, **i32), expert_counts=torch.empty(E, **i32),
                     num_blocks=torch.empty(1, **i32), block_m=block_m, max_blocks=max_blocks, num_slots=T * k,
                     top_k=k, num_experts=E)


def plan_tensors(plan: AlignPlan) -> dict:
    """The plan's device tensors by the names :func:`align_steps` uses."""
    return dict(sorted_slots=plan.sorted_slots, block_expert=plan.block_expert, expert_offsets=plan.expert_offsets,
                expert_counts=plan.expert_counts, num_blocks=plan.num_blocks)


def _one_launch(num_slots: int, E: int) -> bool:
    """Whether the plan of ``num_slots`` slots over ``E`` experts is built in one launch (``_align_small_kernel``):
    up to ``_SMALL_MAX_SLOTS`` slots while the histogram (E + 1 bins, rounded up to a power of two) is at most
    ``_SMALL_WIDE_E_P`` wide, up to ``_SMALL_NARROW_MAX_SLOTS`` otherwise."""
    limit = _SMALL_MAX_SLOTS if _pow2_at_least(E + 1, 32) <= _SMALL_WIDE_E_P else _SMALL_NARROW_MAX_SLOTS
    return num_slots <= limit


def scratch_shapes(num_slots: int, E: int) -> dict:
    """Shapes of the multi-program alignment's scratch tensors (none where :func:`_one_launch`)."""
    if _one_launch(num_slots, E):
        return {}
    shape = (cdiv(num_slots, _CHUNK), _pow2_at_least(E + 1, 32))
    return dict(chunk_counts=shape, base=shape)


def scratch_tensors(num_slots: int, E: int, device) -> dict:
    return {k: torch.empty(v, dtype=torch.int32, device=device) for k, v in scratch_shapes(num_slots, E).items()}


def align_steps(env: dict, num_slots: int, E: int, block_m: int, max_blocks: int) -> list:
    """The alignment launches of :func:`moe_align` as ``(Launch, tensor names)`` steps over ``env`` (ids,
    :func:`plan_tensors`, :func:`scratch_shapes`' tensors): one where :func:`_one_launch`, three otherwise."""
    e_p = _pow2_at_least(E + 1, 32)  # histogram bins: one per expert plus the "dropped" bin E; >= warp size
    sub = _scatter_step(e_p)
    block_b = _blocks_per_tile()

    def step(kernel, grid, names, *scalars, **kw):
        return Launch(kernel, grid, *[env[n] for n in names], *scalars, **kw), names

    if _one_launch(num_slots, E):
        # >= 128 = 4 warps x 32 lanes, so no warp holds a replica of another's slots in the histogram input.
        chunk = _pow2_at_least(num_slots, 128)
        sub = min(sub, chunk)
        grid = (max(cdiv(num_slots, sub), cdiv(max_blocks, block_b)),)
        return [step(_align_small_kernel, grid, ("ids", "sorted_slots", "block_expert", "expert_offsets",
                                                 "expert_counts", "num_blocks"),
                     num_slots, E, max_blocks,
                     BLOCK_M=block_m, CHUNK=chunk, SUB=sub, E_P=e_p, BLOCK_B=block_b, num_warps=4)]
    num_chunks = cdiv(num_slots, _CHUNK)
    # Sub-blocks per scatter program: one while there are few, so no program walks a chunk serially; more
    # (consecutive ones, powers of two) once there are enough programs to fill the GPU, since each program
    # also histograms its chunk.
    subs = min(_CHUNK // sub, next_power_of_2(cdiv(num_chunks * (_CHUNK // sub), _SCATTER_PROGRAMS)))
    num_scatter = num_chunks * (_CHUNK // (sub * subs))
    return [
        step(_align_count_kernel, (num_chunks,), ("ids", "chunk_counts"), num_slots, E, CHUNK=_CHUNK, E_P=e_p,
             num_warps=4),
        step(_align_scan_kernel, (1,), ("chunk_counts", "base", "expert_offsets", "expert_counts", "num_blocks"),
             num_chunks, E, BLOCK_M=block_m, E_P=e_p,
             BLOCK_C=max(1, min(next_power_of_2(num_chunks), _SCAN_TILE_ELEMS // e_p)), num_warps=8),
        step(_align_place_kernel, (max(num_scatter, cdiv(max_blocks, block_b)),),
             ("ids", "base", "expert_offsets", "expert_counts", "sorted_slots", "block_expert"),
             num_slots, E, max_blocks, num_scatter, BLOCK_M=block_m, CHUNK=_CHUNK, SUB=sub, E_P=e_p, SUBS=subs,
             BLOCK_B=block_b, num_warps=4),
    ]
