"""Public LCE functions: signatures, docstrings and reductions."""

from __future__ import annotations

import torch

from .launch import validate_inputs
from .ops import lce_forward_impl, lce_forward_op

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
    """Whether autograd records this call: then the forward takes the label's logit from the log-sum-exp's own
    tiles (see :func:`hopperkern.lce.launch.lce_forward`, ``pick_label``)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _op(grad: bool):
    """The custom op when autograd records or torch.compile traces; otherwise its function, called directly
    (no dispatcher work on an eager no-grad call)."""
    return lce_forward_op if grad or torch.compiler.is_compiling() else lce_forward_impl


def _flat(hidden: torch.Tensor) -> torch.Tensor:
    # A view whenever the leading dims can be merged; otherwise reshape copies hidden (O(N*H), never the
    # [V, H] weight). 2-D inputs are always passed through with their strides.
    return hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden.shape[-1])


def _small_contiguous(labels, bias):
    """Flat contiguous labels [N] and bias [V]: the kernels index them with unit stride. Copies here are
    O(N) and O(V) elements, never the [V, H] weight."""
    return labels.reshape(-1).contiguous(), (bias.contiguous() if bias is not None else None)


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0, tma="auto",
                         check_labels=True):
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
        tma: "auto" | "always" | "never" (``HOPPERKERN_TMA`` overrides).
        check_labels: verify labels lie in [0, V) or equal ignore_index (one pass + one host sync); pass
            False when labels are known valid (an invalid label then gives NaN, never a wrong loss).

    Returns: float32 scalar, or labels.shape for reduction="none". Differentiable w.r.t. hidden, weight, bias.
    """
    hidden, weight, bias = _autocast(hidden, weight, bias)
    validate_inputs(hidden, weight, labels, bias, ignore_index=ignore_index, label_smoothing=label_smoothing,
                    z_loss=z_loss, softcap=softcap, temperature=temperature, tma=tma, reduction=reduction)
    lab, bias = _small_contiguous(labels, bias)
    grad = _backward_follows(hidden, weight, bias)
    loss, _, _, _ = _op(grad)(_flat(hidden), weight, lab, bias, ignore_index, float(label_smoothing), float(z_loss),
                              float(softcap or 0.0), float(temperature), tma, False, bool(check_labels), grad)
    if reduction == "none":
        return loss.view(labels.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (lab != ignore_index).sum().clamp(min=1)


def linear_logprobs_entropy(hidden, weight, labels, *, temperature=1.0, ignore_index=-100, tma="auto",
                            check_labels=True):
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
    rounding (~1e-6), not bit for bit.
    """
    hidden, weight = _autocast(hidden, weight)
    validate_inputs(hidden, weight, labels, None, ignore_index=ignore_index, temperature=temperature, tma=tma)
    lab, _ = _small_contiguous(labels, None)
    grad = _backward_follows(hidden, weight)
    _, logprob, entropy, _ = _op(grad)(_flat(hidden), weight, lab, None, ignore_index, 0.0, 0.0, 0.0,
                                       float(temperature), tma, True, bool(check_labels), grad)
    return logprob.view(labels.shape), entropy.view(labels.shape)
