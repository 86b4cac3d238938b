"""The chunked variant of the 3-pass SFT path (``sft_path="chunked"``, hopperkern/lce/sft.py): per token chunk the
forward forms d(logits) and runs both gradient GEMMs; the backward scales the kept gradients. Against the fp64
reference, the 4-pass path and plain fp16 PyTorch, on both memory paths, with several chunks (a ragged last one),
frozen weights or hidden states, the autograd uses trainers rely on, the auto rule and the custom ops."""

import re

import pytest
import torch
import torch.utils.checkpoint

from test_lce import _no_tma_env  # noqa: F401  (autouse: a HOPPERKERN_TMA in the environment would override modes)
from test_lce import (
    MODES,
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
    run,
    torch_lowp_cross_entropy,
    upstream,
)
from test_lce_sft import CASES, CONFIDENT_CASES, IDS, NO_SOFTCAP, SAME_ORDER_RTOL, _leaves
from hopperkern import lce, tma
from hopperkern.lce import reference as ref
from hopperkern.lce import sft
from hopperkern.lce.ops import lce_sft_chunked_backward_op, lce_sft_chunked_forward_op

CHUNKED, FOUR = dict(sft_path="chunked"), dict(sft_path="4pass")


@pytest.fixture
def chunks(monkeypatch):
    """Chunks of 16 tokens (SHAPE's 37: 16, 16, 5); the list records the rows of every chunk's forward."""
    monkeypatch.setattr(sft, "chunk_tokens", lambda *args, **kwargs: 16)
    rows = []
    real = sft.lce_forward
    monkeypatch.setattr(sft, "lce_forward", lambda h, *a, **k: rows.append(h.shape[0]) or real(h, *a, **k))
    return rows


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, **IDS)
def test_chunked_fp32_matches_reference_and_4pass(case, mode, chunks):
    """fp32 loss and d_hidden, d_weight, d_bias over three token chunks match fp64 to ~1e-5 and the 4-pass path's
    to fp32 summation order (upstream grad in [0.5, 1.5), never 1)."""
    inp, ups = case.inputs(), case.ups()
    (loss,), grads = check_fp32(mode, case.fn(lce.linear_cross_entropy, tma=mode, **CHUNKED),
                                case.fn(ref.linear_cross_entropy), inp, ups, path=dict(sft=True))
    assert chunks == [16, 16, 5]
    with expect_path(mode, sft=False):
        (loss4,), grads4 = run(case.fn(lce.linear_cross_entropy, tma=mode, **FOUR), inp, ups)
    assert_close(loss, loss4, SAME_ORDER_RTOL, "loss")
    check_grads(grads, grads4, SAME_ORDER_RTOL)


# The first case on both memory paths, the others on the two in turn (the paths load the same values: the
# arithmetic whose error is checked here is the same on both).
@pytest.mark.parametrize("case,mode", [
    pytest.param(case, mode, id=f"{case.name}-{mode}")
    for i, case in enumerate(CASES[:2] + [NO_SOFTCAP] + CONFIDENT_CASES)
    for mode in (MODES if i == 0 else MODES[i % 2:i % 2 + 1])])
def test_chunked_fp16_no_worse_than_torch(case, mode, chunks):
    """fp16 loss and grads within 2x plain PyTorch's fp16 error of fp64, confident predictions included, with an
    upstream gradient that is no power of two (d_hidden rounded twice)."""
    check_no_worse(mode, case.fn(lce.linear_cross_entropy, tma=mode, **CHUNKED), case.fn(ref.linear_cross_entropy),
                   case.fn(torch_lowp_cross_entropy), case.inputs(dtype=torch.float16), case.ups(), ("loss",),
                   out_atol=1e-5 if not case.confident else 1e-4, path=dict(sft=True))
    assert chunks == [16, 16, 5]


@pytest.mark.parametrize("requires", [(True, False, True), (False, True, False), (False, False, True)],
                         ids=["frozen weight", "frozen hidden", "bias only"])
def test_chunked_frozen_inputs(requires, monkeypatch, chunks):
    """A frozen weight skips the d_weight GEMM and its fp32 sum (no [V, H] buffer); a frozen hidden the d_hidden
    GEMM; the gradients that are asked for equal the reference's."""
    inp, ups = make_inputs(SHAPE, bias=True, ignore=0.3), [upstream(())]
    mm = []
    real = sft._acc_mm_f32
    monkeypatch.setattr(sft, "_acc_mm_f32", lambda acc, a, b, **k: mm.append(tuple(acc.shape)) or real(acc, a, b, **k))
    fn = call(lce.linear_cross_entropy, tma="never", **CHUNKED)
    (loss,), grads = run(fn, inp, ups, requires=requires)
    (want,), want_grads = run(call(ref.linear_cross_entropy), inp, ups, dtype=torch.float64, requires=requires)
    assert_close(loss, want, 1e-5, "loss")
    check_grads(grads, want_grads, 1e-5)
    assert ((SHAPE[1], SHAPE[2]) in mm) is requires[1]
    assert chunks == [16, 16, 5]


@pytest.mark.parametrize("mode", MODES)
def test_chunked_gradient_accumulation(mode):
    """Two micro-batches (sum loss / kept tokens of the step) accumulate into .grad and equal one call over the
    whole batch and the 4-pass path's grads; a second backward through a retained graph raises (the eager backward
    scales the kept d_hidden in place) instead of giving wrong gradients."""
    inp = make_inputs(SHAPE, bias=True, ignore=0.3)
    n_kept = inp.kept.sum()
    got = {}
    for path in ("chunked", "4pass"):
        h, w, b = _leaves(inp)
        for rows in (slice(0, 20), slice(20, None)):
            loss = lce.linear_cross_entropy(h[rows], w, inp.labels[rows], bias=b, reduction="sum", tma=mode,
                                            sft_path=path, z_loss=0.01)
            (loss / n_kept).backward()
        got[path] = [h.grad.clone(), w.grad.clone(), b.grad.clone()]
        for t in (h, w, b):
            t.grad = None
        loss = lce.linear_cross_entropy(h, w, inp.labels, bias=b, tma=mode, sft_path=path, z_loss=0.01)
        loss.backward(retain_graph=True)
        check_grads([t.grad for t in (h, w, b)], got[path], SAME_ORDER_RTOL)  # the mean over the whole batch
        if path == "chunked":
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                loss.backward()
    check_grads(got["chunked"], got["4pass"], SAME_ORDER_RTOL)


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_chunked_activation_checkpointing(use_reentrant):
    """Under torch.utils.checkpoint the grads equal those of the same call without it, bit for bit."""
    inp = make_inputs(SHAPE, bias=True, ignore=0.3)
    g = upstream(())
    want = {}
    for ckpt in (False, True):
        h, w, b = _leaves(inp)

        def f(h, w, b):
            return lce.linear_cross_entropy(torch.tanh(h), w, inp.labels, bias=b, tma="never", softcap=5.0,
                                            **CHUNKED)

        loss = torch.utils.checkpoint.checkpoint(f, h, w, b, use_reentrant=use_reentrant) if ckpt else f(h, w, b)
        (loss * g).backward()
        want[ckpt] = [h.grad, w.grad, b.grad]
    for got, exp in zip(want[True], want[False]):
        assert torch.equal(got, exp)


# Eager calls skipping the custom ops: test_lce_sft.py's test runs both 3-pass variants.


def test_chunked_double_backward_raises():
    """A backward with create_graph=True raises rather than giving gradients without the terms through the kept
    ones."""
    inp = make_inputs(SMALL)
    h, w = _leaves(inp)[:2]
    loss = lce.linear_cross_entropy(h, w, inp.labels, tma="never", **CHUNKED)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(loss, (h,), create_graph=True)


# ---------------------------------------------------------------------------------------------------------------
# Edge cases


# All tokens ignored and zero tokens: test_lce_sft.py's tests run both 3-pass variants.


def test_chunked_noncontiguous_hidden(chunks):
    """A transposed hidden view (pointer loads) is read through its strides in every chunk."""
    inp, ups = make_inputs(SHAPE, bias=True, ignore=0.2), [upstream(())]
    check_fp32("never", call(lce.linear_cross_entropy, tma="never", **CHUNKED), call(ref.linear_cross_entropy), inp,
               ups, view=lambda t: t.t().contiguous().t(), path=dict(sft=True))


# ---------------------------------------------------------------------------------------------------------------
# Which path runs


def test_auto_takes_chunked_where_the_kept_dlogits_do_not_fit(monkeypatch):
    """"auto": the kept d(logits) where they fit; the chunked variant where they do not and its chunks hold
    MIN_CHUNK_TOKENS tokens (or all of them), and for a frozen weight; the 4-pass path below the token threshold and
    where chunks would be too small."""
    inp = make_inputs(SMALL)
    h, w = _leaves(inp)[:2]
    monkeypatch.setattr(sft, "MIN_TOKENS_3PASS", 1)
    ran = []
    real = sft.lce_sft_chunked_forward
    monkeypatch.setattr(sft, "lce_sft_chunked_forward", lambda *a, **k: ran.append(1) or real(*a, **k))
    from hopperkern.lce import ops

    monkeypatch.setattr(ops, "lce_sft_chunked_forward", sft.lce_sft_chunked_forward)
    lce.linear_cross_entropy(h, w, inp.labels, tma="never").backward()
    assert not ran  # the kept d(logits) fit
    lce.linear_cross_entropy(h, w.detach(), inp.labels, tma="never").backward()
    assert len(ran) == 1  # frozen weight
    # fp32 inputs: the d_weight sum is the fp32 gradient itself, so chunks get all of V H 4 + EXTRA_BUDGET.
    # A token's d(logits) row, reference logit and row factor, scaled hidden row and fp32 d_hidden row.
    per_token = sft.padded_cols(SMALL[1]) * 4 + 8 + 2 * SMALL[2] * 4
    vh4 = SMALL[1] * SMALL[2] * 4
    monkeypatch.setattr(sft, "MIN_CHUNK_TOKENS", 8)
    monkeypatch.setattr(sft, "EXTRA_BUDGET", 10 * per_token - vh4)  # the kept d(logits) of 19 tokens do not fit
    with expect_path("never", sft=True):
        lce.linear_cross_entropy(h, w, inp.labels, tma="never").backward()
    assert len(ran) == 2
    monkeypatch.setattr(sft, "EXTRA_BUDGET", 5 * per_token - vh4)  # chunks of 5 < MIN_CHUNK_TOKENS
    with expect_path("never", sft=False):
        lce.linear_cross_entropy(h, w, inp.labels, tma="never").backward()
    assert len(ran) == 2


@pytest.mark.parametrize("N, H, V, path", [
    (8192, 4096, 128256, "3pass"), (32768, 4096, 128256, "chunked"), (16384, 3584, 152064, "chunked"),
    (8192, 2304, 256000, "chunked"), (1937, 3584, 152064, "3pass"), (1024, 4096, 128256, "4pass"),
    (131072, 8192, 128256, "chunked")])
def test_pick_path_on_real_shapes(N, H, V, path):
    """The documented rule on the benchmark's bf16 shapes, and its chunk sizes: whole row blocks of 128 whose
    memory with the fp32 d_weight sum stays within the budget."""
    assert sft.pick_path("auto", N, V, H, 2) == path
    assert sft.pick_path("auto", N, V, H, 2, need_weight_grad=False) == ("4pass" if N < 1536 else "chunked")
    C = sft.chunk_tokens(V, H, 2)
    assert C % 128 == 0
    per_token = sft.padded_cols(V) * 2 + 8 + H * 2 + H * 4
    assert V * H * 2 + C * per_token <= sft.budget_bytes(V, H) or C == 128  # the sum's lower halves + a chunk
    assert sft.chunk_tokens(V, H, 2, need_weight_grad=False) > C
    for forced in ("3pass", "chunked", "4pass"):
        assert sft.pick_path(forced, N, V, H, 2) == forced


@pytest.mark.parametrize("N, most, want", [(16384, 4864, 4096), (8192, 3072, 2816), (32768, 5632, 5504),
                                           (100, 5632, 128), (5632, 5632, 5632), (5633, 5632, 2944)])
def test_balanced_chunks(N, most, want):
    """As few chunks as ``most`` allows, of like sizes in multiples of 128, never above ``most``."""
    C = sft.balanced_chunk(N, most)
    assert C == want and C <= max(most, 128) and C % 128 == 0
    assert -(-N // C) == -(-N // most) or N <= 128


def test_chunked_path_errors():
    """"chunked" with reduction='none' raises ValueError naming the paths that apply."""
    inp = make_inputs(SMALL)
    match = "sft_path must be 'auto' or '4pass' with reduction='none', got 'chunked'"
    with pytest.raises(ValueError, match=re.escape(match)):
        lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, reduction="none", **CHUNKED)
    with pytest.raises(ValueError, match=re.escape(match)):
        lce.LinearCrossEntropyLoss(reduction="none", sft_path="chunked")


# ---------------------------------------------------------------------------------------------------------------
# torch.compile and the custom ops


def test_chunked_torch_compile_fullgraph():
    """torch.compile(fullgraph=True) traces the chunked path without graph breaks; loss and grads equal eager."""
    torch._dynamo.reset()

    def step(x, w, b, labels):
        return lce.linear_cross_entropy(torch.tanh(x) * 3.0, w, labels, bias=b, z_loss=0.02, tma="never",
                                        **CHUNKED)

    inp, ups = make_inputs(SMALL, bias=True, ignore=0.2), [upstream(())]
    (want,), want_grads = run(step, inp, ups)
    try:
        with expect_path("never", sft=True):
            (loss,), grads = run(torch.compile(step, fullgraph=True, backend="aot_eager"), inp, ups)
    finally:
        torch._dynamo.reset()
    assert_close(loss, want, 1e-6, "loss")
    check_grads(grads, want_grads, 1e-6)


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("need", [(True, True), (True, False), (False, True)], ids=["both", "hidden", "weight"])
def test_chunked_custom_ops_opcheck(need, dtype, bias):
    """torch.library.opcheck: schema, autograd registration and fake kernels of both chunked ops agree with the
    real ones (shapes and dtypes of every output, the empty placeholders included), with and without each
    gradient and bias, for fp32 inputs (the d_weight sum in the fp32 gradient) and fp16 (in int16 halves)."""
    inp = make_inputs((5, 20, 16), bias=bias, dtype=dtype)
    opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.01, softcap=0.0, temperature=1.0, tma="never",
                check=True, mean=True, need_hidden_grad=need[0], need_weight_grad=need[1])
    fwd = _op_args("lce_sft_chunked_forward", hidden=inp.hidden.clone().requires_grad_(need[0]),
                   weight=inp.weight.clone().requires_grad_(need[1]), labels=inp.labels, bias=inp.bias, **opts)
    torch.library.opcheck(lce_sft_chunked_forward_op, fwd, test_utils=("test_schema", "test_autograd_registration",
                                                                       "test_faketensor"))
    _, dh, dw, lo, db = lce_sft_chunked_forward_op(*fwd)
    assert (lo.dtype, lo.dim()) == ((torch.int16, 2) if need[1] and dtype != torch.float32 else (torch.float32, 1))
    bwd = _op_args("lce_sft_chunked_backward", d_hidden=dh.detach(), d_weight=dw.detach(), d_weight_lo=lo,
                   d_bias_sum=db.detach(), g=upstream(()), bias_dtype=dtype if bias else None)
    torch.library.opcheck(lce_sft_chunked_backward_op, bwd, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("epi_tma", (False, True), ids=("pointer-epilogue", "tma-epilogue"))
@pytest.mark.parametrize("mode", MODES)
def test_split_fp32_sum_is_exact(mode, epi_tma):
    """The 16-bit inputs' d_weight sum: lce_dweight_kernel's SPLIT launches keep each fp32 number as two int16
    halves; three chunks' products summed that way equal the fp32 sum of the three fp32 products (to fp32 summation
    order within each product), and the finalize kernel turns halves back into those fp32 numbers bit for bit
    (g = 1, fp32 out) or applies g with one rounding to fp16. The shipped launch shape (persistent programs, the
    epilogue in slices through pointers) and one with a TMA epilogue (one program a tile, whole-tile boxes)."""
    gen = torch.Generator().manual_seed(3)
    N, V, H = 37, 64, 48  # 16-byte aligned rows: TMA loads under "always"
    dl = torch.randn((N, V), generator=gen).half()
    h = torch.randn((N, H), generator=gen).half()
    hi = torch.empty((V, H), dtype=torch.float16)
    lo = torch.empty((V, H), dtype=torch.int16)
    one = torch.ones(1)
    want = torch.zeros((V, H))
    tiles = sft.dweight_tiles(H, True)
    if epi_tma:
        tiles = tiles._replace(epi_sub=1, persistent=False, flatten=False, epi_tma=True)
    for i, rows in enumerate((slice(0, 16), slice(16, 32), slice(32, 37))):
        sft._dweight(dl[rows], h[rows], one, hi, mode, lo=lo, accumulate=i > 0, tiles=tiles)
        want += dl[rows].float().t() @ h[rows].float()
    dec = tma.last_decision("lce.sft_dweight")
    if epi_tma:
        assert dec.use["dweight"] == dec.use["dweight_lo"] == (mode == "always")  # the epilogue on the call's path
    else:
        assert "dweight" not in dec.use  # pointer loads and stores in the epilogue whatever the mode
    x = sft._finalize_split(hi, lo, torch.ones(()), torch.empty((V, H)))
    assert_close(x, want, 1e-6, "split sum")
    bits = x.view(torch.int32)
    assert torch.equal((bits >> 16).to(torch.int16), hi.view(torch.int16))
    assert torch.equal(bits.to(torch.int16), lo)
    g = torch.tensor(0.7)
    assert torch.equal(sft._finalize_split(hi, lo, g, torch.empty((V, H), dtype=torch.float16)), (x * g).half())
    sft._finalize_split(hi, lo, g, hi)  # in place
    assert torch.equal(hi, (x * g).half())
