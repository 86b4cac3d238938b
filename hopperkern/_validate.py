"""Input validation shared by every public op. One wording: ``"{name} must be {expected}, got {actual}"``.

These run on the host before any launch and use real exceptions (``assert`` vanishes under ``python -O``).
"""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def dot_precision(dtype) -> str:
    """``input_precision`` of the kernels' ``tl.dot``: fp32 inputs get true fp32 products ("ieee", not tf32);
    16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def check_dtype(name: str, t: torch.Tensor, allowed) -> None:
    check_tensor(name, t)
    if t.dtype not in allowed:
        raise TypeError(f"{name} must be {_names(allowed)}, got {str(t.dtype).replace('torch.', '')}")


def check_same_dtype(name: str, t: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(
            f"{name} must be {str(ref.dtype).replace('torch.', '')} (the dtype of {ref_name}), "
            f"got {str(t.dtype).replace('torch.', '')}"
        )


def check_ndim(name: str, t: torch.Tensor, ndim: int) -> None:
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")


def check_same_device(tensors: dict) -> None:
    devs = {k: v.device for k, v in tensors.items() if v is not None}
    if len(set(devs.values())) > 1:
        listing = ", ".join(f"{k} on {d}" for k, d in devs.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def check_float(name: str, value, *, low=None, high=None, low_open=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    v = float(value)
    if v != v:
        raise ValueError(f"{name} must not be NaN")
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return v


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value
