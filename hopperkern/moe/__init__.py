"""``hopperkern.moe``: Mixture-of-Experts MLP on Hopper, built on :mod:`hopperkern.tma`.

Pipeline (each piece public, documented in its module):

- :func:`route` (``routing``): router logits -> (topk_weights f32 [T, k], topk_ids int32 [T, k]); softmax
  top-k or DeepSeek-V3 sigmoid group-limited routing; ties go to the lower expert index.
- :func:`moe_align` (``align``): per-expert counts, padded offsets, slots sorted by expert and padded to
  block_m, expert per row block; Triton, no host sync (CUDA-graph capturable). :func:`direct_plan`: no
  alignment at all for tiny batches (one slot per row block).
- :func:`gate_up` / :func:`down` / :func:`topk_sum` (``gemm``): the grouped GEMMs (3-D TMA weights, gathered
  token rows, fused act(gate) * up, routed-weight multiply and top-k reduction).
- :func:`moe_backward` (``backward``): the gradients of hidden, w13, w2 and topk_weights on the same plan
  (dY GEMM with the activation backward fused, d_hidden, per-expert weight-gradient GEMMs); no host sync.
- :func:`fused_moe` (``fused``): all of the above with validation and launch configs (``configs``), through
  the ``hopperkern::moe_forward`` / ``hopperkern::moe_backward`` custom ops (``ops``): differentiable, and
  traceable by ``torch.compile(fullgraph=True)``.
- :class:`MoEBlock` (``modules``): router + experts as an ``nn.Module`` (parameters ``gate.weight``, ``w13``,
  ``w2``), with loaders for the per-expert weights of Mixtral, Qwen3-MoE and DeepSeek-V3 checkpoints.
- :mod:`hopperkern.moe.reference`: plain-PyTorch reference with the same signature.
"""

from ..tma import _triton  # noqa: F401 - first: a clear ImportError when triton cannot load
from .align import AlignPlan, direct_plan, max_blocks_for, moe_align, prefer_direct
from .backward import moe_backward
from .configs import PDL_MAX_TOKENS, heuristic_config, moe_launch_config
from .fused import check_expert_ids, fused_moe
from .gemm import ACTIVATIONS, down, gate_up, topk_sum
from .modules import LAYOUTS, MoEBlock
from .routing import SCORINGS, route

__all__ = [
    "ACTIVATIONS",
    "PDL_MAX_TOKENS",
    "LAYOUTS",
    "SCORINGS",
    "AlignPlan",
    "MoEBlock",
    "check_expert_ids",
    "direct_plan",
    "down",
    "fused_moe",
    "gate_up",
    "heuristic_config",
    "max_blocks_for",
    "moe_align",
    "moe_backward",
    "moe_launch_config",
    "prefer_direct",
    "route",
    "topk_sum",
]
