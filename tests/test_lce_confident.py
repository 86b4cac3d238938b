"""Very confident predictions (1 - p_label between 1e-7 and 1e-5) at LLM-sized logits (~50): the label's log-prob,
the loss and the label column of d(logits), p - 1, are small differences of large numbers.

The log-prob must not be formed as z_label - lse from an LSE already rounded to its own ulp (~4e-6 at 50, more
than all of 1 - p here), nor p - 1 as exp(log p) - 1 in fp32, nor the sum of exponentials s = 1 + (1 - p) / p in
fp32 with the label's own 1 in it (its rounding near 1, ~1e-7, is what plain fp32 PyTorch keeps of 1 - p: 1-4 %
errors of the loss, 3-4 % of d_weight and 60-90 % of d_hidden here). Every sum/mean path (4-pass, 3-pass, chunked)
and ``reduction="none"``, in fp32 on both memory paths, within bounds far below torch's errors.
"""

import pytest
import torch
import torch.nn.functional as F

from conftest import DEVICE
from hopperkern import lce
from hopperkern.lce import reference as ref
from test_lce import MODES, call, make_inputs, rel_err, run, torch_lowp_cross_entropy

N, V, H = 8, 100, 31  # H + 1 hidden units: 128-byte rows, which TMA takes
SHIFT = 30.0  # added to every logit (softmax does not change): raw label logits ~50


def confident_inputs(confident=(1 - 1e-5, 1 - 1e-7)):
    """make_inputs' confident batch (the label's p within ``confident``, every token kept), every logit raised by SHIFT
    through one more hidden unit (1) and weight column (SHIFT), with hidden and weight on a grid of 2^-8: every product
    is then a multiple of 2^-16 and every logit (|z| < 2^7) a sum that fp32 holds exactly in any order. So the logits
    carry no rounding (an fp32 GEMM's, ~ulp(50) = 4e-6, would be as large as 1 - p and depend on the BLAS's summation
    order) and the errors measured are those of the softmax statistics alone."""
    inp = make_inputs((N, V, H), confident=confident)
    inp.hidden = torch.cat([inp.hidden, torch.ones(N, 1, dtype=inp.hidden.dtype, device=inp.hidden.device)], 1)
    inp.weight = torch.cat([inp.weight, torch.full((V, 1), SHIFT, dtype=inp.weight.dtype,
                                                   device=inp.weight.device)], 1)
    inp.hidden, inp.weight = (torch.round(x * 256) / 256 for x in (inp.hidden, inp.weight))
    assert torch.equal(F.linear(inp.hidden, inp.weight).double(), ref.reference_logits(inp.hidden, inp.weight))
    z = ref.reference_logits(inp.hidden, inp.weight)
    p = torch.softmax(z, -1).gather(1, inp.labels[:, None])[:, 0]
    assert (1 - p).max() < 2 * (1 - confident[0]) and z.max() > 40, "the batch is not as confident as asked"
    return inp


PATHS = [("4pass", "sum"), ("4pass", "none"), ("3pass", "sum"), ("3pass", "mean"), ("chunked", "sum")]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path, reduction", PATHS, ids=[f"{p}-{r}" for p, r in PATHS])
def test_very_confident_loss_and_weight_grad_no_worse_than_torch(path, reduction, mode):
    inp = confident_inputs()
    g = torch.Generator(device=inp.hidden.device).manual_seed(3)
    ups = (torch.randn(N, generator=g, device=inp.hidden.device) if reduction == "none"
           else torch.tensor(1.0, device=inp.hidden.device),)
    outs, grads = run(call(lce.linear_cross_entropy, reduction=reduction, sft_path=path, tma=mode), inp, ups)
    want, want_grads = run(call(ref.linear_cross_entropy, reduction=reduction), inp, ups, dtype=torch.float64)
    base, base_grads = run(call(torch_lowp_cross_entropy, reduction=reduction), inp, ups)
    # The forward leaves the label's term out of its fp32 sums (PICK_LABEL with LABEL_OUT: fp32 inputs) and the
    # combine adds it in fp64, so 1 - p keeps the others' relative precision (~1e-6 with the GPU's exp2
    # approximation). Measured on the CPU: loss 0 to 7e-8, d_weight 4e-7, d_hidden 1.5e-5 (torch: 1e-2, 3e-2, 0.6).
    for what, got, want_, torch_, bound in (("loss", outs[0], want[0], base[0], 1e-5),
                                            ("d_weight", grads[1], want_grads[1], base_grads[1], 1e-4),
                                            ("d_hidden", grads[0], want_grads[0], base_grads[0], 1e-3)):
        e_k = rel_err(got, want_)
        assert e_k <= bound, f"{what}: rel err {e_k:.2e} > {bound:.0e} (fp32 torch: {rel_err(torch_, want_):.2e})"


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_very_confident_logprob(grad):
    """Per-token log-probs (the RL outputs) are never above 0. With autograd recording (the label logit from the
    forward's own tiles) they are within 2x torch's fp32 log_softmax error of fp64; without, the label logit
    comes from a separate fp32 dot product, ~ulp(z) away from the tiles' (documented): within 4 ulp of the logits
    (1.5e-5 at 50)."""
    inp = confident_inputs()
    hidden, weight = inp.hidden.clone().requires_grad_(grad), inp.weight.clone().requires_grad_(grad)
    with torch.set_grad_enabled(grad):
        lp, _ = lce.linear_logprobs_entropy(hidden, weight, inp.labels, tma="never")
    lp = lp.detach()
    z64 = ref.reference_logits(inp.hidden, inp.weight)
    want = torch.log_softmax(z64, -1).gather(1, inp.labels[:, None])[:, 0]
    base = torch.log_softmax(F.linear(inp.hidden, inp.weight), -1).gather(1, inp.labels[:, None])[:, 0]
    assert (lp <= 0).all(), lp
    if grad:
        e_k, e_t = rel_err(lp, want), rel_err(base, want)
        assert e_k <= 2 * e_t + 1e-6, f"log-prob: rel err {e_k:.2e} > 2 x torch's {e_t:.2e}"
    else:
        assert (lp.double() - want).abs().max() <= 1.5e-5


def _logprobs_entropy_run(fn, inp, g_logprob, g_entropy, dtype):
    """(logprob, entropy, d_hidden, d_weight) in fp64 of ``fn(hidden, weight)`` under the upstream gradients."""
    h = inp.hidden.to(dtype).clone().requires_grad_()
    w = inp.weight.to(dtype).clone().requires_grad_()
    lp, ent = fn(h, w)
    (lp * g_logprob.to(lp.dtype) + ent * g_entropy.to(ent.dtype)).sum().backward()
    return lp.detach().double(), ent.detach().double(), h.grad.double(), w.grad.double()


def _torch_logprobs_entropy(labels):
    def fn(h, w):
        logp = torch.log_softmax(F.linear(h, w), -1)
        return logp.gather(1, labels[:, None])[:, 0], -(logp.exp() * logp).sum(-1)
    return fn


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_path", ["4pass", "3pass"])
@pytest.mark.parametrize("upstream", ["entropy", "both"])
def test_very_confident_entropy_and_its_gradient(upstream, grad_path, mode):
    """A confident prediction's entropy (~1e-5 here) is far below the ulp of the LSE (~4e-6 at 50): formed as
    lse - E_p[z] it would carry all of that rounding, and so would its gradient p (E - z) at the label; formed from
    an fp32 sum of exponentials with the label's 1 in it, it keeps that sum's rounding (~1e-7, what plain fp32
    PyTorch gets: 1e-2 of the smallest entropy, 7-15 % errors of d_hidden), and a label entry whose constant
    A + C were a + c in fp32 would keep 1e-7 |g_logprob| of its g_entropy term. Measured on the CPU: entropy
    4e-12 absolute, d_hidden 1.1e-5, d_weight 2.4e-7."""
    inp = confident_inputs()
    g = torch.Generator(device=inp.hidden.device).manual_seed(5)
    g_entropy = torch.randn(N, generator=g, device=inp.hidden.device)
    g_logprob = (torch.randn(N, generator=g, device=inp.hidden.device) if upstream == "both"
                 else torch.zeros(N, device=inp.hidden.device))
    ours = _logprobs_entropy_run(
        lambda h, w: lce.linear_logprobs_entropy(h, w, inp.labels, tma=mode, grad_path=grad_path),
        inp, g_logprob, g_entropy, torch.float32)
    want = _logprobs_entropy_run(_torch_logprobs_entropy(inp.labels), inp, g_logprob, g_entropy, torch.float64)
    base = _logprobs_entropy_run(_torch_logprobs_entropy(inp.labels), inp, g_logprob, g_entropy, torch.float32)
    assert want[1].max() < 1e-4, "the batch's entropies are not as small as this test needs"
    e_k, e_t = (ours[1] - want[1]).abs().max().item(), (base[1] - want[1]).abs().max().item()
    bound = 1e-3 * want[1].min().item()
    assert e_k <= bound, f"entropy: abs err {e_k:.2e} > {bound:.1e} (fp32 torch: {e_t:.2e})"
    for what, i, bound in (("d_weight", 3, 1e-4), ("d_hidden", 2, 1e-3)):
        e_k, e_t = rel_err(ours[i], want[i]), rel_err(base[i], want[i])
        assert e_k <= bound, f"{what}: rel err {e_k:.2e} > {bound:.0e} (fp32 torch: {e_t:.2e})"


@pytest.mark.parametrize("mode", MODES)
def test_very_confident_ignored_tokens_with_an_ignore_index_inside_the_vocabulary(mode):
    """With ``ignore_index`` a real column (here the dominant column of some tokens), the forward leaves the label
    column's term out of its fp32 sums for ignored tokens too, and the combine adds it back for them as for kept
    ones: the LSE and entropy of every token stay consistent (a term dropped and never added back would be an
    error of ~1 in s), log-probs of ignored tokens are 0, and entropies, log-probs and the gradients of the kept
    tokens' terms are as tight as in test_very_confident_entropy_and_its_gradient."""
    inp = confident_inputs()
    ii = int(inp.labels[2])
    ignored = inp.labels == ii
    assert 0 < int(ignored.sum()) < N
    g = torch.Generator(device=inp.hidden.device).manual_seed(7)
    g_entropy, g_logprob = (torch.randn(N, generator=g, device=inp.hidden.device) for _ in range(2))
    # The ignored tokens keep their entropy term: at their dominant column (not a kept label) z - lse comes from
    # the LSE's (hi, lo) pair (test_confident_class_that_is_not_the_label).

    def torch_fn(h, w):
        lp, ent = _torch_logprobs_entropy(inp.labels)(h, w)
        return torch.where(ignored, 0.0, lp), ent

    ours = _logprobs_entropy_run(
        lambda h, w: lce.linear_logprobs_entropy(h, w, inp.labels, ignore_index=ii, tma=mode),
        inp, g_logprob, g_entropy, torch.float32)
    want = _logprobs_entropy_run(torch_fn, inp, g_logprob, g_entropy, torch.float64)
    assert torch.equal(ours[0][ignored], torch.zeros_like(ours[0][ignored]))
    assert (ours[1] - want[1]).abs().max().item() <= 1e-3 * want[1].min().item()
    for what, i, bound in (("logprob", 0, 1e-5), ("d_weight", 3, 1e-4), ("d_hidden", 2, 1e-3)):
        e_k = rel_err(ours[i], want[i])
        assert e_k <= bound, f"{what}: rel err {e_k:.2e} > {bound:.0e}"


CALLS = [("sum 4pass", dict(reduction="sum", sft_path="4pass")), ("mean 3pass", dict(sft_path="3pass")),
         ("sum chunked", dict(reduction="sum", sft_path="chunked")), ("none", dict(reduction="none")),
         ("logprobs 4pass", dict(grad_path="4pass")), ("logprobs 3pass", dict(grad_path="3pass"))]


@pytest.mark.parametrize("name, kwargs", CALLS, ids=[c[0] for c in CALLS])
def test_create_graph_raises(name, kwargs):
    """loss.backward(create_graph=True) (a gradient penalty, a Hessian-vector product) raises on every eager path
    instead of returning first-order gradients as if they were constants: the second-order result would silently
    lack every term through this op."""
    inp = confident_inputs()
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    if name.startswith("logprobs"):
        lp, ent = lce.linear_logprobs_entropy(h, w, inp.labels, tma="never", **kwargs)
        loss = lp.sum() + ent.sum()
    else:
        loss = lce.linear_cross_entropy(h, w, inp.labels, tma="never", **kwargs).sum()
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        torch.autograd.grad(loss, (h, w), create_graph=True)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_path", ["4pass", "3pass"])
@pytest.mark.parametrize("confident", [(0.99, 0.999), (0.999, 0.9999)], ids=["p0.99", "p0.999"])
def test_confident_class_that_is_not_the_label(confident, grad_path, mode):
    """The entropy's gradient where the confident class is not the label (an unlikely kept label, or an ignored
    token), at logits near 50. Two differences of large numbers: at the confident column p (E - z) with
    E - z = -(entropy + log p), small beside the LSE's ulp (~4e-6), so log p = z - lse must not carry the LSE's
    rounding (the backward takes (z - hi) - lo against the forward's fp64 LSE, ``_load_lse``); at the unlikely
    label's column p (A + B log p) must not be formed as (p - 1) X + X (``_label_entry``). Measured on the CPU:
    d_hidden 3e-6 to 7e-6 and d_weight 2e-7 off fp64, relative, where fp32 torch is 3e-5 to 2e-4 and 2e-6 to 9e-6
    off; with one fp32 LSE and (p - 1) X + X at every label, 5e-4 to 4e-3 and 3e-5 to 3e-4."""
    inp = confident_inputs(confident)
    z = ref.reference_logits(inp.hidden, inp.weight)
    top = z.argmax(-1)
    steps = torch.arange(N, device=top.device)
    labels = torch.where(steps % 3 == 0, -100, (top + 1 + steps) % V)
    assert (labels != top).all()
    g = torch.Generator(device=inp.hidden.device).manual_seed(9)
    g_entropy = torch.randn(N, generator=g, device=inp.hidden.device)
    g_logprob = torch.zeros(N, device=inp.hidden.device)
    ours = _logprobs_entropy_run(
        lambda h, w: lce.linear_logprobs_entropy(h, w, labels, tma=mode, grad_path=grad_path),
        inp, g_logprob, g_entropy, torch.float32)
    torch_fn = _torch_logprobs_entropy(labels.clamp(min=0))  # g_logprob = 0: the ignored tokens' pick is unused
    want = _logprobs_entropy_run(torch_fn, inp, g_logprob, g_entropy, torch.float64)
    base = _logprobs_entropy_run(torch_fn, inp, g_logprob, g_entropy, torch.float32)
    for what, i, bound in (("d_weight", 3, 1e-6), ("d_hidden", 2, 2e-5)):
        e_k, e_t = rel_err(ours[i], want[i]), rel_err(base[i], want[i])
        assert e_t > bound, f"{what}: fp32 torch is {e_t:.2e} off, within the bound: the case tests nothing"
        assert e_k <= bound, f"{what}: rel err {e_k:.2e} > {bound:.0e} (fp32 torch: {e_t:.2e})"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grad_path", ["4pass", "3pass"])
def test_unlikely_label_entry(grad_path, mode):
    """The label's own d(logits) entry p (A + B log p) + C at an unlikely label (p ~ 1e-5 to 1e-4) under both
    g_logprob and g_entropy: formed as (p - 1) X + (X + C) it would keep ~ulp(X) of p X, and with C taken as
    (A + C) - A ~ulp(g_entropy entropy) of C; ``_label_entry`` takes p X + C with C from its own terms. The weight
    is the identity, so d_hidden is d(logits) itself, checked entry by entry at the labels against fp64 (fp32
    torch: ~2e-7 relative; the two forms above: 3e-3 and 7e-4)."""
    N_, V_ = 16, 64
    g = torch.Generator(device=DEVICE).manual_seed(6)
    z = torch.randn(N_, V_, generator=g, device=DEVICE)
    labels = torch.randint(0, V_, (N_,), generator=g, device=DEVICE)
    rows = torch.arange(N_, device=DEVICE)
    z[rows, labels] -= 6.0
    weight = torch.eye(V_, device=DEVICE)
    g_logprob = torch.full((N_,), 1e-4, device=DEVICE)
    g_entropy = torch.ones(N_, device=DEVICE)

    def grad(fn, dtype):
        h = z.to(dtype).clone().requires_grad_()
        lp, ent = fn(h, weight.to(dtype))
        ((lp * g_logprob.to(dtype)).sum() + (ent * g_entropy.to(dtype)).sum()).backward()
        return h.grad.double()[rows, labels]

    want = grad(lambda h, w: _torch_logprobs_entropy(labels)(h, w), torch.float64)
    base = grad(lambda h, w: _torch_logprobs_entropy(labels)(h, w), torch.float32)
    got = grad(lambda h, w: lce.linear_logprobs_entropy(h, w, labels, tma=mode, grad_path=grad_path), torch.float32)
    e_k = ((got - want).abs() / want.abs()).max().item()
    e_t = ((base - want).abs() / want.abs()).max().item()
    assert e_k <= max(2 * e_t, 1e-6), f"label entries: rel err {e_k:.2e} (fp32 torch: {e_t:.2e})"
