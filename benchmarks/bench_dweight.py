"""The d_weight GEMM of the 3-pass SFT paths (``lce_dweight_kernel``) in each launch shape, against cuBLAS, in one
run; then the chunked SFT step (forward + backward) with each split launch shape, against its 3G floor.

    python -m benchmarks.bench_dweight [--out DIR] [--quick]
    python -m benchmarks.bench_dweight --plot-from benchmarks/results/dweight_NVIDIA_H200.csv

Kernel rows (``part=kernel``), per case (V, H, N tokens of one launch):
- ``split``: the chunked variant's accumulating launch (SPLIT 2): reads the fp32 sum held so far as int16 halves,
  adds d^T @ h, writes it back. Reference: cuBLAS ``addmm`` of the same product into an fp32 [V, H] C, the same
  bytes (C read and written in fp32).
- ``plain``: the unbounded 3-pass path's launch (SPLIT 0: g applied, one rounding to bf16). Reference: cuBLAS's
  bf16 ``d.T @ h``. Each shape is timed again with the label terms of bf16 exponentials (``HAS_LABELS``: one
  random label and fp32 term per token, checked against cuBLAS's fp32 product plus an fp32 ``index_add``).
Every launch shape's output must equal the first one's bit for bit (one K order; the epilogue changes only how the
tile is written), and the first one's must match cuBLAS's fp32 product; a shape that differs is reported and not
timed. Times are CUDA-event medians of back-to-back launches in rotated rounds after a settling run
(:func:`hopperkern.tune.timing.pick_fastest`'s method), each as a ratio to the reference timed in the same rounds.

Step rows (``part=step``): ``linear_cross_entropy(..., reduction="sum", sft_path="chunked")`` forward + backward
at the large shapes with ``sft.DW_SPLIT_TILES`` set to each split shape in turn, and ``sft_path="3pass"`` at
8192 and ~2k tokens with ``sft.DW_TILES`` one program a tile and persistent, interleaved with the 3G floor
(``h @ w.T`` + ``d @ w`` + ``d.T @ h`` in cuBLAS) in the same rounds; ratio = time / 3G.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from benchmarks.common import pyplot, redraw, run_label, run_meta, time_cuda, write_csv
from hopperkern.lce import sft
from hopperkern.lce.sft import DwTiles

W, N_ = sft.DW_TILES, sft.DW_TILES_NARROW
# Launch shapes compared: the first of each list is the reference for bitwise equality.
SPLIT_SHAPES = {
    "128x256 whole ptr": DwTiles(128, 256, 64, 8, 8, 3, epi_tma=False),
    "128x256 sub4 ptr": DwTiles(128, 256, 64, 8, 8, 3, epi_sub=4, epi_tma=False),
    "128x256 sub4 tma": DwTiles(128, 256, 64, 8, 8, 3, epi_sub=4),
    "128x256 sub2 tma": DwTiles(128, 256, 64, 8, 8, 3, epi_sub=2),
    "128x256 sub4 tma pers": DwTiles(128, 256, 64, 8, 8, 3, epi_sub=4, persistent=True),
    "128x256 sub4 tma pers flat": DwTiles(128, 256, 64, 8, 8, 3, epi_sub=4, persistent=True, flatten=True),
    "128x256 sub4 ptr pers flat": DwTiles(128, 256, 64, 8, 8, 3, epi_sub=4, persistent=True, flatten=True,
                                          epi_tma=False),
    "128x128 s4 whole tma": DwTiles(128, 128, 64, 8, 8, 4),
    "128x128 s4 sub2 tma pers flat": DwTiles(128, 128, 64, 8, 8, 4, epi_sub=2, persistent=True, flatten=True),
}
PLAIN_SHAPES = {
    "whole tma": None,  # DW_TILES / DW_TILES_NARROW's tiles, one program a tile
    "sub2 tma": "sub2",
    "pers flat": "pf",
    "sub2 pers flat": "sub2pf",
}
# (V, H, N): the chunk sizes "auto" runs at the three large shapes, and the 3-pass path's full batches.
SPLIT_CASES = [(128256, 4096, 5504), (152064, 3584, 4096), (256000, 2304, 2816)]
PLAIN_CASES = [(128256, 4096, 8192), (152064, 3584, 1937), (151936, 896, 2169)]
STEP_CASES = [(32768, 4096, 128256), (16384, 3584, 152064), (8192, 2304, 256000)]  # (N, H, V), chunked
STEP_CASES_3PASS = [(8192, 4096, 128256), (1937, 3584, 152064), (2169, 896, 151936)]
# The 3-pass step's d_weight launch shapes: one program a tile, and the shipped persistent shapes.
STEP_3PASS = {
    "one program a tile": lambda H: _plain_tiles(H, None),
    "persistent flattened": lambda H: _plain_tiles(H, "pf"),
}


def _plain_tiles(H: int, how):
    base = W if H % W.block_h == 0 else N_
    if how is None:
        return base._replace(epi_sub=1, persistent=False, flatten=False)
    return base._replace(epi_sub=2 if "sub2" in how else 1, persistent="pf" in how, flatten="pf" in how)


def _rounds(fns: dict, rounds: int, reps: int, settle: int) -> dict:
    """{name: [ms per round]} of back-to-back timings, round r in the order rotated by r."""
    names = list(fns)
    for _ in range(settle):
        fns[names[0]]()
    torch.cuda.synchronize()
    out = {n: [] for n in names}
    for r in range(rounds):
        for j in range(len(names)):
            n = names[(j + r) % len(names)]
            out[n].append(time_cuda(fns[n], warmup=1, reps=reps, back_to_back=True)[0])
    return out


def _kernel_rows(kind, cases, shapes, rounds, reps, log):
    rows = []
    for V, H, N in cases:
        g = torch.Generator(device="cuda").manual_seed(V + H + N)
        d = (torch.randn((N, V), device="cuda", generator=g) * 1e-2).bfloat16()
        h = torch.randn((N, H), device="cuda", generator=g).bfloat16()
        one = torch.ones(1, device="cuda")
        ref32 = torch.randn((V, H), device="cuda", generator=g)  # the fp32 sum held so far
        want = torch.addmm(ref32, d.t(), h, out_dtype=torch.float32)
        hi0, lo0 = (ref32.view(torch.int32) >> 16).to(torch.int16), ref32.view(torch.int32).to(torch.int16)
        fns, first = {}, None
        acc = torch.empty_like(ref32)
        if kind == "split":
            fns["cuBLAS addmm fp32"] = lambda: torch.addmm(acc, d.t(), h, out_dtype=torch.float32, out=acc)
        else:
            wb = torch.empty((V, H), dtype=torch.bfloat16, device="cuda")
            fns["cuBLAS bf16 mm"] = lambda: torch.mm(d.t(), h, out=wb)
        for name, spec in shapes.items():
            t = spec if kind == "split" else _plain_tiles(H, spec)
            hi = torch.empty((V, H), dtype=torch.bfloat16, device="cuda")
            lo = torch.empty((V, H), dtype=torch.int16, device="cuda")
            try:
                if kind == "split":
                    hi.view(torch.int16).copy_(hi0)
                    lo.copy_(lo0)
                    sft._dweight(d, h, one, hi, "auto", lo=lo, accumulate=True, tiles=t)
                    got = ((hi.view(torch.int16).to(torch.int32) << 16) | (lo.to(torch.int32) & 0xFFFF)).view(
                        torch.float32)
                else:
                    sft._dweight(d, h, one, hi, "auto", tiles=t)
                    got = hi.clone()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - a shape that does not compile or launch is reported
                log(f"  {kind} {V}x{H}x{N} {name}: FAILED {type(exc).__name__}: {str(exc)[:160]}")
                continue
            if first is None:
                first = got
                ref = want if kind == "split" else want - ref32
                err = ((got.float() - ref).abs().max() / ref.abs().max()).item()
                ok = err < (1e-5 if kind == "split" else 1e-2)
                log(f"  {kind} {V}x{H}x{N} {name}: max error vs cuBLAS fp32 {err:.2e}")
            else:
                ok = torch.equal(got, first)
            if not ok:
                log(f"  {kind} {V}x{H}x{N} {name}: WRONG (not bitwise equal to the first shape / the reference)")
                continue
            if kind == "split":
                fns[name] = (lambda t=t, hi=hi, lo=lo: sft._dweight(d, h, one, hi, "auto", lo=lo, accumulate=True,
                                                                    tiles=t))
            else:
                fns[name] = lambda t=t, hi=hi: sft._dweight(d, h, one, hi, "auto", tiles=t)
                # The same launch with the 3-pass path's label terms (bf16 exponentials: one label per token).
                labels = torch.randint(0, V, (N,), device="cuda", generator=g)
                lab = torch.randn(N, device="cuda", generator=g)
                terms = (h, labels, *sft._label_order(labels, V), lab)
                hl = torch.empty((V, H), dtype=torch.bfloat16, device="cuda")
                sft._dweight(d, h, one, hl, "auto", tiles=t, labels=terms)
                ref_l = (want - ref32).index_add(0, labels, lab[:, None] * h.float())
                err = ((hl.float() - ref_l).abs().max() / ref_l.abs().max()).item()
                log(f"  {kind} {V}x{H}x{N} {name} + label terms: max error vs cuBLAS fp32 {err:.2e}")
                if err < 1e-2:
                    fns[name + " + label terms"] = (lambda t=t, hl=hl, terms=terms: sft._dweight(
                        d, h, one, hl, "auto", tiles=t, labels=terms))
                else:
                    log(f"  {kind} {V}x{H}x{N} {name} + label terms: WRONG")
        times = _rounds(fns, rounds, reps, settle=10)
        ref_name = next(iter(fns))
        ref_ms = statistics.median(times[ref_name])
        for name, ts in times.items():
            ratio = statistics.median([a / b for a, b in zip(ts, times[ref_name])])
            rows.append(dict(part="kernel", kind=kind, V=V, H=H, N=N, variant=name, time_ms=statistics.median(ts),
                             ratio=ratio, ratio_to=ref_name, flops_tf=2 * V * H * N / statistics.median(ts) / 1e9))
            log(f"  {kind} {V}x{H}x{N} {name:32s} {statistics.median(ts):8.3f} ms  {ratio:.3f} x {ref_name}"
                f" (ref {ref_ms:.3f} ms)")
        torch.cuda.empty_cache()
    return rows


def _step_rows(path, cases, shapes, rounds, reps, log):
    """SFT steps on ``path`` ("chunked": shapes set sft.DW_SPLIT_TILES*; "3pass": a function of H giving
    sft.DW_TILES*), each d_weight equal to the first shape's bit for bit, timed with the 3G floor."""
    from hopperkern import lce

    rows = []
    names = ("DW_SPLIT_TILES", "DW_SPLIT_TILES_NARROW") if path == "chunked" else ("DW_TILES", "DW_TILES_NARROW")
    saved = tuple(getattr(sft, n) for n in names)
    try:
        for N, H, V in cases:
            g = torch.Generator(device="cuda").manual_seed(N + H)
            h = (torch.randn((N, H), device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
            w = (torch.randn((V, H), device="cuda", generator=g) * H**-0.5).bfloat16().requires_grad_()
            y = torch.randint(0, V, (N,), device="cuda", generator=g)
            dl = (torch.randn((N, V), device="cuda", generator=g) * 1e-3).bfloat16()
            hd, wd = h.detach(), w.detach()
            grads = {}

            def step(t, key):
                t = t if path == "chunked" else t(H)

                def run():
                    for n in names:
                        setattr(sft, n, t)
                    h.grad = w.grad = None
                    lce.linear_cross_entropy(h, w, y, reduction="sum", sft_path=path).backward()
                    grads[key] = w.grad
                return run

            fns = {"3G floor": lambda: (hd @ wd.T, dl @ wd, dl.T @ hd)}
            for name, t in shapes.items():
                fns[name] = step(t, name)
                fns[name]()
            base = grads[next(iter(shapes))]
            for name in list(shapes):
                if not torch.equal(grads[name], base):
                    log(f"  step {N}x{H}x{V} {name}: d_weight differs from {next(iter(shapes))}'s: not timed")
                    del fns[name]
            times = _rounds(fns, rounds, reps, settle=2)
            floor = times["3G floor"]
            for name, ts in times.items():
                ratio = statistics.median([a / b for a, b in zip(ts, floor)])
                rows.append(dict(part="step", kind=path, V=V, H=H, N=N, variant=name,
                                 time_ms=statistics.median(ts), ratio=ratio, ratio_to="3G floor"))
                log(f"  step {path} {N}x{H}x{V} {name:32s} {statistics.median(ts):8.2f} ms  {ratio:.3f} x 3G")
            torch.cuda.empty_cache()
    finally:
        for n, t in zip(names, saved):
            setattr(sft, n, t)
    return rows


def plot(rows, path) -> None:
    """One panel per part and kind (split kernel, plain kernel, chunked step, 3-pass step): horizontal bars of
    time / the row's reference per launch shape, one group per case; lower is better, 1.0 = the reference."""
    plt = pyplot("bench_dweight")
    if plt is None:
        return
    panels = []
    for r in rows:
        key = (r["part"], r["kind"])
        if key not in panels:
            panels.append(key)
    counts = [sum((r["part"], r["kind"]) == key for r in rows) for key in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, sum(1.2 + 0.2 * n for n in counts)), squeeze=False,
                             gridspec_kw=dict(height_ratios=[1.2 + 0.2 * n for n in counts]))
    for ax, (part, kind) in zip(axes[:, 0], panels):
        sel = [r for r in rows if (r["part"], r["kind"]) == (part, kind)]
        labels = [f"{r['V']}x{r['H']}x{r['N']} {r['variant']}" if part == "kernel" else
                  f"{r['N']}x{r['H']}x{r['V']} {r['variant']}" for r in sel]
        ratios = [float(r["ratio"]) for r in sel]
        ax.barh(range(len(sel)), ratios, color=["0.6" if r["variant"] == r["ratio_to"] else "tab:blue" for r in sel])
        ax.set_yticks(range(len(sel)), labels, fontsize=6)
        ax.invert_yaxis()
        ax.axvline(1.0, color="k", lw=0.8)
        ax.set_xlim(0.8, max(1.5, max(ratios) + 0.05))
        ax.set_xlabel(f"time / {sel[0]['ratio_to']} (same rounds)")
        ax.set_title(f"{part}: {kind}", fontsize=9)
    fig.suptitle(f"lce_dweight_kernel launch shapes, lower is better ({run_label(rows[0])})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--quick", action="store_true", help="one case of each part, fewer rounds")
    ap.add_argument("--plot-from", type=Path, default=None, help="redraw the plot of a stored CSV into --out")
    ap.add_argument("--step-shapes", default="128x256 whole ptr,128x256 sub4 ptr pers flat",
                    help="comma-separated SPLIT_SHAPES names for the step rows")
    args = ap.parse_args(argv)
    if args.plot_from is not None:
        return redraw(args.plot_from, args.out, "bench_dweight", plot)
    if not torch.cuda.is_available():
        print("bench_dweight needs a CUDA GPU")
        return 0
    sl = slice(0, 1) if args.quick else slice(None)
    rounds, reps = (3, 5) if args.quick else (5, 7)
    rows = _kernel_rows("split", SPLIT_CASES[sl], SPLIT_SHAPES, rounds, reps, print)
    rows += _kernel_rows("plain", PLAIN_CASES[sl], PLAIN_SHAPES, rounds, reps, print)
    step_shapes = {n: SPLIT_SHAPES[n] for n in args.step_shapes.split(",") if n}
    rows += _step_rows("chunked", STEP_CASES[sl], step_shapes, 3, 3, print)
    rows += _step_rows("3pass", STEP_CASES_3PASS[sl], STEP_3PASS, 3, 5, print)
    if args.out is not None:
        meta = run_meta()
        args.out.mkdir(parents=True, exist_ok=True)
        tag = meta.get("device", "gpu").replace(" ", "_")
        rows = [dict(meta, **r) for r in rows]
        write_csv(args.out / f"dweight_{tag}.csv", rows)
        plot(rows, args.out / f"dweight_{tag}.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
