"""``hopperkern.tma``: the one layer that knows about hardware, Triton versions and TMA.

Host side: :func:`capability`, :func:`tma_not_supported_reasons`, :func:`decide` (per-operand TMA choice for
``tma="auto"|"always"|"never"``, overridden by ``HOPPERKERN_TMA`` at call time), descriptor factories and the
allocator for device-side descriptors. Device side (``hopperkern.tma.jit``): load/store helpers that take a
pointer or a descriptor and switch on a constexpr, so every kernel keeps one body for both memory paths.
"""

from .capability import (
    Capability,
    UnsupportedError,
    capability,
    check_interpreter,
    interpreter_active,
    interpreter_dtype_problems,
    interpreter_problems,
    launch_context,
    normalize_device_name,
    ptx_approx_math,
    torch_mm_out_dtype,
)
from .launcher import clear_plans
from .descriptors import (
    TMA_MODES,
    TmaDecision,
    decide,
    decision_count,
    ensure_allocator,
    last_decision,
    make_descriptor,
    record_decision,
    resolve_mode,
    tma_not_supported_reasons,
)

__all__ = [
    "TMA_MODES",
    "Capability",
    "TmaDecision",
    "UnsupportedError",
    "capability",
    "clear_plans",
    "check_interpreter",
    "decide",
    "decision_count",
    "ensure_allocator",
    "interpreter_active",
    "interpreter_dtype_problems",
    "interpreter_problems",
    "last_decision",
    "launch_context",
    "make_descriptor",
    "record_decision",
    "normalize_device_name",
    "ptx_approx_math",
    "resolve_mode",
    "tma_not_supported_reasons",
    "torch_mm_out_dtype",
]
