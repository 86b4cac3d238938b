"""``torch.nn.Module`` forms of the LCE functions: the options are set once, at construction, and checked there.

Neither module owns a parameter: the output projection (``lm_head.weight``, or a tied embedding) is passed to
``forward``, so it stays registered where the model keeps it.
"""

from __future__ import annotations

import torch
from torch import nn

from .._validate import check_choice, sync_check
from ..tma import TMA_MODES
from .api import linear_cross_entropy, linear_logprobs_entropy
from .launch import check_scalar_options
from .rl import GRAD_PATHS
from .sft import check_sft_path

__all__ = ["LinearCrossEntropyLoss", "LinearLogprobsEntropy"]

REDUCTIONS = ("mean", "sum", "none")


def _check_common(ignore_index, temperature, tma, check_labels) -> None:
    """The options both modules hold, checked as the functions check them at call time."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    check_scalar_options(temperature=temperature)
    check_choice("tma", tma, TMA_MODES)
    sync_check("check_labels", check_labels, torch.empty(0))  # as the functions check it (ValueError, TypeError)


class LinearCrossEntropyLoss(nn.Module):
    """Cross-entropy of ``hidden @ weight.T`` (+ bias) without the N x V logits: the module form of
    :func:`hopperkern.lce.linear_cross_entropy`. In plain PyTorch, ``forward`` is (math in fp32)::

        z = hidden @ weight.T (+ bias)
        z = softcap * tanh(z / softcap)            # if softcap
        z = z / temperature
        loss = F.cross_entropy(z.flatten(0, -2), labels.flatten(), ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)
               + z_loss * logsumexp(z)**2 on kept tokens, with the same reduction

    ``forward(hidden [..., H], weight [V, H], labels [...], bias=None [V])`` returns a float32 scalar, or
    ``labels.shape`` for ``reduction="none"``. ``"mean"`` divides by the kept tokens (0.0 when all are ignored).
    Gradients reach hidden, weight and bias. ``tma`` and ``check_labels`` are passed on to the function: see
    there (``check_labels``: "auto" checks without a host sync, bad labels turning into NaN; True checks with one).
    ``sft_path`` ("auto" | "3pass" | "chunked" | "4pass") is too: "auto" keeps d(logits) from the forward for a
    two-GEMM backward (3 passes over the vocab) when N x V of them fit V x H x 4 bytes + 512 MiB; else runs the
    gradient GEMMs in the forward, chunk by chunk of tokens, when chunks of 1536 tokens fit that budget (and for a
    frozen weight); and recomputes the logits otherwise.
    """

    def __init__(self, ignore_index: int = -100, reduction: str = "mean", label_smoothing: float = 0.0,
                 z_loss: float = 0.0, softcap: float | None = None, temperature: float = 1.0, *, tma: str = "auto",
                 check_labels: bool | str = "auto", sft_path: str = "auto"):
        super().__init__()
        _check_common(ignore_index, temperature, tma, check_labels)
        check_choice("reduction", reduction, REDUCTIONS)
        check_sft_path(sft_path, reduction)
        check_scalar_options(label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss
        self.softcap = softcap
        self.temperature = temperature
        self.tma = tma
        self.check_labels = check_labels
        self.sft_path = sft_path

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        return linear_cross_entropy(hidden, weight, labels, bias=bias, ignore_index=self.ignore_index,
                                    reduction=self.reduction, label_smoothing=self.label_smoothing,
                                    z_loss=self.z_loss, softcap=self.softcap, temperature=self.temperature,
                                    tma=self.tma, check_labels=self.check_labels, sft_path=self.sft_path)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}, "
                f"temperature={self.temperature}, tma={self.tma!r}, check_labels={self.check_labels}, "
                f"sft_path={self.sft_path!r}")


class LinearLogprobsEntropy(nn.Module):
    """Per-token log-probabilities of ``labels`` and entropies of softmax(hidden @ weight.T / temperature), for
    RL losses (PPO, GRPO): the module form of :func:`hopperkern.lce.linear_logprobs_entropy`. In plain PyTorch,
    ``forward`` is::

        logp = torch.log_softmax((hidden @ weight.T).float() / temperature, -1)
        logprobs = logp.gather(-1, labels[..., None])[..., 0]   # 0 where labels == ignore_index
        entropy = -(logp.exp() * logp).sum(-1)                  # for every token

    ``forward(hidden [..., H], weight [V, H], labels [...])`` returns ``(logprobs, entropy)``, float32, each
    ``labels.shape``, both differentiable with respect to hidden and weight. Under ``torch.no_grad()`` (old or
    reference policy) the log-probs agree with a differentiable call's to fp32 rounding (~1e-6), not bit for bit.
    ``grad_path`` ("auto" | "3pass" | "4pass") is passed on: "auto" keeps the logits' exponentials from the forward
    for a backward of one streaming pass and two GEMMs (3 passes over the vocab) for bf16 and fp32 inputs from 1536
    tokens and H = 896 when N x V of them fit V x H x 4 bytes + 512 MiB, and recomputes the logits otherwise. That
    backward consumes what was kept: one backward per forward (``retain_graph=True`` reuse raises; "4pass" allows
    it). See :func:`hopperkern.lce.linear_logprobs_entropy`.
    """

    def __init__(self, temperature: float = 1.0, *, ignore_index: int = -100, tma: str = "auto",
                 check_labels: bool | str = "auto", grad_path: str = "auto"):
        super().__init__()
        _check_common(ignore_index, temperature, tma, check_labels)
        check_choice("grad_path", grad_path, GRAD_PATHS)
        self.temperature = temperature
        self.ignore_index = ignore_index
        self.tma = tma
        self.check_labels = check_labels
        self.grad_path = grad_path

    def forward(self, hidden: torch.Tensor, weight: torch.Tensor,
                labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return linear_logprobs_entropy(hidden, weight, labels, temperature=self.temperature,
                                       ignore_index=self.ignore_index, tma=self.tma,
                                       check_labels=self.check_labels, grad_path=self.grad_path)

    def extra_repr(self) -> str:
        return (f"temperature={self.temperature}, ignore_index={self.ignore_index}, tma={self.tma!r}, "
                f"check_labels={self.check_labels}, grad_path={self.grad_path!r}")
