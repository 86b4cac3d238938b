"""Launch plans: what an op decides on the host once per problem, and direct launches of compiled kernels.

Without a plan, an eager op call pays on every call for work whose answer only changes with the problem: the tuning
file lookup, the per-operand TMA decision, grid and split arithmetic, and Triton's own launch path
(``kernel[grid](...)`` binds and specialises every argument, builds a cache key and launch metadata; about
10 us of host time for a kernel of 40 arguments). This module holds the two pieces that remove it:

* :class:`PlanCache`: a bounded dict of per-op plans. Ops key a plan on everything the plan depends on (device,
  dtypes, shapes, strides, options, the effective TMA mode, ``HOPPERKERN_CONFIG``, ``HOPPERKERN_PDL``) and check on
  each hit that the tuning file they were built from is unchanged (:meth:`Plan.fresh`, one ``stat``).
  :func:`clear_plans` empties every cache (tests; after adding a tuning file in a running process).
* :class:`Launch`: one kernel launch with its grid and scalar arguments fixed. Its first call goes through
  ``kernel[grid](...)`` (compiling if needed) and keeps the compiled kernel; later calls hand new tensors' addresses
  to the compiled kernel's C launcher, after checking that each tensor still matches what the binary was
  specialised for (dtype, 16-byte alignment) and that no Triton launch hook is installed (profilers). Anything
  else, the interpreter included, takes Triton's own path, so a plan is never less correct than a plain launch.
  :func:`run_steps` launches a plan's steps, reading the device, stream and hook state once.
* :class:`LaunchCache`: a :class:`PlanCache` of single launches, for ops whose launches are not steps of one plan
  (keys built with :func:`state_key` and :func:`tensors_key`).

The direct path relies on the C launcher's call ``launch(grid_x, grid_y, grid_z, stream, function, cooperative,
pdl, global_scratch, profile_scratch, packed_metadata, launch_metadata, enter_hook, exit_hook, *args)`` that
triton 3.6 to 3.9 make from ``CompiledKernel.run``; :func:`direct_launch_supported` gates it on those versions,
and a launcher of another layout (or one that wants profiling scratch) is never bound.
"""

from __future__ import annotations

import functools
import os
import threading

from .._host import round_up
from .capability import _numbers, _triton_version, interpreter_active
from .descriptors import ensure_allocator, record_decision

__all__ = ["Launch", "LaunchCache", "Plan", "PlanCache", "alignment_key", "chain_launches", "clear_plans",
           "current_device", "direct_launch_supported", "env_key", "launch_at", "launch_state", "pdl_enabled",
           "run_direct", "run_steps", "scratch_offsets", "state_key", "tensors_key", "PIECE_ALIGN"]

PIECE_ALIGN = 128  # bytes: where every piece of a plan's per-call allocation starts (TMA's and any binary's need)

_DIRECT_TRITON = ((3, 6), (3, 10))  # [low, high): versions whose launch call this module mirrors


@functools.lru_cache(maxsize=None)
def direct_launch_supported() -> bool:
    """Whether compiled Triton kernels may be launched directly here (the Triton version's launch call is the
    one this module mirrors). Cached; the interpreter never launches directly."""
    v = _triton_version()
    return v is not None and _DIRECT_TRITON[0] <= _numbers(v)[:2] < _DIRECT_TRITON[1]


_RUNTIME: tuple = ()


def _runtime():
    """(triton's runtime knobs, the current-stream getter, the current-device getter, triton's allocation module),
    looked up once."""
    global _RUNTIME
    if not _RUNTIME:
        import torch
        from triton import knobs
        from triton.runtime import _allocation

        _RUNTIME = (knobs.runtime, torch._C._cuda_getCurrentRawStream, torch._C._cuda_getDevice, _allocation)
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
        return (_RUNTIME or _runtime())[2]()
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


_ENV_NAMES = ("HOPPERKERN_TMA", "HOPPERKERN_CONFIG", "HOPPERKERN_PDL")


def _raw_environ():
    """``os.environ``'s own store and the keys of :data:`_ENV_NAMES` as stored there: a read of it costs a dict
    lookup, where ``os.environ.get`` encodes the key and decodes the value on every call. It is the store
    ``os.environ`` reads and writes itself, so it sees every change made through ``os.environ``; ``(None, ...)``
    where the layout differs."""
    env = os.environ
    data, encode = getattr(env, "_data", None), getattr(env, "encodekey", None)
    if not isinstance(data, dict) or encode is None:
        return (None,) + _ENV_NAMES
    return (data,) + tuple(encode(name) for name in _ENV_NAMES)


_ENVIRON = _raw_environ()
_ENVIRON_OF = os.environ  # the mapping _ENVIRON was read from (a replaced os.environ is read anew)


def env_key() -> tuple:
    """The environment every plan depends on: ``HOPPERKERN_TMA``, ``HOPPERKERN_CONFIG`` and ``HOPPERKERN_PDL`` as
    set now (part of each plan key, so a changed value takes effect on the next call), as ``os.environ`` stores
    them."""
    global _ENVIRON, _ENVIRON_OF
    if os.environ is not _ENVIRON_OF:
        _ENVIRON, _ENVIRON_OF = _raw_environ(), os.environ
    data, tma, config, pdl = _ENVIRON
    if data is None:
        env = os.environ
        return env.get(tma), env.get(config), env.get(pdl)
    return data.get(tma), data.get(config), data.get(pdl)


_PDL_OFF = ("0", "off", "false", "no")
_PDL_ON = ("", "1", "on", "true", "yes")


def pdl_enabled(device=None) -> bool:
    """Whether a plan built now for ``device`` may chain its kernels with programmatic dependent launch
    (:func:`chain_launches`): the GPU, CUDA and Triton support it (:attr:`hopperkern.tma.Capability.pdl`) and
    ``HOPPERKERN_PDL`` is not ``0`` / ``off`` / ``false`` / ``no`` (unset, ``1``, ``on``, ``true``, ``yes``: on where
    supported; anything else raises ValueError). Read when a plan is built; the variable is part of
    :func:`env_key`, so a changed value takes effect on the next call."""
    from .capability import capability

    value = env_key()[2]
    if value is not None:
        text = (value.decode(errors="replace") if isinstance(value, bytes) else value).strip().lower()
        if text in _PDL_OFF:
            return False
        if text not in _PDL_ON:
            raise ValueError(f"HOPPERKERN_PDL must be one of 0, off, false, no (off) or 1, on, true, yes (on), "
                             f"got {text!r}")
    return capability(device).pdl


def chain_launches(steps, enabled: bool):
    """Chain a plan's ``(Launch, tensor names)`` steps, which run in this order on one stream, with programmatic
    dependent launch when ``enabled`` (:func:`pdl_enabled`): every launch but the first is a dependent (it may
    start while the one before it drains, and waits on the device before touching memory), every launch but the
    last lets its dependent start early. Kernels without the chain flags (``PDL_WAIT``, ``PDL_TRIGGER``; see
    :func:`hopperkern.tma.jit.chain_start`) simply keep stream order. Must run before the steps' first call.
    The first launch never waits on the device for what came before the plan, so it is launched in plain
    stream order. Returns ``steps``."""
    if enabled:
        last = len(steps) - 1
        for i, (launch, _) in enumerate(steps):
            launch.chain(wait=i > 0, trigger=i < last)
    return steps


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


class LaunchCache(PlanCache):
    """``key -> (Launch, TmaDecision or None)``: single launches bound once per problem, for ops whose launches
    are not part of one plan (:meth:`launch`)."""

    __slots__ = ()

    def launch(self, key: tuple, build) -> Launch:
        """The :class:`Launch` of ``key`` (``build()`` -> ``(Launch, TmaDecision or None)`` on first use), its
        decision recorded for this call as a fresh one would be (``tma.last_decision``). Keys hold the launch's
        name, the device, :func:`state_key`, and whatever else fixes the launch: sizes, strides, options and
        :func:`tensors_key` of its tensors. After its first call a bound launch hands the compiled kernel's C
        launcher the tensors' addresses (no Triton launch path, no TMA decision per call)."""
        entry = self._plans.get(key)
        if entry is None:
            entry = self.put(key, build())
        if entry[1] is not None:
            record_decision(entry[1])
        return entry[0]


def state_key() -> tuple:
    """The part of a launch key that the process state decides: :func:`env_key` and whether the interpreter runs."""
    return env_key(), interpreter_active()


def tensors_key(tensors) -> tuple:
    """The part of a launch key that the launch's tensors decide beyond sizes and strides: their dtypes (a launch
    is bound for them) and 16-byte alignment (:func:`alignment_key`)."""
    return tuple(t.dtype for t in tensors), alignment_key(*tensors)


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

    def direct_stream(self, launches):
        """The current stream, when every launch of ``launches`` (None entries skipped) is bound on this plan's
        device, that device is current and no launch hook is installed: the call may then go direct
        (:meth:`Launch.direct`, :func:`run_direct`) with addresses for its scratch. None otherwise."""
        if self.interpreted:
            return None
        for launch in launches:
            if launch is not None and (launch.c_launch is None or launch.device != self.device):
                return None
        here = launch_state()
        return here[1] if here is not None and here[0] == self.device else None


class Launch:
    """One kernel launch with everything but its tensors fixed: ``Launch(kernel, grid, *args, **kwargs)``
    takes the arguments of ``kernel[grid](*args, **kwargs)``; calling it with the tensors, in the order they
    appear in ``args`` (new tensors of the same dtypes, on the device of the first call), launches the kernel on
    the current stream.

    After the first call the launch goes straight to the compiled kernel's C launcher: tensors travel as their
    addresses, after a check of each one's dtype, device and alignment against the binding, and the descriptor
    scratch comes from the plan's own allocation (:func:`scratch_offsets`) or from Triton's allocator."""

    __slots__ = ("fn", "grid", "template", "options", "tensor_pos", "dtypes", "aligned", "compiled", "device",
                 "c_launch", "c_head", "c_meta", "scratch")

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
        self.c_launch = None
        self.scratch = None  # (bytes, alignment) of the descriptor scratch, once bound

    def __call__(self, *tensors) -> None:
        launch_at(self, launch_state() if self.c_launch is not None else None, tensors)

    def chain(self, wait: bool, trigger: bool) -> None:
        """Set this launch's place in a programmatic-dependent chain (:func:`chain_launches`) before its first
        call: ``wait``, launched as a dependent of the kernel before it (``launch_pdl``; the kernel waits on the
        device first); ``trigger``, lets the kernel after it start early. A kernel without the chain flags
        keeps plain stream order."""
        names = self.fn.arg_names
        if self.compiled is not None:
            raise RuntimeError(f"{self.fn.__name__}: a launch is chained before its first call")
        if "PDL_WAIT" not in names or "PDL_TRIGGER" not in names:
            return
        self.template[names.index("PDL_WAIT")] = bool(wait)
        self.template[names.index("PDL_TRIGGER")] = bool(trigger)
        if wait:
            self.options["launch_pdl"] = True
        else:
            self.options.pop("launch_pdl", None)

    def direct(self, stream: int, tensors, scratch: int | None = None) -> bool:
        """Launch on ``stream`` through the bound C launcher; False (nothing launched) when a tensor does not match
        what the binary was specialised for (dtype, 16-byte alignment). An int in place of a tensor is an address
        taken as it is: a plan's own scratch, laid out with the alignment the launch was bound with. ``scratch``:
        the address of this launch's descriptor scratch in a plan's allocation (:func:`scratch_offsets`); without
        it the scratch comes from Triton's allocator, as on Triton's own path."""
        args = self.template.copy()
        for p, t, dt, al in zip(self.tensor_pos, tensors, self.dtypes, self.aligned):
            if t.__class__ is int:  # an address a plan laid out itself (see run_direct)
                args[p] = t
                continue
            if t.dtype != dt or t.get_device() != self.device:  # another device: Triton's path says what is wrong
                return False
            ptr = t.data_ptr()
            if al and ptr & 15:
                return False
            args[p] = ptr
        buf = None
        if not self.scratch:
            scratch = None
        elif scratch is None:
            size, align = self.scratch
            buf = _scratch_allocator()(size, align, stream)  # held until the launch is enqueued
            scratch = buf.data_ptr()
        g = self.grid
        self.c_launch(g[0], g[1], g[2], stream, *self.c_head, scratch, None, self.c_meta, None, None, None, *args)
        return True

    def _slow(self, tensors) -> None:
        ensure_allocator()  # descriptor scratch in this thread's context, as a decision made now would install it
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
        launcher = kernel.run
        fields = ("launch", "launch_cooperative_grid", "launch_pdl", "global_scratch_size", "global_scratch_align",
                  "profile_scratch_size", "num_ctas")
        if not all(hasattr(launcher, f) for f in fields) or launcher.profile_scratch_size:
            return  # another launcher layout, or a profiling build: Triton's own path
        device_of = _runtime()[2]
        # Alignment the binary may assume: a 16-byte aligned tensor may have been specialised as such ("D").
        self.aligned = tuple(args[p].data_ptr() % 16 == 0 for p in self.tensor_pos)
        g = self.grid
        size = launcher.global_scratch_size
        self.scratch = (g[0] * g[1] * g[2] * launcher.num_ctas * size, launcher.global_scratch_align) if size else None
        self.c_head = (kernel.function, launcher.launch_cooperative_grid, launcher.launch_pdl)
        self.c_meta = kernel.packed_metadata
        self.device = device_of()
        self.compiled = kernel
        self.c_launch = launcher.launch


def _scratch_allocator():
    """Triton's allocator for kernel scratch in this context, installing hopperkern's where none is set."""
    _allocation = (_RUNTIME or _runtime())[3]
    alloc = _allocation._allocator.get()
    if isinstance(alloc, _allocation.NullAllocator):
        ensure_allocator()
        alloc = _allocation._allocator.get()
    return alloc


def launch_state():
    """(current device, its current stream) when bound launches may go direct: no Triton launch hook installed
    (a profiler's enter/exit hooks need Triton's own launch path); None otherwise."""
    rt, stream_of, device_of, _ = _RUNTIME or _runtime()
    if not _hooks_idle(rt):
        return None
    dev = device_of()
    return dev, stream_of(dev)


def run_steps(steps, env: dict) -> None:
    """Launch ``steps``, ``(Launch, tensor names)`` pairs, with the tensors of ``env`` (name -> tensor). The device,
    stream and hook state are read once for all of them."""
    here, read = None, False
    for launch, names in steps:
        if launch.c_launch is not None and not read:
            here, read = launch_state(), True
        launch_at(launch, here, [env[n] for n in names])


def launch_at(launch: Launch, here, tensors) -> None:
    """``launch(*tensors)`` with ``here``, :func:`launch_state` read beforehand: direct where the launch is bound
    on that device and takes the tensors, else Triton's own path (None for ``here`` asks for it)."""
    if launch.c_launch is None or here is None or here[0] != launch.device or not launch.direct(here[1], tensors):
        launch._slow(tensors)


def run_direct(steps, env: dict, stream: int, scratch=None) -> bool:
    """Launch ``steps`` in order on ``stream``, each through its bound C launcher, with the values of ``env`` (tensors,
    or addresses a plan laid out in its own scratch). ``scratch``: per step, the address of its descriptor scratch
    (None: Triton's allocator). False as soon as one cannot go direct (that one and those after it not launched):
    the caller then runs all of them again with tensors (:func:`run_steps`), which is right because a plan's steps
    only read the inputs and what earlier steps of the same call wrote."""
    for i, (launch, names) in enumerate(steps):
        if launch.c_launch is None or not launch.direct(stream, [env[n] for n in names],
                                                        None if scratch is None else scratch[i]):
            return False
    return True


def scratch_offsets(launches, start: int) -> tuple[tuple, int]:
    """Where the descriptor scratch of each bound launch of ``launches`` lies in one allocation whose first
    ``start`` bytes a plan uses for itself: byte offsets (None for a None entry or a launch without scratch), each
    aligned as the launch asks and to at least 128 bytes, and the allocation's size (a multiple of 128). One
    allocation per call then serves the plan's buffers and every launch's scratch."""
    offsets, at = [], start
    for launch in launches:
        need = None if launch is None else launch.scratch
        if not need:
            offsets.append(None)
            continue
        size, align = need
        at = round_up(at, max(align, PIECE_ALIGN))
        offsets.append(at)
        at += size
    return tuple(offsets), round_up(at, PIECE_ALIGN)


