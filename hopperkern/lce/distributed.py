"""Vocab-parallel (tensor-parallel) LCE over ``torch.distributed``: the ``process_group=`` path of
:func:`hopperkern.lce.linear_cross_entropy` and :func:`hopperkern.lce.linear_logprobs_entropy`.

Layout: rank r of the group (its rank *within* the group) holds rows ``offset_r .. offset_r + V_r - 1`` of the
full [V, H] head as ``weight`` [V_r, H] (and ``bias`` [V_r]), where ``offset_r = V_0 + ... + V_{r-1}`` and
``V = V_0 + ... + V_{world-1}``. Shards may be uneven or empty (V_r = 0), not all of them. ``hidden`` [N, H],
``labels`` [N] (global ids in [0, V) or ignore_index) and every option are the same on every rank. The results
equal the unsharded op's on the concatenated head, up to the order of fp32 sums; no rank ever holds another
rank's weights or any [N, V] logits.

One call, in order (collectives on the inputs' device: gloo for CPU tensors, NCCL for CUDA ones):

1. all-gather of (V_r, N, H), int64 [world, 3], read on the host once (one sync): every rank learns its offset
   and V, and ranks whose N or H differ all raise the same ValueError. The label check (``check_labels``) then
   tests the labels against the global V. Gathering the sizes on every call, rather than taking an offset
   argument, keeps the offsets true to the weights actually passed and checks N and H in the same collective;
   it costs a few bytes and one host sync per call (as does the label check, unless switched off).
2. The local forward kernel over the shard, with labels mapped to shard columns (``label - offset`` inside the
   shard, a negative id when another rank holds the label or the token is ignored: such labels pick no logit),
   gives per-split statistics: max m, sum exp(z - m), sum exp(z - m) (z - m) (entropy), sum z (label smoothing) and
   the label's logit (0 on every rank but the one holding the label). Then an all-reduce MAX of one int, read
   on the host (one sync): a rank whose local launch raised makes every rank raise (:func:`_raise_together`).
3. all-reduce MAX of the per-token local max -> M, fp32 [N].
4. all-reduce SUM of one fp32 [k, N] block (k = 2..4): sum exp(z - M), [sum exp(z - M) (z - M)], [sum z], z_label.
   z_label is exact (one rank adds it, the others add 0).
5. The forward's own combine kernel, with S = 1 split and the global V and labels, forms loss (label smoothing's
   eps / V over the global V, z-loss on the global lse), log-prob, entropy and lse, identical on every rank.

Backward: each rank runs the local backward on its shard with the GLOBAL lse, entropy and log-prob (the
per-token d(logits) needs nothing else; only the rank holding a token's label writes the label column's p - 1
term) -> d_weight and d_bias of its shard, local, and a partial d_hidden over its columns, summed in fp32 by ONE
all-reduce SUM of fp32 [N, H] and then rounded once to hidden's dtype, after the same one-int error all-reduce
(one host sync) as the forward's. The upstream gradients must be the same on every rank (as when every rank
computes the same loss from the replicated outputs).

Costs per call: forward one all-gather and three all-reduces (the error flag's int, then O(N) words twice) with
two host syncs; backward two all-reduces (the flag, then 4 N H bytes) with one host sync.
Memory per rank: the local op's (O(S N) forward statistics; the backward's fp32 [N, H] and one d(logits) slice)
plus O(N) for the merged statistics. torch.compile does not trace into this path (:func:`vocab_parallel_forward`
is ``torch.compiler.disable``-d): a compiled caller runs it eagerly behind a graph break, so ``fullgraph=True``
refuses it (torch 2.13's dynamo raises that it skips a disabled function); compile without ``fullgraph``.

An error that only some ranks raise (e.g. ``tma="always"`` where only one shard's rows cannot use TMA) leaves
the other ranks waiting in the next collective until the group's timeout; what can differ between ranks and be
checked cheaply (N, H, all shards empty) is checked on every rank together in step 1.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from .._validate import first_order
from ..tma import launch_context
from .launch import LceOptions, check_labels, combine_stats, lce_backward, lce_forward

__all__ = ["check_process_group", "vocab_parallel_forward"]

# Shard-local label ids for the local kernels: shard columns are >= 0, so these never name one. Ignored tokens get
# their own id (and the local kernels ignore_index = _IGNORED), so that a shifted label can never collide with the
# user's ignore_index (which may lie inside [0, V_r), e.g. ignore_index=5).
_IGNORED = -1
_ELSEWHERE = -2


def check_process_group(group) -> None:
    """TypeError unless ``group`` is a ``torch.distributed.ProcessGroup``."""
    pg_type = getattr(dist, "ProcessGroup", None) if dist.is_available() else None
    if pg_type is None or not isinstance(group, pg_type):
        extra = "" if pg_type is not None else " (this torch build has no torch.distributed)"
        raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None, "
                        f"got {type(group).__name__}{extra}")


@dataclass(frozen=True)
class _Shard:
    """This rank's place in the vocab-parallel head."""

    group: object  # the ProcessGroup
    offset: int  # global id of the shard's first row
    size: int  # V_r, rows of this rank's weight (may be 0)
    vocab: int  # V, rows of the whole head


@dataclass(frozen=True)
class _Call:
    """Non-tensor state of one sharded call (travels as one object through autograd)."""

    shard: _Shard
    opts: LceOptions  # the user's options (global ignore_index)
    need_entropy: bool

    @property
    def local_opts(self) -> LceOptions:
        return dataclasses.replace(self.opts, ignore_index=_IGNORED)


def _all_gather_single(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    # all_gather_single where torch has it (which deprecates all_gather_into_tensor), else the older name.
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _shard_of(group, hidden2d: torch.Tensor, weight: torch.Tensor) -> _Shard:
    """Step 1: all-gather (V_r, N, H) of every rank; ValueError on every rank when N or H differ or V = 0."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = torch.tensor([weight.shape[0], hidden2d.shape[0], weight.shape[1]], dtype=torch.int64,
                        device=hidden2d.device)
    every = torch.empty(world * 3, dtype=torch.int64, device=hidden2d.device)  # the concatenation (gloo's form)
    _all_gather_single(every, mine, group)
    sizes, ns, hs = (list(col) for col in zip(*every.view(world, 3).tolist()))
    if len(set(ns)) > 1:
        raise ValueError(f"hidden must have the same number of tokens N on every rank of process_group, got N = "
                         f"{ns} by rank")
    if len(set(hs)) > 1:
        raise ValueError(f"weight must have the same hidden size H on every rank of process_group, got H = {hs} "
                         f"by rank")
    if sum(sizes) == 0:
        raise ValueError(f"weight must have V >= 1 rows on some rank of process_group, got V = {sizes} by rank")
    return _Shard(group, sum(sizes[:rank]), sizes[rank], sum(sizes))


def _local_labels(labels1d: torch.Tensor, shard: _Shard, ignore_index: int) -> torch.Tensor:
    """Labels as this shard's column ids: label - offset inside the shard, _ELSEWHERE for a label another rank
    holds (or none: an out-of-range label, when unchecked, then gives NaN through the global combine) and
    _IGNORED for ignore_index. O(N)."""
    inside = (labels1d >= shard.offset) & (labels1d < shard.offset + shard.size)
    ids = torch.where(inside, labels1d - shard.offset, _ELSEWHERE)
    return torch.where(labels1d == ignore_index, _IGNORED, ids)


def _forward(hidden2d, weight, bias, labels1d, local, call: _Call, pick_label: bool):
    """Steps 2-5: per-token (loss, logprob, entropy, lse), [N] (fp32, the LSE fp64), equal on every rank."""
    shard, opts = call.shard, call.opts
    N = hidden2d.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden2d.device)
    loss, logprob = torch.empty(N, **f32), torch.empty(N, **f32)
    lse = torch.empty(N, dtype=torch.float64, device=hidden2d.device)  # fp64, as lce_forward's (see _kernels._load_lse)
    entropy = torch.empty(N, **f32) if call.need_entropy else torch.zeros(N, **f32)
    if N == 0:  # every rank has N = 0 (step 1): no collective
        return loss, logprob, entropy, lse
    need_sumz = opts.label_smoothing > 0
    mx = torch.full((N,), float("-inf"), **f32)  # an empty shard: max over no columns
    block = torch.zeros((2 + call.need_entropy + need_sumz, N), **f32)  # an empty shard adds zeros
    failure = None
    if shard.size:
        try:
            m, s, t, sumz, zl = lce_forward(hidden2d, weight, local, bias, call.local_opts,
                                            need_entropy=call.need_entropy, pick_label=pick_label, stats_only=True)
            torch.amax(m, 0, out=mx)
        except Exception as exc:  # noqa: BLE001 - raised below, on every rank together
            failure = exc
    _raise_together(failure, shard.group, hidden2d.device)
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=shard.group)
    if shard.size:
        scale = torch.exp(m - mx)  # every split's m <= M, every M finite: no inf - inf
        # t is taken against each split's own max (lce_forward_kernel's NEED_T): against mx it is t + (m - mx) s.
        parts = ([s * scale] + ([(t + torch.where(s > 0, (m - mx) * s, 0.0)) * scale] if call.need_entropy else [])
                 + ([sumz] if need_sumz else []) + [zl])
        for row, part in zip(block, parts):
            torch.sum(part, 0, out=row)
    dist.all_reduce(block, op=dist.ReduceOp.SUM, group=shard.group)
    rows = iter(block[:, None, :])  # each [1, N]: one "split" for the combine kernel
    s_g = next(rows)
    t_g = next(rows) if call.need_entropy else s_g
    sumz_g = next(rows) if need_sumz else s_g
    combine_stats(mx[None], s_g, t_g, sumz_g, next(rows), labels1d, shard.vocab, opts, (loss, logprob, entropy, lse),
                  need_entropy=call.need_entropy, need_sumz=need_sumz)
    return loss, logprob, entropy, lse


def _raise_together(failure, group, device) -> None:
    """Make an error on some ranks an error on all: a rank whose local launch raised (a bad tuning file,
    ``tma="always"`` refused for its shard) would otherwise leave the others, an empty shard's included, waiting
    in the next collective until the group times out. One int all-reduce; the failing rank re-raises its error,
    the others a RuntimeError that says so."""
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if failure is not None:
        raise failure
    if int(flag.item()):
        raise RuntimeError("hopperkern vocab-parallel LCE: another rank of the group failed in its local launch "
                           "(its error is raised there); this rank stops too instead of waiting for it")


class _VocabParallelLce(torch.autograd.Function):
    """Autograd around the sharded forward: backward = local backward with the global statistics + d_hidden
    all-reduce."""

    @staticmethod
    def forward(ctx, hidden2d, weight, bias, labels1d, local, call: _Call):
        outs = _forward(hidden2d, weight, bias, labels1d, local, call, pick_label=True)
        loss, logprob, entropy, lse = outs
        ctx.save_for_backward(hidden2d, weight, bias, local, lse, entropy, logprob)
        ctx.call = call
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: its term is skipped
        return outs

    @staticmethod
    @first_order("hopperkern.lce (vocab-parallel)")
    @once_differentiable
    def backward(ctx, g_loss, g_logprob, g_entropy, g_lse):
        hidden2d, weight, bias, local, lse, entropy, logprob = ctx.saved_tensors
        call = ctx.call
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        g = [x.float().contiguous() if x is not None else None for x in (g_loss, g_logprob, g_entropy, g_lse)]
        with launch_context(hidden2d, "hopperkern.lce backward"):
            failure = None
            if call.shard.size and hidden2d.shape[0]:
                try:
                    dh, dw, db = lce_backward(hidden2d, weight, local, bias, lse, entropy, *g, call.local_opts,
                                              logprob=logprob, need_hidden_grad=need_h, need_weight_grad=need_w,
                                              vocab_total=call.shard.vocab, fp32_hidden_grad=True)
                except Exception as exc:  # noqa: BLE001 - raised below, on every rank together
                    failure = exc
            if need_h and hidden2d.shape[0]:  # the ranks that all-reduce d_hidden below first agree it exists
                _raise_together(failure, call.shard.group, hidden2d.device)
            elif failure is not None:
                raise failure
            if not (call.shard.size and hidden2d.shape[0]):  # an empty shard (or no tokens): zeros only
                dh = torch.zeros(hidden2d.shape, dtype=torch.float32, device=hidden2d.device) if need_h else None
                dw = torch.zeros_like(weight) if need_w else None
                db = torch.zeros_like(bias) if bias is not None else None
            if need_h:
                dh = dh.float()  # a no-op but after lce_backward's early return (no upstream gradient)
                if dh.numel():
                    dist.all_reduce(dh, op=dist.ReduceOp.SUM, group=call.shard.group)
                dh = dh.to(hidden2d.dtype)
        return dh, dw if need_w else None, db if need_b else None, None, None, None


@torch.compiler.disable
def vocab_parallel_forward(group, hidden2d, weight, labels1d, bias, ignore_index, label_smoothing, z_loss, softcap,
                           temperature, tma, need_entropy, check, grad):
    """Per-token ``(loss, logprob, entropy, lse)`` ([N], fp32 but the fp64 LSE, the same on every rank) of one rank's
    vocab shard; the arguments of :func:`hopperkern.lce.ops.lce_forward_impl` after ``group``, inputs validated.
    ``grad``: autograd records the call (the label's logit then comes from the forward's tiles, as in the unsharded
    op)."""
    opts = LceOptions(ignore_index=int(ignore_index), label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                      softcap=float(softcap), temperature=float(temperature), tma=str(tma))
    with launch_context(hidden2d, "hopperkern.lce"):  # raises on every rank alike, before any collective
        shard = _shard_of(group, hidden2d, weight)
        if check:
            check_labels(labels1d, shard.vocab, opts.ignore_index)
        local = _local_labels(labels1d, shard, opts.ignore_index)
        call = _Call(shard, opts, bool(need_entropy))
        if grad:
            return _VocabParallelLce.apply(hidden2d, weight, bias, labels1d, local, call)
        return _forward(hidden2d, weight, bias, labels1d, local, call, pick_label=False)
