"""Capability detection: the one place that asks which GPU, which Triton, and whether TMA can run.

Everything here is lazy and cached. Nothing touches CUDA or reads the environment at import time, and
``capability()`` never raises: a probe that fails becomes a reason in ``Capability.reasons``.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

__all__ = [
    "Capability",
    "UnsupportedError",
    "capability",
    "device_key",
    "interpreter_active",
    "launch_context",
    "torch_mm_out_dtype",
]


class UnsupportedError(NotImplementedError):
    """The inputs are valid, but this machine or this operand cannot run the requested path.

    The message lists every reason and ends with a pointer to ``python -m hopperkern.info``.
    """

    def __init__(self, what: str, reasons: list[str] | tuple[str, ...]):
        self.what = what
        self.reasons = tuple(reasons)
        lines = "\n".join(f"  - {r}" for r in self.reasons) or "  - (no reason recorded)"
        super().__init__(f"{what}:\n{lines}\nsee: python -m hopperkern.info")


@dataclass(frozen=True)
class Capability:
    """What this process can run. ``tma`` is True when the TMA (tensor-descriptor) path can be used at all;
    individual operands may still be ineligible (see ``tma_not_supported_reasons``)."""

    cuda_available: bool
    interpreter: bool
    device_name: str | None
    compute_capability: tuple[int, int] | None
    sm_count: int | None
    triton_version: str | None
    tensor_descriptors: bool
    tma: bool
    reasons: tuple[str, ...]

    @property
    def config_name(self) -> str | None:
        """File stem of this device's tuning file, e.g. ``NVIDIA_H200``."""
        return normalize_device_name(self.device_name) if self.device_name and not self.interpreter else None


def normalize_device_name(name: str) -> str:
    """``'NVIDIA H200'`` -> ``'NVIDIA_H200'``: letters, digits, ``-`` and ``_`` only."""
    out = []
    for ch in name.strip():
        out.append(ch if (ch.isalnum() or ch in "-_") else "_")
    stem = "".join(out)
    while "__" in stem:
        stem = stem.replace("__", "_")
    return stem.strip("_")


def interpreter_active() -> bool:
    """True when Triton's CPU interpreter is on (``TRITON_INTERPRET=1`` set before triton was imported)."""
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except Exception:  # older triton without knobs, or triton missing
        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except Exception:
        return None


def _has_tensor_descriptors() -> bool:
    try:
        import triton.language as tl
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

        return hasattr(tl, "make_tensor_descriptor")
    except Exception:
        return False


def device_key(device=None) -> int | None:
    """CUDA device index for ``device`` (None = current), or None when CUDA is unusable."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        if device is None:
            return torch.cuda.current_device()
        dev = torch.device(device)
        if dev.type != "cuda":
            return None
        return dev.index if dev.index is not None else torch.cuda.current_device()
    except Exception:
        return None


def capability(device=None) -> Capability:
    """Describe what can run on ``device`` (None = current CUDA device, a CPU tensor device under the
    interpreter). Cached per (device, interpreter) and never raises."""
    return _capability(device_key(device), interpreter_active())


@functools.lru_cache(maxsize=None)
def _capability(index: int | None, interpreter: bool) -> Capability:
    reasons: list[str] = []
    tv = _triton_version()
    if tv is None:
        reasons.append("triton is not importable")
    descriptors = _has_tensor_descriptors()
    if not descriptors:
        reasons.append(f"triton {tv} has no tensor-descriptor API (tl.make_tensor_descriptor); need triton >= 3.4")

    cuda = False
    name = None
    cc = None
    sms = None
    try:
        import torch

        cuda = bool(torch.cuda.is_available())
    except Exception as exc:  # pragma: no cover - torch missing or broken
        reasons.append(f"could not query CUDA: {exc}")
    if cuda and index is not None:
        try:
            import torch

            props = torch.cuda.get_device_properties(index)
            name = str(props.name)
            cc = (int(props.major), int(props.minor))
            sms = int(props.multi_processor_count)
        except Exception as exc:
            reasons.append(f"could not read the properties of cuda:{index}: {exc}")

    if cuda and index is None:
        reasons.append("the device is not a CUDA device")
    if interpreter:
        # The interpreter runs both memory paths on the CPU, so CI can test the TMA path.
        tma = descriptors
    else:
        if not cuda:
            reasons.append("no CUDA GPU is available (and Triton's interpreter is off)")
        elif cc is not None and cc < (9, 0):
            reasons.append(f"compute capability {cc[0]}.{cc[1]} < 9.0: TMA needs Hopper (sm_90) or newer")
        tma = bool(descriptors and cuda and cc is not None and cc >= (9, 0))
    if tma:
        reasons = []
    return Capability(
        cuda_available=cuda,
        interpreter=interpreter,
        device_name=name,
        compute_capability=cc,
        sm_count=sms,
        triton_version=tv,
        tensor_descriptors=descriptors,
        tma=tma,
        reasons=tuple(reasons),
    )


def launch_context(t, op: str):
    """Where ``op`` launches for tensor ``t``: a ``torch.cuda.device`` guard for ``t``'s GPU (Triton launches
    on the current device and stream), a no-op context under the interpreter, and :class:`UnsupportedError`
    when ``t`` is on a device hopperkern cannot run on (e.g. CPU tensors with the interpreter off)."""
    import contextlib

    if getattr(t, "is_cuda", False):
        import torch

        return torch.cuda.device(t.device)
    if interpreter_active():
        return contextlib.nullcontext()
    raise UnsupportedError(f"{op} cannot run on {t.device} tensors", [
        f"the inputs are on {t.device}: hopperkern's kernels need a CUDA GPU, or Triton's CPU interpreter "
        "(TRITON_INTERPRET=1 set before triton is imported)",
        "the plain-PyTorch references in hopperkern.lce.reference / hopperkern.moe.reference run anywhere",
    ])


def torch_mm_out_dtype(device=None, dtype=None) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` works for ``a``, ``b`` of ``dtype``
    (default bf16) and an fp32 ``c`` on ``device`` (cuBLAS: fp32 accumulation written to an fp32 C).

    Probed once per (device, dtype) with 2 x 2 tensors at first use (never at import), never raises. A
    meta-tensor probe is not enough: torch 2.11 has the CUDA kernel but no meta kernel for this overload, and
    taking that for "unsupported" sent the LCE backward to an fp32-copy fallback 4x slower (measured on the
    H200 in session 6). While the current stream is being captured into a CUDA graph the probe cannot run
    (it synchronises): the answer then comes from the operator's registered overloads and is not cached."""
    import torch

    dtype = dtype or torch.bfloat16
    index = device_key(device)
    dev = torch.device("cuda", index) if index is not None else torch.device(device or "cpu")
    key = (str(dev), dtype)
    if key not in _MM_OUT_DTYPE:
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return hasattr(torch.ops.aten.addmm, "dtype_out")
        _MM_OUT_DTYPE[key] = _probe_mm_out_dtype(dev, dtype)
    return _MM_OUT_DTYPE[key]


_MM_OUT_DTYPE: dict = {}


def _probe_mm_out_dtype(device, dtype) -> bool:
    try:
        import torch

        c = torch.zeros(2, 2, device=device)
        a = torch.ones(2, 2, device=device, dtype=dtype)
        out = torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
        return out.dtype == torch.float32 and bool((out == 2).all())
    except Exception:
        return False
