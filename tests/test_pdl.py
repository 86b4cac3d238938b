"""Programmatic dependent launch (PDL): how a plan's launches are chained (hopperkern.tma.launcher.chain_launches),
when chaining is on (capability, HOPPERKERN_PDL), and on the GPU that chained MoE calls compute exactly what
unchained ones do, on every path and inside CUDA graphs."""

import pytest
import torch

import hopperkern.moe.ops as moe_ops
from hopperkern import moe, tma
from hopperkern.moe import reference
from hopperkern.moe._gemm_kernels import _topk_sum_kernel
from hopperkern.moe._align_kernels import _align_count_kernel
from hopperkern.tma import launcher
from hopperkern.tma.launcher import Launch, chain_launches, clear_plans, pdl_enabled

from test_launch_plans import moe_inputs

gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    for name in ("HOPPERKERN_TMA", "HOPPERKERN_CONFIG", "HOPPERKERN_PDL"):
        monkeypatch.delenv(name, raising=False)
    clear_plans()
    yield
    clear_plans()


def _flags(launch):
    names = launch.fn.arg_names
    return (launch.template[names.index("PDL_WAIT")], launch.template[names.index("PDL_TRIGGER")],
            launch.options.get("launch_pdl", False))


def _sum_launch(t):
    ids = torch.zeros(4, dtype=torch.int32)
    return Launch(_topk_sum_kernel, (1, 1), t, ids, t, 4, 8, 8, 8, 1, TOP_K=1, BLOCK_H=8), ("a", "b", "c")


def test_chain_sets_wait_and_trigger_by_position():
    """First link: triggers only (it waits for the work before the plan in plain stream order); middle links:
    both; last link: waits only. Only waiting links are launched with launch_pdl."""
    t = torch.zeros(4, 8)
    steps = [_sum_launch(t) for _ in range(3)]
    assert chain_launches(steps, True) is steps
    assert [_flags(launch) for launch, _ in steps] == [(False, True, False), (True, True, True), (True, False, True)]


def test_chain_disabled_and_single_launch_keep_stream_order():
    t = torch.zeros(4, 8)
    steps = [_sum_launch(t) for _ in range(2)]
    chain_launches(steps, False)
    assert [_flags(launch) for launch, _ in steps] == [(False, False, False)] * 2
    one = [_sum_launch(t)]
    chain_launches(one, True)
    assert _flags(one[0][0]) == (False, False, False)


def test_chain_skips_kernels_without_chain_flags():
    """A kernel without PDL_WAIT / PDL_TRIGGER keeps plain stream order (never launch_pdl: it could not wait)."""
    import triton
    import triton.language as tl

    @triton.jit
    def plain(x_ptr, N: tl.constexpr):
        tl.store(x_ptr + tl.arange(0, N), tl.zeros((N,), dtype=tl.float32))

    t = torch.zeros(8)
    steps = [_sum_launch(torch.zeros(4, 8)), (Launch(plain, (1,), t, N=8), ("x",))]
    chain_launches(steps, True)
    assert _flags(steps[0][0])[:2] == (False, True)
    assert "launch_pdl" not in steps[1][0].options


def test_chain_refuses_a_bound_launch():
    launch, _ = _sum_launch(torch.zeros(4, 8))
    launch.compiled = object()  # as after a first call bound it to a compiled kernel
    with pytest.raises(RuntimeError, match="chained before its first call"):
        launch.chain(True, True)


def test_every_moe_plan_kernel_takes_chain_flags():
    """Every kernel a MoE forward plan or moe.down launches can be a link (the alignment's too)."""
    from hopperkern.moe import _align_kernels as A
    from hopperkern.moe import _gemm_kernels as G

    kernels = [G._gate_up_kernel, G._down_kernel, G._down_direct_kernel, G._topk_sum_kernel, A._align_small_kernel,
               A._align_count_kernel, A._align_scan_kernel, A._align_place_kernel]
    for fn in kernels:
        assert {"PDL_WAIT", "PDL_TRIGGER"} <= set(fn.arg_names), fn


def test_pdl_off_under_the_interpreter_and_by_env(monkeypatch):
    assert not tma.capability().pdl or not tma.capability().interpreter
    if tma.capability().interpreter:
        assert not pdl_enabled()

    class Fake:
        pdl = True

    import sys

    # the module, not the function hopperkern.tma re-exports under the same name
    monkeypatch.setattr(sys.modules["hopperkern.tma.capability"], "capability", lambda device=None: Fake())
    assert pdl_enabled()
    for off in ("0", "off", "False", " no "):
        monkeypatch.setenv("HOPPERKERN_PDL", off)
        assert not pdl_enabled(), off
    for on in ("1", "on", "TRUE", "yes", ""):
        monkeypatch.setenv("HOPPERKERN_PDL", on)
        assert pdl_enabled(), on
    monkeypatch.setenv("HOPPERKERN_PDL", "of")
    with pytest.raises(ValueError, match="HOPPERKERN_PDL must be one of"):
        pdl_enabled()


def test_a_bad_hopperkern_pdl_raises_before_any_launch(monkeypatch):
    """fused_moe builds its plan (where the variable is read) before it launches anything. The capability is the
    real one with ``pdl`` on, so the plan's other decisions (tuning file, TMA) run as on this machine."""
    import dataclasses
    import sys

    module = sys.modules["hopperkern.tma.capability"]
    real = module.capability
    monkeypatch.setattr(module, "capability", lambda device=None: dataclasses.replace(real(device), pdl=True))
    monkeypatch.setenv("HOPPERKERN_PDL", "maybe")
    for T in (2, 80):  # chained (decode) and unchained sizes alike
        x, w13, w2, weights, ids = moe_inputs(T, E=8)
        with pytest.raises(ValueError, match="HOPPERKERN_PDL"):
            moe_ops.ForwardPlan(x, w13, w2, weights, ids, "silu", "never", True, None, moe_ops.SAVE_NONE)


def test_hopperkern_pdl_is_part_of_every_plan_key(monkeypatch):
    key = launcher.env_key()
    monkeypatch.setenv("HOPPERKERN_PDL", "0")
    assert launcher.env_key() != key


@pytest.mark.parametrize("T", [1, 24, 80])  # a direct plan; sorted plans (alignment launch) below and above 64
def test_forward_plan_chains_decode_sizes(T, monkeypatch):
    """With PDL on, a fused_moe plan of up to PDL_MAX_TOKENS tokens chains its launches: the first waits in plain
    stream order, every later one is a dependent. Larger calls keep plain stream order."""
    import hopperkern.moe.configs as moe_configs

    monkeypatch.setattr(moe_configs, "pdl_enabled", lambda device=None: True)
    x, w13, w2, weights, ids = moe_inputs(T, E=8)
    plan = moe_ops.ForwardPlan(x, w13, w2, weights, ids, "silu", "never", True, None, moe_ops.SAVE_NONE)
    flags = [_flags(launch) for launch, _ in plan.steps]
    assert len(flags) >= 2
    if T > moe_configs.PDL_MAX_TOKENS:
        assert flags == [(False, False, False)] * len(flags)
        return
    assert flags[0] == (False, True, False)
    assert all(f[0] and f[2] for f in flags[1:]) and not flags[-1][1]
    assert all(f[1] for f in flags[:-1])


# ---------------------------------------------------------------------------------------------------- GPU


def _gpu_inputs(T, E, H, I, k, seed=0):  # noqa: E741
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((T, H), generator=gen, device="cuda").bfloat16()
    w13 = (torch.randn((E, 2 * I, H), generator=gen, device="cuda") / H ** 0.5).bfloat16()
    w2 = (torch.randn((E, H, I), generator=gen, device="cuda") / I ** 0.5).bfloat16()
    weights, ids = moe.route(torch.randn((T, E), generator=gen, device="cuda"), k)
    ids[0, 0] = -1  # a dropped slot
    return x, w13, w2, weights, ids


@gpu
def test_h200_has_pdl_and_plans_chain():
    assert tma.capability().pdl
    x, w13, w2, weights, ids = _gpu_inputs(3, 64, 256, 128, 4)
    moe.fused_moe(x, w13, w2, weights, ids)
    plan = next(iter(moe_ops._FORWARD_PLANS._plans.values()))
    assert [launch.options.get("launch_pdl", False) for launch, _ in plan.steps][0] is False
    assert all(launch.c_head[2] for launch, _ in plan.steps[1:])  # bound with the PDL launch attribute


@gpu
@pytest.mark.parametrize("T", [1, 3, 40])  # direct plans (per-slot and fused top-k down) where 4*T*k <= E, else sorted
@pytest.mark.parametrize("tma_mode", ["never", "always"])
@pytest.mark.parametrize("deterministic", [True, False])
def test_chained_moe_matches_unchained(T, tma_mode, deterministic, monkeypatch):
    """Chained and unchained calls give bitwise the same output (deterministic) or the same within fp32 atomic
    reordering, on their first call (Triton's launch path, descriptor scratch from the allocator) and on
    later ones (direct launches), for several shapes in a row so freed scratch is reused by the next launch."""
    shapes = [(T, 64, 512, 256, 8), (T, 128, 1024, 96, 4)]
    for fused_topk in (False, True) if T <= 3 else (False,):  # fused top-k applies to direct plans only
        for shape in shapes:
            x, w13, w2, weights, ids = _gpu_inputs(*shape)
            ref = reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.float32)
            cfg = moe.moe_launch_config(shape[1], shape[2], shape[3], x.dtype, T, shape[4], x.device)[0]
            cfg = cfg.model_copy(update={"fused_topk": fused_topk})
            outs = {}
            for pdl in ("0", "1"):
                monkeypatch.setenv("HOPPERKERN_PDL", pdl)
                outs[pdl] = [moe.fused_moe(x, w13, w2, weights, ids, tma=tma_mode, deterministic=deterministic,
                                           config=cfg) for _ in range(3)]
                outs[pdl] += [moe.fused_moe(x, w13, w2, weights, ids, tma=tma_mode, deterministic=deterministic)
                              for _ in range(2)]
            torch.cuda.synchronize()
            for a, b in zip(outs["0"], outs["1"]):
                if deterministic:
                    assert torch.equal(a, b)
                else:
                    assert torch.allclose(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            err = ((outs["1"][-1].double() - ref.double()).abs().max() / ref.double().abs().max()).item()
            assert err < 2e-2


@gpu
@pytest.mark.parametrize("T", [1, 16])
def test_chained_moe_in_cuda_graph(T, monkeypatch):
    """A graph of three chained calls (PDL edges captured) replays, on fresh inputs, to bitwise what unchained eager
    calls give."""
    from hopperkern.tune.timing import capture_graph

    monkeypatch.setenv("HOPPERKERN_PDL", "1")
    x, w13, w2, weights, ids = _gpu_inputs(T, 128, 1024, 256, 8)
    box = {}

    def three():
        y = x
        for _ in range(3):
            y = moe.fused_moe(y, w13, w2, weights, ids, check_ids=False)
        box["y"] = y

    graph = capture_graph(three)
    plans = list(moe_ops._FORWARD_PLANS._plans.values())
    assert plans and all(all(launch.options.get("launch_pdl") for launch, _ in p.steps[1:]) for p in plans)
    x.copy_(torch.randn_like(x))
    graph.replay()
    monkeypatch.setenv("HOPPERKERN_PDL", "0")
    want = x
    for _ in range(3):
        want = moe.fused_moe(want, w13, w2, weights, ids)
    torch.cuda.synchronize()
    assert torch.isfinite(want).all()
    assert torch.equal(box["y"], want)
