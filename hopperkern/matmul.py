"""A plain tiled matmul on the ``hopperkern.tma`` layer: the pattern every hopperkern kernel follows.

``matmul(a, b)`` == ``a @ b`` with fp32 accumulation. ONE kernel body serves both memory paths: each operand
gets a descriptor or a pointer from :func:`hopperkern.tma.jit.tile_source_2d`, chosen per operand on the host
by :func:`hopperkern.tma.decide`.
"""

from __future__ import annotations

import torch

from .tma import _triton  # noqa: F401 - first: a clear ImportError when triton cannot load
import triton
import triton.language as tl

from . import tma as _tma
from ._host import cdiv
from ._validate import FLOAT_DTYPES, check_dtype, check_ndim, check_same_device, check_same_dtype, dot_precision
from .tma.jit import grouped_tile, load_2d, store_2d, tile_source_2d

__all__ = ["matmul"]

@triton.jit
def _matmul_kernel(
    a_ptr,  # [M, K]
    b_ptr,  # [K, N]
    c_ptr,  # [M, N]
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_TMA: tl.constexpr, B_TMA: tl.constexpr, C_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """C = A @ B (GEMM dims M, N, K). Grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),); one program = one C tile,
    tiles visited in groups of GROUP_M row blocks so neighbouring programs share B tiles in L2."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)

    a_src = tile_source_2d(a_ptr, M, K, stride_am, BLOCK_M, BLOCK_K, A_TMA)
    b_src = tile_source_2d(b_ptr, K, N, stride_bk, BLOCK_K, BLOCK_N, B_TMA)
    c_dst = tile_source_2d(c_ptr, M, N, stride_cm, BLOCK_M, BLOCK_N, C_TMA)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        # K tail: both paths read zeros past K, which add nothing to the dot.
        a = load_2d(a_src, pid_m * BLOCK_M, k * BLOCK_K, M, K, stride_am, stride_ak, BLOCK_M, BLOCK_K, A_TMA)
        b = load_2d(b_src, k * BLOCK_K, pid_n * BLOCK_N, K, N, stride_bk, stride_bn, BLOCK_K, BLOCK_N, B_TMA)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    store_2d(c_dst, acc.to(c_ptr.dtype.element_ty), pid_m * BLOCK_M, pid_n * BLOCK_N, M, N, stride_cm, stride_cn,
             BLOCK_M, BLOCK_N, C_TMA)


def matmul(a: torch.Tensor, b: torch.Tensor, *, tma: str = "auto", block_m: int = 64, block_n: int = 64,
           block_k: int = 32, num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """``a @ b`` for 2-D fp16/bf16/fp32 ``a`` [M, K] and ``b`` [K, N] of one dtype, fp32 accumulation.

    Non-contiguous inputs are read through their strides (pointer path) without a copy; with ``tma="auto"``
    each operand uses TMA when :func:`hopperkern.tma.tma_not_supported_reasons` allows it.
    """
    check_dtype("a", a, FLOAT_DTYPES)
    check_dtype("b", b, FLOAT_DTYPES)
    check_same_dtype("b", b, "a", a)
    check_ndim("a", a, 2)
    check_ndim("b", b, 2)
    check_same_device({"a": a, "b": b})
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"b must have {a.shape[1]} rows (a.shape[1]), got shape {tuple(b.shape)}")
    M, K = a.shape
    N = b.shape[1]
    c = torch.empty((M, N), dtype=a.dtype, device=a.device)
    _tma.resolve_mode(tma)  # an unknown mode is an error even for empty inputs
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    with _tma.launch_context(a, "matmul"):
        d = _tma.decide(tma, {"a": (a, (block_m, block_k)), "b": (b, (block_k, block_n)),
                              "c": (c, (block_m, block_n))}, op="matmul")
        grid = (cdiv(M, block_m) * cdiv(N, block_n),)
        _matmul_kernel[grid](
            a, b, c, M, N, K, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0), c.stride(1),
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8,
            A_TMA=d["a"], B_TMA=d["b"], C_TMA=d["c"],
            DOT_PRECISION=dot_precision(a.dtype),
            num_warps=num_warps, num_stages=num_stages,
        )
    return c
