"""Host side of the TMA layer: operand eligibility, mode resolution, descriptor factories, allocator.

Launchers call :func:`decide` once per launch with every operand that could go through TMA and its block
shape; the answer says, per operand, whether the kernel gets a tensor descriptor (``USE_TMA`` constexpr True)
or plain pointer loads. ``tma="always"`` turns an ineligible operand into an :class:`UnsupportedError` that
lists the reasons. The last decision per op is kept for tests and for ``python -m hopperkern.info``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from .capability import UnsupportedError, capability, interpreter_active

__all__ = [
    "TMA_MODES",
    "TmaDecision",
    "decide",
    "decision_count",
    "ensure_allocator",
    "last_decision",
    "make_descriptor",
    "resolve_mode",
    "record_decision",
    "tma_not_supported_reasons",
]

TMA_MODES = ("auto", "always", "never")
_MAX_BOX = 256  # TMA box extent limit per dimension (elements)


def resolve_mode(mode: str) -> str:
    """The effective TMA mode: ``HOPPERKERN_TMA`` (read now, at call time) overrides ``mode``."""
    if not isinstance(mode, str) or mode not in TMA_MODES:
        raise ValueError(f"tma must be one of {TMA_MODES}, got {mode!r}")
    env = os.environ.get("HOPPERKERN_TMA")
    if env is not None and env != "":
        if env not in TMA_MODES:
            raise ValueError(f"HOPPERKERN_TMA must be one of {TMA_MODES}, got {env!r}")
        return env
    return mode


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


_REASONS_MEMO: dict = {}
_REASONS_MEMO_MAX = 4096


def tma_not_supported_reasons(t, block_shape: Sequence[int]) -> list[str]:
    """Why ``t`` cannot be read/written through a TMA descriptor with boxes of ``block_shape``.

    Returns a list of sentences; ``[]`` means TMA can be used for ``t`` on this machine. Every launch asks this
    for each operand, so answers are memoised on what they depend on (the device's Capability, dtype, shape,
    strides, base address modulo 16, block).
    """
    cap = capability(t.device if getattr(t, "is_cuda", False) else None)
    try:
        key = (id(cap), str(t.device), t.dtype, tuple(t.shape), tuple(t.stride()), t.data_ptr() % 16,
               tuple(int(b) for b in block_shape))
    except Exception:  # not a torch tensor: no memo
        return _reasons(t, block_shape, cap)
    hit = _REASONS_MEMO.get(key)
    if hit is None or hit[0] is not cap:  # the Capability object is kept, so its id cannot be reused
        if len(_REASONS_MEMO) >= _REASONS_MEMO_MAX:
            _REASONS_MEMO.clear()
        hit = _REASONS_MEMO[key] = (cap, tuple(_reasons(t, block_shape, cap)))
    return list(hit[1])


def _reasons(t, block_shape: Sequence[int], cap) -> list[str]:
    reasons: list[str] = []
    if not cap.interpreter:
        if not getattr(t, "is_cuda", False):
            reasons.append(f"tensor is on {t.device}, not on a CUDA device")
        elif not cap.tma:
            reasons.extend(cap.reasons)
    nd = t.dim()
    block_shape = tuple(int(b) for b in block_shape)
    if not 2 <= nd <= 5:
        reasons.append(f"tensor has {nd} dims; device-side TMA descriptors need 2 to 5")
    if len(block_shape) != nd:
        reasons.append(f"block shape {block_shape} has {len(block_shape)} dims, tensor has {nd}")
    es = t.element_size()
    if es not in (1, 2, 4, 8):
        reasons.append(f"element size {es} bytes is not 1, 2, 4 or 8")
    for i, b in enumerate(block_shape):
        if not _is_pow2(b) or b > _MAX_BOX:
            reasons.append(f"block dim {i} = {b} must be a power of two <= {_MAX_BOX}")
    if block_shape and (block_shape[-1] * es) % 16 != 0:
        reasons.append(f"block inner extent {block_shape[-1]} x {es} bytes is not a multiple of 16 bytes")
    if nd >= 1:
        if any(s == 0 for s in t.shape):
            reasons.append(f"tensor has a zero-size dim (shape {tuple(t.shape)})")
        if t.stride(-1) != 1:
            reasons.append(f"last stride is {t.stride(-1)}, must be 1 (inner dim contiguous)")
        for d in range(nd - 1):
            if (t.stride(d) * es) % 16 != 0:
                reasons.append(f"stride({d})={t.stride(d) * es} bytes is not a multiple of 16")
        if any(s >= 2**32 for s in t.shape):
            reasons.append(f"a dim of shape {tuple(t.shape)} is >= 2**32")
    if t.data_ptr() % 16 != 0:
        reasons.append(f"base address is {t.data_ptr() % 16} bytes past a 16-byte boundary: it is not 16-byte "
                       "aligned")
    return reasons


@dataclass(frozen=True)
class TmaDecision:
    """Which operands of one launch go through TMA, and why the others do not."""

    op: str
    mode: str
    use: Mapping[str, bool]
    reasons: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def __getitem__(self, name: str) -> bool:
        return self.use[name]

    @property
    def any(self) -> bool:
        return any(self.use.values())


_LAST: dict[str, TmaDecision] = {}
_COUNT: dict[str, int] = {}  # op -> launches recorded (fresh decisions and cached plans' alike)


def decide(mode: str, operands: Mapping[str, tuple[object, Sequence[int]]], *, op: str,
           record: bool = True, auto_pointer: str | None = None) -> TmaDecision:
    """Decide TMA per operand for one launch of ``op``.

    ``operands`` maps a name to ``(tensor, block_shape)``. ``"never"``: all pointer loads. ``"auto"``: TMA
    for each eligible operand, unless the launcher passes ``auto_pointer`` (a sentence saying why pointer
    loads are faster for this launch): then pointer loads for all, with that reason. ``"always"``: TMA for
    all, or :class:`UnsupportedError` listing the reasons.
    ``record=False`` (a launch plan's build, which records its decision when it launches): not reported by
    :func:`last_decision` / :func:`decision_count` here.
    """
    m = resolve_mode(mode)
    if m == "never" or (m == "auto" and auto_pointer):
        why = "tma='never'" if m == "never" else auto_pointer
        d = TmaDecision(op, m, {k: False for k in operands}, {k: (why,) for k in operands})
    else:
        why = {k: tuple(tma_not_supported_reasons(t, b)) for k, (t, b) in operands.items()}
        if m == "always" and any(why.values()):
            lines = [f"{k}: {r}" for k, rs in why.items() for r in rs]
            raise UnsupportedError(f"{op}: tma='always' was asked for, but TMA cannot be used", lines)
        d = TmaDecision(op, m, {k: not rs for k, rs in why.items()}, why)
    if any(d.use.values()):
        ensure_allocator()
    if record:
        record_decision(d)
    return d


def record_decision(d: TmaDecision) -> None:
    """Make ``d`` (a cached plan's decision, reused for this launch) what :func:`last_decision` reports, and count
    the launch (:func:`decision_count`)."""
    _LAST[d.op] = d
    _COUNT[d.op] = _COUNT.get(d.op, 0) + 1


def decision_count(op: str) -> int:
    """How many launches of ``op`` recorded a TMA decision in this process (a fresh one, or a cached plan's)."""
    return _COUNT.get(op, 0)


def last_decision(op: str) -> TmaDecision | None:
    """The TMA decision of the most recent launch of ``op`` in this process (for tests and reports)."""
    return _LAST.get(op)


def _torch_allocator(size: int, alignment: int, stream):
    import torch

    # Scratch for device-side descriptors (128 bytes per program); the caching allocator keeps it cheap and
    # capture-safe under CUDA graphs.
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Install a global-memory allocator for device-side tensor descriptors in the CURRENT context.

    triton >= 3.5 keeps the allocator in a context variable, so a worker thread (or code run in a fresh
    ``contextvars.Context``) starts with none ("no allocator was set"); every launcher calls this where it
    launches. The check reads the context variable each time (cheap), so no per-thread flag can go stale.
    A user's own allocator is kept. The interpreter needs none.
    """
    if interpreter_active():
        return
    import triton

    try:
        from triton.runtime._allocation import NullAllocator, _allocator

        if not isinstance(_allocator.get(), NullAllocator):
            return
    except Exception:  # layout of triton's private module changed: install ours unconditionally
        pass
    triton.set_allocator(_torch_allocator)


def make_descriptor(t, block_shape: Sequence[int]):
    """A host-side ``TensorDescriptor`` over ``t`` with boxes of ``block_shape``, or UnsupportedError."""
    reasons = tma_not_supported_reasons(t, block_shape)
    if reasons:
        raise UnsupportedError("cannot build a TMA descriptor", reasons)
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [int(b) for b in block_shape])
