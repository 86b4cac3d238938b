"""torch.library custom ops around the LCE launchers, with fake (meta) implementations and autograd.

Custom ops keep ``torch.compile(fullgraph=True)`` working: dynamo sees opaque ops with known output shapes
instead of Triton launches and host-side checks. Three pairs: ``lce_forward`` / ``lce_backward`` (the 4-pass
path, any per-token upstream gradients), ``lce_sft_forward`` / ``lce_sft_backward`` (the 3-pass path of a sum or
mean loss, :mod:`.sft`, whose forward returns the d(logits) that its backward multiplies; its chunked variant
``lce_sft_chunked_forward`` returns the gradients for an upstream gradient of 1, which its autograd formula scales)
and ``lce_rl_forward`` /
``lce_rl_backward`` (the 3-pass path of per-token log-probs and entropies, :mod:`.rl`, whose forward returns the
exponentials that its backward turns into d(logits) in place).

Eager calls that autograd records skip the dispatcher: ``LceFunction``, ``LceSftFunction``,
``LceSftChunkedFunction`` and ``LceRlFunction`` run
the same forward and backward functions as autograd functions, without the custom ops' per-call wrappers, and the RL
one bumps the version of what its backward overwrites, as the op's declared mutation does. ``LceReducedFunction``
is ``LceFunction`` with a sum or mean of its per-token losses taken on the device (eager 4-pass calls).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .._validate import first_order
from ..tma import launch_context
from .launch import LceOptions, check_labels, lce_backward, lce_forward
from .rl import stored_config as rl_stored_config
from .rl import lce_rl_backward, lce_rl_forward
from .sft import lce_sft_backward, lce_sft_chunked_backward, lce_sft_chunked_forward, lce_sft_forward, loss_scale
from .sft import factor_rows, fp32_logits, loss_total, padded_cols


_OPTS: dict = {}


def _opts(ignore_index, label_smoothing, z_loss, softcap, temperature, tma) -> LceOptions:
    """The options object of these values (one shared, hashable object per distinct set: no per-call build)."""
    key = (ignore_index, label_smoothing, z_loss, softcap, temperature, tma)
    opts = _OPTS.get(key)
    if opts is None:
        if len(_OPTS) >= 256:
            _OPTS.clear()
        opts = _OPTS[key] = LceOptions(ignore_index=int(ignore_index), label_smoothing=float(label_smoothing),
                                       z_loss=float(z_loss), softcap=float(softcap), temperature=float(temperature),
                                       tma=str(tma))
    return opts


def lce_forward_impl(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
                     label_smoothing: float, z_loss: float, softcap: float, temperature: float, tma: str,
                     need_entropy: bool, check: bool, pick_label: bool = True,
                     shared_out: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-token (loss, logprob, entropy, lse) of 2-D ``hidden`` [N, H]; see :func:`launch.lce_forward`
    (``pick_label``: True when a backward will follow; ``shared_out``: the four outputs may be views of one
    allocation, as an eager no-grad call allows and a custom op's outputs do not)."""
    if check:
        check_labels(labels, weight.shape[0], ignore_index)
    opts = _opts(ignore_index, label_smoothing, z_loss, softcap, temperature, tma)
    with launch_context(hidden, "hopperkern.lce"):  # no guard to enter where hidden's GPU is current
        return lce_forward(hidden, weight, labels, bias, opts, need_entropy=need_entropy, pick_label=pick_label,
                           shared_out=shared_out)


# The custom op runs the same function; an eager call that autograd does not record calls it directly (the
# public functions), skipping the dispatcher's per-call work.
lce_forward_op = torch.library.custom_op("hopperkern::lce_forward", mutates_args=())(lce_forward_impl)


@lce_forward_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma, need_entropy,
      check, pick_label=True, shared_out=False):
    return _fake_stats(hidden, hidden.shape[0])


def _fake_stats(like: Tensor, n: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Fake (loss, logprob, entropy, lse) of ``n`` tokens: fp32, the LSE fp64 (as :func:`launch.lce_forward`)."""
    f32 = [like.new_empty((n,), dtype=torch.float32) for _ in range(3)]
    return (*f32, like.new_empty((n,), dtype=torch.float64))


def lce_backward_impl(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], lse: Tensor,
                      entropy: Tensor, zlab: Optional[Tensor], g_loss: Optional[Tensor], g_logprob: Optional[Tensor],
                      g_entropy: Optional[Tensor], g_lse: Optional[Tensor], ignore_index: int, label_smoothing: float,
                      z_loss: float, softcap: float, temperature: float, tma: str, need_hidden_grad: bool,
                      need_weight_grad: bool, logprob: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(d_hidden, d_weight, d_bias); a gradient that is not needed comes back as an empty tensor.

    ``logprob`` (the forward's fp32 log-prob) is required with ``g_loss`` or ``g_logprob``; ``zlab`` is
    deprecated and ignored (pass None); see :func:`launch.lce_backward`."""
    grads = _backward_grads(hidden, weight, labels, bias, lse, entropy, zlab, g_loss, g_logprob, g_entropy, g_lse,
                            ignore_index, label_smoothing, z_loss, softcap, temperature, tma, need_hidden_grad,
                            need_weight_grad, logprob)
    # Custom-op outputs must not alias each other: one fresh empty tensor per missing gradient.
    return tuple(g if g is not None else hidden.new_empty((0,)) for g in grads)


def _backward_grads(hidden, weight, labels, bias, lse, entropy, zlab, g_loss, g_logprob, g_entropy, g_lse,
                    ignore_index, label_smoothing, z_loss, softcap, temperature, tma, need_hidden_grad,
                    need_weight_grad, logprob=None):
    """:func:`lce_backward_impl`'s work: (d_hidden, d_weight, d_bias), None for a gradient not computed (the eager
    autograd function takes these as they are; the custom op puts empty tensors in their place)."""
    opts = _opts(ignore_index, label_smoothing, z_loss, softcap, temperature, tma)
    g = _f32_grads(g_loss, g_logprob, g_entropy, g_lse)
    with launch_context(hidden, "hopperkern.lce backward"):
        return lce_backward(hidden, weight, labels, bias, lse, entropy, *g, opts, logprob=logprob, zlab=zlab,
                            need_hidden_grad=need_hidden_grad, need_weight_grad=need_weight_grad)


def _f32_grads(*grads):
    """Per-token upstream gradients as the kernels read them: fp32 and contiguous (None stays None)."""
    return [x if x is None or (x.dtype == torch.float32 and x.is_contiguous()) else x.float().contiguous()
            for x in grads]


lce_backward_op = torch.library.custom_op("hopperkern::lce_backward", mutates_args=())(lce_backward_impl)


def _fake_grads(hidden, weight, bias, need_hidden_grad, need_weight_grad):
    """Fake (d_hidden, d_weight, d_bias) of both backward ops: contiguous, as the real ones; empty when absent."""
    dh = hidden.new_empty(hidden.shape) if need_hidden_grad else hidden.new_empty((0,))
    dw = weight.new_empty(weight.shape) if need_weight_grad else hidden.new_empty((0,))
    db = bias.new_empty(bias.shape) if bias is not None else hidden.new_empty((0,))
    return dh, dw, db


@lce_backward_op.register_fake
def _(hidden, weight, labels, bias, lse, entropy, zlab, g_loss, g_logprob, g_entropy, g_lse, ignore_index,
      label_smoothing, z_loss, softcap, temperature, tma, need_hidden_grad, need_weight_grad, logprob=None):
    return _fake_grads(hidden, weight, bias, need_hidden_grad, need_weight_grad)


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma = inputs[:10]
    _, logprob, entropy, lse = output
    # logprob = z_label - lse in fp32: the backward forms the label column of d(logits) from exp(logprob).
    ctx.save_for_backward(hidden, weight, labels, bias, lse, entropy, logprob)
    ctx.opts = (ignore_index, label_smoothing, z_loss, softcap, temperature, tma)


def _grads(ctx, backward, g_loss, g_logprob, g_entropy, g_lse):
    """The forward inputs' gradients (hidden, weight, bias) through ``backward`` (the op or its function)."""
    hidden, weight, labels, bias, lse, entropy, logprob = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = bias is not None and ctx.needs_input_grad[3]
    if not (need_h or need_w or need_b):
        return None, None, None
    dh, dw, db = backward(hidden, weight, labels, bias, lse, entropy, None, g_loss, g_logprob, g_entropy, g_lse,
                          *ctx.opts, need_h, need_w, logprob)
    return dh if need_h else None, dw if need_w else None, db if need_b else None


def _backward(ctx, g_loss, g_logprob, g_entropy, g_lse):
    dh, dw, db = _grads(ctx, lce_backward_op, g_loss, g_logprob, g_entropy, g_lse)
    return (dh, dw, None, db) + (None,) * 10


torch.library.register_autograd("hopperkern::lce_forward", _backward, setup_context=_setup_context)


class LceFunction(torch.autograd.Function):
    """The custom op's autograd, for eager calls: the same forward and backward functions, without the
    dispatcher's per-call work (tens of microseconds of host time). Traced calls use the op."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma,
                need_entropy, check):
        out = lce_forward_impl(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap,
                               temperature, tma, need_entropy, check, True)
        _setup_context(ctx, (hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap,
                             temperature, tma), out)
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None: a term the kernels skip
        return out

    @staticmethod
    @first_order("hopperkern.lce")
    @torch.autograd.function.once_differentiable  # as the op: a double backward raises, never drops a term
    def backward(ctx, g_loss, g_logprob, g_entropy, g_lse):
        dh, dw, db = _grads(ctx, _backward_grads, g_loss, g_logprob, g_entropy, g_lse)
        return (dh, dw, None, db) + (None,) * 8


class LceReducedFunction(torch.autograd.Function):
    """The 4-pass path's sum or mean loss for eager calls that autograd records: the forward of
    :class:`LceFunction`, its per-token losses reduced on the device by two one-program kernels
    (:func:`sft.loss_scale`, :func:`sft.loss_total`: the kept-token count and a fixed-order sum), and a backward
    that hands every token its part of the upstream gradient as one fp32 [N] vector to the same backward: one
    autograd node, three launches beside the op's own per step. Traced calls reduce the op's per-token losses
    with torch ops instead."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma,
                check, mean):
        out = lce_forward_impl(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap,
                               temperature, tma, False, check, True)
        with launch_context(hidden, "hopperkern.lce"):
            total, ctx.share = loss_total(out[0], loss_scale(labels, ignore_index, True) if mean else None,
                                          share=True)
        _setup_context(ctx, (hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap,
                             temperature, tma), out)
        ctx.set_materialize_grads(False)
        return total

    @staticmethod
    @first_order("hopperkern.lce")
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        if g is None:
            return (None,) * 12
        # Each token's loss gradient, fp32 and contiguous as the kernels read it: share[n] * g.
        dh, dw, db = _grads(ctx, _backward_grads, ctx.share * g, None, None, None)
        return (dh, dw, None, db) + (None,) * 8


# ---------------------------------------------------------------------------------------------------------------
# The 3-pass path of a sum or mean loss (hopperkern.lce.sft)


def lce_sft_forward_impl(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor], ignore_index: int,
                         label_smoothing: float, z_loss: float, softcap: float, temperature: float, tma: str,
                         check: bool, mean: bool) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, dlogits, rho): the 0-dim fp32 sum (``mean``: mean over kept tokens) of the per-token loss, and its
    gradient w.r.t. the logits as rho[:, None] * dlogits, dlogits [N, padded_cols(V)] in hidden's dtype, rho fp32
    [N], or [2N] with each row's label term after the factors (16-bit inputs), or [0]: none; see
    :func:`sft.lce_sft_forward`."""
    with launch_context(hidden, "hopperkern.lce"):
        if check:
            check_labels(labels, weight.shape[0], ignore_index)
        opts = _opts(ignore_index, label_smoothing, z_loss, softcap, temperature, tma)
        return lce_sft_forward(hidden, weight, labels, bias, opts, mean=mean)


lce_sft_forward_op = torch.library.custom_op("hopperkern::lce_sft_forward", mutates_args=())(lce_sft_forward_impl)


@lce_sft_forward_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma, check, mean):
    N = hidden.shape[0]
    rows = 0 if N == 0 or fp32_logits(hidden.dtype, softcap, label_smoothing) else factor_rows(N, hidden.dtype)
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty((N, padded_cols(weight.shape[0]))),
            hidden.new_empty((rows,), dtype=torch.float32))


def lce_sft_backward_impl(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], dlogits: Tensor, rho: Tensor,
                          g: Tensor, need_hidden_grad: bool, need_weight_grad: bool,
                          tma: str, labels: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor]:
    """(d_hidden, d_weight, d_bias) for the upstream gradient ``g`` (0-dim) of lce_sft_forward's loss, from its
    dlogits and rho (and the forward's labels, which label terms in rho need); a gradient that is not needed comes
    back as an empty tensor. See :func:`sft.lce_sft_backward`."""
    with launch_context(hidden, "hopperkern.lce backward"):
        grads = lce_sft_backward(hidden, weight, bias, dlogits, g, need_hidden_grad=need_hidden_grad,
                                 need_weight_grad=need_weight_grad, tma=tma, rho=rho, labels=labels)
    return tuple(x if x is not None else hidden.new_empty((0,)) for x in grads)


lce_sft_backward_op = torch.library.custom_op("hopperkern::lce_sft_backward", mutates_args=())(lce_sft_backward_impl)


@lce_sft_backward_op.register_fake
def _(hidden, weight, bias, dlogits, rho, g, need_hidden_grad, need_weight_grad, tma, labels=None):
    return _fake_grads(hidden, weight, bias, need_hidden_grad, need_weight_grad)


def _sft_setup_context(ctx, inputs, output):
    hidden, weight, labels, bias = inputs[:4]
    dlogits, rho = output[1], output[2]
    ctx.mark_non_differentiable(dlogits, rho)
    ctx.save_for_backward(hidden, weight, bias, dlogits, rho, labels)
    ctx.tma = inputs[9]
    # Without this autograd would fill a zero gradient for dlogits ([N, V]: as large as dlogits itself) before
    # every backward.
    ctx.set_materialize_grads(False)


def _sft_grads(ctx, backward, g_loss):
    """(d_hidden, d_weight, d_bias), None where not needed, through ``backward`` (the op or its function)."""
    hidden, weight, bias, dlogits, rho, labels = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_b = bias is not None and ctx.needs_input_grad[3]
    if g_loss is None or not (need_h or need_w or need_b):
        return None, None, None
    dh, dw, db = backward(hidden, weight, bias, dlogits, rho, g_loss, need_h, need_w, ctx.tma, labels)
    return dh if need_h else None, dw if need_w else None, db if need_b else None


def _sft_backward(ctx, g_loss, *_):
    dh, dw, db = _sft_grads(ctx, lce_sft_backward_op, g_loss)
    return (dh, dw, None, db) + (None,) * 8


torch.library.register_autograd("hopperkern::lce_sft_forward", _sft_backward, setup_context=_sft_setup_context)


class LceSftFunction(torch.autograd.Function):
    """The 3-pass SFT op's autograd for eager calls: its forward and backward functions called directly, without
    the custom ops' per-call dispatch work. Traced calls use the ops."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma,
                check, mean):
        inputs = (hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma,
                  check, mean)
        out = lce_sft_forward_impl(*inputs)
        _sft_setup_context(ctx, inputs, out)
        return out

    @staticmethod
    @first_order("hopperkern.lce")
    @torch.autograd.function.once_differentiable  # as the op: a double backward raises, never drops a term
    def backward(ctx, g_loss, *_):
        dh, dw, db = _sft_grads(ctx, lce_sft_backward_impl, g_loss)
        return (dh, dw, None, db) + (None,) * 8


# ---------------------------------------------------------------------------------------------------------------
# The chunked variant of the 3-pass path (hopperkern.lce.sft): the forward computes the gradients


def lce_sft_chunked_forward_impl(hidden: Tensor, weight: Tensor, labels: Tensor, bias: Optional[Tensor],
                                 ignore_index: int, label_smoothing: float, z_loss: float, softcap: float,
                                 temperature: float, tma: str, check: bool, mean: bool, need_hidden_grad: bool,
                                 need_weight_grad: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, d_hidden, d_weight, d_weight_lo, d_bias_sum) for an upstream gradient of 1; see
    :func:`sft.lce_sft_chunked_forward` (a gradient not asked for is an empty tensor)."""
    with launch_context(hidden, "hopperkern.lce"):
        if check:
            check_labels(labels, weight.shape[0], ignore_index)
        opts = _opts(ignore_index, label_smoothing, z_loss, softcap, temperature, tma)
        return lce_sft_chunked_forward(hidden, weight, labels, bias, opts, mean=mean,
                                       need_hidden_grad=need_hidden_grad, need_weight_grad=need_weight_grad)


lce_sft_chunked_forward_op = torch.library.custom_op("hopperkern::lce_sft_chunked_forward",
                                                     mutates_args=())(lce_sft_chunked_forward_impl)


@lce_sft_chunked_forward_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma, check, mean,
      need_hidden_grad, need_weight_grad):
    f32 = torch.float32
    split = need_weight_grad and hidden.dtype != f32
    none = lambda: hidden.new_empty((0,), dtype=f32)  # noqa: E731 - each placeholder a tensor of its own
    return (hidden.new_empty((), dtype=f32),
            hidden.new_empty((hidden.shape[0], hidden.shape[1])) if need_hidden_grad else none(),
            hidden.new_empty(tuple(weight.shape)) if need_weight_grad else none(),
            hidden.new_empty(tuple(weight.shape), dtype=torch.int16) if split else none(),
            hidden.new_empty((weight.shape[0],), dtype=f32) if bias is not None else none())


def _sft_chunked_setup_context(ctx, inputs, output):
    ctx.mark_non_differentiable(*output[1:])
    ctx.save_for_backward(*output[1:])
    bias = inputs[3]
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.set_materialize_grads(False)


def lce_sft_chunked_backward_impl(d_hidden: Tensor, d_weight: Tensor, d_weight_lo: Tensor, d_bias_sum: Tensor,
                                  g: Tensor, bias_dtype: Optional[torch.dtype]) -> tuple[Tensor, Tensor, Tensor]:
    """(d_hidden, d_weight, d_bias): the chunked forward's sums times ``g``, in new buffers; a gradient not computed
    comes back as an empty tensor. See :func:`sft.lce_sft_chunked_backward`."""
    with launch_context(d_hidden, "hopperkern.lce backward"):
        grads = lce_sft_chunked_backward(d_hidden, d_weight, d_weight_lo, d_bias_sum, g, bias_dtype)
    # A gradient not computed: an empty tensor like the forward's placeholder it stands for (as the fake gives it).
    kept = (d_hidden, d_weight, d_bias_sum)
    return tuple(x if x is not None else k.new_empty((0,)) for x, k in zip(grads, kept))


lce_sft_chunked_backward_op = torch.library.custom_op("hopperkern::lce_sft_chunked_backward",
                                                      mutates_args=())(lce_sft_chunked_backward_impl)


@lce_sft_chunked_backward_op.register_fake
def _(d_hidden, d_weight, d_weight_lo, d_bias_sum, g, bias_dtype):
    return (torch.empty_like(d_hidden, memory_format=torch.contiguous_format),
            torch.empty_like(d_weight, memory_format=torch.contiguous_format),
            d_bias_sum.new_empty(tuple(d_bias_sum.shape), dtype=bias_dtype) if bias_dtype is not None
            else d_bias_sum.new_empty((0,)))


def _sft_chunked_grads(ctx, backward, g_loss):
    """The gradients of the chunked op's inputs (None where not needed) through ``backward`` (op or function)."""
    if g_loss is None:
        return (None,) * 14
    dh, dw, db = backward(*ctx.saved_tensors, g_loss, ctx.bias_dtype)
    keep = lambda t, i: t if ctx.needs_input_grad[i] else None  # noqa: E731
    return (keep(dh, 0), keep(dw, 1), None, keep(db, 3)) + (None,) * 10


def _sft_chunked_backward(ctx, g_loss, *_):
    return _sft_chunked_grads(ctx, lce_sft_chunked_backward_op, g_loss)


torch.library.register_autograd("hopperkern::lce_sft_chunked_forward", _sft_chunked_backward,
                               setup_context=_sft_chunked_setup_context)


class LceSftChunkedFunction(torch.autograd.Function):
    """The chunked SFT op's autograd for eager calls: its forward function called directly, without the custom
    op's per-call dispatch work, and a backward that scales the kept d_hidden and d_weight in place (one backward
    per forward). Traced calls use the ops (the backward op writes new buffers)."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss, softcap, temperature, tma,
                check, mean, need_hidden_grad, need_weight_grad):
        inputs = (hidden, weight, labels, bias)
        out = lce_sft_chunked_forward_impl(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss,
                                           softcap, temperature, tma, check, mean, need_hidden_grad,
                                           need_weight_grad)
        _sft_chunked_setup_context(ctx, inputs, out)
        return out

    @staticmethod
    @first_order("hopperkern.lce")
    @torch.autograd.function.once_differentiable  # as the op: a double backward raises, never drops a term
    def backward(ctx, g_loss, *_):
        return _sft_chunked_grads(ctx, _sft_chunked_backward_eager, g_loss)


def _sft_chunked_backward_eager(d_hidden, d_weight, d_weight_lo, d_bias_sum, g, bias_dtype):
    """The eager backward: d_hidden and d_weight become the gradients in their own memory (no second buffers), with
    new versions, so a second backward through a retained graph raises rather than scaling them twice."""
    with launch_context(d_hidden, "hopperkern.lce backward"):
        grads = lce_sft_chunked_backward(d_hidden, d_weight, d_weight_lo, d_bias_sum, g, bias_dtype, in_place=True)
    torch.autograd.graph.increment_version(tuple(t for t, x in zip((d_hidden, d_weight), grads) if x is not None))
    return grads


# ---------------------------------------------------------------------------------------------------------------
# The 3-pass path of per-token log-probs and entropies (hopperkern.lce.rl)


def _rl_opts(ignore_index, temperature, tma) -> LceOptions:
    return _opts(ignore_index, 0.0, 0.0, 0.0, temperature, tma)


def lce_rl_forward_impl(hidden: Tensor, weight: Tensor, labels: Tensor, ignore_index: int, temperature: float,
                        tma: str, check: bool,
                        stored: int = -1) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(loss, logprob, entropy, lse, e, mt): the per-token fp32 outputs and the exponentials and per-tile maxima
    the backward forms d(logits) from, of the first ``stored`` tokens (-1: all; fewer: the mixed path, whose other
    tokens' backward recomputes their logits); see :func:`rl.lce_rl_forward`. ``e`` and ``mt`` are for the
    backward op only: a compiled region must not return them (the public functions drop them)."""
    with launch_context(hidden, "hopperkern.lce"):
        if check:
            check_labels(labels, weight.shape[0], ignore_index)
        return lce_rl_forward(hidden, weight, labels, _rl_opts(ignore_index, temperature, tma),
                              stored=None if stored < 0 else stored)


lce_rl_forward_op = torch.library.custom_op("hopperkern::lce_rl_forward", mutates_args=())(lce_rl_forward_impl)


@lce_rl_forward_op.register_fake
def _(hidden, weight, labels, ignore_index, temperature, tma, check, stored=-1):
    n, (v, h) = hidden.shape[0], weight.shape
    s = n if stored < 0 else min(stored, n)
    # The real call's config lookup (host only), so mt's width matches; it depends on the stored rows' token
    # bucket, so a dynamic N specialises on it.
    cfg = rl_stored_config(hidden.dtype, s, h, hidden.device)
    return (*_fake_stats(hidden, n), hidden.new_empty((s, padded_cols(v))),
            hidden.new_empty((s, (v + cfg.block_n - 1) // cfg.block_n), dtype=torch.float32))


@torch.library.custom_op("hopperkern::lce_rl_backward", mutates_args=("e", "mt"))
def lce_rl_backward_op(hidden: Tensor, weight: Tensor, labels: Tensor, e: Tensor, mt: Tensor, lse: Tensor,
                       entropy: Tensor, logprob: Tensor, g_loss: Optional[Tensor], g_logprob: Optional[Tensor],
                       g_entropy: Optional[Tensor], g_lse: Optional[Tensor], ignore_index: int, temperature: float,
                       tma: str, need_hidden_grad: bool, need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    """(d_hidden, d_weight) from what lce_rl_forward kept and fp32 [N] upstream gradients of its per-token outputs;
    ``e`` is overwritten with d(logits) and ``mt`` with NaN (the pair serves one backward). A gradient that is not
    needed comes back as an empty tensor."""
    return _rl_backward_run(hidden, weight, labels, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy, g_lse,
                            ignore_index, temperature, tma, need_hidden_grad, need_weight_grad, True)


def _rl_backward_run(hidden, weight, labels, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy, g_lse,
                     ignore_index, temperature, tma, need_hidden_grad, need_weight_grad, in_place):
    """Both RL backward ops' work (:func:`rl.lce_rl_backward`), with an empty tensor per missing gradient."""
    with launch_context(hidden, "hopperkern.lce backward"):
        grads = lce_rl_backward(hidden, weight, labels, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy,
                                g_lse, _rl_opts(ignore_index, temperature, tma), need_hidden_grad=need_hidden_grad,
                                need_weight_grad=need_weight_grad, in_place=in_place)
    return tuple(x if x is not None else hidden.new_empty((0,)) for x in grads)


@torch.library.custom_op("hopperkern::lce_rl_backward_functional", mutates_args=())
def lce_rl_backward_functional_op(hidden: Tensor, weight: Tensor, labels: Tensor, e: Tensor, mt: Tensor, lse: Tensor,
                                  entropy: Tensor, logprob: Tensor, g_loss: Optional[Tensor],
                                  g_logprob: Optional[Tensor], g_entropy: Optional[Tensor], g_lse: Optional[Tensor],
                                  ignore_index: int, temperature: float, tma: str, need_hidden_grad: bool,
                                  need_weight_grad: bool) -> tuple[Tensor, Tensor]:
    """lce_rl_backward_op without side effects, for traced backwards: d(logits) goes to a buffer of its own and
    ``e``, ``mt`` are left as they are (a traced in-place update would be written back over them unchecked)."""
    return _rl_backward_run(hidden, weight, labels, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy, g_lse,
                            ignore_index, temperature, tma, need_hidden_grad, need_weight_grad, False)


def _rl_fake_backward(hidden, weight, labels, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy, g_lse,
                      ignore_index, temperature, tma, need_hidden_grad, need_weight_grad):
    return _fake_grads(hidden, weight, None, need_hidden_grad, need_weight_grad)[:2]


lce_rl_backward_op.register_fake(_rl_fake_backward)
lce_rl_backward_functional_op.register_fake(_rl_fake_backward)


def _rl_setup_context(ctx, inputs, output):
    hidden, weight, labels = inputs[:3]
    _, logprob, entropy, lse, e, mt = output
    ctx.mark_non_differentiable(e, mt)
    # An eager backward overwrites e and mt: a second backward through this graph then fails autograd's version
    # check.
    ctx.save_for_backward(hidden, weight, labels, e, mt, lse, entropy, logprob)
    ctx.opts = tuple(inputs[3:6])
    ctx.set_materialize_grads(False)  # an unused output's gradient stays None: a term the kernel skips


def _rl_backward(ctx, g_loss, g_logprob, g_entropy, g_lse, _e, _mt):
    # Eager: in place (version-checked). Traced: into a buffer of its own, as functionalisation would write an
    # in-place update back over the saved tensors without the check.
    op = lce_rl_backward_functional_op if torch.compiler.is_compiling() else lce_rl_backward_op
    return _rl_grads(ctx, op, g_loss, g_logprob, g_entropy, g_lse) + (None,) * 6


def _rl_grads(ctx, backward, g_loss, g_logprob, g_entropy, g_lse):
    """(d_hidden, d_weight), None where not needed, through ``backward`` (an op, or :func:`_rl_backward_eager`)."""
    hidden, weight, labels, e, mt, lse, entropy, logprob = ctx.saved_tensors
    need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    ups = _f32_grads(g_loss, g_logprob, g_entropy, g_lse)
    if not (need_h or need_w) or all(x is None for x in ups):
        return None, None
    dh, dw = backward(hidden, weight, labels, e, mt, lse, entropy, logprob, *ups, *ctx.opts, need_h, need_w)
    return dh if need_h else None, dw if need_w else None


def _rl_backward_eager(hidden, weight, labels, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy, g_lse,
                       ignore_index, temperature, tma, need_hidden_grad, need_weight_grad):
    """lce_rl_backward_op's work called directly: e becomes d(logits) and mt NaN in place, and both get a new
    version, as the op's declared mutation gives them, so a second backward through the graph raises."""
    grads = _rl_backward_run(hidden, weight, labels, e, mt, lse, entropy, logprob, g_loss, g_logprob, g_entropy,
                             g_lse, ignore_index, temperature, tma, need_hidden_grad, need_weight_grad, True)
    torch.autograd.graph.increment_version((e, mt))
    return grads


torch.library.register_autograd("hopperkern::lce_rl_forward", _rl_backward, setup_context=_rl_setup_context)


class LceRlFunction(torch.autograd.Function):
    """The 3-pass log-prob / entropy op's autograd for eager calls: its forward and backward functions called
    directly, without the custom ops' per-call dispatch work. Traced calls use the ops."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, temperature, tma, check, stored=-1):
        inputs = (hidden, weight, labels, ignore_index, temperature, tma, check, stored)
        out = lce_rl_forward_impl(*inputs)
        _rl_setup_context(ctx, inputs, out)
        return out

    @staticmethod
    @first_order("hopperkern.lce")
    @torch.autograd.function.once_differentiable  # as the op: a double backward raises, never drops a term
    def backward(ctx, g_loss, g_logprob, g_entropy, g_lse, _e, _mt):
        return _rl_grads(ctx, _rl_backward_eager, g_loss, g_logprob, g_entropy, g_lse) + (None,) * 6
