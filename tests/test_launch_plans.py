"""Launch plans (hopperkern.tma.launcher): per-problem caching, invalidation, and what a reused plan must still
do right: fresh tensors every call, HOPPERKERN_TMA / HOPPERKERN_CONFIG changes, edited tuning files, other shapes
and dtypes. Also the index-check modes (check_labels / check_ids = True | False | "auto")."""

import os
import re

import pytest
import torch

import hopperkern.lce.launch as lce_launch
import hopperkern.moe.ops as moe_ops
from hopperkern import lce, moe, tma, tuning
from hopperkern._validate import sync_check
from hopperkern.lce import reference as lce_ref
from hopperkern.moe import reference as moe_ref
from hopperkern.tma.launcher import Launch, clear_plans

from conftest import DEVICE

gpu = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv("HOPPERKERN_TMA", raising=False)
    monkeypatch.delenv("HOPPERKERN_CONFIG", raising=False)
    clear_plans()
    yield
    clear_plans()


def lce_inputs(N=19, V=70, H=40, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn((N, H), generator=gen).to(dtype)
    w = (torch.randn((V, H), generator=gen) * H ** -0.5).to(dtype)
    y = torch.randint(0, V, (N,), generator=gen)
    return h.to(DEVICE), w.to(DEVICE), y.to(DEVICE)


def moe_inputs(T=6, E=4, H=64, I=32, k=2, seed=0):  # noqa: E741
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((T, H), generator=gen)
    w13 = torch.randn((E, 2 * I, H), generator=gen) / H ** 0.5
    w2 = torch.randn((E, H, I), generator=gen) / I ** 0.5
    weights, ids = moe.route(torch.randn((T, E), generator=gen), k)
    return [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30)).item()


def test_lce_plan_is_built_once_and_reused_with_fresh_tensors():
    """Two calls of one problem share one forward plan; the second call's new values give its own right
    answer (the plan holds no tensor of the first call)."""
    h, w, y = lce_inputs()
    lp1, _ = lce.linear_logprobs_entropy(h, w, y, tma="never")
    assert len(lce_launch._FORWARD_PLANS) == 1
    plan = next(iter(lce_launch._FORWARD_PLANS._plans.values()))
    assert all(a is None or not isinstance(a, torch.Tensor) for a in plan.forward.template)
    h2, w2, y2 = lce_inputs(seed=1)
    lp2, ent2 = lce.linear_logprobs_entropy(h2, w2, y2, tma="never")
    assert len(lce_launch._FORWARD_PLANS) == 1
    want_lp, want_ent = lce_ref.linear_logprobs_entropy(h2, w2, y2)
    assert rel(lp2, want_lp) < 1e-5 and rel(ent2, want_ent) < 1e-5
    assert not torch.equal(lp1, lp2)


@pytest.mark.parametrize("change", ["tokens", "dtype", "strides", "options", "entropy"])
def test_lce_plan_per_problem(change):
    """A different shape, dtype, stride, option or output set is a different plan, and each answer is right."""
    h, w, y = lce_inputs()
    lce.linear_cross_entropy(h, w, y, tma="never")
    kw = dict(tma="never")
    if change == "tokens":
        h, y = h[:11], y[:11]
    elif change == "dtype":
        h, w = h.half(), w.half()
    elif change == "strides":
        h = torch.cat([h, h], 1)[:, ::2]
    elif change == "options":
        kw["label_smoothing"] = 0.1
    else:
        kw["label_smoothing"] = 0.2
    loss = lce.linear_cross_entropy(h, w, y, **kw)
    assert len(lce_launch._FORWARD_PLANS) == 2
    want = lce_ref.linear_cross_entropy(h.float(), w.float(), y, **{k: v for k, v in kw.items() if k != "tma"})
    assert rel(loss, want) < (2e-3 if change == "dtype" else 1e-5)


def test_lce_plan_follows_hopperkern_tma(monkeypatch):
    """HOPPERKERN_TMA set between two calls takes effect on the next call (a new plan, the new decision)."""
    h, w, y = lce_inputs()
    lce.linear_logprobs_entropy(h, w, y)
    assert tma.last_decision("lce.forward").mode == "auto"
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    lce.linear_logprobs_entropy(h, w, y)
    d = tma.last_decision("lce.forward")
    assert d.mode == "never" and not any(d.use.values())
    monkeypatch.delenv("HOPPERKERN_TMA")
    lce.linear_logprobs_entropy(h, w, y)
    assert tma.last_decision("lce.forward").mode == "auto"
    assert len(lce_launch._FORWARD_PLANS) == 2  # the first plan serves the third call again


def test_plan_key_holds_hopperkern_config(monkeypatch, tmp_path):
    """A changed HOPPERKERN_CONFIG value is a new plan key (its file is looked up again)."""
    key = tma.launcher.env_key()
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    assert tma.launcher.env_key() != key
    h, w, y = lce_inputs()
    lce.linear_logprobs_entropy(h, w, y, tma="never")
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path / "other"))
    lce.linear_logprobs_entropy(h, w, y, tma="never")
    assert len(lce_launch._FORWARD_PLANS) == 2


def test_stamp_fresh_sees_an_edited_tuning_file(tmp_path):
    """A tuning file's stamp goes stale when the file changes (what every cached plan checks per call)."""
    path = tmp_path / "NVIDIA_H200.json"
    tuning.TuningConfig(device_name="NVIDIA H200").save(path)
    cfg = tuning.load_config(str(path))
    assert tuning.stamp_fresh(cfg)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert not tuning.stamp_fresh(cfg)
    assert tuning.stamp_fresh(tuning.load_config(str(path)))  # parsed again: a fresh stamp
    assert tuning.stamp_fresh(tuning.TuningConfig())  # built-in defaults never go stale


@pytest.mark.parametrize("family", ["lce", "moe"])
def test_stale_plan_is_rebuilt(family, tmp_path):
    """A plan whose tuning file changed since it was built is replaced on the next call."""
    path = tmp_path / "NVIDIA_H200.json"
    tuning.TuningConfig(device_name="NVIDIA H200").save(path)
    stale = tuning.load_config(str(path))
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    if family == "lce":
        h, w, y = lce_inputs()
        call = lambda: lce.linear_logprobs_entropy(h, w, y, tma="never")  # noqa: E731
        cache = lce_launch._FORWARD_PLANS
    else:
        args = moe_inputs()
        call = lambda: moe.fused_moe(*args, tma="never")  # noqa: E731
        cache = moe_ops._FORWARD_PLANS
    call()
    (key, plan), = cache._plans.items()
    plan.stamp = tuning.file_stamp(stale)
    call()
    assert cache.get(key) is not plan and cache.get(key).fresh()


def _three_pass_step(family, seed, mode):
    """One differentiable 3-pass call (sum loss, or log-probs and entropies with per-token upstream gradients) and
    its gradients, beside an fp64 autograd reference's: ((loss or outputs), grads, reference grads)."""
    h, w, y = lce_inputs(seed=seed)
    y[::5] = -100  # ignored tokens
    gen = torch.Generator().manual_seed(seed + 100)
    gl, ge = (torch.randn(h.shape[0], generator=gen).to(DEVICE) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    refs = [t.double().requires_grad_() for t in (h, w)]
    if family == "sft":
        out = lce.linear_cross_entropy(*leaves, y, reduction="sum", sft_path="3pass", tma=mode)
        grads = torch.autograd.grad(out, leaves)
        want = torch.autograd.grad(lce_ref.linear_cross_entropy(*refs, y, reduction="sum"), refs)
    else:
        lp, ent = lce.linear_logprobs_entropy(*leaves, y, grad_path="3pass", tma=mode)
        grads = torch.autograd.grad((lp, ent), leaves, (gl, ge))
        want = torch.autograd.grad(lce_ref.linear_logprobs_entropy(*refs, y), refs, (gl.double(), ge.double()))
    return grads, want


@pytest.mark.parametrize("family", ["sft", "rl"])
def test_3pass_launches_are_bound_once_and_follow_hopperkern_tma(family, monkeypatch):
    """The 3-pass paths' own launches (SFT: the reference logits, the row factors, the flagged rows and the
    backward's scaled hidden states; log-probs: d(logits) from the kept exponentials) are built once per problem
    and serve the next call's fresh tensors (each call's gradients right against fp64); a changed HOPPERKERN_TMA
    builds new ones, and tma.last_decision reports each call's decision of the launch that has one."""
    from hopperkern.lce import sft

    op = None if family == "sft" else "lce.rl_dlogits"
    n = 4 if family == "sft" else 1  # launches a step binds
    for seed in (0, 1):
        grads, want = _three_pass_step(family, seed, "auto")
        for g, r in zip(grads, want):
            assert rel(g, r) < 1e-5
    assert len(sft._LAUNCHES) == n
    count = tma.decision_count(op) if op else 0
    _three_pass_step(family, 2, "auto")
    assert len(sft._LAUNCHES) == n and (op is None or tma.decision_count(op) == count + 1)
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    grads, want = _three_pass_step(family, 3, "auto")
    assert len(sft._LAUNCHES) == 2 * n
    assert op is None or (tma.last_decision(op).mode == "never" and not any(tma.last_decision(op).use.values()))
    for g, r in zip(grads, want):
        assert rel(g, r) < 1e-5
    monkeypatch.delenv("HOPPERKERN_TMA")
    _three_pass_step(family, 4, "always")
    if op is None:
        assert len(sft._LAUNCHES) == 2 * n  # no operand of the SFT's launches has a memory path to choose
    else:
        assert len(sft._LAUNCHES) == 3 * n and tma.last_decision(op).mode == "always"


def test_moe_plan_reused_across_routings():
    """One fused_moe plan serves calls with new ids and weights (sorted and direct alignment), each right."""
    for T in (6, 1):
        x, w13, w2, _, _ = moe_inputs(T=T)
        for seed in (1, 2):
            gen = torch.Generator().manual_seed(seed)
            weights, ids = moe.route(torch.randn((T, 4), generator=gen).to(DEVICE), 2)
            out = moe.fused_moe(x, w13, w2, weights, ids, tma="never")
            want = moe_ref.fused_moe(x, w13, w2, weights, ids)
            assert rel(out, want) < 1e-5
    assert len(moe_ops._FORWARD_PLANS) == 2


@pytest.mark.parametrize("mode", ["never", "always"])
def test_moe_plan_training_and_inference(mode):
    """Training calls (plan + pre-activations kept for the backward) and inference calls of one problem use
    their own plans; gradients stay right when the plans are reused."""
    x, w13, w2, weights, ids = moe_inputs()
    for _ in range(2):
        xs = x.clone().requires_grad_()
        out = moe.fused_moe(xs, w13, w2, weights, ids, tma=mode)
        out.backward(torch.ones_like(out))
        xr = x.clone().requires_grad_()
        moe_ref.fused_moe(xr, w13, w2, weights, ids).backward(torch.ones_like(out))
        assert rel(xs.grad, xr.grad) < 1e-5
        with torch.no_grad():
            assert rel(moe.fused_moe(x, w13, w2, weights, ids, tma=mode), out.detach()) < 1e-6
    assert len(moe_ops._FORWARD_PLANS) == 2


@pytest.mark.parametrize("layout", ["sliced", "transposed"])
def test_moe_plan_per_top_k(layout):
    """Ids of k = 2 and k = 3 sliced from one wider tensor (the same strides) are different plans."""
    x, w13, w2, _, _ = moe_inputs(T=8)
    gen = torch.Generator().manual_seed(3)
    weights, ids = moe.route(torch.randn((8, 4), generator=gen).to(DEVICE), 4)
    if layout == "transposed":
        weights, ids = weights.T.contiguous().T, ids.T.contiguous().T
    for k in (2, 3):
        out = moe.fused_moe(x, w13, w2, weights[:, :k], ids[:, :k], tma="never")
        assert rel(out, moe_ref.fused_moe(x, w13, w2, weights[:, :k], ids[:, :k])) < 1e-5, k


def test_meta_tensors_get_shapes():
    """Meta tensors (shape inference) go to the ops' fake implementations, with and without grad."""
    h = torch.empty((5, 16), device="meta", requires_grad=True)
    w = torch.empty((32, 16), device="meta", requires_grad=True)
    y = torch.empty(5, dtype=torch.int64, device="meta")
    assert lce.linear_cross_entropy(h, w, y, check_labels=False).shape == ()
    with torch.no_grad():
        lp, ent = lce.linear_logprobs_entropy(h, w, y, check_labels=False)
    assert lp.shape == ent.shape == (5,) and lp.is_meta
    x = torch.empty((5, 16), device="meta")
    w13, w2 = torch.empty((4, 16, 16), device="meta"), torch.empty((4, 16, 8), device="meta")
    tw, ids = torch.empty((5, 2), device="meta"), torch.empty((5, 2), dtype=torch.int32, device="meta")
    assert moe.fused_moe(x, w13, w2, tw, ids, check_ids=False).shape == (5, 16)


def test_double_backward_raises():
    """A second derivative through the LCE or the MoE raises (it is not implemented) instead of dropping a term:
    at the backward that asks for a graph (create_graph=True)."""
    h, w, y = lce_inputs()
    h.requires_grad_()
    loss = lce.linear_cross_entropy(h, w, y, tma="never")
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(loss, h, create_graph=True)
    x, w13, w2, weights, ids = moe_inputs()
    x.requires_grad_()
    out = moe.fused_moe(x, w13, w2, weights, ids, tma="never")
    with pytest.raises(RuntimeError, match="hopperkern.moe: double backward is not supported"):
        torch.autograd.grad(out.square().sum(), x, create_graph=True)
    (g,) = torch.autograd.grad(out.square().sum(), x)  # first order stays available
    assert g.shape == x.shape and not g.requires_grad


def test_torch_func_transforms_refused():
    """Inside torch.func.vmap or torch.func.grad every op raises UnsupportedError naming the transform (its
    wrappers have no device addresses for the kernels), not an internal error of PyTorch; outside, calls work."""
    h, w, y = lce_inputs()
    x, w13, w2, weights, ids = moe_inputs()
    calls = {
        "lce.linear_cross_entropy": lambda a: lce.linear_cross_entropy(a, w, y[:1].expand(a.shape[0]), tma="never"),
        "lce.linear_logprobs_entropy": lambda a: lce.linear_logprobs_entropy(a, w, y[:1].expand(a.shape[0]),
                                                                             tma="never")[0].sum(),
        "moe.fused_moe": lambda a: moe.fused_moe(a.expand(x.shape[0], -1), w13, w2, weights, ids,
                                                 tma="never").sum(),
    }
    row = {"moe.fused_moe": x[:1], "lce.linear_cross_entropy": h[:2], "lce.linear_logprobs_entropy": h[:2]}
    for op, fn in calls.items():
        for transform in (torch.func.vmap, torch.func.grad):
            arg = row[op].unsqueeze(0) if transform is torch.func.vmap else row[op]
            with pytest.raises(tma.UnsupportedError, match=re.escape(op) + r":\n  - torch.func transforms"):
                transform(fn)(arg)
        assert torch.isfinite(fn(row[op])).all()


def test_launch_checks_dtypes_and_keeps_no_tensors():
    """A Launch refuses a tensor of another dtype than it was built for, and keeps none of its build tensors."""
    from hopperkern.moe._gemm_kernels import _topk_sum_kernel

    src, ids, out = torch.ones((4, 8)), torch.zeros(4, dtype=torch.int32), torch.empty((2, 8))
    launch = Launch(_topk_sum_kernel, (2, 1), src, ids, out, 4, 8, 8, 8, 1, TOP_K=2, BLOCK_H=8, num_warps=4)
    assert sum(isinstance(a, torch.Tensor) for a in launch.template) == 0
    if DEVICE == "cpu":
        launch(src, ids, out)
        assert torch.equal(out, torch.full((2, 8), 2.0))
        with pytest.raises(TypeError, match="bound for torch.int32"):
            launch(src, ids.long(), out)


def test_sync_check_modes():
    """True: always; False: never; "auto": only where no device sync is needed; another string or None:
    ValueError; a value of another type (0 / 1 and numpy bools aside): TypeError."""
    cpu = torch.zeros(3, dtype=torch.int64)

    class OnGpu:
        is_cuda = True

    assert sync_check("check_ids", True, OnGpu()) and not sync_check("check_ids", False, cpu)
    assert sync_check("check_ids", "auto", cpu) and not sync_check("check_ids", "auto", OnGpu())
    for bad in ("yes", "True", None):
        with pytest.raises(ValueError, match="check_ids must be True, False or 'auto'"):
            sync_check("check_ids", bad, cpu)
    assert sync_check("check_ids", 1, OnGpu()) and not sync_check("check_ids", 0, cpu)
    for bad in ([], 0.0, 2, object()):  # no truthiness: an empty list must not turn the check off
        with pytest.raises(TypeError, match="check_ids must be True, False or 'auto'"):
            sync_check("check_ids", bad, cpu)


def test_auto_checks_raise_on_cpu():
    """The default check mode raises for bad indices where checking costs no sync (CPU tensors)."""
    h, w, y = lce_inputs()
    y = y.clone()
    y[2] = 70
    with pytest.raises(ValueError, match="labels must be in"):
        lce.linear_cross_entropy(h, w, y)
    with pytest.raises(ValueError, match="check_labels must be True, False or 'auto'"):
        lce.linear_cross_entropy(h, w, y, check_labels="sometimes")
    args = moe_inputs()
    args[4][1, 0] = 7
    with pytest.raises(ValueError, match="topk_ids must be in"):
        moe.fused_moe(*args)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the direct launch path


@gpu
def test_direct_launch_binds_and_matches():
    """On a GPU the second call of a plan launches its compiled kernels directly, with the same results."""
    h, w, y = lce_inputs(N=300, V=5000, H=256, dtype=torch.bfloat16)
    outs = [lce.linear_logprobs_entropy(h, w, y) for _ in range(3)]
    plan = next(iter(lce_launch._FORWARD_PLANS._plans.values()))
    assert plan.forward.compiled is not None and plan.combine.compiled is not None
    assert plan.label.compiled is not None
    for a, b in zip(outs[0], outs[2]):
        assert torch.equal(a, b)
    x, w13, w2, weights, ids = moe_inputs(T=40, E=8, H=256, I=128, k=2)
    args = [t.bfloat16() if t.is_floating_point() and t is not weights else t for t in (x, w13, w2, weights, ids)]
    moe_outs = [moe.fused_moe(*args) for _ in range(3)]
    mplan = next(iter(moe_ops._FORWARD_PLANS._plans.values()))
    assert all(step[0].compiled is not None for step in mplan.steps)
    assert torch.equal(moe_outs[0], moe_outs[2])


@gpu
@pytest.mark.parametrize("mode", ["auto", "never"])
def test_unaligned_tensor_gets_its_own_plan(mode):
    """A call whose hidden starts off a 16-byte boundary is another plan (TMA refuses it; a binary may assume
    alignment), and stays right after aligned calls of the same shape bound their kernels."""
    N, V, H = 64, 4096, 256
    h, w, y = lce_inputs(N=N, V=V, H=H, dtype=torch.bfloat16)
    for _ in range(2):
        lce.linear_logprobs_entropy(h, w, y, tma=mode)
    buf = torch.empty(N * H + 1, dtype=torch.bfloat16, device=DEVICE)
    h_odd = buf[1:].view(N, H)
    h_odd.copy_(h)
    assert h_odd.data_ptr() % 16 != 0
    for _ in range(2):
        lp, ent = lce.linear_logprobs_entropy(h_odd, w, y, tma=mode)
    assert not tma.last_decision("lce.forward").use["hidden"]
    want_lp, want_ent = lce_ref.linear_logprobs_entropy(h.float(), w.float(), y)
    assert rel(lp, want_lp) < 2e-2 and rel(ent, want_ent) < 2e-2
    assert len(lce_launch._FORWARD_PLANS) == 2


@gpu
def test_direct_launch_leaves_profiler_hooks_to_triton():
    """With a Triton launch hook installed (a profiler), launches go through Triton, which calls the hook."""
    import triton

    h, w, y = lce_inputs(N=64, V=4096, H=256, dtype=torch.bfloat16)
    lce.linear_logprobs_entropy(h, w, y)
    seen = []
    hook = lambda metadata: seen.append(metadata)  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        lce.linear_logprobs_entropy(h, w, y)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    torch.cuda.synchronize()
    assert len(seen) == 3  # label logit, forward, combine


@gpu
def test_auto_checks_poison_on_gpu_without_sync():
    """On a GPU the default check mode does not synchronise: bad labels and ids give NaN, not an error."""
    h, w, y = lce_inputs(N=64, V=4096, H=256, dtype=torch.bfloat16)
    y[5] = 5000
    loss = lce.linear_cross_entropy(h, w, y, reduction="none")
    assert torch.isnan(loss[5]) and torch.isfinite(loss[:5]).all()
    x, w13, w2, weights, ids = moe_inputs(T=40, E=8, H=256, I=128, k=2)
    ids[3, 1] = 8
    out = moe.fused_moe(x, w13, w2, weights, ids)
    assert torch.isnan(out[3]).all() and torch.isfinite(out[4:]).all()


@gpu
def test_moe_cached_forward_serves_validated_plans_only():
    """fused_moe's one-lookup path serves a plan only where a validated call built or met it; arguments whose
    metadata differs take the full path and get its errors."""
    x, w13, w2, weights, ids = moe_inputs(T=40, E=8, H=256, I=128, k=2)
    x, w13, w2 = (t.bfloat16() for t in (x, w13, w2))
    args = (x, w13, w2, weights, ids, "silu", "auto", "auto", True)
    moe_ops.moe_forward_run(x, w13, w2, weights, ids, "silu", "auto", False, True, None, moe_ops.SAVE_NONE)
    assert moe_ops.cached_forward(*args) is None  # built by a caller that did not validate
    want = moe.fused_moe(x, w13, w2, weights, ids)
    got = moe_ops.cached_forward(*args)
    assert got is not None and torch.equal(got, want)
    assert torch.equal(moe.fused_moe(x, w13, w2, weights, ids), want)
    with pytest.raises(TypeError, match="w2 must be"):
        moe.fused_moe(x, w13, w2.half(), weights, ids)
    with pytest.raises(ValueError, match="topk_ids must have 40 rows"):
        moe.fused_moe(x, w13, w2, weights[:39], ids[:39])


@gpu
@pytest.mark.parametrize("N", [37, 256])
def test_lce_nograd_direct_path_matches_and_validates(N, monkeypatch):
    """A no-grad linear_logprobs_entropy call with the metadata of an earlier validated call takes the one-lookup
    direct path (statistics and outputs at 128-byte aligned addresses, also for N not a multiple of 4); its
    results equal the full path's and fp64's, for 1-D and 2-D labels. Changed metadata or HOPPERKERN_TMA takes
    the full path again, with its errors."""
    import hopperkern.lce.api as lce_api

    h, w, y = lce_inputs(N=N, V=1000, H=256, dtype=torch.bfloat16)
    want_lp, want_ent = lce_ref.linear_logprobs_entropy(h.double(), w.double(), y)
    for labels, hidden in ((y, h), (y.view(1, N), h.view(1, N, -1))):
        with torch.no_grad():
            first = lce.linear_logprobs_entropy(hidden, w, labels)
            assert len(lce_api._NOGRAD_CALLS) >= 1
            key = lce_api._nograd_key(hidden, w, labels, 1.0, -100, "auto", "auto", None)
            assert lce_api._NOGRAD_CALLS.get(key) is not None
            fast = lce_api._nograd_cached(key, hidden, w, labels)
            assert fast is not None and fast[0].shape == labels.shape
            again = lce.linear_logprobs_entropy(hidden, w, labels)
        for got in (fast, again):
            assert torch.equal(got[0], first[0]) and torch.equal(got[1], first[1])
            assert got[0].data_ptr() % 128 == 0 and got[1].data_ptr() % 128 == 0
        assert rel(first[0].flatten(), want_lp) < 2e-2 and rel(first[1].flatten(), want_ent) < 2e-2
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    key = lce_api._nograd_key(h, w, y, 1.0, -100, "auto", "auto", None)
    assert lce_api._NOGRAD_CALLS.get(key) is None  # another environment: a key of its own
    with torch.no_grad():
        lp, _ = lce.linear_logprobs_entropy(h, w, y)
        assert not tma.last_decision("lce.forward").any
        assert rel(lp, want_lp) < 2e-2
        with pytest.raises(ValueError, match="labels must have shape"):
            lce.linear_logprobs_entropy(h, w, y[:-1])
        with pytest.raises(TypeError, match="weight must be"):
            lce.linear_logprobs_entropy(h, w.half(), y)


@gpu
@pytest.mark.parametrize("T", [1, 40])
def test_direct_calls_with_descriptor_scratch_match(T):
    """With tma="always" the kernels build device-side descriptors in global scratch; a direct call takes that
    scratch from the plan's own allocation. Repeated calls (the first binds, later ones go direct) equal the first
    and the fp32 reference, for the LCE forward (grad and no grad) and for fused_moe's direct (T=1) and sorted
    (T=40) plans."""
    h, w, y = lce_inputs(N=45, V=3000, H=256, dtype=torch.bfloat16)
    want_lp, _ = lce_ref.linear_logprobs_entropy(h.double(), w.double(), y)
    with torch.no_grad():
        outs = [lce.linear_logprobs_entropy(h, w, y, tma="always") for _ in range(3)]
    grad_outs = [lce.linear_logprobs_entropy(h, w.requires_grad_(), y, tma="always") for _ in range(3)]
    w.requires_grad_(False)
    plans = list(lce_launch._FORWARD_PLANS._plans.values())
    assert any(p.forward.scratch for p in plans), "the test needs a launch with descriptor scratch"
    for got in outs[1:]:
        assert torch.equal(got[0], outs[0][0]) and torch.equal(got[1], outs[0][1])
    for got in grad_outs[1:]:
        assert torch.equal(got[0], grad_outs[0][0])
    assert rel(outs[2][0], want_lp) < 2e-2 and rel(grad_outs[2][0], want_lp) < 2e-2
    x, w13, w2, weights, ids = moe_inputs(T=T, E=8, H=256, I=128, k=2)
    x, w13, w2 = (t.bfloat16() for t in (x, w13, w2))
    moe_outs = [moe.fused_moe(x, w13, w2, weights, ids, tma="always") for _ in range(3)]
    mplan = next(iter(moe_ops._FORWARD_PLANS._plans.values()))
    assert mplan.all_bound and any(step[0].scratch for step in mplan.steps)
    want = moe_ref.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
    for got in moe_outs[1:]:
        assert torch.equal(got, moe_outs[0])
    assert rel(moe_outs[2], want) < 2e-2


def test_scratch_offsets_lay_out_descriptor_scratch():
    """One allocation serves a plan's buffers and its launches' descriptor scratch: each piece starts aligned as
    its launch asks (at least 128 bytes) after the plan's own bytes, launches without scratch get None, and the
    total is a multiple of 128 bytes."""
    from types import SimpleNamespace

    from hopperkern.tma.launcher import scratch_offsets

    launches = [SimpleNamespace(scratch=(1000, 128)), None, SimpleNamespace(scratch=None),
                SimpleNamespace(scratch=(64, 256)), SimpleNamespace(scratch=(10, 16))]
    offsets, total = scratch_offsets(launches, 300)
    assert offsets == (384, None, None, 1536, 1664)
    assert total == 1792 and total % 128 == 0
    assert scratch_offsets([], 0) == ((), 0)
    assert scratch_offsets([None], 130) == ((None,), 256)


@gpu
def test_lce_nograd_key_only_for_plain_eager_nograd_calls():
    """The one-lookup path is only for eager calls autograd does not record, on plain CUDA tensors, without
    autocast, a process group or a synchronous label check; every other call gets no key (the full path)."""
    import hopperkern.lce.api as lce_api

    h, w, y = lce_inputs(N=8, V=300, H=64, dtype=torch.bfloat16)
    key = lambda *a, **kw: lce_api._nograd_key(*a, **kw)  # noqa: E731
    args = (1.0, -100, "auto")
    assert key(h, w, y, *args, "auto", None) is not None
    assert key(h, w, y, *args, False, None) is not None
    assert key(h, w, y, *args, True, None) is None  # a synchronous check runs on the full path
    assert key(h, w, y, *args, "auto", object()) is None  # a process group
    assert key(h.cpu(), w.cpu(), y.cpu(), *args, "auto", None) is None
    wg = w.clone().requires_grad_()
    assert key(h, wg, y, *args, "auto", None) is None  # autograd records this call
    with torch.no_grad():
        assert key(h, wg, y, *args, "auto", None) is not None
        with torch.autocast("cuda", dtype=torch.float16):
            assert key(h, w, y, *args, "auto", None) is None

    class Sub(torch.Tensor):
        pass

    assert key(h.as_subclass(Sub), w, y, *args, "auto", None) is None
    assert key(h, w, y, 1, -100, "auto", "auto", None) != key(h, w, y, 1.0, -100, "auto", "auto", None)
    assert key(h, w, y, *args, "auto", None, "4pass") != key(h, w, y, *args, "auto", None)  # grad_path is checked


@pytest.mark.parametrize("bad", ["hidden", "topk_weights"])
def test_fused_moe_non_tensor_gets_type_error_with_grad_enabled(bad):
    """The eager fast path's grad test must not touch a non-tensor argument: the validation's TypeError comes
    first, as without the fast path."""
    x, w13, w2, weights, ids = moe_inputs()
    args = dict(hidden=x, w13=w13, w2=w2, topk_weights=weights, topk_ids=ids)
    args[bad] = None if bad == "topk_weights" else x.tolist()
    with torch.enable_grad(), pytest.raises(TypeError, match=f"{bad} must be"):
        moe.fused_moe(args["hidden"], args["w13"], args["w2"], args["topk_weights"], args["topk_ids"])


@pytest.mark.parametrize("flag", ["recompute", "deterministic"])
def test_fused_moe_flags_checked_on_the_cached_path(flag, monkeypatch):
    """Once a validated inference call has built its plan, later calls take the one-lookup path (on a GPU); a
    flag that is not a bool still gets its TypeError there. The interpreter's plans take that path here."""
    monkeypatch.setattr(tma.launcher.Plan, "launch_here", lambda self: True)  # a GPU plan on its device says so
    x, w13, w2, weights, ids = moe_inputs()
    want = moe.fused_moe(x, w13, w2, weights, ids)
    got = moe_ops.cached_forward(x, w13, w2, weights, ids, "silu", "auto", "auto", True)
    assert got is not None and torch.equal(got, want)
    for bad in ("yes", None, 2):
        with pytest.raises(TypeError, match=f"{flag} must be True or False"):
            moe.fused_moe(x, w13, w2, weights, ids, **{flag: bad})


def test_env_key_follows_a_replaced_environ(monkeypatch):
    """env_key reads os.environ's own store for speed, and reads anew when os.environ itself is replaced."""
    from hopperkern.tma.launcher import env_key

    monkeypatch.setenv("HOPPERKERN_TMA", "always")
    always = env_key()  # the values as os.environ stores them (bytes on POSIX)
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    assert env_key() != always
    monkeypatch.setattr(os, "environ", {"HOPPERKERN_TMA": "never", "HOPPERKERN_CONFIG": "x.json"})
    assert env_key() == ("never", "x.json", None)


def test_launch_at_dispatch():
    """launch_at goes direct only for a bound launch on the device of ``here`` that takes the tensors; every other
    case (unbound, no launch state, another device, tensors refused) takes Triton's path, once."""
    from hopperkern.tma.launcher import launch_at

    class Fake:
        def __init__(self, bound, device=0, takes=True):
            self.c_launch = object() if bound else None
            self.device, self.takes, self.calls = device, takes, []

        def direct(self, stream, tensors):
            self.calls.append(("direct", stream))
            return self.takes

        def _slow(self, tensors):
            self.calls.append(("slow",))

    cases = [(Fake(True), (0, 7), [("direct", 7)]), (Fake(False), (0, 7), [("slow",)]),
             (Fake(True), None, [("slow",)]), (Fake(True, device=1), (0, 7), [("slow",)]),
             (Fake(True, takes=False), (0, 7), [("direct", 7), ("slow",)])]
    for fake, here, want in cases:
        launch_at(fake, here, ())
        assert fake.calls == want
