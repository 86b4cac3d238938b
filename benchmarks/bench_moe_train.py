"""MoE training benchmark: forward + backward of hopperkern.moe.fused_moe vs a torch._grouped_mm autograd MLP.

One step = forward, then the gradients of hidden, w13, w2 and topk_weights for a random upstream gradient
(``torch.autograd.grad``), bf16, timed with ``triton.testing.do_bench`` (medians, L2 flushed between calls).
Shapes (E, k, H, I): qwen3-30B-A3B, mixtral-8x7B, gpt-oss-120B and deepseek-V3 (I = 2048, no tensor
parallelism); T = 4096 and 16384 tokens; uniform routing (softmax top-k of random logits) and skewed routing
(a Zipf-like prior, expert of rank r favoured as (r + 1)^-1.2, so a few experts get most of the tokens).

Providers:
  hopperkern            fused_moe (pre-activations saved by the forward)
  hopperkern-recompute  fused_moe(recompute=True): the backward recomputes them (less memory, more FLOPs)
  torch._grouped_mm     sort / gather / two grouped GEMMs / silu * up / weighted scatter, under autograd

Figures written next to each row:
  FLOPs   = 3 x the forward's useful FLOPs, 3 x 2 * (live slots) * 3 * H * I (the usual "training = 3x forward")
  TF/s    = FLOPs / time;  %cuBLAS = TF/s / the cuBLAS bf16 8192^3 rate measured in the same run
  peak    = peak allocated memory during one step minus what was allocated before it (MiB)
  errors  = ||g - g_ref|| / ||g_ref|| of each gradient against an fp32 reference computed expert by expert

    python -m benchmarks.bench_moe_train --out DIR [--quick] [--shapes qwen3-30B-A3B ...] [--tokens 4096]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.bench_moe import torch_grouped_moe
from benchmarks.common import measure_ceilings, pyplot, redraw, run_label, run_meta, write_csv

SHAPES = {  # name: (E, top_k, H, I)
    "qwen3-30B-A3B": (128, 8, 2048, 768),
    "mixtral-8x7B": (8, 2, 4096, 14336),
    "gpt-oss-120B": (128, 4, 2880, 2880),
    "deepseek-V3": (256, 8, 7168, 2048),
}
TOKENS = (4096, 16384)
ROUTINGS = ("uniform", "skewed")
GRADS = ("d_hidden", "d_w13", "d_w2", "d_topk_weights")
DEVICE, DTYPE = "cuda", torch.bfloat16


PROVIDERS = {  # provider: what it runs (the plot's legend)
    "hopperkern": "hopperkern fused_moe: the forward saves the pre-activations for the backward",
    "hopperkern-recompute": "hopperkern fused_moe(recompute=True): the backward recomputes them (less memory)",
    "torch._grouped_mm": "torch: sort, torch._grouped_mm GEMMs, silu * up, weighted scatter under autograd "
                         "(the 1.0 line)",
}


def providers():
    from hopperkern import moe

    return {
        "hopperkern": lambda *a: moe.fused_moe(*a, check_ids=False),
        "hopperkern-recompute": lambda *a: moe.fused_moe(*a, check_ids=False, recompute=True),
        "torch._grouped_mm": torch_grouped_moe,
    }


def routing(T, E, k, kind, gen):
    from hopperkern import moe

    logits = torch.randn((T, E), generator=gen, device=DEVICE)
    if kind == "skewed":
        rank = torch.randperm(E, generator=gen, device=DEVICE).float()
        logits = logits - 1.2 * torch.log1p(rank)
    return moe.route(logits, k)


def reference_grads(x, w13, w2, weights, ids, dout):
    """fp32 gradients (d_hidden, d_w13, d_w2, d_topk_weights), one expert at a time (fp32 copies of one
    expert's weights only, so the largest shape fits beside the bf16 problem)."""
    from hopperkern.moe.reference import apply_activation

    T, H = x.shape
    E, two_i, _ = w13.shape
    I = two_i // 2  # noqa: E741
    dx = torch.zeros((T, H), dtype=torch.float32, device=x.device)
    dw13 = torch.zeros_like(w13, dtype=torch.float32)
    dw2 = torch.zeros_like(w2, dtype=torch.float32)
    dtw = torch.zeros_like(weights, dtype=torch.float32)
    ids = ids.long()
    for e in range(E):
        tok, j = torch.nonzero(ids == e, as_tuple=True)
        if tok.numel() == 0:
            continue
        xe = x[tok].float().requires_grad_()
        a = w13[e].float().requires_grad_()
        b = w2[e].float().requires_grad_()
        we = weights[tok, j].float().requires_grad_()
        h = apply_activation(xe @ a[:I].T, "silu") * (xe @ a[I:].T)
        y = (h @ b.T) * we[:, None]
        gx, ga, gb, gw = torch.autograd.grad(y, (xe, a, b, we), dout[tok].float())
        dx.index_add_(0, tok, gx)
        dw13[e], dw2[e] = ga, gb
        dtw[tok, j] = gw
    return dx, dw13, dw2, dtw


def rel_norm_err(g, ref, chunk: int = 1 << 26) -> float:
    """||g - ref|| / ||ref|| in fp64, in chunks (deepseek-V3's d_w13 has 7.5e9 elements)."""
    num = den = 0.0
    for a, b in zip(g.reshape(-1).split(chunk), ref.reshape(-1).split(chunk)):
        b = b.double()
        num += float((a.double() - b).square().sum())
        den += float(b.square().sum())
    return (num / max(den, 1e-300)) ** 0.5


def run_point(name, E, k, H, I, T, kind, provs, ceil, meta, log):  # noqa: E741
    import triton

    gen = torch.Generator(device=DEVICE).manual_seed(T + E)
    w13 = (torch.randn((E, 2 * I, H), generator=gen, device=DEVICE) * H ** -0.5).to(DTYPE).requires_grad_()
    w2 = (torch.randn((E, H, I), generator=gen, device=DEVICE) * I ** -0.5).to(DTYPE).requires_grad_()
    x = torch.randn((T, H), generator=gen, device=DEVICE).to(DTYPE).requires_grad_()
    weights, ids = routing(T, E, k, kind, gen)
    weights = weights.requires_grad_()
    dout = torch.randn((T, H), generator=gen, device=DEVICE).to(DTYPE)
    counts = torch.bincount(ids.flatten().long(), minlength=E)
    flops = 3 * 2 * int(counts.sum()) * 3 * H * I
    ref = reference_grads(x.detach(), w13.detach(), w2.detach(), weights.detach(), ids, dout)
    inputs = (x, w13, w2, weights)
    base = dict(meta, shape=name, E=E, top_k=k, H=H, I=I, T=T, routing=kind, flops=flops,
                max_expert_share=float(counts.max()) / max(int(counts.sum()), 1), **ceil)
    rows = []
    for pname, fn in provs.items():
        row = dict(base, provider=pname)

        def step():
            out = fn(x, w13, w2, weights, ids)
            return torch.autograd.grad(out, inputs, dout)

        try:
            grads = step()
            for gname, g, r in zip(GRADS, grads, ref):
                row[f"err_{gname}"] = rel_norm_err(g, r)
            del grads
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            kept = step()
            torch.cuda.synchronize()
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
            del kept
            med, p20, p80 = triton.testing.do_bench(step, warmup=3, rep=60, quantiles=[0.5, 0.2, 0.8])
            row.update(time_ms=med, p20_ms=p20, p80_ms=p80, tflops=flops / med / 1e9)
            row["pct_cublas"] = 100 * row["tflops"] / ceil["cublas_bf16_tflops"]
            log(f"{name} T={T} {kind} {pname}: {med:.2f} ms  {row['tflops']:.0f} TF/s ({row['pct_cublas']:.0f} %)"
                f"  peak {row['peak_mib']:.0f} MiB  errs " + " ".join(f"{row[f'err_{g}']:.1e}" for g in GRADS))
        except Exception as exc:  # one failing provider must not hide the rest
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            log(f"{name} T={T} {kind} {pname}: FAILED {row['error']}")
            traceback.print_exc(limit=3)
            torch.cuda.synchronize()
        rows.append(row)
    torch_row = next((r for r in rows if r["provider"] == "torch._grouped_mm" and "time_ms" in r), None)
    for r in rows:
        if torch_row and "time_ms" in r:
            r["speedup_vs_torch"] = torch_row["time_ms"] / r["time_ms"]
            r["err_ratio_vs_torch"] = max(r[f"err_{g}"] / max(torch_row[f"err_{g}"], 1e-30) for g in GRADS)
    del w13, w2, x, weights, ids, dout, ref
    torch.cuda.empty_cache()
    return rows


def plot(rows, path):
    """Speed-up of each hopperkern provider over the torch._grouped_mm MLP of the same run, per shape, token count
    and routing, on a linear axis (higher is better)."""
    plt = pyplot("bench_moe_train")
    if plt is None:
        return
    pts = [r for r in rows if r.get("speedup_vs_torch") and r["provider"] != "torch._grouped_mm"]
    labels = list(dict.fromkeys(f"{r['shape']}\nT={r['T']} {r['routing']}" for r in pts))
    provs = list(dict.fromkeys(r["provider"] for r in pts))
    fig, ax = plt.subplots(figsize=(max(8, 0.8 * len(labels)), 6.5))
    width = 0.8 / max(len(provs), 1)
    for i, p in enumerate(provs):
        ys = [next((r["speedup_vs_torch"] for r in pts if r["provider"] == p
                    and f"{r['shape']}\nT={r['T']} {r['routing']}" == lab), math.nan) for lab in labels]
        ax.bar([x + i * width for x in range(len(labels))], ys, width, label=f"{p}: {PROVIDERS.get(p, p)}")
    ax.axhline(1.0, color="k", lw=0.8, label=f"torch._grouped_mm: {PROVIDERS['torch._grouped_mm']}")
    ax.set_xticks([x + width * (len(provs) - 1) / 2 for x in range(len(labels))], labels, fontsize=7, rotation=45,
                  ha="right")
    ax.set_ylabel("speed-up over torch._grouped_mm MLP (higher is better)")
    ax.set_title(f"MoE forward + backward (d hidden, w13, w2, topk_weights): {run_label(rows[0])}", fontsize=9)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.32), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="MoE training step (bf16): time, % of cuBLAS (3x forward FLOPs), speed-up, memory, grad errors")
    for col in ("shape", "T", "routing", "provider", "ms", "%cuBLAS", "x torch", "peak MiB", "err max ratio"):
        t.add_column(col)
    for r in rows:
        f = (lambda key, fmt: (fmt % r[key]) if r.get(key) is not None else "-")
        t.add_row(r["shape"], str(r["T"]), r["routing"], r["provider"], f("time_ms", "%.2f"), f("pct_cublas", "%.0f"),
                  f("speedup_vs_torch", "%.2f"), f("peak_mib", "%.0f"), f("err_ratio_vs_torch", "%.2f"))
    Console(width=150).print(t)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="qwen3-30B-A3B and mixtral-8x7B at T=4096, uniform")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None)
    ap.add_argument("--tokens", nargs="+", type=int, default=None)
    ap.add_argument("--routings", nargs="+", choices=ROUTINGS, default=None)
    ap.add_argument("--plot-from", type=Path, default=None, help="redraw the plot of a stored CSV into --out")
    args = ap.parse_args(argv)
    if args.plot_from is not None:
        return redraw(args.plot_from, args.out, "bench_moe_train", plot)
    if not torch.cuda.is_available():
        print("bench_moe_train: no CUDA GPU, nothing to time")
        return 0
    t0 = time.time()
    meta = run_meta()
    ceil = measure_ceilings()
    print(json.dumps({**meta, **ceil}))
    names = args.shapes or (["qwen3-30B-A3B", "mixtral-8x7B"] if args.quick else list(SHAPES))
    tokens = args.tokens or ([4096] if args.quick else list(TOKENS))
    kinds = args.routings or (["uniform"] if args.quick else list(ROUTINGS))
    provs = providers()
    rows = []
    tag = meta["device"].replace(" ", "_")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        E, k, H, I = SHAPES[name]  # noqa: E741
        for T in tokens:
            for kind in kinds:
                rows += run_point(name, E, k, H, I, T, kind, provs, ceil, meta, print)
                write_csv(args.out / f"moe_train_{tag}.csv", rows)  # after every point: a cut-off run keeps them
    plot(rows, args.out / f"moe_train_{tag}.png")
    table(rows)
    print(f"bench_moe_train: {len(rows)} rows in {time.time() - t0:.0f} s -> {args.out}/moe_train_{tag}.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
