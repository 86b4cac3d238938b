"""The TMA layer: capability detection, operand eligibility, mode resolution, descriptors, allocator, jit helpers."""

import contextvars
import importlib
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from conftest import DEVICE, HAS_CUDA

from hopperkern import tma
from hopperkern.tma.jit import (load_2d, load_3d, load_halves, load_rows, log_approx, store_2d, tile_source_2d,
                               tile_source_3d, tile_source_halves)

# `hopperkern.tma.capability` is the function (re-exported); the module lives in sys.modules.
capmod = importlib.import_module("hopperkern.tma.capability")
descmod = importlib.import_module("hopperkern.tma.descriptors")


# ---------------------------------------------------------------------------------------------------------------
# capability()


@pytest.fixture
def fresh_capability():
    """Clear the capability cache around a test that fakes the device, so no fake leaks into other tests."""
    capmod._capability.cache_clear()
    yield
    capmod._capability.cache_clear()


def _fake_gpu(monkeypatch, props=None, error=None, interpreter=False):
    """Make torch report one CUDA device with ``props`` (or raise ``error`` when asked for them)."""
    calls = []

    def get_device_properties(index):
        calls.append(index)
        if error is not None:
            raise error
        return props

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", get_device_properties)
    monkeypatch.setattr(capmod, "interpreter_active", lambda: interpreter)
    return calls


def test_capability_describes_this_machine():
    cap = tma.capability()
    assert cap.triton_version == triton.__version__
    assert cap.tensor_descriptors  # triton 3.6 has tl.make_tensor_descriptor
    if HAS_CUDA:
        assert cap.cuda_available and cap.device_name and cap.sm_count > 0
        assert cap.compute_capability == torch.cuda.get_device_capability()
    else:
        # CPU torch under the interpreter: no device facts, but both memory paths can run.
        assert (cap.cuda_available, cap.interpreter) == (False, True)
        assert (cap.device_name, cap.compute_capability, cap.sm_count) == (None, None, None)
        assert cap.tma is True and cap.reasons == ()
        assert cap.config_name is None


def test_capability_is_cached():
    assert tma.capability() is tma.capability()


def test_capability_reads_device_properties_once(monkeypatch, fresh_capability):
    props = SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132)
    calls = _fake_gpu(monkeypatch, props=props)
    cap = tma.capability()
    assert tma.capability() is cap
    assert calls == [0]
    assert (cap.device_name, cap.compute_capability, cap.sm_count) == ("NVIDIA H200", (9, 0), 132)
    assert cap.tma is True and cap.reasons == ()
    assert cap.config_name == "NVIDIA_H200"


def test_capability_never_raises_when_device_query_fails(monkeypatch, fresh_capability):
    _fake_gpu(monkeypatch, error=RuntimeError("driver exploded"))
    cap = tma.capability()
    assert cap.cuda_available is True and cap.tma is False
    assert "could not read the properties of cuda:0: driver exploded" in cap.reasons


def test_capability_never_raises_when_cuda_query_fails(monkeypatch, fresh_capability):
    def boom():
        raise RuntimeError("no libcuda")

    monkeypatch.setattr(torch.cuda, "is_available", boom)
    monkeypatch.setattr(capmod, "interpreter_active", lambda: False)
    cap = tma.capability()
    assert cap.tma is False
    assert "could not query CUDA: no libcuda" in cap.reasons


@pytest.mark.parametrize("major, cuda, hip, want", [(9, "12.8", None, True), (8, "12.8", None, False),
                                                     (10, "12.8", None, False), (9, None, "6.2", False)],
                         ids=["hopper", "ampere", "blackwell", "rocm"])
def test_capability_hopper_mma(monkeypatch, fresh_capability, major, cuda, hip, want):
    """hopper_mma (the tensor-core products the LCE label kernel relies on to match the forward's tiles bitwise):
    an sm_90 GPU with a CUDA build of torch, compiled kernels; no other architecture, no ROCm build."""
    _fake_gpu(monkeypatch, props=SimpleNamespace(name="GPU", major=major, minor=0, multi_processor_count=100))
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.version, "hip", hip, raising=False)
    assert tma.capability().hopper_mma is want


def test_capability_hopper_mma_never_interpreted(monkeypatch, fresh_capability):
    _fake_gpu(monkeypatch, props=SimpleNamespace(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132),
              interpreter=True)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert tma.capability().hopper_mma is False


def test_capability_pre_hopper_gpu(monkeypatch, fresh_capability):
    _fake_gpu(monkeypatch, props=SimpleNamespace(name="NVIDIA A100", major=8, minor=0, multi_processor_count=108))
    cap = tma.capability()
    assert cap.tma is False
    assert cap.reasons == ("compute capability 8.0 < 9.0: TMA needs Hopper (sm_90) or newer",)


def test_capability_no_gpu_and_no_interpreter(monkeypatch, fresh_capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(capmod, "interpreter_active", lambda: False)
    cap = tma.capability()
    assert (cap.cuda_available, cap.tma) == (False, False)
    assert cap.reasons == ("no CUDA GPU is available (and Triton's interpreter is off)",)


@pytest.mark.parametrize("name, stem", [
    ("NVIDIA H200", "NVIDIA_H200"),
    ("NVIDIA H100 80GB HBM3", "NVIDIA_H100_80GB_HBM3"),
    ("  NVIDIA  H20 (MIG 1g.12gb) ", "NVIDIA_H20_MIG_1g_12gb"),
])
def test_normalize_device_name(name, stem):
    assert tma.normalize_device_name(name) == stem


# ---------------------------------------------------------------------------------------------------------------
# tma_not_supported_reasons()


@dataclass(frozen=True)
class Case:
    name: str
    make: object  # device -> tensor
    block: tuple
    expect: str  # a sentence that must be among the reasons
    why: str


def _misaligned_base(device):
    # One fp32 element of storage offset: contiguous, aligned strides, base address 4 bytes off.
    return torch.zeros(64 * 64 + 1, device=device)[1:].view(64, 64)


REASON_CASES = [
    Case("transposed", lambda d: torch.zeros(64, 128, device=d).t(), (32, 32),
         "last stride is 128, must be 1 (inner dim contiguous)", "non-contiguous inner dim: pointer path only"),
    Case("odd row pitch", lambda d: torch.zeros(64, 65, dtype=torch.float16, device=d), (32, 32),
         "stride(0)=130 bytes is not a multiple of 16", "row stride must be 16-byte aligned"),
    Case("storage offset", _misaligned_base, (32, 32),
         "is not 16-byte aligned", "base address from a storage offset"),
    Case("block not pow2", lambda d: torch.zeros(64, 64, device=d), (48, 32),
         "block dim 0 = 48 must be a power of two <= 256", "TMA boxes are powers of two"),
    Case("block too big", lambda d: torch.zeros(64, 1024, device=d), (32, 512),
         "block dim 1 = 512 must be a power of two <= 256", "TMA box extent limit"),
    Case("box too narrow", lambda d: torch.zeros(64, 64, device=d), (32, 2),
         "block inner extent 2 x 4 bytes is not a multiple of 16 bytes", "inner box must be >= 16 bytes"),
    Case("block rank", lambda d: torch.zeros(64, 64, device=d), (32,),
         "block shape (32,) has 1 dims, tensor has 2", "one box extent per dim"),
    Case("1-D", lambda d: torch.zeros(64, device=d), (64,),
         "tensor has 1 dims; device-side TMA descriptors need 2 to 5", "descriptors are 2-D to 5-D"),
    Case("zero-size", lambda d: torch.zeros(0, 64, device=d), (32, 32),
         "tensor has a zero-size dim (shape (0, 64))", "TMA cannot describe an empty dim"),
]


def test_reasons_empty_for_eligible_tensors(device):
    assert tma.tma_not_supported_reasons(torch.zeros(64, 64, device=device), (32, 32)) == []
    # A row slice of a wider matrix keeps an aligned pitch: still eligible.
    wide = torch.zeros(64, 128, dtype=torch.float16, device=device)
    assert tma.tma_not_supported_reasons(wide[:, :64], (32, 32)) == []
    assert tma.tma_not_supported_reasons(torch.zeros(4, 64, 32, device=device), (1, 32, 32)) == []


@pytest.mark.parametrize("case", REASON_CASES, ids=lambda c: c.name)
def test_reasons_sentences(case, device):
    reasons = tma.tma_not_supported_reasons(case.make(device), case.block)
    assert any(case.expect in r for r in reasons), reasons


def test_reasons_misaligned_base_names_the_offset(device):
    t = _misaligned_base(device)
    want = f"base address is {t.data_ptr() % 16} bytes past a 16-byte boundary: it is not 16-byte aligned"
    assert want in tma.tma_not_supported_reasons(t, (32, 32))


def test_reasons_are_memoised_on_layout_not_identity(device):
    """Same layout, different tensors: one memo entry serves both; a different stride or base offset is a
    different answer."""
    a = torch.zeros(64, 64, device=device)
    b = torch.ones(64, 64, device=device)
    assert tma.tma_not_supported_reasons(a, (32, 32)) == tma.tma_not_supported_reasons(b, (32, 32))
    assert tma.tma_not_supported_reasons(a[:, 1:], (32, 32)) != tma.tma_not_supported_reasons(a, (32, 32))
    assert any("last stride" in r for r in tma.tma_not_supported_reasons(a.t(), (32, 32)))
    assert tma.tma_not_supported_reasons(_misaligned_base(device), (32, 32))


# ---------------------------------------------------------------------------------------------------------------
# decide(), modes, HOPPERKERN_TMA


@pytest.fixture
def no_tma_env(monkeypatch):
    monkeypatch.delenv("HOPPERKERN_TMA", raising=False)


def _operands(device):
    good = torch.zeros(64, 64, device=device)
    bad = torch.zeros(64, 128, device=device).t()
    return {"good": (good, (32, 32)), "bad": (bad, (32, 32))}


def test_decide_auto_per_operand(device, no_tma_env):
    d = tma.decide("auto", _operands(device), op="test.auto")
    assert (d["good"], d["bad"], d.any, d.mode) == (True, False, True, "auto")
    assert d.reasons["good"] == ()
    assert "last stride is 128, must be 1 (inner dim contiguous)" in d.reasons["bad"]
    assert tma.last_decision("test.auto") is d


def test_decide_never(device, no_tma_env):
    d = tma.decide("never", _operands(device), op="test.never")
    assert d.use == {"good": False, "bad": False} and not d.any
    assert d.reasons["good"] == ("tma='never'",)


def test_decide_always_eligible(device, no_tma_env):
    ops = _operands(device)
    del ops["bad"]
    assert tma.decide("always", ops, op="test.always").use == {"good": True}


def test_decide_always_raises_with_reasons(device, no_tma_env):
    with pytest.raises(tma.UnsupportedError, match=r"tma='always' was asked for") as info:
        tma.decide("always", _operands(device), op="test.always")
    msg = str(info.value)
    assert "  - bad: last stride is 128, must be 1 (inner dim contiguous)" in msg
    assert "good" not in msg
    assert msg.endswith("see: python -m hopperkern.info")
    assert isinstance(info.value, NotImplementedError)
    assert info.value.reasons[0] == "bad: last stride is 128, must be 1 (inner dim contiguous)"
    assert all(r.startswith("bad: ") for r in info.value.reasons)


def test_errors_module_holds_the_package_exceptions():
    """hopperkern.errors is where both exceptions live; the layers re-export the same classes."""
    import hopperkern
    from hopperkern import errors, tuning

    assert tma.UnsupportedError is errors.UnsupportedError is capmod.UnsupportedError
    assert tuning.TuningFileError is errors.TuningFileError and issubclass(errors.TuningFileError, ValueError)
    assert hopperkern.errors is errors


@pytest.mark.parametrize("mode", ["yes", "AUTO", "", None, True])
def test_invalid_mode(mode, device, no_tma_env):
    with pytest.raises(ValueError, match=r"tma must be one of \('auto', 'always', 'never'\), got"):
        tma.decide(mode, _operands(device), op="test.invalid")


def test_env_override_is_read_at_call_time(device, monkeypatch):
    ops = _operands(device)
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    d = tma.decide("always", ops, op="test.env")  # would raise without the override
    assert d.mode == "never" and not d.any
    monkeypatch.setenv("HOPPERKERN_TMA", "always")
    with pytest.raises(tma.UnsupportedError, match="see: python -m hopperkern.info"):
        tma.decide("auto", ops, op="test.env")
    monkeypatch.setenv("HOPPERKERN_TMA", "")  # empty means unset
    assert tma.resolve_mode("auto") == "auto"


def test_env_override_invalid(monkeypatch):
    monkeypatch.setenv("HOPPERKERN_TMA", "sometimes")
    with pytest.raises(ValueError, match=r"HOPPERKERN_TMA must be one of \('auto', 'always', 'never'\), "
                                         r"got 'sometimes'"):
        tma.resolve_mode("auto")


def test_unsupported_error_without_reasons():
    err = tma.UnsupportedError("thing", [])
    assert str(err) == "thing:\n  - (no reason recorded)\nsee: python -m hopperkern.info"


# ---------------------------------------------------------------------------------------------------------------
# host-side descriptors and the allocator


@triton.jit
def _copy_through_host_descriptor(desc, out_ptr, B0: tl.constexpr, B1: tl.constexpr):
    tile = desc.load([B0, 0])  # second row block
    r = tl.arange(0, B0)
    c = tl.arange(0, B1)
    tl.store(out_ptr + r[:, None] * B1 + c[None, :], tile)


def test_make_descriptor_loads_a_tile(device):
    x = torch.randn(48, 16, device=device)
    desc = tma.make_descriptor(x, (32, 16))
    assert (list(desc.shape), list(desc.strides), list(desc.block_shape)) == ([48, 16], [16, 1], [32, 16])
    tma.ensure_allocator()
    out = torch.full((32, 16), float("nan"), device=device)
    _copy_through_host_descriptor[(1,)](desc, out, 32, 16)
    expect = torch.zeros(32, 16, device=device)
    expect[:16] = x[32:]  # rows past 48 come back as zeros
    assert torch.equal(out, expect)


def test_make_descriptor_refuses_ineligible(device):
    with pytest.raises(tma.UnsupportedError, match=r"cannot build a TMA descriptor:\n  - last stride is 64"):
        tma.make_descriptor(torch.zeros(32, 64, device=device).t(), (32, 32))


@pytest.fixture
def compiled_mode(monkeypatch):
    """Pretend the interpreter is off so ensure_allocator does its GPU-side work (setting an allocator is
    harmless on a CPU: nothing calls it)."""
    monkeypatch.setattr(descmod, "interpreter_active", lambda: False)
    from triton.runtime._allocation import NullAllocator, _allocator

    return lambda: not isinstance(_allocator.get(), NullAllocator)


def test_ensure_allocator_in_worker_thread(compiled_mode):
    seen = {}

    def worker():
        seen["before"] = compiled_mode()
        tma.ensure_allocator()
        seen["after"] = compiled_mode()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"before": False, "after": True}


def test_ensure_allocator_in_fresh_context_after_earlier_call(compiled_mode):
    """A thread that already called ensure_allocator must still install one inside a fresh context
    (a per-thread "done" flag would skip it and the launch would fail with "no allocator was set")."""

    def run():
        tma.ensure_allocator()
        inner = contextvars.Context().run(lambda: (tma.ensure_allocator(), compiled_mode())[1])
        return compiled_mode(), inner

    assert contextvars.Context().run(run) == (True, True)


def test_ensure_allocator_keeps_a_users_allocator(compiled_mode):
    def mine(size, alignment, stream):
        raise AssertionError("not called on CPU")

    def run():
        triton.set_allocator(mine)
        tma.ensure_allocator()
        from triton.runtime._allocation import _allocator

        return _allocator.get()

    assert contextvars.Context().run(run) is mine


# ---------------------------------------------------------------------------------------------------------------
# jit helpers: both memory paths from one body, zero padding, clipped stores, static_assert guards


@triton.jit
def _tile_copy_2d(x_ptr, y_ptr, t_ptr, M, N, stride_x, stride_y, off0, off1,
                  B0: tl.constexpr, B1: tl.constexpr, X_TMA: tl.constexpr, Y_TMA: tl.constexpr):
    """Load the [B0, B1] tile of x at (off0, off1) into t (dense [B0, B1]) and store it back into y there."""
    src = tile_source_2d(x_ptr, M, N, stride_x, B0, B1, X_TMA)
    dst = tile_source_2d(y_ptr, M, N, stride_y, B0, B1, Y_TMA)
    tile = load_2d(src, off0, off1, M, N, stride_x, 1, B0, B1, X_TMA)
    r = tl.arange(0, B0)
    c = tl.arange(0, B1)
    tl.store(t_ptr + r[:, None] * B1 + c[None, :], tile)
    store_2d(dst, tile, off0, off1, M, N, stride_y, 1, B0, B1, Y_TMA)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
def test_load_store_2d_pads_and_clips(use_tma, device):
    M, N, B0, B1, off0, off1 = 40, 24, 16, 16, 32, 16  # the tile hangs over both edges
    x = torch.randn(M, N, device=device)
    y = torch.zeros(M, N, device=device)
    t = torch.full((B0, B1), float("nan"), device=device)
    tma.ensure_allocator()  # device-side descriptors on a GPU
    _tile_copy_2d[(1,)](x, y, t, M, N, x.stride(0), y.stride(0), off0, off1, B0, B1, use_tma, use_tma)
    padded = torch.zeros(B0, B1, device=device)
    padded[: M - off0, : N - off1] = x[off0:, off1:]
    assert torch.equal(t, padded)
    expect = torch.zeros(M, N, device=device)
    expect[off0:, off1:] = x[off0:, off1:]
    assert torch.equal(y, expect)  # nothing written outside the tensor (it would land in other memory)


@triton.jit
def _slab_copy_3d(w_ptr, t_ptr, E, N, K, stride0, stride1, idx0, off1, off2,
                  B1: tl.constexpr, B2: tl.constexpr, USE_TMA: tl.constexpr, IDX_CONST: tl.constexpr = -1):
    """Copy the [B1, B2] tile of slab idx0 (or of slab IDX_CONST when >= 0) at (off1, off2) into t."""
    src = tile_source_3d(w_ptr, E, N, K, stride0, stride1, B1, B2, USE_TMA)
    if IDX_CONST >= 0:
        tile = load_3d(src, IDX_CONST, off1, off2, N, K, stride0, stride1, 1, B1, B2, USE_TMA)
    else:
        tile = load_3d(src, idx0, off1, off2, N, K, stride0, stride1, 1, B1, B2, USE_TMA)
    r = tl.arange(0, B1)
    c = tl.arange(0, B2)
    tl.store(t_ptr + r[:, None] * B2 + c[None, :], tile)


# The slab index as a runtime int (Triton makes an int argument equal to 1 a constexpr when compiling) and as an
# explicit constexpr: load_3d must accept both.
@pytest.mark.parametrize("idx_const", [-1, 1], ids=["runtime-index", "constexpr-index"])
@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
def test_load_3d_reads_one_slab(use_tma, idx_const, device):
    E, N, K, B1, B2 = 3, 24, 16, 16, 16
    w = torch.randn(E, N, K, dtype=torch.float16, device=device)
    t = torch.full((B1, B2), float("nan"), dtype=torch.float16, device=device)
    tma.ensure_allocator()
    _slab_copy_3d[(1,)](w, t, E, N, K, w.stride(0), w.stride(1), 1, 16, 0, B1, B2, use_tma, idx_const)
    expect = torch.zeros(B1, B2, dtype=torch.float16, device=device)
    expect[: N - 16] = w[1, 16:]  # rows past N are zeros, never the next expert's rows
    assert torch.equal(t, expect)


@triton.jit
def _halves_copy(w_ptr, t_ptr, E, half, K, stride0, stride1, idx0, off1, off2, B1: tl.constexpr, B2: tl.constexpr,
                 USE_TMA: tl.constexpr):
    """Copy the [2 * B1, B2] paired tile of slab idx0 at (off1, off2) into t."""
    src = tile_source_halves(w_ptr, E, half, K, stride0, stride1, B1, B2, USE_TMA)
    tile = load_halves(src, idx0, off1, off2, half, K, stride0, stride1, 1, B1, B2, USE_TMA)
    r = tl.arange(0, 2 * B1)
    c = tl.arange(0, B2)
    tl.store(t_ptr + r[:, None] * B2 + c[None, :], tile)


@pytest.mark.parametrize("use_tma", [False, True], ids=["pointer", "tma"])
def test_load_halves_pairs_rows_of_both_halves(use_tma, device):
    """Rows off1.. of the first half, then the same rows of the second half; rows past ``half`` (in either half)
    and columns past K are zeros: never the other half's rows, never the next slab's."""
    E, half, K, B1, B2 = 3, 20, 24, 16, 16
    w = torch.randn(E, 2 * half, K, dtype=torch.float16, device=device)
    t = torch.full((2 * B1, B2), float("nan"), dtype=torch.float16, device=device)
    tma.ensure_allocator()
    _halves_copy[(1,)](w, t, E, half, K, w.stride(0), w.stride(1), 2, 16, 16, B1, B2, use_tma)
    expect = torch.zeros(2 * B1, B2, dtype=torch.float16, device=device)
    expect[: half - 16, : K - 16] = w[2, 16:half, 16:]
    expect[B1: B1 + half - 16, : K - 16] = w[2, half + 16:, 16:]
    assert torch.equal(t, expect)


@triton.jit
def _gather_rows(x_ptr, idx_ptr, t_ptr, R, N, stride0, B1: tl.constexpr, R_BLOCK: tl.constexpr,
                 USE_TMA: tl.constexpr):
    i = tl.arange(0, R_BLOCK)
    rows = tl.load(idx_ptr + i, mask=i < R, other=0)
    tile = load_rows(x_ptr, rows, i < R, 0, N, stride0, 1, B1, USE_TMA)
    tl.store(t_ptr + i[:, None] * B1 + tl.arange(0, B1)[None, :], tile)


def test_load_rows_gathers(device):
    x = torch.randn(10, 12, device=device)
    idx = torch.tensor([7, 0, 7, 3, 9], dtype=torch.int32, device=device)
    t = torch.full((8, 16), float("nan"), device=device)
    _gather_rows[(1,)](x, idx, t, 5, 12, x.stride(0), 16, 8, False)
    expect = torch.zeros(8, 16, device=device)
    expect[:5, :12] = x[idx.long()]
    assert torch.equal(t, expect)


# The guards are compile-time: InterpreterError under the interpreter; compiled, a CompileTimeAssertionFailure that
# Triton wraps in a CompilationError at the call site when the assert sits in a called helper. All are TritonErrors.
# The `gpu` copies check the compiled form on the H200.
BOTH_BACKENDS = [pytest.param("here", id="here"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def assert_static_assert(excinfo, message):
    """``message`` is carried by the right kind of error somewhere in the exception chain."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import InterpreterError

    kind = InterpreterError if triton.knobs.runtime.interpret else CompileTimeAssertionFailure
    chain, exc = [], excinfo.value
    while exc is not None and len(chain) < 10:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    assert any(isinstance(e, kind) and message in str(e) for e in chain), [f"{type(e).__name__}: {e}" for e in chain]


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_static_assert_row_gather_has_no_tma(backend, device):
    x = torch.randn(10, 16, device=device)
    idx = torch.zeros(8, dtype=torch.int32, device=device)
    t = torch.empty(8, 16, device=device)
    with pytest.raises(triton.errors.TritonError) as info:
        _gather_rows[(1,)](x, idx, t, 8, 16, x.stride(0), 16, 8, True)
    assert_static_assert(info, "row gather has no TMA path on sm_90: pass USE_TMA=False for gathered rows")


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_static_assert_tma_box_too_narrow(backend, device):
    x = torch.randn(8, 8, device=device)
    t = torch.empty(8, 2, device=device)
    tma.ensure_allocator()
    with pytest.raises(triton.errors.TritonError) as info:
        _tile_copy_2d[(1,)](x, x, t, 8, 8, 8, 8, 0, 0, 8, 2, True, True)  # 2 fp32 = 8 bytes
    assert_static_assert(info, "TMA box inner extent must be at least 16 bytes")


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_static_assert_tma_box_too_narrow_3d(backend, device):
    w = torch.randn(2, 8, 8, device=device)
    t = torch.empty(8, 2, device=device)
    tma.ensure_allocator()
    with pytest.raises(triton.errors.TritonError) as info:
        _slab_copy_3d[(1,)](w, t, 2, 8, 8, 64, 8, 0, 0, 0, 8, 2, True)
    assert_static_assert(info, "TMA box inner extent must be at least 16 bytes")


# ---------------------------------------------------------------------------------------------------------------
# Where ops launch


def test_cpu_tensors_without_interpreter_raise_unsupported(monkeypatch):
    """CPU tensors with the interpreter off: UnsupportedError naming the device, before any launch."""
    from hopperkern import lce
    from hopperkern.matmul import matmul

    monkeypatch.setattr(capmod, "interpreter_active", lambda: False)
    with pytest.raises(tma.UnsupportedError, match=r"matmul cannot run on cpu tensors(.|\n)*TRITON_INTERPRET"):
        matmul(torch.randn(8, 8), torch.randn(8, 8))
    with pytest.raises(tma.UnsupportedError, match=r"hopperkern.lce cannot run on cpu tensors"):
        lce.linear_cross_entropy(torch.randn(4, 16), torch.randn(32, 16), torch.randint(0, 32, (4,)))


@pytest.mark.parametrize("shape", [(0, 32, 32), (16, 0, 32), (16, 32, 0)], ids=["M=0", "K=0", "N=0"])
def test_zero_size_matmul_with_tma_always(shape):
    """Empty problems return (zeros) before any TMA decision, so tma='always' does not raise on them."""
    from hopperkern.matmul import matmul

    M, K, N = shape
    c = matmul(torch.randn(M, K, device=DEVICE), torch.randn(K, N, device=DEVICE), tma="always")
    assert c.shape == (M, N) and (c == 0).all()


def test_torch_mm_out_dtype_probe_is_a_bool():
    """The out_dtype probe (fp32 d_hidden accumulation in the LCE backward) answers without raising."""
    assert tma.torch_mm_out_dtype() in (True, False)


# ---------------------------------------------------------------------------------------------------------------
# Approximate math (log_approx)


@triton.jit
def _log_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, APPROX: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=1.0)
    tl.store(y_ptr + offs, log_approx(x, APPROX), mask=offs < n)


def _log_inputs(device):
    """Normal positive fp32 values over the whole range, the values near 1, and the ends (log_approx's domain)."""
    gen = torch.Generator().manual_seed(0)
    wide = torch.exp2(torch.empty(4096).uniform_(-126, 127, generator=gen))
    near_one = 1.0 + torch.linspace(-0.25, 0.25, 1001)
    special = torch.tensor([1.0, 2.0, 0.5, torch.finfo(torch.float32).tiny, 3.4e38, torch.finfo(torch.bfloat16).tiny])
    return torch.cat([wide, near_one, special]).float().to(device)


def test_ptx_approx_math_is_off_under_the_interpreter(monkeypatch):
    """The interpreter runs no inline assembly: launchers are told to use tl.log there."""
    monkeypatch.setattr(capmod, "interpreter_active", lambda: True)
    assert tma.ptx_approx_math() is False


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
def test_log_approx_matches_fp64(backend):
    """log_approx against fp64 log over normal fp32 inputs: to fp32 rounding without APPROX; with APPROX on a GPU
    within 2^-21 absolute plus two roundings of the result (|log x| 2^-22)."""
    if backend == "gpu" and not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    device = DEVICE if backend == "here" else "cuda"
    x = _log_inputs(device)
    want = torch.log(x.double())
    modes = [False] + ([True] if backend == "gpu" and tma.ptx_approx_math() else [])
    assert backend == "here" or modes == [False, True], "a GPU must run the approximate path"
    for approx in modes:
        y = torch.empty_like(x)
        _log_kernel[(triton.cdiv(x.numel(), 256),)](x, y, x.numel(), BLOCK=256, APPROX=approx)
        err = (y.double() - want).abs()
        # Exact: one rounding of the result. APPROX: lg2.approx's 2^-22.6 on the mantissa's log2, then two roundings
        # (log2 x, then times ln 2) of the result.
        bound = (2.0 ** -21 + want.abs() * 2.0 ** -22) if approx else want.abs() * 2.0 ** -23
        worst = int(torch.argmax(err - bound))  # the element furthest over its bound (for the message)
        assert bool((err <= bound * 1.0001 + 2.0 ** -24).all()), \
            f"APPROX={approx}: log({x[worst].item()!r}) = {y[worst].item()!r}, want {want[worst].item()!r}"
