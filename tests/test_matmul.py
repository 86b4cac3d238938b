"""hopperkern.matmul: one kernel body, both memory paths, against fp64 references."""

import contextvars
import re
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from conftest import DEVICE, _f32_to_bf16_bits, run_in_thread

from hopperkern import tma
from hopperkern.matmul import matmul


@dataclass(frozen=True)
class Case:
    M: int
    N: int
    K: int
    why: str
    blocks: tuple = (64, 64, 32)  # block_m, block_n, block_k

    def __str__(self):
        return f"{self.M}x{self.N}x{self.K}"


CASES = [
    Case(64, 64, 64, "tile-aligned: no tails"),
    Case(70, 88, 72, "M, N, K not multiples of the blocks: zero-padded K tail, clipped M/N tails"),
    Case(1, 40, 24, "one row (M < BLOCK_M) and N < BLOCK_N: a single partial tile"),
    Case(140, 40, 32, "9 row blocks > GROUP_M=8: the grouped tile order must still cover every tile",
         blocks=(16, 32, 16)),
]


def _inputs(M, N, K, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    b = torch.randn(K, N, generator=g).to(dtype).to(DEVICE)
    return a, b


def assert_matches_reference(out, a, b, *, factor=2.0):
    """|out - fp64 reference| <= factor * (plain torch's error in the same dtype) + a tiny atol."""
    assert out.shape == (a.shape[0], b.shape[1]) and out.dtype == a.dtype
    ref = a.double() @ b.double()
    err = (out.double() - ref).abs().max().item()
    torch_err = ((a @ b).double() - ref).abs().max().item()
    atol = 1e-7 * max(ref.abs().max().item(), 1.0)
    assert err <= factor * torch_err + atol, f"error {err:.3g} vs plain torch {torch_err:.3g}"


@pytest.fixture(autouse=True)
def no_tma_env(monkeypatch):
    monkeypatch.delenv("HOPPERKERN_TMA", raising=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_matmul_both_paths(case, mode, dtype):
    a, b = _inputs(case.M, case.N, case.K, dtype)
    bm, bn, bk = case.blocks
    out = matmul(a, b, tma=mode, block_m=bm, block_n=bn, block_k=bk)
    d = tma.last_decision("matmul")
    assert d.mode == mode and d.use == {k: mode == "always" for k in "abc"}
    assert_matches_reference(out, a, b)


def test_paths_agree_bitwise():
    a, b = _inputs(70, 88, 72, torch.float16, seed=1)
    assert torch.equal(matmul(a, b, tma="never"), matmul(a, b, tma="always"))


# bf16: on CPU the interpreter needs the test-only fix in conftest.py; the `gpu` copy runs it compiled on the H200.
BF16_RUNS = [pytest.param((70, 88, 72), id="here"),
             pytest.param((1000, 1496, 2040), id="gpu", marks=pytest.mark.gpu)]  # rows 16-byte aligned for TMA


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("shape", BF16_RUNS)
def test_matmul_bf16_vs_fp32_torch(shape, mode):
    M, N, K = shape
    a, b = _inputs(M, N, K, torch.bfloat16, seed=2)
    out = matmul(a, b, tma=mode)
    assert tma.last_decision("matmul").use == {k: mode == "always" for k in "abc"}
    ref = a.float() @ b.float()
    err = (out.float() - ref).abs().max().item()
    torch_err = ((a @ b).float() - ref).abs().max().item()
    assert out.dtype == torch.bfloat16
    assert err <= 2 * torch_err + 1e-6 * ref.abs().max().item(), (err, torch_err)


def test_interpreter_fix_rounds_like_torch():
    """conftest's fp32 -> bf16 conversion is round-to-nearest-even, as torch and the GPU do (ties, inf, nan)."""
    x = torch.cat([torch.randn(4096) * 100,
                   torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -1.0 - 2**-8, 3.0e38, float("inf"), -0.0])])
    got = _f32_to_bf16_bits(x.numpy()).view(np.int16)
    assert np.array_equal(got, x.to(torch.bfloat16).view(torch.int16).numpy())
    nan = _f32_to_bf16_bits(np.array([np.nan], dtype=np.float32)).view(np.uint16)
    assert torch.isnan(torch.from_numpy(nan.view(np.int16)).view(torch.bfloat16)).all()


# ---------------------------------------------------------------------------------------------------------------
# operand layouts under tma="auto"


def test_auto_transposed_operand_falls_back_per_operand():
    a_t, _ = _inputs(72, 1, 70, torch.float32, seed=3)  # a_t [72, 70] -> a = a_t.T is [70, 72], strides (1, 70)
    a = a_t.t()
    _, b = _inputs(1, 88, 72, torch.float32, seed=3)
    out = matmul(a, b, tma="auto")
    d = tma.last_decision("matmul")
    assert d.use == {"a": False, "b": True, "c": True}
    assert "last stride is 70, must be 1 (inner dim contiguous)" in d.reasons["a"]
    assert_matches_reference(out, a, b)


def test_auto_strided_columns_fall_back():
    a, wide = _inputs(40, 176, 48, torch.float16, seed=4)
    b = wide[:, ::2]  # [48, 88], last stride 2
    out = matmul(a, b, tma="auto")
    assert tma.last_decision("matmul").use == {"a": True, "b": False, "c": True}
    assert_matches_reference(out, a, b)


def test_auto_row_slice_keeps_tma():
    """A column slice of a wider matrix has an aligned row pitch, so TMA reads it with stride != width."""
    wide, _ = _inputs(70, 1, 144, torch.float32, seed=5)
    _, b = _inputs(1, 88, 72, torch.float32, seed=5)
    a = wide[:, 8:80]  # [70, 72], row pitch 144 elements, base 32 bytes in: still aligned
    out = matmul(a, b, tma="auto")
    assert tma.last_decision("matmul").use == {"a": True, "b": True, "c": True}
    assert_matches_reference(out, a, b)


def test_always_with_ineligible_operand_raises():
    a, b = _inputs(64, 64, 64, torch.float32)
    with pytest.raises(tma.UnsupportedError, match=r"(?s)matmul: tma='always' was asked for.*"
                                                   r"  - a: last stride is 64.*see: python -m hopperkern\.info$"):
        matmul(a.t(), b, tma="always")


def test_env_override_reaches_matmul(monkeypatch):
    a, b = _inputs(64, 64, 64, torch.float32)
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    assert_matches_reference(matmul(a, b, tma="always"), a, b)
    assert tma.last_decision("matmul").mode == "never"


@pytest.mark.parametrize("M, N, K", [(0, 40, 24), (24, 0, 40), (24, 40, 0), (0, 0, 0)])
@pytest.mark.parametrize("mode", ["auto", "never"])
def test_zero_size(M, N, K, mode):
    a, b = _inputs(M, N, K, torch.float32)
    out = matmul(a, b, tma=mode)
    assert out.shape == (M, N) and out.dtype == torch.float32
    assert torch.equal(out, torch.zeros(M, N, device=DEVICE))  # K == 0: an empty sum is 0


# ---------------------------------------------------------------------------------------------------------------
# validation


def test_rejects_bad_inputs():
    a, b = _inputs(8, 4, 8, torch.float32)
    with pytest.raises(TypeError, match=r"^a must be a torch\.Tensor, got list$"):
        matmul([[1.0]], b)
    with pytest.raises(TypeError, match=r"^a must be float16 or bfloat16 or float32, got int32$"):
        matmul(a.to(torch.int32), b)
    with pytest.raises(TypeError, match=r"^b must be float32 \(the dtype of a\), got float16$"):
        matmul(a, b.half())
    with pytest.raises(ValueError, match=re.escape("a must be 2-D, got shape (2, 8, 8)")):
        matmul(a.expand(2, 8, 8), b)
    with pytest.raises(ValueError, match=re.escape("b must have 8 rows (a.shape[1]), got shape (9, 4)")):
        matmul(a, torch.zeros(9, 4, device=DEVICE))
    with pytest.raises(ValueError, match=r"^all tensors must be on one device, got a on .*, b on meta$"):
        matmul(a, torch.empty(8, 4, device="meta"))
    with pytest.raises(ValueError, match=r"tma must be one of \('auto', 'always', 'never'\), got 'TMA'"):
        matmul(a, b, tma="TMA")


# ---------------------------------------------------------------------------------------------------------------
# GPU only: device-side descriptors need triton's allocator in every thread / context that launches


def _run_and_capture(fn):
    out = {}

    def work():
        try:
            out["c"] = fn()
            torch.cuda.synchronize()
            out["use"] = tma.last_decision("matmul").use
        except BaseException as exc:  # re-raised in the main thread by the assertion below
            out["error"] = exc

    return out, work


@pytest.mark.gpu
def test_tma_matmul_in_worker_thread():
    a, b = _inputs(256, 320, 192, torch.float16, seed=6)
    matmul(a, b, tma="always")  # the main thread has its allocator; the worker must install its own
    c, use = run_in_thread(lambda: (matmul(a, b, tma="always"), tma.last_decision("matmul").use))
    assert use == {"a": True, "b": True, "c": True}
    assert_matches_reference(c, a, b)


@pytest.mark.gpu
def test_tma_matmul_in_fresh_context():
    a, b = _inputs(256, 320, 192, torch.float16, seed=7)
    matmul(a, b, tma="always")
    out, work = _run_and_capture(lambda: matmul(a, b, tma="always"))
    contextvars.Context().run(work)
    assert "error" not in out, repr(out.get("error"))
    assert_matches_reference(out["c"], a, b)
