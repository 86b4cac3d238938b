"""``hopperkern.lce``: fused linear cross-entropy (loss, per-token log-probs and entropy of hidden @ weight.T)
forward and backward, never holding the N x V logits.

Public: :func:`linear_cross_entropy`, :func:`linear_logprobs_entropy` (both vocab-parallel with ``process_group=``,
see :mod:`.distributed`), and their ``nn.Module`` forms :class:`LinearCrossEntropyLoss`, :class:`LinearLogprobsEntropy`
(``modules``). Lower level: :mod:`.launch` (``lce_forward``, ``lce_backward``), :mod:`.sft` (the 3-pass path of sum and
mean losses and its chunked variant, ``sft_path=``), :mod:`.rl` (the 3-pass path of log-probs and entropies, ``grad_path=``),
:mod:`.reference` (plain PyTorch).
"""

from ..tma import _triton  # noqa: F401 - first: a clear ImportError when triton cannot load
from .api import linear_cross_entropy, linear_logprobs_entropy
from .launch import LceOptions, lce_backward, lce_forward
from .modules import LinearCrossEntropyLoss, LinearLogprobsEntropy

__all__ = [
    "LceOptions",
    "LinearCrossEntropyLoss",
    "LinearLogprobsEntropy",
    "lce_backward",
    "lce_forward",
    "linear_cross_entropy",
    "linear_logprobs_entropy",
]
