"""Test set-up: on a machine without a CUDA GPU the kernels run under Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is imported, so this runs first (pytest imports conftest.py
before any test module). ``DEVICE`` is where tests put their tensors.

Under the interpreter, ``tl.dot`` on bfloat16 multiplies the raw 16-bit patterns (bf16 is stored as uint16 in
numpy; upstream triton#11584), and ``x.to(tl.bfloat16)`` truncates where the GPU rounds to nearest even.
:func:`_patch_interpreter_bf16` fixes those two builder methods for the test session so bf16 GEMMs can be
checked on CPU. Kernels are never changed to suit the interpreter. hopperkern itself refuses bf16 inputs under an
interpreter whose probe finds these faults (``hopperkern.tma.interpreter_dtype_problems``); with the patch the
probe finds none, and tests that need the interpreter as users get it take the ``unpatched_interpreter`` fixture.
"""

import importlib
import os
import threading

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICE = "cuda" if HAS_CUDA else "cpu"


def _bf16_bits_to_f32(bits):
    """bf16 bit patterns (numpy uint16) -> exactly equal float32 values: bf16 is the top half of an fp32."""
    import numpy as np

    return (bits.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16_bits(x):
    """float32 -> bf16 bit patterns, rounded to nearest even like the GPU's ``cvt.rn.bf16.f32`` (NaN stays NaN)."""
    import numpy as np

    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), np.uint16(0x7FC0), rounded)


def _patch_interpreter_bf16():
    """Make two bf16 operations of the interpreter match the GPU, for the test session only:

    - ``tl.dot`` widens bf16 operands to fp32 before multiplying (exact) instead of multiplying bit patterns;
    - the fp32 -> bf16 cast (``x.to(tl.bfloat16)``) rounds to nearest even instead of truncating.

    Returns a function that undoes the patch. Does nothing when the interpreter is off.
    """
    import triton
    import triton.language as tl

    if not triton.knobs.runtime.interpret:
        return lambda: None
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    original_dot, original_cast = builder.create_dot, builder.cast_impl

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype == tl.bfloat16:
            a = interpreter.TensorHandle(_bf16_bits_to_f32(a.data), tl.float32)
        if b.dtype == tl.bfloat16:
            b = interpreter.TensorHandle(_bf16_bits_to_f32(b.data), tl.float32)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_f32_to_bf16_bits(src.data), tl.bfloat16)
        return original_cast(self, src, dst_type)

    builder.create_dot, builder.cast_impl = create_dot, cast_impl

    def undo():
        builder.create_dot, builder.cast_impl = original_dot, original_cast

    return undo


@pytest.fixture(scope="session", autouse=True)
def interpreter_bf16():
    """Session-wide: bf16 ``tl.dot`` and fp32 -> bf16 casts behave as on the GPU under the interpreter. Yields
    the function that undoes the patch."""
    undo = _patch_interpreter_bf16()
    yield undo
    undo()


def _forget_dtype_probes():
    # The module, not the function ``hopperkern.tma.capability`` that the package re-exports under its name.
    importlib.import_module("hopperkern.tma.capability")._probe_interpreter_dtype.cache_clear()


@pytest.fixture
def unpatched_interpreter(interpreter_bf16):
    """For one test: Triton's interpreter as users get it (the session's bf16 patch undone), with hopperkern's
    cached dtype probes forgotten before and after, so that they report what the interpreter does each time."""
    if HAS_CUDA:
        pytest.skip("needs Triton's interpreter: with a GPU the tests run compiled kernels")
    interpreter_bf16()
    _forget_dtype_probes()
    try:
        yield
    finally:
        _patch_interpreter_bf16()
        _forget_dtype_probes()


def pytest_configure(config):
    # triton 3.6's interpreter turns 1-element arrays into ints the way numpy >= 1.25 deprecates; not ours.
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning:triton.runtime.interpreter")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on the H200)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture
def device():
    return DEVICE


def run_in_thread(fn):
    """``fn()`` run in a new ``threading.Thread`` (a fresh context, as in a trainer's worker thread); returns its
    result, and re-raises here whatever it raised there."""
    box = {}

    def work():
        try:
            box["out"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            box["err"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """Every test starts without cached launch plans: tests that monkeypatch a launcher's helpers (split plans,
    buffer budgets, configs) must see them used, not a plan an earlier test cached for the same shapes."""
    from hopperkern.tma.launcher import clear_plans

    clear_plans()
    yield
