"""The nn.Module forms: lce.LinearCrossEntropyLoss, lce.LinearLogprobsEntropy and moe.MoEBlock.

Each module must hold its options, register its parameters with the right shapes and dtypes, compute exactly what
the functional calls compute with those options, and pass gradients to every parameter (the router included).
MoEBlock's checkpoint loaders are checked against a plain per-expert PyTorch computation in fp64 written from
the checkpoint's own tensors and routing rule, independent of the block's w13 layout and of moe.route.

Sizes stay small for the interpreter: LCE N=12, V=70, H=40 (a tail in every tiled dim); MoE T=16, E=4, H=64, I=32.
"""

import math
import re

import pytest
import torch

from conftest import DEVICE
from hopperkern import lce, moe
from hopperkern.lce import reference as lce_reference
from hopperkern.moe import reference

T, E, H, I, K = 16, 4, 64, 32, 2  # noqa: E741 - MoE tokens, experts, hidden, intermediate, top-k
N, V = 12, 70  # LCE tokens and vocab (hidden H_LCE)
H_LCE = 40
FP32_RTOL = 2e-5
F16_ATOL = 2e-4


@pytest.fixture(autouse=True)
def _no_tma_env(monkeypatch):
    monkeypatch.delenv("HOPPERKERN_TMA", raising=False)


def rel_err(a, ref):
    r = ref.double()
    return ((a.double() - r).norm() / r.norm().clamp_min(1e-30)).item()


def randn(*shape, seed, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * scale).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------------------------
# LCE modules

LOSS_OPTIONS = dict(ignore_index=5, reduction="sum", label_smoothing=0.1, z_loss=1e-3, softcap=20.0, temperature=0.7,
                    tma="never", check_labels=False)


def lce_inputs(dtype, seed=0):
    hidden = randn(3, N // 3, H_LCE, seed=seed, dtype=dtype)
    weight = randn(V, H_LCE, seed=seed + 1, dtype=dtype, scale=H_LCE ** -0.5)
    bias = randn(V, seed=seed + 2, dtype=dtype, scale=0.1)
    labels = torch.randint(0, V, (3, N // 3), generator=torch.Generator().manual_seed(seed + 3)).to(DEVICE)
    labels[0, :2] = 5  # ignore_index=5 in LOSS_OPTIONS
    return hidden, weight, bias, labels


def grads(fn, *tensors):
    """fn's outputs (a tuple) and the gradients of sum(output_i * (i + 1)) w.r.t. fresh leaves of ``tensors``."""
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum(o.sum() * (i + 1) for i, o in enumerate(outs)).backward()
    return [o.detach() for o in outs], [t.grad for t in leaves]


def test_loss_module_holds_options():
    loss_fn = lce.LinearCrossEntropyLoss(**LOSS_OPTIONS)
    for name, value in LOSS_OPTIONS.items():
        assert getattr(loss_fn, name) == value, name
    assert list(loss_fn.parameters()) == [] and list(loss_fn.buffers()) == []
    assert "reduction='sum'" in repr(loss_fn) and "softcap=20.0" in repr(loss_fn)
    default = lce.LinearCrossEntropyLoss()
    assert (default.ignore_index, default.reduction, default.softcap, default.tma) == (-100, "mean", None, "auto")
    assert default.sft_path == "auto" and "sft_path='4pass'" in repr(lce.LinearCrossEntropyLoss(sft_path="4pass"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_module_equals_function(reduction, dtype):
    """Loss and gradients of the module are bitwise those of lce.linear_cross_entropy with the same options."""
    opts = dict(LOSS_OPTIONS, reduction=reduction)
    loss_fn = lce.LinearCrossEntropyLoss(**opts)
    hidden, weight, bias, labels = lce_inputs(dtype)
    got = grads(lambda h, w, b: loss_fn(h, w, labels, b), hidden, weight, bias)
    want = grads(lambda h, w, b: lce.linear_cross_entropy(h, w, labels, bias=b, **opts), hidden, weight, bias)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)
    assert got[0][0].shape == (() if reduction != "none" else labels.shape)


def test_loss_module_matches_reference():
    """The options reach the kernels: the module's loss equals the fp64 reference with those options."""
    hidden, weight, bias, labels = lce_inputs(torch.float32)
    opts = {k: v for k, v in LOSS_OPTIONS.items() if k not in ("tma", "check_labels")}
    loss = lce.LinearCrossEntropyLoss(**LOSS_OPTIONS)(hidden, weight, labels, bias)
    want = lce_reference.linear_cross_entropy(hidden, weight, labels, bias=bias, **opts)
    assert rel_err(loss, want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_logprobs_module_equals_function(dtype):
    module = lce.LinearLogprobsEntropy(temperature=0.7, ignore_index=5, tma="never")
    assert (module.temperature, module.ignore_index, module.tma, module.check_labels) == (0.7, 5, "never", "auto")
    assert list(module.parameters()) == []
    hidden, weight, _, labels = lce_inputs(dtype, seed=4)
    got = grads(lambda h, w: module(h, w, labels), hidden, weight)
    want = grads(lambda h, w: lce.linear_logprobs_entropy(h, w, labels, temperature=0.7, ignore_index=5,
                                                          tma="never"), hidden, weight)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        assert torch.equal(a, b)
    assert got[0][0].shape == labels.shape and torch.count_nonzero(got[0][0][labels == 5]) == 0
    lp, ent = lce_reference.linear_logprobs_entropy(hidden, weight, labels, temperature=0.7, ignore_index=5)
    tol = FP32_RTOL if dtype == torch.float32 else 2e-3
    assert rel_err(got[0][0], lp) <= tol and rel_err(got[0][1], ent) <= tol


LCE_ERRORS = [
    (lce.LinearCrossEntropyLoss, dict(reduction="avg"), ValueError, r"reduction must be one of \('mean', 'sum'"),
    (lce.LinearCrossEntropyLoss, dict(ignore_index=1.5), TypeError, "ignore_index must be an int, got float"),
    (lce.LinearCrossEntropyLoss, dict(label_smoothing=1.5), ValueError, "label_smoothing must be <= 1.0, got 1.5"),
    (lce.LinearCrossEntropyLoss, dict(z_loss=-1.0), ValueError, "z_loss must be >= 0.0, got -1.0"),
    (lce.LinearCrossEntropyLoss, dict(softcap=0.0), ValueError, "softcap must be > 0.0, got 0.0"),
    (lce.LinearCrossEntropyLoss, dict(softcap=float("inf")), ValueError, "softcap must be finite, got inf"),
    (lce.LinearCrossEntropyLoss, dict(z_loss=float("inf")), ValueError, "z_loss must be finite, got inf"),
    (lce.LinearLogprobsEntropy, dict(temperature=1e-300), ValueError, "temperature must be at least 2.939e-39"),
    (lce.LinearCrossEntropyLoss, dict(temperature=0), ValueError, "temperature must be > 0.0, got 0"),
    (lce.LinearCrossEntropyLoss, dict(tma="fast"), ValueError, r"tma must be one of \('auto', 'always', 'never'\)"),
    (lce.LinearCrossEntropyLoss, dict(check_labels="yes"), ValueError,
     "check_labels must be True, False or 'auto', got 'yes'"),
    (lce.LinearLogprobsEntropy, dict(check_labels=None), ValueError,
     "check_labels must be True, False or 'auto', got None"),
    (lce.LinearCrossEntropyLoss, dict(sft_path="2pass"), ValueError,
     r"sft_path must be one of \('auto', '3pass', 'chunked', '4pass'\), got '2pass'"),
    (lce.LinearCrossEntropyLoss, dict(sft_path="3pass", reduction="none"), ValueError,
     r"sft_path must be 'auto' or '4pass' with reduction='none', got '3pass'"),
    (lce.LinearLogprobsEntropy, dict(temperature="hot"), TypeError, "temperature must be a number, got str"),
    (lce.LinearLogprobsEntropy, dict(temperature=10 ** 400), ValueError,
     "temperature must be finite and representable as a float"),
    (lce.LinearCrossEntropyLoss, dict(z_loss=10 ** 400), ValueError, "z_loss must be finite and representable"),
    (lce.LinearCrossEntropyLoss, dict(check_labels=[]), TypeError,
     r"check_labels must be True, False or 'auto', got \[\]"),
    (lce.LinearLogprobsEntropy, dict(ignore_index=True), TypeError, "ignore_index must be an int, got bool"),
]


@pytest.mark.parametrize("cls, kwargs, exc, match", LCE_ERRORS, ids=[str(e[1]) for e in LCE_ERRORS])
def test_lce_module_option_errors(cls, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        cls(**kwargs)


@pytest.mark.parametrize("value", ["yes", None, 1, 0, True, "auto", [], 0.0])
def test_lce_modules_take_check_labels_as_the_functions_do(value):
    """A check_labels value the functions refuse, the modules refuse with the same error; one they take (0 and 1
    for their truth value), the modules take."""
    hidden, weight, labels = torch.randn(4, 8), torch.randn(10, 8), torch.randint(0, 10, (4,))
    for cls, fn in ((lce.LinearCrossEntropyLoss, lce.linear_cross_entropy),
                    (lce.LinearLogprobsEntropy, lce.linear_logprobs_entropy)):
        try:
            fn(hidden, weight, labels, check_labels=value, tma="never")
        except (TypeError, ValueError) as e:
            with pytest.raises(type(e), match=re.escape(str(e))):
                cls(check_labels=value)
        else:
            cls(check_labels=value)


# ---------------------------------------------------------------------------------------------------------------
# MoEBlock: parameters, forward, gradients


def make_block(dtype=torch.float32, seed=0, **options):
    torch.manual_seed(seed)
    return moe.MoEBlock(H, I, E, K, device=DEVICE, dtype=dtype, **options)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_block_parameters(dtype):
    block = make_block(dtype)
    params = dict(block.named_parameters())
    assert {n: (tuple(p.shape), p.dtype) for n, p in params.items()} == {
        "gate.weight": ((E, H), dtype), "w13": ((E, 2 * I, H), dtype), "w2": ((E, H, I), dtype)}
    assert all(p.requires_grad and p.device.type == torch.device(DEVICE).type for p in params.values())
    assert isinstance(block.gate, torch.nn.Linear) and block.gate.bias is None
    assert block.correction_bias is None and list(block.buffers()) == []
    # nn.Linear's init: uniform in +-1/sqrt(fan_in), so std = bound / sqrt(3)
    for p, fan_in in ((block.gate.weight, H), (block.w13, H), (block.w2, I)):
        bound = 1 / math.sqrt(fan_in)
        assert p.abs().max() <= bound and abs(p.float().std().item() - bound / math.sqrt(3)) < 0.1 * bound


def test_block_holds_options():
    block = make_block(activation="gelu_tanh", scoring="sigmoid", renormalize=False, num_groups=2, topk_groups=1,
                       correction_bias=True, scale=2.5, tma="never", deterministic=False, recompute=True)
    assert (block.hidden_size, block.intermediate_size, block.num_experts, block.top_k) == (H, I, E, K)
    assert (block.activation, block.scoring, block.renormalize, block.num_groups, block.topk_groups, block.scale,
            block.tma, block.deterministic, block.recompute) == ("gelu_tanh", "sigmoid", False, 2, 1, 2.5, "never",
                                                                 False, True)
    assert block.correction_bias.shape == (E,) and block.correction_bias.dtype == torch.float32
    assert dict(block.named_buffers()).keys() == {"correction_bias"}
    assert not block.correction_bias.requires_grad and torch.count_nonzero(block.correction_bias) == 0
    assert "scoring='sigmoid'" in repr(block) and "correction_bias=True" in repr(block)


BLOCK_VARIANTS = [
    pytest.param(torch.float32, {}, id="fp32 softmax silu"),
    pytest.param(torch.float16, dict(activation="gelu_tanh", renormalize=False), id="fp16 gelu_tanh unnormalised"),
    pytest.param(torch.float32, dict(scoring="sigmoid", num_groups=2, topk_groups=1, correction_bias=True,
                                     scale=2.5), id="fp32 DeepSeek-style routing"),
]


def route_as(block, logits):
    """moe.route with the block's routing options."""
    return moe.route(logits, K, scoring=block.scoring, renormalize=block.renormalize, num_groups=block.num_groups,
                     topk_groups=block.topk_groups, correction_bias=block.correction_bias, scale=block.scale)


def functional_block(block, x, w13=None, w2=None):
    """What MoEBlock documents: moe.route on the router's logits, then moe.fused_moe (on ``w13``, ``w2`` if
    given, else the block's), for [..., H] inputs."""
    h = x.reshape(-1, H)
    weights, ids = route_as(block, torch.nn.functional.linear(h, block.gate.weight))
    w13, w2 = (block.w13, block.w2) if w13 is None else (w13, w2)
    return moe.fused_moe(h, w13, w2, weights, ids, activation=block.activation).view(x.shape)


@pytest.mark.parametrize("dtype, options", BLOCK_VARIANTS)
def test_block_forward_equals_functional(dtype, options):
    block = make_block(dtype, **options)
    if block.correction_bias is not None:
        block.correction_bias.copy_(torch.linspace(-0.2, 0.2, E))
    x = randn(2, T // 2, H, seed=1, dtype=dtype)
    out = block(x)
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.equal(out, functional_block(block, x))
    with torch.no_grad():
        assert torch.equal(block(x), out)


def reference_grads(block, x, up, dtype):
    """Output and gradients (x, gate.weight, w13, w2) of <block(x), up> computed by moe.route (math in fp32) and
    the per-expert reference in ``dtype`` (float64 for the truth, the block's dtype for plain torch's baseline)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (x, block.gate.weight, block.w13, block.w2)]
    h = leaves[0].reshape(-1, H)
    logits = h @ leaves[1].T
    weights, ids = route_as(block, logits.float() if dtype == torch.float64 else logits)
    out = reference.fused_moe(h, leaves[2], leaves[3], weights, ids, activation=block.activation,
                              compute_dtype=dtype)
    out.backward(up.reshape(-1, H).to(dtype))
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype, options", BLOCK_VARIANTS)
def test_block_gradients_reach_every_parameter(dtype, options):
    """Gradients of x, the router, w13 and w2 against fp64 autograd of route + the per-expert reference; fp32
    within 2e-5, fp16 no worse than 2x plain torch in fp16 (+ atol)."""
    block = make_block(dtype, **options)
    x = randn(2, T // 2, H, seed=2, dtype=dtype).requires_grad_()
    up = randn(2, T // 2, H, seed=3)
    out = block(x)
    out.backward(up.to(dtype))
    got = [x.grad, block.gate.weight.grad, block.w13.grad, block.w2.grad]
    want_out, want = reference_grads(block, x, up, torch.float64)
    assert block.gate.weight.grad.abs().max() > 0, "the router must get a gradient through the routing weights"
    if dtype == torch.float32:
        assert rel_err(out.reshape(-1, H), want_out) <= FP32_RTOL
        for name, g, w in zip(("x", "gate.weight", "w13", "w2"), got, want):
            assert g.dtype == dtype and rel_err(g, w) <= FP32_RTOL, name
        return
    _, base = reference_grads(block, x, up, dtype)
    for name, g, b, w in zip(("x", "gate.weight", "w13", "w2"), got, base, want):
        e_k, e_t = rel_err(g, w), rel_err(b, w)
        assert g.dtype == dtype and e_k <= 2 * e_t + F16_ATOL, f"{name}: kernel {e_k:.2e} vs torch {e_t:.2e}"


def test_block_optimizer_step_moves_every_parameter():
    block = make_block()
    before = {n: p.detach().clone() for n, p in block.named_parameters()}
    opt = torch.optim.SGD(block.parameters(), lr=0.1)
    block(randn(T, H, seed=4)).square().mean().backward()
    opt.step()
    for name, p in block.named_parameters():
        assert not torch.equal(p, before[name]), name


def test_block_autocast_fp16():
    """Under torch.autocast(float16) with fp32 parameters the router and experts run in fp16 and the gradients
    land on the fp32 parameters; the result is the functional call on fp16 casts."""
    block = make_block(torch.float32)
    x = randn(T, H, seed=5)
    with torch.autocast(torch.device(DEVICE).type, dtype=torch.float16):
        out = block(x)
        want = functional_block(block, x.half(), block.w13.half(), block.w2.half())
    assert out.dtype == torch.float16 and torch.equal(out, want)
    out.float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in block.parameters())


def test_block_zero_tokens():
    block = make_block()
    x = torch.zeros((0, 3, H), device=DEVICE, requires_grad=True)
    out = block(x)
    assert out.shape == (0, 3, H)
    out.sum().backward()
    assert torch.count_nonzero(block.w13.grad) == 0 and block.gate.weight.grad.shape == (E, H)


def test_state_dict_round_trip():
    block = make_block(scoring="sigmoid", correction_bias=True)
    block.correction_bias.copy_(torch.arange(E) * 0.1)
    state = block.state_dict()
    assert set(state) == {"gate.weight", "w13", "w2", "correction_bias"}
    other = make_block(seed=1, scoring="sigmoid", correction_bias=True)
    other.load_state_dict(state)
    x = randn(T, H, seed=6)
    assert torch.equal(other(x), block(x))
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), state.values()))


BLOCK_ERRORS = [
    (dict(hidden_size=0), ValueError, "hidden_size must be >= 1, got 0"),
    (dict(intermediate_size=32.0), TypeError, "intermediate_size must be an int, got float"),
    (dict(num_experts=True), TypeError, "num_experts must be an int, got bool"),
    (dict(top_k=5), ValueError, r"top_k must be <= the number of experts \(4\), got 5"),
    (dict(top_k=0), ValueError, "top_k must be >= 1, got 0"),
    (dict(activation="relu"), ValueError, r"activation must be one of \('silu', 'gelu_tanh'\), got 'relu'"),
    (dict(scoring="sparsemax"), ValueError, r"scoring must be one of \('softmax', 'sigmoid'\)"),
    (dict(num_groups=3), ValueError, r"num_groups must divide the number of experts \(4\), got 3"),
    (dict(topk_groups=2), ValueError, "topk_groups needs num_groups, got num_groups=None"),
    (dict(num_groups=4, topk_groups=1), ValueError, r"top_k must be <= topk_groups \* experts per group"),
    (dict(renormalize=1), TypeError, "renormalize must be a bool, got int"),
    (dict(correction_bias=torch.zeros(4)), TypeError, "correction_bias must be a bool, got Tensor"),
    (dict(scale="2"), TypeError, "scale must be a number, got str"),
    (dict(scale=float("-inf")), ValueError, "scale must be finite, got -inf"),
    (dict(tma="yes"), ValueError, r"tma must be one of \('auto', 'always', 'never'\)"),
    (dict(dtype=torch.float64), TypeError, "dtype must be float16 or bfloat16 or float32, got torch.float64"),
]


@pytest.mark.parametrize("kwargs, exc, match", BLOCK_ERRORS, ids=[str(e[0]) for e in BLOCK_ERRORS])
def test_block_constructor_errors(kwargs, exc, match):
    args = dict(hidden_size=H, intermediate_size=I, num_experts=E, top_k=K) | kwargs
    with pytest.raises(exc, match=match):
        moe.MoEBlock(args.pop("hidden_size"), args.pop("intermediate_size"), args.pop("num_experts"),
                     args.pop("top_k"), **args)


def test_block_forward_errors():
    block = make_block()
    with pytest.raises(ValueError, match=r"x must be \[\.\.\., 64\] \(hidden_size 64\), got shape \(16, 32\)"):
        block(randn(T, 32, seed=0))
    with pytest.raises(TypeError, match=r"x must be float32 \(the dtype of the block's parameters\), got float16"):
        block(randn(T, H, seed=0, dtype=torch.float16))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        block([1.0] * H)


# ---------------------------------------------------------------------------------------------------------------
# MoEBlock: checkpoint loaders


def hf_experts(seed=0, scale=0.3):
    """Per-expert (gate [I, H], up [I, H], down [H, I]) as the open checkpoints hold them, a router [E, H] and a
    DeepSeek-style correction bias [E], in fp32 on the CPU (checkpoints load there)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, fan_in: torch.randn(s, generator=g) * scale / fan_in ** 0.5  # noqa: E731
    gate = [rnd(I, H, fan_in=H) for _ in range(E)]
    up = [rnd(I, H, fan_in=H) for _ in range(E)]
    down = [rnd(H, I, fan_in=I) for _ in range(E)]
    bias = torch.tensor([-0.3, 0.1, 0.25, -0.05])  # favours expert group {2, 3} by 0.4: moves some tokens there
    return gate, up, down, rnd(E, H, fan_in=H / 10), bias


def hf_state_dict(layout, prefix, seed=0):
    gate, up, down, router, bias = hf_experts(seed)
    sd = {prefix + "gate.weight": router}
    names = {"mixtral": ("w1", "w3", "w2"), "qwen3": ("gate_proj", "up_proj", "down_proj"),
             "deepseek": ("gate_proj", "up_proj", "down_proj")}
    if layout == "stacked":
        sd[prefix + "experts.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up)])
        sd[prefix + "experts.down_proj"] = torch.stack(down)
    else:
        for e in range(E):
            for name, t in zip(names[layout], (gate[e], up[e], down[e])):
                sd[f"{prefix}experts.{e}.{name}.weight"] = t
    if layout == "deepseek":
        sd[prefix + "gate.e_score_correction_bias"] = bias
    sd[prefix + "shared_experts.gate_proj.weight"] = torch.zeros(I, H)  # not part of the routed block
    sd["model.norm.weight"] = torch.ones(H)
    return sd, (gate, up, down, router, bias)


# routing of each model, as its modelling code writes it
ROUTING = {
    "mixtral": dict(),
    "qwen3": dict(),
    "stacked": dict(),
    "deepseek": dict(scoring="sigmoid", num_groups=2, topk_groups=1, correction_bias=True, scale=2.5),
}


def hf_moe(x, gate, up, down, router, bias, layout, dtype=torch.float64):
    """The checkpoint's MoE layer in plain PyTorch in ``dtype`` (routing scores in at least fp32, as the models
    do): its own routing rule, then a loop over tokens and their experts with act(x @ gate.T) * (x @ up.T) @
    down.T."""
    x = x.to(dtype)
    logits = (x @ router.to(dtype).T).to(torch.promote_types(dtype, torch.float32))
    if layout == "deepseek":  # sigmoid scores, bias for selection only, best group of 2 by its top-2 sum
        s = logits.sigmoid()
        c = (s + bias).view(len(x), 2, E // 2)
        best_group = c.topk(2, dim=-1).values.sum(-1).argmax(-1)
        c = torch.where(torch.arange(2)[None, :, None] == best_group[:, None, None], c, float("-inf"))
        ids = c.view(len(x), E).topk(K, dim=-1).indices
        w = s.gather(1, ids)
        w = w / w.sum(-1, keepdim=True) * 2.5
    else:  # softmax, top-k, renormalise
        w, ids = logits.softmax(-1).topk(K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for t in range(len(x)):
        for j in range(K):
            e = int(ids[t, j])
            a = torch.nn.functional.silu(x[t] @ gate[e].to(dtype).T) * (x[t] @ up[e].to(dtype).T)
            out[t] += w[t, j].to(dtype) * (a @ down[e].to(dtype).T)
    return out


@pytest.mark.parametrize("layout", ["mixtral", "qwen3", "deepseek", "stacked"])
def test_load_hf_state_dict_matches_checkpoint_math(layout):
    prefix = "model.layers.1.mlp."
    sd, (gate, up, down, router, bias) = hf_state_dict(layout, prefix)
    block = make_block(**ROUTING[layout])
    read = block.load_hf_state_dict(sd, prefix, layout=layout)
    assert set(read) == set(sd) - {prefix + "shared_experts.gate_proj.weight", "model.norm.weight"}
    for e in range(E):  # rows 0..I-1 of w13 are the gate projection, I..2I-1 the up projection
        assert torch.equal(block.w13[e, :I], gate[e]) and torch.equal(block.w13[e, I:], up[e])
        assert torch.equal(block.w2[e], down[e])
    x = randn(T, H, seed=7)
    want = hf_moe(x, gate, up, down, router, bias, layout)
    assert rel_err(block(x), want) <= FP32_RTOL
    if layout == "deepseek":  # the correction bias changes the experts chosen here, so it must have been loaded
        assert rel_err(hf_moe(x, gate, up, down, router, torch.zeros(E), layout), want) > 100 * FP32_RTOL


def test_load_experts_lists_and_stacked_agree():
    gate, up, down, router, _ = hf_experts(seed=1)
    from_lists, from_stacked = make_block(seed=0), make_block(seed=1)
    from_lists.load_experts(gate, up, down, router=router)
    from_stacked.load_experts(torch.stack(gate), tuple(up), torch.stack(down).half(), router=router)
    for a, b in zip(from_lists.parameters(), from_stacked.parameters()):
        if a is not from_lists.w2:
            assert torch.equal(a, b)
    assert rel_err(from_stacked.w2, from_lists.w2) < 1e-3  # down_proj went through fp16, cast back on copy
    x = randn(T, H, seed=8)
    assert rel_err(from_lists(x), hf_moe(x, gate, up, down, router, None, "qwen3")) <= FP32_RTOL


def test_load_into_fp16_block():
    gate, up, down, router, _ = hf_experts(seed=2)
    block = make_block(torch.float16)
    block.load_experts(gate, up, down, router=router)
    assert block.w13.dtype == torch.float16 and torch.equal(block.w13[1, I:], up[1].half())
    x = randn(T, H, seed=9)
    want = hf_moe(x, gate, up, down, router, None, "qwen3")
    base = hf_moe(x, gate, up, down, router, None, "qwen3", dtype=torch.float16)
    assert rel_err(block(x.half()), want) <= 2 * rel_err(base, want) + 2e-3


def _gate_up_down(**change):
    gate, up, down, router, _ = hf_experts()
    parts = dict(gate_proj=gate, up_proj=up, down_proj=down, router=router)
    return parts | change


LOAD_ERRORS = [
    (dict(gate_proj=[torch.zeros(I, H)] * 3), ValueError, r"gate_proj must hold 4 tensors \(num_experts\), got 3"),
    (dict(up_proj=[torch.zeros(I, H)] * 3 + [torch.zeros(H, I)]), ValueError,
     r"up_proj\[3\] must have shape \[I, H\] = \(32, 64\), got \(64, 32\)"),
    (dict(down_proj=torch.zeros(E, I, H)), ValueError, r"down_proj must have shape \[E, H, I\] = \(4, 64, 32\)"),
    (dict(gate_proj={0: torch.zeros(I, H)}), TypeError, r"gate_proj must be a tensor \[E, I, H\] or a list of E"),
    (dict(gate_proj=[torch.zeros(I, H, dtype=torch.int64)] * E), TypeError,
     r"gate_proj\[0\] must be a floating-point tensor, got int64"),
    (dict(down_proj=[torch.zeros(H, I)] * 3 + [None]), TypeError,
     r"down_proj\[3\] must be a torch.Tensor, got NoneType"),
    (dict(router=torch.zeros(H, E)), ValueError, r"router must have shape \[E, H\] = \(4, 64\), got \(64, 4\)"),
]


@pytest.mark.parametrize("change, exc, match", LOAD_ERRORS, ids=[e[2][:40] for e in LOAD_ERRORS])
def test_load_experts_errors_copy_nothing(change, exc, match):
    block = make_block()
    before = [p.detach().clone() for p in block.parameters()]
    parts = _gate_up_down(**change)
    with pytest.raises(exc, match=match):
        block.load_experts(parts.pop("gate_proj"), parts.pop("up_proj"), parts.pop("down_proj"), **parts)
    assert all(torch.equal(p, b) for p, b in zip(block.parameters(), before)), "nothing is copied on an error"


def test_load_hf_state_dict_errors():
    prefix = "model.layers.0.block_sparse_moe."
    sd, _ = hf_state_dict("mixtral", prefix)
    block = make_block()
    with pytest.raises(ValueError, match=r"layout must be one of \('mixtral', 'qwen3', 'deepseek', 'stacked'\)"):
        block.load_hf_state_dict(sd, prefix, layout="llama")
    with pytest.raises(ValueError, match=r"state_dict must hold the 13 keys of layout 'qwen3' under prefix "
                                         r"'model.layers.0.block_sparse_moe.', got 12 missing: "
                                         r"model.layers.0.block_sparse_moe.experts.0.gate_proj.weight, "):
        block.load_hf_state_dict(sd, prefix, layout="qwen3")
    with pytest.raises(ValueError, match=r"got 13 missing: model.layers.0.mlp.gate.weight, .*, \.\.\.$"):
        block.load_hf_state_dict(sd, "model.layers.0.mlp.", layout="mixtral")
    with pytest.raises(TypeError, match="prefix must be a str, got int"):
        block.load_hf_state_dict(sd, 0, layout="mixtral")
    bad = dict(sd) | {prefix + "experts.2.w2.weight": torch.zeros(I, H)}
    with pytest.raises(ValueError, match=r"model.layers.0.block_sparse_moe.experts.2.w2.weight must have shape "
                                         r"\[H, I\] = \(64, 32\), got \(32, 64\)"):
        block.load_hf_state_dict(bad, prefix, layout="mixtral")
    stacked, _ = hf_state_dict("stacked", "")
    stacked["experts.gate_up_proj"] = stacked["experts.gate_up_proj"][:, :I]
    with pytest.raises(ValueError, match=r"experts.gate_up_proj must have shape \[E, 2I, H\] = \(4, 64, 64\)"):
        block.load_hf_state_dict(stacked, layout="stacked")
    deepseek, _ = hf_state_dict("deepseek", "")
    with pytest.raises(ValueError, match="state_dict holds gate.e_score_correction_bias, but this block has no "
                                         "correction bias: build it with correction_bias=True"):
        block.load_hf_state_dict(deepseek, layout="deepseek")
    with pytest.raises(ValueError, match="missing: gate.e_score_correction_bias"):
        make_block(**ROUTING["deepseek"]).load_hf_state_dict(hf_state_dict("qwen3", "")[0], layout="qwen3")
