"""Capability detection: the one place that asks which GPU, which Triton, and whether TMA can run.

Everything here is lazy and cached. Nothing touches CUDA or reads the environment at import time, and
``capability()`` never raises: a probe that fails becomes a reason in ``Capability.reasons``.

Triton's CPU interpreter gets its own answers, which every launch checks through :func:`launch_context`:
:func:`interpreter_problems` (set after triton's import, numpy missing or too new) and
:func:`interpreter_dtype_problems` (a probe kernel per 16-bit dtype: bf16 comes out wrong, triton#11584).

Device facts beyond the current GPU: :func:`gpu_model`, :func:`known_compute_capability` and
:func:`closest_devices` (which tuning file serves a GPU that has none of its own), and the driver and runtime
versions for bug reports (:func:`nvidia_driver_version`, :func:`cuda_runtime_version`; these raise where there is
no GPU, and ``python -m hopperkern.info`` turns that into "could not collect").
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import re
from dataclasses import dataclass

from ..errors import UnsupportedError

__all__ = [
    "Capability",
    "UnsupportedError",
    "capability",
    "check_interpreter",
    "closest_devices",
    "cuda_runtime_version",
    "device_key",
    "gpu_model",
    "interpreter_active",
    "interpreter_dtype_problems",
    "interpreter_problems",
    "known_compute_capability",
    "known_sm_count",
    "launch_context",
    "nvidia_driver_version",
    "ptx_approx_math",
    "require_triton",
    "torch_mm_out_dtype",
]


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
    # Programmatic dependent launch (a kernel of a plan starts while the one before it drains, and waits on the
    # device before reading what that one wrote): sm_90 or newer, compiled (not interpreted), a CUDA (not ROCm)
    # build of torch from CUDA 12.3, a Triton with the launch_pdl option and griddepcontrol
    # (tl.extra.cuda.gdc_wait).
    pdl: bool = False
    # Tensor-core products through sm_90's wgmma (an NVIDIA Hopper GPU, CUDA build of torch, compiled kernels): an
    # entry of a product depends on its own row and column and the K order only, not on the tile's width, which
    # hopperkern.lce's label-logit kernel relies on to match the forward's tiles bit for bit (checked on the H200).
    hopper_mma: bool = False

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


# Device facts for choosing a tuning file when a GPU has none of its own. Files are named after their device
# (normalize_device_name), so the model in a file's name tells its architecture without reading it. Models:
# the token of the device name torch reports ("NVIDIA H100 80GB HBM3" -> H100, "NVIDIA GH200 480GB" -> GH200).
_MODEL_ARCH = {
    "H100": (9, 0), "H800": (9, 0), "H200": (9, 0), "GH200": (9, 0), "H20": (9, 0),
    "A100": (8, 0), "A800": (8, 0), "A30": (8, 0), "A10": (8, 6), "A40": (8, 6), "A6000": (8, 6),
    "L4": (8, 9), "L20": (8, 9), "L40": (8, 9), "L40S": (8, 9),
    "B100": (10, 0), "B200": (10, 0), "GB200": (10, 0), "B300": (10, 3), "GB300": (10, 3),
}
# For a Hopper GPU without a file: the models whose files come closest, best first. H800 is the H100 chip with
# less NVLink bandwidth; GH200 and H200 carry the same chip with more, faster memory (HBM3e); H20 has 78 SMs
# and HBM3 at 4.0 TB/s, nearer the H200's bandwidth per SM than the H100's.
_CLOSEST_MODELS = {
    "H100": ("H100", "H800", "GH200", "H200", "H20"),
    "H800": ("H800", "H100", "GH200", "H200", "H20"),
    "H200": ("H200", "GH200", "H100", "H800", "H20"),
    "GH200": ("GH200", "H200", "H100", "H800", "H20"),
    "H20": ("H20", "H200", "GH200", "H100", "H800"),
}
_SM_COUNTS = {"H100": 132, "H800": 132, "H200": 132, "GH200": 132, "H20": 78}  # PCIe H100/H800 cards: 114


def gpu_model(name: str) -> str | None:
    """The GPU model in a device name or tuning-file name: ``"NVIDIA H100 PCIe"`` -> ``"H100"``,
    ``"NVIDIA_GH200_480GB"`` -> ``"GH200"``; None for a model this table does not know."""
    for token in re.split(r"[^0-9A-Za-z]+", name.upper()):
        if token in _MODEL_ARCH:
            return token
    return None


def known_compute_capability(name: str) -> tuple[int, int] | None:
    """(major, minor) of the GPU model named in ``name`` (a device name or file name), or None when unknown."""
    return _MODEL_ARCH.get(gpu_model(name) or "")


def known_sm_count(name: str) -> int | None:
    """SM count of the Hopper variant named in ``name`` (PCIe H100/H800 cards: 114), or None when unknown."""
    model = gpu_model(name)
    if model in ("H100", "H800") and "PCIE" in name.upper():
        return 114
    return _SM_COUNTS.get(model or "")


def closest_devices(name: str, candidates, *, compute_capability: tuple[int, int] | None = None,
                    sm_count: int | None = None) -> list[str]:
    """The ``candidates`` (device names or tuning-file names) of the same architecture as the GPU ``name``,
    closest first; the others, and any whose model is unknown, are left out.

    ``compute_capability`` and ``sm_count`` describe ``name`` (the current GPU's, from :func:`capability`);
    without them the model table answers. Closest: the same model (an H100 PCIe for an H100 SXM), then the
    models of ``_CLOSEST_MODELS`` in order (an H100 without H100 or H800 files takes a GH200's, then an
    H200's), then the nearest SM count, then the name, so the choice never depends on the order of a folder."""
    cc = compute_capability or known_compute_capability(name)
    if cc is None:
        return []
    own = normalize_device_name(name)
    prefs = _CLOSEST_MODELS.get(gpu_model(name) or "", ())
    sms = sm_count or known_sm_count(name)
    ranked = []
    for cand in candidates:
        if normalize_device_name(cand) == own or known_compute_capability(cand) != tuple(cc):
            continue
        model = gpu_model(cand)
        other = known_sm_count(cand)
        ranked.append((prefs.index(model) if model in prefs else len(prefs),
                       abs(other - sms) if other and sms else 0, cand))
    return [cand for *_, cand in sorted(ranked)]


def interpreter_active() -> bool:
    """True when Triton's CPU interpreter is switched on (``TRITON_INTERPRET=1``). Whether it can run kernels
    in this process is :func:`interpreter_problems`' answer."""
    try:
        import triton

        return bool(triton.knobs.runtime.interpret)
    except Exception:  # older triton without knobs, or triton missing
        return _interpret_env()


def _interpret_env() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def _numbers(version: str) -> tuple[int, ...]:
    """``"3.6.0"`` -> (3, 6, 0); ``"2.4.0rc1"`` -> (2, 4, 0): the leading numeric parts."""
    out = []
    for part in version.split("."):
        digits = "".join(itertools.takewhile(str.isdigit, part))
        if not digits:
            break
        out.append(int(digits))
    return tuple(out)


_NUMPY_MISSING = ("Triton's CPU interpreter (TRITON_INTERPRET=1) needs numpy, which triton does not install: "
                  "pip install numpy")


def _numpy_version() -> str | None:
    """numpy's version, or None when numpy cannot be imported."""
    try:
        import numpy

        return str(numpy.__version__)
    except Exception:
        return None


def _explain_triton_import_error(exc: BaseException) -> str:
    """What to do when ``import triton`` raised ``exc``."""
    if _interpret_env() and _numpy_version() is None:
        return f"triton cannot be imported: {_NUMPY_MISSING}"
    return f"triton cannot be imported ({type(exc).__name__}: {exc}); hopperkern needs triton >= 3.6"


def require_triton():
    """``import triton``; when that fails, an ImportError that says why and what to do instead of triton's own
    (with ``TRITON_INTERPRET=1`` and no numpy, triton fails inside its interpreter's ``import numpy``).
    Modules that import triton run it first, through ``hopperkern.tma._triton``."""
    try:
        import triton
    except ImportError as exc:
        raise ImportError(f"{_explain_triton_import_error(exc)}\nsee: python -m hopperkern.info") from exc
    return triton


def _triton_version() -> str | None:
    try:
        import triton

        return str(triton.__version__)
    except Exception:
        return None


def _triton_import_problem() -> str | None:
    """Why ``import triton`` fails here (a sentence that says what to do), or None when it works."""
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return _explain_triton_import_error(exc)
    return None


@functools.lru_cache(maxsize=None)
def _triton_imported_for_interpreter() -> bool:
    """Whether triton's own ``@triton.jit`` helpers (``triton.language.standard``) were built for the
    interpreter, i.e. ``TRITON_INTERPRET=1`` was set when triton was imported. Fixed once triton is imported."""
    import triton.language.standard as std
    from triton.runtime.jit import JITFunction

    return not any(isinstance(v, JITFunction) for v in vars(std).values())


def interpreter_problems() -> tuple[str, ...]:
    """Why Triton's interpreter, once switched on, cannot run hopperkern's kernels in this process: sentences
    that say what to do, or () when it can (or when it is off). Cheap after the first call; never raises."""
    if not interpreter_active():
        return ()
    reasons = []
    numpy_version = _numpy_version()
    if numpy_version is None:
        reasons.append(_NUMPY_MISSING)
    tv = _triton_version()
    if tv is None:
        return tuple(reasons) or (_triton_import_problem() or "triton cannot be imported",)
    try:
        late = not _triton_imported_for_interpreter()
    except Exception as exc:  # triton's layout changed: say so rather than guess
        reasons.append(f"could not tell whether triton was imported with the interpreter on: {exc}")
        late = False
    if late:
        reasons.append("TRITON_INTERPRET=1 was set after triton was imported, so triton's own jit functions were built "
                       "for a GPU and every kernel fails: set it in the environment before the first import of triton "
                       "or hopperkern (`TRITON_INTERPRET=1 python ...`, or os.environ in the program's first lines)")
    if numpy_version is not None and _numbers(tv) < (3, 7) and _numbers(numpy_version) >= (2, 4):
        reasons.append(f"triton {tv}'s interpreter fails with numpy {numpy_version} (every range() over a runtime "
                       "value raises): pip install 'numpy<2.4', or triton >= 3.7")
    return tuple(reasons)


def _has_tensor_descriptors() -> bool:
    try:
        import triton.language as tl
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401

        return hasattr(tl, "make_tensor_descriptor")
    except Exception:
        return False


def _cuda_at_least(version: tuple[int, int]) -> bool:
    """torch is a CUDA build (not ROCm) of at least ``version``: PDL edges inside CUDA-graph capture need 12.3."""
    try:
        import torch

        cuda = getattr(torch.version, "cuda", None)
        return getattr(torch.version, "hip", None) is None and cuda is not None and _numbers(cuda)[:2] >= version
    except Exception:
        return False


def _has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

        return "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:
        return False


def interpreter_dtype_problems(dtype) -> tuple[str, ...]:
    """Why Triton's interpreter computes kernels on ``dtype`` (a torch dtype) inputs wrongly in this process, or
    () when it computes them right, when the interpreter is off (a GPU does) or for dtypes other than fp16/bf16.

    The answer comes from running what the kernels do with 16-bit inputs (a ``tl.dot`` with fp32 accumulation,
    a cast of fp32 values to ``dtype``) on a 16 x 16 probe once per dtype (a few ms, cached) and comparing with
    PyTorch, so it reports what this interpreter really does, patched or not. Never raises."""
    import torch

    if dtype not in (torch.float16, torch.bfloat16) or not interpreter_active():
        return ()
    return _probe_interpreter_dtype(dtype)


_PROBE_N = 16


@functools.lru_cache(maxsize=None)
def _dot_cast_probe_kernel():
    """The probe kernel, defined at first use: @triton.jit must run after TRITON_INTERPRET is settled."""
    import triton
    import triton.language as tl

    @triton.jit
    def dot_cast_probe(a_ptr, b_ptr, c_ptr, x_ptr, y_ptr, N: tl.constexpr):
        """c = a @ b ([N, N], fp32 accumulation) and y = x.to(y's dtype) ([N * N] fp32 x); one program."""
        offs = tl.arange(0, N)[:, None] * N + tl.arange(0, N)[None, :]
        tl.store(c_ptr + offs, tl.dot(tl.load(a_ptr + offs), tl.load(b_ptr + offs)))
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(y_ptr.dtype.element_ty))

    return dot_cast_probe


@functools.lru_cache(maxsize=None)
def _probe_interpreter_dtype(dtype) -> tuple[str, ...]:
    import torch

    name = str(dtype).replace("torch.", "")
    n = _PROBE_N
    try:
        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randn(n, n, generator=gen).to(dtype) for _ in range(2))
        x = torch.randn(n * n, generator=gen)
        c = torch.empty(n, n)
        y = torch.empty(n * n, dtype=dtype)
        _dot_cast_probe_kernel()[(1,)](a, b, c, x, y, N=n)
    except Exception as exc:
        return (f"a {name} probe kernel failed under Triton's interpreter: {type(exc).__name__}: {exc}",)
    reasons = []
    want = a.double() @ b.double()  # products of 16-bit floats are exact in fp32; only the sum rounds
    err = float((c.double() - want).abs().max())
    scale = float(want.abs().max())
    if not err <= 1e-5 * scale:
        upstream = " (it multiplies the raw bit patterns, triton#11584)" if dtype == torch.bfloat16 else ""
        reasons.append(f"Triton's interpreter computes {name} tl.dot wrongly{upstream}: a {n}x{n}x{n} probe product "
                       f"is off by {err:.3g}, its largest entry being {scale:.3g}")
    bad = int((y.view(torch.int16) != x.to(dtype).view(torch.int16)).sum())
    if bad:
        reasons.append(f"Triton's interpreter casts float32 to {name} wrongly: {bad} of {n * n} probe values differ "
                       "from round-to-nearest-even (a truncating cast)")
    return tuple(reasons)


def nvidia_driver_version() -> str:
    """The NVIDIA kernel driver's version (``"550.54.15"``), from ``/proc/driver/nvidia/version`` or else
    ``nvidia-smi``. Raises RuntimeError when there is no CUDA GPU or neither source answers."""
    if not _cuda_available():
        raise RuntimeError("no CUDA GPU is available")
    found = re.search(r"Kernel Module(?:\s+for\s+\S+)?\s+(\d+\.\d+(?:\.\d+)?)", _proc_driver_text())
    if found:
        return found.group(1)
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"no /proc/driver/nvidia/version and nvidia-smi failed: {exc}") from exc
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"no /proc/driver/nvidia/version and nvidia-smi exited with {out.returncode}")
    return out.stdout.splitlines()[0].strip()


def cuda_runtime_version() -> str:
    """The CUDA runtime this process uses (``"12.8"``): ``cudaRuntimeGetVersion`` of the ``libcudart`` it loaded,
    else the version torch was built with, said so. Raises RuntimeError when there is no CUDA GPU."""
    if not _cuda_available():
        raise RuntimeError("no CUDA GPU is available")
    import torch

    torch.cuda.init()  # loads the runtime, so it shows in the process's mapped libraries
    try:
        with open("/proc/self/maps") as maps:
            libs = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        libs = []
    if libs:
        import ctypes

        version = ctypes.c_int(0)
        if ctypes.CDLL(libs[0]).cudaRuntimeGetVersion(ctypes.byref(version)) == 0 and version.value:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    return f"{torch.version.cuda} (the CUDA version torch was built with)"


def _proc_driver_text() -> str:
    try:
        with open("/proc/driver/nvidia/version") as f:
            return f.read()
    except OSError:
        return ""


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
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
        reasons.append(_triton_import_problem() or "triton cannot be imported")
    descriptors = _has_tensor_descriptors()
    if not descriptors and tv is not None:
        reasons.append(f"triton {tv} has no tensor-descriptor API (tl.make_tensor_descriptor); "
                       "hopperkern needs triton >= 3.6")

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
    pdl = bool(not interpreter and cuda and cc is not None and cc >= (9, 0) and tv is not None and _has_pdl()
               and _cuda_at_least((12, 3)))
    hopper_mma = bool(not interpreter and cuda and cc is not None and cc[0] == 9 and _cuda_at_least((12, 0)))
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
        pdl=pdl,
        hopper_mma=hopper_mma,
    )


_NO_GUARD = contextlib.nullcontext()


def launch_context(t, op: str):
    """Where ``op`` launches for tensor ``t``: a ``torch.cuda.device`` guard for ``t``'s GPU (Triton launches
    on the current device and stream), a no-op context under the interpreter, and :class:`UnsupportedError`
    when ``t`` is on a device hopperkern cannot run on (e.g. CPU tensors with the interpreter off), or when the
    interpreter cannot run ``op`` right for ``t``'s dtype (:func:`check_interpreter`). Launchers pass the
    tensor whose dtype their kernels compute in."""
    interpreting = interpreter_active()
    if interpreting:  # the interpreter runs the kernels on the host, for CUDA tensors too
        check_interpreter(t.dtype, op)
    if getattr(t, "is_cuda", False):
        import torch

        if t.get_device() == torch._C._cuda_getDevice():
            return _NO_GUARD  # already the current device: no guard to enter and leave
        return torch.cuda.device(t.device)
    if interpreting:
        return _NO_GUARD
    raise UnsupportedError(f"{op} cannot run on {t.device} tensors", [
        f"the inputs are on {t.device}: hopperkern's kernels need a CUDA GPU, or Triton's CPU interpreter "
        "(TRITON_INTERPRET=1 set before triton is imported)",
        "the plain-PyTorch references in hopperkern.lce.reference / hopperkern.moe.reference run anywhere",
    ])


def check_interpreter(dtype, op: str) -> None:
    """Raise :class:`UnsupportedError` when Triton's interpreter cannot run ``op`` right here: it cannot start
    (:func:`interpreter_problems`), or it computes ``dtype`` inputs wrongly (:func:`interpreter_dtype_problems`).
    Returns None otherwise, and whenever the interpreter is off."""
    problems = interpreter_problems()
    if problems:
        raise UnsupportedError(f"{op} cannot run under Triton's CPU interpreter in this process", problems)
    problems = interpreter_dtype_problems(dtype)
    if problems:
        import torch

        name = str(dtype).replace("torch.", "")
        right = [str(d).replace("torch.", "") for d in (torch.float32, torch.float16, torch.bfloat16)
                 if d != dtype and not interpreter_dtype_problems(d)]
        raise UnsupportedError(f"{op} cannot run {name} inputs under Triton's CPU interpreter", [
            *problems,
            f"under the interpreter use {' or '.join(right)} inputs and no torch.autocast to {name} (it casts the "
            f"inputs to {name}); or run on a CUDA GPU without TRITON_INTERPRET; or call the plain-PyTorch references "
            "hopperkern.lce.reference / hopperkern.moe.reference, which run anywhere",
        ])


def ptx_approx_math() -> bool:
    """Whether kernels may use PTX's approximate transcendental instructions through inline assembly
    (:func:`hopperkern.tma.jit.log_approx`): true on NVIDIA GPUs, false under Triton's CPU interpreter (which runs
    no inline assembly) and on ROCm builds of torch. Launchers pass it as the kernels' ``APPROX_MATH`` constexpr,
    so the interpreter runs the same body with ``tl.log``."""
    if interpreter_active():
        return False
    import torch

    return getattr(torch.version, "hip", None) is None


def torch_mm_out_dtype(device=None, dtype=None) -> bool:
    """Whether ``torch.addmm(c, a, b, out_dtype=torch.float32, out=c)`` works for ``a``, ``b`` of ``dtype``
    (default bf16) and an fp32 ``c`` on ``device`` (cuBLAS: fp32 accumulation written to an fp32 C).

    Probed once per (device, dtype) with 2 x 2 tensors at first use (never at import), never raises. A
    meta-tensor probe is not enough: torch 2.11 has the CUDA kernel but no meta kernel for this overload, and
    taking that for "unsupported" sends the LCE backward to an fp32-copy fallback 4x slower (measured on the
    H200). While the current stream is being captured into a CUDA graph the probe cannot run
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
