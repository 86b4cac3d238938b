"""LCE benchmark: hopperkern (tma auto / never) vs plain torch, torch.compile, Liger and CCE (when installed).

For each (N, H, V) and mode it reports time, the ratio to the cuBLAS floors measured in the same run,
peak extra memory and the error of loss / dH / dW against an fp32 reference.

Shapes are N tokens x H hidden x V vocabulary. Floors (cuBLAS bf16, this run): 1G = h @ w.T;
3G = 1G + dlogits @ w + dlogits.T @ h; 4G = 3G + 1G. Modes: ``fwd`` = no-grad log-probs + entropy (floor 1G);
``sft`` = sum-loss forward + backward (floor 3G); ``rl`` = log-probs + entropy forward + backward with per-token
upstream grads (floor 4G). A ratio of 1.0 is as fast as cuBLAS doing only those GEMMs; lower is better.

Gradient paths: the ``hopperkern`` provider runs ``sft_path="auto"`` and ``grad_path="auto"`` (the 3-pass paths
where N x V d(logits) or exponentials fit V x H x 4 bytes + 512 MiB, the rl one from H = 2048; for sft else the
chunked 3-pass variant where its chunks hold 1536 tokens; else the 4-pass paths); ``hopperkern-3pass`` and
``hopperkern-4pass`` force each path on every shape (sft and rl rows), ``hopperkern-chunked`` the chunked variant
(sft rows), side by side with their peak extra memory. The CSV's ``sft_path`` column says which path each
hopperkern sft or rl row ran.

Timing: every provider and every floor is timed with calls enqueued back to back and one synchronisation at the
end (benchmarks.common.time_cuda(back_to_back=True)), as in a training loop: host work overlaps the previous
call's kernels, while a sync inside an op (hopperkern's default label check) still counts. The GPU's clock drifts
under sustained load (the same cuBLAS GEMM has timed 10 to 20 % apart within seconds on the H200, either way), so
each shape's floors are timed before and after its providers and the ratios use their mean; ``floor_drift`` is the
3G floor after over before.

    python -m benchmarks.bench_lce --out DIR [--quick] [--compile-shapes K]
    python -m benchmarks.bench_lce --plot-from benchmarks/results/lce_NVIDIA_H200.csv   # redraw, no GPU needed
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import measure_ceilings, pyplot, redraw, run_label, run_meta, time_cuda, write_csv

SHAPES = [(8192, 4096, 128256), (32768, 4096, 128256), (16384, 3584, 152064), (8192, 2304, 256000),
          (1937, 3584, 152064), (2169, 896, 151936)]
QUICK = [(8192, 4096, 128256), (2169, 896, 151936)]
FLOORS = {"fwd": "1G", "sft": "3G", "rl": "4G"}
MODES = {  # mode: what one timed call does (the plot's panel titles)
    "fwd": "fwd: log-probs + entropy, no grad (floor 1G = h @ w.T)",
    "sft": "sft: sum loss, forward + backward (floor 3G = 1G + dlogits @ w + dlogits.T @ h)",
    "rl": "rl: log-probs + entropy, forward + backward (floor 4G = 3G + 1G)",
}
PROVIDERS = {  # provider: what it runs (the plot's legend)
    "hopperkern": "hopperkern, tma='auto' (TMA for every eligible operand); sft_path / grad_path 'auto'",
    "hopperkern-3pass": "hopperkern, tma='auto', sft_path / grad_path '3pass' (d(logits) or exponentials kept)",
    "hopperkern-4pass": "hopperkern, tma='auto', sft_path / grad_path '4pass' (logits recomputed in the backward)",
    "hopperkern-chunked": "hopperkern, tma='auto', sft_path 'chunked' (gradient GEMMs per token chunk in the forward)",
    "hopperkern-ptr": "hopperkern, tma='never' (pointer loads only)",
    "torch": "torch: h @ w.T, then F.cross_entropy / log_softmax on fp32 logits",
    "torch.compile": "torch.compile of the torch provider",
    "liger": "Liger-Kernel fused linear cross-entropy (loss only: sft)",
    "cce": "Cut Cross-Entropy, Apple (loss only: sft)",
}
RATIO_TOP = 3.0  # the plot's y limit: taller bars are cut there and labelled with their value


def _providers(compile_ok: bool):
    from hopperkern import lce

    def hk(tma, path="auto"):
        def sft(h, w, y):
            return lce.linear_cross_entropy(h, w, y, reduction="sum", tma=tma, sft_path=path)

        def rl(h, w, y):
            return lce.linear_logprobs_entropy(h, w, y, tma=tma, grad_path=path)

        return sft, rl

    def torch_sft(h, w, y):
        return F.cross_entropy((h @ w.T).float(), y, reduction="sum")

    def torch_rl(h, w, y):
        logp = torch.log_softmax((h @ w.T).float(), -1)
        return logp.gather(-1, y[:, None])[:, 0], -(logp.exp() * logp).sum(-1)

    provs = {"hopperkern": hk("auto"), "hopperkern-3pass": hk("auto", "3pass"), "hopperkern-4pass": hk("auto", "4pass"),
             "hopperkern-chunked": (hk("auto", "chunked")[0], None), "hopperkern-ptr": hk("never"),
             "torch": (torch_sft, torch_rl)}
    if compile_ok:
        provs["torch.compile"] = (torch.compile(torch_sft, dynamic=False), torch.compile(torch_rl, dynamic=False))
    try:
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        provs["liger"] = (lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y, reduction="sum"), None)
    except Exception:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        provs["cce"] = (lambda h, w, y: cce(h, w, y, reduction="sum"), None)
    except Exception:
        pass
    return provs


def _sft_path(provider, mode, N, H, V):
    """Which gradient path a hopperkern provider's sft or rl row ran ("3pass" / "chunked" / "mixed" / "4pass"; "" for
    other rows): a forced one, or what "auto" picks for bf16 at this shape (hopperkern.lce.sft.pick_path,
    rl.stored_rows)."""
    if mode == "fwd" or not provider.startswith("hopperkern"):
        return ""
    from hopperkern.lce import rl, sft

    forced = provider.rsplit("-", 1)[-1]
    path = forced if forced in ("3pass", "chunked", "4pass") else "auto"
    if mode == "sft":
        return sft.pick_path(path, N, V, H, 2)
    return rl_path_name(rl.stored_rows(path, N, V, H, torch.bfloat16), N)


def rl_path_name(stored: int, N: int) -> str:
    """The RL gradient path of a call that keeps ``stored`` of its ``N`` tokens' exponentials."""
    return "3pass" if stored >= N else ("mixed" if stored else "4pass")


def _floors(h, w, reps):
    N, V = h.shape[0], w.shape[0]
    dl = torch.randn(N, V, device="cuda", dtype=h.dtype) * 1e-3
    t1, _, _ = time_cuda(lambda: h @ w.T, reps=reps, back_to_back=True)
    tdh, _, _ = time_cuda(lambda: dl @ w, reps=reps, back_to_back=True)
    tdw, _, _ = time_cuda(lambda: dl.T @ h, reps=reps, back_to_back=True)
    del dl
    return {"1G": t1, "3G": t1 + tdh + tdw, "4G": 2 * t1 + tdh + tdw}


def _reference(h, w, y, g1, g2):
    """fp32 reference of the sum loss and the RL objective, with grads (TF32 off)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = h.detach().float().requires_grad_()
    wf = w.detach().float().requires_grad_()
    z = hf @ wf.T
    loss = F.cross_entropy(z, y, reduction="sum")
    dh, dw = torch.autograd.grad(loss, (hf, wf))
    ref = {"loss": loss.detach(), "dh": dh, "dw": dw}
    del z
    z = hf @ wf.T
    logp = torch.log_softmax(z, -1)
    lp = logp.gather(-1, y[:, None])[:, 0]
    ent = -(logp.exp() * logp).sum(-1)
    rdh, rdw = torch.autograd.grad((lp * g1 + ent * g2).sum(), (hf, wf))
    ref.update(lp=lp.detach(), ent=ent.detach(), rl_dh=rdh, rl_dw=rdw)
    del z, logp
    return ref


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def run_case(N, H, V, provs, reps, with_errors, ceilings):
    torch.manual_seed(0)
    h = (torch.randn(N, H, device="cuda") * H**-0.5 * 2).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda") * 0.5).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda")
    g1 = torch.randn(N, device="cuda")
    g2 = torch.randn(N, device="cuda") * 0.1
    floors = _floors(h, w, reps)  # and again after the providers (the end of this function)
    ref = None
    if with_errors:
        try:
            ref = _reference(h, w, y, g1, g2)
        except torch.OutOfMemoryError:  # the fp32 logits of the largest shapes exceed an 80 GB card
            print(f"{N} x {H} x {V}: the fp32 reference does not fit this GPU's memory; no error columns for this "
                  "shape", flush=True)
            gc.collect()
    gc.collect()
    torch.cuda.empty_cache()
    rows = []
    base = dict(N=N, H=H, V=V, **ceilings)
    for name, (sft, rl) in provs.items():
        for mode in ("fwd", "sft", "rl"):
            fn = sft if mode == "sft" else rl
            if fn is None:
                continue
            hh = h.detach().requires_grad_(mode != "fwd")
            ww = w.detach().requires_grad_(mode != "fwd")
            out = {}

            def step():
                if mode == "fwd":
                    with torch.no_grad():
                        out["lp"], out["ent"] = fn(hh, ww, y)
                elif mode == "sft":
                    hh.grad = ww.grad = None
                    out["loss"] = fn(hh, ww, y)
                    out["loss"].backward()
                else:
                    hh.grad = ww.grad = None
                    lp, ent = fn(hh, ww, y)
                    out["lp"], out["ent"] = lp, ent
                    (lp * g1 + ent * g2).sum().backward()

            row = dict(base, provider=name, mode=mode, floor=FLOORS[mode], sft_path=_sft_path(name, mode, N, H, V))
            try:
                step()  # warm-up / compile
                torch.cuda.synchronize()
                hh.grad = ww.grad = None
                out.clear()
                gc.collect()
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                step()
                torch.cuda.synchronize()
                grads = sum(t.numel() * t.element_size() for t in (hh.grad, ww.grad) if t is not None)
                outs = sum(t.numel() * t.element_size() for t in out.values())
                row["extra_mem_mib"] = (torch.cuda.max_memory_allocated() - before - grads - outs) / 2**20
                if ref is not None:
                    if mode == "sft":
                        row["err_loss"] = abs(out["loss"].item() - ref["loss"].item()) / abs(ref["loss"].item())
                        row["err_dh"] = _rel(hh.grad, ref["dh"])
                        row["err_dw"] = _rel(ww.grad, ref["dw"])
                    else:
                        row["err_logprob"] = _rel(out["lp"], ref["lp"])
                        row["err_entropy"] = _rel(out["ent"], ref["ent"])
                        if mode == "rl":
                            row["err_dh"] = _rel(hh.grad, ref["rl_dh"])
                            row["err_dw"] = _rel(ww.grad, ref["rl_dw"])
                med, p20, p80 = time_cuda(step, warmup=0, reps=reps, back_to_back=True)
                row.update(time_ms=med, p20_ms=p20, p80_ms=p80)
            except Exception as exc:  # report and go on: one failing peer must not hide the rest
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                traceback.print_exc(limit=2)
            rows.append(row)
            hh.grad = ww.grad = None
            out.clear()
            gc.collect()
            torch.cuda.empty_cache()
    after = _floors(h, w, reps)
    for row in rows:
        row.update({f"floor_{k}_ms": (floors[k] + after[k]) / 2 for k in floors}, floor_drift=after["3G"] / floors["3G"])
        if row.get("time_ms") is not None:
            row["ratio"] = row["time_ms"] / row[f"floor_{row['floor']}_ms"]
    return rows


def plot(rows, path):
    """Bars of time / floor per shape, one panel per mode, on a linear axis from 0 to RATIO_TOP (lower is
    better; 1.0 = the cuBLAS floor of the same run). Each shape's label carries its floor in ms."""
    plt = pyplot("bench_lce")
    if plt is None:
        return
    rows = [r for r in rows if r.get("ratio") is not None]
    shapes = sorted({(r["N"], r["H"], r["V"]) for r in rows}, key=lambda s: (-s[0] * s[1] * s[2], s))
    provs = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    provs += sorted({r["provider"] for r in rows} - set(provs))
    colors = dict(zip(provs, plt.get_cmap("tab10").colors))
    fig, axes = plt.subplots(3, 1, figsize=(13, 14), sharey=True)
    width = 0.8 / max(1, len(provs))
    for ax, mode in zip(axes, MODES):
        floor = FLOORS[mode]
        for i, p in enumerate(provs):
            for j, s in enumerate(shapes):
                hit = [r for r in rows if (r["N"], r["H"], r["V"]) == s and r["provider"] == p and r["mode"] == mode]
                if not hit:
                    continue
                x, y = j + (i - (len(provs) - 1) / 2) * width, float(hit[0]["ratio"])
                ax.bar(x, min(y, RATIO_TOP), width, color=colors[p])
                if y > RATIO_TOP:
                    ax.text(x, RATIO_TOP, f"{y:.1f}", ha="center", va="bottom", fontsize=6, rotation=90)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_ylim(0, RATIO_TOP * 1.08)
        ax.set_yticks([0, 0.5, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0])
        ax.grid(True, axis="y", lw=0.3)
        ax.set_xticks(range(len(shapes)))
        labels = []
        for s in shapes:
            f = next(r for r in rows if (r["N"], r["H"], r["V"]) == s)[f"floor_{floor}_ms"]
            labels.append(f"{s[0]} x {s[1]} x {s[2]}\n{floor} = {f:.1f} ms")
        ax.set_xticklabels(labels, fontsize=8)
        ax.set_ylabel("time / floor")
        ax.set_title(MODES[mode], fontsize=9)
    fig.suptitle(f"Fused linear cross-entropy: time / cuBLAS floor of the same run, lower is better (bars taller "
                 f"than {RATIO_TOP:g} are cut and labelled)\nN x H x V = tokens x hidden x vocabulary; "
                 f"{run_label(rows[0])}", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[p]) for p in provs]
    fig.legend(handles, [f"{p}: {PROVIDERS.get(p, p)}" for p in provs], loc="lower center", ncol=2, fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.06, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows):
    from rich.console import Console
    from rich.table import Table

    t = Table(title="LCE: time / cuBLAS floor (same run), extra MiB, errors vs fp32")
    for c in ("shape", "provider", "mode", "path", "ms", "ratio", "floor", "MiB", "err dH", "err dW"):
        t.add_column(c)
    for r in rows:
        f = (lambda k, fmt: (fmt % r[k]) if r.get(k) is not None else "-")
        t.add_row(f"{r['N']}x{r['H']}x{r['V']}", r["provider"], r["mode"], r.get("sft_path") or "",
                  f("time_ms", "%.2f"),
                  f("ratio", "%.3f"), r["floor"], f("extra_mem_mib", "%.0f"), f("err_dh", "%.2e"),
                  f("err_dw", "%.2e") if "error" not in r else r["error"][:40])
    Console(width=160).print(t)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--compile-shapes", type=int, default=1, help="torch.compile on the first K shapes only")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-errors", action="store_true")
    ap.add_argument("--plot-from", type=Path, default=None, help="redraw the plot of a stored CSV into --out")
    args = ap.parse_args(argv)
    if args.plot_from is not None:
        return redraw(args.plot_from, args.out, "bench_lce", plot)
    if not torch.cuda.is_available():
        print("bench_lce: no CUDA GPU, nothing to time")
        return 0
    from rich.progress import track

    meta = run_meta()
    ceil = measure_ceilings()
    print(json.dumps({**meta, **ceil}))
    shapes = QUICK if args.quick else SHAPES
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    tag = meta["device"].replace(" ", "_")
    for i, (N, H, V) in enumerate(track(shapes, description="LCE shapes")):
        provs = _providers(compile_ok=i < args.compile_shapes)
        rows += [dict(meta, **r) for r in run_case(N, H, V, provs, args.reps, not args.no_errors, ceil)]
        torch._dynamo.reset()
        # After every shape, beside the result: a run cut short keeps what it timed and leaves the CSV as it was.
        write_csv(args.out / f"lce_{tag}.partial.csv", rows)
    write_csv(args.out / f"lce_{tag}.csv", rows)
    (args.out / f"lce_{tag}.partial.csv").unlink(missing_ok=True)
    plot(rows, args.out / f"lce_{tag}.png")
    table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
