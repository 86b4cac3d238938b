"""MoE tuner: a small sweep of launch configs per (E, H, I, dtype) and token bucket on the current GPU.

For each bucket the row block (block_m) comes from :func:`hopperkern.moe.configs.pick_block_m` plus its neighbours
where the mean slots per expert sit near a block boundary; GEMM1 (gate/up) and GEMM2 (down, with its top-k reduction
as fused_moe runs it) are then timed separately over a few candidates each. The fastest gate/up config of each
block_m, paired with each of the two fastest down configs (and, for direct plans, the fastest of the fused top-k
form), then runs as a whole ``fused_moe`` beside the config that ``fused_moe`` uses now
(:func:`in_use`: the tuning file's entry or the heuristics), in the same interleaved rounds, and the fastest of
those wins: a re-tune keeps the config in use unless a new one beats it in the same run, and block_m choices timed
seconds apart are compared side by side. Candidates that fail (shared memory, compile) are skipped, and so is every
candidate whose result is off by more than 2 % from an fp32 reference of the whole MoE on 32 tokens spread over the
batch (a gate/up candidate goes through a fixed down config; a slot-parallel down candidate is checked with both
top-k reductions, as fused_moe may run either): a miscompiled config cannot win.

Buckets up to ``GRAPH_MAX_T`` tokens are timed as CUDA-graph replays of 10 launches, each after an L2 flush
(:func:`hopperkern.tune.timing.graph_ms`): their kernels run for 10-500 us, where an eager loop would time the
host's launch overhead instead of the kernels.
"""

from __future__ import annotations

import time

import torch

from ..tuning import KernelConfig, MoeConfig, moe_key
from .shapes import MOE_SHAPES
from .timing import graph_ms, pick_fastest, rank_fastest, rel_err

__all__ = ["BUCKETS", "CHECK_ROWS", "GRAPH_MAX_T", "block_m_choices", "candidates", "fused_candidates",
           "fused_mlp_candidates", "in_use", "tune_moe", "tune_moe_default"]

BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384)
GRAPH_MAX_T = 1024
_SMEM_BUDGET = 220 * 1024  # bytes of bf16 pipeline stages + epilogue tile a candidate may use (227 KiB limit)


def _k(bm, bn, bk, warps, stages, group, flatten=False):
    return KernelConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages, group_m=group,
                        flatten=flatten)


def _fits(cfg: KernelConfig, gemm: int) -> bool:
    from ..moe.configs import smem_bytes

    return smem_bytes(cfg, 2, 2 if gemm == 1 else 1) <= _SMEM_BUDGET  # bf16; gate/up reads two weight tiles


def _deepest(bm, bn, bk, stages, gemm, flatten) -> KernelConfig | None:
    """The decode config (bm, bn, bk, 4 warps) with the most pipeline stages <= ``stages`` that fits shared
    memory; None below 3 stages (too shallow to stream weights)."""
    for s in range(stages, 2, -1):
        c = _k(bm, bn, bk, 4, s, 1, flatten)
        if _fits(c, gemm):
            return c
    return None


# Decode (block_m <= 32) candidates as (block_n, block_k, most stages, flatten). Weight-bandwidth bound: deep
# pipelines of 16-64 KiB stages. The down GEMM's K (= I) is short for fine-grained experts (256-768), so its
# flattened tile loop, which prefetches the next tile's K loads under this tile's epilogue, streams at the
# gate/up GEMM's rate; the flattened loop costs the gate/up GEMM nothing at these sizes.
_DECODE = {
    1: [(64, 256, 3, True), (64, 128, 6, True), (32, 256, 5, True), (128, 128, 3, True), (128, 64, 6, True),
        (32, 128, 8, False)],
    2: [(256, 128, 3, True), (128, 128, 6, True), (128, 256, 3, True), (64, 256, 5, True), (32, 128, 8, True)],
}
_DECODE_FUSED = [(128, 256, 3, False), (64, 256, 5, True), (32, 256, 8, True)]
# Both GEMMs in one kernel (MoeConfig.fused_mlp, direct plans) as (slice of I, gate/up step over H, down chunk of H,
# gate/up stages, down stages, warps): one program per (slot, slice), so the slice sets how many programs stream.
_FUSED_MLP = [(16, 256, 128, 4, 4, 4), (16, 128, 256, 6, 3, 4), (32, 128, 128, 6, 4, 4), (32, 256, 128, 4, 4, 4),
              (64, 128, 64, 4, 4, 4), (64, 128, 128, 4, 3, 8), (128, 128, 64, 3, 3, 8)]
FUSED_MLP_MIN_PROGRAMS = 64  # fewer (slot, slice) programs than this cannot stream the weights at full rate


def candidates(block_m: int, gemm: int) -> list[KernelConfig]:
    """3-9 launch configs for one GEMM (1 = gate/up: a paired gate-and-up accumulator, 2 = down) at this block_m.

    Decode sizes (block_m <= 32): :data:`_DECODE`, each with as many stages as fit. Prefill sizes
    (block_m >= 64) include flattened tile loops (the persistent kernels prefetch the next tile's K loads
    under this tile's epilogue), and at block_m 128 one 4-warp tile per GEMM small enough for two programs per
    SM (128 x 64 x 64 with 3 stages for gate/up, a flattened 128 x 128 x 64 with 2 stages for the down GEMM):
    one program's epilogue then runs while the other's MMAs do, which pays where the down GEMM's K (= I) is
    short; and a flattened 128 x 256 x 64 down tile (195 registers with the per-slot store in column quarters; the
    atomic top-k sum runs it unflattened, see :func:`hopperkern.moe.configs.atomic_config`), which gains most
    where K is short and the output wide (I = 256-768)."""
    if block_m <= 32:
        cands = [_deepest(block_m, bn, bk, s, gemm, f) for bn, bk, s, f in _DECODE[gemm]]
        return [c for c in cands
                if c is not None and not (gemm == 1 and block_m == 32 and c.block_k == 256)]  # spills (ptxas)
    if block_m == 64:
        t = ([(64, 64, 4, 4, 0), (64, 128, 4, 3, 0), (128, 64, 8, 3, 0), (64, 64, 4, 5, 0), (64, 64, 4, 4, 1),
              (128, 64, 8, 3, 1)]
             if gemm == 1 else
             [(64, 64, 4, 4, 0), (128, 64, 4, 4, 0), (128, 64, 8, 3, 0), (256, 64, 8, 3, 0), (128, 64, 4, 4, 1),
              (128, 64, 8, 3, 1), (256, 64, 8, 3, 1)])
        return [_k(64, bn, bk, w, s, 8, bool(f)) for bn, bk, w, s, f in t]
    t = ([(64, 64, 4, 4, 0), (128, 64, 8, 3, 0), (128, 64, 8, 4, 0), (64, 64, 4, 4, 1), (128, 64, 8, 3, 1),
          (128, 64, 8, 4, 1), (64, 64, 4, 3, 0)]
         if gemm == 1 else
         [(128, 64, 8, 3, 0), (128, 64, 8, 4, 0), (256, 64, 8, 3, 0), (256, 32, 8, 4, 0), (128, 64, 8, 3, 1),
          (128, 64, 8, 4, 1), (128, 128, 8, 3, 1), (128, 64, 4, 2, 1), (256, 64, 8, 3, 1)])
    return [_k(128, bn, bk, w, s, 8, bool(f)) for bn, bk, w, s, f in t]


def fused_candidates(block_m: int) -> list[KernelConfig]:
    """Down-GEMM configs for the fused top-k kernel of direct plans: it has k times fewer programs than the
    slot-parallel kernel, so each needs a deep pipeline to keep enough bytes in flight."""
    return [c for c in (_deepest(block_m, bn, bk, s, 2, f) for bn, bk, s, f in _DECODE_FUSED) if c is not None]


def fused_mlp_candidates(num_slots: int, I: int) -> list[MoeConfig]:  # noqa: E741
    """:data:`_FUSED_MLP` configs (``MoeConfig.fused_mlp``) for a direct plan of ``num_slots`` slots: those whose
    slices of I give at least :data:`FUSED_MLP_MIN_PROGRAMS` programs, else the one with the most programs."""
    out = []
    for bi, bk, bh, s1, s2, w in _FUSED_MLP:
        g1 = _k(16, bi, bk, w, s1, 1)
        g2 = _k(16, bh, bi, w, s2, 1)
        out.append((num_slots * -(-I // bi), MoeConfig(gemm1=g1, gemm2=g2, fused_mlp=True)))
    enough = [mc for n, mc in out if n >= FUSED_MLP_MIN_PROGRAMS]
    return enough or [max(out, key=lambda x: x[0])[1]]


def block_m_choices(T: int, top_k: int, E: int) -> list[int]:
    """Row-block sizes to try: the heuristic's, and its neighbours where the mean slots per expert sit near a
    block boundary. At decode sizes a bigger block (more padding rows, nearly free while weight-bound) keeps
    most experts in ONE block, so their weights stream once instead of once per block."""
    from ..moe.configs import pick_block_m

    bm = pick_block_m(T, top_k, E)
    per_expert = T * top_k / E
    if bm <= 32 and per_expert > 2:
        return [bm, 2 * bm]
    if bm == 64 and per_expert > 48:
        return [64, 128]
    if bm == 64:
        return [64, 32]
    if bm == 128 and per_expert < 512:
        return [128, 64]
    return [bm]


def _timer(graph: bool):
    import triton

    # One of pick_fastest's rounds per call (three rounds per candidate). Eager buckets (>= 4096 tokens,
    # milliseconds per call): 15 ms of samples per round.
    return (lambda fn: graph_ms(fn, rep=15)) if graph else (lambda fn: triton.testing.do_bench(fn, warmup=5, rep=15))


FINALIST_DOWNS = 2  # down configs per block_m (the fastest timed apart) that the end-to-end pick times
# From this many tokens the end-to-end pick also times each sorted-plan finalist with MoeConfig.sorted_rows. Below,
# the GEMMs stream weights and the row copy is one more launch for nothing (H200, same tiles: 0.95-1.03 x at 1024
# tokens, 0.92-0.98 x for gpt-oss-120B and mixtral-8x7B at 4096 and 16384).
SORTED_ROWS_MIN_T = 1024

SETTLE_S = {True: 0.2, False: 0.5}  # seconds of back-to-back calls before a bucket's timing rounds (graph, eager)


CHECK_ROWS = 32  # tokens compared with the fp32 reference per bucket (rows are independent), spread over T


def in_use(E: int, H: int, I: int, dtype, T: int, top_k: int, device) -> MoeConfig | None:  # noqa: E741
    """The config ``fused_moe`` runs now for this problem: the entry of the tuning file it loads (which is the
    file ``--out`` merges into only when they are the same file), else the heuristics; None under the
    interpreter or when no file can be read. The tuner keeps it unless a new config beats it in the same run."""
    import warnings

    from ..moe.configs import moe_launch_config

    try:
        with warnings.catch_warnings():  # "no entry, tune it": the tuner is doing so
            warnings.simplefilter("ignore")
            cfg, source = moe_launch_config(E, H, I, dtype, T, top_k, device)
    except Exception:  # an unreadable tuning file: nothing to compare with (the runtime says what is wrong)
        return None
    return None if source == "interpreter" else cfg


def _final_pick(finalists, current, run, err, timer, settle: float, log, rounds: int = 3):
    """(ms, MoeConfig) among the per-block_m finalists and the config in use (``current``), timed end to end
    (``run(config)`` = fused_moe with it) in interleaved rounds; a lone finalist is taken as it is (with its
    GEMMs' time). None without finalists (every candidate failed: the bucket keeps what it has)."""
    if not finalists:
        return None
    cands = [mc for _, mc in finalists]
    if current is not None and current not in cands:
        cands.append(current)
    if len(cands) == 1:
        return finalists[0]
    return pick_fastest(cands, run, timer, log=log, what="fused_moe", settle_s=settle, rounds=rounds,
                        check=lambda mc: err(run(mc)))


def tune_moe(shapes, token_counts=BUCKETS, dtype=torch.bfloat16, time_budget_s: float = 180.0, log=print, *,
             device="cuda", time_fn=None):
    """Sweep configs for ``shapes`` ((E, H, I, top_k) tuples) at each token count; stop starting new buckets
    once ``time_budget_s`` is spent (those keep the heuristics). Returns ``{moe_key: {str(T): MoeConfig}}``.
    ``device`` and ``time_fn`` (fn -> ms; default: graph replays / do_bench) let the CPU tests run the whole
    loop under Triton's interpreter."""
    from .. import moe
    from ..moe import reference

    t0 = time.time()
    result: dict = {}
    for E, H, I, top_k in shapes:  # noqa: E741
        gen = torch.Generator(device=device).manual_seed(0)
        w13 = (torch.randn((E, 2 * I, H), generator=gen, device=device) * H ** -0.5).to(dtype)
        w2 = (torch.randn((E, H, I), generator=gen, device=device) * I ** -0.5).to(dtype)
        key = moe_key(E, H, I, dtype)
        for T in token_counts:
            if time.time() - t0 > time_budget_s:
                log(f"tune_moe: time budget {time_budget_s:.0f} s spent; {key} T={T} keeps the heuristics")
                continue
            x = torch.randn((T, H), generator=gen, device=device).to(dtype)
            weights, ids = moe.route(torch.randn((T, E), generator=gen, device=device), top_k)
            sel = torch.linspace(0, T - 1, min(T, CHECK_ROWS), device=device).long()  # spread over the batch
            ref = reference.fused_moe(x[sel], w13, w2, weights[sel], ids[sel], compute_dtype=torch.float32)
            timer = time_fn or _timer(T <= GRAPH_MAX_T)
            settle = 0.0 if time_fn else SETTLE_S[T <= GRAPH_MAX_T]
            rounds = 1 if time_fn else 3  # a given time_fn (the CPU tests') is deterministic: one round is enough

            def err(out):
                return rel_err(out[sel], ref)

            finalists: list = []  # (gemm1 + gemm2 ms, MoeConfig): the pairs the end-to-end pick times
            for bm in block_m_choices(T, top_k, E):
                make_plan = moe.direct_plan if moe.prefer_direct(T, top_k, E) else moe.moe_align  # as fused_moe
                plan = make_plan(ids, E, bm)
                probe2 = candidates(bm, 2)[0]  # finishes each gate/up candidate's output for the check
                g1 = pick_fastest(candidates(bm, 1), lambda cf: moe.gate_up(x, w13, plan, config=cf), timer,
                                  rounds=rounds, log=log, what="gemm1", settle_s=settle, check=lambda cf: err(moe.down(
                                      moe.gate_up(x, w13, plan, config=cf), w2, weights, ids, plan, config=probe2)))
                if g1 is None:
                    continue
                inter = moe.gate_up(x, w13, plan, config=g1[1])

                def run2(cf, fused=False):
                    return moe.down(inter, w2, weights, ids, plan, config=cf, fused_topk=fused)

                def check2(cf):
                    # The slot-parallel down config also serves deterministic=False (fp32 atomic top-k sum, on
                    # direct and sorted plans alike), whose epilogue needs other resources: it must compile and
                    # compute right too.
                    atomic = err(moe.down(inter, w2, weights, ids, plan, config=cf, deterministic=False))
                    return max(err(run2(cf)), atomic)

                # The two fastest down configs go on to the end-to-end pick: timed apart (after an L2 flush or
                # alone), their order can differ from the one they take behind the gate/up GEMM.
                downs = [(g2, False) for g2 in rank_fastest(candidates(bm, 2), run2, timer, rounds=rounds, log=log,
                                                            what="gemm2", check=check2,
                                                            settle_s=settle)[:FINALIST_DOWNS]]
                if plan.direct:  # the top-k sum inside the down GEMM: k times fewer, longer programs
                    downs.append((pick_fastest(fused_candidates(bm), lambda cf: run2(cf, True), timer, log=log,
                                               rounds=rounds, what="gemm2 fused", check=lambda cf: err(run2(cf, True)),
                                               settle_s=settle), True))
                for g2, fused in downs:
                    if g2 is None:
                        continue
                    log(f"  {key} T={T} block_m={bm}: gemm1 {g1[0] * 1e3:.1f} us {g1[1].model_dump()} | "
                        f"gemm2{' fused top-k' if fused else ''} {g2[0] * 1e3:.1f} us {g2[1].model_dump()}")
                    finalists.append((g1[0] + g2[0], MoeConfig(gemm1=g1[1], gemm2=g2[1], fused_topk=fused)))
                    if not plan.direct and T >= SORTED_ROWS_MIN_T:  # the same tiles, the gate/up GEMM on a sorted copy
                        finalists.append((g1[0] + g2[0], MoeConfig(gemm1=g1[1], gemm2=g2[1], sorted_rows=True)))
                if plan.direct and bm == 16:  # both GEMMs in one kernel: timed whole, as fused_moe runs it
                    mlp = pick_fastest(fused_mlp_candidates(T * top_k, I),
                                       lambda mc: moe.fused_moe(x, w13, w2, weights, ids, config=mc), timer, log=log,
                                       what="fused mlp", check=lambda mc: err(moe.fused_moe(x, w13, w2, weights, ids,
                                                                                            config=mc)),
                                       settle_s=settle, rounds=rounds)
                    if mlp is not None:
                        log(f"  {key} T={T} fused mlp {mlp[0] * 1e3:.1f} us {mlp[1].model_dump()}")
                        finalists.append(mlp)
                del inter, plan
            best = _final_pick(finalists, in_use(E, H, I, dtype, T, top_k, x.device),
                               lambda mc: moe.fused_moe(x, w13, w2, weights, ids, config=mc), err, timer, settle, log,
                               rounds)
            if best is not None:
                result.setdefault(key, {})[str(T)] = best[1]
                log(f"tune_moe: {key} T={T}: {best[0] * 1e3:.1f} us {best[1].model_dump()} "
                    f"(t+{time.time() - t0:.0f} s)")
            del x, weights, ids
        del w13, w2
        torch.cuda.empty_cache()
    return result


def tune_moe_default(names=None, token_counts=BUCKETS, time_budget_s: float = 180.0, log=print) -> dict:
    """The :data:`~hopperkern.tune.shapes.MOE_SHAPES` named in ``names`` (default: all) at ``token_counts``,
    bf16: what ``python -m hopperkern.tune`` sweeps."""
    shapes = [(E, H, I, k) for E, k, H, I in (MOE_SHAPES[n] for n in (names or MOE_SHAPES))]
    return tune_moe(shapes, tuple(token_counts), torch.bfloat16, time_budget_s, log)
