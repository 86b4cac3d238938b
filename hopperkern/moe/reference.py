"""Plain-PyTorch reference of :func:`hopperkern.moe.fused_moe` (tests, CPU fallback): a loop over experts.

Same signature as the fused op plus ``compute_dtype``; the result is returned in ``compute_dtype`` (float64 by
default) so tests can measure the kernel's error against it. With ``compute_dtype=hidden.dtype`` it is "plain
torch in the same dtype", the baseline that test tolerances are relative to.
"""

from __future__ import annotations

import math

import torch

__all__ = ["apply_activation", "fused_moe"]


def apply_activation(g: torch.Tensor, name: str) -> torch.Tensor:
    """silu or gelu (tanh approximation) in g's dtype."""
    if name == "silu":
        return g * torch.sigmoid(g)
    if name == "gelu_tanh":
        return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g)))
    raise ValueError(f"activation must be one of ('silu', 'gelu_tanh'), got {name!r}")


def fused_moe(hidden, w13, w2, topk_weights, topk_ids, *, activation="silu", tma="auto", check_ids=True,
              deterministic=False, config=None, compute_dtype=torch.float64) -> torch.Tensor:
    """``out[t] = sum_j topk_weights[t,j] * (act(x W_gate[e]^T) * (x W_up[e]^T)) W2[e]^T``, e = topk_ids[t,j],
    computed expert by expert in ``compute_dtype``; ids of -1 are skipped. ``tma``, ``check_ids``,
    ``deterministic`` and ``config`` are accepted for signature parity and ignored. Returns [T, H] in
    ``compute_dtype``."""
    del tma, check_ids, deterministic, config
    T, H = hidden.shape
    E, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    x = hidden.to(compute_dtype)
    out = torch.zeros((T, H), dtype=compute_dtype, device=hidden.device)
    ids = topk_ids.long()
    w = topk_weights.to(compute_dtype)
    for e in range(E):
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        w13e = w13[e].to(compute_dtype)
        xe = x[tok]
        h = apply_activation(xe @ w13e[:I].T, activation) * (xe @ w13e[I:].T)
        y = (h @ w2[e].to(compute_dtype).T) * w[tok, j][:, None]
        out.index_add_(0, tok, y)
    return out
