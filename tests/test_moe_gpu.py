"""GPU-only MoE tests (run on the H200 with ``pytest -m gpu``): bf16 on the real shapes, CUDA-graph capture of
a decode step, a call from a worker thread (device-side TMA descriptors need a per-thread allocator)."""


import pytest
import torch

from conftest import run_in_thread
from hopperkern import moe, tma
from hopperkern.moe import reference

pytestmark = pytest.mark.gpu

# (name, E, top_k, H, I) from shared/PERF.md
SHAPES = [
    ("qwen3-30B-A3B", 128, 8, 2048, 768),
    ("deepseek-V3-TP8", 256, 8, 7168, 256),
    ("mixtral-8x7B", 8, 2, 4096, 14336),
    ("qwen3-235B-TP4", 128, 8, 4096, 384),
    ("gpt-oss-120B", 128, 4, 2880, 2880),
]

_WEIGHTS = {}


def _weights(E, H, I, dtype=torch.bfloat16):  # noqa: E741
    key = (E, H, I, dtype)
    if key not in _WEIGHTS:
        _WEIGHTS.clear()  # one shape at a time: mixtral's weights are 2.8 GB
        gen = torch.Generator(device="cuda").manual_seed(E + H + I)
        w13 = (torch.randn((E, 2 * I, H), generator=gen, device="cuda") / H ** 0.5).to(dtype)
        w2 = (torch.randn((E, H, I), generator=gen, device="cuda") / I ** 0.5).to(dtype)
        _WEIGHTS[key] = (w13, w2)
    return _WEIGHTS[key]


def _tokens(T, E, H, k, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn((T, H), generator=gen, device="cuda").to(dtype)
    weights, ids = moe.route(torch.randn((T, E), generator=gen, device="cuda"), k)
    return x, weights, ids


def _rel_err(out, ref):
    return ((out.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


@pytest.mark.parametrize("T", [1, 3, 300])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_bf16_real_shapes(shape, T):
    """The shipped tuning file's configs on both memory paths, with a dropped slot. T=1 takes the T=1 entries
    (a direct plan; DeepSeek-V3's uses the fused top-k down GEMM), 3 a direct or small sorted plan, 300 a
    sorted plan."""
    _, E, k, H, I = shape  # noqa: E741
    w13, w2 = _weights(E, H, I)
    x, weights, ids = _tokens(T, E, H, k)
    ids[0, 0] = -1
    out = moe.fused_moe(x, w13, w2, weights, ids)
    ref = reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.float32)
    base = reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.bfloat16)
    err, err_torch = _rel_err(out, ref), _rel_err(base, ref)
    assert err <= 2 * err_torch + 2e-3, f"kernel {err:.3g} vs torch bf16 {err_torch:.3g}"
    direct = moe.prefer_direct(T, k, E)  # 'auto' reads a direct plan's operands with pointer loads
    assert tma.last_decision("moe.gemm1").use["w13"] != direct and tma.last_decision("moe.gemm2").use["w2"] != direct
    never = moe.fused_moe(x, w13, w2, weights, ids, tma="never", deterministic=False)
    assert _rel_err(never, ref) <= 2 * err_torch + 2e-3
    if direct:
        always = moe.fused_moe(x, w13, w2, weights, ids, tma="always")
        assert tma.last_decision("moe.gemm1").use["w13"] and tma.last_decision("moe.gemm2").use["w2"]
        assert _rel_err(always, ref) <= 2 * err_torch + 2e-3


def _capture(step):
    """(CUDA graph of one call of ``step``, the graph's static output): two calls on a side stream first, so
    compiles and allocations happen outside the capture."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = step()
    return graph, static


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("T", [1, 4, 16])  # 1, 4: direct plan; 16: alignment kernel in the graph
def test_cuda_graph_decode_step(T, deterministic):
    """route + fused_moe captured once (check_ids=False: no host sync), replayed on new inputs."""
    _, E, k, H, I = SHAPES[0]  # noqa: E741
    w13, w2 = _weights(E, H, I)
    x, _, _ = _tokens(T, E, H, k, seed=1)
    logits = torch.randn((T, E), device="cuda")

    def step():
        w, ids = moe.route(logits, k)
        return moe.fused_moe(x, w13, w2, w, ids, check_ids=False, deterministic=deterministic)

    graph, static_out = _capture(step)
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(100 + seed)
        x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
        logits.copy_(torch.randn(logits.shape, generator=gen, device="cuda"))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        if deterministic:
            assert torch.equal(static_out, eager)
        else:
            torch.testing.assert_close(static_out, eager, rtol=1e-2, atol=1e-3)


def test_call_from_worker_thread():
    """tma='always' on a fresh thread: fails with 'no allocator was set' unless the launcher installs one."""
    _, E, k, H, I = SHAPES[0]  # noqa: E741
    w13, w2 = _weights(E, H, I)
    x, weights, ids = _tokens(5, E, H, k, seed=2)
    main = moe.fused_moe(x, w13, w2, weights, ids, tma="always")
    assert torch.equal(run_in_thread(lambda: moe.fused_moe(x, w13, w2, weights, ids, tma="always")), main)


def test_large_prefill_against_reference():
    """T=8192 on qwen3-30B: block_m 128 configs, multi-chunk alignment, both top-k reductions over k=8."""
    _, E, k, H, I = SHAPES[0]  # noqa: E741
    w13, w2 = _weights(E, H, I)
    x, weights, ids = _tokens(8192, E, H, k, seed=3)
    ref = reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.float32)
    base = reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.bfloat16)
    for deterministic in (True, False):
        out = moe.fused_moe(x, w13, w2, weights, ids, deterministic=deterministic)
        assert _rel_err(out, ref) <= 2 * _rel_err(base, ref) + 2e-3


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("shape", [SHAPES[0], SHAPES[4]], ids=lambda s: s[0])
def test_sorted_rows_match_gathered_rows(shape, deterministic):
    """``MoeConfig.sorted_rows`` (the token rows copied into sorted order, read by the gate/up GEMM with TMA) on
    the shipped tiles of 4096 tokens: the deterministic output is bitwise that of the gathering GEMM on the first
    call, on cached calls (the copy then shares the per-slot rows' scratch) and in a CUDA graph; the atomic one
    is as close to the reference."""
    _, E, k, H, I = shape  # noqa: E741
    w13, w2 = _weights(E, H, I)
    x, weights, ids = _tokens(4096, E, H, k, seed=5)
    ids[0, 0] = -1
    cfg = moe.moe_launch_config(E, H, I, x.dtype, 4096, k, x.device)[0]
    plain, sorted_ = cfg.model_copy(update={"sorted_rows": False}), cfg.model_copy(update={"sorted_rows": True})
    want = moe.fused_moe(x, w13, w2, weights, ids, config=plain, deterministic=deterministic)
    outs = [moe.fused_moe(x, w13, w2, weights, ids, config=sorted_, deterministic=deterministic) for _ in range(3)]
    assert tma.last_decision("moe.gemm1").use["xs"]
    graph, static = _capture(lambda: moe.fused_moe(x, w13, w2, weights, ids, config=sorted_,
                                                   deterministic=deterministic))
    graph.replay()
    torch.cuda.synchronize()
    outs.append(static)
    ref = reference.fused_moe(x[:256], w13, w2, weights[:256], ids[:256], compute_dtype=torch.float32)
    base = reference.fused_moe(x[:256], w13, w2, weights[:256], ids[:256], compute_dtype=torch.bfloat16)
    for out in outs:
        if deterministic:
            assert torch.equal(out, want)
        assert _rel_err(out[:256], ref) <= 2 * _rel_err(base, ref) + 2e-3


@pytest.mark.parametrize("mode", ["never", "always"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_fused_mlp_decode(shape, mode):
    """``MoeConfig.fused_mlp`` (both GEMMs of a direct plan in one kernel, the partial rows summed in a fixed
    order) on every shape at 1 and 2 tokens with a dropped slot, both memory paths: as close to the fp32
    reference as plain bf16 torch; bitwise the same on a cached call and in a CUDA graph."""
    from hopperkern.tune.moe_tuner import fused_mlp_candidates

    _, E, k, H, I = shape  # noqa: E741
    w13, w2 = _weights(E, H, I)
    for T in (1, 2):
        x, weights, ids = _tokens(T, E, H, k, seed=7)
        ids[0, 1] = -1
        cfg = fused_mlp_candidates(T * k, I)[0]
        run = lambda: moe.fused_moe(x, w13, w2, weights, ids, config=cfg, tma=mode)  # noqa: E731
        outs = [run(), run()]
        if moe.prefer_direct(T, k, E):
            assert set(tma.last_decision("moe.gemm1").use) == {"w13"}
        graph, static = _capture(run)
        graph.replay()
        torch.cuda.synchronize()
        ref = reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.float32)
        base = reference.fused_moe(x, w13, w2, weights, ids, compute_dtype=torch.bfloat16)
        assert _rel_err(outs[0], ref) <= 2 * _rel_err(base, ref) + 2e-3
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], static)


# ---------------------------------------------------------------------------------------------------------------
# Training: forward + backward in bf16

TRAIN_SHAPES = [
    ("qwen3-30B-A3B", 128, 8, 2048, 768),
    ("mixtral-8x7B", 8, 2, 4096, 14336),
    ("gpt-oss-120B", 128, 4, 2880, 2880),
    ("deepseek-V3", 256, 8, 7168, 2048),
]


def _experts_that_fit(H, I, headroom=0.75):  # noqa: E741
    """The most experts (a power of two) of this H and I whose training test fits the GPU in ``headroom`` of its
    memory: 12 bytes per weight at the peak (the bf16 weights, the fp32 reference's weight gradients, the kernel's
    bf16 gradients, then torch._grouped_mm's bf16 gradients and its leaves' copy of the weights), with room for
    what earlier tests left cached. deepseek-V3's 256 experts need about 126 GiB: an 80 GB card runs 64 of them and
    a 141 GB card 128, with the same H and I (the same tiles and kernels) and more rows per expert."""
    per_expert = 3 * H * I * 12
    E = 1
    while (2 * E) * per_expert <= headroom * torch.cuda.get_device_properties(0).total_memory:
        E *= 2
    return E


def _train_grads(fn, x, w13, w2, weights, ids, dout):
    leaves = [t.detach().clone().requires_grad_() for t in (x, w13, w2, weights)]
    return torch.autograd.grad(fn(*leaves, ids), leaves, dout)


@pytest.mark.parametrize("recompute", [False, True], ids=["saved", "recompute"])
@pytest.mark.parametrize("shape", TRAIN_SHAPES, ids=lambda s: s[0])
def test_bf16_backward_real_shapes(shape, recompute):
    """Gradients of hidden, w13, w2 and topk_weights within 2x the torch._grouped_mm autograd MLP's error
    against an fp32 reference (expert by expert), at 512 tokens with skewed routing (a heavy expert); as many of
    the shape's experts as fit the GPU (:func:`_experts_that_fit`)."""
    from benchmarks.bench_moe import torch_grouped_moe
    from benchmarks.bench_moe_train import GRADS, reference_grads, rel_norm_err

    _, E, k, H, I = shape  # noqa: E741
    E = min(E, _experts_that_fit(H, I))
    w13, w2 = _weights(E, H, I)
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn((512, H), generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn((512, E), generator=gen, device="cuda")
    logits[:, 0] += 2.0  # expert 0 takes most tokens
    weights, ids = moe.route(logits, k)
    dout = torch.randn((512, H), generator=gen, device="cuda").to(torch.bfloat16)
    ref = reference_grads(x, w13, w2, weights, ids, dout)
    ours = _train_grads(lambda *a: moe.fused_moe(*a, recompute=recompute), x, w13, w2, weights, ids, dout)
    base = _train_grads(torch_grouped_moe, x, w13, w2, weights, ids, dout)
    for name, g, b, r in zip(GRADS, ours, base, ref):
        e_k, e_t = rel_norm_err(g, r), rel_norm_err(b, r)
        assert e_k <= 2 * e_t + 1e-3, f"{name}: kernel {e_k:.3g} vs torch._grouped_mm {e_t:.3g}"
    assert all(tma.last_decision("moe.backward.d_w13").use.values())
    assert tma.last_decision("moe.backward.dgate_up").use["w2"]


def test_cuda_graph_training_step():
    """route + fused_moe + backward captured in one CUDA graph (check_ids=False: nothing synchronises with the
    host in forward or backward), replayed on new inputs: bitwise equal to eager."""
    _, E, k, H, I = SHAPES[0]  # noqa: E741
    w13, w2 = _weights(E, H, I)
    w13 = w13.detach().clone().requires_grad_()
    x = torch.randn((256, H), device="cuda", dtype=torch.bfloat16).requires_grad_()
    logits = torch.randn((256, E), device="cuda").requires_grad_()
    dout = torch.randn((256, H), device="cuda", dtype=torch.bfloat16)

    def step():
        weights, ids = moe.route(logits, k)
        out = moe.fused_moe(x, w13, w2, weights, ids, check_ids=False)
        return torch.autograd.grad(out, (x, w13, logits), dout)

    graph, static = _capture(step)
    for seed in range(2):
        gen = torch.Generator(device="cuda").manual_seed(200 + seed)
        with torch.no_grad():
            x.copy_(torch.randn(x.shape, generator=gen, device="cuda"))
            logits.copy_(torch.randn(logits.shape, generator=gen, device="cuda"))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for a, b in zip(static, eager):
            assert torch.equal(a, b)


def test_backward_from_worker_thread():
    """The backward's device-side descriptors on a fresh thread (tma='always')."""
    _, E, k, H, I = SHAPES[0]  # noqa: E741
    w13, w2 = _weights(E, H, I)
    x, weights, ids = _tokens(300, E, H, k, seed=4)
    dout = torch.randn_like(x)
    fn = lambda *a: moe.fused_moe(*a, tma="always")  # noqa: E731
    main = _train_grads(fn, x, w13, w2, weights, ids, dout)
    other = run_in_thread(lambda: _train_grads(fn, x, w13, w2, weights, ids, dout))
    for a, b in zip(main, other):
        assert torch.equal(a, b)
