"""Device side of the TMA layer: tiny ``@triton.jit`` helpers that read or write a tile either through a
tensor descriptor or through masked pointer loads, switched by a ``USE_TMA`` constexpr.

A kernel calls ``src = tile_source_2d(ptr, ..., USE_TMA)`` once, then ``load_2d(src, ...)`` in its loop;
Triton compiles one variant per value of ``USE_TMA`` from the same kernel body. Both paths read zeros
outside the tensor (TMA pads with zeros, the pointer path uses ``other=0``) and clip stores, so a kernel
must mask padded rows/columns itself where zero is not neutral (e.g. -inf for vocab tails).

Pointer offsets along the leading dim are computed in int64: N*V and V*H exceed 2**31 in real workloads.
"""

from . import _triton  # noqa: F401 - first: a clear ImportError when triton cannot load
import triton
import triton.language as tl
try:  # tl.extra.cuda.gdc_* in chain_start; Capability.pdl is False where they are missing, so no kernel traces them
    import triton.language.extra.cuda  # noqa: F401
except ImportError:  # pragma: no cover - a Triton without the CUDA extras
    pass

__all__ = ["chain_start", "grouped_tile", "log_approx", "tile_source_2d", "load_2d", "store_2d", "tile_source_3d",
           "load_3d", "store_3d", "tile_source_halves", "load_halves", "load_rows"]


@triton.jit
def chain_start(PDL_WAIT: tl.constexpr, PDL_TRIGGER: tl.constexpr):
    """Programmatic dependent launch, first thing in a kernel of a launch chain (a plan's kernels, one after
    another on one stream; :func:`hopperkern.tma.launcher.chain_launches` sets the flags).

    PDL_TRIGGER: the next kernel of the chain may be scheduled once every program of this one has started, so
    its launch and set-up overlap this kernel's run instead of following its last program. PDL_WAIT (this
    kernel was launched as a dependent): block until the previous kernel has completed and its writes are
    visible; nothing before this point reads or writes global memory. Both flags are off under the
    interpreter and on GPUs without PDL (:attr:`hopperkern.tma.Capability.pdl`), where this is a no-op."""
    if PDL_TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    if PDL_WAIT:
        tl.extra.cuda.gdc_wait()


@triton.jit
def log_approx(x, APPROX: tl.constexpr):
    """Natural logarithm of a normal positive fp32 ``x``. With APPROX (:func:`hopperkern.tma.ptx_approx_math`: a
    GPU), one ``lg2.approx.f32`` (the special-function unit: an absolute error of 2^-22.6 on the mantissa's log2,
    then the result's roundings, |log x| 2^-22) times ln 2, in place of ``tl.log``'s libdevice polynomial (about
    twenty instructions an element), for element-wise passes whose inputs carry far more error than that
    (exponentials stored in bf16). Without APPROX, ``tl.log``: the interpreter runs no inline assembly. Subnormal
    ``x`` (below 2^-126) is the caller's to exclude: compiled Triton code takes libdevice's flush-to-zero path in
    ``tl.log``, the interpreter does not."""
    if APPROX:
        return tl.inline_asm_elementwise("lg2.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1) * 0.6931471805599453
    else:
        return tl.log(x)


@triton.jit
def grouped_tile(tile, num_rows, num_cols, GROUP: tl.constexpr):
    """(row tile, column tile) of linear tile index ``tile`` over a [num_rows, num_cols] grid of tiles, visiting
    GROUP row tiles per sweep of the columns, so that tiles in flight together share row and column operands
    in L2. The one tile order of every hopperkern GEMM-shaped kernel."""
    per_group = GROUP * num_cols
    first = (tile // per_group) * GROUP
    size = tl.minimum(num_rows - first, GROUP)
    local = tile % per_group
    return first + local % size, local // size


@triton.jit
def _check_inner_box(ptr, INNER: tl.constexpr):
    """Compile-time guard of every descriptor factory below: a TMA box's inner extent is at least 16 bytes."""
    tl.static_assert(INNER * ptr.dtype.element_ty.primitive_bitwidth // 8 >= 16,
                     "TMA box inner extent must be at least 16 bytes")


@triton.jit
def tile_source_2d(ptr, shape0, shape1, stride0, BLOCK0: tl.constexpr, BLOCK1: tl.constexpr,
                   USE_TMA: tl.constexpr):
    """A descriptor over a [shape0, shape1] matrix with unit inner stride when USE_TMA, else ``ptr``."""
    if USE_TMA:
        _check_inner_box(ptr, BLOCK1)
        src = tl.make_tensor_descriptor(ptr, shape=[shape0, shape1], strides=[stride0, 1],
                                        block_shape=[BLOCK0, BLOCK1])
    else:
        src = ptr
    return src


@triton.jit
def load_2d(src, off0, off1, shape0, shape1, stride0, stride1, BLOCK0: tl.constexpr, BLOCK1: tl.constexpr,
            USE_TMA: tl.constexpr):
    """Tile [BLOCK0, BLOCK1] at (off0, off1); zeros outside [shape0, shape1]."""
    if USE_TMA:
        tile = src.load([off0, off1])
    else:
        r = off0 + tl.arange(0, BLOCK0)
        c = off1 + tl.arange(0, BLOCK1)
        ptrs = src + r[:, None].to(tl.int64) * stride0 + c[None, :].to(tl.int64) * stride1
        tile = tl.load(ptrs, mask=(r[:, None] < shape0) & (c[None, :] < shape1), other=0.0)
    return tile


@triton.jit
def store_2d(dst, value, off0, off1, shape0, shape1, stride0, stride1, BLOCK0: tl.constexpr,
             BLOCK1: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a [BLOCK0, BLOCK1] tile at (off0, off1), clipped to [shape0, shape1]."""
    if USE_TMA:
        dst.store([off0, off1], value)
    else:
        r = off0 + tl.arange(0, BLOCK0)
        c = off1 + tl.arange(0, BLOCK1)
        ptrs = dst + r[:, None].to(tl.int64) * stride0 + c[None, :].to(tl.int64) * stride1
        tl.store(ptrs, value, mask=(r[:, None] < shape0) & (c[None, :] < shape1))


@triton.jit
def tile_source_3d(ptr, shape0, shape1, shape2, stride0, stride1, BLOCK1: tl.constexpr, BLOCK2: tl.constexpr,
                   USE_TMA: tl.constexpr):
    """A descriptor over a [shape0, shape1, shape2] tensor (e.g. expert weights [E, N, K]) with boxes
    [1, BLOCK1, BLOCK2] when USE_TMA, else ``ptr``."""
    if USE_TMA:
        _check_inner_box(ptr, BLOCK2)
        src = tl.make_tensor_descriptor(ptr, shape=[shape0, shape1, shape2], strides=[stride0, stride1, 1],
                                        block_shape=[1, BLOCK1, BLOCK2])
    else:
        src = ptr
    return src


@triton.jit
def load_3d(src, idx0, off1, off2, shape1, shape2, stride0, stride1, stride2, BLOCK1: tl.constexpr,
            BLOCK2: tl.constexpr, USE_TMA: tl.constexpr):
    """Tile [BLOCK1, BLOCK2] of slab ``idx0`` at (off1, off2); zeros outside [shape1, shape2]."""
    if USE_TMA:
        tile = src.load([idx0, off1, off2]).reshape(BLOCK1, BLOCK2)
    else:
        r = off1 + tl.arange(0, BLOCK1)
        c = off2 + tl.arange(0, BLOCK2)
        base = src + tl.cast(idx0, tl.int64) * stride0  # tl.cast: idx0 may be a constexpr (an int arg == 1 is one)
        ptrs = base + r[:, None].to(tl.int64) * stride1 + c[None, :].to(tl.int64) * stride2
        tile = tl.load(ptrs, mask=(r[:, None] < shape1) & (c[None, :] < shape2), other=0.0)
    return tile


@triton.jit
def store_3d(dst, value, idx0, off1, off2, shape1, shape2, stride0, stride1, stride2, BLOCK1: tl.constexpr,
             BLOCK2: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a [BLOCK1, BLOCK2] tile into slab ``idx0`` at (off1, off2), clipped to [shape1, shape2]."""
    if USE_TMA:
        dst.store([idx0, off1, off2], value.reshape(1, BLOCK1, BLOCK2))
    else:
        r = off1 + tl.arange(0, BLOCK1)
        c = off2 + tl.arange(0, BLOCK2)
        base = dst + tl.cast(idx0, tl.int64) * stride0
        ptrs = base + r[:, None].to(tl.int64) * stride1 + c[None, :].to(tl.int64) * stride2
        tl.store(ptrs, value, mask=(r[:, None] < shape1) & (c[None, :] < shape2))


@triton.jit
def tile_source_halves(ptr, shape0, half, shape2, stride0, stride1, BLOCK1: tl.constexpr, BLOCK2: tl.constexpr,
                       USE_TMA: tl.constexpr):
    """A tensor [shape0, 2 * half, shape2] (unit inner stride) whose middle dim holds two halves of ``half`` rows
    (e.g. expert weights [E, 2I, H] with gate rows then up rows), for :func:`load_halves`: a descriptor over it
    seen as [shape0, 2, half, shape2] with boxes [1, 2, BLOCK1, BLOCK2] when USE_TMA, else ``ptr``."""
    if USE_TMA:
        _check_inner_box(ptr, BLOCK2)
        src = tl.make_tensor_descriptor(ptr, shape=[shape0, 2, half, shape2],
                                        strides=[stride0, half * stride1, stride1, 1],
                                        block_shape=[1, 2, BLOCK1, BLOCK2])
    else:
        src = ptr
    return src


@triton.jit
def load_halves(src, idx0, off1, off2, half, shape2, stride0, stride1, stride2, BLOCK1: tl.constexpr,
                BLOCK2: tl.constexpr, USE_TMA: tl.constexpr):
    """Tile [2 * BLOCK1, BLOCK2] of slab ``idx0`` of a :func:`tile_source_halves` tensor: rows 0..BLOCK1-1 are
    rows off1.. of the first half, rows BLOCK1.. the same rows of the second half (middle index half + off1..);
    zeros for rows at or past ``half`` within a half and columns at or past ``shape2``, on both paths. One tile
    feeds one dot where two [BLOCK1, BLOCK2] tiles would feed two."""
    if USE_TMA:
        tile = src.load([idx0, 0, off1, off2]).reshape(2 * BLOCK1, BLOCK2)
    else:
        j = tl.arange(0, 2 * BLOCK1)
        second = (j >= BLOCK1).to(tl.int32)
        r = off1 + j - second * BLOCK1
        c = off2 + tl.arange(0, BLOCK2)
        base = src + tl.cast(idx0, tl.int64) * stride0
        ptrs = base + (second * half + r)[:, None].to(tl.int64) * stride1 + c[None, :].to(tl.int64) * stride2
        tile = tl.load(ptrs, mask=(r[:, None] < half) & (c[None, :] < shape2), other=0.0)
    return tile


@triton.jit
def load_rows(ptr, rows, row_mask, off1, shape1, stride0, stride1, BLOCK1: tl.constexpr, USE_TMA: tl.constexpr):
    """Gather rows ``rows`` (int tensor [R]) of a [*, shape1] matrix, columns off1..off1+BLOCK1.

    Row gathers have no TMA form on sm_90 (TMA gather is sm_100), so USE_TMA=True is rejected at compile time.
    """
    tl.static_assert(not USE_TMA, "row gather has no TMA path on sm_90: pass USE_TMA=False for gathered rows")
    c = off1 + tl.arange(0, BLOCK1)
    ptrs = ptr + rows[:, None].to(tl.int64) * stride0 + c[None, :].to(tl.int64) * stride1
    return tl.load(ptrs, mask=row_mask[:, None] & (c[None, :] < shape1), other=0.0)
