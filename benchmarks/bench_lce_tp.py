"""Vocab-parallel LCE benchmark: time and memory per rank of the sharded op against the unsharded op.

Each rank holds a contiguous 1/world of the vocab (the last rank takes the remainder); "tp" calls the LCE
functions with ``process_group`` on that shard, "full" calls the unsharded op on the whole head on every rank (what a
rank would run without vocab parallelism). Modes as in bench_lce: ``fwd`` = no-grad log-probs + entropy, ``sft`` =
sum loss forward + backward, ``rl`` = log-probs + entropy forward + backward with per-token upstream grads. Times are
medians of back-to-back calls (benchmarks.common.time_cuda), the slowest rank's; memory is each rank's peak above
its inputs, gradients and outputs, the largest over the ranks. Every "tp" row also holds its largest difference
from "full" (loss or log-prob / entropy, and d_hidden), a check that the run computed the same thing.

    torchrun --nproc-per-node 2 -m benchmarks.bench_lce_tp --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist

from benchmarks.common import run_meta, time_cuda, write_csv

HEADS = {"llama3-8B": (4096, 128256), "qwen2.5-7B": (3584, 152064)}  # H, V
TOKENS = (8192, 32768)
MODES = ("fwd", "sft", "rl")


def _shard(V: int, rank: int, world: int) -> slice:
    size = V // world
    return slice(rank * size, V if rank == world - 1 else (rank + 1) * size)


def _step(mode, h, w, y, g1, g2, group):
    from hopperkern import lce

    if mode == "fwd":
        with torch.no_grad():
            return lce.linear_logprobs_entropy(h, w, y, process_group=group)
    h.grad = w.grad = None
    if mode == "sft":
        loss = lce.linear_cross_entropy(h, w, y, reduction="sum", process_group=group)
        loss.backward()
        return (loss.detach(),)
    lp, ent = lce.linear_logprobs_entropy(h, w, y, process_group=group)
    (lp * g1 + ent * g2).sum().backward()
    return lp.detach(), ent.detach()


def _measure(mode, h, w, y, g1, g2, group, reps):
    """(outputs, d_hidden, median ms, p20, p80, extra peak MiB) of one provider on this rank."""
    hh, ww = h.detach().requires_grad_(mode != "fwd"), w.detach().requires_grad_(mode != "fwd")
    _step(mode, hh, ww, y, g1, g2, group)  # warm-up: compiles
    torch.cuda.synchronize()
    hh.grad = ww.grad = None
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    outs = _step(mode, hh, ww, y, g1, g2, group)
    torch.cuda.synchronize()
    kept = sum(t.numel() * t.element_size() for t in (*outs, hh.grad, ww.grad) if t is not None)
    extra = (torch.cuda.max_memory_allocated() - before - kept) / 2**20
    dh = None if hh.grad is None else hh.grad.clone()
    med, p20, p80 = time_cuda(lambda: _step(mode, hh, ww, y, g1, g2, group), warmup=0, reps=reps,
                              back_to_back=True)
    return outs, dh, med, p20, p80, extra


def _max_over_ranks(x: float) -> float:
    t = torch.tensor([x], device="cuda", dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _max_diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item() if a is not None and b is not None else float("nan")


def run_case(head, N, reps, rank, world):
    H, V = HEADS[head]
    g = torch.Generator(device="cuda").manual_seed(0)  # the same inputs on every rank
    h = (torch.randn(N, H, device="cuda", generator=g) * H**-0.5 * 2).to(torch.bfloat16)
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.5).to(torch.bfloat16)
    y = torch.randint(0, V, (N,), device="cuda", generator=g)
    g1, g2 = torch.randn(N, device="cuda", generator=g), torch.randn(N, device="cuda", generator=g) * 0.1
    w_shard = w[_shard(V, rank, world)].clone()
    rows = []
    for mode in MODES:
        got = {}
        for provider, weight, group in (("full", w, None), ("tp", w_shard, dist.group.WORLD)):
            row = dict(head=head, N=N, H=H, V=V, world=world, mode=mode, provider=provider,
                       V_shard=weight.shape[0])
            try:
                outs, dh, med, p20, p80, extra = _measure(mode, h, weight, y, g1, g2, group, reps)
                got[provider] = (outs, dh)
                row.update(time_ms=_max_over_ranks(med), p20_ms=_max_over_ranks(p20), p80_ms=_max_over_ranks(p80),
                           extra_mem_mib=_max_over_ranks(extra))
                if provider == "tp":
                    (o_full, dh_full), (o_tp, dh_tp) = got["full"], got["tp"]
                    row["max_diff_out"] = _max_over_ranks(max(_max_diff(a, b) for a, b in zip(o_tp, o_full)))
                    row["max_diff_dh"] = _max_over_ranks(_max_diff(dh_tp, dh_full))
            except Exception as exc:  # noqa: BLE001 - one failing case must not hide the rest (all ranks fail alike)
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            gc.collect()
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="8192 tokens only, fewer repetitions")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args(argv)
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for head in HEADS:
        for N in TOKENS[:1] if args.quick else TOKENS:
            rows += run_case(head, N, 5 if args.quick else args.reps, rank, world)
            if rank == 0:
                for r in rows[-2 * len(MODES):]:
                    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
    if rank == 0:
        meta = run_meta()
        path = args.out / f"lce_tp_{meta['device'].replace(' ', '_')}.csv"
        write_csv(path, [dict(r, **meta) for r in rows])
        print(f"wrote {path}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
