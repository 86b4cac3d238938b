"""Host cost of eager calls: what one call of an op costs the CPU, beside what it costs the GPU.

For ``fused_moe`` at 1, 16 and 256 tokens on the five MoE shapes, and for the LCE forward (log-probs +
entropy, no grad) and forward + backward (RL), the backward alone, and a mean cross-entropy loss with its
gradients (SFT) at 256 and 2048 tokens (llama3-8B head), three figures per call:

  host_us     time to issue one call without synchronising: the median over batches of HOST_BATCH calls, each
              batch started on an idle GPU (the GPU work queues up behind; the queue never fills); host_p25_us is
              the lower quartile of the same batches (host time only grows with interference: other processes,
              interrupts). The baselines below are the lowest median of three such measurements;
              trivial_adjacent_us is the trivial launch timed again right before each row (host_in_adjacent_trivial
              divides by it, which cancels drift of the host's speed within a run). Ops that synchronise inside
              (check_labels / check_ids = True) pay that here.
  eager_us    an eager loop of CALLS calls, one synchronisation at the end, per call (what a training or
              serving loop sees: host and GPU overlap, the slower of the two wins)
  graph_us    the same call replayed from a CUDA graph (GPU time without the host; ops with a host sync
              inside run with check "auto", which does not synchronise)

and, measured in the same run, the host cost of one trivial Triton launch (``trivial_triton_us``), of one
small torch op (``small_torch_us``) and of one autograd round trip (``autograd_us``: ``torch.autograd.grad``
through a custom Function that launches nothing, the engine's fixed cost that every backward call pays;
``autograd_calling_thread_us`` the same with the backward on the calling thread, see below), to
which the host figures are compared: absolute microseconds differ between hosts, these ratios hold.
``launches`` counts the kernels one call enqueues (torch profiler). ``lce.backward`` is the backward alone,
``torch.autograd.grad`` over a kept forward graph (``retain_graph``), so on the 4-pass path (the 3-pass path's
backward consumes what its forward kept, once); its ``host_net_us`` subtracts the autograd round trip, leaving
what the op's own backward costs the host. ``grad_path`` names the path an LCE row with a backward ran.
``host_calling_thread_us`` (LCE rows with a backward): ``host_us`` again with the backward on the calling thread
(``torch.autograd.set_multithreading_enabled(False)``), where the autograd engine does not hand it to its
worker thread and wait.

    python -m benchmarks.bench_host --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_lce import rl_path_name
from benchmarks.common import capture_graph, kernel_profile, run_meta, write_csv
from hopperkern.tune.shapes import MOE_SHAPES

MOE_TOKENS = (1, 16, 256)
LCE_SHAPE = (4096, 128256)  # H, V
LCE_TOKENS = (256, 2048)
CALLS = 200
HOST_BATCH = 10  # calls per host-time batch: at most ~200 launches queued, far below the GPU's queue depth


def _loop_us(fn, calls: int, *, wait: bool) -> float:
    """Microseconds per call of ``calls`` back-to-back calls after one warm-up; ``wait``: the clock stops after
    the GPU finished them (eager time), else as soon as the last call returned."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    if wait:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def host_stats(fn, calls=CALLS * 2, batch: int = HOST_BATCH) -> tuple[float, float]:
    """Host time per call, (median, lower quartile) over batches of ``batch`` calls, each batch started on an idle
    GPU, so the launch queue never fills and the host is never held back by the GPU (a long loop of calls whose
    GPU time exceeds their host time would measure the GPU instead)."""
    per_batch = [_loop_us(fn, batch, wait=False) for _ in range(max(4, calls // batch))]
    return statistics.median(per_batch), statistics.quantiles(per_batch, n=4)[0]


def host_us(fn, calls=CALLS * 2, batch: int = HOST_BATCH) -> float:
    return host_stats(fn, calls, batch)[0]


_TRIVIAL: list = []  # the trivial Triton launch of baselines(), timed again beside every row


def host_row(fn, calls=CALLS * 2) -> dict:
    """host_us and host_p25_us of ``fn``, and ``trivial_adjacent_us``: the trivial launch's median timed right
    before, the same way (the ratio to it cancels drift of the host's speed within a run)."""
    adjacent = host_stats(_TRIVIAL[0], calls)[0] if _TRIVIAL else None
    median, p25 = host_stats(fn, calls)
    return dict(host_us=median, host_p25_us=p25, trivial_adjacent_us=adjacent)


def eager_us(fn, calls=CALLS) -> float:
    return _loop_us(fn, calls, wait=True)


def graph_us(fn, calls=50) -> float:
    g = capture_graph(fn)
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / calls * 1e6


def count_launches(fn) -> int:
    return len(kernel_profile(fn))


def baselines() -> dict:
    import triton
    import triton.language as tl

    @triton.jit
    def _trivial(x_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    class _Nothing(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.new_empty(a.shape)

        @staticmethod
        def backward(ctx, grad):
            return grad

    x = torch.zeros(1024, device="cuda")
    _TRIVIAL[:] = [lambda: _trivial[(1,)](x, 1024, BLOCK=1024)]
    trivial = min(host_us(_TRIVIAL[0]) for _ in range(3))
    small = min(host_us(lambda: x.add_(1.0)) for _ in range(3))
    leaf, g = torch.zeros(4, device="cuda", requires_grad=True), torch.ones(4, device="cuda")
    y = _Nothing.apply(leaf)
    autograd = min(host_us(lambda: torch.autograd.grad(y, leaf, g, retain_graph=True)) for _ in range(3))
    with torch.autograd.set_multithreading_enabled(False):
        same_thread = min(host_us(lambda: torch.autograd.grad(y, leaf, g, retain_graph=True)) for _ in range(3))
    return {"trivial_triton_us": trivial, "small_torch_us": small, "autograd_us": autograd,
            "autograd_calling_thread_us": same_thread}


def calling_thread_host_us(fn) -> float:
    """host_us of ``fn`` (a call with a backward) under ``torch.autograd.set_multithreading_enabled(False)``: the
    autograd engine runs the backward on the calling thread instead of handing it to its per-device worker
    thread and waiting for it."""
    with torch.autograd.set_multithreading_enabled(False):
        return host_row(fn, 100)["host_us"]


def moe_rows(base, quick):
    from hopperkern import moe

    rows = []
    for name, (E, k, H, I) in MOE_SHAPES.items():  # noqa: E741
        if quick and name not in ("qwen3-30B-A3B", "mixtral-8x7B"):
            continue
        gen = torch.Generator(device="cuda").manual_seed(0)
        w13 = (torch.randn((E, 2 * I, H), generator=gen, device="cuda") * H ** -0.5).bfloat16()
        w2 = (torch.randn((E, H, I), generator=gen, device="cuda") * I ** -0.5).bfloat16()
        for T in MOE_TOKENS:
            x = torch.randn((T, H), generator=gen, device="cuda").bfloat16()
            weights, ids = moe.route(torch.randn((T, E), generator=gen, device="cuda"), k)
            for check in ("auto", True):
                fn = (lambda: moe.fused_moe(x, w13, w2, weights, ids, check_ids=check))
                row = dict(base, op="fused_moe", shape=name, tokens=T, check=check, **host_row(fn),
                           eager_us=eager_us(fn), launches=count_launches(fn))
                if check != True:  # noqa: E712 - a synchronising check cannot be captured
                    row["graph_us"] = graph_us(fn)
                rows.append(row)
        del w13, w2
        torch.cuda.empty_cache()
    return rows


def lce_rows(base):
    from hopperkern import lce
    from hopperkern.lce import rl, sft

    H, V = LCE_SHAPE
    gen = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn((V, H), generator=gen, device="cuda") * H ** -0.5).bfloat16().requires_grad_()
    rows = []
    for N in LCE_TOKENS:
        h = torch.randn((N, H), generator=gen, device="cuda").bfloat16().requires_grad_()
        y = torch.randint(0, V, (N,), generator=gen, device="cuda")
        g = torch.randn((N,), generator=gen, device="cuda")
        for check in ("auto", True):
            def fwd():
                with torch.no_grad():
                    return lce.linear_logprobs_entropy(h, w, y, check_labels=check)

            def fwd_bwd():
                lp, ent = lce.linear_logprobs_entropy(h, w, y, check_labels=check)
                return torch.autograd.grad((lp, ent), (h, w), (g, g))

            auto_path = rl_path_name(rl.stored_rows("auto", N, V, H, torch.bfloat16), N)
            for op, fn in (("lce.forward", fwd), ("lce.forward+backward", fwd_bwd)):
                row = dict(base, op=op, shape=f"{H}x{V}", tokens=N, check=check,
                           grad_path=auto_path if op == "lce.forward+backward" else "", **host_row(fn, 100),
                           eager_us=eager_us(fn, 50), launches=count_launches(fn))
                if check != True:  # noqa: E712 - a synchronising check cannot be captured
                    row["graph_us"] = graph_us(fn, 20)
                if op == "lce.forward+backward":
                    row["host_calling_thread_us"] = calling_thread_host_us(fn)
                rows.append(row)
            if check == True:  # noqa: E712 - the check is in the forward
                continue
            # After the graphs: a kept graph's accumulate nodes would tie a capture to the default stream.
            # retain_graph needs the 4-pass path.
            kept = lce.linear_logprobs_entropy(h, w, y, check_labels=check, grad_path="4pass")

            def bwd():
                return torch.autograd.grad(kept, (h, w), (g, g), retain_graph=True)

            row = dict(base, op="lce.backward", shape=f"{H}x{V}", tokens=N, check=check, grad_path="4pass",
                       **host_row(bwd, 100), eager_us=eager_us(bwd, 50), launches=count_launches(bwd),
                       host_calling_thread_us=calling_thread_host_us(bwd))
            row["host_net_us"] = row["host_us"] - base["autograd_us"]
            rows.append(row)
            del kept

            def sft_step():  # a mean cross-entropy loss and its gradients, the path "auto" picks
                loss = lce.linear_cross_entropy(h, w, y, check_labels=check)
                return torch.autograd.grad(loss, (h, w))

            rows.append(dict(base, op="lce.sft forward+backward", shape=f"{H}x{V}", tokens=N, check=check,
                             grad_path=sft.pick_path("auto", N, V, H, 2), **host_row(sft_step, 100),
                             eager_us=eager_us(sft_step, 50), launches=count_launches(sft_step),
                             graph_us=graph_us(sft_step, 20), host_calling_thread_us=calling_thread_host_us(sft_step)))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="two MoE shapes")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_host: no CUDA GPU, nothing to time")
        return 0
    from rich.console import Console
    from rich.table import Table

    meta = run_meta()
    base = dict(meta, **baselines())
    print(json.dumps({k: base[k] for k in ("device", "git_sha", "trivial_triton_us", "small_torch_us", "autograd_us")}))
    rows = moe_rows(base, args.quick) + lce_rows(base)
    for r in rows:
        r["host_in_trivial_launches"] = r.get("host_net_us", r["host_us"]) / r["trivial_triton_us"]
        if r.get("trivial_adjacent_us"):
            r["host_in_adjacent_trivial"] = r.get("host_net_us", r["host_us"]) / r["trivial_adjacent_us"]
        r["target_trivial_launches"] = r["launches"] + 1
        if r.get("graph_us"):
            r["eager_over_graph"] = r["eager_us"] / r["graph_us"]
    tag = meta["device"].replace(" ", "_")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"host_{tag}.csv", rows)
    t = Table(title=f"Host cost per eager call (trivial Triton launch {base['trivial_triton_us']:.1f} us, small torch "
                    f"op {base['small_torch_us']:.1f} us, autograd round trip {base['autograd_us']:.1f} us, same run; "
                    "host / trivial nets out the round trip for lce.backward)")
    for col in ("op", "shape", "tokens", "check", "launches", "host us", "host / trivial", "/ adjacent", "target",
                "eager us", "graph us", "eager / graph", "host us, calling thread"):
        t.add_column(col)
    for r in rows:
        f = (lambda key, fmt: (fmt % r[key]) if r.get(key) is not None else "-")
        t.add_row(r["op"], r["shape"], str(r["tokens"]), str(r["check"]), str(r["launches"]), f("host_us", "%.0f"),
                  f("host_in_trivial_launches", "%.1f"), f("host_in_adjacent_trivial", "%.1f"),
                  str(r["target_trivial_launches"]), f("eager_us", "%.0f"),
                  f("graph_us", "%.0f"), f("eager_over_graph", "%.2f"), f("host_calling_thread_us", "%.0f"))
    Console(width=160).print(t)
    return 0


if __name__ == "__main__":
    sys.exit(main())
