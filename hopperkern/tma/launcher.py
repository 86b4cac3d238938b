"""Launch plans: what an op decides on the host once per problem, and direct launches of compiled kernels.

Without a plan, an eager op call pays on every call for work whose answer only changes with the problem: the tuning
file lookup, the per-operand TMA decision, grid and split arithmetic, and Triton's own launch path
(``kernel[grid](...)`` binds and specialises every argument, builds a cache key and launch metadata; about
10 us of host time for a kernel of 40 arguments). This module holds the two pieces that remove it:

* :class:`PlanCache`: a bounded dict of per-op plans. Ops key a plan on everything the plan depends on (device,
  dtypes, shapes, strides, options, the effective TMA mode, ``HOPPERKERN_CONFIG``) and check on each hit that
  the tuning file they were built from is unchanged (:meth:`Plan.fresh`, one ``stat``).
  :func:`clear_plans` empties every cache (tests; after adding a tuning file in a running process).
* :class:`Launch`: one kernel launch with its grid and scalar arguments fixed. Its first call goes through
  ``kernel[grid](...)`` (compiling if needed) and keeps the compiled kernel; later calls pass new tensors to the
  compiled kernel's launcher directly, after checking that each tensor still matches what the binary was
  specialised for (dtype, 16-byte alignment) and that no Triton launch hook is installed (profilers). Anything
  else, the interpreter included, takes Triton's own path, so a plan is never less correct than a plain launch.

The direct path relies on ``CompiledKernel.run(grid_x, grid_y, grid_z, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *args)``, the call ``JITFunction.run`` makes in triton 3.6 to 3.9;
:func:`direct_launch_supported` gates it on those versions.
"""

from __future__ import annotations

import functools
import os
import threading

from .capability import _numbers, _triton_version, interpreter_active
from .descriptors import ensure_allocator

__all__ = ["Launch", "Plan", "PlanCache", "alignment_key", "clear_plans", "current_device", "direct_launch_supported",
           "env_key", "run_steps"]

_DIRECT_TRITON = ((3, 6), (3, 10))  # [low, high): versions whose launch call this module mirrors


@functools.lru_cache(maxsize=None)
def direct_launch_supported() -> bool:
    """Whether compiled Triton kernels may be launched directly here (the Triton version's launch call is the
    one this module mirrors). Cached; the interpreter never launches directly."""
    v = _triton_version()
    return v is not None and _DIRECT_TRITON[0] <= _numbers(v)[:2] < _DIRECT_TRITON[1]


_RUNTIME: tuple = ()


def _runtime():
    """(triton's runtime knobs, the current-stream getter, the current-device getter), looked up once."""
    global _RUNTIME
    if not _RUNTIME:
        import torch
        from triton import knobs

        _RUNTIME = (knobs.runtime, torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice)
    return _RUNTIME


def _hooks_idle(rt) -> bool:
    """No launch hook is installed (a profiler's enter/exit hooks need Triton's own launch path)."""
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def current_device() -> int:
    """The current CUDA device's index (-1 without CUDA): a plan built for a device launches directly only
    while that device is current."""
    try:
        return _runtime()[2]()
    except Exception:
        return -1


def alignment_key(*tensors) -> int:
    """Which of ``tensors`` start 16 bytes past an aligned address or more, as bits: part of every plan key, since
    the TMA decision (and the kernel binaries) depend on it."""
    bits = 0
    for i, t in enumerate(tensors):
        if t is not None and t.data_ptr() & 15:
            bits |= 1 << i
    return bits


def env_key() -> tuple:
    """The environment every plan depends on: ``HOPPERKERN_TMA`` and ``HOPPERKERN_CONFIG`` as set now (part of
    each plan key, so a changed value takes effect on the next call)."""
    env = os.environ
    return env.get("HOPPERKERN_TMA"), env.get("HOPPERKERN_CONFIG")


_CACHES: list = []
_CACHES_LOCK = threading.Lock()


class PlanCache:
    """A bounded ``key -> plan`` dict (emptied when full: plans are cheap to rebuild, keys rarely churn)."""

    __slots__ = ("name", "maxsize", "_plans")

    def __init__(self, name: str, maxsize: int = 256):
        self.name, self.maxsize, self._plans = name, maxsize, {}
        with _CACHES_LOCK:
            _CACHES.append(self)

    def get(self, key):
        return self._plans.get(key)

    def put(self, key, plan):
        if len(self._plans) >= self.maxsize:
            self._plans.clear()
        self._plans[key] = plan
        return plan

    def clear(self) -> None:
        self._plans.clear()

    def __len__(self) -> int:
        return len(self._plans)


def clear_plans() -> None:
    """Forget every cached launch plan (the next call of each op builds its plan again)."""
    with _CACHES_LOCK:
        for cache in _CACHES:
            cache.clear()


_STAMP_CURRENT = None  # hopperkern.tuning.stamp_current, set by the first Plan.bind_source


class Plan:
    """Base of the ops' launch plans: where a plan launches and the tuning file it was built from.

    ``stamp`` is :func:`hopperkern.tuning.file_stamp` of that file ((None, None) for none: defaults, a config
    given by the caller, the interpreter); :meth:`fresh` is checked on every call, one ``stat``."""

    __slots__ = ("stamp", "device", "interpreted")

    def bind_source(self, tuning_config, device) -> None:
        """Record ``tuning_config`` (a TuningConfig, or None) and the device this plan is built for."""
        global _STAMP_CURRENT
        from ..tuning import file_stamp, stamp_current

        _STAMP_CURRENT = stamp_current  # fresh() runs on every call: no import statement there
        self.stamp = (None, None) if tuning_config is None else file_stamp(tuning_config)
        self.device = device.index if device.type == "cuda" else -1
        self.interpreted = interpreter_active()

    def fresh(self) -> bool:
        return self.stamp[0] is None or _STAMP_CURRENT(self.stamp)

    def launch_here(self) -> bool:
        """Whether this call may skip the launch context (device guard, interpreter checks): a GPU plan whose
        device is the current one."""
        return not self.interpreted and self.device == current_device()


class Launch:
    """One kernel launch with everything but its tensors fixed: ``Launch(kernel, grid, *args, **kwargs)``
    takes the arguments of ``kernel[grid](*args, **kwargs)``; calling it with the tensors, in the order they
    appear in ``args`` (new tensors of the same dtypes), launches the kernel on the current stream."""

    __slots__ = ("fn", "grid", "template", "options", "tensor_pos", "dtypes", "aligned", "compiled", "device",
                 "scratch")

    def __init__(self, fn, grid, *args, **kwargs):
        import torch

        names = fn.arg_names
        full = list(args)
        params = None
        for name in names[len(args):]:
            if name not in kwargs:
                if params is None:
                    import inspect

                    params = inspect.signature(fn.fn).parameters
                if params[name].default is inspect.Parameter.empty:
                    raise TypeError(f"{fn.__name__}: no value for argument {name!r}")
                full.append(params[name].default)
                continue
            full.append(kwargs[name])
        self.fn = fn
        self.grid = tuple(grid) + (1,) * (3 - len(grid))
        self.template = full
        self.options = {k: v for k, v in kwargs.items() if k not in names}
        self.tensor_pos = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        self.dtypes = tuple(args[i].dtype for i in self.tensor_pos)
        for p in self.tensor_pos:  # a cached plan must not keep the first call's tensors alive
            full[p] = None
        self.aligned = ()
        self.compiled = None
        self.device = None
        self.scratch = False

    def __call__(self, *tensors) -> None:
        c = self.compiled
        if c is not None:
            rt, stream_of, device_of = _RUNTIME or _runtime()
            dev = device_of()
            if dev == self.device and _hooks_idle(rt) and self._matches(tensors):
                args = self.template.copy()
                for p, t in zip(self.tensor_pos, tensors):
                    args[p] = t
                if self.scratch:
                    ensure_allocator()
                g = self.grid
                c.run(g[0], g[1], g[2], stream_of(dev), c.function, c.packed_metadata, None, None, None, *args)
                return
        self._slow(tensors)

    def _matches(self, tensors) -> bool:
        for t, dt, al in zip(tensors, self.dtypes, self.aligned):
            if t.dtype != dt or (al and t.data_ptr() & 15):
                return False
        return True

    def _slow(self, tensors) -> None:
        args = self.template.copy()
        for p, t, dt in zip(self.tensor_pos, tensors, self.dtypes):
            if t.dtype != dt:
                raise TypeError(f"{self.fn.__name__}: a plan bound for {dt} was given {t.dtype}")
            args[p] = t
        kernel = self.fn[self.grid](*args, **self.options)
        if self.compiled is None and kernel is not None and not interpreter_active() and direct_launch_supported():
            self._bind(kernel, args)

    def _bind(self, kernel, args) -> None:
        if hasattr(kernel, "result"):  # an asynchronous compile's future
            return
        if not all(hasattr(kernel, a) for a in ("run", "function", "packed_metadata", "metadata")):
            return
        _, _, device_of = _runtime()
        # Alignment the binary may assume: a 16-byte aligned tensor may have been specialised as such ("D").
        self.aligned = tuple(args[p].data_ptr() % 16 == 0 for p in self.tensor_pos)
        self.scratch = bool(getattr(kernel.metadata, "global_scratch_size", 0))
        self.device = device_of()
        self.compiled = kernel


def run_steps(steps, env: dict) -> None:
    """Launch ``steps``, ``(Launch, tensor names)`` pairs, with the tensors of ``env`` (name -> tensor)."""
    for launch, names in steps:
        launch(*[env[n] for n in names])
