"""MoE benchmark: hopperkern.moe.fused_moe (tma auto / never / atomic top-k sum) vs a torch._grouped_mm MLP.

Cases: the five shared/PERF.md shapes x M tokens in {1, 16, 64, 256, 1024, 4096, 16384}, bf16, softmax top-k
of a random router. M <= 1024 is timed as CUDA-graph replays (fused_moe with check_ids=False inside the
graph; the torch._grouped_mm MLP is captured too): there an eager loop is bound by the host's launch overhead
(qwen3-235B at M = 256 on the H200: ~500 us of host time per eager call for ~400 us of kernels, and eager
samples of one config spread over 418-934 us), so it would time Python, not the GPU. Larger M
eagerly (the `timing` column says which). For M <= 64 also ``time_us_graph10``: per call in a graph of 10
calls, each after an L2 flush (a decode step inside a model-wide graph, where each layer reads new weights; a
single-call replay also pays a graph launch, ~10 us at M = 1). Every provider is checked against an fp32
reference before it is timed.

Models (written next to the figures):
  bytes  = distinct experts touched (counted from the ids) x (2I*H + H*I) x 2  +  x and out (2 x M*H*2)
  FLOPs  = 2 * M * k * (2I*H + H*I)
  %copy  = bytes / time / copy bandwidth (reported for M <= 256; pct_copy_bw_graph10 from time_us_graph10);  %cuBLAS = FLOPs / time / cuBLAS bf16 rate
  (reported for M >= 1024). Both ceilings are measured in the same run (common.measure_ceilings).
  stream_us_graph10 (M <= 64) = a streaming reference: torch.sum over a bf16 tensor of ``bytes`` bytes (one
  kernel up to 2 GiB, two beyond), which only reads the case's bytes, timed like time_us_graph10 (10-call graph,
  L2 flushed before each call); vs_stream_graph10 = stream_us_graph10 / time_us_graph10. The copy bandwidth is
  measured on 1 GiB; a read of a few tens of MB after an L2 flush reaches less of it, and this reference says
  how much a plain read gets in the same run. It is not a strict floor: a better streaming kernel can beat it.
  kernel_us_align / _gate_up / _down / _topk_sum / _other (hopperkern rows) = GPU microseconds per call of each
  kernel of the call (torch profiler over 10 eager calls, warm L2): where a point's time goes. Up to
  PDL_MAX_TOKENS (64) the kernels are chained with programmatic dependent launch, so a kernel's span starts
  before the previous one ends and includes its wait for it: there the columns overlap and their sum exceeds
  the call (e.g. a decode top-k sum that shows most of the down GEMM's time).

    python -m benchmarks.bench_moe --out DIR [--quick] [--shapes qwen3-30B-A3B mixtral-8x7B ...]
    python -m benchmarks.bench_moe --plot-from benchmarks/results/moe_NVIDIA_H200.csv   # redraw, no GPU needed
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

from benchmarks.common import (capture_graph, graph_ms, kernel_profile, measure_ceilings, pyplot, redraw, run_label,
                               run_meta, write_csv)
from hopperkern.tune.shapes import MOE_SHAPES

SHAPES = MOE_SHAPES  # name: (E, top_k, H, I): the shapes the tuner sweeps
TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
QUICK_SHAPES = ("qwen3-30B-A3B", "mixtral-8x7B")
QUICK_TOKENS = (1, 64, 4096)
GRAPH_MAX_M = 1024
DECODE_MAX_M = 64  # also timed per call inside a 10-call graph (time_us_graph10)
DEVICE, DTYPE = "cuda", torch.bfloat16  # module-level so a CPU dry run of the plumbing can swap them
CHECK_ROWS = 256  # rows of out compared with the fp32 reference (rows are independent)

# The fastest public Triton / CUTLASS MoE latency per (shape, M) in microseconds: the best of LightLLM's grouped
# matmul (with and without TMA), vLLM's fused_moe with its tuned H200 files and a torch._grouped_mm MLP, measured
# on the H200 on 2026-12-01 with the method of this file (M <= 64: per call in a 10-call graph with the L2
# flushed). Those libraries are not installed here, so these figures come from that run, not this one:
# ``vs_best_public`` (their time / ours) compares across runs; every other ratio in the CSV is same-run. Rows of
# another GPU get no such column: those figures say nothing about it.
PUBLIC_DEVICE = "NVIDIA H200"
BEST_PUBLIC_US = {
    "qwen3-30B-A3B": (37.3, 225.8, 355.5, 569.9, 627.0, 1002.0, 2936.1),
    "deepseek-V3-TP8": (50.1, 337.1, 750.1, 875.7, 1126.7, 1692.6, 4667.9),
    "mixtral-8x7B": (190.9, 731.5, 743.2, 896.1, 1674.3, 5100.4, 21743.7),
    "qwen3-235B-TP4": (42.2, 208.8, 298.3, 450.7, 445.4, 822.3, 2661.3),
    "gpt-oss-120B": (70.1, 703.2, 1432.2, 1708.1, 1889.7, 2782.0, 8567.9),
}


def best_public_us(shape: str, M: int, device: str = PUBLIC_DEVICE):
    """The best public latency of :data:`BEST_PUBLIC_US` at (shape, M), or None off its grid or on a ``device``
    other than :data:`PUBLIC_DEVICE`, where they were measured."""
    if device != PUBLIC_DEVICE:
        return None
    figures = BEST_PUBLIC_US.get(shape)
    return figures[TOKENS.index(M)] if figures is not None and M in TOKENS else None


PROVIDERS = {  # provider: what it runs (the plot's legend)
    "hopperkern": "hopperkern fused_moe, tma='auto' (TMA for weights and sorted rows)",
    "hopperkern-ptr": "hopperkern fused_moe, tma='never' (pointer loads only)",
    "hopperkern-atomic": "hopperkern fused_moe, deterministic=False (fp32 atomic top-k sum)",
    "hopperkern-nopdl": "hopperkern fused_moe, HOPPERKERN_PDL=0 (kernels in plain stream order; M <= 64 only)",
    "torch._grouped_mm": "torch: sort slots, two torch._grouped_mm GEMMs, silu * up, weighted sum (the 1.0 line)",
}


def torch_grouped_moe(x, w13, w2, weights, ids):
    """The same MLP from torch._grouped_mm: sort slots by expert, two grouped GEMMs, weighted sum over k.
    No host sync (counts by scatter_add, not bincount), so it can be graph-captured too."""
    T, k = ids.shape
    E, two_i, _ = w13.shape
    flat = ids.reshape(-1).long()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    xs = x[order // k]
    h = torch._grouped_mm(xs, w13.transpose(-2, -1), offs=offs)
    a = torch.nn.functional.silu(h[:, : two_i // 2]) * h[:, two_i // 2:]
    y = torch._grouped_mm(a, w2.transpose(-2, -1), offs=offs)
    y = y.float() * weights.reshape(-1)[order, None]
    out = torch.empty_like(y)
    out[order] = y
    return out.view(T, k, -1).sum(1).to(x.dtype)


def _reference(x, w13, w2, weights, ids):
    from hopperkern.moe import reference

    with _no_tf32():
        return reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.float32)


class _no_tf32:
    def __enter__(self):
        self.prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.prev


def _rel_err(out, ref):
    return ((out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _without_pdl(fn):
    """``fn`` with HOPPERKERN_PDL=0 around each call (read at every call, so a graph captures the unchained plan)."""
    def call(*args):
        old = os.environ.get("HOPPERKERN_PDL")
        os.environ["HOPPERKERN_PDL"] = "0"
        try:
            return fn(*args)
        finally:
            if old is None:
                del os.environ["HOPPERKERN_PDL"]
            else:
                os.environ["HOPPERKERN_PDL"] = old
    return call


def _providers(atomic: bool):
    from hopperkern import moe

    provs = {
        "hopperkern": lambda *a: moe.fused_moe(*a, check_ids=False),
        "hopperkern-nopdl": _without_pdl(lambda *a: moe.fused_moe(*a, check_ids=False)),
        "hopperkern-ptr": lambda *a: moe.fused_moe(*a, tma="never", check_ids=False),
    }
    if atomic:
        provs["hopperkern-atomic"] = lambda *a: moe.fused_moe(*a, check_ids=False, deterministic=False)
    provs["torch._grouped_mm"] = torch_grouped_moe
    return provs


def _time(fn, graph: bool):
    """((median, p20, p80) ms, how) with triton.testing.do_bench; a CUDA-graph replay for decode sizes (eager
    when capture fails, said in ``how``)."""
    import triton

    how = "eager"
    if graph:
        try:
            g = capture_graph(fn)
            fn, how = g.replay, "graph"
        except Exception as exc:
            torch.cuda.synchronize()
            how = f"eager (graph capture failed: {type(exc).__name__})"
    return triton.testing.do_bench(fn, warmup=10, rep=40, quantiles=[0.5, 0.2, 0.8]), how


KERNEL_PARTS = ("align", "gate_up", "down", "topk_sum")  # kernel_us_* columns, matched in the kernels' names


def kernel_parts(fn, calls: int = 10) -> dict:
    """GPU microseconds per call of each part of ``fn``'s kernels (``kernel_us_<part>``: the first of
    :data:`KERNEL_PARTS` whose name the kernel's contains; ``kernel_us_other`` for the rest), from ``calls`` eager
    calls under the torch profiler (warm L2, unlike the graph10 timings)."""
    parts = dict.fromkeys([*KERNEL_PARTS, "other"], 0.0)
    for name, us in kernel_profile(fn, calls):
        parts[next((p for p in KERNEL_PARTS if p in name), "other")] += us / calls
    return {f"kernel_us_{p}": v for p, v in parts.items()}


def run_shape(name, E, k, H, I, tokens, provs, ceil, meta, log):  # noqa: E741
    from hopperkern import moe

    gen = torch.Generator(device=DEVICE).manual_seed(0)
    w13 = (torch.randn((E, 2 * I, H), generator=gen, device=DEVICE) * H ** -0.5).to(DTYPE)
    w2 = (torch.randn((E, H, I), generator=gen, device=DEVICE) * I ** -0.5).to(DTYPE)
    expert_bytes = (2 * I * H + H * I) * 2
    rows = []
    for M in tokens:
        x = torch.randn((M, H), generator=gen, device=DEVICE).to(DTYPE)
        weights, ids = moe.route(torch.randn((M, E), generator=gen, device=DEVICE), k)
        distinct = int(torch.unique(ids).numel())
        nbytes = distinct * expert_bytes + 2 * M * H * 2
        flops = 2 * M * k * (2 * I * H + H * I)
        c = min(M, CHECK_ROWS)
        ref = _reference(x[:c], w13, w2, weights[:c], ids[:c])
        stream = {}
        if M <= DECODE_MAX_M:
            try:
                stream["stream_us_graph10"] = stream_reference_us(nbytes)
            except Exception as exc:  # a failing reference must not cost the case's rows
                log(f"{name} M={M} stream reference: FAILED {type(exc).__name__}: {exc}"[:300])
                torch.cuda.synchronize()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg, origin = moe.moe_launch_config(E, H, I, DTYPE, M, k)
        base = dict(meta, shape=name, E=E, top_k=k, H=H, I=I, M=M, distinct_experts=distinct, bytes=nbytes,
                    flops=flops, config_source=Path(origin).name if origin.endswith(".json") else origin, config=json.dumps(cfg.model_dump(), sort_keys=True),
                    **ceil, **stream)
        graph = M <= GRAPH_MAX_M
        for pname, fn in provs.items():
            if pname == "hopperkern-nopdl" and M > moe.PDL_MAX_TOKENS:
                continue  # the same plan as "hopperkern" there: only calls of up to PDL_MAX_TOKENS are chained
            row = dict(base, provider=pname)
            args = (x, w13, w2, weights, ids)
            try:
                out = fn(*args)
                row["rel_err"] = _rel_err(out[:c], ref)
                del out
                (med, p20, p80), row["timing"] = _time(lambda: fn(*args), graph)
                row.update(time_us=med * 1e3, p20_us=p20 * 1e3, p80_us=p80 * 1e3,
                           gbs=nbytes / med / 1e6, tflops=flops / med / 1e9)
                if M <= DECODE_MAX_M:
                    # Per call inside a graph of 10 calls with cold L2: a decode step inside a model-wide graph,
                    # without the one graph launch that a single-call replay (time_us) also pays.
                    row["time_us_graph10"] = graph_ms(lambda: fn(*args)) * 1e3
                    row["pct_copy_bw_graph10"] = 100 * nbytes / row["time_us_graph10"] / 1e3 / ceil["copy_gbs"]
                    if "stream_us_graph10" in row:
                        row["vs_stream_graph10"] = row["stream_us_graph10"] / row["time_us_graph10"]
                if pname == "hopperkern":
                    try:
                        row.update(kernel_parts(lambda: fn(*args)))
                    except Exception as exc:  # a profiler failure must not cost the row its timings
                        log(f"{name} M={M} kernel profile: FAILED {type(exc).__name__}: {exc}"[:300])
                row["pct_copy_bw"] = 100 * row["gbs"] / ceil["copy_gbs"] if M <= 256 else None
                row["pct_cublas"] = 100 * row["tflops"] / ceil["cublas_bf16_tflops"] if M >= 1024 else None
                log(f"{name} M={M} {pname}: {row['time_us']:.1f} us  err {row['rel_err']:.2e}")
            except Exception as exc:  # report and go on: one failing provider must not hide the rest
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                log(f"{name} M={M} {pname}: FAILED {row['error']}")
                traceback.print_exc(limit=3)
            rows.append(row)
        torch_rows = [r for r in rows if r["M"] == M and r["provider"] == "torch._grouped_mm" and "time_us" in r]
        pair = {r["provider"]: r for r in rows if r["M"] == M and r.get("time_us_graph10")}
        if "hopperkern" in pair and "hopperkern-nopdl" in pair:  # same run: what chaining the launches gains
            pair["hopperkern"]["pdl_speedup_graph10"] = (pair["hopperkern-nopdl"]["time_us_graph10"]
                                                         / pair["hopperkern"]["time_us_graph10"])
        public = best_public_us(name, M, meta["device"])
        for r in rows:
            if r["M"] == M and torch_rows and "time_us" in r:
                r["speedup_vs_torch"] = torch_rows[0]["time_us"] / r["time_us"]
            if r["M"] == M and public is not None and "time_us" in r:
                r["best_public_us"] = public
                r["vs_best_public"] = public / r.get("time_us_graph10", r["time_us"])
        del x, weights, ids, ref
    del w13, w2
    torch.cuda.empty_cache()
    return rows


def stream_reference_us(nbytes: int) -> float:
    """Microseconds per call of torch.sum over a bf16 tensor of ``nbytes`` bytes (a plain read of them: one
    kernel up to 2 GiB), timed as :func:`graph_ms` times the decode rows (10 calls in a graph, L2 flushed before
    each): what a plain read of a decode call's expert weights gets in the same run."""
    data = torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16, device=DEVICE)
    return graph_ms(data.sum) * 1e3


def check_grouped_mm_small() -> str:
    """Correctness of the torch._grouped_mm provider at a small size (uneven groups, an empty expert)."""
    from hopperkern import moe

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    E, k, H, I, T = 6, 2, 256, 128, 37  # noqa: E741
    w13 = (torch.randn((E, 2 * I, H), generator=gen, device=DEVICE) * H ** -0.5).to(DTYPE)
    w2 = (torch.randn((E, H, I), generator=gen, device=DEVICE) * I ** -0.5).to(DTYPE)
    x = torch.randn((T, H), generator=gen, device=DEVICE).to(DTYPE)
    logits = torch.randn((T, E), generator=gen, device=DEVICE)
    logits[:, 3] = -30  # expert 3 gets no tokens
    weights, ids = moe.route(logits, k)
    err = _rel_err(torch_grouped_moe(x, w13, w2, weights, ids), _reference(x, w13, w2, weights, ids))
    if err > 2e-2:
        raise RuntimeError(f"torch._grouped_mm provider disagrees with the reference: rel err {err:.3g}")
    return f"torch._grouped_mm provider ok at small size (rel err {err:.2e})"


def plot(rows, path):
    """Per shape: the speed-up over the torch._grouped_mm MLP of the same run (top, higher is better) and the share
    of the measured ceiling (bottom: copy bandwidth up to M = 256, cuBLAS bf16 rate from M = 1024), both on
    linear axes, at each token count M."""
    plt = pyplot("bench_moe")
    if plt is None:
        return
    rows = [r for r in rows if r.get("time_us") is not None]
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    provs += sorted({r["provider"] for r in rows} - set(provs))
    ours = [p for p in provs if p != "torch._grouped_mm"]
    colors = dict(zip(provs, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(2, len(shapes), figsize=(4.4 * len(shapes), 8.5), squeeze=False, sharey="row")
    width = 0.8 / max(1, len(ours))
    for col, s in enumerate(shapes):
        tokens = sorted({r["M"] for r in rows if r["shape"] == s})
        top, bottom = axes[0][col], axes[1][col]
        for i, p in enumerate(ours):
            for j, M in enumerate(tokens):
                hit = [r for r in rows if r["shape"] == s and r["provider"] == p and r["M"] == M]
                if not hit:
                    continue
                x = j + (i - (len(ours) - 1) / 2) * width
                if hit[0].get("speedup_vs_torch") is not None:
                    top.bar(x, hit[0]["speedup_vs_torch"], width, color=colors[p])
                pct = hit[0].get("pct_copy_bw") if M <= 256 else hit[0].get("pct_cublas")
                if pct is not None:
                    bottom.bar(x, pct, width, color=colors[p], hatch="" if M <= 256 else "//")
        E, k, H, I = (next(r for r in rows if r["shape"] == s)[c] for c in ("E", "top_k", "H", "I"))  # noqa: E741
        top.set_title(f"{s}\nE={E}, k={k}, H={H}, I={I}", fontsize=9)
        top.axhline(1.0, color="k", lw=0.8)
        bottom.axhline(100, color="k", lw=0.5, ls="--")
        for ax in (top, bottom):
            ax.set_xticks(range(len(tokens)), [str(M) for M in tokens], fontsize=8)
            ax.grid(True, axis="y", lw=0.3)
        bottom.set_xlabel("tokens M")
    axes[0][0].set_ylabel("speed-up over torch._grouped_mm (higher is better)")
    axes[1][0].set_ylabel("% of the ceiling: copy bandwidth (M <= 256),\ncuBLAS bf16 rate (M >= 1024, hatched)")
    axes[0][0].set_ylim(0, None)
    axes[1][0].set_ylim(0, 110)
    fig.suptitle(f"MoE forward (fused_moe, softmax top-k of a random router): {run_label(rows[0])}", fontsize=10)
    handles = [plt.Line2D([], [], color="k", lw=0.8) if p == "torch._grouped_mm"
               else plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in provs]
    fig.legend(handles, [f"{p}: {PROVIDERS.get(p, p)}" for p in provs], loc="lower center", ncol=2, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.07, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows):
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    t = Table(title="MoE (bf16): latency; % of copy bandwidth (M <= 256) / % of cuBLAS (M >= 1024), same run")
    for col in ("shape", "M", "provider", "us", "us/call in 10", "%copy", "%copy in 10", "x stream in 10", "%cuBLAS",
                "x torch", "x best public", "rel err", "config"):
        t.add_column(col)
    for r in rows:
        f = (lambda key, fmt: (fmt % r[key]) if r.get(key) is not None else "-")
        t.add_row(r["shape"], str(r["M"]), r["provider"], f("time_us", "%.1f"), f("time_us_graph10", "%.1f"),
                  f("pct_copy_bw", "%.0f"), f("pct_copy_bw_graph10", "%.0f"), f("vs_stream_graph10", "%.2f"),
                  f("pct_cublas", "%.0f"), f("speedup_vs_torch", "%.2f"), f("vs_best_public", "%.2f"),
                  f("rel_err", "%.1e"),
                  escape(r.get("error", r["config_source"] if r["provider"].startswith("hopperkern") else ""))[:40])
    Console(width=170).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true", help="2 shapes x M in {1, 64, 4096}")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None)
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--no-atomic", action="store_true", help="skip the atomic top-k reduction provider")
    ap.add_argument("--plot-from", type=Path, default=None, help="redraw the plot of a stored CSV into --out")
    args = ap.parse_args(argv)
    if args.plot_from is not None:
        return redraw(args.plot_from, args.out, "bench_moe", plot)
    if not torch.cuda.is_available():
        print("bench_moe: no CUDA GPU, nothing to time")
        return 0
    from rich.progress import Progress

    t0 = time.time()
    meta = run_meta()
    ceil = measure_ceilings()
    print(json.dumps({**meta, **ceil}))
    print(check_grouped_mm_small())
    names = args.shapes or (list(QUICK_SHAPES) if args.quick else list(SHAPES))
    tokens = tuple(args.tokens or (QUICK_TOKENS if args.quick else TOKENS))
    provs = _providers(atomic=not (args.no_atomic or args.quick))
    rows = []
    with Progress() as prog:
        task = prog.add_task("MoE shapes", total=len(names))
        for name in names:
            E, k, H, I = SHAPES[name]  # noqa: E741
            rows += run_shape(name, E, k, H, I, tokens, provs, ceil, meta, prog.console.print)
            prog.advance(task)
    tag = meta["device"].replace(" ", "_")
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / f"moe_{tag}.csv", rows)
    plot(rows, args.out / f"moe_{tag}.png")
    table(rows)
    ours = [r["vs_best_public"] for r in rows if r["provider"] == "hopperkern" and r.get("vs_best_public")]
    if ours:
        geo = math.exp(sum(math.log(v) for v in ours) / len(ours))
        print(f"hopperkern vs the best public latency (figures of another run, see BEST_PUBLIC_US): faster at "
              f"{sum(v >= 1.0 for v in ours)} of {len(ours)} points, geometric mean {geo:.3f}x")
    print(f"bench_moe: {len(rows)} rows in {time.time() - t0:.0f} s -> {args.out}/moe_{tag}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
