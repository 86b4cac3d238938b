"""fused_moe against the fp64 per-expert reference, on both memory paths; errors; configs."""

import warnings
from dataclasses import dataclass

import pytest
import torch

import hopperkern.moe.configs as moe_configs
from hopperkern import moe, tma
from hopperkern.moe import reference
from hopperkern.tma import UnsupportedError
from hopperkern.tuning import KernelConfig, MoeConfig, TuningConfig, moe_key

# Normalised by max|ref|: the kernel's error must be <= 2x plain torch's in the same dtype plus this.
ATOL = {torch.float32: 1e-6, torch.float16: 1e-4}


def make_inputs(T, E, H, I, k, dtype, device, seed=0, drop=0.15):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=gen).to(dtype)
    w13 = (torch.randn((E, 2 * I, H), generator=gen) / H ** 0.5).to(dtype)
    w2 = (torch.randn((E, H, I), generator=gen) / I ** 0.5).to(dtype)
    weights, ids = moe.route(torch.randn((T, E), generator=gen), k)
    ids[torch.rand((T, k), generator=gen) < drop] = -1  # expert-parallel "not on this rank"
    return [t.to(device) for t in (x, w13, w2, weights, ids)]


def check_against_reference(out, args, activation="silu"):
    x, w13, w2, weights, ids = args
    cpu = [t.cpu() for t in args]
    ref = reference.fused_moe(*cpu, activation=activation)
    base = reference.fused_moe(*cpu, activation=activation, compute_dtype=x.dtype)
    scale = ref.abs().max().clamp_min(1e-30)
    err = ((out.cpu().double() - ref).abs().max() / scale).item()
    err_torch = ((base.double() - ref).abs().max() / scale).item()
    assert out.shape == x.shape and out.dtype == x.dtype
    assert err <= 2 * err_torch + ATOL[x.dtype], f"kernel error {err:.3g} vs plain torch {err_torch:.3g}"
    return ref


@dataclass
class Case:
    T: int
    E: int
    H: int
    I: int  # noqa: E741
    k: int
    dtype: torch.dtype
    activation: str
    why: str


CASES = [
    Case(20, 8, 64, 32, 2, torch.float32, "silu", "fp32: ieee dots; several experts, T > block_m"),
    Case(20, 8, 64, 32, 2, torch.float16, "gelu_tanh", "fp16 gelu_tanh"),
    Case(1, 8, 64, 32, 8, torch.float16, "silu", "T=1 decode, k=8"),
    Case(7, 4, 64, 32, 4, torch.float16, "silu", "top-k = E, T < block_m"),
    Case(9, 5, 40, 24, 3, torch.float32, "gelu_tanh", "H=40, I=24, prime E: tails in N and K (TMA-aligned in fp32)"),
    Case(40, 2, 64, 16, 1, torch.float16, "silu", "k=1, two blocks per expert, I < block_n"),
]


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.why)
def test_fused_moe_matches_reference(case, mode, device):
    args = make_inputs(case.T, case.E, case.H, case.I, case.k, case.dtype, device)
    out = moe.fused_moe(*args, activation=case.activation, tma=mode)
    check_against_reference(out, args, case.activation)
    want = mode == "always"
    assert dict(tma.last_decision("moe.gemm1").use) == {"w13": want, "inter": want}
    assert dict(tma.last_decision("moe.gemm2").use) == {"inter": want, "w2": want}


@pytest.mark.parametrize("mode", ["never", "always"])
def test_atomic_and_deterministic_reductions(mode, device):
    args = make_inputs(12, 6, 64, 32, 3, torch.float16, device, seed=4)
    out = moe.fused_moe(*args, tma=mode)  # default: deterministic fixed-order sum
    check_against_reference(out, args)
    assert torch.equal(out, moe.fused_moe(*args, tma=mode, deterministic=True))
    atomic = moe.fused_moe(*args, tma=mode, deterministic=False)
    check_against_reference(atomic, args)


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_direct_plan_matches_sorted_plan(mode, deterministic, device):
    """Tiny batches skip the alignment (one slot per row block); same result as the sorted plan, including a
    dropped slot and one expert chosen twice by a token."""
    assert moe.prefer_direct(1, 8, 16) and moe.prefer_direct(2, 2, 16) and not moe.prefer_direct(3, 4, 16)
    x, w13, w2, weights, ids = make_inputs(3, 16, 64, 32, 4, torch.float16, device, seed=10, drop=0.0)
    ids[0, 1] = -1
    ids[1, 2] = ids[1, 0]
    cfg = moe_configs.INTERPRETER_CONFIG
    outs = []
    for plan in (moe.direct_plan(ids, 16, 16), moe.moe_align(ids, 16, 16)):
        inter = moe.gate_up(x, w13, plan, config=cfg.gemm1, tma=mode)
        outs.append(moe.down(inter, w2, weights, ids, plan, config=cfg.gemm2, tma=mode, deterministic=deterministic))
    check_against_reference(outs[0], (x, w13, w2, weights, ids))
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-3, atol=1e-4)


def test_odd_shapes_pointer_path_and_always_raises(device):
    """H=44, I=20 in fp16: rows of 88 and 40 bytes are not 16-byte multiples, so TMA cannot read them."""
    args = make_inputs(5, 4, 44, 20, 2, torch.float16, device, seed=5)
    out = moe.fused_moe(*args, tma="auto")
    check_against_reference(out, args)
    assert not tma.last_decision("moe.gemm1").use["w13"]
    with pytest.raises(UnsupportedError, match=r"moe.gemm1: tma='always' was asked for(.|\n)*w13: stride\(1\)=88"):
        moe.fused_moe(*args, tma="always")


def test_dropped_slots_and_tokens(device):
    x, w13, w2, weights, ids = make_inputs(6, 4, 64, 32, 2, torch.float32, device, seed=6, drop=0.0)
    ids[2, :] = -1  # token 2 routed nowhere on this rank
    ids[4, 1] = -1
    for det in (True, False):
        out = moe.fused_moe(x, w13, w2, weights, ids, tma="never", deterministic=det)
        check_against_reference(out, (x, w13, w2, weights, ids))
        assert torch.count_nonzero(out[2]) == 0


@pytest.mark.parametrize("T, deterministic, grad", [(1, True, False), (6, True, False), (6, False, False),
                                                    (6, True, True), (6, False, True)])
def test_unchecked_invalid_ids_poison_their_tokens(device, T, deterministic, grad):
    """check_ids=False: an id outside [-1, E) (9 of 4 experts, -3) makes its token's output row NaN on every path
    (direct plan with the fused top-k sum, sorted deterministic, sorted atomic; inference and training), and
    its d_hidden and d_topk_weights rows NaN too; every other token stays right (never a finite, plausible row
    that lacks an expert's contribution)."""
    x, w13, w2, weights, ids = make_inputs(T, 4, 64, 32, 2, torch.float32, device, seed=7, drop=0.0)
    bad_tokens = [0] if T == 1 else [1, 4]
    bad = ids.clone()
    bad[bad_tokens[0], 0] = 9
    if T > 1:
        bad[bad_tokens[1], 1] = -3
    args = [t.clone().requires_grad_(grad and t.is_floating_point()) for t in (x, w13, w2, weights)]
    out = moe.fused_moe(*args, bad, tma="never", check_ids=False, deterministic=deterministic)
    ok = torch.ones(T, dtype=torch.bool)
    ok[bad_tokens] = False
    assert torch.isnan(out[bad_tokens]).all()
    if T > 1:
        ref = reference.fused_moe(*[t.detach().cpu() for t in (x, w13, w2, weights)], ids.cpu())
        err = (out.detach().cpu().double()[ok] - ref[ok]).abs().max() / ref.abs().max()
        assert err < 1e-5, f"good tokens: relative error {err:.3g}"
    if grad:
        out.backward(torch.ones_like(out))
        assert torch.isnan(args[0].grad[bad_tokens]).all() and torch.isfinite(args[0].grad[ok]).all()
        assert torch.isnan(args[3].grad[bad_tokens[0], 0])


def test_noncontiguous_inputs_by_strides(device):
    """Strided hidden, a transposed w13 view (not TMA-eligible: 'auto' falls back), strided weights/ids."""
    x, w13, w2, weights, ids = make_inputs(10, 4, 64, 32, 2, torch.float32, device, seed=8)
    x_s = torch.zeros((10, 128), device=device)[:, ::2]
    x_s.copy_(x)
    w13_t = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(-1) != 1
    weights_t = weights.T.contiguous().T
    ids_t = ids.T.contiguous().T
    out = moe.fused_moe(x_s, w13_t, w2, weights_t, ids_t, tma="auto")
    check_against_reference(out, (x, w13, w2, weights, ids))
    d = tma.last_decision("moe.gemm1")
    assert not d.use["w13"] and d.use["inter"]
    assert any("last stride" in r for r in d.reasons["w13"])


def _strided_ids(ids):
    """The same ids as a [T, k] view whose flat form has stride 2 (a column slice of a wider tensor)."""
    wide = torch.stack([ids, torch.full_like(ids, 7)], -1)
    return wide[..., 0]


@pytest.mark.parametrize("mode,deterministic", [("never", True), ("always", False)])
@pytest.mark.parametrize("T", [1, 12], ids=["direct plan", "sorted plan"])
def test_strided_topk_ids_views(T, mode, deterministic, device):
    """topk_ids views that flatten to a non-unit stride (``ids[:, :1]``, or a slice of a wider tensor) give the
    results of contiguous ids, forward and backward, with or without the fused top-k sum: the kernels index the
    flat ids by slot, so the flat form must have unit stride."""
    x, w13, w2, weights, ids = make_inputs(T, 4, 32, 16, 2, torch.float32, device, seed=11, drop=0.0)
    for view in (_strided_ids(ids), ids[:, :1]):
        tw = weights[:, :view.shape[1]]
        assert view.reshape(-1).stride(0) != 1 or view.numel() <= 1 or view.shape[1] == 1
        want = moe.fused_moe(x, w13, w2, tw, view.contiguous(), tma=mode, deterministic=deterministic)
        check_against_reference(want, (x, w13, w2, tw, view.contiguous()))
        got = moe.fused_moe(x, w13, w2, tw, view, tma=mode, deterministic=deterministic)
        assert torch.allclose(got, want, rtol=0, atol=1e-6), (got - want).abs().max()
        cfg = moe_configs.INTERPRETER_CONFIG.model_copy(update={"fused_topk": True})
        got = moe.fused_moe(x, w13, w2, tw, view, tma=mode, config=cfg)
        check_against_reference(got, (x, w13, w2, tw, view.contiguous()))
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2, tw)]
        moe.fused_moe(*leaves, view, tma=mode, deterministic=deterministic).square().sum().backward()
        ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2, tw)]
        moe.fused_moe(*ref_leaves, view.contiguous(), tma=mode, deterministic=deterministic).square().sum().backward()
        for a, b in zip(leaves, ref_leaves):
            assert torch.allclose(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    plan = moe.moe_align(_strided_ids(ids), 4, 16)
    assert torch.equal(plan.expert_counts, moe.moe_align(ids, 4, 16).expert_counts)


def test_topk_sum_reads_strided_ids(device):
    """An out-of-range id in a strided view still poisons its token (NaN), and the others sum the right rows."""
    ids = torch.tensor([[0, 1], [2, 9]], device=device)
    rows = torch.randn(4, 8, device=device)
    out = moe.topk_sum(rows, _strided_ids(ids), 4)
    assert torch.isnan(out[1]).all()
    assert torch.allclose(out[0], rows[0] + rows[1])


@pytest.mark.parametrize("field", ["block_m", "block_n", "block_k"])
def test_kernel_config_blocks_at_least_16(field):
    """A config whose tiles tl.dot (K >= 16 on the GPU) or the MoE alignment cannot take is refused when it is made,
    before any launch."""
    with pytest.raises(ValueError, match=f"{field} must be >= 16, got 8"):
        KernelConfig(**{**dict(block_m=16, block_n=32, block_k=32), field: 8})


@pytest.mark.parametrize("T", [1, 12], ids=["direct plan", "sorted plan"])
def test_auto_reads_direct_plans_with_pointer_loads(T, device):
    """tma='auto' gives a direct plan (tiny batch) pointer loads, with the reason; a sorted plan keeps TMA;
    'always' still takes TMA for a direct plan."""
    args = make_inputs(T, 8, 64, 32, 2, torch.float16, device, seed=13)
    assert moe.prefer_direct(T, 2, 8) == (T == 1)
    for mode in ("auto", "always"):
        out = moe.fused_moe(*args, tma=mode)
        check_against_reference(out, args)
        pointer = mode == "auto" and T == 1
        for op, name in (("moe.gemm1", "w13"), ("moe.gemm2", "w2")):
            d = tma.last_decision(op)
            assert d.use[name] is not pointer
            assert any("direct plan" in r for r in d.reasons[name]) is pointer


def test_explicit_config_and_fp16_weights_dtype(device):
    args = make_inputs(30, 4, 64, 64, 2, torch.float16, device, seed=9)
    cfg = MoeConfig(gemm1=KernelConfig(block_m=32, block_n=16, block_k=64, group_m=2, num_warps=4, num_stages=1),
                    gemm2=KernelConfig(block_m=32, block_n=64, block_k=16, group_m=1, num_warps=4, num_stages=1))
    out = moe.fused_moe(*args, tma="always", config=cfg, deterministic=False)
    check_against_reference(out, args)


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("flatten", [False, True], ids=["loop", "flatten"])
def test_persistent_programs_take_several_tiles(mode, flatten, device):
    """The interpreter's persistent grid is 2 programs, so each takes 10+ (row block, N tile) tiles: grouped
    order with group_m not dividing the live block count, live blocks below max_blocks, a sorted plan and a
    direct plan with a dropped slot (zero K steps), flattened and plain tile loops."""
    g = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=3, num_warps=4, num_stages=1, flatten=flatten)
    assert moe_configs.num_programs(g, 2, 2) == moe_configs.num_programs(g, 2, 1) == 2
    args = make_inputs(24, 6, 64, 48, 2, torch.float16, device, seed=11)
    out = moe.fused_moe(*args, tma=mode, config=MoeConfig(gemm1=g, gemm2=g))
    check_against_reference(out, args)
    x, w13, w2, weights, ids = make_inputs(2, 16, 64, 48, 2, torch.float16, device, seed=12, drop=0.0)
    ids[1, 0] = -1
    plan = moe.direct_plan(ids, 16, 16)
    inter = moe.gate_up(x, w13, plan, config=g, tma=mode)
    out = moe.down(inter, w2, weights, ids, plan, config=g, tma=mode)
    check_against_reference(out, (x, w13, w2, weights, ids))
    assert tma.last_decision("moe.gemm2").use["w2"] == (mode == "always")


@pytest.mark.parametrize("mode", ["never", "always"])
def test_wide_down_tile_stores_in_column_quarters(mode, device):
    """A 128 x 256 down tile writes its per-slot rows in four column quarters: H = 320 leaves the second N tile
    one live quarter and three fully masked ones, dropped slots leave rows of a block dead, and several blocks per
    expert take the sorted plan. Bitwise equal to a 64-column tile (the same products summed in the same order)
    and within the fp64 reference's tolerance."""
    g1 = KernelConfig(block_m=128, block_n=32, block_k=64, group_m=2, num_warps=4, num_stages=1)
    wide = KernelConfig(block_m=128, block_n=256, block_k=64, group_m=2, num_warps=8, num_stages=3, flatten=True)
    narrow = wide.model_copy(update={"block_n": 64, "num_warps": 4})
    args = make_inputs(150, 4, 320, 64, 2, torch.float16, device, seed=21)
    out = moe.fused_moe(*args, tma=mode, config=MoeConfig(gemm1=g1, gemm2=wide))
    check_against_reference(out, args)
    assert torch.equal(out, moe.fused_moe(*args, tma=mode, config=MoeConfig(gemm1=g1, gemm2=narrow)))


def test_programs_per_sm_estimate():
    """Prefill tiles (two 128x128 accumulators, 3 x 48 KiB stages) fit once per SM; small decode tiles several
    times; the estimate never depends on the token count."""
    big = moe.heuristic_config(128, 2048, 768, T=16384, top_k=8)
    small = moe.heuristic_config(128, 2048, 768, T=1, top_k=8)
    assert moe_configs.programs_per_sm(big.gemm1, 2, 2) == 1
    assert moe_configs.programs_per_sm(small.gemm2, 2, 1) >= 2


def test_atomic_config_fits_the_fp32_epilogue():
    """deterministic=False stages an fp32 epilogue tile: a tuned 128x128x128 down tile with 3 stages (192 KiB of
    pipeline + 64 KiB of fp32 staging, over the 227 KiB a program may use; ptxas measures 256 KiB) drops to 2
    stages; a config that already fits is kept; the fp32 staging halves programs per SM where it matters."""
    tuned = KernelConfig(block_m=128, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=3, flatten=True)
    assert moe_configs.smem_bytes(tuned, 2, 1) <= 227 * 1024 < moe_configs.smem_bytes(tuned, 2, 1, 4)
    fitted = moe_configs.atomic_config(tuned, 2)
    assert fitted == tuned.model_copy(update={"num_stages": 2})
    assert moe_configs.smem_bytes(fitted, 2, 1, 4) <= 227 * 1024
    small = KernelConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    assert moe_configs.atomic_config(small, 2) == small
    mid = KernelConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4, flatten=True)
    assert moe_configs.programs_per_sm(mid, 2, 1) == 2 and moe_configs.programs_per_sm(mid, 2, 1, 4) == 1
    assert moe_configs.atomic_config(mid, 2).num_warps == 4  # 64 accumulator registers per thread: kept
    # Two programs per SM on the fixed-order path; the atomic epilogue of a 4-warp 128 x 128 tile would spill.
    pair = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=2, flatten=True)
    assert moe_configs.programs_per_sm(pair, 2, 1) == 2
    assert moe_configs.atomic_config(pair, 2) == pair.model_copy(update={"num_warps": 8})
    # A flattened 128 x 256 tile (128 accumulator registers per thread with 8 warps) runs the atomic epilogue
    # unflattened (its prefetch of the next tile beside that epilogue would spill), with the stages that fit.
    wide = KernelConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, flatten=True)
    fitted = moe_configs.atomic_config(wide, 2)
    assert fitted == wide.model_copy(update={"flatten": False, "num_stages": 2})
    assert moe_configs.smem_bytes(fitted, 2, 1, 4) <= 227 * 1024


def test_non_boolean_deterministic_after_a_cached_call(device):
    """A call with deterministic=True caches its plan; a later call whose deterministic only compares equal to True
    (1.0) is not served from that cache but checked like a first call (TypeError)."""
    args = make_inputs(3, 4, 64, 32, 2, torch.float16, device, drop=0.0)
    want = moe.fused_moe(*args, deterministic=True)
    torch.testing.assert_close(moe.fused_moe(*args, deterministic=True), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match=r"deterministic must be True or False, got 1.0"):
        moe.fused_moe(*args, deterministic=1.0)


def test_zero_tokens(device):
    x, w13, w2, weights, ids = make_inputs(1, 4, 64, 32, 2, torch.float16, device)
    out = moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0])
    assert out.shape == (0, 64) and out.dtype == torch.float16


def _err_args(device):
    return dict(zip(("hidden", "w13", "w2", "topk_weights", "topk_ids"),
                    make_inputs(3, 4, 64, 32, 2, torch.float16, device, drop=0.0)))


@pytest.mark.parametrize("change, exc, match", [
    (lambda a: a["topk_ids"].__setitem__((1, 1), 7), ValueError,
     r"topk_ids must be in \[-1, 4\) \(-1 drops a slot\), got expert ids 7"),
    (lambda a: a["topk_ids"].__setitem__((0, 0), -2), ValueError, r"got expert ids -2"),
    (lambda a: a.update(w13=a["w13"][:, :62]), ValueError, r"w13 must be \[E, 2\*I, H\] = \(4, 64, 64\)"),
    (lambda a: a.update(w2=a["w2"][:, :60]), ValueError, r"w2 must be \[E, H, I\] with H = 64"),
    (lambda a: a.update(topk_weights=a["topk_weights"][:, :1]), ValueError,
     r"topk_weights must have the shape of topk_ids \(3, 2\), got shape \(3, 1\)"),
    (lambda a: a.update(topk_ids=a["topk_ids"][:2]), ValueError, "topk_ids must have 3 rows"),
    (lambda a: a.update(w2=a["w2"].float()), TypeError, r"w2 must be float16 \(the dtype of hidden\), got float32"),
    (lambda a: a.update(topk_ids=a["topk_ids"].float()), TypeError, "topk_ids must be int32 or int64, got float32"),
    (lambda a: a.update(hidden=a["hidden"][None]), ValueError, "hidden must be 2-D"),
    (lambda a: a.update(activation="relu"), ValueError, r"activation must be one of \('silu', 'gelu_tanh'\), got 'relu'"),
    (lambda a: a.update(tma="sometimes"), ValueError, r"tma must be one of \('auto', 'always', 'never'\)"),
    (lambda a: a.update(hidden=a["hidden"].to_sparse()), TypeError,
     r"hidden must be a dense \(strided\) tensor, got layout sparse_coo"),
    (lambda a: a.update(topk_ids=a["topk_ids"].to_sparse()), TypeError, r"topk_ids must be a dense \(strided\) tensor"),
    (lambda a: a.update(deterministic="no"), TypeError, r"deterministic must be True or False, got 'no'"),
    (lambda a: a.update(recompute=None), TypeError, r"recompute must be True or False, got None"),
    (lambda a: a.update(w13=a["w13"][:0], w2=a["w2"][:0]), ValueError,
     r"w2 must have at least 1 expert \(E >= 1\), got shape \(0, 64, 32\)"),
    (lambda a: a.update(w13=a["w13"][:0], w2=a["w2"][:0], hidden=a["hidden"][:1], topk_weights=a["topk_weights"][:1],
                        topk_ids=a["topk_ids"][:1]), ValueError, r"w2 must have at least 1 expert \(E >= 1\)"),
])
def test_fused_moe_errors(change, exc, match, device):
    a = _err_args(device)
    change(a)
    with pytest.raises(exc, match=match):
        moe.fused_moe(**a)


def test_heuristic_configs_scale_with_tokens():
    small = moe.heuristic_config(128, 2048, 768, T=1, top_k=8)
    big = moe.heuristic_config(128, 2048, 768, T=16384, top_k=8)
    assert small.gemm1.block_m == 16 and big.gemm1.block_m == 128 and big.gemm1.num_warps == 8
    # decode: narrow N tiles so >= 2 programs per SM stream weights (8 experts x 768/16 = 384 >= 264)
    assert small.gemm1.block_n == 16 and 8 * (768 // small.gemm1.block_n) >= 2 * 132


def test_interpreter_uses_fixed_config():
    cfg, origin = moe.moe_launch_config(8, 64, 32, torch.float16, 20, 2)
    assert origin == "interpreter" and cfg == moe_configs.INTERPRETER_CONFIG


def test_missing_shape_in_tuning_file_warns_once(tmp_path, monkeypatch):
    path = tmp_path / "gpu.json"
    entry = {"1": moe.heuristic_config(8, 64, 32, 1, 2)}
    TuningConfig(device_name="test", moe={moe_key(8, 64, 32, torch.float16): entry}).save(path)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(path))
    monkeypatch.setattr(moe_configs, "interpreter_active", lambda: False)
    cfg, origin = moe.moe_launch_config(8, 64, 32, torch.float16, 3, 2)
    assert origin == str(path) and cfg == entry["1"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            cfg, origin = moe.moe_launch_config(8, 96, 32, torch.float16, 3, 2)
    assert origin == "heuristics"
    msgs = [str(w.message) for w in caught if "no MoE entry" in str(w.message)]
    assert len(msgs) == 1 and "E8_H96_I32_float16" in msgs[0]


def test_launcher_shape_checks(device):
    """The public launchers refuse tensors that disagree with the plan (the kernels index by the plan)."""
    x, w13, w2, weights, ids = make_inputs(4, 4, 64, 32, 2, torch.float16, device, drop=0.0)
    cfg = moe_configs.INTERPRETER_CONFIG
    plan = moe.moe_align(ids, 4, 16)
    with pytest.raises(ValueError, match=r"gate_up: hidden must have shape \(4, 64\), got \(3, 64\)"):
        moe.gate_up(x[:3], w13, plan, config=cfg.gemm1)
    with pytest.raises(ValueError, match="config.block_m must be 16"):
        moe.gate_up(x, w13, plan, config=KernelConfig(block_m=32, block_n=32, block_k=32))
    inter = moe.gate_up(x, w13, plan, config=cfg.gemm1)
    with pytest.raises(ValueError, match=r"down: inter must have shape"):
        moe.down(inter[:-16], w2, weights, ids, plan, config=cfg.gemm2)
    with pytest.raises(ValueError, match="down: w2 must have 4 experts"):
        moe.down(inter, w2[:3], weights, ids, plan, config=cfg.gemm2)


@pytest.mark.parametrize("via_env", [False, True], ids=["arg", "HOPPERKERN_TMA"])
def test_zero_size_problems_with_tma_always(via_env, device, monkeypatch):
    """Empty problems return before the TMA decision: tma="always" (or HOPPERKERN_TMA=always) must not refuse
    an operand for being zero-sized when nothing launches."""
    if via_env:
        monkeypatch.setenv("HOPPERKERN_TMA", "always")
    mode = "auto" if via_env else "always"
    x, w13, w2, weights, ids = make_inputs(5, 4, 64, 32, 2, torch.float16, device, drop=0.0)
    w13_0, w2_0 = w13[:, :0].contiguous(), w2[:, :, :0].contiguous()  # I == 0
    for det in (True, False):
        out = moe.fused_moe(x, w13_0, w2_0, weights, ids, tma=mode, deterministic=det)
        assert out.shape == (5, 64) and out.dtype == torch.float16 and torch.count_nonzero(out) == 0
    cfg = moe_configs.INTERPRETER_CONFIG
    for plan in (moe.moe_align(ids, 4, 16), moe.direct_plan(ids, 4, 16)):
        inter = moe.gate_up(x, w13_0, plan, config=cfg.gemm1, tma=mode)
        assert inter.shape == (plan.max_rows, 0)
        for det in (True, False):
            out = moe.down(inter, w2_0, weights, ids, plan, config=cfg.gemm2, tma=mode, deterministic=det)
            assert out.shape == (5, 64) and torch.count_nonzero(out) == 0
    empty = moe.moe_align(ids[:0], 4, 16)  # T == 0: no row blocks
    inter = moe.gate_up(x[:0], w13, empty, config=cfg.gemm1, tma=mode)
    out = moe.down(inter, w2, weights[:0], ids[:0], empty, config=cfg.gemm2, tma=mode)
    assert inter.shape == (0, 32) and out.shape == (0, 64)


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("T", [6, 1], ids=["sorted-plan", "direct-plan"])
def test_unchecked_int64_ids_beyond_int32_poison(T, deterministic, mode, device):
    """check_ids=False with int64 ids: 2**32 + 1 must poison its token like any out-of-range id, not be narrowed
    to expert 1 first (sorted plan: alignment kernels; direct plan: the GEMMs read the ids themselves)."""
    x, w13, w2, weights, ids = make_inputs(T, 4, 64, 32, 2, torch.float32, device, seed=13, drop=0.0)
    ids = ids.long()
    ids[0, 0] = 1 if ids[0, 1] != 1 else 2  # the narrowed id would name a real expert of this token
    bad, dropped = ids.clone(), ids.clone()
    bad[0, 0] = 2**32 + 1 if ids[0, 0] == 1 else 2**32 + 2
    dropped[0, 0] = -1
    out = moe.fused_moe(x, w13, w2, weights, bad, tma=mode, check_ids=False, deterministic=deterministic)
    assert torch.isnan(out[0]).all()
    if T > 1:
        check_against_reference(out[1:], (x[1:], w13, w2, weights[1:], dropped[1:]))
    with pytest.raises(ValueError, match=r"got expert ids 429496729[78]"):
        moe.fused_moe(x, w13, w2, weights, bad, tma=mode)


def test_launch_configs_use_the_inputs_device(device, monkeypatch):
    """SM counts come from the tensors' device, not the current one: num_programs / moe_launch_config take a
    device, and fused_moe, gate_up and down pass their inputs' device."""
    seen = []

    class FakeCap:
        def __init__(self, dev):
            self.sm_count = 100 if str(dev) == "cuda:1" else 7
            self.device_name = None

    def fake_capability(dev=None):
        seen.append(dev)
        return FakeCap(dev)

    monkeypatch.setattr(moe_configs, "capability", fake_capability)
    monkeypatch.setattr(moe_configs, "interpreter_active", lambda: False)
    g = moe_configs.INTERPRETER_CONFIG.gemm1
    per_sm = moe_configs.programs_per_sm(g, 2, 1)
    assert moe_configs.num_programs(g, 2, 1, "cuda:1") == 100 * per_sm
    assert moe_configs.num_programs(g, 2, 1) == 7 * per_sm and seen[-1] is None
    monkeypatch.setenv("HOPPERKERN_CONFIG", "")
    cfg, origin = moe.moe_launch_config(128, 2048, 768, torch.float16, 1, 8, device="cuda:1")
    assert origin == "heuristics" and seen[-1] == "cuda:1"
    assert cfg == moe.heuristic_config(128, 2048, 768, 1, 8, sm_count=100)
    monkeypatch.undo()

    import hopperkern.moe.gemm as gemm_mod
    import hopperkern.moe.ops as ops_mod

    devices = []
    real_launch, real_programs = ops_mod.moe_launch_config, gemm_mod.num_programs
    monkeypatch.setattr(ops_mod, "moe_launch_config",
                        lambda *a, **kw: devices.append(("config", a[6] if len(a) > 6 else kw["device"]))
                        or real_launch(*a[:6]))
    monkeypatch.setattr(gemm_mod, "num_programs",
                        lambda cfg, es, b, dev=None, **kw: devices.append(("programs", dev))
                        or real_programs(cfg, es, b, **kw))
    args = make_inputs(6, 4, 64, 32, 2, torch.float16, device, seed=14)
    check_against_reference(moe.fused_moe(*args), args)
    dev = args[0].device
    assert devices == [("config", dev), ("programs", dev), ("programs", dev)]


def test_cpu_tensors_without_interpreter_raise_unsupported(monkeypatch):
    """fused_moe on CPU tensors with the interpreter off: UnsupportedError naming the device, not a Triton error."""
    import importlib

    from hopperkern import moe, tma

    capmod = importlib.import_module("hopperkern.tma.capability")  # the module, not the re-exported function
    monkeypatch.setattr(capmod, "interpreter_active", lambda: False)
    x, w13, w2 = torch.randn(3, 32), torch.randn(4, 32, 32), torch.randn(4, 32, 16)
    ids = torch.tensor([[0, 1], [2, 3], [1, 2]], dtype=torch.int32)
    with torch.no_grad(), pytest.raises(tma.UnsupportedError, match="moe.fused_moe cannot run on cpu tensors"):
        moe.fused_moe(x, w13, w2, torch.rand(3, 2), ids)


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("k", [3, 5], ids=["k3", "k5"])
def test_direct_plan_down_fuses_topk_sum(k, mode, device):
    """fused_topk: a direct plan's down GEMM sums the token's k experts in one kernel: k not a power of two (masked
    register lanes), I = 48 over two K steps of 32 (the per-expert switch happens mid-loop, with a K tail),
    a dropped id in the middle, int64 ids, fp32. Equal to the sorted plan's result (a topk_sum launch)."""
    x, w13, w2, weights, ids = make_inputs(1, 16, 64, 48, k, torch.float32, device, seed=13, drop=0.0)
    ids = ids.long()
    ids[0, 1] = -1
    g = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=1, num_warps=4, num_stages=1)
    outs = []
    for plan in (moe.direct_plan(ids, 16, 16), moe.moe_align(ids, 16, 16)):
        assert plan.direct == (len(outs) == 0)
        inter = moe.gate_up(x, w13, plan, config=g, tma=mode)
        outs.append(moe.down(inter, w2, weights, ids, plan, config=g, tma=mode, out_dtype=torch.float32,
                             fused_topk=True))
    check_against_reference(outs[0], (x, w13, w2, weights, ids))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    cfg = MoeConfig(gemm1=g, gemm2=g, fused_topk=True)  # through fused_moe and the config model
    out = moe.fused_moe(x, w13, w2, weights, ids, tma=mode, config=cfg)
    torch.testing.assert_close(out.float(), outs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode, deterministic", [("always", True), ("always", False)])
def test_sorted_rows_gate_up(mode, deterministic, device):
    """``MoeConfig.sorted_rows``: one launch copies the token rows into the plan's sorted order and the gate/up
    GEMM reads the copy with 2-D TMA. Same results as the gathering GEMM (the same products, summed in the same
    order), on calls through a fresh and a cached plan (the copy then shares the per-slot rows' scratch), with
    grads. (With tma='never' the GEMM gathers the rows itself: test_sorted_rows_needs_a_16_byte_row_pitch.)"""
    g = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    plain, sorted_ = MoeConfig(gemm1=g, gemm2=g), MoeConfig(gemm1=g, gemm2=g, sorted_rows=True)
    args = make_inputs(24, 6, 64, 48, 3, torch.float16, device, seed=13)
    want = moe.fused_moe(*args, tma=mode, config=plain, deterministic=deterministic)
    check_against_reference(want, args)
    for _ in range(2):  # the first call builds the plan, the second runs it from the cache
        got = moe.fused_moe(*args, tma=mode, config=sorted_, deterministic=deterministic)
        use = dict(tma.last_decision("moe.gemm1").use)
        assert use == ({"w13": True, "inter": True, "xs": True} if mode == "always" else
                       {"w13": False, "inter": False})
        if deterministic:
            assert torch.equal(got, want)
        else:  # atomic top-k sums: the order of the adds may differ
            check_against_reference(got, args)
    x, w13, w2, weights, ids = args
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    out = moe.fused_moe(*leaves, ids, tma=mode, config=sorted_, deterministic=deterministic)
    assert dict(tma.last_decision("moe.gemm1").use).get("xs", False) == (mode == "always")
    out.float().square().sum().backward()
    ref = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    moe.fused_moe(*ref, ids, tma=mode, config=plain, deterministic=deterministic).float().square().sum().backward()
    if deterministic:
        assert torch.equal(out, want)
    for a, b in zip(leaves, ref):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-3, atol=2e-3)


def test_sorted_rows_needs_a_16_byte_row_pitch(device):
    """H = 44 in fp16 (88-byte rows): no TMA copy is possible, so the GEMM gathers the rows even where the config
    asks for sorted rows, and tma='always' names the operands that cannot take TMA, not the copy. With
    tma='never' (a 16-byte pitch, H = 64) the copy is refused too: the rows are gathered, bitwise as without
    sorted rows, on a fresh and a cached plan."""
    g = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    args = make_inputs(9, 4, 44, 20, 2, torch.float16, device, seed=14)
    out = moe.fused_moe(*args, tma="auto", config=MoeConfig(gemm1=g, gemm2=g, sorted_rows=True))
    check_against_reference(out, args)
    assert "xs" not in tma.last_decision("moe.gemm1").use
    args = make_inputs(9, 4, 64, 20, 2, torch.float16, device, seed=15)
    want = moe.fused_moe(*args, tma="never", config=MoeConfig(gemm1=g, gemm2=g))
    for _ in range(2):
        got = moe.fused_moe(*args, tma="never", config=MoeConfig(gemm1=g, gemm2=g, sorted_rows=True))
        assert dict(tma.last_decision("moe.gemm1").use) == {"w13": False, "inter": False}
        assert torch.equal(got, want)


def _fused_mlp_config(block_i=16, block_k=32, block_h=32):
    g1 = KernelConfig(block_m=16, block_n=block_i, block_k=block_k, group_m=1, num_warps=4, num_stages=2)
    g2 = KernelConfig(block_m=16, block_n=block_h, block_k=block_i, group_m=1, num_warps=4, num_stages=2)
    return MoeConfig(gemm1=g1, gemm2=g2, fused_mlp=True)


@pytest.mark.parametrize("mode", ["never", "always"])
def test_fused_mlp_direct_plan(mode, device):
    """``MoeConfig.fused_mlp``: a direct plan runs both GEMMs in one kernel per (slot, slice of I) and sums the
    partial rows per token in a fixed order. Three tokens with k = 3 over 40 experts (direct), I = 40 over three
    slices of 16 (a tail), H = 72 over chunks of 32 (a tail), a dropped slot, int64 ids, gelu_tanh; fp16 (and
    fp32 on the pointer path). Right against the reference and bitwise the same on a fresh and a cached plan; the
    decisions name the weights only. A token whose id is outside [-1, E) gets a NaN row, the others stay right."""
    cfg = _fused_mlp_config()
    for dtype in (torch.float16, torch.float32) if mode == "never" else (torch.float16,):
        args = make_inputs(3, 40, 72, 40, 3, dtype, device, seed=21, drop=0.0)
        args[4] = args[4].long()
        args[4][1, 2] = -1
        assert moe.prefer_direct(3, 3, 40)
        outs = [moe.fused_moe(*args, tma=mode, config=cfg, activation="gelu_tanh") for _ in range(2)]
        check_against_reference(outs[0], args, activation="gelu_tanh")
        assert torch.equal(outs[0], outs[1])
        assert dict(tma.last_decision("moe.gemm1").use) == {"w13": mode == "always"}
        assert dict(tma.last_decision("moe.gemm2").use) == {"w2": mode == "always"}
    bad = [t.clone() for t in args]
    bad[4][2, 0] = 40
    out = moe.fused_moe(*bad, tma=mode, config=cfg, activation="gelu_tanh", check_ids=False)
    assert bool(out[2].isnan().all()) and bool(torch.isfinite(out[:2]).all())
    torch.testing.assert_close(out[:2], outs[0][:2], rtol=0, atol=0)


def test_fused_mlp_config_rules_and_sorted_plans(device):
    """The config model rejects a fused_mlp whose two GEMMs disagree on the slice of I or on num_warps, or that
    also asks for fused_topk; a sorted plan (more slots than a direct plan takes) ignores fused_mlp and runs the
    two GEMMs; the flat config list a custom op takes keeps the field."""
    cfg = _fused_mlp_config()
    with pytest.raises(ValueError, match="block_k"):
        MoeConfig(gemm1=cfg.gemm1, gemm2=cfg.gemm2.model_copy(update={"block_k": 32}), fused_mlp=True)
    with pytest.raises(ValueError, match="num_warps"):
        MoeConfig(gemm1=cfg.gemm1, gemm2=cfg.gemm2.model_copy(update={"num_warps": 8}), fused_mlp=True)
    with pytest.raises(ValueError, match="exclude"):
        MoeConfig(gemm1=cfg.gemm1, gemm2=cfg.gemm2, fused_mlp=True, fused_topk=True)
    from hopperkern.moe.ops import config_from_list, config_to_list

    assert config_from_list(config_to_list(cfg)) == cfg
    args = make_inputs(12, 6, 64, 32, 2, torch.float16, device, seed=22)
    assert not moe.prefer_direct(12, 2, 6)
    out = moe.fused_moe(*args, config=cfg)
    check_against_reference(out, args)
    assert "inter" in tma.last_decision("moe.gemm1").use
