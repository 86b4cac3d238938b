"""fused_moe backward: gradients of hidden, w13, w2 and topk_weights against fp64 autograd of the per-expert
reference (hopperkern/moe/reference.py), on both memory paths, with saved and recomputed pre-activations;
router-logit gradients through moe.route; custom-op checks and torch.compile; determinism and no-grad behaviour.

Under the interpreter the MoE config is block_m=16, block_n=32, block_k=32 and the weight-gradient GEMMs use
32 x 32 tiles with K steps of 16 rows, so the shapes below leave tails in every tiled dim."""

from dataclasses import dataclass

import pytest
import torch

from hopperkern import moe, tma
from hopperkern.moe import ops, reference
from hopperkern.moe.backward import gather_rows, moe_backward
from hopperkern.moe.configs import INTERPRETER_CONFIG
from hopperkern.tuning import MoeConfig

MODES = ("never", "always")
FP32_RTOL = 2e-5
F16_ATOL = 2e-4
BWD_OPS = ("moe.backward.dgate_up", "moe.backward.d_hidden", "moe.backward.d_w13", "moe.backward.d_w2")


@pytest.fixture(autouse=True)
def _no_tma_env(monkeypatch):
    monkeypatch.delenv("HOPPERKERN_TMA", raising=False)


@dataclass(frozen=True)
class Case:
    T: int
    E: int
    H: int
    I: int  # noqa: E741
    k: int
    dtype: torch.dtype
    activation: str
    routing: str
    why: str


CASES = [
    Case(21, 6, 64, 32, 2, torch.float32, "silu", "uniform", "fp32 silu: T > block_m, several blocks per expert"),
    Case(19, 5, 40, 24, 3, torch.float32, "gelu_tanh", "uniform", "fp32 gelu_tanh: H, I tails in every GEMM"),
    Case(23, 8, 64, 48, 2, torch.float16, "silu", "skewed", "fp16, Zipf-like routing: a heavy expert, empty ones"),
    Case(9, 8, 64, 32, 8, torch.float16, "gelu_tanh", "uniform", "k = 8 = E, T < block_m"),
    Case(33, 3, 48, 16, 1, torch.float16, "silu", "uniform", "k = 1, I < block_n"),
    Case(19, 4, 48, 80, 2, torch.float32, "gelu_tanh", "uniform",
         "I = 80: two column tiles of two halves each, the second past I"),
]


def make_inputs(case: Case, device, seed=0, drop=0.15):
    """hidden, w13, w2, router logits and (topk_weights, topk_ids) from moe.route; ~drop of the slots dropped
    (-1). ``skewed`` routing sends most tokens to expert 0 and none to the last experts."""
    gen = torch.Generator().manual_seed(seed)
    T, E, H, I, k = case.T, case.E, case.H, case.I, case.k  # noqa: E741
    x = torch.randn((T, H), generator=gen).to(case.dtype)
    w13 = (torch.randn((E, 2 * I, H), generator=gen) / H ** 0.5).to(case.dtype)
    w2 = (torch.randn((E, H, I), generator=gen) / I ** 0.5).to(case.dtype)
    logits = torch.randn((T, E), generator=gen)
    if case.routing == "skewed":
        logits = logits - 3.0 * torch.arange(E).float()  # expert e is picked ~ exp(-3e)
        logits[:, E - 2:] = -1e4  # the last two experts get no token at all
    weights, ids = moe.route(logits, k)
    ids[torch.rand((T, k), generator=gen) < drop] = -1
    upstream = torch.randn((T, H), generator=gen)
    return [t.to(device) for t in (x, w13, w2, weights, ids, logits, upstream)]


def grads_of(fn, x, w13, w2, weights, ids, upstream, dtype=None):
    """Output and gradients of <fn(...), upstream> w.r.t. (hidden, w13, w2, topk_weights), on fresh leaves
    cast to ``dtype``."""
    leaves = [t.detach().to(dtype or t.dtype).clone().requires_grad_() for t in (x, w13, w2, weights)]
    out = fn(*leaves, ids)
    out.backward(upstream.to(out.dtype))
    return out.detach(), [t.grad for t in leaves]


def rel_err(a, ref):
    r = ref.double()
    return ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()


def check_grads(case, x, w13, w2, weights, ids, upstream, got, got_out, activation):
    """fp32: relative error <= FP32_RTOL against fp64; fp16: <= 2x plain torch's fp16 error (the same
    reference run in fp16 under autograd) + F16_ATOL."""
    ref_fn = lambda *a: reference.fused_moe(*a, activation=activation)  # noqa: E731
    want_out, want = grads_of(ref_fn, x, w13, w2, weights, ids, upstream, torch.float64)
    if case.dtype == torch.float16:
        low_fn = lambda *a: reference.fused_moe(*a, activation=activation, compute_dtype=torch.float16)  # noqa: E731
        base_out, base = grads_of(low_fn, x, w13, w2, weights.half(), ids, upstream)
    for name, g, w, b in zip(("d_hidden", "d_w13", "d_w2", "d_topk_weights"), got, want,
                             base if case.dtype == torch.float16 else [None] * 4):
        ref_leaf = (x, w13, w2, weights)[("d_hidden", "d_w13", "d_w2", "d_topk_weights").index(name)]
        assert g is not None and g.shape == ref_leaf.shape and g.dtype == ref_leaf.dtype, name
        if b is None:
            assert rel_err(g, w) <= FP32_RTOL, f"{name}: rel err {rel_err(g, w):.2e}"
        else:
            e_k, e_t = rel_err(g, w), rel_err(b, w)
            assert e_t < 5e-2, f"{name}: torch fp16 baseline is broken ({e_t:.2e})"
            assert e_k <= 2 * e_t + F16_ATOL, f"{name}: kernel {e_k:.2e} > 2 x torch {e_t:.2e} + {F16_ATOL}"
    tol = FP32_RTOL if case.dtype == torch.float32 else 2e-3
    assert rel_err(got_out, want_out) <= tol
    return want


# Every case on both memory paths with the saved intermediate; the recomputing backward (which runs the forward's
# gate/up kernel again) once per case, on the two paths in turn.
@pytest.mark.parametrize("case,mode,recompute", [
    pytest.param(case, mode, recompute, id=f"{case.why}-{mode}-{'recompute' if recompute else 'saved'}")
    for i, case in enumerate(CASES) for mode, recompute in (*((m, False) for m in MODES), (MODES[i % 2], True))])
def test_gradients_match_reference(case, mode, recompute, device):
    x, w13, w2, weights, ids, _, up = make_inputs(case, device)
    fn = lambda *a: moe.fused_moe(*a, activation=case.activation, tma=mode, recompute=recompute)  # noqa: E731
    before = {op: tma.decision_count(op) for op in BWD_OPS}
    out, got = grads_of(fn, x, w13, w2, weights, ids, up)
    check_grads(case, x, w13, w2, weights, ids, up, got, out, case.activation)
    for op in BWD_OPS:
        dec = tma.last_decision(op)
        assert dec is not None and tma.decision_count(op) > before[op], f"{op} was not launched"
        assert all(v == (mode == "always") for v in dec.use.values()), dec
    dropped = ids == -1
    assert torch.count_nonzero(got[3][dropped]) == 0, "dropped slots must get exactly zero d_topk_weights"
    used = torch.zeros(case.E, dtype=torch.bool)
    used[ids[ids >= 0].long().cpu()] = True
    for e in torch.nonzero(~used).flatten().tolist():
        assert torch.count_nonzero(got[1][e]) == 0 and torch.count_nonzero(got[2][e]) == 0, \
            f"expert {e} has no token: its weight gradients must be exact zeros"


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid"])
def test_router_logit_gradient(scoring, device):
    """Gradients flow from fused_moe through moe.route to the router logits (softmax top-k, and DeepSeek-V3's
    sigmoid group-limited routing with renormalisation and scale)."""
    case = Case(17, 8, 64, 32, 2, torch.float32, "silu", "uniform", "")
    x, w13, w2, _, _, logits, up = make_inputs(case, device, seed=3)
    kw = dict(scoring=scoring) | (dict(num_groups=4, topk_groups=2, scale=2.5) if scoring == "sigmoid" else {})
    results = []
    for fused in (True, False):
        lg = logits.detach().clone().requires_grad_()
        weights, ids = moe.route(lg, case.k, **kw)
        if fused:
            out = moe.fused_moe(x, w13, w2, weights, ids)
        else:
            out = reference.fused_moe(x.double(), w13.double(), w2.double(), weights.double(), ids)
        out.backward(up.to(out.dtype))
        results.append(lg.grad)
    assert results[0].abs().max() > 0
    assert rel_err(results[0], results[1]) <= FP32_RTOL


def _transposed_storage(t):
    """The same values as ``t`` (2-D or 3-D) in a non-contiguous view: the last two dims stored transposed."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


def test_noncontiguous_upstream_and_inputs(device):
    """A transposed upstream gradient, an expanded one (out.sum()), and hidden, w13, w2 and topk_weights read
    through non-contiguous views: gradients still match the reference (no copies needed) and come contiguous."""
    case = CASES[0]
    x, w13, w2, weights, ids, _, up = make_inputs(case, device, seed=5)
    up_t = up.t().contiguous().t()
    assert up_t.stride() != up.stride()
    views = lambda a, b, c, w, i: moe.fused_moe(*map(_transposed_storage, (a, b, c, w)), i)  # noqa: E731
    out, got = grads_of(views, x, w13, w2, weights, ids, up_t)
    check_grads(case, x, w13, w2, weights, ids, up, got, out, "silu")
    assert all(g.is_contiguous() for g in got)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    moe.fused_moe(*leaves, ids).sum().backward()  # upstream gradient with strides (0, 0)
    _, want = grads_of(lambda *a: reference.fused_moe(*a), x, w13, w2, weights, ids, torch.ones_like(up),
                       torch.float64)
    for g, w in zip([t.grad for t in leaves], want):
        assert rel_err(g, w) <= FP32_RTOL


def test_deterministic_and_atomic_hidden_gradient(device):
    """deterministic=True: bitwise equal gradients in two runs; deterministic=False (fp32 atomics for d_hidden
    and the output) agrees to fp32 rounding."""
    case = CASES[2]
    x, w13, w2, weights, ids, _, up = make_inputs(case, device, seed=7)
    runs = [grads_of(lambda *a: moe.fused_moe(*a), x, w13, w2, weights, ids, up)[1] for _ in range(2)]
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    _, atomic = grads_of(lambda *a: moe.fused_moe(*a, deterministic=False), x, w13, w2, weights, ids, up)
    for a, b in zip(runs[0], atomic):
        assert rel_err(b, a) <= 2e-3


def test_no_grad_saves_nothing_and_grad_saves(device):
    """Under no_grad (or with no input requiring grad) fused_moe records nothing for autograd; with grad it
    saves the plan and pre-activations, or only the plan with recompute=True."""
    case = CASES[0]
    x, w13, w2, weights, ids, _, _ = make_inputs(case, device)
    w13 = w13.clone().requires_grad_()
    packed = []

    def pack(t):
        packed.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.no_grad():
            out = moe.fused_moe(x, w13, w2, weights, ids)
        assert out.grad_fn is None and packed == []
        moe.fused_moe(x, w13.detach(), w2, weights, ids)
        assert packed == []
        saved = moe.fused_moe(x, w13, w2, weights, ids)
        n_saved = sum(packed)
        packed.clear()
        recomputed = moe.fused_moe(x, w13, w2, weights, ids, recompute=True)
        n_recompute = sum(packed)
    assert saved.grad_fn is not None and recomputed.grad_fn is not None
    rows = -(-case.T * case.k // 16) * 16
    assert n_saved - n_recompute >= rows * 2 * case.I, "saved mode keeps the [rows, 2I] pre-activations"


@pytest.mark.parametrize("block_m", [16, 32])
@pytest.mark.parametrize("empty", ["T=0", "k=0"])
def test_empty_problems_with_grad(empty, block_m, device):
    """T = 0 or k = 0 with grads, with the interpreter's config and with an explicit one of another block_m
    (tuned configs of large token buckets use 64-128): an output of the right shape (zeros for k = 0) and zero
    gradients of the right shapes."""
    case = CASES[0]
    x, w13, w2, weights, ids, _, _ = make_inputs(case, device)
    if empty == "T=0":
        x, weights, ids = x[:0], weights[:0], ids[:0]
    else:
        weights, ids = weights[:, :0], ids[:, :0]
    g = INTERPRETER_CONFIG.gemm1.model_copy(update={"block_m": block_m})
    config = MoeConfig(gemm1=g, gemm2=g)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    out = moe.fused_moe(*leaves, ids, config=config)
    assert out.shape == x.shape and torch.count_nonzero(out) == 0
    out.sum().backward()
    for leaf in leaves:
        assert leaf.grad.shape == leaf.shape and torch.count_nonzero(leaf.grad) == 0


@pytest.mark.parametrize("which", ["w13", "topk_weights", "hidden"])
def test_only_some_inputs_need_grad(which, device):
    """Frozen experts, router-only training and activation-only gradients: the one gradient asked for matches
    the reference; fp16 routing weights and int64 ids work (route gives fp32 / int32)."""
    case = CASES[2]
    x, w13, w2, weights, ids, _, up = make_inputs(case, device, seed=9)
    weights, ids = weights.half(), ids.long()
    names = ("hidden", "w13", "w2", "topk_weights")
    leaves = {n: t.clone().requires_grad_(n == which) for n, t in zip(names, (x, w13, w2, weights))}
    moe.fused_moe(*leaves.values(), ids).backward(up.half())
    ref = {n: t.double().requires_grad_(n == which) for n, t in zip(names, (x, w13, w2, weights))}
    reference.fused_moe(*ref.values(), ids).backward(up.double())
    g = leaves[which].grad
    assert g.dtype == leaves[which].dtype and all(leaves[n].grad is None for n in names if n != which)
    assert rel_err(g, ref[which].grad) <= 5e-3


def test_opcheck(device):
    """torch.library.opcheck: schemas, fake implementations (dynamic sizes of the saved tensors, gradient
    strides for non-contiguous weights and routing weights) and the registered autograd of both custom ops."""
    case = CASES[1]
    x, w13, w2, weights, ids, _, up = make_inputs(case, device)
    w2, weights = _transposed_storage(w2), _transposed_storage(weights)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
    for save in (ops.SAVE_NONE, ops.SAVE_PRE, ops.SAVE_PLAN):
        torch.library.opcheck(ops.moe_forward_op, (*leaves, ids, "silu", "never", True, True, None, save),
                              test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    outs = ops.moe_forward_op(x, w13, w2, weights, ids, "silu", "never", True, True, None, ops.SAVE_PRE)
    torch.library.opcheck(ops.moe_backward_op, (up, x, w13, w2, weights, ids, *outs[1:], "silu", "never", True,
                                                None, [True, True, True, True]),
                          test_utils=("test_schema", "test_faketensor"))


def test_compile_fullgraph_training_step(device):
    """torch.compile(fullgraph=True) traces route + fused_moe + loss + backward, with w2 stored transposed;
    gradients equal eager's."""
    case = Case(17, 8, 64, 32, 2, torch.float32, "silu", "uniform", "")
    x, w13, w2, _, _, logits, _ = make_inputs(case, device, seed=11)

    def step(x, w13, w2, logits):
        weights, ids = moe.route(logits, case.k)
        return moe.fused_moe(x, w13, w2, weights, ids, check_ids=False).square().sum()

    grads = []
    for fn in (torch.compile(step, fullgraph=True), step):
        leaves = [t.clone().requires_grad_() for t in (x, w13, _transposed_storage(w2), logits)]
        fn(*leaves).backward()
        grads.append([t.grad for t in leaves])
    for a, b in zip(*grads):
        assert rel_err(a, b) <= FP32_RTOL


def test_compile_dynamic_token_counts_one_graph(device):
    """torch.compile(dynamic=True, fullgraph=True) of fused_moe + backward traces one graph for every token count
    (the validation cache must not pin symbolic sizes); outputs and gradients equal eager's."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, w13, w2, weights, ids):
        return moe.fused_moe(x, w13, w2, weights, ids, check_ids=False)

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    try:
        for T in (5, 9, 12):
            x, w13, w2, weights, ids, _, up = make_inputs(Case(T, 4, 32, 16, 2, torch.float32, "silu", "uniform", ""),
                                                          device, seed=T)
            got = []
            for fn in (compiled, step):
                leaves = [t.clone().requires_grad_() for t in (x, w13, w2, weights)]
                out = fn(*leaves, ids)
                out.backward(up)
                got.append([out, *(t.grad for t in leaves)])
            for a, b in zip(*got):
                assert rel_err(a, b) <= FP32_RTOL
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"{len(graphs)} graphs traced for 3 token counts"


def test_backward_launcher_checks(device):
    """The public backward launcher refuses a direct plan, a plan of other ids, saved pre-activations of the
    wrong shape and an upstream gradient of the wrong shape; gather_rows refuses a direct plan."""
    case = CASES[0]
    x, w13, w2, weights, ids, _, up = make_inputs(case, device, drop=0.0)
    cfg = INTERPRETER_CONFIG
    plan = moe.moe_align(ids, case.E, cfg.gemm1.block_m)
    pre = torch.empty((plan.max_rows, 2 * case.I), dtype=x.dtype, device=device)
    moe.gate_up(x, w13, plan, config=cfg.gemm1, pre_out=pre)
    with pytest.raises(ValueError, match="moe_backward needs a sorted plan"):
        moe_backward(up, x, w13, w2, weights, ids, moe.direct_plan(ids, case.E, 16), config=cfg)
    with pytest.raises(ValueError, match=r"pre must be \(\d+, 64\)"):
        moe_backward(up, x, w13, w2, weights, ids, plan, config=cfg, pre=pre[:, :-1])
    with pytest.raises(ValueError, match=r"d_out must be \[21, 64\]"):
        moe_backward(up[:-1], x, w13, w2, weights, ids, plan, config=cfg, pre=pre)
    with pytest.raises(ValueError, match=r"plan must be built from topk_ids \(20, 2\)"):
        moe_backward(up[:-1], x[:-1], w13, w2, weights[:-1], ids[:-1], plan, config=cfg, pre=pre)
    with pytest.raises(ValueError, match="gather_rows needs a sorted plan"):
        gather_rows(x, moe.direct_plan(ids, case.E, 16))
    with pytest.raises(ValueError, match="gate_up: pre_out needs a sorted plan"):
        moe.gate_up(x, w13, moe.direct_plan(ids, case.E, 16), config=cfg.gemm1, pre_out=pre)


def test_backward_configs_from_forward_tiles():
    """The dY GEMM starts from the forward's gate/up tile: block_n capped at 32 fp32 values per thread, and a
    4-warp 128-row forward tile (two programs per SM there) runs it with 8 warps, whose epilogue compiles
    without spills for sm_90 (benchmarks/compile_moe_sm90.py); the d_hidden GEMM keeps the down tile."""
    from hopperkern.moe.backward import backward_configs
    from hopperkern.tuning import KernelConfig

    down = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=2, flatten=True)
    for warps, bn in ((8, 128), (4, 64)):
        fwd = MoeConfig(gemm1=KernelConfig(block_m=128, block_n=bn, block_k=64, group_m=8, num_warps=warps,
                                           num_stages=3), gemm2=down)
        for recompute in (False, True):
            dy, dh, _ = backward_configs(fwd, torch.bfloat16, recompute)
            assert (dy.block_m, dy.num_warps, dy.block_n) == (128, 8, 64)
            assert dh == down
    small = MoeConfig(gemm1=KernelConfig(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4),
                      gemm2=KernelConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=4))
    dy, _, _ = backward_configs(small, torch.bfloat16, False)
    assert (dy.num_warps, dy.block_n) == (4, 64)
