"""Top-k routing: router logits -> (topk_weights float32 [T, k], topk_ids int32 [T, k]).

Plain PyTorch on the logits' device (tiny next to the expert GEMMs); no host synchronisation, so it can be
captured in a CUDA graph. Ties are broken deterministically: **the lower expert (or group) index wins**, on
every device (a stable descending sort instead of ``torch.topk``, whose tie order is unspecified).
"""

from __future__ import annotations

import torch

from .._validate import FLOAT_DTYPES, check_bool, check_choice, check_dtype, check_float, check_ndim

__all__ = ["SCORINGS", "route"]

SCORINGS = ("softmax", "sigmoid")


def _topk_indices(x: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries along the last dim, ties to the lower index, best first."""
    return torch.sort(x, dim=-1, descending=True, stable=True).indices[..., :k]


def _check_int(name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
    return value


def route(router_logits: torch.Tensor, top_k: int, *, scoring: str = "softmax", renormalize: bool = True,
          num_groups: int | None = None, topk_groups: int | None = None,
          correction_bias: torch.Tensor | None = None, scale: float = 1.0):
    """Pick ``top_k`` experts per token.

    router_logits [T, E] (fp16/bf16/fp32; math in fp32). Returns ``(topk_weights, topk_ids)``: float32 and
    int32 [T, top_k], best expert first. In plain PyTorch::

        s = logits.float().softmax(-1)            # scoring="softmax"
        s = logits.float().sigmoid()              # scoring="sigmoid"
        c = s + correction_bias                   # selection score (c = s without a bias)
        if num_groups:                            # group-limited routing (DeepSeek-V2/V3)
            g = c.view(T, num_groups, -1)
            gs = g.topk(2, -1).values.sum(-1) if correction_bias is not None else g.amax(-1)
            keep the topk_groups best groups; c = -inf on the experts of the other groups
        ids = c.topk(top_k).indices               # ties: lower expert index wins
        w = s.gather(-1, ids)                     # weights from the score, not from score + bias
        if renormalize: w = w / w.sum(-1, keepdim=True)
        w = w * scale

    DeepSeek-V3 is ``scoring="sigmoid", num_groups=8, topk_groups=4, correction_bias=b, scale=2.5``. A group
    of one expert scores with that expert alone. ``topk_groups`` defaults to ``num_groups`` (no limit).
    """
    check_dtype("router_logits", router_logits, FLOAT_DTYPES)
    check_ndim("router_logits", router_logits, 2)
    check_choice("scoring", scoring, SCORINGS)
    T, E = router_logits.shape
    _check_int("top_k", top_k, 1)
    if top_k > E:
        raise ValueError(f"top_k must be <= the number of experts ({E}), got {top_k}")
    check_bool("renormalize", renormalize)
    scale = check_float("scale", scale, finite=True)
    groups = 1 if num_groups is None else _check_int("num_groups", num_groups, 1)
    if E % groups:
        raise ValueError(f"num_groups must divide the number of experts ({E}), got {groups}")
    if topk_groups is not None and num_groups is None:
        raise ValueError("topk_groups needs num_groups, got num_groups=None")
    keep = groups if topk_groups is None else _check_int("topk_groups", topk_groups, 1, groups)
    per_group = E // groups
    if top_k > keep * per_group:
        raise ValueError(f"top_k must be <= topk_groups * experts per group ({keep} * {per_group}), got {top_k}")
    if correction_bias is not None:
        check_dtype("correction_bias", correction_bias, FLOAT_DTYPES)
        if tuple(correction_bias.shape) != (E,):
            raise ValueError(f"correction_bias must have shape ({E},), got {tuple(correction_bias.shape)}")
        if correction_bias.device != router_logits.device:
            raise ValueError(f"correction_bias must be on {router_logits.device}, got {correction_bias.device}")

    x = router_logits.float()
    scores = x.softmax(dim=-1) if scoring == "softmax" else x.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if keep < groups:
        g = choice.view(T, groups, per_group)
        if correction_bias is not None and per_group >= 2:
            group_score = torch.sort(g, dim=-1, descending=True).values[..., :2].sum(-1)
        else:
            group_score = g.amax(dim=-1)
        kept = torch.zeros((T, groups), dtype=torch.bool, device=x.device)
        kept.scatter_(1, _topk_indices(group_score, keep), True)
        choice = choice.masked_fill(~kept.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = _topk_indices(choice, top_k)
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny)
    if scale != 1.0:
        weights = weights * scale
    return weights, ids.to(torch.int32)
