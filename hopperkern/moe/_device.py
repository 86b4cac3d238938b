"""Launch-device guard shared by the public MoE ops."""

from __future__ import annotations

import contextlib

import torch


def on_device(t: torch.Tensor):
    """``torch.cuda.device(t.device)`` for a CUDA tensor (Triton launches on the current device, so a caller on
    another GPU would otherwise launch there), a no-op context otherwise (the interpreter's CPU tensors)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
