"""Input validation shared by every public op. One wording: ``"{name} must be {expected}, got {actual}"``.

These run on the host before any launch and use real exceptions (``assert`` vanishes under ``python -O``).
"""

from __future__ import annotations

import functools
import sys

import torch

from .errors import UnsupportedError

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # other subclasses may have no storage to ask about


def dot_precision(dtype) -> str:
    """``input_precision`` of the kernels' ``tl.dot``: fp32 inputs get true fp32 products ("ieee", not tf32);
    16-bit inputs ignore the setting."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _names(dtypes) -> str:
    return " or ".join(str(d).replace("torch.", "") for d in dtypes)


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.layout != torch.strided:  # sparse or nested: no strided memory for the kernels to read
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {str(t.layout).replace('torch.', '')}")
    if not torch.compiler.is_compiling():  # traced calls see fake tensors; the eager checks below need real ones
        check_local_memory(name, t)


def check_local_memory(name: str, t: torch.Tensor) -> None:
    """Refuse tensors whose elements are not in local memory, which the kernels would read through a raw pointer.

    - A DTensor (FSDP2 parameters outside the wrapped module's forward, tensor parallelism) has no storage of
      its own: a launch would fail with "invalid python storage", a recorded call with a missing sharding rule.
    - A plain tensor whose storage was freed (``untyped_storage().resize_(0)``, as FSDP1 does to the gathered
      parameters after the forward) keeps a stale pointer: the kernels would read garbage without an error.
    """
    dtensor = sys.modules.get("torch.distributed.tensor")  # no DTensor can exist before this module is imported
    if dtensor is not None and isinstance(t, dtensor.DTensor):
        raise TypeError(
            f"{name} must be a plain torch.Tensor, got a DTensor with placements {tuple(t.placements)}: hopperkern's "
            f"kernels read local memory. Pass {name}.full_tensor(); for FSDP2 parameters, call the op inside the "
            "forward of the module that fully_shard wraps, where they are gathered into plain tensors")
    if (type(t) in _PLAIN_TENSORS and t.layout == torch.strided and t.numel()
            and not torch._C._functorch.is_functorch_wrapped_tensor(t)  # vmap / grad wrappers have no storage
            and t.untyped_storage().nbytes() == 0):
        raise ValueError(
            f"{name} must hold its {t.numel()} elements in memory, got a tensor of shape {tuple(t.shape)} whose "
            "storage is empty (freed, as FSDP does to gathered parameters after the forward). Call the op "
            "inside the wrapped module's forward")


_VALIDATED: dict = {}  # argument metadata that passed validation once -> True
_VALIDATED_MAX = 1024


def real_tensor(t) -> bool:
    """A plain tensor with memory (not meta, not a FakeTensor or other subclass): what an eager launch path needs."""
    return type(t) in _PLAIN_TENSORS and not t.is_meta


def tensor_meta(t):
    """What the validation of one tensor argument depends on: dtype, shape, device and layout of a plain tensor,
    ``()`` for None, and None for anything else (a subclass, a DTensor, a non-tensor: validate on every call)."""
    if t is None:
        return ()
    if type(t) not in _PLAIN_TENSORS:
        return None
    return t.dtype, t.shape, t.device, t.layout


def sync_check(name: str, value, t: torch.Tensor) -> bool:
    """Whether an op runs its synchronous index check (labels, expert ids) for ``value`` of its ``check_*``
    argument: True always (one device->host sync), False never, "auto" only where the check costs no device
    sync (``t`` not on a GPU). Unchecked bad indices never give a finite wrong result: the kernels turn the
    affected tokens' outputs and gradients into NaN."""
    if value is True or value is False:
        return value
    if isinstance(value, str):
        if value == "auto":
            return not t.is_cuda
        raise ValueError(f"{name} must be True, False or 'auto', got {value!r}")
    if value is None:
        raise ValueError(f"{name} must be True, False or 'auto', got None")
    flag = _as_flag(value)
    if flag is None:  # [] or 0.0 must not turn the check off
        raise TypeError(f"{name} must be True, False or 'auto', got {value!r}")
    return flag


def _as_flag(value) -> bool | None:
    """``value`` as a bool where it is one (0 / 1 and numpy bools by their value), else None."""
    if value is True or value is False:
        return value
    if type(value).__name__ in ("bool_", "bool") or (type(value) is int and value in (0, 1)):
        return bool(value)
    return None


def check_no_transform(op: str) -> None:
    """UnsupportedError inside a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...): the kernels take
    raw device addresses, which batched and gradient-tracking wrappers do not have. One C call (~40 ns) per op
    call; skipped while torch.compile traces (there the ops are custom ops)."""
    if not torch.compiler.is_compiling() and torch._C._functorch.peek_interpreter_stack() is not None:
        raise UnsupportedError(op, ["torch.func transforms (vmap, grad, jacrev, jvp, ...) are not supported: the "
                                    "kernels read raw device memory; call the op on plain tensors (for vmap: on "
                                    "the batch flattened into rows)"])


def check_flag(name: str, value) -> bool:
    """A boolean option: True / False (0 / 1 and numpy bools by their value); anything else is a TypeError, so
    that a string such as "no" does not pass as True."""
    if value is True or value is False:
        return value
    flag = _as_flag(value)
    if flag is None:
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return flag


def options_key(*values) -> tuple:
    """Option values with their types, for a :func:`validate_once` key (True == 1 == 1.0 as dict keys)."""
    return values + tuple(type(v) for v in values)


def validate_once(key, validate, *fresh) -> None:
    """Run ``validate()`` unless arguments with the same metadata ``key`` passed it before (a hashable tuple;
    a key holding None, from :func:`tensor_meta`, is never remembered). ``fresh`` names (name, tensor) pairs whose
    memory is checked on every call all the same (:func:`check_local_memory`: a storage freed since, as FSDP does
    to gathered parameters). Validation is a pure function of the metadata, so a remembered key cannot hide an
    error; it costs a dict lookup instead of tens of checks on an op's hot path. While torch.compile traces,
    ``validate()`` runs every time and nothing is remembered: a lookup of a key holding symbolic sizes would pin
    each size to its value and recompile the graph for every new one."""
    if torch.compiler.is_compiling():
        validate()
        return
    try:
        seen = key in _VALIDATED
    except TypeError:  # an unhashable option value: validate() says what is wrong with it
        seen, key = False, (None,)
    if seen:
        for name, t in fresh:
            check_local_memory(name, t)
        return
    validate()
    if None not in key:
        if len(_VALIDATED) >= _VALIDATED_MAX:
            _VALIDATED.clear()
        _VALIDATED[key] = True


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


def check_bool(name: str, value) -> bool:
    """``value`` if it is a bool (TypeError otherwise: a truthy string or number is not taken for True)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_float(name: str, value, *, low=None, high=None, low_open=False, finite=False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond fp64's range
        raise ValueError(f"{name} must be finite and representable as a float, got {value}") from None
    if v != v:
        raise ValueError(f"{name} must not be NaN")
    if finite and v in (float("inf"), float("-inf")):
        raise ValueError(f"{name} must be finite, got {value}")
    if low is not None and (v <= low if low_open else v < low):
        raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and v > high:
        raise ValueError(f"{name} must be <= {high}, got {value}")
    return v


def check_choice(name: str, value, choices) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {tuple(choices)}, got {value!r}")
    return value


def first_order(what: str):
    """Decorator of an autograd Function's backward (outside ``once_differentiable``) whose gradients are
    first-order only: a backward with ``create_graph=True`` raises RuntimeError instead of returning gradients
    that lack their own dependence on the inputs (``once_differentiable`` alone raises only where the incoming
    gradient requires grad, not for ``loss.backward(create_graph=True)``, where a gradient penalty or a
    Hessian-vector product through the op would silently drop its terms)."""

    def wrap(backward):
        @functools.wraps(backward)
        def checked(ctx, *grads):
            if torch.is_grad_enabled():
                raise RuntimeError(f"{what}: double backward is not supported (a backward with create_graph=True): "
                                   "this op's gradients are first-order only, and treating them as constants would "
                                   "silently drop terms of the second-order result")
            return backward(ctx, *grads)

        return checked

    return wrap
