"""Compile the grouped-GEMM kernels of fused_moe for sm_90 without a GPU (Triton front end + ptxas only) and
print registers, spills, shared memory and the estimated resident programs per SM against the real ones.

For every config of the heuristics and of the tuner's candidate list on the PERF.md shapes, both TMA flags,
flatten on and off, sorted and direct plans, the down GEMM with both top-k reductions, and the kernel that runs
both GEMMs of a direct plan (``MoeConfig.fused_mlp``, the tuner's candidates for one token); ``--shipped``: the
shipped tuning files' configs only, their gate/up GEMMs of sorted plans also on the sorted row copy. Also the
training path (forward saving pre-activations, the backward's dY, d_hidden and weight-gradient GEMMs) on the
training shapes. Catches what the interpreter cannot: lowering and pipeliner failures, shared memory over 227 KiB,
register spills, and a programs-per-SM estimate above what fits.

    env -u TRITON_INTERPRET python -m benchmarks.compile_moe_sm90 [--quick | --shipped] [--jobs 16]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor

SMEM_LIMIT = 227 * 1024
_DIV16 = [["tt.divisibility", 16]]


def _signature(fn, values: dict, constexprs: dict):
    """(signature, constexprs, attrs) like the launcher's specialisation: pointers and ints that are multiples
    of 16 get divisibility 16, ints equal to 1 become constexprs, do_not_specialize ints stay plain i32."""
    sig, const, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        v = values[name]
        if isinstance(v, str):  # pointer element type
            sig[name] = f"*{v}"
            attrs[(i,)] = _DIV16
        elif name in fn.do_not_specialize or i in fn.do_not_specialize:
            sig[name] = "i32"
        elif v == 1:
            sig[name] = "constexpr"
            const[name] = 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = _DIV16
    return sig, const, attrs


def _ptxas_stats(ptx: str) -> tuple[int, int]:
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        res = subprocess.run([get_ptxas(90).path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    regs = int(re.search(r"Used (\d+) registers", res.stderr).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", res.stderr))
    return regs, spills


_MEMORY_OP = re.compile(r"\b(?:ld|st|atom|red)\.(?:global|shared)|\bcp\.async|\btensormap|\bcp\.reduce\.async")


def pdl_wait_first(ptx: str) -> bool:
    """A chained kernel's PTX waits for the previous kernel (griddepcontrol.wait) before its first global or shared
    memory access, TMA copy or descriptor write: nothing it reads or writes can race the kernel before it."""
    body = ptx[ptx.index(".entry"):]
    wait = body.find("griddepcontrol.wait")
    first = _MEMORY_OP.search(body)
    return wait >= 0 and (first is None or wait < first.start())


def compile_one(job):
    """Compile one variant; returns a result row (dict)."""
    import triton
    from triton.backends.compiler import GPUTarget

    from hopperkern.moe import _backward_kernels as B
    from hopperkern.moe import _gemm_kernels as K
    from hopperkern.moe.configs import atomic_config, programs_per_sm
    from hopperkern.tuning import KernelConfig

    gemm, E, H, I, cfg_d, w_tma, y_tma, flatten, direct = job  # noqa: E741
    cfg = KernelConfig(**{**cfg_d, "flatten": flatten})
    atomic = direct in ("atomic", "atomic_direct")  # deterministic=False: fp32 atomic top-k sum epilogue
    if atomic:
        cfg = atomic_config(cfg, 2)  # as the launcher derives it (stages, warps and flattening)
        flatten = cfg.flatten
    common = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                  W_TMA=w_tma, Y_TMA=y_tma, DOT_PRECISION="tf32", NUM_PROGRAMS=132, FLATTEN=flatten,
                  # Chained (moe.configs.chain_decode) only at decode sizes, whose row blocks are 16 or 32.
                  PDL_WAIT=cfg.block_m <= 32, PDL_TRIGGER=cfg.block_m <= 32)
    if gemm == 1:
        fn = K._gate_up_kernel
        vals = dict(x_ptr="bf16", w_ptr="bf16", y_ptr="bf16", pg_ptr="bf16", pu_ptr="bf16", slots_ptr="i32",
                    block_expert_ptr="i32", num_blocks_ptr="i32", E=E, H=H, I=I, num_rows=4096, num_slots=4096,
                    top_k=8, max_blocks=64, stride_xt=H, stride_xh=1, stride_we=2 * I * H, stride_wn=H, stride_wh=1,
                    stride_ym=I, stride_pm=2 * I)
        save = direct == "save"  # training forward: also stores the pre-activations
        xs = direct == "sorted_rows"  # A rows from the sorted copy, through TMA (MoeConfig.sorted_rows)
        const = dict(common, ACT=K.ACT_SILU, DIRECT=bool(direct) and not (save or xs), SAVE_PRE=save,
                     PG_TMA=save and y_tma, PU_TMA=save and y_tma, X_SORTED=xs)
    elif gemm == "dgate_up":
        fn, recompute = B._dgate_up_kernel, direct == "recompute"
        vals = dict(dout_ptr="bf16", w2_ptr="bf16", x_ptr="bf16", w13_ptr="bf16", pg_ptr="bf16", pu_ptr="bf16",
                    y_ptr="bf16", dg_ptr="bf16", du_ptr="bf16", part_ptr="fp32", tw_ptr="fp32", slots_ptr="i32",
                    block_expert_ptr="i32", num_blocks_ptr="i32", E=E, H=H, I=I, num_rows=4096, num_slots=4096,
                    top_k=8, max_blocks=64, stride_dm=H, stride_w2e=H * I, stride_w2h=I, stride_w2i=1, stride_xm=H,
                    stride_w13e=2 * I * H, stride_w13n=H, stride_w13h=1, stride_pm=2 * I, stride_ym=I,
                    stride_gm=2 * I, stride_twt=8, stride_twk=1)
        const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                     ACT=K.ACT_SILU, RECOMPUTE=recompute, HALVES=2 if y_tma and not recompute else 1, D_TMA=y_tma,
                     X_TMA=y_tma and recompute, W2_TMA=w_tma, W13_TMA=w_tma and recompute,
                     PG_TMA=y_tma and not recompute, PU_TMA=y_tma and not recompute, Y_TMA=y_tma,
                     DG_TMA=y_tma, DU_TMA=y_tma, DOT_PRECISION="tf32", NUM_PROGRAMS=132, FLATTEN=flatten)
    elif gemm in ("d_w13", "d_w2"):
        fn, w13 = B._expert_wgrad_kernel, gemm == "d_w13"
        M, N = (2 * I, H) if w13 else (H, I)
        vals = dict(a_ptr="bf16", b_ptr="bf16", out_ptr="bf16", offsets_ptr="i32", E=E, M=M, N=N, num_rows=4096,
                    stride_a=M, stride_b=N, stride_oe=M * N, stride_om=N, stride_on=1)
        const = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                     A_TMA=y_tma, B_TMA=y_tma, O_TMA=y_tma, DOT_PRECISION="tf32", NUM_PROGRAMS=132, FLATTEN=flatten)
    elif gemm == "mlp":  # MoeConfig.fused_mlp: both GEMMs of a DIRECT plan in one kernel; direct = (block_h, stages)
        fn = K._gate_up_down_kernel
        vals = dict(x_ptr="bf16", w13_ptr="bf16", w2_ptr="bf16", part_ptr="fp32", tw_ptr="fp32", ids_ptr="i32", E=E,
                    H=H, I=I, num_slots=8, top_k=8, stride_xt=H, stride_xh=1, stride_w1e=2 * I * H, stride_w1n=H,
                    stride_w1h=1, stride_w2e=H * I, stride_w2h=I, stride_w2i=1, stride_twt=8, stride_twk=1, stride_p=H)
        const = dict(BLOCK_M=cfg.block_m, BLOCK_I=cfg.block_n, BLOCK_K=cfg.block_k, BLOCK_H=direct[0],
                     STAGES_1=cfg.num_stages, STAGES_2=direct[1], ACT=K.ACT_SILU, W1_TMA=w_tma, W2_TMA=y_tma,
                     DOT_PRECISION="tf32", PDL_WAIT=True, PDL_TRIGGER=True)
    elif direct == "fused":  # a DIRECT plan's down GEMM with the top-k sum inside
        fn = K._down_direct_kernel
        vals = dict(y_ptr="bf16", w_ptr="bf16", out_ptr="bf16", tw_ptr="fp32", ids_ptr="i32", E=E, H=H, I=I,
                    num_rows=128, num_tokens=1, top_k=8, stride_ym=I, stride_we=H * I, stride_wh=I, stride_wi=1,
                    stride_twt=8, stride_twk=1, stride_ot=H, stride_oh=1)
        const = dict(common, TOP_K_P=8)
    else:
        fn = K._down_kernel
        b_kn = direct == "b_kn"  # the backward's d_hidden GEMM: w13 [E, 2I, H] as [E, K, N], no routed weight
        K_dim = 2 * I if b_kn else I
        vals = dict(y_ptr="bf16", w_ptr="bf16", out_ptr="bf16", tw_ptr="fp32", slots_ptr="i32",
                    block_expert_ptr="i32", num_blocks_ptr="i32", E=E, H=H, I=K_dim, num_rows=4096, num_slots=4096,
                    top_k=8, max_blocks=64, stride_ym=K_dim, stride_we=H * K_dim, stride_wh=1 if b_kn else K_dim,
                    stride_wi=H if b_kn else 1, stride_twt=8, stride_twk=1, stride_om=H, stride_on=1)
        plan_direct = direct == "atomic_direct" or (bool(direct) and not b_kn and not atomic)
        if atomic:
            vals["out_ptr"] = "fp32"  # the atomic top-k sum adds into an fp32 [T, H] buffer
        const = dict(common, ATOMIC=atomic, DIRECT=plan_direct, B_KN=b_kn, SCALE=not b_kn)
    sig, const, attrs = _signature(fn, vals, const)
    row = dict(gemm=gemm, E=E, H=H, I=I, cfg=cfg, w_tma=w_tma, y_tma=y_tma, direct=direct)
    try:
        k = triton.compile(triton.compiler.ASTSource(fn, sig, const, attrs), target=GPUTarget("cuda", 90, 32),
                           options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        regs, spills = _ptxas_stats(k.asm["ptx"])
        shared = k.metadata.shared
        threads = 32 * cfg.num_warps
        regs_alloc = -(-regs * 32 // 256) * 256 * cfg.num_warps  # registers are allocated per warp, 256 at a time
        fits = min((228 * 1024) // (shared + 1024), 65536 // regs_alloc, 2048 // threads, 32)
        row.update(ok=True, regs=regs, spills=spills, shared=shared, fits=fits,
                   est=programs_per_sm(cfg, 2, 2 if gemm == 1 else 1, 4 if atomic else None) if gemm in (1, 2) else 0,
                   pdl_order=pdl_wait_first(k.asm["ptx"]) if const.get("PDL_WAIT") else True)
    except Exception as exc:  # noqa: BLE001 - report every failure, keep going
        row.update(ok=False, error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
    return row


def jobs(quick: bool):
    from hopperkern.moe.configs import heuristic_config
    from hopperkern.tune.moe_tuner import BUCKETS, block_m_choices, candidates, fused_candidates, fused_mlp_candidates
    from hopperkern.tune.shapes import MOE_SHAPES as SHAPES

    cfgs = {}  # (gemm, E, H, I) -> {config dict}
    for E, k, H, I in SHAPES.values():  # noqa: E741
        for T in BUCKETS:
            h = heuristic_config(E, H, I, T, k)
            for gemm, c in ((1, h.gemm1), (2, h.gemm2)):
                cfgs.setdefault((gemm, E, H, I), {})[tuple(sorted(c.model_dump().items()))] = c
            if quick:
                continue
            for bm in block_m_choices(T, k, E):
                for gemm in (1, 2):
                    for c in candidates(bm, gemm) + (fused_candidates(bm) if gemm == 2 and bm == 16 else []):
                        cfgs.setdefault((gemm, E, H, I), {})[tuple(sorted(c.model_dump().items()))] = c
    out = backward_jobs()
    for E, k, H, I in SHAPES.values():  # noqa: E741 - both GEMMs in one kernel (fused_mlp), one token's slots
        for mc in fused_mlp_candidates(k, I):
            out += [("mlp", E, H, I, mc.gemm1.model_dump(), tma, tma, False, (mc.gemm2.block_n, mc.gemm2.num_stages))
                    for tma in (False, True)]
    for (gemm, E, H, I), cs in cfgs.items():  # noqa: E741
        for c in cs.values():
            d = c.model_dump()
            flats = (c.flatten,) if quick else (False, True)
            for flatten in flats:
                for tma in (False, True):
                    direct = c.block_m == 16 and not flatten  # fused_moe uses direct plans for tiny batches
                    out.append((gemm, E, H, I, d, tma, tma, flatten, False))
                    if direct:
                        out.append((gemm, E, H, I, d, tma, tma, flatten, True))
                        if gemm == 2:
                            out.append((gemm, E, H, I, d, tma, tma, flatten, "fused"))
                    if gemm == 2:  # deterministic=False runs the same config with the atomic epilogue
                        out.append((gemm, E, H, I, d, tma, tma, flatten, "atomic"))
    return out


def shipped_jobs():
    """Every config of the shipped tuning files (configs/*.json) as fused_moe runs it, both memory paths:
    the gate/up GEMM (direct plan where the bucket takes one), the down GEMM with both top-k reductions (fixed
    order and fp32 atomics), the fused top-k down GEMM where the entry asks for it, and the one kernel of both
    GEMMs where a direct bucket takes ``fused_mlp``."""
    from pathlib import Path

    from hopperkern.moe.align import prefer_direct
    from hopperkern.tune.shapes import MOE_SHAPES as SHAPES
    from hopperkern.tuning import load_config, moe_key

    files = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.json"))
    out = []
    for (E, k, H, I), cfg in itertools.product(SHAPES.values(), [load_config(f) for f in files]):  # noqa: E741
        for bucket, mc in cfg.moe.get(moe_key(E, H, I, "bfloat16"), {}).items():
            direct = prefer_direct(int(bucket), k, E)
            for tma in (False, True):
                g1, g2 = mc.gemm1.model_dump(), mc.gemm2.model_dump()
                if direct and mc.fused_mlp:  # both GEMMs in one kernel; no atomic variant (always in fixed order)
                    out.append(("mlp", E, H, I, g1, tma, tma, False, (mc.gemm2.block_n, mc.gemm2.num_stages)))
                    continue
                out.append((1, E, H, I, g1, tma, tma, mc.gemm1.flatten, direct))
                if tma and not direct:  # the gate/up GEMM on the sorted copy (MoeConfig.sorted_rows), TMA only
                    out.append((1, E, H, I, g1, tma, tma, mc.gemm1.flatten, "sorted_rows"))
                if direct and mc.fused_topk:
                    out.append((2, E, H, I, g2, tma, tma, mc.gemm2.flatten, "fused"))
                else:
                    out.append((2, E, H, I, g2, tma, tma, mc.gemm2.flatten, direct))
                out.append((2, E, H, I, g2, tma, tma, mc.gemm2.flatten, "atomic_direct" if direct else "atomic"))
    return list({repr(j): j for j in out}.values())


def backward_jobs():
    """The training path's kernels on the training shapes at T = 4096 and 16384: the forward's gate/up GEMM
    saving pre-activations, the dY GEMM (saved and recomputed), the d_hidden GEMM and both weight-gradient
    GEMMs, with the configs the backward derives from the heuristic forward configs."""
    import torch

    from benchmarks.bench_moe_train import SHAPES as TRAIN
    from hopperkern.moe.backward import backward_configs
    from hopperkern.moe.configs import heuristic_config

    out = []
    for E, k, H, I in TRAIN.values():  # noqa: E741
        for T in (4096, 16384):
            h = heuristic_config(E, H, I, T, k)
            for recompute in (False, True):
                c1, c2, cw = backward_configs(h, torch.bfloat16, recompute)
                for tma in (False, True):
                    mode = "recompute" if recompute else "saved"
                    out.append(("dgate_up", E, H, I, c1.model_dump(), tma, tma, c1.flatten, mode))
                    if recompute:
                        continue
                    out.append((1, E, H, I, h.gemm1.model_dump(), tma, tma, h.gemm1.flatten, "save"))
                    out.append((2, E, H, I, c2.model_dump(), tma, tma, c2.flatten, "b_kn"))
                    for g in ("d_w13", "d_w2"):
                        out.append((g, E, H, I, cw.model_dump(), tma, tma, cw.flatten, False))
    return list({repr(j): j for j in out}.values())


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET"):
        print("compile_moe_sm90: unset TRITON_INTERPRET (env -u TRITON_INTERPRET ...)")
        return 2
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="heuristic configs only, their own flatten flag")
    ap.add_argument("--shipped", action="store_true",
                    help="only the configs of the shipped tuning files, as fused_moe runs them (both top-k sums)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count())
    args = ap.parse_args(argv)
    todo = shipped_jobs() if args.shipped else jobs(args.quick)
    bad = 0
    with ProcessPoolExecutor(args.jobs) as pool:
        for r in pool.map(compile_one, todo):
            c = r["cfg"]
            label = f"gemm{r['gemm']}" if isinstance(r["gemm"], int) else r["gemm"]
            what = (f"{label} E{r['E']} H{r['H']} I{r['I']} bm{c.block_m} bn{c.block_n} bk{c.block_k} "
                    f"w{c.num_warps} s{c.num_stages} flat={int(c.flatten)} tma={int(r['w_tma'])} "
                    f"direct={r['direct']}")
            if not r["ok"]:
                bad += 1
                print(f"FAIL {what}: {r['error']}")
                continue
            warn = []
            if r["shared"] > SMEM_LIMIT:
                warn.append("SMEM>227K")
            if r["spills"]:
                warn.append("SPILLS")
            if r["est"] > r["fits"]:
                warn.append("EST>FITS")
            if not r.get("pdl_order", True):
                warn.append("MEMORY-BEFORE-PDL-WAIT")
            bad += bool(warn)
            print(f"{'WARN' if warn else 'ok  '} {what}: regs {r['regs']} spills {r['spills']} smem "
                  f"{r['shared'] / 1024:.0f}K programs/SM est {r['est']} fits {r['fits']} {' '.join(warn)}")
    print(f"compile_moe_sm90: {len(todo)} variants, {bad} failed or warned")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
