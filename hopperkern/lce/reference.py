"""Plain-PyTorch references of the LCE contract (tests, and a CPU fallback). They hold the N x V logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def final_logits(z, bias=None, softcap=None, temperature=1.0):
    """The final logits from the raw ``z = hidden @ weight.T``: + bias, softcap * tanh(z / softcap), / temperature."""
    if bias is not None:
        z = z + bias.to(z.dtype)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z / temperature


def reference_logits(hidden, weight, bias=None, softcap=None, temperature=1.0, dtype=torch.float64):
    return final_logits(hidden.to(dtype) @ weight.to(dtype).T, bias, softcap, temperature)


def linear_cross_entropy(hidden, weight, labels, *, bias=None, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, temperature=1.0, dtype=torch.float64):
    """F.cross_entropy on the full logits (+ z_loss * logsumexp^2 on kept tokens), computed in ``dtype``."""
    z = reference_logits(hidden.reshape(-1, hidden.shape[-1]), weight, bias, softcap, temperature, dtype)
    lab = labels.reshape(-1).long()
    loss = F.cross_entropy(z, lab, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    kept = lab != ignore_index
    if z_loss:
        loss = loss + z_loss * torch.where(kept, torch.logsumexp(z, -1) ** 2, 0.0)
    if reduction == "none":
        return loss.view(labels.shape).float()
    if reduction == "sum":
        return loss.sum().float()
    return (loss.sum() / kept.sum().clamp(min=1)).float()


def linear_logprobs_entropy(hidden, weight, labels, *, temperature=1.0, ignore_index=-100, dtype=torch.float64):
    """(log-prob of the label, 0 at ignored tokens; entropy of softmax(z)) in ``dtype``, returned as fp32."""
    z = reference_logits(hidden.reshape(-1, hidden.shape[-1]), weight, None, None, temperature, dtype)
    lab = labels.reshape(-1).long()
    logp = torch.log_softmax(z, -1)
    kept = lab != ignore_index
    lp = torch.where(kept, logp.gather(1, lab.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
    ent = -(logp.exp() * logp).sum(-1)
    return lp.view(labels.shape).float(), ent.view(labels.shape).float()
