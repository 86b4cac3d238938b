"""Public LCE functions: signatures, docstrings and reductions."""

from __future__ import annotations

import torch

from .._validate import _PLAIN_TENSORS, check_local_memory, check_no_transform, options_key, real_tensor, sync_check
from .._validate import tensor_meta, validate_once
from ..tma import launch_context
from ..tma.launcher import PlanCache, alignment_key, env_key
from . import rl, sft
from .launch import fast_mm_f32, forward_plan_for, logprobs_direct, validate_inputs
from .ops import LceFunction, LceReducedFunction, LceRlFunction, LceSftChunkedFunction, LceSftFunction, _opts
from .ops import lce_forward_impl
from .ops import lce_forward_op, lce_rl_forward_op, lce_sft_chunked_forward_op, lce_sft_forward_op

__all__ = ["linear_cross_entropy", "linear_logprobs_entropy"]


def _autocast(*tensors):
    """Under autocast, run in the autocast dtype as F.linear would (fp32 operands are cast)."""
    t0 = tensors[0]
    if not isinstance(t0, torch.Tensor):
        return tensors
    dev = t0.device.type
    if dev in ("cuda", "cpu") and torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        return tuple(t.to(dt) if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in tensors)
    return tensors


def _backward_follows(*tensors) -> bool:
    """Whether autograd records this call: then the forward takes the label's logit as the log-sum-exp's own
    tiles computed it (see :func:`hopperkern.lce.launch.lce_forward`, ``pick_label``)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _forward(process_group, grad: bool, *args):
    """Per-token (loss, logprob, entropy, lse) from the op's arguments (pick_label = grad): the vocab-parallel path
    over ``process_group`` (:mod:`hopperkern.lce.distributed`); the custom op when torch.compile traces; its
    autograd function when autograd records an eager call; otherwise the op's function, called directly (no
    dispatcher work, one output allocation). Meta and fake tensors go to the op, whose fake implementation gives
    the outputs' shapes."""
    if process_group is not None:
        from .distributed import vocab_parallel_forward  # on first use: it imports torch.distributed and dynamo

        return vocab_parallel_forward(process_group, *args, grad)
    if torch.compiler.is_compiling() or not real_tensor(args[0]):
        return lce_forward_op(*args, grad)  # traced, meta or fake tensors: the op's fake implementation
    if grad:
        return LceFunction.apply(*args)
    return lce_forward_impl(*args, False, True)


def _eager_or_op(function, op, *args):
    """A 3-pass path's forward with autograd: its custom ``op`` where torch.compile traces or the tensors are meta
    or fake, else its autograd ``function`` (the same forward and backward called directly: no dispatcher work)."""
    if torch.compiler.is_compiling() or not real_tensor(args[0]):
        return op(*args)
    return function.apply(*args)


def _validate(process_group, hidden, weight, labels, bias, options: tuple, **kw) -> None:
    """validate_inputs, skipped for arguments whose metadata passed it before (weight's memory is checked on
    every call all the same)."""
    check = lambda: validate_inputs(hidden, weight, labels, bias, vocab_shard=_sharded(process_group), **kw)  # noqa: E731
    if process_group is not None:
        check()
        return
    validate_once((tensor_meta(hidden), tensor_meta(weight), tensor_meta(labels), tensor_meta(bias), options),
                  check, ("weight", weight))


def _sharded(process_group) -> bool:
    if process_group is not None:
        from .distributed import check_process_group

        check_process_group(process_group)  # TypeError
    return process_group is not None


def _flat(hidden: torch.Tensor) -> torch.Tensor:
    # A view whenever the leading dims can be merged; otherwise reshape copies hidden (O(N*H), never the
    # [V, H] weight). 2-D inputs are always passed through with their strides.
    return hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])


def _small_contiguous(labels, bias):
    """Flat contiguous labels [N] and bias [V]: the kernels index them with unit stride. Copies here are
    O(N) and O(V) elements, never the [V, H] weight."""
    return _flat_labels(labels), (bias.contiguous() if bias is not None else None)


def _flat_labels(labels):
    return labels if labels.dim() == 1 and labels.is_contiguous() else labels.reshape(-1).contiguous()


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0, tma="auto",
                         check_labels="auto", process_group=None, sft_path="auto"):
    """Cross-entropy of ``hidden @ weight.T`` without materialising the N x V logits.

    Equivalent to (all math in fp32)::

        z = hidden @ weight.T (+ bias)
        z = softcap * tanh(z / softcap)            # if softcap
        z = z / temperature
        loss = F.cross_entropy(z, labels, ignore_index=ignore_index, label_smoothing=label_smoothing,
                               reduction=reduction)
               + z_loss * logsumexp(z)**2 on kept tokens, with the same reduction

    Args:
        hidden: [..., H] fp16/bf16/fp32. weight: [V, H] same dtype. labels: [...] int32/int64.
        bias: optional [V], weight's dtype.
        reduction: "mean" (divides by kept tokens; all ignored -> 0.0 with zero grads), "sum" or "none"
            (labels.shape, 0 at ignored tokens).
        softcap: None or a finite number > 0. Up to ``launch.EXACT_TANH_SOFTCAP`` (32; Gemma 2's 30) tanh is
            formed as 1 - 2 / (e^2x + 1), ~1e-7 x softcap absolute error in each logit; above it, with its series
            near 0 as well (a few ulp of each logit however small; more registers, a slower kernel).
        temperature: > 0 (infinity: the uniform limit), at least 2.94e-39 so that 1 / temperature is an fp32
            number. label_smoothing: in [0, 1]. z_loss: finite, >= 0.
        tma: "auto" | "always" | "never" (``HOPPERKERN_TMA`` overrides).
        check_labels: "auto" (default): no host sync on a GPU; a kept label outside [0, V) makes its token's
            loss, log-prob, entropy and gradients NaN (so the reduced loss too), never a finite wrong number;
            where the check costs no sync (CPU tensors) it raises ValueError. True: always check first (one
            pass + one host sync), raising ValueError naming the bad labels. False: never check.
        process_group: None, or a ``torch.distributed.ProcessGroup`` over which the head is vocab-parallel (see
            below).
        sft_path: "auto" | "3pass" | "chunked" | "4pass": how a differentiable "sum" or "mean" call computes its
            gradients. "3pass": the forward also forms d(logits) and keeps it, N x V in the inputs' dtype, until the
            backward, which is then two GEMMs: three passes over the vocab. d(logits) comes from the
            exponentials the forward stores in the inputs' dtype (two roundings of the exact value in bf16, one
            in fp32), or with softcap, label smoothing or fp16 inputs from fp32 logits (one rounding). "chunked":
            the same three passes per chunk of tokens, the forward running both gradient GEMMs on each chunk's
            d(logits) and keeping d_hidden and the fp32 d_weight sum for the backward to scale (two passes
            when weight needs no gradient; extra memory V x H x 2 bytes for 16-bit inputs + one chunk, sized to
            the budget below, in eager mode; d_hidden rounded twice where the upstream gradient is no power of two;
            one backward per forward). "4pass": the
            backward recomputes the logits (four passes; extra memory O(N H) + 128 MiB). "auto" (default) takes
            "3pass" from ``sft.MIN_TOKENS_3PASS`` tokens (1536; ``sft.MIN_TOKENS_FP32_LOGITS``, 4096, with softcap,
            label smoothing or fp16) when its extra memory, N x V x itemsize plus scratch (``sft.extra_bytes``), is at
            most V x H x 4 bytes + 512 MiB (``sft.budget_bytes``); else (and for a frozen weight) "chunked" when
            chunks of ``sft.MIN_CHUNK_TOKENS`` tokens (1536) or all N fit that budget; else "4pass"
            (``sft.pick_path``). In fp32 all give the same gradients to fp32 rounding and summation order. A call
            under ``torch.no_grad()`` runs the plain forward either way; ``reduction="none"`` and ``process_group``
            always take "4pass" ("3pass" and "chunked" raise ValueError there). See :mod:`hopperkern.lce.sft`.

    Returns: float32 scalar, or labels.shape for reduction="none". Differentiable w.r.t. hidden, weight, bias.

    Vocab parallelism (``process_group`` given): ``weight`` [V_r, H] and ``bias`` [V_r] are this rank's contiguous
    rows of the whole [V, H] head, the shards in the order of the ranks in the group (uneven sizes, and empty
    shards beside non-empty ones, are fine); hidden, labels (global ids in [0, V) with V the sum of the shards,
    which ``check_labels`` checks against) and every option are the same on every rank. Every rank gets the
    unsharded call's result (to fp32 summation order): label smoothing spreads eps over the global V, z-loss
    and "mean" (over the kept tokens, the same on every rank) are those of the whole head. Per call: one
    all-gather of (V_r, N, H) per rank with one host sync (each rank's vocab offset; ranks whose N or H differ
    raise ValueError together), one all-reduce of an error flag after the local launch (one more host sync: an
    error on one rank raises on all), then two all-reduces on O(N) fp32 data (the per-token max, then the sums
    of exp, entropy terms, logits and the label's logit). The backward all-reduces the same flag (one host
    sync), then sums d_hidden once as fp32 [N, H] on every rank and rounds it to hidden's dtype; d_weight and
    d_bias are this shard's, local. The upstream gradient must be the same on every rank. No logits or weights
    are gathered: memory per rank is the unsharded op's on the shard plus O(N). Under torch.compile this path
    runs eagerly behind a graph break (not traced; ``fullgraph=True`` refuses it). See
    :mod:`hopperkern.lce.distributed`. Meant for gloo (CPU tensors) and NCCL (CUDA tensors); tested so far only on
    CPUs with gloo under Triton's interpreter, not yet with NCCL on GPUs.
    """
    check_no_transform("lce.linear_cross_entropy")
    hidden, weight, bias = _autocast(hidden, weight, bias)
    _validate(process_group, hidden, weight, labels, bias,
              options_key("ce", ignore_index, label_smoothing, z_loss, softcap, temperature, tma, reduction),
              ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
              temperature=temperature, tma=tma, reduction=reduction)
    sft.check_sft_path(sft_path, reduction, sharded=process_group is not None)
    lab, bias = _small_contiguous(labels, bias)
    grad = _backward_follows(hidden, weight, bias)
    hidden2d = _flat(hidden)
    check = sync_check("check_labels", check_labels, lab)
    args = (hidden2d, weight, lab, bias, ignore_index, float(label_smoothing), float(z_loss), float(softcap or 0.0),
            float(temperature), tma)
    path = "4pass"
    if grad and reduction != "none" and process_group is None:
        path = sft.pick_path(sft_path, hidden2d.shape[0], weight.shape[0], weight.shape[1], hidden2d.element_size(),
                             logits=sft.fp32_logits(hidden2d.dtype, softcap, label_smoothing),
                             need_hidden_grad=hidden2d.requires_grad, need_weight_grad=weight.requires_grad,
                             bias=bias is not None)
    if path == "3pass":
        loss = _eager_or_op(LceSftFunction, lce_sft_forward_op, *args, check, reduction == "mean")[0]
        return loss
    if path == "chunked":
        out = _eager_or_op(LceSftChunkedFunction, lce_sft_chunked_forward_op, *args, check, reduction == "mean",
                           hidden2d.requires_grad, weight.requires_grad)
        return out[0]
    if (reduction != "none" and process_group is None and not torch.compiler.is_compiling() and real_tensor(hidden2d)
            and hidden2d.shape[0]):
        # Eager: the reduction in two one-program kernels (the kept-token count, a fixed-order sum), one autograd
        # node in all.
        mean = reduction == "mean"
        if grad:
            return LceReducedFunction.apply(*args, check, mean)
        loss = lce_forward_impl(*args, False, check, False, True)[0]
        with launch_context(hidden2d, "hopperkern.lce"):
            return sft.loss_total(loss, sft.loss_scale(lab, ignore_index, True) if mean else None)[0]
    loss, _, _, _ = _forward(process_group, grad, *args, False, check)
    if reduction == "none":
        return loss.view(labels.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (lab != ignore_index).sum().clamp(min=1)


def linear_logprobs_entropy(hidden, weight, labels, *, temperature=1.0, ignore_index=-100, tma="auto",
                            check_labels="auto", process_group=None, grad_path="auto"):
    """Per-token log-probabilities of ``labels`` and entropies under softmax(hidden @ weight.T / temperature).

    Equivalent to::

        logp = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)
        logprobs = logp.gather(-1, labels[..., None])[..., 0]   # 0 where labels == ignore_index
        entropy = -(logp.exp() * logp).sum(-1)                  # for every token

    Both outputs are float32 with labels.shape and differentiable w.r.t. hidden and weight under arbitrary
    per-token upstream gradients (PPO/GRPO with an entropy bonus). Under ``torch.no_grad()`` the extra memory
    is O(N) (reference / old-policy log-prob passes). A differentiable call takes the label's logit from the
    same tiles as the log-sum-exp (so the backward's p - 1 keeps full precision for confident predictions); a
    no-grad call takes it from a cheaper dot product: its log-probs agree with a differentiable call's to fp32
    rounding (~1e-6), not bit for bit. Its entropies, whose sums then keep the label's term, are within ~1e-7 of
    the exact ones, absolute: relative to a tiny entropy (a confident prediction, 1 - p ~ 1e-7) a few per cent,
    as fp32 PyTorch's; the differentiable call's fp64 combine keeps the entropy of a prediction confident on its
    label exact (the label's term is added in fp64), and of one confident on another class as the no-grad call.

    ``check_labels``: as for :func:`linear_cross_entropy`; by default ("auto") no host sync on a GPU, and a kept
    label outside [0, V) gives its token NaN log-prob and entropy (and NaN gradients).

    ``process_group``: a ``torch.distributed.ProcessGroup`` over which the head is vocab-parallel, as for
    :func:`linear_cross_entropy`: ``weight`` holds this rank's contiguous rows (shards in rank order, uneven or
    empty ones allowed), labels are global ids, and every rank gets the unsharded call's log-probs and entropies
    (to fp32 summation order). One all-gather of the shard sizes and an error flag's all-reduce (a host sync
    each), and two all-reduces on O(N) fp32 data per call; the backward all-reduces the flag (a host sync) and
    d_hidden (fp32 [N, H], summed) and keeps d_weight local. Not traced by torch.compile (runs eagerly behind a
    graph break; ``fullgraph=True`` refuses it). Tested so far on CPUs with gloo under Triton's interpreter only,
    not with NCCL.

    ``grad_path``: "auto" | "3pass" | "4pass": how a differentiable call computes its gradients. "3pass": the
    forward also keeps the exponentials of the logits it computes anyway, N x V in the inputs' dtype, until the
    backward, which forms d(logits) from them in place and runs two GEMMs (three passes over the vocab; bf16 and
    fp32 inputs). That backward consumes what was kept: call it once per forward (a second backward through the
    same graph, ``retain_graph=True``, raises RuntimeError), and several differentiable forwards before one backward
    hold N x V each. "4pass": the backward recomputes the logits (extra memory O(N H) + 128 MiB; any number of
    backwards). "auto" (default) takes "3pass" for bf16 and fp32 inputs from ``sft.MIN_TOKENS_3PASS`` tokens (1536)
    and ``rl.MIN_HIDDEN_3PASS`` hidden units (896) when N x V x itemsize plus scratch (``rl.extra_bytes``) is at
    most V x H x 4 bytes + 512 MiB (``sft.budget_bytes``). Where the whole batch's exponentials exceed that but the
    thresholds hold, "auto" takes the mixed path: the first ``rl.stored_rows(...)`` tokens (as many whole blocks of
    128 as fit the same budget beside the 4-pass part's memory, ``rl.mixed_extra_bytes``; at least 1024) keep
    their exponentials and the others recompute their logits, every d_weight entry still one fp32 sum over all
    tokens, rounded once. Its backward, too, consumes what was kept (pass "4pass" to backpropagate twice through
    a retained graph), and each forward holds its S x V buffer until its backward. Else "4pass". fp16 inputs
    (after autocast) and ``process_group`` always take "4pass" ("3pass" raises TypeError and ValueError there).
    No-grad calls run the plain forward either way. See :mod:`hopperkern.lce.rl`.
    """
    check_no_transform("lce.linear_logprobs_entropy")
    key = _nograd_key(hidden, weight, labels, temperature, ignore_index, tma, check_labels, process_group,
                      grad_path)
    if key is not None:
        out = _nograd_cached(key, hidden, weight, labels)
        if out is not None:
            return out
    hidden, weight = _autocast(hidden, weight)
    _validate(process_group, hidden, weight, labels, None, options_key("lpe", ignore_index, temperature, tma),
              ignore_index=ignore_index, temperature=temperature, tma=tma)
    rl.check_grad_path(grad_path, hidden.dtype, sharded=process_group is not None)
    lab, _ = _small_contiguous(labels, None)
    grad = _backward_follows(hidden, weight)
    hidden2d = _flat(hidden)
    check = sync_check("check_labels", check_labels, lab)
    stored = 0  # tokens that keep their exponentials: -1 all (the 3-pass path), 0 none (the 4-pass path)
    if grad and process_group is None:
        N, (V, H) = hidden2d.shape[0], weight.shape
        if rl.use_3pass(grad_path, N, V, H, hidden2d.dtype):
            stored = -1
        elif fast_mm_f32(hidden2d) or not hidden2d.is_cuda:
            # The mixed path's d_weight GEMMs need cuBLAS's fp32 output for 16-bit inputs on a GPU (else they would
            # copy whole hidden rows to fp32 per vocab slice); the interpreter's tensors are small.
            stored = rl.stored_rows(grad_path, N, V, H, hidden2d.dtype)
    if stored:
        _, logprob, entropy, _, _, _ = _eager_or_op(LceRlFunction, lce_rl_forward_op, hidden2d, weight, lab,
                                                    ignore_index, float(temperature), tma, check, stored)
    else:
        _, logprob, entropy, _ = _forward(process_group, grad, hidden2d, weight, lab, None, ignore_index, 0.0, 0.0,
                                          0.0, float(temperature), tma, True, check)
    if key is not None and hidden2d.shape[0]:
        # These arguments passed validation: later calls with the same key take the one-lookup path.
        opts = _opts(ignore_index, 0.0, 0.0, 0.0, float(temperature), tma)
        _NOGRAD_CALLS.put(key, forward_plan_for(hidden2d, weight, lab, None, opts, need_entropy=True,
                                                pick_label=False))
    if labels.dim() == 1:
        return logprob, entropy
    return logprob.view(labels.shape), entropy.view(labels.shape)


# Validated no-grad log-prob calls: their argument metadata -> the forward plan that served them.
_NOGRAD_CALLS = PlanCache("lce.logprobs_nograd")


def _nograd_key(hidden, weight, labels, temperature, ignore_index, tma, check_labels, process_group, grad_path="auto"):
    """The key of an eager no-grad ``linear_logprobs_entropy`` call on plain CUDA tensors without autocast, a
    process group or a synchronous label check: everything its validation and its plan depend on (devices,
    dtypes, shapes, strides, 16-byte alignment, options with their types, the effective ``HOPPERKERN_TMA`` and
    ``HOPPERKERN_CONFIG``). None for every other call, which takes the full path."""
    if (process_group is not None or type(hidden) not in _PLAIN_TENSORS or type(weight) not in _PLAIN_TENSORS
            or type(labels) not in _PLAIN_TENSORS or not hidden.is_cuda
            or hidden.layout != torch.strided or weight.layout != torch.strided or labels.layout != torch.strided
            or not (check_labels is False or (check_labels.__class__ is str and check_labels == "auto"))):
        return None
    if (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)) \
            or torch.is_autocast_enabled("cuda") or torch.compiler.is_compiling():
        return None
    return (hidden.device, hidden.dtype, hidden.shape, hidden.stride(), weight.device, weight.dtype, weight.shape,
            weight.stride(), labels.device, labels.dtype, labels.shape, labels.stride(), temperature,
            type(temperature), ignore_index, type(ignore_index), tma, grad_path, env_key(),
            alignment_key(hidden, weight, labels))


def _nograd_cached(key, hidden, weight, labels):
    """(logprob, entropy) of a call whose key a validated call stored, launched directly; None when there is no
    such call, its plan is stale (tuning file edited), another device is current or a launch cannot go direct."""
    try:
        plan = _NOGRAD_CALLS.get(key)
    except TypeError:  # an unhashable option value: the full path says what is wrong with it
        return None
    if plan is None or not plan.fresh() or not plan.launch_here():
        return None
    check_local_memory("weight", weight)  # FSDP may have freed its storage since
    out = logprobs_direct(plan, _flat(hidden), weight, _flat_labels(labels))
    if out is None or labels.dim() == 1:
        return out
    return out[0].view(labels.shape), out[1].view(labels.shape)
