"""The 3-pass path of lce.linear_logprobs_entropy (hopperkern/lce/rl.py) against the fp64 reference and against the
4-pass path: numerics on both memory paths, the path choice, autograd uses (gradient accumulation, checkpointing,
a second backward, torch.compile) and its custom ops. Shapes and helpers are test_lce.py's (interpreter-sized)."""

import contextlib
import re

import pytest
import torch
import torch.utils.checkpoint

from test_lce import _no_tma_env  # noqa: F401  (autouse: a HOPPERKERN_TMA in the environment would override modes)
from test_lce import (
    _BF16_OK,
    CONFIDENT,
    CONFIDENT_LOSS_ATOL,
    BWD,
    FWD,
    LAYOUTS,
    MODES,
    RL,
    SHAPE,
    SMALL,
    _op_args,
    assert_close,
    call,
    check_fp32,
    check_grads,
    check_no_worse,
    expect_path,
    make_inputs,
    rel_err,
    run,
    torch_lowp_logprobs_entropy,
    upstream,
)
from hopperkern import lce, tma
from hopperkern.lce import launch, rl, sft
from hopperkern.lce import reference as ref
from hopperkern.lce.ops import lce_rl_backward_functional_op, lce_rl_backward_op, lce_rl_forward_op
from hopperkern.tuning import KernelConfig

THREE, FOUR = dict(grad_path="3pass"), dict(grad_path="4pass")
SAME_ORDER_RTOL = 2e-6  # 3-pass vs 4-pass in fp32: the same math, summed in another order
GRADS_ON = ["both", "logprobs", "entropy"]


def _ups(grads_on, n=SHAPE[0]):
    return [upstream((n,), seed=2) if grads_on != "entropy" else None,
            upstream((n,), seed=3) if grads_on != "logprobs" else None]


def _lpe(mode, **extra):
    return call(lce.linear_logprobs_entropy, temperature=0.7, tma=mode, **extra)


REF = call(ref.linear_logprobs_entropy, temperature=0.7)
BASE = call(torch_lowp_logprobs_entropy, temperature=0.7)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grads_on", GRADS_ON)
def test_3pass_fp32_matches_reference_and_4pass(grads_on, mode):
    """fp32 log-probs, entropies and d_hidden, d_weight of the 3-pass path match fp64 to ~1e-5 and the 4-pass
    path's to fp32 summation order, under random per-token upstream grads (ignored tokens: no log-prob gradient,
    the entropy one all the same)."""
    inp, ups = make_inputs(SHAPE, ignore=0.3), _ups(grads_on)
    (lp, ent), grads = check_fp32(mode, _lpe(mode, **THREE), REF, inp, ups, path=dict(rl=True))
    with expect_path(mode, sft=False):
        (lp4, ent4), grads4 = run(_lpe(mode, **FOUR), inp, ups)
    assert_close(lp, lp4, SAME_ORDER_RTOL, "logprob")
    assert_close(ent, ent4, SAME_ORDER_RTOL, "entropy")
    check_grads(grads[:2], grads4[:2], SAME_ORDER_RTOL)
    ignored_rows = grads[0][~inp.kept].abs().sum(-1)
    assert (ignored_rows > 0).all() if grads_on != "logprobs" else not ignored_rows.any()


@pytest.mark.parametrize("mode", MODES)
def test_3pass_exponentials_with_vocab_splits(mode, monkeypatch):
    """Under a forced config (block_n=16: 7 vocab tiles) and 3 vocab splits (3, 3, 1 tiles) every split restarts
    its running max and each tile's max lands at mt[n, tile]: the backward, which reads the tile width back from
    mt's shape, gives the reference's grads."""
    cfg = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    asked = []
    monkeypatch.setattr(rl, "pick_config", lambda *args: cfg)
    monkeypatch.setattr(launch, "forward_plan", lambda *args: asked.append(args) or (3, 3))
    check_fp32(mode, _lpe(mode, **THREE), REF, make_inputs(SHAPE, ignore=0.3), _ups("both"), path=dict(rl=True))
    assert asked, "the forward must take its splits from forward_plan"


@pytest.mark.parametrize("mode", MODES)
def test_3pass_backward_tiles_narrower_than_forward_tiles(mode, monkeypatch):
    """A forward at 64-wide vocab tiles (3 row blocks x 2 tiles at V = 100) under the backward's 32-wide tiles: two
    backward tiles read each tile's max, and the grads match the reference."""
    cfg = KernelConfig(block_m=16, block_n=64, block_k=32, group_m=2, num_warps=4, num_stages=1)
    monkeypatch.setattr(rl, "pick_config", lambda *args: cfg)
    check_fp32(mode, _lpe(mode, **THREE), REF, make_inputs(SHAPE, ignore=0.3), _ups("both"), path=dict(rl=True))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grads_on", ["both", "logprobs"])
def test_3pass_fp32_confident(grads_on, mode):
    """Confident predictions (p_label in [0.99, 0.9999]) in fp32: the label's gradient g (1 - p) comes from the
    forward's fp32 log-prob, not from e. Both paths then carry the log-prob's ~1e-6 absolute error (two fp32 sums of
    size |z|), ~1e-4 of d_hidden where the label column and the rest nearly cancel; the 3-pass path's grads are as
    close to fp64 as the 4-pass path's (within 25 %), its outputs those of the same forward."""
    _confident_vs_4pass(mode, _lpe(mode, **THREE), expect_path(mode, rl=True), grads_on)


def _confident_vs_4pass(mode, kernel_fn, path_ctx, grads_on="both"):
    """On a confident fp32 batch (loss-masked upstream grads), ``kernel_fn`` (run inside ``path_ctx``) gives the
    4-pass path's outputs to fp32 order and grads as close to fp64 as the 4-pass path's (within 25 %)."""
    inp = make_inputs(SHAPE, ignore=0.2, confident=CONFIDENT, temperature=0.7)
    mask = inp.kept.float()
    ups = [u * mask if u is not None else None for u in _ups(grads_on)]
    with path_ctx:
        outs, grads = run(kernel_fn, inp, ups)
    outs4, grads4 = run(_lpe(mode, **FOUR), inp, ups)
    _, want = run(REF, inp, ups, dtype=torch.float64)
    for o, o4 in zip(outs, outs4):
        assert_close(o, o4, SAME_ORDER_RTOL, "output")
    for name, g, g4, w in zip(("d_hidden", "d_weight"), grads, grads4, want):
        e3, e4 = rel_err(g, w), rel_err(g4, w)
        assert e4 < 1e-3, f"{name}: the 4-pass path's error {e4:.2e} is no baseline"
        assert e3 <= 1.25 * e4 + 1e-7, f"{name}: error {e3:.2e} vs the 4-pass path's {e4:.2e}"


@pytest.mark.skipif(not _BF16_OK, reason="bf16 tl.dot is wrong in the interpreter without conftest's patch")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("confident", [False, True], ids=["random", "confident"])
def test_3pass_bf16_no_worse_than_torch(confident, mode):
    """bf16 (conftest's interpreter patch): log-probs, entropies and grads within 2x plain PyTorch's bf16 error of
    fp64, with e's extra rounding in p and z; also for confident predictions (loss-masked upstream grads)."""
    inp = make_inputs(SHAPE, torch.bfloat16, ignore=0.2, confident=CONFIDENT if confident else None,
                      temperature=0.7)
    mask = inp.kept.float()
    ups = [u * mask for u in _ups("both")]
    check_no_worse(mode, _lpe(mode, **THREE), REF, BASE, inp, ups, ("logprob", "entropy"),
                   out_atol=CONFIDENT_LOSS_ATOL if confident else 1e-5, path=dict(rl=True))


@pytest.mark.parametrize("mode", ["auto", "never"])
@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay.name != "odd pitch"], ids=lambda lay: lay.name)
@pytest.mark.parametrize("mixed", [False, True], ids=["3pass", "mixed"])
def test_3pass_noncontiguous_hidden(layout, mode, mixed, monkeypatch):
    """A strided hidden view (transposed: pointer loads; an aligned column slice: TMA in place) gives the
    reference's outputs and grads; the d_weight GEMMs read the view with its strides (on the mixed path both
    token sets' row views of it)."""
    inp = make_inputs(SMALL, ignore=0.2)
    inp.hidden = layout.make(inp.hidden)
    if mixed:
        _stored(monkeypatch, 7)
    check_fp32(mode, _lpe(mode, **({} if mixed else THREE)), REF, inp, _ups("both", SMALL[0]), view=layout.view,
               path=dict(hidden=layout.tma_reason is None, rl=True, backward=not mixed))


# ---------------------------------------------------------------------------------------------------------------
# Autograd uses


def _leaves(inp):
    return [inp.hidden.detach().clone().requires_grad_(), inp.weight.detach().clone().requires_grad_()]


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation(mode):
    """Two micro-batches accumulate into .grad as one batch does, on both paths, and the paths agree."""
    inp = make_inputs(SHAPE, ignore=0.3)
    g_lp, g_ent = _ups("both")
    got = {}
    for path in ("3pass", "4pass"):
        h, w = _leaves(inp)
        for rows in (slice(0, 20), slice(20, None)):
            lp, ent = lce.linear_logprobs_entropy(h[rows], w, inp.labels[rows], tma=mode, grad_path=path)
            ((lp * g_lp[rows]).sum() + (ent * g_ent[rows]).sum()).backward()
        got[path] = [h.grad.clone(), w.grad.clone()]
        h2, w2 = _leaves(inp)
        lp, ent = lce.linear_logprobs_entropy(h2, w2, inp.labels, tma=mode, grad_path=path)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        check_grads(got[path], [h2.grad, w2.grad], SAME_ORDER_RTOL)
    check_grads(got["3pass"], got["4pass"], SAME_ORDER_RTOL)


def test_second_backward_raises():
    """The backward overwrites the kept exponentials: a second backward through a retained graph fails autograd's
    version check instead of reading d(logits) as exponentials; the 4-pass path allows it."""
    inp = make_inputs(SMALL)
    h, w = _leaves(inp)
    lp, _ = lce.linear_logprobs_entropy(h, w, inp.labels, tma="never", **THREE)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()
    lp, _ = lce.linear_logprobs_entropy(h, w, inp.labels, tma="never", **FOUR)
    lp.sum().backward(retain_graph=True)
    lp.sum().backward()


def test_eager_3pass_calls_skip_the_custom_ops(monkeypatch):
    """An eager differentiable call runs the 3-pass forward and backward through their autograd function, not
    the custom ops (and their per-call dispatch work): with both ops made to raise, the eager call still
    computes the 4-pass path's gradients."""
    from hopperkern.lce import ops

    inp = make_inputs(SMALL)

    def boom(*args, **kwargs):
        raise AssertionError("custom op called in eager mode")

    h, w = _leaves(inp)
    expected = torch.autograd.grad(lce.linear_logprobs_entropy(h, w, inp.labels, tma="never", **FOUR)[0].sum(), (h, w))
    monkeypatch.setattr(ops, "lce_rl_forward_op", boom)
    monkeypatch.setattr(ops, "lce_rl_backward_op", boom)
    monkeypatch.setattr(lce.api, "lce_rl_forward_op", boom)
    lp, _ = lce.linear_logprobs_entropy(h, w, inp.labels, tma="never", **THREE)
    assert type(lp.grad_fn).__name__ != "GeneratedBackwardFor_hopperkern_lce_rl_forward_default"
    got = torch.autograd.grad(lp.sum(), (h, w))
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=SAME_ORDER_RTOL * 10, atol=1e-7)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(use_reentrant):
    """Under torch.utils.checkpoint (the forward re-run in the backward, keeping its exponentials anew) the grads
    equal those of the same call without checkpointing, bit for bit."""
    inp = make_inputs(SHAPE, ignore=0.3)
    g_lp, g_ent = _ups("both")
    want = {}
    for ckpt in (False, True):
        h, w = _leaves(inp)

        def f(h, w):
            return lce.linear_logprobs_entropy(torch.tanh(h), w, inp.labels, tma="never", **THREE)

        lp, ent = torch.utils.checkpoint.checkpoint(f, h, w, use_reentrant=use_reentrant) if ckpt else f(h, w)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        want[ckpt] = [h.grad, w.grad]
    for got, exp in zip(want[True], want[False]):
        assert torch.equal(got, exp)


# ---------------------------------------------------------------------------------------------------------------
# Edge cases


def test_3pass_zero_tokens():
    """No tokens: empty outputs and zero grads of the right shapes, without a launch."""
    inp = make_inputs((0, SMALL[1], SMALL[2]))
    before = tma.last_decision(FWD)
    (lp, ent), grads = run(_lpe("always", **THREE), inp, [upstream((0,)), upstream((0,))])
    assert tma.last_decision(FWD) is before
    assert lp.shape == ent.shape == (0,)
    for g, t in zip(grads, (inp.hidden, inp.weight)):
        assert g.shape == t.shape and not g.any()


def test_3pass_out_of_range_label_gives_nan():
    """Unchecked (check_labels=False), a label >= V makes its token's log-prob, entropy and d_hidden row NaN;
    the other tokens' rows stay finite."""
    inp = make_inputs(SMALL)
    inp.labels[3] = SMALL[1] + 5
    (lp, ent), (d_h, d_w, _) = run(_lpe("never", check_labels=False, **THREE), inp, _ups("both", SMALL[0]))
    assert lp[3].isnan() and ent[3].isnan() and d_h[3].isnan().all()
    rest = torch.arange(SMALL[0]) != 3
    assert lp[rest].isfinite().all() and d_h[rest].isfinite().all()
    assert d_w.isnan().any()  # the bad token's row reaches every d_weight column


def test_3pass_fp16_is_refused_and_auto_takes_4pass():
    """fp16 inputs: "3pass" raises TypeError before any launch; "auto" takes the 4-pass path."""
    inp = make_inputs(SMALL, torch.float16)
    h, w = _leaves(inp)
    before = tma.last_decision(FWD)
    with pytest.raises(TypeError, match=re.escape("grad_path='3pass' needs bfloat16 or float32 inputs")):
        lce.linear_logprobs_entropy(h, w, inp.labels, **THREE)
    assert tma.last_decision(FWD) is before
    assert not rl.use_3pass("auto", 8192, 128256, 4096, torch.float16)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(grad_path="2pass"), ValueError, "grad_path must be one of ('auto', '3pass', '4pass'), got '2pass'"),
    (dict(grad_path=3), ValueError, "grad_path must be one of ('auto', '3pass', '4pass'), got 3"),
])
def test_grad_path_errors(kwargs, error, match):
    """A bad grad_path raises before any launch, with or without grad (also once a no-grad call is cached)."""
    inp = make_inputs(SMALL)
    lce.linear_logprobs_entropy(inp.hidden, inp.weight, inp.labels)  # a valid no-grad call first
    before = tma.last_decision(FWD)
    for grad in (False, True):
        h = inp.hidden.clone().requires_grad_(grad)
        with pytest.raises(error, match=re.escape(match)):
            lce.linear_logprobs_entropy(h, inp.weight, inp.labels, **kwargs)
    with pytest.raises(error, match=re.escape(match)):
        lce.LinearLogprobsEntropy(**kwargs)
    assert tma.last_decision(FWD) is before


def test_module_passes_grad_path():
    """LinearLogprobsEntropy(grad_path=...) takes that path and says so in its repr."""
    inp = make_inputs(SMALL)
    mod = lce.LinearLogprobsEntropy(temperature=0.7, tma="never", **THREE)
    assert "grad_path='3pass'" in repr(mod)
    with expect_path("never", rl=True):
        (lp, _), grads = run(lambda h, w, b, lab: mod(h, w, lab), inp, _ups("both", SMALL[0]))
    _, want = run(REF, inp, _ups("both", SMALL[0]), dtype=torch.float64)
    check_grads(grads[:2], want[:2], 1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Which path runs


def test_auto_path_follows_the_memory_rule(monkeypatch):
    """"auto" takes the 3-pass path at interpreter sizes once the token and hidden-size thresholds are lowered,
    and the 4-pass path below either, under no_grad the plain forward."""
    inp = make_inputs(SMALL)
    for tokens, hidden, budget, path in ((1, 1, None, dict(rl=True)), (SMALL[0] + 1, 1, None, dict(sft=False)),
                                         (1, SMALL[2] + 1, None, dict(sft=False)), (1, 1, 0, dict(sft=False))):
        monkeypatch.setattr(sft, "MIN_TOKENS_3PASS", tokens)
        monkeypatch.setattr(rl, "MIN_HIDDEN_3PASS", hidden)
        monkeypatch.setattr(rl, "budget_bytes", sft.budget_bytes if budget is None else lambda V, H: budget)
        with expect_path("never", **path):
            run(_lpe("never"), inp, _ups("both", SMALL[0]))
    with expect_path("never", sft=False):  # fp16 under "auto": the 4-pass path at any size
        run(_lpe("never"), make_inputs(SMALL, torch.float16), _ups("both", SMALL[0]))
    with torch.no_grad(), expect_path("never", backward=False):
        lce.linear_logprobs_entropy(inp.hidden, inp.weight, inp.labels, tma="never", **THREE)


@pytest.mark.parametrize("N, H, V, dtype, three", [
    (8192, 4096, 128256, torch.bfloat16, True),  # 2.0 GiB of exponentials within 2.0 GiB + 512 MiB
    (32768, 4096, 128256, torch.bfloat16, False),  # 7.8 GiB: over the budget
    (1937, 3584, 152064, torch.bfloat16, True),
    (1024, 3584, 152064, torch.bfloat16, False),  # below MIN_TOKENS_3PASS
    (2169, 896, 151936, torch.bfloat16, True),  # MIN_HIDDEN_3PASS: 659 MB of exponentials within 1.08 GB
    (4096, 896, 151936, torch.bfloat16, False),  # 1.25 GB: over the budget (and no mixed path below 2048)
    (2169, 640, 151936, torch.bfloat16, False),  # below MIN_HIDDEN_3PASS
    (8192, 4096, 128256, torch.float32, False),  # 3.9 GiB of fp32 exponentials: over the budget
    (2048, 4096, 128256, torch.float32, True),
])
def test_memory_rule_on_real_shapes(N, H, V, dtype, three):
    """The rule on real shapes: the token and hidden-size thresholds, then rl.extra_bytes against
    sft.budget_bytes."""
    elem = torch.finfo(dtype).bits // 8
    assert rl.use_3pass("auto", N, V, H, dtype) is three
    assert three is (N >= sft.MIN_TOKENS_3PASS and H >= rl.MIN_HIDDEN_3PASS
                     and rl.extra_bytes(N, V, H, elem) <= sft.budget_bytes(V, H))
    if not three and H < rl.MIN_HIDDEN_MIXED:
        assert rl.stored_rows("auto", N, V, H, dtype) == 0  # no mixed path there either
    # the kept exponentials, the larger of the per-tile maxima and the backward's fp32 scratch, and the maxima
    # once more (they stay beside the backward's fp32 d_hidden)
    tiles = N * -(-V // 64) * 4
    backward = N * H * 4 + (sft._slice_rows(V, H) * H * 4 if elem == 4 else 0)
    assert rl.extra_bytes(N, V, H, elem) == N * sft.padded_cols(V) * elem + max(tiles, backward) + tiles
    assert rl.use_3pass("3pass", N, V, H, dtype) and not rl.use_3pass("4pass", N, V, H, dtype)


def test_forward_config():
    """From MIN_TOKENS_NARROW_TILES tokens a 128 x 256 forward runs as 128 x 128 x 64, 8 warps, 4 stages (group and
    flatten kept); below it, and smaller tiles at any size, as tuned."""
    wide = KernelConfig(block_m=128, block_n=256, block_k=64, group_m=8, num_warps=8, num_stages=3, flatten=True)
    narrow = rl.forward_config(wide, rl.MIN_TOKENS_NARROW_TILES)
    assert (narrow.block_m, narrow.block_n, narrow.block_k, narrow.num_warps, narrow.num_stages) == (128, 128, 64, 8, 4)
    assert (narrow.group_m, narrow.flatten) == (8, True)
    assert rl.forward_config(wide, rl.MIN_TOKENS_NARROW_TILES - 1) == wide
    small = KernelConfig(block_m=64, block_n=64, block_k=32, group_m=8, num_warps=4, num_stages=3)
    assert rl.forward_config(small, 10**6) == small


def test_forward_block_v():
    """The tile width read back from the per-tile maxima's column count is the config's, for every power-of-two
    width at several V; a count no width gives raises."""
    for V in (1, 15, 100, 128256, 151936):
        for width in (16, 32, 64, 128, 256):
            got = rl.forward_block_v(V, -(-V // width))
            assert -(-V // got) == -(-V // width)
            if -(-V // width) > 1:
                assert got == width
    with pytest.raises(ValueError, match="no power-of-two vocab tile"):
        rl.forward_block_v(100, 5)
    with pytest.raises(ValueError, match="at least one column"):
        rl.forward_block_v(100, 0)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile and the custom ops


@pytest.mark.parametrize("path", ["3pass", "mixed"])
def test_3pass_compiled_backward_keeps_its_inputs(path, monkeypatch):
    """torch.compile(fullgraph=True) with Inductor traces the 3-pass path (and the mixed path, whose forward op's
    ``stored`` argument sizes its fake outputs) without graph breaks. With donated buffers off (what torch's own
    retain_graph error advises) the traced backward writes d(logits) to a buffer of its own: a second backward
    through the retained graph equals the first, and both equal eager."""
    torch._dynamo.reset()
    kw = THREE
    if path == "mixed":
        _stored(monkeypatch, 7)
        kw = {}

    def step(x, w, labels):
        return lce.linear_logprobs_entropy(torch.tanh(x) * 3.0, w, labels, temperature=0.7, tma="never", **kw)

    inp = make_inputs(SMALL, ignore=0.2)
    h, w = _leaves(inp)
    g_lp, g_ent = _ups("both", SMALL[0])
    lp, ent = step(h, w, inp.labels)
    want = torch.autograd.grad((lp, ent), (h, w), (g_lp, g_ent))
    ctx = expect_mixed("never") if path == "mixed" else expect_path("never", rl=True)
    try:
        with torch._functorch.config.patch(donated_buffer=False), ctx:
            lp, ent = torch.compile(step, fullgraph=True, backend="inductor")(h, w, inp.labels)
            first = torch.autograd.grad((lp, ent), (h, w), (g_lp, g_ent), retain_graph=True)
            second = torch.autograd.grad((lp, ent), (h, w), (g_lp, g_ent))
    finally:
        torch._dynamo.reset()
    check_grads(first, want, 1e-6)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_rl_custom_ops_opcheck():
    """torch.library.opcheck: schema, autograd registration and fake kernels of both ops agree with the real
    ones (the backward's in-place write of e declared)."""
    inp = make_inputs((5, 20, 16))
    opts = dict(ignore_index=-100, temperature=0.7, tma="never", check=True, stored=-1)
    fwd = _op_args("lce_rl_forward", hidden=inp.hidden.clone().requires_grad_(),
                   weight=inp.weight.clone().requires_grad_(), labels=inp.labels, **opts)
    torch.library.opcheck(lce_rl_forward_op, fwd, test_utils=("test_schema", "test_autograd_registration",
                                                              "test_faketensor"))
    _, lp, ent, lse, e, mt = (t.detach() for t in lce_rl_forward_op(*fwd))
    g = upstream((5,))
    bwd = _op_args("lce_rl_backward", hidden=inp.hidden, weight=inp.weight, labels=inp.labels, e=e, mt=mt, lse=lse,
                   entropy=ent, logprob=lp, g_loss=None, g_logprob=g, g_entropy=g, g_lse=None, ignore_index=-100,
                   temperature=0.7, tma="never", need_hidden_grad=True, need_weight_grad=True)
    torch.library.opcheck(lce_rl_backward_op, bwd, test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(lce_rl_backward_functional_op, bwd, test_utils=("test_schema", "test_faketensor"))


# ---------------------------------------------------------------------------------------------------------------
# The mixed path: the first S tokens keep their exponentials, the others recompute their logits


@contextlib.contextmanager
def expect_mixed(mode):
    """The block ran the mixed path on memory path ``mode``: the forward, the 3-pass d(logits) pass over the kept
    rows and the 4-pass backward over the others were each launched, with ``mode``'s decisions."""
    ops = (FWD, RL, BWD)
    before = {op: tma.decision_count(op) for op in ops}
    yield
    for op in ops:
        assert tma.decision_count(op) > before[op], f"{op} was not launched"
        assert tma.last_decision(op).mode == mode, op
    assert dict(tma.last_decision(RL).use) == {"dlogits": mode == "always"}
    assert all(v == (mode != "never") for v in tma.last_decision(BWD).use.values())


def _stored(monkeypatch, S):
    """Make "auto" keep the exponentials of the first S tokens (the budget rule itself: test_stored_rows_rule)."""
    monkeypatch.setattr(rl, "stored_rows", lambda grad_path, N, V, H, dtype: S)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grads_on,S", [("both", 1), ("logprobs", 16), ("entropy", 1), ("both", SHAPE[0] - 1)],
                         ids=["both-one-row", "logprobs-one-block", "entropy-one-row", "both-all-but-one"])
def test_mixed_fp32_matches_reference_and_4pass(grads_on, S, mode, monkeypatch):
    """fp32: with the first S tokens on the 3-pass path and the rest on the 4-pass path, log-probs, entropies,
    d_hidden and d_weight match fp64 to ~1e-5 and the 4-pass path's to fp32 summation order (d_weight: one fp32
    sum over both token sets per entry); a single stored row, a row-block boundary and all but one row (where the
    split falls does not depend on which upstream gradients are given: each split meets one or two of them)."""
    inp, ups = make_inputs(SHAPE, ignore=0.3), _ups(grads_on)
    _stored(monkeypatch, S)
    with expect_mixed(mode):
        (lp, ent), grads = check_fp32(mode, _lpe(mode), REF, inp, ups, path=dict(rl=True, backward=False))
    (lp4, ent4), grads4 = run(_lpe(mode, **FOUR), inp, ups)
    assert_close(lp, lp4, SAME_ORDER_RTOL, "logprob")
    assert_close(ent, ent4, SAME_ORDER_RTOL, "entropy")
    check_grads(grads[:2], grads4[:2], SAME_ORDER_RTOL)


@pytest.mark.parametrize("mode", MODES)
def test_mixed_fp32_confident(mode, monkeypatch):
    """Confident predictions on both parts of the mixed path: as close to fp64 as the 4-pass path (within 25 %)."""
    _stored(monkeypatch, 16)
    _confident_vs_4pass(mode, _lpe(mode), expect_mixed(mode))


@pytest.mark.skipif(not _BF16_OK, reason="bf16 tl.dot is wrong in the interpreter without conftest's patch")
@pytest.mark.parametrize("mode", MODES)
def test_mixed_bf16_no_worse_than_torch(mode, monkeypatch):
    """bf16 (conftest's interpreter patch), confident predictions: within 2x plain PyTorch's bf16 error of fp64."""
    inp = make_inputs(SHAPE, torch.bfloat16, ignore=0.2, confident=CONFIDENT, temperature=0.7)
    ups = [u * inp.kept.float() for u in _ups("both")]
    _stored(monkeypatch, 16)
    with expect_mixed(mode):
        check_no_worse(mode, _lpe(mode), REF, BASE, inp, ups, ("logprob", "entropy"), out_atol=CONFIDENT_LOSS_ATOL,
                       path=dict(rl=True, backward=False))


@pytest.mark.parametrize("need", ["hidden", "weight"])
def test_mixed_one_gradient(need, monkeypatch):
    """Only d_hidden or only d_weight wanted (a frozen head, frozen activations): the mixed path computes that one
    as the 4-pass path does."""
    inp = make_inputs(SMALL, ignore=0.2)
    ups = _ups("both", SMALL[0])
    requires = (need == "hidden", need == "weight", False)
    _stored(monkeypatch, 7)
    _, grads = run(_lpe("never"), inp, ups, requires=requires)
    _, grads4 = run(_lpe("never", **FOUR), inp, ups, requires=requires)
    for g, g4, r in zip(grads[:2], grads4[:2], requires):
        assert (g is None) is (not r)
        if r:
            assert_close(g, g4, SAME_ORDER_RTOL)


def test_mixed_accumulation_and_second_backward(monkeypatch):
    """Two mixed micro-batches accumulate into .grad as one 4-pass batch does; the backward consumes what its
    forward kept: a second backward through a retained graph raises autograd's in-place error."""
    inp = make_inputs(SHAPE, ignore=0.3)
    g_lp, g_ent = _ups("both")
    _stored(monkeypatch, 5)
    h, w = _leaves(inp)
    for rows in (slice(0, 20), slice(20, None)):
        lp, ent = lce.linear_logprobs_entropy(h[rows], w, inp.labels[rows], tma="never")
        ((lp * g_lp[rows]).sum() + (ent * g_ent[rows]).sum()).backward()
    h4, w4 = _leaves(inp)
    lp, ent = lce.linear_logprobs_entropy(h4, w4, inp.labels, tma="never", **FOUR)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    check_grads([h.grad, w.grad], [h4.grad, w4.grad], SAME_ORDER_RTOL)
    lp, _ = lce.linear_logprobs_entropy(h, w, inp.labels, tma="never")
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        lp.sum().backward()


def test_mixed_forward_op_opcheck():
    """opcheck of the forward op keeping 2 of 5 tokens' exponentials: the fake outputs' shapes ([2, ...] e and mt)
    agree with the real ones."""
    inp = make_inputs((5, 20, 16))
    fwd = _op_args("lce_rl_forward", hidden=inp.hidden.clone().requires_grad_(),
                   weight=inp.weight.clone().requires_grad_(), labels=inp.labels, ignore_index=-100, temperature=0.7,
                   tma="never", check=True, stored=2)
    torch.library.opcheck(lce_rl_forward_op, fwd, test_utils=("test_schema", "test_autograd_registration",
                                                              "test_faketensor"))
    out = lce_rl_forward_op(*fwd)
    assert out[4].shape[0] == out[5].shape[0] == 2 and out[1].shape == (5,)


@pytest.mark.parametrize("N, H, V", [(32768, 4096, 128256), (16384, 3584, 152064), (8192, 2304, 256000),
                                     (65536, 4096, 128256)])
def test_stored_rows_rule(N, H, V):
    """Where the whole batch's exponentials exceed the budget, "auto" keeps as many leading row blocks of 128 as fit
    it beside the 4-pass part's memory (one block more would not), at least MIN_STORED_ROWS and fewer than N;
    "3pass" keeps all, "4pass", fp16 and sizes below the thresholds none."""
    bf16 = torch.bfloat16
    S = rl.stored_rows("auto", N, V, H, bf16)
    assert not rl.use_3pass("auto", N, V, H, bf16)
    assert S % rl.MIXED_ROW_STEP == 0 and rl.MIN_STORED_ROWS <= S < N
    budget = sft.budget_bytes(V, H)
    assert rl.mixed_extra_bytes(N, S, V, H, 2) <= budget < rl.mixed_extra_bytes(N, S + rl.MIXED_ROW_STEP, V, H, 2)
    assert rl.stored_rows("3pass", N, V, H, bf16) == N
    assert rl.stored_rows("4pass", N, V, H, bf16) == 0
    assert rl.stored_rows("auto", N, V, H, torch.float16) == 0
    assert rl.stored_rows("auto", N, V, rl.MIN_HIDDEN_MIXED - 1, bf16) == 0
    assert rl.stored_rows("auto", 8192, 128256, 4096, bf16) == 8192  # the whole batch fits: the 3-pass path


@pytest.mark.parametrize("mode", MODES)
def test_mixed_dweight_sum_in_pieces(mode, monkeypatch):
    """With the fp32 d_weight sum capped at 5 rows (sft.DW_SLICE_BUDGET, pieces of 4 columns: DW_ROWS_ALIGN) each
    vocab slice's two GEMMs run piece by piece: d_hidden and d_weight as close to fp64 as the 4-pass path's. 16-bit inputs take that fp32 sum (fp32
    d_weight is its own); fp16 here only because the interpreter's bf16 dot is wrong (stored_rows itself never
    keeps fp16 exponentials)."""
    inp = make_inputs(SHAPE, ignore=0.3)
    ups = _ups("both")
    monkeypatch.setattr(sft, "DW_SLICE_BUDGET", 4 * SHAPE[2] * 5)
    monkeypatch.setattr(launch, "DW_ROWS_ALIGN", 4)  # pieces of 4 columns
    monkeypatch.setattr(launch, "DLOGITS_BUDGET", SHAPE[0] * 2 * 4 * 48)  # slices of 48 columns: 3 of V = 100
    _stored(monkeypatch, 16)
    with expect_mixed(mode):
        _, grads = run(_lpe(mode), inp, ups, dtype=torch.float16)
    _, grads4 = run(_lpe(mode, **FOUR), inp, ups, dtype=torch.float16)
    _, want = run(REF, inp, ups, dtype=torch.float64)
    for name, g, g4, w in zip(("d_hidden", "d_weight"), grads, grads4, want):
        assert rel_err(g, w) <= 1.25 * rel_err(g4, w) + 1e-6, name


def test_dweight_pieces_are_aligned():
    """The mixed path's fp32 d_weight pieces are whole multiples of DW_ROWS_ALIGN (128) columns within
    sft.DW_SLICE_BUDGET, so every piece of a d(logits) slice starts 256-byte aligned for cuBLAS."""
    for H in (896, 2304, 3584, 4096, 7168, 10**6):
        rows = launch._dw_rows(H)
        assert rows % launch.DW_ROWS_ALIGN == 0 and rows >= launch.DW_ROWS_ALIGN
        assert rows * H * 4 <= sft.DW_SLICE_BUDGET or rows == launch.DW_ROWS_ALIGN
