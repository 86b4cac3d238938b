"""The 3-pass SFT path of lce.linear_cross_entropy (hopperkern/lce/sft.py) against the fp64 reference and against
the 4-pass path: numerics on both memory paths, the path choice, autograd uses (gradient accumulation,
checkpointing, torch.compile) and its custom ops. Shapes and helpers are test_lce.py's (interpreter-sized)."""

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from conftest import DEVICE
from test_lce import _no_tma_env  # noqa: F401  (autouse: a HOPPERKERN_TMA in the environment would override modes)
from test_lce import (
    _BF16_OK,
    ALL,
    CONFIDENT,
    CONFIDENT_ALL,
    CONFIDENT_LOSS_ATOL,
    FWD,
    LAYOUTS,
    MODES,
    SFT,
    SHAPE,
    SMALL,
    Case,
    _op_args,
    assert_close,
    assert_no_worse,
    call,
    check_fp32,
    check_grads,
    check_no_worse,
    expect_path,
    make_inputs,
    run,
    torch_lowp_cross_entropy,
    upstream,
)
from hopperkern import lce, tma
from hopperkern.lce import reference as ref
from hopperkern.lce import launch, sft
from hopperkern.lce.ops import lce_sft_backward_op, lce_sft_forward_op
from hopperkern.tuning import KernelConfig

THREE, FOUR = dict(sft_path="3pass"), dict(sft_path="4pass")
DW = "lce.sft_dweight"
SAME_ORDER_RTOL = 2e-6  # 3-pass vs 4-pass in fp32: the same math, summed in another order

CASES = [
    Case("plain/mean", "no options; mean over all tokens (1/N folded into d(logits) from the device)"),
    Case("all/mean", "every option + bias + ignored tokens; 1/kept from the device", ALL, bias=True, ignore=0.3),
    Case("all/sum", "every option + bias + ignored tokens; sum", ALL, bias=True, ignore=0.3, reduction="sum"),
    Case("z-loss+temperature/sum", "z-loss, temperature, bias, ignored tokens: the stored exponentials' path (no "
         "softcap, no label smoothing)", dict(ALL, softcap=None, label_smoothing=0.0), bias=True, ignore=0.3,
         reduction="sum"),
    Case("ignore_index=5", "an ignore_index inside [0, V): its column is no label for ignored rows",
         dict(ignore_index=5), ignore=0.3, reduction="sum"),
]
IDS = {"ids": lambda c: c.name}
CONFIDENT_CASES = [
    Case("confident/mean", "p_label -> 1: the label entry p - 1 from the fp32 log-prob", ignore=0.2,
         confident=CONFIDENT),
    Case("confident/all", "every option (softcap 30) + bias, mean", CONFIDENT_ALL, bias=True, ignore=0.2,
         confident=CONFIDENT),
    Case("confident/centered", "label logits ~0: the tightest torch baseline", bias=True, reduction="sum",
         ignore=0.2, confident=CONFIDENT, centered=True),
]


def _sft_path_ran(mode):
    return expect_path(mode, sft=True)


def _check_3pass_vs_reference_and_4pass(case, mode, inp, ups, vs_4pass=True):
    """fp32 loss and grads of the 3-pass path against fp64 (check_fp32) and the 4-pass path's to summation order."""
    (loss,), grads = check_fp32(mode, case.fn(lce.linear_cross_entropy, tma=mode, **THREE),
                                case.fn(ref.linear_cross_entropy), inp, ups, path=dict(sft=True))
    if not vs_4pass:
        return
    with expect_path(mode, sft=False):
        (loss4,), grads4 = run(case.fn(lce.linear_cross_entropy, tma=mode, **FOUR), inp, ups)
    assert_close(loss, loss4, SAME_ORDER_RTOL, "loss")
    check_grads(grads, grads4, SAME_ORDER_RTOL)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, **IDS)
def test_3pass_fp32_matches_reference_and_4pass(case, mode):
    """fp32 loss and d_hidden, d_weight, d_bias of the 3-pass path match fp64 to ~1e-5 and the 4-pass path's to fp32
    summation order (upstream grad in [0.5, 1.5), so never 1)."""
    inp, ups = case.inputs(), case.ups()
    _check_3pass_vs_reference_and_4pass(case, mode, inp, ups)


@pytest.mark.parametrize("mode", MODES)
def test_3pass_token_chunks(mode, monkeypatch):
    """A logits budget of 16 rows cuts the forward into 3 token chunks (16, 16, 5 of N=37): each chunk's logits and
    d(logits) land in the right rows."""
    monkeypatch.setattr(sft, "LOGITS_CHUNK_BUDGET", 16 * sft.padded_cols(SHAPE[1]) * 4)
    monkeypatch.setattr(sft, "LOGITS_CHUNK_MAX", 16 * sft.padded_cols(SHAPE[1]) * 4)
    calls = []
    real = sft.lce_forward
    monkeypatch.setattr(sft, "lce_forward", lambda h, *a, **k: calls.append(h.shape[0]) or real(h, *a, **k))
    case = CASES[1]
    check_fp32(mode, case.fn(lce.linear_cross_entropy, tma=mode, **THREE), case.fn(ref.linear_cross_entropy),
               case.inputs(), case.ups(), path=dict(sft=True))
    assert calls == [16, 16, 5]


def _case(name):
    return next(c for c in CASES + CONFIDENT_CASES if c.name == name)


NO_SOFTCAP = _case("z-loss+temperature/sum")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES[:2] + [NO_SOFTCAP] + CONFIDENT_CASES, **IDS)
def test_3pass_fp16_no_worse_than_torch(case, mode):
    """fp16 loss and grads within 2x plain PyTorch's fp16 error of fp64, also for confident predictions (the label
    entry formed in fp32 from the log-prob, the upstream grad applied in fp32 after the GEMM, one rounding each).
    d_weight comes from lce_dweight_kernel on the call's memory path."""
    before = tma.decision_count(DW)
    check_no_worse(mode, case.fn(lce.linear_cross_entropy, tma=mode, **THREE), case.fn(ref.linear_cross_entropy),
                   case.fn(torch_lowp_cross_entropy), case.inputs(dtype=torch.float16), case.ups(), ("loss",),
                   out_atol=CONFIDENT_LOSS_ATOL if case.confident else 1e-5)
    assert tma.decision_count(DW) == before + 1
    d = tma.last_decision(DW)
    assert (d.mode, dict(d.use)) == (mode, dict.fromkeys(("dlogits", "hidden", "dweight"), mode != "never"))


@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay.name != "odd pitch"], ids=lambda lay: lay.name)
def test_3pass_fp16_strided_hidden(layout):
    """fp16 with a strided hidden view: lce_dweight_kernel reads it with its strides ("auto": pointer loads for a
    transposed view, TMA for an aligned slice) and d_weight stays within 2x torch's error."""
    case = NO_SOFTCAP
    inp = case.inputs(dtype=torch.float16)
    inp.hidden = layout.make(inp.hidden)
    check_no_worse("auto", case.fn(lce.linear_cross_entropy, tma="auto", **THREE), case.fn(ref.linear_cross_entropy),
                   case.fn(torch_lowp_cross_entropy), inp, case.ups(), ("loss",), view=layout.view,
                   path=dict(hidden=layout.tma_reason is None, sft=True))
    assert tma.last_decision(DW).use["hidden"] is (layout.tma_reason is None)


@pytest.mark.skipif(not _BF16_OK, reason="bf16 tl.dot is wrong in the interpreter without conftest's patch")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", [CASES[1], NO_SOFTCAP, CONFIDENT_CASES[2]], **IDS)
def test_3pass_bf16_no_worse_than_torch(case, mode):
    """bf16 (conftest's interpreter patch): loss and grads within 2x plain PyTorch's bf16 error of fp64."""
    check_no_worse(mode, case.fn(lce.linear_cross_entropy, tma=mode, **THREE), case.fn(ref.linear_cross_entropy),
                   case.fn(torch_lowp_cross_entropy), case.inputs(dtype=torch.bfloat16), case.ups(), ("loss",),
                   out_atol=CONFIDENT_LOSS_ATOL if case.confident else 1e-5)


def _fp32_torch_grads(inp, reduction):
    """(d_hidden, d_weight, d_bias) as PyTorch's fp32-accumulated path forms them from bf16 inputs: fp32 logits of
    the bf16 operands, d(logits) in fp32 rounded once to bf16, each gradient GEMM accumulated in fp32 and rounded
    once (the torch baseline of the issue's "2x fp32-torch" bound)."""
    h, w, b = (None if t is None else t.float().requires_grad_() for t in (inp.hidden, inp.weight, inp.bias))
    z = F.linear(h, w, b)
    dz = torch.autograd.grad(F.cross_entropy(z, inp.labels, reduction=reduction), z)[0].bfloat16().float()
    return ((dz @ w).bfloat16(), (dz.t() @ h).bfloat16(), dz.sum(0).bfloat16())


@pytest.mark.skipif(not _BF16_OK, reason="bf16 tl.dot is wrong in the interpreter without conftest's patch")
@pytest.mark.parametrize("path,mode", [("3pass", "never"), ("chunked", "always")])
def test_bf16_label_terms_as_exact_as_fp32_torch(path, mode):
    """bf16 exponentials: each row's label entry of d(logits) (the largest of the row, -1 + p for an unlikely
    label) reaches d_hidden, d_weight and d_bias without a rounding of its own (fp32 label terms, exact products
    on the tensor cores), so their errors against fp64 stay within 1.25x of PyTorch's fp32-accumulated path, which
    rounds that entry once; as a bf16 entry times bf16 rho-scaled hidden rows it would carry two roundings
    (1.5 to 1.8x). An unconfident batch (logits of std 1 over 1000 classes), bias, ignored tokens."""
    inp = make_inputs((40, 1000, 32), torch.bfloat16, bias=True, ignore=0.2, logit_std=1.0)
    reduction = "sum"  # an upstream gradient of 1: PyTorch's label entries -1 + p round to nearly exact values
    leaves = _leaves(inp)
    loss = lce.linear_cross_entropy(*leaves[:2], inp.labels, bias=leaves[2], reduction=reduction, tma=mode,
                                    sft_path=path)
    got = torch.autograd.grad(loss, leaves)
    h64, w64, b64 = _leaves(inp, torch.float64)
    want = torch.autograd.grad(ref.linear_cross_entropy(h64, w64, inp.labels, bias=b64, reduction=reduction),
                               (h64, w64, b64))
    for name, g, t, r in zip(("d_hidden", "d_weight", "d_bias"), got, _fp32_torch_grads(inp, reduction), want):
        assert_no_worse(name, g, t, r, factor=1.25, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Autograd uses


def _leaves(inp, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_()
            for t in (inp.hidden, inp.weight, inp.bias)]


@pytest.mark.parametrize("mode", MODES)
def test_gradient_accumulation(mode):
    """Two micro-batches (sum loss / kept tokens of the step, as in the README) accumulate into .grad; a loss
    backpropagated twice with retain_graph doubles it. The 3-pass path's grads equal the 4-pass path's."""
    inp = make_inputs(SHAPE, bias=True, ignore=0.3)
    halves = (slice(0, 20), slice(20, None))
    n_kept = inp.kept.sum()
    got = {}
    for path in ("3pass", "4pass"):
        h, w, b = _leaves(inp)
        for rows in halves:
            loss = lce.linear_cross_entropy(h[rows], w, inp.labels[rows], bias=b, reduction="sum", tma=mode,
                                            sft_path=path, **ALL)
            (loss / n_kept).backward()
        got[path] = [h.grad.clone(), w.grad.clone(), b.grad.clone()]
        for t in (h, w, b):
            t.grad = None
        loss = lce.linear_cross_entropy(h, w, inp.labels, bias=b, tma=mode, sft_path=path, **ALL)
        loss.backward(retain_graph=True)
        once = [t.grad.clone() for t in (h, w, b)]
        loss.backward()
        check_grads([t.grad for t in (h, w, b)], [2 * g for g in once], 1e-6)
        check_grads(once, got[path], SAME_ORDER_RTOL)  # the mean over the whole batch: the same step
    check_grads(got["3pass"], got["4pass"], SAME_ORDER_RTOL)


@pytest.mark.parametrize("path, op_names", [
    ("3pass", ["lce_sft_forward_op", "lce_sft_backward_op"]),
    ("chunked", ["lce_sft_chunked_forward_op", "lce_sft_chunked_backward_op"])])
def test_eager_3pass_calls_skip_the_custom_ops(path, op_names, monkeypatch):
    """An eager differentiable call on either 3-pass variant runs its forward and backward through its autograd
    function, not the custom ops (and their per-call dispatch work): with its ops made to raise, the eager call
    still computes the 4-pass path's gradients, bias included."""
    from hopperkern.lce import ops

    inp = make_inputs(SHAPE, bias=True, ignore=0.3)

    def boom(*args, **kwargs):
        raise AssertionError("custom op called in eager mode")

    h, w, b = _leaves(inp)
    expected = torch.autograd.grad(lce.linear_cross_entropy(h, w, inp.labels, bias=b, tma="never", **FOUR), (h, w, b))
    for name in op_names:
        monkeypatch.setattr(ops, name, boom)
    monkeypatch.setattr(lce.api, op_names[0], boom)
    got = torch.autograd.grad(lce.linear_cross_entropy(h, w, inp.labels, bias=b, tma="never", sft_path=path),
                              (h, w, b))
    check_grads(list(got), list(expected), SAME_ORDER_RTOL)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_activation_checkpointing(use_reentrant):
    """Under torch.utils.checkpoint (the forward re-run in the backward; the reentrant variant first runs it under
    no_grad, the plain forward) the grads equal those of the same call without checkpointing, bit for bit, and
    the 4-pass path's to fp32 summation order."""
    inp = make_inputs(SHAPE, bias=True, ignore=0.3)
    g = upstream(())
    want = {}
    for path, ckpt in (("3pass", False), ("3pass", True), ("4pass", False)):
        h, w, b = _leaves(inp)

        def f(h, w, b, path=path):
            return lce.linear_cross_entropy(torch.tanh(h), w, inp.labels, bias=b, tma="never", sft_path=path, **ALL)

        loss = torch.utils.checkpoint.checkpoint(f, h, w, b, use_reentrant=use_reentrant) if ckpt else f(h, w, b)
        (loss * g).backward()
        want[path, ckpt] = [h.grad, w.grad, b.grad]
    for got, exp in zip(want["3pass", True], want["3pass", False]):
        assert torch.equal(got, exp)
    check_grads(want["3pass", False], want["4pass", False], SAME_ORDER_RTOL)


# ---------------------------------------------------------------------------------------------------------------
# Edge cases


@pytest.mark.parametrize("path", ["3pass", "chunked"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_3pass_all_tokens_ignored(reduction, mode, path):
    """All tokens ignored: loss exactly 0.0 (not NaN) and every gradient exactly zero, on both 3-pass variants."""
    inp = make_inputs(SMALL, bias=True)
    inp.labels.fill_(-100)
    with _sft_path_ran(mode):
        (loss,), grads = run(call(lce.linear_cross_entropy, reduction=reduction, label_smoothing=0.1, z_loss=0.02,
                                  tma=mode, sft_path=path), inp, [upstream(())])
    assert loss.item() == 0.0
    for g, t in zip(grads, (inp.hidden, inp.weight, inp.bias)):
        assert g.shape == t.shape and not g.any()


@pytest.mark.parametrize("path", ["3pass", "chunked"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_3pass_zero_tokens(reduction, path):
    """No tokens: a 0.0 loss and zero grads of the right shapes, without a launch, on both 3-pass variants."""
    inp = make_inputs((0, SMALL[1], SMALL[2]), bias=True)
    before = tma.last_decision(FWD)
    (loss,), grads = run(call(lce.linear_cross_entropy, reduction=reduction, tma="always", sft_path=path), inp,
                         [upstream(())])
    assert tma.last_decision(FWD) is before
    assert loss.shape == () and loss.item() == 0.0
    for g, t in zip(grads, (inp.hidden, inp.weight, inp.bias)):
        assert g.shape == t.shape and not g.any()


@pytest.mark.parametrize("mode", ["auto", "never"])
@pytest.mark.parametrize("layout", [lay for lay in LAYOUTS if lay.name != "odd pitch"], ids=lambda lay: lay.name)
def test_3pass_noncontiguous_hidden(layout, mode):
    """A strided hidden view (transposed: pointer loads; an aligned column slice: TMA in place) gives the
    reference's loss and grads; the d_weight GEMM reads the view with its strides."""
    inp, ups = make_inputs(SMALL, bias=True, ignore=0.2), [upstream(())]
    inp.hidden = layout.make(inp.hidden)
    check_fp32(mode, call(lce.linear_cross_entropy, tma=mode, **THREE), call(ref.linear_cross_entropy), inp, ups,
               view=layout.view, path=dict(hidden=layout.tma_reason is None, sft=True))


# ---------------------------------------------------------------------------------------------------------------
# Which path runs


def test_auto_path_follows_the_memory_rule(monkeypatch):
    """"auto" takes the 3-pass path at interpreter sizes (token threshold lowered) and the 4-pass path once the
    rule says the kept d(logits) does not fit, or below the threshold; "none", per-token outputs and no-grad
    calls never launch the 3-pass kernel."""
    inp = make_inputs(SMALL)
    h, w = _leaves(inp)[:2]
    with expect_path("never", sft=False):
        lce.linear_cross_entropy(h, w, inp.labels, tma="never").backward()  # fewer than MIN_TOKENS_3PASS tokens
    monkeypatch.setattr(sft, "MIN_TOKENS_3PASS", 1)
    with expect_path("never", sft=True):
        lce.linear_cross_entropy(h, w, inp.labels, tma="never").backward()
    with expect_path("never", sft=True):
        lce.LinearCrossEntropyLoss(reduction="sum", tma="never")(h, w, inp.labels).backward()
    with expect_path("never", sft=False):
        lce.LinearCrossEntropyLoss(tma="never", sft_path="4pass")(h, w, inp.labels).backward()
    with expect_path("never", sft=False):
        lce.linear_cross_entropy(h, w, inp.labels, reduction="none", tma="never").sum().backward()
    before = tma.last_decision(SFT)
    with torch.no_grad(), expect_path("never", backward=False):
        lce.linear_cross_entropy(h, w, inp.labels, tma="never", **THREE)
    lce.linear_logprobs_entropy(h, w, inp.labels, tma="never")[0].sum().backward()
    assert tma.last_decision(SFT) is before
    monkeypatch.setattr(sft, "EXTRA_BUDGET", -SMALL[1] * SMALL[2] * 4)  # nothing fits
    with expect_path("never", sft=False):
        lce.linear_cross_entropy(h, w, inp.labels, tma="never").backward()
    with expect_path("never", sft=True):
        lce.linear_cross_entropy(h, w, inp.labels, tma="never", **THREE).backward()


@pytest.mark.parametrize("N, H, V, fits, three", [
    (8192, 4096, 128256, True, True), (32768, 4096, 128256, False, False), (16384, 3584, 152064, False, False),
    (8192, 2304, 256000, False, False), (1937, 3584, 152064, True, True), (2169, 896, 151936, True, True),
    (1, 16, 32000, True, False), (4096, 4096, 128256, True, True), (1024, 4096, 128256, True, False)])
def test_memory_rule_on_real_shapes(N, H, V, fits, three):
    """The documented rule on the benchmark's bf16 shapes: "auto" takes the 3-pass path from MIN_TOKENS_3PASS
    tokens, where kept d(logits) + scratch <= V H 4 bytes + 512 MiB."""
    assert sft.use_3pass("auto", N, V, H, 2) is three
    assert (sft.extra_bytes(N, V, H, 2) <= V * H * 4 + 512 * 2**20) is fits
    assert three == (fits and N >= sft.MIN_TOKENS_3PASS)
    assert sft.use_3pass("3pass", N, V, H, 2) and not sft.use_3pass("4pass", N, V, H, 2)
    assert sft.extra_bytes(N, V, H, 2) >= N * V * 2
    assert sft.chunk_rows(128256, 128) * sft.padded_cols(128256) * 4 <= sft.LOGITS_CHUNK_BUDGET
    chunk = sft.chunk_bytes(N, V, H, 2)
    assert sft.LOGITS_CHUNK_BUDGET <= chunk <= sft.LOGITS_CHUNK_MAX
    if fits:  # the chunk takes only what the budget leaves beside the kept d(logits)
        assert N * sft.padded_cols(V) * 2 + min(N, sft.chunk_rows(V, 128, chunk)) * sft.padded_cols(V) * 4 <= \
            max(sft.budget_bytes(V, H), N * sft.padded_cols(V) * 2 + sft.LOGITS_CHUNK_BUDGET)


@pytest.mark.parametrize("N, H, V, three", [
    (8192, 4096, 128256, True), (1937, 3584, 152064, False), (2169, 896, 151936, False), (4096, 4096, 128256, True),
    (32768, 4096, 128256, False)])
def test_memory_rule_with_fp32_logits(N, H, V, three):
    """Where the forward keeps fp32 logit chunks (softcap, fp16), "auto" takes the 3-pass path from
    MIN_TOKENS_FP32_LOGITS tokens, and the chunk counts in its memory."""
    assert sft.use_3pass("auto", N, V, H, 2, logits=True) is three
    assert three == (N >= sft.MIN_TOKENS_FP32_LOGITS and
                     sft.extra_bytes(N, V, H, 2, logits=True) <= sft.budget_bytes(V, H))
    assert sft.extra_bytes(N, V, H, 2, logits=True) >= N * sft.padded_cols(V) * 2 + sft.LOGITS_CHUNK_BUDGET
    assert sft.fp32_logits(torch.float16, None) and sft.fp32_logits(torch.bfloat16, 30.0)
    assert sft.fp32_logits(torch.bfloat16, None, 0.1)
    assert not sft.fp32_logits(torch.bfloat16, None) and not sft.fp32_logits(torch.float32, 0.0, 0.0)


@pytest.mark.parametrize("dtype, softcap, smoothing, stores_exp", [
    (torch.float32, None, 0.0, True), (torch.float32, 3.0, 0.0, False), (torch.float32, None, 0.1, False),
    (torch.float16, None, 0.0, False),
    pytest.param(torch.bfloat16, None, 0.0, True, marks=pytest.mark.skipif(not _BF16_OK, reason="interpreter bf16")),
])
def test_3pass_forward_variant(dtype, softcap, smoothing, stores_exp):
    """Which 3-pass forward runs: the stored exponentials (a third TMA operand of the forward, d(logits) as row
    factors of that one buffer: no d(logits) pass) for bf16 and fp32 without softcap or label smoothing; fp32 logit
    chunks and a d(logits) pass over them with softcap, label smoothing or fp16."""
    inp = make_inputs(SMALL, dtype=dtype)
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    before = tma.decision_count(SFT)
    with expect_path("always", sft=True):
        lce.linear_cross_entropy(h, w, inp.labels, tma="always", softcap=softcap, label_smoothing=smoothing,
                                 **THREE).backward()
    assert ("exp_logits" in tma.last_decision(FWD).use) is stores_exp
    if stores_exp:
        assert tma.decision_count(SFT) == before
    else:
        assert set(tma.last_decision(SFT).use) == {"logits", "dlogits"}


@pytest.mark.parametrize("mode", MODES)
def test_3pass_exponentials_with_vocab_splits(mode, monkeypatch):
    """The stored exponentials under a forced config (block_n=16: 7 vocab tiles) and 3 vocab splits (3, 3, 1
    tiles): every split restarts its running max, each tile's exponentials are rescaled to the row's reference
    logit, and the row factors give the reference's loss and grads (fp32, z-loss, temperature and bias)."""
    cfg = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    asked = []
    monkeypatch.setattr(sft, "pick_config", lambda *args: cfg)
    monkeypatch.setattr(launch, "forward_plan", lambda *args: asked.append(args) or (3, 3))
    case = NO_SOFTCAP
    check_fp32(mode, case.fn(lce.linear_cross_entropy, tma=mode, **THREE), case.fn(ref.linear_cross_entropy),
               case.inputs(), case.ups(), path=dict(sft=True))
    assert asked, "the forward must take its splits from forward_plan"


# Where the stored exponentials' reference logits come from: the forward's label launch (launch._LABEL_MMA True:
# the GPU's way for 16-bit inputs) or a row dot of their own before it.
REF_SOURCES = [pytest.param(True, id="ref from the label kernel"), pytest.param(False, id="ref from a row dot")]


def _ref_source(by_mma, monkeypatch):
    """Force the reference logits' source. With the label launch the forward's tiles widen to 128 x 256
    (store_e_config); the recomputed rows then take the same tiles, so that the interpreter's products (numpy's,
    whose rounding depends on the tile's shape) equal the forward's bit for bit, as the GPU's do at any tile."""
    monkeypatch.setattr(launch, "_LABEL_MMA", by_mma)
    if by_mma:
        monkeypatch.setattr(sft, "_ROWS_TILES_INTERPRETED", sft._STORE_E_TILE[:2])


@pytest.mark.parametrize("by_mma", REF_SOURCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_3pass_far_labels(mode, reduction, by_mma, monkeypatch):
    """Tokens whose label's log-prob lies below -(E_OFFSET + E_CLAMP) = -80 (logits of std ~120 on some rows): the
    forward clamps their stored exponentials, the row factors cannot serve them, and lce_sft_rows_kernel forms their
    d(logits) rows from recomputed logits; ignored rows with such logits keep finite (clamped) exponentials and add
    nothing. fp32 with z-loss, temperature, bias and ignored tokens: loss and grads match fp64 and (reference
    logits from a row dot) the 4-pass path; with the reference logits from the forward's label launch the 3-pass
    tiles widen, and the interpreter's products at |z| ~ 450 then differ from the 4-pass path's tuned tiles by an
    ulp (on the GPU they are equal at any tile), so that variant is held to fp64 alone."""
    _ref_source(by_mma, monkeypatch)
    case = dataclasses.replace(NO_SOFTCAP, reduction=reduction)
    inp = case.inputs()
    far = torch.zeros(inp.hidden.shape[0], dtype=torch.bool, device=inp.hidden.device)
    far[1::3] = True
    inp.hidden[far] *= 60.0
    z = ref.reference_logits(inp.hidden, inp.weight, inp.bias, None, case.options["temperature"])
    logp = torch.log_softmax(z, -1).gather(1, inp.labels.clamp(min=0)[:, None])[:, 0]
    flagged = inp.kept & (logp < -(launch.E_OFFSET + launch.E_CLAMP + 1))
    assert flagged.sum() >= 3 and (inp.kept & ~flagged).sum() >= 3, "the batch must mix flagged and plain rows"
    assert (~inp.kept & far).any(), "an ignored row with far logits"
    ups = case.ups()
    _check_3pass_vs_reference_and_4pass(case, mode, inp, ups, vs_4pass=not by_mma)


@pytest.mark.skipif(not _BF16_OK, reason="bf16 tl.dot is wrong in the interpreter without conftest's patch")
def test_3pass_far_labels_bf16_label_terms():
    """bf16 with flagged rows (label log-prob below -80: lce_sft_rows_kernel writes their whole d(logits) rows,
    label entries included, and their label terms are 0) beside plain rows (fp32 label terms) and ignored ones:
    d_hidden, d_weight and d_bias within 1.25x the error of fp64 of PyTorch's fp32-accumulated path."""
    inp = make_inputs((24, 300, 32), torch.bfloat16, bias=True, ignore=0.2, logit_std=1.0)
    far = torch.zeros(inp.hidden.shape[0], dtype=torch.bool, device=inp.hidden.device)
    far[1::3] = True
    inp.hidden[far] = (inp.hidden[far].float() * 150.0).bfloat16()
    z = ref.reference_logits(inp.hidden, inp.weight, inp.bias, None, 1.0)
    logp = torch.log_softmax(z, -1).gather(1, inp.labels.clamp(min=0)[:, None])[:, 0]
    flagged = inp.kept & (logp < -(launch.E_OFFSET + launch.E_CLAMP + 1))
    assert flagged.sum() >= 2 and (inp.kept & ~flagged).sum() >= 3, "the batch must mix flagged and plain rows"
    leaves = _leaves(inp)
    with expect_path("never", sft=True):
        got = torch.autograd.grad(lce.linear_cross_entropy(*leaves[:2], inp.labels, bias=leaves[2], reduction="sum",
                                                           tma="never", sft_path="3pass"), leaves)
    h64, w64, b64 = _leaves(inp, torch.float64)
    want = torch.autograd.grad(ref.linear_cross_entropy(h64, w64, inp.labels, bias=b64, reduction="sum"),
                               (h64, w64, b64))
    for name, g, t, r in zip(("d_hidden", "d_weight", "d_bias"), got, _fp32_torch_grads(inp, "sum"), want):
        assert_no_worse(name, g, t, r, factor=1.25, atol=1e-6)


@pytest.mark.parametrize("by_mma", REF_SOURCES)
def test_3pass_row_factors(by_mma, monkeypatch):
    """lce_sft_forward's (dlogits, rho) pair on the stored exponentials' path: rho[:, None] * dlogits is d(logits) of
    the fp64 reference (fp32 inputs: to ~1e-6 of its largest entry), rho is 0 on ignored rows and 1 on flagged ones,
    and every stored entry is finite; the row dot of the reference logits runs only without a label launch."""
    _ref_source(by_mma, monkeypatch)
    sft._LAUNCHES.clear()  # so that a reference row dot, if it runs, is built (and counted) here
    launched = []
    real = sft._label_ref_launch
    monkeypatch.setattr(sft, "_label_ref_launch", lambda *a: launched.append(1) or real(*a))
    case = NO_SOFTCAP
    inp = case.inputs()
    inp.hidden[2] *= 60.0  # a far label (flagged) on a kept row, given the seed
    inp.hidden[-1] *= 60.0  # the last row is ignored
    opts = launch.LceOptions(tma="never", z_loss=case.options["z_loss"], temperature=case.options["temperature"])
    loss, dl, rho = sft.lce_sft_forward(inp.hidden, inp.weight, inp.labels, inp.bias, opts, mean=False)
    V = inp.weight.shape[0]
    assert rho.shape == (inp.hidden.shape[0],) and torch.isfinite(dl[:, :V]).all()
    h = inp.hidden.double().requires_grad_()
    z = (h @ inp.weight.double().t() + inp.bias.double()) * (1 / case.options["temperature"])
    z.retain_grad()
    lse = torch.logsumexp(z, -1)
    kept = inp.kept
    per = lse - z.gather(1, inp.labels.clamp(min=0)[:, None])[:, 0] + case.options["z_loss"] * lse * lse
    (per * kept).sum().backward()
    want = z.grad / case.options["temperature"]  # d loss / d (h w^T + b)
    got = rho.double()[:, None] * dl[:, :V].double()
    assert_close(got, want, 1e-5, "d(logits)")
    assert (rho[~kept] == 0).all()
    assert rho[2] == 1.0 and kept[2], "row 2 must be flagged"
    assert (rho[kept & (torch.arange(len(rho), device=rho.device) != 2)] != 1.0).all()
    assert launched == ([] if by_mma else [1])


def test_store_arguments_are_checked():
    """lce_forward's z_out / e_out: exclusive, only with pick_label, the documented dtypes and shapes, and enough
    per-tile maxima for the config's vocab tiles; ValueError or TypeError before any launch."""
    inp = make_inputs(SMALL)
    N, V = SMALL[0], SMALL[1]
    opts = launch.LceOptions(tma="never")
    cfg = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    e = torch.empty((N, sft.padded_cols(V)))
    mt = torch.empty((N, 5))  # V = 70 needs 5 tiles of 16
    z = torch.empty((N, sft.padded_cols(V)))
    args = (inp.hidden, inp.weight, inp.labels, None, opts)
    bad = [(dict(z_out=z, e_out=(e, mt)), ValueError, "exclusive"),
           (dict(e_out=(e, mt), pick_label=False), ValueError, "pick_label=True"),
           (dict(e_out=(e.half(), mt)), TypeError, "e_out[0] (e) must be torch.float32"),
           (dict(e_out=(e, mt.double())), TypeError, "mt"),
           (dict(e_out=(e[:, :V - 1], mt)), ValueError, ">= V=70"),
           (dict(e_out=(e, mt[:, :4])), ValueError, "at least 5 columns"),
           (dict(z_out=z.half()), TypeError, "z_out must be torch.float32"),
           (dict(e_out=[e, mt]), TypeError, "tuple (e, mt)")]
    for kwargs, err, match in bad:
        before = tma.decision_count(FWD)
        with pytest.raises(err, match=re.escape(match)):
            launch.lce_forward(*args, config=cfg, need_entropy=False, **kwargs)
        assert tma.decision_count(FWD) == before, kwargs
    ref_logits = torch.zeros(N)
    for kwargs, err, match in [(dict(e_out=(e, ref_logits[:N - 1])), ValueError, "ref must be [>= N"),
                               (dict(e_out=(e, torch.zeros(2 * N)[::2])), ValueError, "unit stride")]:
        with pytest.raises(err, match=re.escape(match)):
            launch.lce_forward(*args, config=cfg, need_entropy=False, **kwargs)
    launch.lce_forward(*args, config=cfg, need_entropy=False, e_out=(e, mt))  # the good ones run
    launch.lce_forward(*args, config=cfg, need_entropy=False, e_out=(e, ref_logits))


def test_store_z_config():
    """The logits-storing forward keeps tiles under 128 x 128 and re-tiles larger ones to the 128 x 128 x 64,
    8-warp, 4-stage config that compiles for sm_90 without spills within its shared memory."""
    small = KernelConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3)
    assert sft.store_z_config(small) == small
    big = sft.store_z_config(KernelConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8,
                                          num_stages=3, flatten=True))
    assert big == KernelConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=4,
                               flatten=True)


def test_store_e_config(monkeypatch):
    """The exponentials-storing forward widens tiles narrower than 128 x 256 to 128 x 256 x 64 with 8 warps and 3
    stages (group and flatten kept) where the label's logit of such tiles comes from the label kernel (16-bit
    inputs on a Hopper GPU); wider tiles, fp32 inputs, other devices and the in-tile pick forced keep the config."""
    narrow = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=4, flatten=True)
    wide = KernelConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, flatten=True)
    assert sft.store_e_config(narrow, torch.bfloat16, DEVICE) == (wide if tma.capability(DEVICE).hopper_mma
                                                                  else narrow)
    fake = dataclasses.replace(tma.capability(), hopper_mma=True)
    monkeypatch.setattr(tma, "capability", lambda device=None: fake)
    assert sft.store_e_config(narrow, torch.bfloat16, DEVICE) == wide
    assert sft.store_e_config(narrow.model_copy(update=dict(group_m=4, flatten=False)), torch.bfloat16, DEVICE) == \
        wide.model_copy(update=dict(group_m=4, flatten=False))
    assert sft.store_e_config(wide, torch.bfloat16, DEVICE) == wide
    assert sft.store_e_config(narrow, torch.float32, DEVICE) == narrow
    monkeypatch.setattr(launch, "_LABEL_MMA", False)
    assert sft.store_e_config(narrow, torch.bfloat16, DEVICE) == narrow
    monkeypatch.setattr(tma, "capability", lambda device=None: dataclasses.replace(fake, hopper_mma=False))
    monkeypatch.setattr(launch, "_LABEL_MMA", None)
    assert sft.store_e_config(narrow, torch.bfloat16, DEVICE) == narrow


PATH_ERRORS = [
    pytest.param(dict(sft_path="2pass"), "sft_path must be one of ('auto', '3pass', 'chunked', '4pass'), got '2pass'",
                 id="unknown"),
    pytest.param(dict(sft_path=None), "sft_path must be one of ('auto', '3pass', 'chunked', '4pass'), got None", id="None"),
    pytest.param(dict(sft_path="3pass", reduction="none"),
                 "sft_path must be 'auto' or '4pass' with reduction='none', got '3pass'", id="3pass with none"),
]


@pytest.mark.parametrize("kwargs, match", PATH_ERRORS)
def test_sft_path_errors(kwargs, match):
    """A bad sft_path raises ValueError before anything is launched (with grad, and under no_grad too)."""
    inp = make_inputs(SMALL)
    h = inp.hidden.clone().requires_grad_()
    before = {op: tma.last_decision(op) for op in (FWD, SFT)}
    for ctx in (torch.enable_grad(), torch.no_grad()):
        with ctx, pytest.raises(ValueError, match=re.escape(match)):
            lce.linear_cross_entropy(h, inp.weight, inp.labels, **kwargs)
    assert {op: tma.last_decision(op) for op in (FWD, SFT)} == before


# ---------------------------------------------------------------------------------------------------------------
# torch.compile and the custom ops


def test_3pass_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the 3-pass path (its d(logits) saved for the backward) without graph
    breaks; loss and grads equal eager."""
    torch._dynamo.reset()

    def step(x, w, b, labels):
        return lce.linear_cross_entropy(torch.tanh(x) * 3.0, w, labels, bias=b, label_smoothing=0.1, z_loss=0.02,
                                        tma="never", **THREE)

    inp, ups = make_inputs(SMALL, bias=True, ignore=0.2), [upstream(())]
    (want,), want_grads = run(step, inp, ups)
    try:
        with _sft_path_ran("never"):
            (loss,), grads = run(torch.compile(step, fullgraph=True, backend="aot_eager"), inp, ups)
    finally:
        torch._dynamo.reset()
    assert_close(loss, want, 1e-6, "loss")
    check_grads(grads, want_grads, 1e-6)


@pytest.mark.parametrize("smoothing,dtype", [(0.1, torch.float32), (0.0, torch.float32), (0.0, torch.bfloat16)],
                         ids=["fp32-logits", "exponentials", "bf16-exponentials"])
def test_sft_custom_ops_opcheck(smoothing, dtype):
    """torch.library.opcheck: schema, autograd registration and fake kernels of both 3-pass ops agree with the
    real ones (both forwards: fp32 logits, with no row factors, and the stored exponentials, with them, and for
    bf16 with the label terms after them); the backward op also with a transposed hidden (strides of the fake
    d_hidden)."""
    if dtype == torch.bfloat16 and not _BF16_OK:
        pytest.skip("bf16 tl.dot is wrong in the interpreter without conftest's patch")
    inp = make_inputs((5, 20, 16), dtype, bias=True)
    opts = dict(ignore_index=-100, label_smoothing=smoothing, z_loss=0.0, softcap=0.0, temperature=1.0, tma="never",
                check=True, mean=True)
    fwd = _op_args("lce_sft_forward", hidden=inp.hidden.clone().requires_grad_(),
                   weight=inp.weight.clone().requires_grad_(), labels=inp.labels, bias=inp.bias, **opts)
    torch.library.opcheck(lce_sft_forward_op, fwd, test_utils=("test_schema", "test_autograd_registration",
                                                               "test_faketensor"))
    _, dl, rho = lce_sft_forward_op(*fwd)
    for hidden in (inp.hidden, inp.hidden.t().contiguous().t()):
        bwd = _op_args("lce_sft_backward", hidden=hidden, weight=inp.weight, bias=inp.bias, dlogits=dl.detach(),
                       rho=rho, g=upstream(()), need_hidden_grad=True, need_weight_grad=True, tma="never",
                       labels=inp.labels)
        torch.library.opcheck(lce_sft_backward_op, bwd, test_utils=("test_schema", "test_faketensor"))



_DW_SHAPES = [
    ("one-program-a-tile", dict(persistent=False, flatten=False, epi_sub=1)),
    ("persistent", dict(persistent=True, flatten=False, epi_sub=1)),
    ("persistent-flattened", dict(persistent=True, flatten=True, epi_sub=1)),
    ("sliced-epilogue-2", dict(epi_sub=2)),
    ("sliced-epilogue-4", dict(epi_sub=4, block_h=64)),
    ("pointer-epilogue", dict(epi_tma=False)),
    ("tma-epilogue-sliced-4", dict(epi_sub=4, block_h=64, epi_tma=True)),
    ("tma-epilogue-persistent-sliced-2", dict(persistent=True, flatten=True, epi_sub=2, epi_tma=True)),
]


@pytest.mark.parametrize("split", (0, 2), ids=("plain", "split"))
@pytest.mark.parametrize("mode", MODES)
def test_dweight_launch_shapes_agree(mode, split):
    """Every launch shape of lce_dweight_kernel (persistent or one program a tile, fused loops, the epilogue whole
    or in 2 or 4 column slices, TMA or pointer epilogue) writes every element of its result, in the right place,
    with the epilogue's arithmetic. Ragged V and H (tail tiles and slices past the edge). The operands are
    multiples of 1/8 in [-1, 1], so every partial sum of products is exact in fp32 whatever the order of the
    additions (the interpreter's dot is numpy's matmul, whose order may change with the tile width on some CPUs):
    each result equals, bit for bit, the exact product with the epilogue applied (plain: times g in fp32, one
    rounding to fp16; split: added to a prior fp32 sum, one rounding)."""
    gen = torch.Generator().manual_seed(11)
    N, V, H = 37, 72, 88  # V % 16 and H % 32 != 0; 16-byte aligned rows: TMA under "always"
    dl = (torch.randint(-8, 9, (N, V), generator=gen) / 8).half()
    h = (torch.randint(-8, 9, (N, H), generator=gen) / 8).half()
    g = torch.tensor([0.37])
    prior = torch.randn((V, H), generator=gen)
    prod = dl.double().t() @ h.double()
    results = []
    for _, change in _DW_SHAPES:
        tiles = sft.dweight_tiles(H, bool(split))._replace(**change)
        out = torch.full((V, H), float("nan"), dtype=torch.float16)  # poisoned: every element must be written
        if split:
            bits = prior.view(torch.int32)
            out.view(torch.int16).copy_((bits >> 16).to(torch.int16))
            lo = bits.to(torch.int16)
            sft._dweight(dl, h, g, out, mode, lo=lo, accumulate=True, tiles=tiles)
            res = ((out.view(torch.int16).to(torch.int32) << 16) | (lo.to(torch.int32) & 0xFFFF)).view(torch.float32)
        else:
            sft._dweight(dl, h, g, out, mode, tiles=tiles)
            res = out
        assert torch.isfinite(res).all()
        use = tma.last_decision(DW).use
        assert use["dlogits"] == use["hidden"] == (mode == "always")
        assert use.get("dweight", False) == (mode == "always" and tiles.epi_tma)
        results.append(res)
    for (name, _), res in zip(_DW_SHAPES[1:], results[1:]):
        assert torch.equal(res, results[0]), name
    if split:
        assert torch.equal(results[0], (prior.double() + prod).float()), "split sum"
    else:
        assert torch.equal(results[0], (prod.float() * g).half()), "d_weight"


@pytest.mark.parametrize("split", (0, 2), ids=("plain", "split"))
@pytest.mark.parametrize("mode", MODES)
def test_dweight_label_terms_every_launch_shape(mode, split):
    """lce_dweight_kernel's label terms (HAS_LABELS) on every launch shape: each token's fp32 term times its row of
    r (not the GEMM's hidden operand) lands in its label's d_weight row, before the epilogue. Skewed labels: 20 of
    37 tokens share one label (two 16-token steps in its tile, the second partly masked), three the last,
    ragged row; ignored tokens (label -100) carry nonzero terms that must not land anywhere. The terms need
    their lower 16-bit half (2^-12 parts below a half-precision number near 1), and every operand is a multiple of
    a power of two, so all sums are exact in fp32 and the result must equal the exact one bit for bit."""
    gen = torch.Generator().manual_seed(12)
    N, V, H = 37, 72, 88
    dl = (torch.randint(-8, 9, (N, V), generator=gen) / 8).half()
    h = (torch.randint(-8, 9, (N, H), generator=gen) / 8).half()
    r = (torch.randint(-8, 9, (N, H), generator=gen) / 16).half()
    labels = torch.randint(0, V, (N,), generator=gen)
    labels[:20] = 5
    labels[30:33] = V - 1
    labels[33:35] = -100
    lab = torch.randint(-8, 9, (N,), generator=gen) / 8 + torch.randint(-3, 4, (N,), generator=gen) * 2.0**-12
    lab[:4] = 1 + 2.0**-12  # hi = 1, lo = 2^-12
    perm, off = sft._label_order(labels, V)
    g = torch.tensor([0.37])
    prior = torch.randn((V, H), generator=gen)
    exact = dl.double().t() @ h.double()
    kept = labels >= 0
    exact.index_add_(0, labels[kept], lab[kept].double()[:, None] * r[kept].double())
    for name, change in _DW_SHAPES:
        tiles = sft.dweight_tiles(H, bool(split))._replace(**change)
        out = torch.full((V, H), float("nan"), dtype=torch.float16)
        terms = (r, labels, perm, off, lab)
        if split:
            bits = prior.view(torch.int32)
            out.view(torch.int16).copy_((bits >> 16).to(torch.int16))
            lo = bits.to(torch.int16)
            sft._dweight(dl, h, g, out, mode, lo=lo, accumulate=True, tiles=tiles, labels=terms)
            res = ((out.view(torch.int16).to(torch.int32) << 16) | (lo.to(torch.int32) & 0xFFFF)).view(torch.float32)
            assert torch.equal(res, (prior.double() + exact).float()), name
        else:
            sft._dweight(dl, h, g, out, mode, tiles=tiles, labels=terms)
            assert torch.equal(out, (exact.float() * g).half()), name


def test_label_sums_skewed():
    """sft._add_label_sums (d_bias's label terms): out[v] gains the sum of the terms of the tokens labelled v, for a
    label that 300 of 400 tokens share (many 16-token steps of one lane, the last partly masked), labels at both
    ends of V, ignored tokens whose nonzero terms must land nowhere, and a tail block of V. Against fp64 sums."""
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    N, V = 400, 300
    labels = torch.randint(0, V, (N,), generator=gen, device=DEVICE)
    labels[:300] = 7
    labels[300:305] = V - 1
    labels[305:307] = 0
    labels[307:310] = -100
    lab = torch.randn(N, generator=gen, device=DEVICE)
    prior = torch.randn(V, generator=gen, device=DEVICE)
    kept = labels >= 0
    want = prior.double().index_add(0, labels[kept], lab[kept].double())
    got = sft._add_label_sums(prior.clone(), *sft._label_order(labels, V), lab)
    assert_close(got, want.float(), 1e-6, "label sums")


@pytest.mark.parametrize("strided", [False, True], ids=["contiguous out", "transposed out"])
def test_dhidden_label_terms(strided):
    """sft._dhidden: g * (rho * acc + lab * w[label]) per row in fp32, rounded once; rows with a zero label term or
    a label outside [0, V) read no weight row; an output of non-unit column stride gets the same values."""
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    N, H, V = 6, 40, 7
    acc = torch.randn(N, H, generator=gen, device=DEVICE)
    rho = torch.rand(N, generator=gen, device=DEVICE)
    lab = torch.randn(N, generator=gen, device=DEVICE)
    lab[2] = 0.0
    labels = torch.randint(0, V, (N,), generator=gen, device=DEVICE)
    labels[4] = -100
    weight = torch.randn(V, H, generator=gen, device=DEVICE)
    g = torch.tensor(0.75, device=DEVICE)
    use = (lab != 0) & (labels >= 0)
    want = g * (rho[:, None] * acc + torch.where(use, lab, 0.0)[:, None] * weight[labels.clamp(min=0)])
    out = torch.empty(H, N, device=DEVICE).t() if strided else torch.empty(N, H, device=DEVICE)
    got = sft._dhidden(acc, rho, lab, labels, weight, g, out)
    assert got is out
    assert_close(out, want, 1e-6, "d_hidden rows")
