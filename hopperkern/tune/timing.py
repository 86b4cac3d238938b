"""Timing and candidate selection shared by the tuners and the benchmarks.

Everything here touches CUDA only when called: CUDA-event timing (:func:`time_cuda`), CUDA-graph capture
(:func:`capture_graph`) and graph-replay timing with a cold L2 (:func:`graph_ms`), the error measure the tuners'
reference checks use (:func:`rel_err`), and the selection loop that never lets a wrong config win
(:func:`rank_fastest`, and :func:`pick_fastest`, its first entry).
"""

from __future__ import annotations

import statistics

import torch

__all__ = ["capture_graph", "graph_ms", "pick_fastest", "rank_fastest", "rel_err", "time_cuda"]


def time_cuda(fn, *, warmup: int = 2, reps: int = 7, min_ms: float = 0.0, max_reps: int = 200,
              back_to_back: bool = False):
    """(median, p20, p80) milliseconds of ``fn()`` timed with CUDA events after ``warmup`` calls.

    Repeats at least ``reps`` times and until ``min_ms`` of samples (capped at ``max_reps``).
    ``back_to_back=False`` synchronises after every call, so each sample also holds the host time before the
    call's first kernel (validation, config lookup, launches): an isolated call. ``back_to_back=True``
    enqueues the calls one after another and synchronises once, as a training loop does: the host's work
    overlaps the previous call's kernels, and only what the op itself waits for (e.g. a host sync inside
    it) stays in the samples."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    while len(times) < reps or (sum(times) < min_ms and len(times) < max_reps):
        n = reps if back_to_back else 1
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        torch.cuda.synchronize()
        times += [a.elapsed_time(b) for a, b in ev]
    times.sort()
    q = statistics.quantiles(times, n=5) if len(times) >= 5 else [times[0], 0, 0, times[-1]]
    return statistics.median(times), q[0], q[-1]


def capture_graph(fn, *, warmup: int = 2):
    """A CUDA graph of one call of ``fn``, after ``warmup`` calls on a side stream (compiles, allocations)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


_FLUSH: dict = {}  # device index -> the 256 MiB buffer graph_ms overwrites to evict L2


def graph_ms(fn, *, calls: int = 10, warmup: int = 10, rep: int = 40, flush: bool = True) -> float:
    """Median GPU milliseconds of ONE call of ``fn`` with a cold L2: a CUDA graph of ``calls`` x (overwrite a
    256 MiB buffer, ``fn()``), replayed by triton.testing.do_bench, minus the same graph without ``fn``, divided
    by ``calls``. For launches of a few to a few hundred microseconds, where an eager loop measures the host's
    launch overhead instead of the kernels (tuners, decode sizes). Without the flush, calls 2..n would find
    the weights of call 1 in L2 (DeepSeek-V3's 8 experts of w2 are 29 MB, the H200's L2 is 50 MB): a warm
    number that decode, where every layer reads new weights, never sees. ``flush=False`` keeps them warm."""
    import triton

    dev = torch.cuda.current_device()
    if flush and dev not in _FLUSH:
        _FLUSH[dev] = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    buf = _FLUSH.get(dev)

    def many(with_fn=True):
        for _ in range(calls):
            if flush:
                buf.zero_()
            if with_fn:
                fn()  # outputs are dropped at once, so the graph's pool reuses one set of buffers

    g = capture_graph(many, warmup=1)
    total = triton.testing.do_bench(g.replay, warmup=warmup, rep=rep, return_mode="median")
    if not flush:
        return total / calls
    base = capture_graph(lambda: many(False), warmup=1)
    return max(total - triton.testing.do_bench(base.replay, warmup=warmup, rep=rep, return_mode="median"),
               0.0) / calls


def rel_err(out, ref) -> float:
    """max |out - ref| / max |ref| in fp64 (inf when out has a NaN or inf)."""
    out, ref = out.double(), ref.double()
    if not bool(torch.isfinite(out).all()):
        return float("inf")
    return ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def pick_fastest(cands, run, timer, *, log=print, what="", check=None, tol: float = 2e-2, rounds: int = 3,
                 settle_s: float = 0.0):
    """(ms, config) of the fastest candidate that runs and computes the right thing, or None: the first of
    :func:`rank_fastest`."""
    ranked = rank_fastest(cands, run, timer, log=log, what=what, check=check, tol=tol, rounds=rounds,
                          settle_s=settle_s)
    return ranked[0] if ranked else None


def rank_fastest(cands, run, timer, *, log=print, what="", check=None, tol: float = 2e-2, rounds: int = 3,
                 settle_s: float = 0.0) -> list:
    """``[(ms, config), ...]`` of the candidates that run and compute the right thing, fastest first.

    ``run(cfg)`` launches the op with ``cfg`` (its first call compiles, outside any timing or graph capture);
    ``timer(fn)`` returns the milliseconds of ``fn``; ``check(cfg)``, when given, returns the candidate's error
    against a reference computed outside the kernels under test. A candidate that raises (shared memory,
    registers, compile) or whose error is above ``tol`` (a miscompiled or mis-indexed config) is logged and
    skipped: a tuner must never ship a fast wrong config.

    A GPU's clock drifts within seconds of sustained load (it boosts when idle and slows as it heats or meets
    its power limit), so candidates timed one after another would favour whichever went first. So the
    candidates that pass are timed after ``settle_s`` seconds of back-to-back calls of the first of them (the
    clock's settling, not timed), in ``rounds`` rounds, round r in the order rotated by r places (every
    candidate takes every place once when there are as many rounds as candidates). Each time is divided by
    its round's median (a clock that drops between rounds moves every candidate of the later rounds alike),
    and the candidates are ranked by the median of those ratios (ties keep the candidates' order). Each ms is the
    candidate's median time (what a caller adds up across separate picks)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    valid = []
    for cfg in cands:
        try:
            run(cfg)
            err = check(cfg) if check is not None else 0.0
        except Exception as exc:  # out of shared memory / registers, compile error: skip the candidate
            _skip(log, what, cfg, exc)
            continue
        if not err <= tol:  # also catches NaN
            log(f"    {what} {cfg.model_dump()} skipped: error {err:.3g} > {tol:g} against the reference")
            continue
        valid.append(cfg)
    if valid and settle_s > 0:
        try:
            _settle(lambda: run(valid[0]), settle_s)
        except Exception as exc:  # the timing rounds below drop a candidate that fails again
            _skip(log, what + " settling", valid[0], exc)
    samples: dict = {i: {} for i in range(len(valid))}  # candidate -> {round: ms}
    for r in range(rounds):
        for j in range(len(valid)):
            i = (j + r) % len(valid)
            if i not in samples:  # failed in an earlier round
                continue
            cfg = valid[i]
            try:
                samples[i][r] = timer(lambda: run(cfg))
            except Exception as exc:  # fails only when timed (a graph capture, say): drop the candidate
                _skip(log, what, cfg, exc)
                del samples[i]
    level = {r: statistics.median([t[r] for t in samples.values() if r in t]) for r in range(rounds)
             if any(r in t for t in samples.values())}
    ranked = []
    for i, times in samples.items():
        # A round whose median is 0 (graph_ms clamps a time below its baseline to 0) ranks nobody.
        score = statistics.median([ms / level[r] if level[r] > 0 else 1.0 for r, ms in times.items()])
        ms = statistics.median(times.values())
        rounds_us = ", ".join(f"{t * 1e3:.1f}" for t in times.values())
        log(f"    {what} {valid[i].model_dump()} {ms * 1e3:.1f} us (rounds {rounds_us}; {score:.3f} of the rounds' "
            "medians)")
        ranked.append((score, i, ms, valid[i]))
    return [(ms, cfg) for _, _, ms, cfg in sorted(ranked, key=lambda item: item[:2])]


def _settle(fn, seconds: float) -> None:
    """Call ``fn`` back to back for about ``seconds`` (synchronising every few calls, so the queue stays short)."""
    import time

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()


def _skip(log, what, cfg, exc) -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    log(f"    {what} {cfg.model_dump()} skipped: {type(exc).__name__}: {str(exc)[:100]}")
