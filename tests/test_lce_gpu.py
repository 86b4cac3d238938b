"""hopperkern.lce on a real GPU: bf16/fp16 at real vocab sizes, N*V > 2**31, worker threads, inductor, autocast.

Tolerances are relative to plain PyTorch in the same precision (``assert_no_worse`` in test_lce.py): the kernel's
error against an fp64 reference (chunked fp32 where fp64 would not fit) is at most 2x torch's plus a small atol.
Run with ``pytest -m gpu``; on a machine without CUDA every test here is skipped.
"""


import pytest
import torch

from conftest import run_in_thread
from hopperkern import lce
from hopperkern.lce import reference as ref
from test_lce import _no_tma_env  # noqa: F401  (autouse: a HOPPERKERN_TMA in the environment would override modes)
from test_lce import (
    CONFIDENT,
    CONFIDENT_LOSS_ATOL,
    assert_close,
    assert_no_worse,
    call,
    expect_path,
    make_inputs,
    rel_err,
    run,
    torch_lowp_cross_entropy,
    torch_lowp_logprobs_entropy,
    upstream,
)

pytestmark = pytest.mark.gpu

DEV = "cuda"
GRADS = ("d_hidden", "d_weight")
REAL_VOCABS = [
    pytest.param((512, 128256, 4096), id="llama3-V128256-H4096"),  # V % 256 == 0
    pytest.param((512, 151936, 896), id="qwen2-V151936-H896"),  # V % 256 == 128: a vocab tail tile
]
CONFIDENT_SHAPES = [
    pytest.param((1024, 32000, 1024), id="V32000-H1024"),
    pytest.param((1024, 128256, 1024), id="llama3-V128256-H1024"),
]
# Centered confident batches (label logits ~0): torch's bf16 errors are ~3e-3 to 4.5e-3 for d_hidden and d_weight
# (measured on the CPU at N=128, V=32000, H=1024 and N=64, V=4000, H=1024), the kernel's ~2.5e-3.
CONFIDENT_BASELINE_MAX = 1e-2
MID = (256, 32000, 1024)  # for behaviour tests: shares compiled kernels with the real-vocab ones
FP16 = (512, 128256, 2048)
ACCUMULATION = (8192, 32000, 1024)
OVERFLOW = (17000, 128256, 256)
INT32_LIMIT = 2**31


def _inputs(shape, dtype=torch.bfloat16, *, bias=False, ignore=0.1):
    return make_inputs(shape, dtype, device=DEV, bias=bias, ignore=ignore)


def _no_worse_than_torch(got, base, want, names, baseline_max=5e-2, out_atol=1e-5):
    """assert_no_worse for each of ``names``; ``out_atol`` is the atol of the outputs (not of GRADS)."""
    for name, g, b, w in zip(names, got, base, want):
        assert_no_worse(name, g, b, w, baseline_max=baseline_max, atol=1e-5 if name in GRADS else out_atol)


def _cross_entropy_no_worse_than_torch(inp, mode, baseline_max=5e-2, out_atol=1e-5):
    """Mean loss, d_hidden and d_weight of the kernel vs fp64, against torch's error in the inputs' dtype (which
    must be under ``baseline_max``)."""
    ups = [upstream((), device=DEV)]
    with expect_path(mode):
        (loss,), grads = run(call(lce.linear_cross_entropy, tma=mode), inp, ups)
    (want,), want_grads = run(call(ref.linear_cross_entropy), inp, ups, dtype=torch.float64)
    (base,), base_grads = run(call(torch_lowp_cross_entropy), inp, ups)
    assert grads[0].dtype == grads[1].dtype == inp.hidden.dtype
    _no_worse_than_torch([loss, *grads[:2]], [base, *base_grads[:2]], [want, *want_grads[:2]], ("loss",) + GRADS,
                         baseline_max, out_atol)


def _logprobs_entropy_no_worse_than_torch(inp, ups, mode, baseline_max=5e-2, out_atol=1e-5):
    """Log-probs, entropies (temperature 0.7), d_hidden and d_weight of the kernel vs fp64 under upstream grads
    ``ups`` of both outputs, against torch's error in the inputs' dtype (which must be under ``baseline_max``)."""
    with expect_path(mode):
        outs, grads = run(call(lce.linear_logprobs_entropy, temperature=0.7, tma=mode), inp, ups)
    want, want_grads = run(call(ref.linear_logprobs_entropy, temperature=0.7), inp, ups, dtype=torch.float64)
    base, base_grads = run(call(torch_lowp_logprobs_entropy, temperature=0.7), inp, ups)
    assert (outs[0][~inp.kept] == 0).all()
    _no_worse_than_torch([*outs, *grads[:2]], [*base, *base_grads[:2]], [*want, *want_grads[:2]],
                         ("logprob", "entropy") + GRADS, baseline_max, out_atol)


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("shape", REAL_VOCABS)
def test_bf16_real_vocab_cross_entropy(shape, mode):
    """bf16 mean loss, d_hidden and d_weight at real vocab sizes: within 2x torch's bf16 error of fp64, on both
    memory paths ("always" must work for contiguous aligned inputs on Hopper)."""
    _cross_entropy_no_worse_than_torch(_inputs(shape), mode)


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("shape", REAL_VOCABS)
def test_bf16_real_vocab_logprobs_entropy(shape, mode):
    """bf16 log-probs and entropies (temperature 0.7) and their grads under random per-token upstream grads on
    both outputs: within 2x torch's bf16 error of fp64."""
    ups = [upstream((shape[0],), seed=2, device=DEV), upstream((shape[0],), seed=3, device=DEV)]
    _logprobs_entropy_no_worse_than_torch(_inputs(shape), ups, mode)


def _confident_inputs(shape, temperature=1.0):
    """A bf16 batch with p_label in [0.99, 0.9999] for every kept token and label logits ~0 (make_inputs'
    ``centered``), so that torch's bf16 logits keep p - 1 and its error is a tight bar."""
    return make_inputs(shape, torch.bfloat16, device=DEV, ignore=0.1, confident=CONFIDENT, centered=True,
                       temperature=temperature)


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("shape", CONFIDENT_SHAPES)
def test_bf16_confident_cross_entropy(shape, mode):
    """bf16 at p_label in [0.99, 0.9999], where d(logits) at the label is ~p - 1 and the spacing of bf16 below 1
    is 3.9e-3 (p rounded before the 1 is subtracted loses it): mean loss, d_hidden and d_weight within 2x torch's
    bf16 error of fp64, and torch's error under 1e-2."""
    _cross_entropy_no_worse_than_torch(_confident_inputs(shape), mode, baseline_max=CONFIDENT_BASELINE_MAX,
                                       out_atol=CONFIDENT_LOSS_ATOL)


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("shape", CONFIDENT_SHAPES)
def test_bf16_confident_logprobs_entropy(shape, mode):
    """The same confident bf16 batches at temperature 0.7 with random per-token upstream grads of both log-probs
    and entropies, zero at ignored tokens (an RL loss mask): outputs and grads within 2x torch's bf16 error of
    fp64, and torch's error under 1e-2."""
    inp = _confident_inputs(shape, temperature=0.7)
    mask = inp.kept.float()
    ups = [upstream((shape[0],), seed=2, device=DEV) * mask, upstream((shape[0],), seed=3, device=DEV) * mask]
    _logprobs_entropy_no_worse_than_torch(inp, ups, mode, baseline_max=CONFIDENT_BASELINE_MAX,
                                          out_atol=CONFIDENT_LOSS_ATOL)


def test_fp16_real_vocab_cross_entropy():
    """fp16 (logits std 2, no overflow) at V=128256: loss and grads within 2x torch's fp16 error of fp64."""
    _cross_entropy_no_worse_than_torch(_inputs(FP16, torch.float16), "always")


def test_bf16_gradient_accumulation_accuracy():
    """N=8192 tokens summed into d_weight and V=32000 columns into d_hidden: neither sum loses precision (the
    users' top complaint is a bf16 running sum): within 2x torch's bf16 error of fp64."""
    _cross_entropy_no_worse_than_torch(_inputs(ACCUMULATION), "always")


def _chunked_fp32_reference(inp, g, chunk=1024):
    """Per-token loss and d_hidden, d_weight of sum(g * per-token CE) in fp32, ``chunk`` rows at a time (the
    N x V logits would not fit)."""
    h, w, labels = inp.hidden, inp.weight.float(), inp.labels
    N, H = h.shape
    loss = torch.empty(N, device=DEV)
    d_h = torch.empty(N, H, device=DEV)
    d_w = torch.zeros_like(w)
    for i in range(0, N, chunk):
        hc, lab, kept = h[i:i + chunk].float(), labels[i:i + chunk].clamp(min=0), inp.kept[i:i + chunk]
        z = hc @ w.T
        lse = torch.logsumexp(z, -1)
        loss[i:i + chunk] = torch.where(kept, lse - z.gather(1, lab[:, None])[:, 0], 0.0)
        dz = z.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
        dz[torch.arange(len(lab), device=DEV), lab] -= 1.0
        dz *= (g[i:i + chunk] * kept)[:, None]
        d_h[i:i + chunk] = dz @ w
        d_w += dz.T @ hc
    return loss, d_h, d_w


def test_bf16_more_than_2_31_logits(monkeypatch):
    """N*V = 17000 * 128256 > 2**31: per-token losses match a chunked fp32 reference everywhere, and the grads do
    too, including the rows past 2**31 / V where an int32 offset into N x V would wrap."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # a true fp32 reference
    N, V, H = OVERFLOW
    assert N * V > INT32_LIMIT
    inp = _inputs((N, V, H))
    g = upstream((N,), device=DEV)
    (loss,), grads = run(call(lce.linear_cross_entropy, reduction="none", tma="always"), inp, [g])
    want_loss, want_dh, want_dw = _chunked_fp32_reference(inp, g)
    assert_close(loss, want_loss, 1e-4, "loss")
    tail = slice(INT32_LIMIT // V - 8, N)
    assert rel_err(grads[0][tail], want_dh[tail]) < 1e-2, "d_hidden rows past 2**31 / V"
    assert rel_err(grads[0], want_dh) < 1e-2, "d_hidden"
    assert rel_err(grads[1], want_dw) < 1e-2, "d_weight"


def test_call_from_worker_thread():
    """A tma="always" call from a threading.Thread (a fresh context: the descriptor allocator must be installed
    there too) equals the same call on the main thread."""
    inp, ups = _inputs(MID), [upstream((), device=DEV)]
    fn = call(lce.linear_cross_entropy, tma="always")
    main = run(fn, inp, ups)
    (loss,), grads = run_in_thread(lambda: run(fn, inp, ups))
    assert torch.equal(loss, main[0][0])
    for name, g, want in zip(GRADS, grads, main[1]):
        assert rel_err(g, want) < 1e-3, name


def test_torch_compile_inductor_training_step():
    """torch.compile(fullgraph=True) with inductor of a step around linear_cross_entropy (options and bias on):
    loss and grads equal eager up to inductor's fused prologue."""
    def step(x, w, b, labels):
        return lce.linear_cross_entropy(torch.tanh(x.float()).to(x.dtype) * 3.0, w, labels, bias=b,
                                        label_smoothing=0.1, z_loss=1e-4, tma="always")

    torch._dynamo.reset()
    inp, ups = _inputs(MID, bias=True), [upstream((), device=DEV)]
    (want,), want_grads = run(step, inp, ups)
    with expect_path("always"):
        (loss,), grads = run(torch.compile(step, fullgraph=True), inp, ups)
    torch._dynamo.reset()
    assert_close(loss, want, 1e-3, "loss")
    for name, g, w in zip(GRADS + ("d_bias",), grads, want_grads):
        assert rel_err(g, w) < 2e-2, name


def test_autocast_cuda_bf16():
    """Under torch.autocast("cuda", bf16), fp32 hidden/weight run in bf16: the loss and the fp32 grads equal the
    explicit bf16 call's."""
    inp, ups = _inputs(MID, torch.float32), [upstream((), device=DEV)]
    fn = call(lce.linear_cross_entropy, tma="always")
    (loss,), grads = run(fn, inp, ups, forward_ctx=torch.autocast(torch.device(DEV).type, dtype=torch.bfloat16))
    (want,), want_grads = run(fn, inp, ups, dtype=torch.bfloat16)
    assert torch.equal(loss, want)
    for name, g, w in zip(GRADS, grads, want_grads):
        assert g.dtype == torch.float32 and torch.equal(g, w.float()), name


def test_device_mismatch():
    """labels on the CPU with hidden/weight on the GPU: ValueError naming every tensor's device."""
    inp = _inputs((16, 64, 32))
    with pytest.raises(ValueError, match="all tensors must be on one device, got hidden on cuda:0, weight on "
                                         "cuda:0, labels on cpu"):
        lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels.cpu())


def test_backward_uses_fp32_accumulating_cublas_and_stays_in_memory_budget():
    """d_hidden's sum over vocab slices goes through cuBLAS with out_dtype=fp32 (no fp32 copies of the slice),
    so the backward's extra memory stays at the fp32 [N, H] sum + one d(logits) slice + bf16 grads. A probe
    that wrongly says "unsupported" (one on meta tensors, which lack this overload) silently makes the backward 4x
    slower and its memory 2.2x larger; this test fails on either."""
    from hopperkern import tma
    from hopperkern.lce import launch

    if tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 11):
        for dt in (torch.bfloat16, torch.float16):
            assert tma.torch_mm_out_dtype(DEV, dt), f"torch >= 2.11 has addmm(out_dtype=fp32) for {dt} on CUDA"
    N, V, H = 8192, 128256, 1024
    extra, grads = _sum_loss_peak_extra((N, V, H), "4pass")
    budget = N * H * 4 + launch.DLOGITS_BUDGET + grads + 32 * 2**20
    assert extra <= budget, f"backward peak extra {extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def _sum_loss_peak_extra(shape, sft_path):
    """(peak memory beyond the inputs, bytes of the bf16 grads) of a bf16 sum loss's forward + backward at
    ``shape`` on ``sft_path``, asserting which path ran."""
    N, V, H = shape
    inp = make_inputs((N, V, H), dtype=torch.bfloat16, device=DEV)
    h = inp.hidden.detach().requires_grad_()
    w = inp.weight.detach().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with expect_path("auto", sft=sft_path != "4pass"):
        lce.linear_cross_entropy(h, w, inp.labels, reduction="sum", sft_path=sft_path).backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base, (N * H + V * H) * 2


# ---------------------------------------------------------------------------------------------------------------
# The 3-pass SFT path (hopperkern.lce.sft) against the 4-pass path and fp64, bf16 at real sizes

SFT_SHAPES = [
    pytest.param((2048, 128256, 4096), id="llama3-V128256-H4096"),
    pytest.param((1937, 151936, 896), id="qwen2-V151936-H896"),  # odd N, a vocab tail tile
]


def _sft_paths_no_worse(inp, mode, reduction="mean", baseline_max=5e-2, out_atol=1e-5, **options):
    """Loss, d_hidden and d_weight of both SFT paths (upstream grad in [0.5, 1.5)): each within 2x torch's error
    (in the inputs' dtype) of fp64, and the two paths' grads within a few bf16 roundings of each other."""
    ups = [upstream((), device=DEV)]
    (want,), want_grads = run(call(ref.linear_cross_entropy, reduction=reduction, **options), inp, ups,
                              dtype=torch.float64)
    (base,), base_grads = run(call(torch_lowp_cross_entropy, reduction=reduction, **options), inp, ups)

    def run_path(path):
        with expect_path(mode, sft=path != "4pass"):
            return run(call(lce.linear_cross_entropy, reduction=reduction, tma=mode, sft_path=path, **options), inp,
                       ups)

    _paths_no_worse(run_path, ("loss",), ([want], want_grads), ([base], base_grads), baseline_max, out_atol,
                    paths=("3pass", "chunked", "4pass"))


def _paths_no_worse(run_path, names, want, base, baseline_max, out_atol, paths=("3pass", "4pass")):
    """``run_path(path)`` -> (outputs, grads) on each gradient path: the outputs (``names``), d_hidden and
    d_weight each within 2x torch's error (``base``: its outputs and grads) of fp64 (``want``), and each path's
    grads within a few bf16 roundings of the last path's."""
    got = {}
    for path in paths:
        outs, grads = run_path(path)
        _no_worse_than_torch([*outs, *grads[:2]], [*base[0], *base[1][:2]], [*want[0], *want[1][:2]], names + GRADS,
                             baseline_max, out_atol)
        got[path] = grads
    for path in paths[:-1]:
        for name, a, b in zip(GRADS, got[path], got[paths[-1]]):
            assert rel_err(a, b) < 5e-3, f"{name}: {path} vs {paths[-1]}"


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("shape", SFT_SHAPES)
def test_bf16_sft_paths(shape, mode):
    """bf16 mean loss at real sizes on both SFT paths: within 2x torch's bf16 error of fp64, and each other."""
    _sft_paths_no_worse(_inputs(shape), mode)


@pytest.mark.parametrize("path", ["3pass", "chunked"])
@pytest.mark.parametrize("shape", SFT_SHAPES)
def test_bf16_sft_label_terms_as_exact_as_fp32_torch(shape, path):
    """bf16 sum loss at real sizes on the exponentials' paths: d_hidden, d_weight within 1.25x the error of fp64
    that PyTorch's fp32-accumulated path has (d(logits) rounded once to bf16): the label entries, -1 + p for
    unconfident tokens, enter the gradient GEMMs as fp32 terms, not as bf16 entries times bf16 scaled rows."""
    from test_lce_sft import _fp32_torch_grads

    inp = _inputs(shape)
    h, w = (t.detach().clone().requires_grad_() for t in (inp.hidden, inp.weight))
    with expect_path("always", sft=True):
        got = torch.autograd.grad(lce.linear_cross_entropy(h, w, inp.labels, reduction="sum", tma="always",
                                                           sft_path=path), (h, w))
    h64, w64 = (t.detach().double().requires_grad_() for t in (h, w))
    want = torch.autograd.grad(ref.linear_cross_entropy(h64, w64, inp.labels, reduction="sum"), (h64, w64))
    base = _fp32_torch_grads(inp, "sum")[:2]
    for name, g, b, r in zip(GRADS, got, base, want):
        assert_no_worse(name, g, b, r, factor=1.25, atol=1e-6)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_bf16_sft_paths_softcap(mode):
    """With softcap (Gemma-2's 30) and label smoothing the 3-pass forward stores fp32 logits in token chunks (the
    tanh factor needs each logit): bf16 at a real size, both SFT paths against torch's error and each other."""
    _sft_paths_no_worse(_inputs(SFT_SHAPES[1].values[0]), mode, softcap=30.0, label_smoothing=0.1)


@pytest.mark.parametrize("shape", CONFIDENT_SHAPES)
def test_bf16_sft_paths_confident(shape):
    """Confident bf16 batches (p_label in [0.99, 0.9999], label logits ~0) under a sum loss on both SFT paths: the
    3-pass path's label entry p - 1 comes from the fp32 log-prob, and its upstream grad is applied after the GEMM
    in fp32 with one rounding."""
    _sft_paths_no_worse(_confident_inputs(shape), "always", reduction="sum",
                        baseline_max=CONFIDENT_BASELINE_MAX, out_atol=CONFIDENT_LOSS_ATOL)


def test_bf16_sft_3pass_far_labels():
    """Rows whose label's log-prob lies below -80 (hidden rows scaled so that their logits have a std of ~120)
    among ordinary ones, bf16 at a real size: the 3-pass path forms those rows' d(logits) from recomputed logits
    (lce_sft_rows_kernel), and its loss, d_hidden and d_weight stay as close to fp64 as the 4-pass path's."""
    from hopperkern.lce import launch

    inp = _inputs(SFT_SHAPES[0].values[0])
    far = slice(1, None, 7)
    inp.hidden[far] = (inp.hidden[far].float() * 60).to(torch.bfloat16)
    z = inp.hidden[far].float() @ inp.weight.float().t()
    lab = inp.labels[far]
    logp = torch.log_softmax(z, -1).gather(1, lab.clamp(min=0)[:, None])[:, 0]
    assert ((logp < -(launch.E_OFFSET + launch.E_CLAMP)) & (lab != -100)).sum() >= 10, "rows to flag"
    del z
    ups = [upstream((), device=DEV)]
    (want,), want_grads = run(call(ref.linear_cross_entropy, reduction="sum"), inp, ups, dtype=torch.float64)
    errs = {}
    for path in ("3pass", "4pass"):
        with expect_path("auto", sft=path == "3pass"):
            (loss,), grads = run(call(lce.linear_cross_entropy, reduction="sum", tma="auto", sft_path=path), inp,
                                 ups)
        errs[path] = [rel_err(loss, want)] + [rel_err(g, w) for g, w in zip(grads[:2], want_grads[:2])]
    for name, a, b in zip(("loss",) + tuple(GRADS), errs["3pass"], errs["4pass"]):
        assert a <= 1.5 * b + 1e-6, f"{name}: 3pass {a:.2e} vs 4pass {b:.2e}"


def test_sft_3pass_memory_within_its_budget():
    """The 3-pass forward + backward at 8192 x 4096 x 128256 (the rule's choice there) stays within its documented
    extra memory, N x V x 2 + scratch <= V x H x 4 + 512 MiB (plus the bf16 grads), and "auto" picks it."""
    from hopperkern.lce import sft

    N, V, H = 8192, 128256, 4096
    assert sft.use_3pass("auto", N, V, H, 2)
    extra, grads = _sum_loss_peak_extra((N, V, H), "auto")
    budget = sft.budget_bytes(V, H) + grads + 32 * 2**20
    assert extra <= budget, f"3-pass peak extra {extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def test_sft_chunked_memory_within_its_budget():
    """At 32768 x 4096 x 128256 "auto" takes the chunked variant (the kept d(logits) would not fit), and its forward +
    backward stays within V x H x 4 + 512 MiB beyond the bf16 grads."""
    from hopperkern.lce import sft

    N, V, H = 32768, 128256, 4096
    assert sft.pick_path("auto", N, V, H, 2) == "chunked"
    extra, grads = _sum_loss_peak_extra((N, V, H), "auto")
    budget = sft.budget_bytes(V, H) + grads + 32 * 2**20
    assert extra <= budget, f"chunked peak extra {extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def test_bf16_sft_chunked_gradient_accumulation_scale(monkeypatch):
    """An upstream gradient of 1/3 (3-step accumulation: d_hidden rounded twice) keeps the chunked path's d_hidden and
    d_weight within 2x torch's bf16 error of fp64, over four chunks of 512 tokens (the bf16 d_weight sum accumulated
    in int16 halves three times)."""
    from hopperkern.lce import sft

    monkeypatch.setattr(sft, "chunk_tokens", lambda *args, **kwargs: 512)
    inp = _inputs(SFT_SHAPES[0].values[0])
    ups = [torch.tensor(1.0 / 3.0, device=DEV)]
    (want,), want_grads = run(call(ref.linear_cross_entropy), inp, ups, dtype=torch.float64)
    (base,), base_grads = run(call(torch_lowp_cross_entropy), inp, ups)
    with expect_path("auto", sft=True):
        (loss,), grads = run(call(lce.linear_cross_entropy, sft_path="chunked"), inp, ups)
    _no_worse_than_torch([loss, *grads[:2]], [base, *base_grads[:2]], [want, *want_grads[:2]], ("loss",) + GRADS,
                         5e-2, 1e-5)


# ---------------------------------------------------------------------------------------------------------------
# The 3-pass path of log-probs and entropies (hopperkern.lce.rl) against the 4-pass path and fp64, bf16


def _rl_paths_no_worse(inp, ups, mode, baseline_max=5e-2, out_atol=1e-5):
    """Log-probs, entropies (temperature 0.7), d_hidden and d_weight of both gradient paths under per-token upstream
    grads ``ups``: each within 2x torch's bf16 error of fp64, and the two paths' grads within a few bf16 roundings
    of each other."""
    fn = dict(temperature=0.7, tma=mode)
    want, want_grads = run(call(ref.linear_logprobs_entropy, temperature=0.7), inp, ups, dtype=torch.float64)
    base, base_grads = run(call(torch_lowp_logprobs_entropy, temperature=0.7), inp, ups)

    def run_path(path):
        with expect_path(mode, sft=False, rl=path == "3pass"):
            return run(call(lce.linear_logprobs_entropy, grad_path=path, **fn), inp, ups)

    _paths_no_worse(run_path, ("logprob", "entropy"), (want, want_grads), (base, base_grads), baseline_max, out_atol)


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("shape", SFT_SHAPES)
def test_bf16_rl_paths(shape, mode):
    """bf16 log-probs and entropies with random per-token upstream grads of both at real sizes, on both gradient
    paths: within 2x torch's bf16 error of fp64, and each other."""
    ups = [upstream((shape[0],), seed=2, device=DEV), upstream((shape[0],), seed=3, device=DEV)]
    _rl_paths_no_worse(_inputs(shape), ups, mode)


@pytest.mark.parametrize("shape", CONFIDENT_SHAPES)
def test_bf16_rl_paths_confident(shape):
    """Confident bf16 batches (p_label in [0.99, 0.9999], label logits ~0) with loss-masked upstream grads on both
    gradient paths: the 3-pass path's label entry comes from the fp32 log-prob, not from the stored e."""
    inp = _confident_inputs(shape, temperature=0.7)
    mask = inp.kept.float()
    ups = [upstream((shape[0],), seed=2, device=DEV) * mask, upstream((shape[0],), seed=3, device=DEV) * mask]
    _rl_paths_no_worse(inp, ups, "always", baseline_max=CONFIDENT_BASELINE_MAX, out_atol=CONFIDENT_LOSS_ATOL)


def test_bf16_rl_3pass_wide_logits():
    """Logits of std 40 (over +-150) span far more than the 87 to 92 below a tile's running max where a stored bf16
    exponential would be subnormal, the edge of the pass's logarithm. The 3-pass path's log-probs, entropies and
    gradients stay finite and agree with the 4-pass path's (which recomputes the logits) to a few bf16 roundings, and
    are no further from fp64 than twice the 4-pass path's error plus one bf16 rounding."""
    inp = make_inputs((512, 32000, 1024), torch.bfloat16, device=DEV, ignore=0.1, logit_std=40.0)
    ups = [upstream((512,), seed=2, device=DEV), upstream((512,), seed=3, device=DEV)]
    want = run(call(ref.linear_logprobs_entropy), inp, ups, dtype=torch.float64)
    got = {}
    for path in ("3pass", "4pass"):
        with expect_path("always", sft=False, rl=path == "3pass"):
            got[path] = run(call(lce.linear_logprobs_entropy, grad_path=path, tma="always"), inp, ups)
    for name, i, j in (("logprob", 0, 0), ("entropy", 0, 1), ("d_hidden", 1, 0), ("d_weight", 1, 1)):
        a, b, w = got["3pass"][i][j], got["4pass"][i][j], want[i][j]
        assert torch.isfinite(a).all(), f"{name}: the 3-pass path gave non-finite values"
        assert rel_err(a, b) < 5e-3, f"{name}: 3pass vs 4pass {rel_err(a, b):.2e}"
        assert rel_err(a, w) <= 2 * rel_err(b, w) + 4e-3, f"{name}: {rel_err(a, w):.2e} vs 4pass {rel_err(b, w):.2e}"


def test_rl_3pass_memory_within_its_budget():
    """The 3-pass log-prob forward + backward at 8192 x 4096 x 128256 (the rule's choice there) stays within its
    documented extra memory, N x V x 2 + scratch <= V x H x 4 + 512 MiB (plus the bf16 grads)."""
    from hopperkern.lce import rl

    N, V, H = 8192, 128256, 4096
    assert rl.use_3pass("auto", N, V, H, torch.bfloat16)
    _rl_step_within_budget(N, V, H, expect_path("auto", rl=True), "3-pass")


def _rl_step_within_budget(N, V, H, path_ctx, what):
    """A bf16 log-prob + entropy forward and backward under "auto" (inside ``path_ctx``) allocates at most
    sft.budget_bytes(V, H) beyond its inputs, plus the bf16 grads and 32 MiB of slack."""
    from hopperkern.lce import sft

    inp = make_inputs((N, V, H), dtype=torch.bfloat16, device=DEV)
    h, w = inp.hidden.detach().requires_grad_(), inp.weight.detach().requires_grad_()
    g = upstream((N,), device=DEV)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with path_ctx:
        lp, ent = lce.linear_logprobs_entropy(h, w, inp.labels)
        torch.autograd.backward((lp, ent), (g, g))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    budget = sft.budget_bytes(V, H) + (N * H + V * H) * 2 + 32 * 2**20
    assert extra <= budget, f"{what} peak extra {extra / 2**20:.0f} MiB > {budget / 2**20:.0f} MiB"


def test_bf16_rl_3pass_narrow_tiles(monkeypatch):
    """The 3-pass forward's 128 x 128 x 64 tiles (rl.forward_config, taken from 4096 tokens) at a real size: both
    gradient paths within 2x torch's bf16 error of fp64, and each other."""
    from hopperkern.lce import rl

    monkeypatch.setattr(rl, "MIN_TOKENS_NARROW_TILES", 1)
    shape = SFT_SHAPES[0].values[0]
    ups = [upstream((shape[0],), seed=2, device=DEV), upstream((shape[0],), seed=3, device=DEV)]
    _rl_paths_no_worse(_inputs(shape), ups, "always")


# ---------------------------------------------------------------------------------------------------------------
# The mixed path of log-probs and entropies: the first rl.stored_rows tokens on the 3-pass path, the rest recomputed


def _mixed_run_path(monkeypatch, mode, S):
    from hopperkern.lce import rl

    def run_path(inp, ups, path):
        if path != "mixed":
            with expect_path(mode, sft=False, rl=path == "3pass"):
                return run(call(lce.linear_logprobs_entropy, grad_path=path, temperature=0.7, tma=mode), inp, ups)
        with monkeypatch.context() as m:
            m.setattr(rl, "stored_rows", lambda grad_path, N, V, H, dtype: S)
            with expect_path(mode, rl=True, backward=False):
                return run(call(lce.linear_logprobs_entropy, temperature=0.7, tma=mode), inp, ups)

    return run_path


@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("shape", SFT_SHAPES)
def test_bf16_rl_mixed_path(shape, mode, monkeypatch):
    """bf16 at real sizes with 1024 tokens stored (odd N: the 4-pass part's rows start mid-tensor) and the rest
    recomputed: within 2x torch's bf16 error of fp64, and the 4-pass path's grads within a few bf16 roundings."""
    inp = _inputs(shape)
    ups = [upstream((shape[0],), seed=2, device=DEV), upstream((shape[0],), seed=3, device=DEV)]
    want = run(call(ref.linear_logprobs_entropy, temperature=0.7), inp, ups, dtype=torch.float64)
    base = run(call(torch_lowp_logprobs_entropy, temperature=0.7), inp, ups)
    run_path = _mixed_run_path(monkeypatch, mode, 1024)
    _paths_no_worse(lambda p: run_path(inp, ups, p), ("logprob", "entropy"), want, base, 5e-2, 1e-5,
                    paths=("mixed", "4pass"))


def test_bf16_rl_mixed_path_confident(monkeypatch):
    """Confident bf16 batches with loss-masked upstream grads, half the tokens stored."""
    shape = CONFIDENT_SHAPES[1].values[0]
    inp = _confident_inputs(shape, temperature=0.7)
    mask = inp.kept.float()
    ups = [upstream((shape[0],), seed=2, device=DEV) * mask, upstream((shape[0],), seed=3, device=DEV) * mask]
    want = run(call(ref.linear_logprobs_entropy, temperature=0.7), inp, ups, dtype=torch.float64)
    base = run(call(torch_lowp_logprobs_entropy, temperature=0.7), inp, ups)
    run_path = _mixed_run_path(monkeypatch, "always", shape[0] // 2)
    _paths_no_worse(lambda p: run_path(inp, ups, p), ("logprob", "entropy"), want, base, CONFIDENT_BASELINE_MAX,
                    CONFIDENT_LOSS_ATOL, paths=("mixed", "4pass"))


def test_rl_mixed_memory_within_its_budget():
    """"auto" at 32768 x 4096 x 128256 takes the mixed path (the whole batch's exponentials, 7.8 GiB, are over the
    budget) and stays within V x H x 4 + 512 MiB of extra memory (plus the bf16 grads)."""
    from hopperkern.lce import rl

    N, V, H = 32768, 128256, 4096
    assert 0 < rl.stored_rows("auto", N, V, H, torch.bfloat16) < N
    _rl_step_within_budget(N, V, H, expect_path("auto", rl=True, backward=False), "mixed")


LABEL_KERNEL_CASES = [
    pytest.param(((1000, 128256, 4096), {}), id="N1000-V128256-H4096"),
    pytest.param(((4097, 151936, 896), dict(temperature=0.7)), id="N4097-V151936-H896-temperature"),
    pytest.param(((333, 32003, 2304), dict(softcap=30.0, temperature=1.3, bias=True)), id="N333-V32003-bias-softcap"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["always", "never"])
@pytest.mark.parametrize("case", LABEL_KERNEL_CASES)
def test_label_kernel_equals_the_tiles_bitwise(case, mode, dtype, monkeypatch):
    """On the GPU a forward that a backward follows takes its labels' logits from lce_label_mma_kernel instead of
    picking them out of the forward's tiles: that is only right if the two agree bit for bit (log p = z_label - lse
    of a confident prediction needs the tiles' own rounding). Per-split statistics of a stats-only forward, both
    ways, at 128 x 256 tiles (the label kernel's by default) and 128 x 128: every label's logit equal, bitwise,
    with labels of other shards (negative) and ignored ones giving 0, at a ragged N, with bias, softcap and
    temperature."""
    from hopperkern.lce import launch
    from hopperkern.tuning import KernelConfig

    (N, V, H), opt = case
    inp = make_inputs((N, V, H), dtype, device=DEV, bias=opt.get("bias", False))
    labels = inp.labels.clone()
    labels[3::17] = -5
    labels[5::23] = -100
    opts = launch.LceOptions(tma=mode, softcap=opt.get("softcap", 0.0), temperature=opt.get("temperature", 1.0))
    # The wide tiles at which the label kernel runs by default, and the narrow ones of the storing forwards.
    wide = KernelConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3, flatten=True)
    narrow = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=4, flatten=True)
    assert launch.label_by_mma(dtype, inp.hidden.device, wide)
    for cfg in (wide, narrow):
        zl = {}
        for by_mma in (False, True):
            monkeypatch.setattr(launch, "_LABEL_MMA", by_mma)
            stats = launch.lce_forward(inp.hidden, inp.weight, labels, inp.bias, opts, config=cfg, pick_label=True,
                                       stats_only=True)
            assert stats[-1].shape[0] == (1 if by_mma else stats[0].shape[0])
            zl[by_mma] = stats[-1].sum(0)
        differ = int((zl[True] != zl[False]).sum())
        assert differ == 0, f"{differ} of {N} label logits differ at {cfg.block_m}x{cfg.block_n}x{cfg.block_k}"
        inside = (labels >= 0) & (labels < V)
        assert torch.equal(zl[True] == 0, ~inside)
