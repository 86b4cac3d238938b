"""hopperkern.lce against the fp64 reference of its contract (hopperkern/lce/reference.py).

Without a GPU the kernels run under Triton's interpreter (conftest.py), whose LCE config is block_m=16, block_n=32,
block_k=32. The main shape N=37, V=100, H=40 leaves a tail in every tiled dim (37 % 16, 100 % 32, 40 % 32) and has
a partial group of row blocks (3 with group_m=2); test_forward_vocab_splits forces how the forward splits the
vocab. The interpreter's cost is per tile visited, so shapes stay this small. Every numeric case runs on both
memory paths (tma="never" and tma="always") and asserts which one ran. On a CUDA machine the same tests run
compiled kernels; bf16 at real vocab sizes lives in test_lce_gpu.py, which imports the helpers below.
"""

import contextlib
import dataclasses
import math
import re
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F

import conftest
from conftest import DEVICE
from hopperkern import lce, tma
from hopperkern.lce import launch
from hopperkern.lce import reference as ref
from hopperkern.lce import rl as lce_rl
from hopperkern.lce import sft as lce_sft
from hopperkern.lce.ops import lce_backward_op, lce_forward_op
from hopperkern.tuning import KernelConfig

MODES = ("never", "always")
SHAPE = (37, 100, 40)  # N, V, H: a tail in every tiled dim, 3 row blocks x 4 vocab tiles under the interpreter
SMALL = (19, 70, 40)  # still a tail in every dim, half the tiles: for behaviour rather than numerics
FWD, BWD, SFT = "lce.forward", "lce.backward", "lce.sft_dlogits"  # SFT: d(logits) of the 3-pass path
RL = "lce.rl_dlogits"  # d(logits) of the 3-pass path of per-token log-probs and entropies
FP32_RTOL = 1e-5


@pytest.fixture(autouse=True)
def _no_tma_env(monkeypatch):
    """A HOPPERKERN_TMA in the caller's environment would override every mode these tests ask for."""
    monkeypatch.delenv("HOPPERKERN_TMA", raising=False)


# ---------------------------------------------------------------------------------------------------------------
# Helpers (also used by test_lce_gpu.py)


@dataclass
class Inputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: torch.Tensor
    ignore_index: int = -100

    @property
    def kept(self):
        return self.labels != self.ignore_index


CENTER_WEIGHT = 1.0  # make_inputs(centered=True): weight column 0


def make_inputs(shape, dtype=torch.float32, *, bias=False, ignore=0.0, ignore_index=-100, seed=0, device=DEVICE,
                logit_std=2.0, confident=None, centered=False, softcap=None, temperature=1.0):
    """hidden [N, H], weight [V, H] (logits of std ~logit_std), optional bias [V], labels [N], made on ``device``.

    Labels 0 and V-1 (first and tail vocab tile) are always present; with ``ignore`` > 0 about that fraction of
    the tokens, and at least the last one, is ``ignore_index`` (the first stays kept). With ``confident=(lo, hi)``
    every kept token's label probability under the final logits (``softcap``, ``temperature``, bias) lies in
    [lo, hi], checked in fp64 on the rounded inputs; ignored tokens keep their random hidden rows.

    ``centered`` (with ``confident``, no softcap) gives every weight row the component CENTER_WEIGHT in column 0
    (a direction all rows share, as in trained LM heads) and sets each kept token's hidden[:, 0] so that its
    label's raw logit is ~0 rather than ~ln(V / (1 - p)) ~ 20: softmax does not change, but a 16-bit rounding of
    the logits (plain torch's) then keeps p - 1 to ~1e-3 instead of bf16's ~3e-2 at 20, a tighter bar.
    """
    if centered and (not confident or softcap):
        raise ValueError("centered needs confident=(lo, hi) and no softcap (a softcap is not shift-invariant)")
    N, V, H = shape
    g = torch.Generator(device=device).manual_seed(seed)
    kw = dict(device=device, generator=g)
    hidden = torch.randn(N, H, **kw)
    weight = (torch.randn(V, H, **kw) * (logit_std / H**0.5)).to(dtype)
    if centered:
        weight[:, 0] = CENTER_WEIGHT
    b = torch.randn(V, **kw).to(dtype) if bias else None
    labels = torch.randint(0, V, (N,), **kw)
    labels[: min(N, 2)] = torch.tensor([0, V - 1], device=device)[: min(N, 2)]
    if ignore and N:
        drop = torch.rand(N, **kw) < ignore
        drop[0], drop[-1] = False, True
        labels[drop] = ignore_index
    inp = Inputs(hidden, weight, b, labels, ignore_index)
    if confident:
        hidden = _confident_hidden(inp, confident, softcap, temperature, g)
    if centered:
        kept, lab = inp.kept, inp.labels[inp.kept]
        z_lab = (hidden[kept] * weight[lab].double()).sum(-1) + (0.0 if b is None else b[lab].double())
        hidden[kept, 0] -= z_lab / CENTER_WEIGHT
    inp.hidden = hidden.to(dtype)
    if confident:
        p = label_probs(inp, softcap=softcap, temperature=temperature)
        lo, hi = confident
        assert p.numel() and lo <= p.min() and p.max() <= hi, \
            f"confident batch: p_label in [{p.min():.6f}, {p.max():.6f}], wanted [{lo}, {hi}]"
    return inp


def label_probs(inp, *, softcap=None, temperature=1.0):
    """fp64 softmax probability of the label of every kept token of ``inp``, under the final logits."""
    z = ref.reference_logits(inp.hidden, inp.weight, inp.bias, softcap, temperature)
    kept = inp.kept
    return torch.log_softmax(z[kept], -1).gather(1, inp.labels[kept][:, None])[:, 0].exp()


def _confident_hidden(inp, p_range, softcap, temperature, generator):
    """fp64 hidden whose kept rows are moved by alpha * u, so that p_label hits a per-token target drawn
    log-uniformly in 1 - p, a factor 2 inside ``p_range`` on each side to leave room for rounding hidden.

    u raises the raw label logit by exactly alpha and every other logit j by alpha * <w_j, u>; of those u, the one
    along (W^T W)^-1 w[label] keeps sum_j <w_j, u>^2 least, so that with few hidden dims the other logits rise
    slowly enough for a softcap to leave p_label near 1 reachable (a small ridge keeps W^T W invertible)."""
    kept, w = inp.kept, inp.weight.double()
    lab = inp.labels[kept]
    gram = w.T @ w
    gram += torch.eye(len(gram), dtype=gram.dtype, device=gram.device) * (1e-3 * gram.trace() / len(gram))
    u = torch.linalg.solve(gram, w[lab].T).T
    u /= (u * w[lab]).sum(-1, keepdim=True)
    z0, slope = inp.hidden[kept].double() @ w.T, u @ w.T  # raw logits at alpha = 0 and their rate in alpha
    lo, hi = math.log(2 * (1 - p_range[1])), math.log((1 - p_range[0]) / 2)
    q = torch.empty(len(lab), dtype=torch.float64, device=w.device).uniform_(lo, hi, generator=generator)
    target = torch.log1p(-q.exp())

    def log_p(alpha):
        z = ref.final_logits(z0 + alpha[:, None] * slope, inp.bias, softcap, temperature)
        return torch.log_softmax(z, -1).gather(1, lab[:, None])[:, 0]

    # log p_label rises with alpha until a softcap saturates the competitors too (then it falls): take the first
    # point of a grid that reaches the target, and bisect between it and the grid point before.
    grid = torch.arange(-20.0, 80.0, 0.5, dtype=torch.float64, device=w.device)
    first = torch.full_like(q, -1, dtype=torch.long)
    for k, a in enumerate(grid):
        first = torch.where((first < 0) & (log_p(a.expand_as(q)) >= target), k, first)
    if (first <= 0).any():
        raise ValueError(f"confident={p_range}: some label probability is not reachable on the grid")
    a_lo, a_hi = grid[first - 1], grid[first]
    for _ in range(40):
        mid = (a_lo + a_hi) / 2
        below = log_p(mid) < target
        a_lo, a_hi = torch.where(below, mid, a_lo), torch.where(below, a_hi, mid)
    hidden = inp.hidden.double().clone()
    hidden[kept] += a_hi[:, None] * u
    return hidden


def upstream(shape, seed=1, device=DEVICE):
    """A random upstream gradient: N(0, 1) per token, or one number in [0.5, 1.5) for a scalar output."""
    g = torch.Generator(device=device).manual_seed(seed)
    if len(shape) == 0:
        return torch.rand((), generator=g, device=device) + 0.5
    return torch.randn(shape, generator=g, device=device)


def run(fn, inp, ups, *, dtype=None, view=None, requires=(True, True, True), forward_ctx=None):
    """Outputs of ``fn(hidden, weight, bias, labels)`` on fresh leaves (cast to ``dtype``), and the gradients of
    sum_i <out_i, ups[i]> w.r.t. (hidden, weight, bias) (None where not required or absent).

    ``view`` maps the hidden leaf to what ``fn`` gets (a transposed or sliced view keeps its strides);
    ``forward_ctx`` wraps the forward only (e.g. autocast), the backward runs outside it.
    """
    leaves = [None if t is None else t.detach().to(dtype or t.dtype).clone().requires_grad_(r)
              for t, r in zip((inp.hidden, inp.weight, inp.bias), requires)]
    hidden = view(leaves[0]) if view is not None else leaves[0]
    with forward_ctx or contextlib.nullcontext():
        outs = fn(hidden, leaves[1], leaves[2], inp.labels)
    outs = outs if isinstance(outs, tuple) else (outs,)
    pairs = [(o, u.to(o.dtype)) for o, u in zip(outs, ups) if u is not None]
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [u for _, u in pairs])
    return [o.detach() for o in outs], [None if t is None else t.grad for t in leaves]


def call(impl, **kwargs):
    """``fn(hidden, weight, bias, labels)`` calling ``impl(hidden, weight, labels, **kwargs)`` (a kernel,
    reference or torch-baseline function), with ``bias=`` only when there is one."""
    return lambda h, w, b, lab: impl(h, w, lab, **kwargs, **({} if b is None else {"bias": b}))


def assert_close(actual, expected, rtol, what=""):
    """|actual - expected| <= rtol * |expected| + rtol * max|expected| elementwise: relative, with an absolute
    floor at the tensor's scale for entries near zero."""
    e = expected.double()
    scale = e.abs().max().item() if e.numel() else 0.0
    torch.testing.assert_close(actual.double(), e, rtol=rtol, atol=rtol * scale, msg=lambda m: f"{what}: {m}")


def rel_err(x, reference):
    """||x - reference|| / ||reference|| in fp64."""
    r = reference.double()
    return ((x.double() - r).norm() / r.norm().clamp(min=1e-30)).item()


def assert_no_worse(what, got, baseline, reference, *, factor=2.0, atol=1e-5, baseline_max=5e-2):
    """The kernel's relative error against ``reference`` is at most ``factor`` x plain PyTorch's (``baseline``)
    in the same low precision, plus ``atol``; a baseline off by more than ``baseline_max`` means the baseline
    itself is broken (and would make this check vacuous)."""
    e_k, e_t = rel_err(got, reference), rel_err(baseline, reference)
    assert e_t < baseline_max, f"{what}: torch baseline rel err {e_t:.2e}: the baseline is broken"
    assert e_k <= factor * e_t + atol, f"{what}: kernel rel err {e_k:.2e} > {factor} x torch's {e_t:.2e} + {atol:g}"


def torch_lowp_cross_entropy(h, w, lab, *, bias=None, reduction="mean", ignore_index=-100, label_smoothing=0.0,
                             z_loss=0.0, softcap=None, temperature=1.0):
    """Plain PyTorch as a model in h.dtype computes it: logits from F.linear rounded to that dtype, then fp32."""
    z = F.linear(h, w, bias).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temperature
    kept = lab != ignore_index
    loss = F.cross_entropy(z, lab, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    loss = loss + z_loss * torch.where(kept, torch.logsumexp(z, -1) ** 2, 0.0)
    return {"none": loss, "sum": loss.sum(), "mean": loss.sum() / kept.sum().clamp(min=1)}[reduction]


def torch_lowp_logprobs_entropy(h, w, lab, *, temperature=1.0, ignore_index=-100):
    """Plain PyTorch log-probs and entropy from logits rounded to h.dtype, then fp32."""
    logp = torch.log_softmax(F.linear(h, w).float() / temperature, -1)
    lp = logp.gather(1, lab.clamp(min=0)[:, None])[:, 0]
    return torch.where(lab != ignore_index, lp, 0.0), -(logp.exp() * logp).sum(-1)


def expected_use(mode, *, hidden=True, weight=True):
    """TmaDecision.use of the LCE launches: all pointers for "never"; otherwise TMA for every eligible operand,
    except the 3-pass d(logits) passes, whose "auto" takes pointer loads (measured faster)."""
    on = mode != "never"
    return {FWD: {"hidden": on and hidden, "weight": on and weight},
            BWD: {"hidden": on and hidden, "weight": on and weight, "dlogits": on},
            SFT: {"logits": mode == "always", "dlogits": mode == "always"}, RL: {"dlogits": mode == "always"}}


@contextlib.contextmanager
def expect_path(mode, *, backward=True, hidden=True, weight=True, sft=None, rl=False):
    """Assert that the block launched the forward (and the d(logits) kernel of a backward) with ``mode`` and the
    expected per-operand TMA choice (the ops' launch counts prove the launch happened inside the block).
    d(logits) comes from the 4-pass backward (BWD), the 3-pass SFT forward (SFT) or, with ``rl``, the 3-pass
    log-prob backward (RL): ``sft`` True or False asks for one of the first two, None takes either."""
    before = {op: tma.decision_count(op) for op in (FWD, BWD, SFT, RL)}
    yield
    want = expected_use(mode, hidden=hidden, weight=weight)
    launched = {op for op in before if tma.decision_count(op) > before[op]}
    assert FWD in launched, f"{FWD} was not launched"
    stored_exp = "exp_logits" in tma.last_decision(FWD).use
    if backward and stored_exp and not rl:
        # The 3-pass SFT forward over exponentials has no d(logits) pass of its own: row factors stand in for it.
        assert sft is not False, "a 3-pass SFT forward where the 4-pass path was asked for"
        assert not (launched - {FWD}), f"{sorted(launched - {FWD})} launched too"
    elif backward:
        wanted = {RL} if rl else {None: {BWD, SFT}, True: {SFT}, False: {BWD}}[sft]
        assert launched & wanted, f"none of {sorted(wanted)} was launched (launched: {sorted(launched)})"
        assert not (launched - wanted - {FWD}), f"{sorted(launched - wanted - {FWD})} launched too"
    if stored_exp:
        # A 3-pass forward without softcap stores its exponentials (a third operand); the log-prob path's
        # d(logits) kernel reads and writes that one buffer in place (TMA only under "always").
        want[FWD] = dict(want[FWD], exp_logits=mode != "never")
        if rl:
            assert RL in launched, f"a forward stored its exponentials without {RL}"
            want[RL] = {"dlogits": mode == "always"}  # "auto": pointer loads, measured faster for this pass
    for op in launched:
        d = tma.last_decision(op)
        assert (d.mode, dict(d.use)) == (mode, want[op]), d
        if mode == "auto" and op in (SFT, RL):
            # "auto" takes pointer loads there and says why: the pass over fp32 logits or over exponentials.
            why = lce_sft._DLOGITS_POINTER if "logits" in d.use else lce_rl._EXP_POINTER
            assert all(r == (why,) for r in d.reasons.values()), d


def check_grads(grads, want, rtol, dtype=torch.float32):
    for name, g, w in zip(("d_hidden", "d_weight", "d_bias"), grads, want):
        if w is None:
            assert g is None, f"{name} should not exist"
            continue
        assert g is not None and g.dtype == dtype and g.shape == w.shape, name
        assert_close(g, w, rtol, name)


def check_fp32(mode, kernel_fn, ref_fn, inp, ups, *, path=None, **run_kw):
    """Run ``kernel_fn`` (asserting it takes memory path ``mode``, with ``path`` overrides for expect_path) and
    ``ref_fn`` in fp64 on the same fp32 inputs and upstream grads; outputs and grads must agree to FP32_RTOL.
    Returns the kernel's (outputs, grads)."""
    with expect_path(mode, **(path or {})):
        outs, grads = run(kernel_fn, inp, ups, **run_kw)
    want, want_grads = run(ref_fn, inp, ups, dtype=torch.float64, **run_kw)
    for i, (o, w) in enumerate(zip(outs, want)):
        assert o.dtype == torch.float32 and o.shape == w.shape, f"output {i}"
        assert_close(o, w, FP32_RTOL, f"output {i}")
    check_grads(grads, want_grads, FP32_RTOL)
    return outs, grads


# ---------------------------------------------------------------------------------------------------------------
# The reference itself


@dataclass(frozen=True)
class Case:
    name: str
    why: str
    options: dict = field(default_factory=dict)
    reduction: str = "mean"
    bias: bool = False
    ignore: float = 0.0
    confident: tuple | None = None  # (lo, hi): p_label of every kept token lies in [lo, hi]
    centered: bool = False  # with confident: label logits ~0 (see make_inputs)

    def inputs(self, shape=SHAPE, dtype=torch.float32):
        return make_inputs(shape, dtype, bias=self.bias, ignore=self.ignore,
                           ignore_index=self.options.get("ignore_index", -100), confident=self.confident,
                           centered=self.centered, softcap=self.options.get("softcap"),
                           temperature=self.options.get("temperature", 1.0))

    def ups(self, shape=SHAPE):
        return [upstream((shape[0],) if self.reduction == "none" else ())]

    def fn(self, impl, **extra):
        return call(impl, reduction=self.reduction, **self.options, **extra)


ALL = dict(label_smoothing=0.1, z_loss=0.02, softcap=3.0, temperature=0.7)
CASES = [
    Case("plain", "no options: N, V, H tails masked, vocab splits merged, a label in the tail tile"),
    Case("bias", "bias on every logit; d_bias = column sums of d(logits)", bias=True, reduction="sum"),
    Case("label_smoothing", "eps/V * sum(z) from the split sums and its uniform gradient",
         dict(label_smoothing=0.1)),
    Case("z_loss", "z_loss * lse^2 per kept token and its 2 z_loss lse p gradient", dict(z_loss=0.02),
         reduction="none"),
    Case("softcap", "softcap * tanh(z / softcap) (tanh via exp) and its (1 - tanh^2) factor, also at the label",
         dict(softcap=3.0)),
    Case("temperature", "z / T in the softmax and 1/T in the gradient", dict(temperature=0.7), reduction="sum"),
    Case("ignore_index=5", "a custom ignore_index inside [0, V): those tokens leave loss, count and grads",
         dict(ignore_index=5), ignore=0.3, reduction="none"),
    Case("all/none", "every option + bias + ignored tokens; per-token loss, random per-token upstream grads",
         ALL, bias=True, ignore=0.3, reduction="none"),
    Case("all/mean", "every option + bias + ignored tokens; mean over kept tokens only", ALL, bias=True,
         ignore=0.3),
    Case("all/sum", "every option + bias + ignored tokens; sum", ALL, bias=True, ignore=0.3, reduction="sum"),
]
CASE_IDS = {"ids": lambda c: c.name}


@pytest.mark.parametrize("case", CASES, **CASE_IDS)
def test_reference_matches_f_cross_entropy(case):
    """The oracle is right: the reference equals F.cross_entropy on explicitly built fp64 logits (+ z-loss)."""
    inp = case.inputs()
    o = dict(case.options)
    ii, softcap, temp, zl = o.pop("ignore_index", -100), o.pop("softcap", None), o.pop("temperature", 1.0), \
        o.pop("z_loss", 0.0)
    z = inp.hidden.double() @ inp.weight.double().T
    if inp.bias is not None:
        z = z + inp.bias.double()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z = z / temp
    per_token = F.cross_entropy(z, inp.labels, ignore_index=ii, reduction="none", **o)
    per_token = per_token + zl * torch.logsumexp(z, -1) ** 2 * inp.kept
    want = {"none": per_token, "sum": per_token.sum(), "mean": per_token.sum() / inp.kept.sum()}[case.reduction]
    got = case.fn(ref.linear_cross_entropy)(inp.hidden, inp.weight, inp.bias, inp.labels)
    assert got.dtype == torch.float32
    assert_close(got, want, 1e-6, case.name)


def test_reference_logprobs_entropy_matches_torch():
    """The oracle is right: log-probs equal log_softmax gathered (0 at ignored), entropy equals Categorical's."""
    inp = make_inputs(SMALL, ignore=0.3)
    z = (inp.hidden.double() @ inp.weight.double().T) / 0.7
    lp, ent = ref.linear_logprobs_entropy(inp.hidden, inp.weight, inp.labels, temperature=0.7)
    want_lp = torch.log_softmax(z, -1).gather(1, inp.labels.clamp(min=0)[:, None])[:, 0] * inp.kept
    assert_close(lp, want_lp, 1e-6, "logprob")
    assert_close(ent, torch.distributions.Categorical(logits=z).entropy(), 1e-6, "entropy")


# ---------------------------------------------------------------------------------------------------------------
# linear_cross_entropy: numerics on both memory paths


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, **CASE_IDS)
def test_linear_cross_entropy_fp32(case, mode):
    """fp32 loss and d_hidden, d_weight, d_bias match the fp64 reference to ~1e-5 relative."""
    inp = case.inputs()
    (loss,), _ = check_fp32(mode, case.fn(lce.linear_cross_entropy, tma=mode), case.fn(ref.linear_cross_entropy),
                            inp, case.ups())
    if case.reduction == "none":
        assert (loss[~inp.kept] == 0).all(), "ignored tokens must have loss exactly 0"


FP16_CASES = [c for c in CASES if c.name in ("plain", "all/none")]
CONFIDENT = (0.99, 0.9999)  # p_label of every kept token of a confident batch
# A confident token's loss (and log-prob) is ~1e-3, which the kernels form as z_label - lse from two fp32 sums of
# size ~|z| (the label's row dot, the LSE): ~1e-6 off per token, ~1e-3 of its value, up to ~2e-4 of a small batch's
# mean. Plain torch's per-token errors from 16-bit logits are as large or larger, but its error on one scalar can
# by chance be far smaller (or its logits nearly exact, with label logits ~0), so outputs get this absolute floor.
CONFIDENT_LOSS_ATOL = 2e-4
CONFIDENT_ALL = dict(ALL, softcap=30.0)  # softcap 3 caps p_label below 0.99 at V=100; Gemma-2 uses 30
CONFIDENT_CASES = [
    Case("confident/mean", "p_label -> 1: d(logits) at the label is p - 1, lost if p is rounded before the 1 is "
         "subtracted", ignore=0.2, confident=CONFIDENT),
    Case("confident/sum", "the same under reduction='sum'", reduction="sum", ignore=0.2, confident=CONFIDENT),
    Case("confident/none", "per-token upstream grads of both signs", reduction="none", ignore=0.2,
         confident=CONFIDENT),
    Case("confident/label_smoothing", "p - (1 - eps) - eps/V at the label, p - eps/V elsewhere",
         dict(label_smoothing=0.1), ignore=0.2, confident=CONFIDENT),
    Case("confident/z_loss", "p (1 + 2 z_loss lse) - 1 at the label", dict(z_loss=0.02), reduction="none",
         ignore=0.2, confident=CONFIDENT),
    Case("confident/softcap", "(1 - tanh^2) at the label from the forward's z_label", dict(softcap=30.0),
         ignore=0.2, confident=CONFIDENT),
    Case("confident/temperature", "1/T on the label column as on the others", dict(temperature=0.7),
         reduction="sum", ignore=0.2, confident=CONFIDENT),
    Case("confident/all", "every option + bias + per-token upstream grads", CONFIDENT_ALL, bias=True,
         reduction="none", ignore=0.2, confident=CONFIDENT),
    Case("confident/centered", "label logits ~0: torch's fp16 logits keep p - 1, so its error is the output "
         "rounding alone, the tightest bar (the GPU's bf16 batches)", bias=True, reduction="none", ignore=0.2,
         confident=CONFIDENT, centered=True),
]


def check_no_worse(mode, kernel_fn, ref_fn, base_fn, inp, ups, names, *, out_atol=1e-5, view=None, path=None):
    """Run ``kernel_fn`` (asserting it takes memory path ``mode``; ``path``: expect_path's other arguments),
    ``ref_fn`` in fp64 and ``base_fn`` (plain PyTorch in the inputs' precision) on the same rounded inputs and
    upstream grads (``view``: as in :func:`run`): the kernel's outputs (fp32, called ``names``; ``out_atol`` added
    to their bar) and grads (in the inputs' dtype) are each within 2x torch's error of fp64."""
    with expect_path(mode, **(path or {})):
        outs, grads = run(kernel_fn, inp, ups, view=view)
    want, want_grads = run(ref_fn, inp, ups, dtype=torch.float64, view=view)
    base, base_grads = run(base_fn, inp, ups, view=view)
    for name, o, b, w in zip(names, outs, base, want):
        assert o.dtype == torch.float32, name
        assert_no_worse(name, o, b, w, atol=out_atol)
    for name, g, b, w in zip(("d_hidden", "d_weight", "d_bias"), grads, base_grads, want_grads):
        if w is not None:
            assert g.dtype == inp.hidden.dtype, name
            assert_no_worse(name, g, b, w)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", FP16_CASES + CONFIDENT_CASES, **CASE_IDS)
def test_linear_cross_entropy_fp16_no_worse_than_torch(case, mode):
    """fp16 loss and grads are within 2x plain PyTorch's fp16 error (logits from an fp16 GEMM) of fp64, also for
    confident predictions, where d(logits) at the label must be formed in fp32 and rounded to fp16 once."""
    check_no_worse(mode, case.fn(lce.linear_cross_entropy, tma=mode), case.fn(ref.linear_cross_entropy),
                   case.fn(torch_lowp_cross_entropy), case.inputs(dtype=torch.float16), case.ups(), ("loss",),
                   out_atol=CONFIDENT_LOSS_ATOL if case.confident else 1e-5)


def _confident_case(name):
    return next(c for c in CONFIDENT_CASES if c.name == name)


@pytest.mark.parametrize("name", ["confident/mean", "confident/all", "confident/centered"])
def test_torch_baseline_is_right_for_confident_predictions(name):
    """The bar of the confident tests means something: torch's fp16 baseline (fp32 cross-entropy, d(logits) cast
    to fp16 once in F.linear's backward) has grads within 1e-2 of fp64."""
    case = _confident_case(name)
    inp, ups = case.inputs(dtype=torch.float16), case.ups()
    _, want_grads = run(case.fn(ref.linear_cross_entropy), inp, ups, dtype=torch.float64)
    _, base_grads = run(case.fn(torch_lowp_cross_entropy), inp, ups)
    errs = [rel_err(b, w) for b, w in zip(base_grads, want_grads) if w is not None]
    assert max(errs) < 1e-2, errs


def test_confident_batch_exposes_double_rounding():
    """The confident batches discriminate: d(logits) = g (p - onehot) rounded to fp16 once as p g and again after
    the label's -g is added gives a d_hidden more than 5x as far from fp64 as torch's."""
    case = _confident_case("confident/mean")
    inp, ups = case.inputs(dtype=torch.float16), case.ups()
    _, (want, _, _) = run(case.fn(ref.linear_cross_entropy), inp, ups, dtype=torch.float64)
    _, (base, _, _) = run(case.fn(torch_lowp_cross_entropy), inp, ups)
    z = ref.reference_logits(inp.hidden, inp.weight)
    g = (ups[0].double() / inp.kept.sum() * inp.kept)[:, None]  # upstream grad of each token's loss (mean)
    onehot = F.one_hot(inp.labels.clamp(min=0), z.shape[1]) * g
    twice = ((torch.softmax(z, -1) * g).half().double() - onehot).half().double()
    assert rel_err(twice @ inp.weight.double(), want) > 5 * rel_err(base, want)


@pytest.mark.parametrize("mode", MODES)
def test_several_vocab_slices_in_backward(mode, monkeypatch):
    """A small d(logits) budget cuts the 4-pass backward into 4 vocab slices of 32 columns (the last of 4): labels
    and bias grads land in the right slice."""
    case = CASES[-1]
    monkeypatch.setattr(launch, "DLOGITS_BUDGET", SHAPE[0] * 4 * 32)
    check_fp32(mode, case.fn(lce.linear_cross_entropy, tma=mode, sft_path="4pass"), case.fn(ref.linear_cross_entropy),
               case.inputs(), case.ups(), path=dict(sft=False))


@pytest.mark.parametrize("N, V, sm_count", [(37, 100, 1), (37, 100, 4), (1, 128256, 132), (8192, 128256, 132),
                                             (131072, 151936, 132), (17000, 128256, 132), (262144, 128256, 132)])
def test_forward_plan_invariants(N, V, sm_count):
    """Whatever the split heuristic: every vocab tile in exactly one split, no empty split, the per-split
    statistics within STATS_BUDGET and splits of at least _MIN_SPLIT_COLS columns (or a single split), unless
    more splits are needed to give every SM a program."""
    for cfg in (KernelConfig(block_m=16, block_n=32, block_k=32), KernelConfig(block_m=128, block_n=256, block_k=64)):
        S, tps = launch.forward_plan(N, V, cfg, sm_count)
        num_vt = -(-V // cfg.block_n)
        num_rb = -(-N // cfg.block_m)
        assert S >= 1 and tps >= 1 and (S - 1) * tps < num_vt <= S * tps, (S, tps, num_vt)
        assert S == 1 or 20 * S * N <= launch.STATS_BUDGET
        assert S == 1 or V // S >= launch._MIN_SPLIT_COLS or num_rb * (S - 1) < sm_count, \
            "each split must cover at least _MIN_SPLIT_COLS columns unless SMs would be left without a program"


def _waves_cost(N, V, cfg, sm_count, S, tps):
    """forward_plan's estimate of a plan's time: waves of programs times (tiles per program + start-up)."""
    num_rb = -(-N // cfg.block_m)
    return -(-num_rb * S // sm_count) * (tps + launch._PROGRAM_COST)


def _cap_plan(N, V, cfg, sm_count, fill=True):
    """The split plan of forward_plan's cap alone: the most splits its limits allow (``fill``: also enough to give
    every SM a program). Without ``fill`` it is the plan of the storing forwards."""
    num_rb, num_vt = -(-N // cfg.block_m), -(-V // cfg.block_n)
    s_max = max(1, min(num_vt, launch.STATS_BUDGET // (20 * N)))
    cols = max(1, V // launch._MIN_SPLIT_COLS)
    cap = max(1, min(s_max, max(cols, -(-sm_count // num_rb)) if fill else cols,
                     -(-launch._TARGET_WAVES * sm_count // num_rb)))
    tps = -(-num_vt // cap)
    return cap, -(-num_vt // tps), tps


# (N, V) -> the plan (S, tiles per split) at 128 x 128 tiles on 132 SMs: the searched plan where the cap's needs at
# most 5 waves, else the cap's.
PINNED_PLANS = {(1937, 152064): (33, 36), (2169, 151936): (23, 52), (256, 128256): (63, 16),
                (2048, 128256): (16, 63), (3072, 128256): (31, 33), (8192, 128256): (31, 33),
                (16384, 152064): (21, 57), (32768, 128256): (11, 92), (37, 100): (1, 1)}


@pytest.mark.parametrize("N, V", list(PINNED_PLANS))
def test_forward_plan_fills_waves(N, V):
    """Where the cap's plan runs in at most 5 waves (_FEW_WAVES), the split plan is the one with the smallest
    estimate waves * (tiles per split + start-up) among the split counts from the cap down to half of it (the
    larger on a tie), so never worse than the cap's plan, whose last wave may hold a few programs; with more
    waves it is the cap's plan; for forwards that store per logit (weigh_waves=False) it is the cap's plan
    without the fill rule. At 1937 x 3584 x 152064 on 132 SMs: 33 splits of 36 tiles (four full waves) where the
    cap's 36 splits of 33 tiles need a fifth wave for 48 programs; at 256 tokens (2 row blocks) 126 of the 132
    SMs get a program."""
    cfg = KernelConfig(block_m=128, block_n=128, block_k=64)
    S, tps = launch.forward_plan(N, V, cfg, 132)
    assert (S, tps) == PINNED_PLANS[(N, V)]
    assert launch.forward_plan(N, V, cfg, 132, False) == _cap_plan(N, V, cfg, 132, fill=False)[1:]
    assert launch.forward_plan(N, V, cfg, 1) == _cap_plan(N, V, cfg, 1, fill=False)[1:], "one SM: no search"
    num_rb, num_vt = -(-N // 128), -(-V // 128)
    cap, cap_S, cap_tps = _cap_plan(N, V, cfg, 132)
    if -(-num_rb * cap_S // 132) > 5:
        assert (S, tps) == (cap_S, cap_tps)
        return
    best = None
    for s in range(cap, (cap - 1) // 2, -1):
        t = -(-num_vt // s)
        cost = _waves_cost(N, V, cfg, 132, -(-num_vt // t), t)
        if best is None or cost < best[0]:
            best = (cost, -(-num_vt // t), t)
    assert (S, tps) == best[1:]
    assert _waves_cost(N, V, cfg, 132, S, tps) <= _waves_cost(N, V, cfg, 132, cap_S, cap_tps)


def test_forward_plan_weighs_waves_only_without_stores(monkeypatch):
    """lce_forward asks forward_plan to weigh the last wave's fill only for forwards that store nothing per logit
    (the 3-pass paths' forwards that store exponentials or logits keep the cap's plan)."""
    asked = []
    real = launch.forward_plan
    monkeypatch.setattr(launch, "forward_plan", lambda *args: asked.append(args) or real(*args))
    N, V, H = 40, 48, 32
    h = torch.randn(N, H, device=DEVICE)
    w = torch.randn(V, H, device=DEVICE)
    y = torch.randint(0, V, (N,), device=DEVICE)
    cfg = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    opts = launch.LceOptions()
    launch.lce_forward(h, w, y, None, opts, config=cfg)
    launch.lce_forward(h, w, y, None, opts, config=cfg, z_out=torch.empty(N, V, device=DEVICE))
    e = torch.empty(N, V, device=DEVICE)
    launch.lce_forward(h, w, y, None, opts, config=cfg, e_out=(e, torch.empty(N, V // 16, device=DEVICE)))
    assert [args[4] for args in asked] == [True, False, False]


PLANS = [pytest.param((1, 7), id="1 split of all 7 tiles"), pytest.param((3, 3), id="3 splits of 3, 3, 1 tiles"),
         pytest.param((7, 1), id="7 splits of 1 tile")]


# Where a forward takes its labels' logits from: (pick_label, launch._LABEL_MMA).
LABEL_SOURCES = [pytest.param((True, False), id="label from tiles"),
                 pytest.param((True, True), id="label from the label kernel"),
                 pytest.param((False, None), id="label from row dot")]


@pytest.mark.parametrize("source", LABEL_SOURCES)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", PLANS)
def test_forward_vocab_splits(plan, mode, source, monkeypatch):
    """A forced config (block_n=16: 7 vocab tiles, 3 row blocks) and a forced (splits, tiles per split) plan:
    the online LSE inside a split and the merge across splits give per-token loss, log-prob, entropy and LSE
    equal to the reference with every option set (bias, softcap, temperature), whatever the split heuristic
    picks; the label's logit picked from the tiles (each split's pick merged), computed by lce_label_mma_kernel,
    or taken from the row dot product."""
    pick_label, by_mma = source
    monkeypatch.setattr(launch, "_LABEL_MMA", by_mma)
    cfg = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    asked = []
    monkeypatch.setattr(launch, "forward_plan", lambda *args: asked.append(args) or plan)
    inp = make_inputs(SHAPE, bias=True, ignore=0.3)
    with expect_path(mode, backward=False):
        loss, lp, ent, lse = launch.lce_forward(inp.hidden, inp.weight, inp.labels, inp.bias,
                                                launch.LceOptions(tma=mode, **ALL), config=cfg, pick_label=pick_label)
    assert len(asked) == 1, "lce_forward must take its plan from forward_plan"
    z = ref.reference_logits(inp.hidden, inp.weight, inp.bias, ALL["softcap"], ALL["temperature"])
    logp = torch.log_softmax(z, -1)
    assert_close(loss, ref.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, bias=inp.bias, reduction="none",
                                                **ALL), FP32_RTOL, "loss")
    assert_close(lp, logp.gather(1, inp.labels.clamp(min=0)[:, None])[:, 0] * inp.kept, FP32_RTOL, "logprob")
    assert_close(ent, -(logp.exp() * logp).sum(-1), FP32_RTOL, "entropy")
    assert_close(lse, torch.logsumexp(z, -1), FP32_RTOL, "lse")


@pytest.mark.parametrize("by_mma", [False, True], ids=["pick in tiles", "label kernel"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("plan", [PLANS[0], PLANS[2]])
def test_label_pick_at_tile_edges(plan, mode, by_mma, monkeypatch):
    """The forward's label pick, which runs only in the vocab tiles that hold a label of their rows, misses no
    label: with labels clustered (row block 0 all in tile 1; row block 1 only at the last column of tile 0 and the
    first of tile 3, so each of those tiles holds one label, at its edge; row block 2 in the ragged tail tile and
    ignored), log p, loss and LSE equal the fp64 reference. (Picking in a tile without a label adds exactly 0, so
    no result can show that such tiles are skipped; this guards against skipping one that holds a label.) The
    label kernel (lce_label_mma_kernel, the GPU's way for 16-bit inputs) gives the same on these labels: repeated
    ones, the first and last vocab rows, ignored rows and a ragged last row block."""
    monkeypatch.setattr(launch, "_LABEL_MMA", by_mma)
    monkeypatch.setattr(launch, "forward_plan", lambda *args: plan)
    N, V, H = SHAPE
    cfg = KernelConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=1)
    inp = make_inputs(SHAPE)
    labels = torch.empty(N, dtype=torch.int64, device=DEVICE)
    labels[:16] = 16 + torch.arange(16) % 16          # tile 1 only
    labels[16:32] = torch.tensor([15, 48] * 8)  # the last column of tile 0, the first of tile 3
    labels[32:] = torch.tensor([V - 1, -100, 96, V - 1, -100])[: N - 32]  # tail tile (96..99) and ignored rows
    with expect_path(mode, backward=False):
        loss, lp, _, lse = launch.lce_forward(inp.hidden, inp.weight, labels, None, launch.LceOptions(tma=mode),
                                              config=cfg, pick_label=True)
    z = ref.reference_logits(inp.hidden.double(), inp.weight.double(), None, None, 1.0)
    logp = torch.log_softmax(z, -1)
    want = torch.where(labels != -100, logp.gather(1, labels.clamp(min=0)[:, None])[:, 0], 0.0)
    assert_close(lp, want, FP32_RTOL, "logprob")
    assert_close(loss, -want, FP32_RTOL, "loss")
    assert_close(lse, torch.logsumexp(z, -1), FP32_RTOL, "lse")


def _hopper(monkeypatch, hopper_mma: bool):
    """Make ``tma.capability`` report a device whose tensor-core products hopper_mma says (any device asked)."""
    fake = dataclasses.replace(tma.capability(), hopper_mma=hopper_mma)
    monkeypatch.setattr(tma, "capability", lambda device=None: fake)


@pytest.mark.parametrize("hopper", [True, False], ids=["hopper", "other device"])
def test_label_kernel_where_its_products_are_the_tiles(hopper, monkeypatch):
    """lce_label_mma_kernel stands in for the in-tile pick where its tensor-core products equal the forward's tiles
    bit for bit (16-bit inputs on a Hopper GPU: Capability.hopper_mma; checked bitwise by the GPU tests) and the
    tiles are wide enough (128 x 256) for the pick to spill; never for fp32 inputs (an FMA dot) or on any other
    device (the interpreter's numpy dot among them)."""
    real = tma.capability
    _hopper(monkeypatch, hopper)
    wide = KernelConfig(block_m=128, block_n=256, block_k=64, group_m=16, num_warps=8, num_stages=3)
    narrow = KernelConfig(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=4)
    assert launch._LABEL_MMA is None
    assert launch.label_by_mma(torch.bfloat16, DEVICE, wide) is hopper
    assert launch.label_by_mma(torch.float16, DEVICE, wide) is hopper
    assert not launch.label_by_mma(torch.bfloat16, DEVICE, narrow)
    assert not launch.label_by_mma(torch.float32, DEVICE, wide)
    monkeypatch.setattr(tma, "capability", real)  # this machine's own device
    here = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] == 9 and torch.version.hip is None
    assert tma.capability(DEVICE).hopper_mma is here
    assert launch.label_by_mma(torch.bfloat16, DEVICE, wide) is here


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("mode", MODES)
def test_label_kernel_shard_local_labels(mode, dtype, monkeypatch):
    """lce_label_mma_kernel's labels outside [0, V) (another vocab shard's, negative; ignored ones) and a row
    block of 64 rows over 37 tokens: the per-split statistics of a stats-only forward hold the label's logit for
    every label inside the shard and 0 for the others, as the in-tile pick gives them (fp16 and fp32, bias,
    softcap, temperature), within fp32 rounding under the interpreter."""
    N, V, H = SHAPE
    inp = make_inputs(SHAPE, dtype, bias=True)
    labels = inp.labels.clone()
    labels[3::4] = -7  # held by another shard
    labels[5::9] = -100
    labels[6], labels[10] = V, V + 3  # outside the shard above it (unchecked labels reach the kernels so)
    labels[11] = 2**32 + 1  # column 1 if narrowed to int32 before the range check
    opts = launch.LceOptions(tma=mode, ignore_index=-100, softcap=3.0, temperature=0.7)
    cfg = KernelConfig(block_m=16, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1)
    zl = {}
    for by_mma in (False, True):
        monkeypatch.setattr(launch, "_LABEL_MMA", by_mma)
        stats = launch.lce_forward(inp.hidden, inp.weight, labels, inp.bias, opts, config=cfg, pick_label=True,
                                   stats_only=True)
        zl[by_mma] = stats[-1].sum(0)
    if mode == "never":
        # Strided operands (pointer loads only): hidden and weight as transposed views of column-major copies.
        h_t = inp.hidden.t().contiguous().t()
        w_t = inp.weight.t().contiguous().t()
        assert h_t.stride(1) != 1 and w_t.stride(1) != 1
        stats = launch.lce_forward(h_t, w_t, labels, inp.bias, opts, config=cfg, pick_label=True, stats_only=True)
        assert_close(stats[-1].sum(0), zl[True], 1e-5, "label kernel on strided operands")
    z = ref.reference_logits(inp.hidden.double(), inp.weight.double(), inp.bias.double(), 3.0, 0.7)
    inside = (labels >= 0) & (labels < V)
    want = torch.where(inside, z.gather(1, labels.clamp(0, V - 1)[:, None])[:, 0], 0.0)
    assert_close(zl[False], want, 1e-5 if dtype == torch.float32 else 1e-3, "picked label logit")
    assert torch.equal(zl[True] == 0, ~inside), "the label kernel's zeros are the labels outside the shard"
    assert_close(zl[True], zl[False], 1e-5, "label kernel against the in-tile pick")


def test_label_pick_only_when_a_backward_follows(monkeypatch):
    """The public functions pick the label's logit from the tiles exactly when autograd records the call
    (a backward will need p - 1 to full precision), and take the cheaper row dot product otherwise."""
    seen = []
    real = launch.lce_forward
    spy = lambda *a, **k: seen.append(k["pick_label"]) or real(*a, **k)  # noqa: E731
    monkeypatch.setattr("hopperkern.lce.ops.lce_forward", spy)
    monkeypatch.setattr("hopperkern.lce.sft.lce_forward", spy)  # the 3-pass path of a differentiable mean loss
    inp = make_inputs(SMALL)
    w = inp.weight.clone().requires_grad_()
    lce.linear_logprobs_entropy(inp.hidden, w, inp.labels)
    with torch.no_grad():
        lce.linear_logprobs_entropy(inp.hidden, w, inp.labels)
    lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels)
    lce.linear_cross_entropy(inp.hidden.clone().requires_grad_(), inp.weight, inp.labels)
    assert seen == [True, False, False, True]


@pytest.mark.parametrize("mode", MODES)
def test_all_tokens_ignored(mode):
    """All tokens ignored: mean is exactly 0.0 (not NaN) and every gradient is exactly zero."""
    inp = make_inputs(SMALL, bias=True)
    inp.labels.fill_(-100)
    with expect_path(mode):
        (loss,), grads = run(call(lce.linear_cross_entropy, label_smoothing=0.1, z_loss=0.02, tma=mode), inp,
                             [upstream(())])
    assert loss.item() == 0.0
    for g, t in zip(grads, (inp.hidden, inp.weight, inp.bias)):
        assert g.shape == t.shape and not g.any()


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("lead", [(0,), (2, 0)], ids=["N=0", "B=2,T=0"])
def test_zero_tokens(lead, reduction):
    """No tokens: labels.shape (or scalar 0.0) comes back without a launch, and all grads are zeros."""
    inp = make_inputs((0, SMALL[1], SMALL[2]), bias=True)
    inp.hidden, inp.labels = inp.hidden.reshape(*lead, SMALL[2]), inp.labels.reshape(lead)
    ups = [upstream(lead if reduction == "none" else ())]
    (loss,), grads = run(call(lce.linear_cross_entropy, reduction=reduction, tma="always"), inp, ups)
    assert loss.shape == (lead if reduction == "none" else ()) and loss.dtype == torch.float32
    assert not loss.any()
    for g, t in zip(grads, (inp.hidden, inp.weight, inp.bias)):
        assert g.shape == t.shape and not g.any()
    inp.bias = None
    (lp, ent), grads = run(call(lce.linear_logprobs_entropy), inp, [upstream(lead)] * 2)
    assert lp.shape == ent.shape == lead and grads[0].shape == inp.hidden.shape and not grads[1].any()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_3d_hidden(layout, mode):
    """hidden [B, T, H] with int32 labels [B, T] (also a [T, B, H].transpose(0, 1) view that must be copied):
    per-token loss of shape [B, T] and grads match the reference."""
    B, T, V, H = 2, 10, SMALL[1], SMALL[2]
    inp = make_inputs((B * T, V, H), ignore=0.2)
    if layout == "contiguous":
        inp.hidden, view = inp.hidden.view(B, T, H), None
    else:
        inp.hidden, view = inp.hidden.view(T, B, H), (lambda x: x.transpose(0, 1))
    inp.labels = inp.labels.view(B, T).int()
    (loss,), _ = check_fp32(mode, call(lce.linear_cross_entropy, reduction="none", tma=mode),
                            call(ref.linear_cross_entropy, reduction="none"), inp, [upstream((B, T))], view=view)
    assert loss.shape == (B, T)


@pytest.mark.parametrize("mode", MODES)
def test_1d_hidden_single_token(mode):
    """hidden [H] with a 0-d label: a 0-d per-token loss, equal to the mean, with grads."""
    inp = make_inputs((1, SMALL[1], SMALL[2]))
    inp.hidden, inp.labels = inp.hidden[0], inp.labels[0]
    (loss,), _ = check_fp32(mode, call(lce.linear_cross_entropy, reduction="none", tma=mode),
                            call(ref.linear_cross_entropy), inp, [upstream(())])
    assert loss.shape == ()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("frozen, bias", [
    ("weight", False), ("hidden", False), ("weight", True), ("hidden", True)])
def test_frozen_inputs(frozen, bias, mode):
    """Only one of hidden/weight requires grad (frozen LM head, or frozen features): that one is right, the
    other gets none."""
    requires = (frozen != "hidden", frozen != "weight", bias)
    check_fp32(mode, call(lce.linear_cross_entropy, tma=mode), call(ref.linear_cross_entropy),
               make_inputs(SMALL, bias=bias), [upstream(())], requires=requires)


# ---------------------------------------------------------------------------------------------------------------
# Layouts and the TMA decision


@dataclass(frozen=True)
class Layout:
    name: str
    why: str
    make: object  # hidden [N, H] -> the tensor that becomes the leaf
    view: object  # leaf -> the hidden [N, H] view passed to the op
    tma_reason: str | None  # None: TMA-eligible; else a reason tma="always" must give


N_S, V_S, H_S = SMALL
LAYOUTS = [
    Layout("transposed", "stride(-1) != 1: pointer path only", lambda h: h.t().contiguous(), lambda x: x.t(),
           f"hidden: last stride is {N_S}, must be 1"),
    Layout("odd pitch", "column slice with a row pitch of 41 floats: not a multiple of 16 bytes",
           lambda h: torch.cat([h, h[:, :1]], 1), lambda x: x[:, :H_S],
           f"hidden: stride(0)={(H_S + 1) * 4} bytes is not a multiple of 16"),
    Layout("aligned slice", "column slice at a 32-byte offset with a 224-byte pitch: TMA reads it in place",
           lambda h: F.pad(h, (8, 8)), lambda x: x[:, 8:8 + H_S], None),
]


@pytest.mark.parametrize("mode", ["auto", "always", "never"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: lay.name)
def test_noncontiguous_hidden(layout, mode):
    """A strided hidden view: "auto" falls back to pointers for hidden only, "always" raises UnsupportedError
    listing the reason (or uses TMA when the view is eligible), "never" uses pointers; results stay right."""
    inp, ups = make_inputs(SMALL, bias=True, ignore=0.2), [upstream(())]
    inp.hidden = layout.make(inp.hidden)
    fn = call(lce.linear_cross_entropy, tma=mode)
    if mode == "always" and layout.tma_reason:
        with pytest.raises(tma.UnsupportedError, match=re.escape(layout.tma_reason)) as err:
            run(fn, inp, ups, view=layout.view)
        assert "see: python -m hopperkern.info" in str(err.value)
        return
    check_fp32(mode, fn, call(ref.linear_cross_entropy), inp, ups, view=layout.view,
               path=dict(hidden=layout.tma_reason is None))


@pytest.mark.parametrize("mode", ["auto", "always"])
def test_transposed_weight(mode):
    """weight [V, H] as a transposed [H, V] tensor (stride(-1) = V): pointer path for weight under "auto",
    UnsupportedError under "always"."""
    inp, ups = make_inputs(SMALL), [upstream(())]
    inp.weight = inp.weight.t().contiguous().t()
    fn = call(lce.linear_cross_entropy, tma=mode)
    if mode == "always":
        with pytest.raises(tma.UnsupportedError, match=re.escape(f"weight: last stride is {V_S}, must be 1")):
            fn(inp.hidden, inp.weight, None, inp.labels)
        return
    check_fp32(mode, fn, call(ref.linear_cross_entropy), inp, ups, path=dict(weight=False))


def test_env_overrides_tma_at_call_time(monkeypatch):
    """HOPPERKERN_TMA, read at each call, overrides the tma argument; a bad value is a ValueError."""
    inp = make_inputs(SMALL)
    transposed = inp.hidden.t().contiguous().t()
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    with expect_path("never", backward=False):
        lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, tma="always")
    monkeypatch.setenv("HOPPERKERN_TMA", "auto")
    with expect_path("auto", backward=False):
        lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, tma="never")
    monkeypatch.setenv("HOPPERKERN_TMA", "always")
    with pytest.raises(tma.UnsupportedError, match="hidden: last stride"):
        lce.linear_cross_entropy(transposed, inp.weight, inp.labels, tma="never")
    monkeypatch.setenv("HOPPERKERN_TMA", "sometimes")
    with pytest.raises(ValueError, match=re.escape("HOPPERKERN_TMA must be one of ('auto', 'always', 'never'), "
                                                   "got 'sometimes'")):
        lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels)


# ---------------------------------------------------------------------------------------------------------------
# linear_logprobs_entropy


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grads_on", ["both", "logprobs", "entropy"])
def test_logprobs_entropy(grads_on, mode):
    """Log-probs (0 at ignored tokens) and entropies (all tokens) at temperature 0.7, and grads under arbitrary
    per-token upstream grads: the entropy gradient flows through ignored tokens, the log-prob one does not."""
    inp = make_inputs(SHAPE, ignore=0.3)
    N = SHAPE[0]
    ups = [upstream((N,), seed=2) if grads_on != "entropy" else None,
           upstream((N,), seed=3) if grads_on != "logprobs" else None]
    (lp, _), grads = check_fp32(mode, call(lce.linear_logprobs_entropy, temperature=0.7, tma=mode),
                                call(ref.linear_logprobs_entropy, temperature=0.7), inp, ups)
    assert (lp[~inp.kept] == 0).all()
    ignored_rows = grads[0][~inp.kept].abs().sum(-1)
    assert (ignored_rows > 0).all() if grads_on != "logprobs" else not ignored_rows.any()


def _confident_rl_batch(grads_on="both"):
    """A confident fp16 batch at temperature 0.7 and random per-token upstream grads of the log-probs (and of the
    entropies with ``grads_on="both"``), zero at ignored tokens as under an RL trainer's loss mask (the entropy
    grads of unmasked ignored tokens, far from confident, would dominate d_hidden)."""
    inp = make_inputs(SHAPE, torch.float16, ignore=0.2, confident=CONFIDENT, temperature=0.7)
    mask = inp.kept.float()
    ups = [upstream((SHAPE[0],), seed=2) * mask, upstream((SHAPE[0],), seed=3) * mask]
    return inp, ups if grads_on == "both" else ups[:1] + [None]


def test_logprobs_entropy_baseline_is_right_for_confident_predictions():
    """torch's fp16 log-prob/entropy baseline has grads within 1e-2 of fp64 on a confident batch."""
    inp, ups = _confident_rl_batch()
    _, want_grads = run(call(ref.linear_logprobs_entropy, temperature=0.7), inp, ups, dtype=torch.float64)
    _, base_grads = run(call(torch_lowp_logprobs_entropy, temperature=0.7), inp, ups)
    errs = [rel_err(b, w) for b, w in zip(base_grads, want_grads) if w is not None]
    assert max(errs) < 1e-2, errs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("grads_on", ["both", "logprobs"])
def test_logprobs_entropy_fp16_confident(grads_on, mode):
    """Confident fp16 batch (p_label in [0.99, 0.9999]): log-probs, entropies and grads within 2x torch's fp16
    error of fp64. The log-prob gradient at the label is g (1 - p): formed in fp32 and rounded once."""
    inp, ups = _confident_rl_batch(grads_on)
    check_no_worse(mode, call(lce.linear_logprobs_entropy, temperature=0.7, tma=mode),
                   call(ref.linear_logprobs_entropy, temperature=0.7),
                   call(torch_lowp_logprobs_entropy, temperature=0.7), inp, ups, ("logprob", "entropy"),
                   out_atol=CONFIDENT_LOSS_ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_logprobs_entropy_no_grad(mode):
    """Under torch.no_grad (reference / old-policy passes) the values equal the differentiable call's to fp32
    rounding: the no-grad forward takes the label's logit from a row dot product, the differentiable one from the
    log-sum-exp's tiles, whose sums of exponentials then leave the label's own term to the combine's fp64 sum
    (lce_forward_kernel's LABEL_OUT), so the entropies too agree to fp32 rounding, not bit for bit."""
    inp = make_inputs(SMALL, ignore=0.3)
    h, w = inp.hidden.clone().requires_grad_(), inp.weight.clone().requires_grad_()
    lp, ent = lce.linear_logprobs_entropy(h, w, inp.labels, tma=mode)
    with torch.no_grad(), expect_path(mode, backward=False):
        lp0, ent0 = lce.linear_logprobs_entropy(h, w, inp.labels, tma=mode)
    assert lp.requires_grad and not lp0.requires_grad and not ent0.requires_grad
    assert_close(lp0, lp.detach(), FP32_RTOL, "logprob, no grad vs grad")
    assert_close(ent0, ent.detach(), FP32_RTOL, "entropy, no grad vs grad")
    want_lp, want_ent = ref.linear_logprobs_entropy(inp.hidden, inp.weight, inp.labels)
    assert_close(lp0, want_lp, FP32_RTOL, "logprob")
    assert_close(ent0, want_ent, FP32_RTOL, "entropy")


# ---------------------------------------------------------------------------------------------------------------
# Labels


def test_check_labels_names_bad_labels():
    """Labels >= V or < 0 (other than ignore_index) raise ValueError naming the values and flat positions."""
    inp = make_inputs(SMALL)
    lab = inp.labels.clone().int()
    lab[3], lab[7], lab[9] = V_S, -1, -100
    msg = f"labels must be in [0, {V_S}) or ignore_index=-100; got [{V_S}, -1] at flat positions [3, 7]"
    with pytest.raises(ValueError, match=re.escape(msg)):
        lce.linear_cross_entropy(inp.hidden, inp.weight, lab)
    with pytest.raises(ValueError, match=re.escape(msg)):
        lce.linear_logprobs_entropy(inp.hidden, inp.weight, lab)
    lab3 = inp.labels[:18].clone().view(2, 9)
    lab3[1, 2] = V_S + 5
    with pytest.raises(ValueError, match=re.escape(f"got [{V_S + 5}] at flat positions [11]")):
        lce.linear_cross_entropy(inp.hidden[:18].view(2, 9, H_S), inp.weight, lab3)
    many = torch.full_like(inp.labels, V_S)
    with pytest.raises(ValueError, match=re.escape("(first 8 shown)")):
        lce.linear_cross_entropy(inp.hidden, inp.weight, many)


@pytest.mark.parametrize("mode", MODES)
def test_unchecked_bad_labels_give_nan(mode):
    """check_labels=False: a bad label (V, one inside the padded tail tile, -1) gives NaN for its token's loss,
    the mean, its log-prob and entropy, never a finite number; the other tokens stay right."""
    inp = make_inputs(SMALL)
    bad = [3, 5, 7]
    lab = inp.labels.clone()
    lab[bad] = torch.tensor([V_S, V_S + 10, -1], device=DEVICE)
    ok = torch.ones_like(lab, dtype=torch.bool)
    ok[bad] = False
    clean = torch.where(ok, lab, -100)
    h, w = inp.hidden, inp.weight
    with expect_path(mode, backward=False):
        loss = lce.linear_cross_entropy(h, w, lab, reduction="none", check_labels=False, tma=mode)
    assert torch.isnan(loss[bad]).all()
    assert_close(loss[ok], ref.linear_cross_entropy(h, w, clean, reduction="none")[ok], FP32_RTOL, "loss")
    assert torch.isnan(lce.linear_cross_entropy(h, w, lab, check_labels=False, tma=mode))
    lp, ent = lce.linear_logprobs_entropy(h, w, lab, check_labels=False, tma=mode)
    want_lp, want_ent = ref.linear_logprobs_entropy(h, w, clean)
    assert torch.isnan(lp[bad]).all() and torch.isnan(ent[bad]).all()
    assert_close(lp[ok], want_lp[ok], FP32_RTOL, "logprob")
    assert_close(ent[ok], want_ent[ok], FP32_RTOL, "entropy")


@pytest.mark.parametrize("mode", MODES)
def test_strided_labels(mode):
    """labels = pairs[:, 0] (stride 2, reshape(-1) keeps the view): per-token loss must follow the view."""
    inp = make_inputs(SMALL)
    pairs = torch.stack([inp.labels, inp.labels.flip(0)], 1)
    loss = lce.linear_cross_entropy(inp.hidden, inp.weight, pairs[:, 0], reduction="none", tma=mode)
    assert_close(loss, ref.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, reduction="none"), FP32_RTOL,
                 "loss")


@pytest.mark.parametrize("mode", MODES)
def test_strided_bias(mode):
    """bias = wide[::2] (stride 2, shape (V,)): the loss must use the view's values."""
    inp = make_inputs(SMALL, bias=True)
    wide = torch.stack([inp.bias, -inp.bias], 1).flatten()
    loss = lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, bias=wide[::2], reduction="none", tma=mode)
    assert_close(loss, ref.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, bias=inp.bias,
                                                reduction="none"), FP32_RTOL, "loss")


# ---------------------------------------------------------------------------------------------------------------
# Errors


@dataclass(frozen=True)
class Err:
    name: str
    change: object  # dict of call arguments -> dict
    exc: type
    match: str  # literal text of the message
    fn: object = lce.linear_cross_entropy


def _small_args(with_bias):
    inp = make_inputs(SMALL, bias=with_bias)
    return dict(hidden=inp.hidden, weight=inp.weight, labels=inp.labels,
                **({"bias": inp.bias} if with_bias else {}))


D = "float16 or bfloat16 or float32"
ERRORS = [
    Err("hidden int", lambda a: {**a, "hidden": a["hidden"].long()}, TypeError, f"hidden must be {D}, got int64"),
    Err("weight dtype", lambda a: {**a, "weight": a["weight"].half()}, TypeError,
        "weight must be float32 (the dtype of hidden), got float16"),
    Err("labels float", lambda a: {**a, "labels": a["labels"].float()}, TypeError,
        "labels must be int32 or int64, got float32"),
    Err("bias dtype", lambda a: {**a, "bias": a["bias"].double()}, TypeError,
        "bias must be float16 or bfloat16 or float32, got float64"),
    Err("bias fp16", lambda a: {**a, "bias": a["bias"].half()}, TypeError,
        "bias must be float32 (the dtype of weight), got float16"),
    Err("H mismatch", lambda a: {**a, "hidden": a["hidden"][:, :-1]}, ValueError,
        f"hidden must have last dim {H_S} (weight.shape[1]), got shape ({N_S}, {H_S - 1})"),
    Err("labels shape", lambda a: {**a, "labels": a["labels"][:-1]}, ValueError,
        f"labels must have shape ({N_S},) (hidden.shape[:-1]), got ({N_S - 1},)"),
    Err("labels 2-D", lambda a: {**a, "hidden": a["hidden"][:18].view(2, 9, H_S), "labels": a["labels"][:18]},
        ValueError, "labels must have shape (2, 9) (hidden.shape[:-1]), got (18,)"),
    Err("bias shape", lambda a: {**a, "bias": a["bias"][:-1]}, ValueError,
        f"bias must have shape ({V_S},), got ({V_S - 1},)"),
    Err("weight 1-D", lambda a: {**a, "weight": a["weight"][0]}, ValueError,
        f"weight must be 2-D [V, H], got shape ({H_S},)"),
    Err("weight empty", lambda a: {**a, "weight": a["weight"][:0]}, ValueError,
        f"weight must have V >= 1 rows and H >= 1 columns, got shape (0, {H_S})"),
    Err("hidden 0-d", lambda a: {**a, "hidden": a["hidden"][0, 0]}, ValueError,
        "hidden must have at least 1 dim [..., H], got shape ()"),
    Err("reduction", lambda a: {**a, "reduction": "avg"}, ValueError,
        "reduction must be one of ('none', 'mean', 'sum'), got 'avg'"),
    Err("reduction None", lambda a: {**a, "reduction": None}, ValueError,
        "reduction must be one of ('none', 'mean', 'sum'), got None"),
    Err("temperature 0", lambda a: {**a, "temperature": 0.0}, ValueError, "temperature must be > 0.0, got 0.0"),
    Err("temperature below fp32's reciprocal range", lambda a: {**a, "temperature": 1e-300}, ValueError,
        "temperature must be at least 2.939e-39 (the kernels scale by its reciprocal in fp32), got 1e-300"),
    Err("softcap inf", lambda a: {**a, "softcap": float("inf")}, ValueError,
        "softcap must be finite, got inf (pass softcap=None for no softcap)"),
    Err("z_loss inf", lambda a: {**a, "z_loss": float("inf")}, ValueError, "z_loss must be finite, got inf"),
    Err("temperature < 0", lambda a: {**a, "temperature": -1}, ValueError, "temperature must be > 0.0, got -1"),
    Err("temperature NaN", lambda a: {**a, "temperature": float("nan")}, ValueError,
        "temperature must not be NaN"),
    Err("temperature str", lambda a: {**a, "temperature": "1"}, TypeError, "temperature must be a number, got str"),
    Err("softcap 0", lambda a: {**a, "softcap": 0.0}, ValueError, "softcap must be > 0.0, got 0.0"),
    Err("softcap < 0", lambda a: {**a, "softcap": -30.0}, ValueError, "softcap must be > 0.0, got -30.0"),
    Err("label_smoothing < 0", lambda a: {**a, "label_smoothing": -0.1}, ValueError,
        "label_smoothing must be >= 0.0, got -0.1"),
    Err("label_smoothing > 1", lambda a: {**a, "label_smoothing": 1.5}, ValueError,
        "label_smoothing must be <= 1.0, got 1.5"),
    Err("z_loss < 0", lambda a: {**a, "z_loss": -1e-4}, ValueError, "z_loss must be >= 0.0, got -0.0001"),
    Err("tma", lambda a: {**a, "tma": "sometimes"}, ValueError,
        "tma must be one of ('auto', 'always', 'never'), got 'sometimes'"),
    Err("ignore_index float", lambda a: {**a, "ignore_index": -100.0}, TypeError,
        "ignore_index must be an int, got float"),
    Err("ignore_index beyond int32 labels", lambda a: {**a, "labels": a["labels"].int(), "ignore_index": 2**31},
        ValueError, "ignore_index must be within the range of the labels' dtype torch.int32 "
        "[-2147483648, 2147483647], got 2147483648"),
    Err("logprobs: labels float", lambda a: {**a, "labels": a["labels"].float()}, TypeError,
        "labels must be int32 or int64, got float32", lce.linear_logprobs_entropy),
    Err("logprobs: temperature", lambda a: {**a, "temperature": 0}, ValueError,
        "temperature must be > 0.0, got 0", lce.linear_logprobs_entropy),
    Err("logprobs: tiny temperature", lambda a: {**a, "temperature": 1e-40}, ValueError,
        "temperature must be at least 2.939e-39", lce.linear_logprobs_entropy),
    Err("logprobs: H mismatch", lambda a: {**a, "weight": a["weight"][:, :-1]}, ValueError,
        f"hidden must have last dim {H_S - 1} (weight.shape[1]), got shape ({N_S}, {H_S})",
        lce.linear_logprobs_entropy),
    Err("logprobs: tma", lambda a: {**a, "tma": "yes"}, ValueError,
        "tma must be one of ('auto', 'always', 'never'), got 'yes'", lce.linear_logprobs_entropy),
    Err("sparse hidden", lambda a: {**a, "hidden": a["hidden"].to_sparse()}, TypeError,
        "hidden must be a dense (strided) tensor, got layout sparse_coo"),
    Err("logprobs: sparse weight", lambda a: {**a, "weight": a["weight"].to_sparse()}, TypeError,
        "weight must be a dense (strided) tensor, got layout sparse_coo", lce.linear_logprobs_entropy),
]


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: e.name)
def test_errors(err):
    """Each documented validation error: its type and its exact "{name} must be {expected}, got {actual}" text."""
    args = err.change(_small_args(with_bias=err.fn is lce.linear_cross_entropy))
    with pytest.raises(err.exc, match=re.escape(err.match)):
        err.fn(args.pop("hidden"), args.pop("weight"), args.pop("labels"), **args)


# ---------------------------------------------------------------------------------------------------------------
# torch.compile, custom ops, autocast


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", MODES)
def test_torch_compile_fullgraph(mode, fresh_dynamo):
    """torch.compile(fullgraph=True) of a function around linear_cross_entropy traces without graph breaks, and
    its loss and grads equal eager."""
    def step(x, w, b, labels):
        return lce.linear_cross_entropy(torch.tanh(x) * 3.0, w, labels, bias=b, label_smoothing=0.1, z_loss=0.02,
                                        tma=mode)

    inp, ups = make_inputs(SMALL, bias=True, ignore=0.2), [upstream(())]
    (want,), want_grads = run(step, inp, ups)
    with expect_path(mode):
        (loss,), grads = run(torch.compile(step, fullgraph=True, backend="aot_eager"), inp, ups)
    assert_close(loss, want, 1e-6, "loss")
    check_grads(grads, want_grads, 1e-6)


def test_torch_compile_dynamic_token_counts_one_graph(fresh_dynamo):
    """torch.compile(dynamic=True, fullgraph=True) traces one graph for every token count (the validation cache
    must not pin symbolic sizes); losses and gradients equal eager's."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def step(x, w, b, labels):
        return lce.linear_cross_entropy(x, w, labels, bias=b, tma="never")

    compiled = torch.compile(step, backend=backend, fullgraph=True, dynamic=True)
    for n in (5, 9, 12):
        inp, ups = make_inputs((n, 20, 16), seed=n), [upstream(())]
        (want,), want_grads = run(step, inp, ups)
        (loss,), grads = run(compiled, inp, ups)
        assert_close(loss, want, 1e-6, "loss")
        check_grads(grads, want_grads, 1e-6)
    assert len(graphs) == 1, f"{len(graphs)} graphs traced for 3 token counts"


def _op_args(name, **values):
    """Positional arguments of the custom op ``hopperkern::<name>``, taken by name from its schema."""
    return tuple(values[a.name] for a in getattr(torch.ops.hopperkern, name).default._schema.arguments)


def _backward_op_args(hidden):
    """Arguments of lce_backward for a tiny problem whose hidden is ``hidden(a contiguous [5, 16] tensor)``."""
    inp = make_inputs((5, 20, 16))
    opts = dict(ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=0.0, temperature=1.0, tma="never")
    _, lp, ent, lse = lce_forward_op(*_op_args("lce_forward", hidden=hidden(inp.hidden), weight=inp.weight,
                                               labels=inp.labels, bias=None, need_entropy=True, check=True,
                                               pick_label=True, shared_out=False, **opts))
    return _op_args("lce_backward", hidden=hidden(inp.hidden), weight=inp.weight, labels=inp.labels, bias=None,
                    lse=lse, entropy=ent, zlab=None, logprob=lp, g_loss=upstream((5,)), g_logprob=None,
                    g_entropy=upstream((5,), seed=2), g_lse=None, need_hidden_grad=True, need_weight_grad=True,
                    **opts)


OPCHECKS = ("test_schema", "test_autograd_registration", "test_faketensor")


def test_custom_ops_opcheck():
    """torch.library.opcheck: schema, autograd registration and fake (meta) kernels of both custom ops agree with
    the real kernels, which is what torch.compile relies on."""
    inp = make_inputs((5, 20, 16), bias=True)
    fwd = _op_args("lce_forward", hidden=inp.hidden.requires_grad_(), weight=inp.weight.requires_grad_(),
                   labels=inp.labels, bias=inp.bias, ignore_index=-100, label_smoothing=0.1, z_loss=0.0, softcap=0.0,
                   temperature=1.0, tma="never", need_entropy=True, check=True, pick_label=True, shared_out=False)
    torch.library.opcheck(lce_forward_op, fwd, test_utils=OPCHECKS)
    torch.library.opcheck(lce_backward_op, _backward_op_args(lambda h: h), test_utils=OPCHECKS)


def test_backward_op_fake_strides_transposed_hidden():
    """opcheck's fake-tensor test with a transposed hidden: fake and real d_hidden must have the same strides."""
    args = _backward_op_args(lambda h: h.t().contiguous().t())
    torch.library.opcheck(lce_backward_op, args, test_utils=("test_faketensor",))


def _tiny_backward():
    """A tiny problem (N=5, V=20, H=16, softcap 3) after its forward: ``(call, logprob)``, where ``call(**kw)`` runs
    lce_backward with upstream grads of the loss and the entropy and the forward's log-prob, ``kw`` replacing any
    of those (``g_loss``, ``g_logprob``, ``g_entropy``, ``g_lse``, ``logprob``) or adding ``zlab``."""
    inp = make_inputs((5, 20, 16))
    opts = launch.LceOptions(softcap=3.0, tma="never")
    _, lp, ent, lse = launch.lce_forward(inp.hidden, inp.weight, inp.labels, None, opts)
    defaults = dict(g_loss=upstream((5,)), g_logprob=None, g_entropy=upstream((5,), seed=2), g_lse=None, logprob=lp)

    def call(**kw):
        kw = {**defaults, **kw}
        grads = [kw.pop(k) for k in ("g_loss", "g_logprob", "g_entropy", "g_lse")]
        return launch.lce_backward(inp.hidden, inp.weight, inp.labels, None, lse, ent, *grads, opts, **kw)

    return call, lp


def test_backward_takes_an_fp32_lse_and_checks_it():
    """lce_backward takes the forward's fp64 LSE or an fp32 one (rounded: ~ulp(lse) off in every log-prob, so the
    gradients agree to ~1e-6 here) through plans of their own, and refuses another dtype or shape before any
    launch."""
    inp = make_inputs((5, 20, 16))
    opts = launch.LceOptions(tma="never")
    _, lp, ent, lse = launch.lce_forward(inp.hidden, inp.weight, inp.labels, None, opts)
    assert lse.dtype == torch.float64 and lp.dtype == ent.dtype == torch.float32
    grads = (upstream((5,)), None, upstream((5,), seed=2), None)
    d64 = launch.lce_backward(inp.hidden, inp.weight, inp.labels, None, lse, ent, *grads, opts, logprob=lp)
    d32 = launch.lce_backward(inp.hidden, inp.weight, inp.labels, None, lse.float(), ent, *grads, opts, logprob=lp)
    for a, b in zip(d64[:2], d32[:2]):
        assert_close(b, a, 1e-5, "fp32 LSE")
    with pytest.raises(TypeError, match="lse must be"):
        launch.lce_backward(inp.hidden, inp.weight, inp.labels, None, lse.half(), ent, *grads, opts, logprob=lp)
    with pytest.raises(ValueError, match=re.escape("lse must be a contiguous (5,) tensor")):
        launch.lce_backward(inp.hidden, inp.weight, inp.labels, None, lse[:4], ent, *grads, opts, logprob=lp)


LOGPROB_ERRORS = [
    pytest.param("g_loss", lambda lp: None, ValueError, "logprob must be given when g_loss or g_logprob is",
                 id="missing, g_loss"),
    pytest.param("g_logprob", lambda lp: None, ValueError, "logprob must be given when g_loss or g_logprob is",
                 id="missing, g_logprob"),
    pytest.param("g_loss", lambda lp: lp.double(), TypeError, "logprob must be float32, got float64", id="float64"),
    pytest.param("g_loss", lambda lp: lp[:4], ValueError,
                 "logprob must be a contiguous (5,) tensor (one per token), got shape (4,) and strides (1,)",
                 id="short"),
    pytest.param("g_logprob", lambda lp: torch.stack([lp, lp], 1)[:, 0], ValueError,
                 "logprob must be a contiguous (5,) tensor (one per token), got shape (5,) and strides (2,)",
                 id="strided"),
]


@pytest.mark.parametrize("grad, change, exc, match", LOGPROB_ERRORS)
def test_backward_logprob_errors(grad, change, exc, match):
    """With an upstream grad of the loss or the log-prob (a label term), lce_backward needs the forward's
    contiguous fp32 [N] log-prob: a missing or malformed one raises before anything is allocated or launched."""
    call, lp = _tiny_backward()
    before = tma.decision_count(BWD)
    with pytest.raises(exc, match=re.escape(match)):
        call(**{"g_loss": None, grad: upstream((5,))}, logprob=change(lp))
    assert tma.decision_count(BWD) == before, "the backward got as far as its memory-path decision"


def test_backward_logprob_only_for_label_terms():
    """Upstream grads of the entropy and the LSE only (no label term): no logprob is needed. Given one, the
    entropy term at the label takes its z - lse from it (more precise for a confident prediction; here the two
    agree to fp32 rounding); without an entropy grad the results are the same bit for bit. Passing the deprecated
    ``zlab`` warns."""
    call, lp = _tiny_backward()
    no_label = dict(g_loss=None, g_lse=upstream((5,), seed=3))
    d_h, d_w, _ = call(**no_label, logprob=None)
    want_h, want_w, _ = call(**no_label)
    torch.testing.assert_close(d_h, want_h, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d_w, want_w, rtol=1e-5, atol=1e-6)
    d_h, d_w, _ = call(**no_label, g_entropy=None, logprob=None)
    want_h, want_w, _ = call(**no_label, g_entropy=None)
    assert torch.equal(d_h, want_h) and torch.equal(d_w, want_w)
    with pytest.warns(DeprecationWarning, match="zlab is deprecated and ignored"):
        call(g_loss=None, g_entropy=None, zlab=lp)  # no upstream grads: zeros without a launch


_BF16_OK = DEVICE != "cpu" or hasattr(conftest, "_patch_interpreter_bf16")


@pytest.mark.skipif(not _BF16_OK, reason="bf16 tl.dot is wrong in the interpreter without conftest's patch")
@pytest.mark.parametrize("mode", MODES)
def test_autocast_bf16(mode):
    """Under torch.autocast(bf16), fp32 hidden/weight/bias run in bf16 as F.linear would: the loss and the (fp32)
    grads equal the explicit bf16 call's, and are no worse than 2x plain PyTorch's bf16 error."""
    inp, ups = make_inputs(SHAPE, bias=True, ignore=0.2), [upstream(())]
    fn = call(lce.linear_cross_entropy, tma=mode)
    autocast = torch.autocast(torch.device(DEVICE).type, dtype=torch.bfloat16)
    with expect_path(mode):
        (loss,), grads = run(fn, inp, ups, forward_ctx=autocast)
    (want,), want_grads = run(fn, inp, ups, dtype=torch.bfloat16)
    assert torch.equal(loss, want)
    for g, w in zip(grads, want_grads):
        assert g.dtype == torch.float32 and torch.equal(g, w.float())
    bf16 = dataclasses.replace(inp, hidden=inp.hidden.bfloat16(), weight=inp.weight.bfloat16(),
                               bias=inp.bias.bfloat16())
    (exact,), exact_grads = run(call(ref.linear_cross_entropy), bf16, ups, dtype=torch.float64)
    (base,), base_grads = run(call(torch_lowp_cross_entropy), bf16, ups)
    assert_no_worse("loss", loss, base, exact)
    for name, g, b, e in zip(("d_hidden", "d_weight", "d_bias"), grads, base_grads, exact_grads):
        assert_no_worse(name, g, b, e)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("softcap", [30.0, 33.0, 1e4, 1e12])
@pytest.mark.parametrize("sft_path", ["4pass", "3pass"])
def test_softcap_far_above_the_logits(mode, softcap, sft_path):
    """A softcap far above the logits (up to 1e12: all but no cap) keeps the loss, d_hidden and d_weight at fp32
    precision against fp64: tanh's exp form cancels near 0 (an error of ~1e-7 x
    softcap in each logit: at 1e4 the loss was 9e-5 off), so softcaps above launch.EXACT_TANH_SOFTCAP take its
    series there. 30 runs the exp form (launch.softcap_mode 1), 33 and up the series (mode 2)."""
    assert launch.softcap_mode(softcap) == (1 if softcap <= launch.EXACT_TANH_SOFTCAP else 2)
    g = torch.Generator().manual_seed(7)
    N, H, V = 37, 40, 203
    hidden = torch.randn(N, H, generator=g).to(DEVICE)
    weight = (torch.randn(V, H, generator=g) * 0.3).to(DEVICE)
    labels = torch.randint(0, V, (N,), generator=g).to(DEVICE)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = lce.linear_cross_entropy(h, w, labels, softcap=softcap, tma=mode, sft_path=sft_path, reduction="sum")
    dh, dw = torch.autograd.grad(loss, (h, w))
    hd, wd = hidden.double().requires_grad_(), weight.double().requires_grad_()
    want = ref.linear_cross_entropy(hd, wd, labels, softcap=softcap, reduction="sum")
    want_dh, want_dw = torch.autograd.grad(want, (hd, wd))
    assert rel_err(loss, want) <= FP32_RTOL
    assert rel_err(dh, want_dh) <= FP32_RTOL and rel_err(dw, want_dw) <= FP32_RTOL


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path, reduction", [("4pass", "sum"), ("4pass", "none"), ("3pass", "sum"),
                                             ("chunked", "mean")])
def test_minus_inf_bias_columns(path, reduction, mode):
    """Columns masked by a bias of -inf (vocabulary padding) have p = 0: the loss and every gradient stay finite,
    those columns' gradients are exactly 0, and the rest match fp64 (the 4-pass backward once formed their
    entries as 0 * -inf)."""
    inp = make_inputs((12, 40, 16), bias=True)
    inp.bias[-3:] = float("-inf")
    inp.labels = torch.where(inp.labels == -100, -100, inp.labels % 37)  # no label in a masked column
    ups = (torch.randn(12, device=DEVICE) if reduction == "none" else torch.tensor(1.0, device=DEVICE),)
    outs, grads = run(call(lce.linear_cross_entropy, reduction=reduction, sft_path=path, tma=mode), inp, ups)
    want, want_grads = run(call(ref.linear_cross_entropy, reduction=reduction), inp, ups, dtype=torch.float64)
    assert torch.isfinite(outs[0]).all()
    for what, got, ref_ in zip(("d_hidden", "d_weight", "d_bias"), grads, want_grads):
        assert torch.isfinite(got).all(), what
        assert_close(got, ref_, 1e-5, what)
    assert (grads[2][-3:] == 0).all() and (grads[1][-3:] == 0).all()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("path, reduction", [("4pass", "none"), ("4pass", "sum"), ("3pass", "sum")])
def test_label_at_a_minus_inf_column(path, reduction, smoothing, mode):
    """A kept label whose logit is -inf (a masked column) has p = 0: its loss is +inf, as PyTorch's (never NaN
    from inf - inf between the log-prob and the label-smoothing terms); with smoothing every token's loss is +inf
    (the mean of its log-probs is -inf), else the other tokens' losses are finite; every gradient is finite and
    matches fp64 (d(logits) at that label is -(1 - eps) times the token's upstream gradient)."""
    inp = make_inputs((12, 40, 16), bias=True)
    inp.bias[-3:] = float("-inf")
    inp.labels = torch.where(inp.labels == -100, -100, inp.labels % 37)
    inp.labels[2] = 39
    ups = (torch.randn(12, device=DEVICE) if reduction == "none" else torch.tensor(1.0, device=DEVICE),)
    kw = dict(reduction=reduction, label_smoothing=smoothing)
    outs, grads = run(call(lce.linear_cross_entropy, sft_path=path, tma=mode, **kw), inp, ups)
    want, want_grads = run(call(ref.linear_cross_entropy, **kw), inp, ups, dtype=torch.float64)
    loss = outs[0].reshape(-1)
    assert torch.equal(torch.isinf(loss), torch.isinf(want[0].reshape(-1))) and (loss[torch.isinf(loss)] > 0).all()
    assert_close(loss[torch.isfinite(loss)], want[0].reshape(-1)[torch.isfinite(loss)], 1e-5, "loss")
    for what, got, ref_ in zip(("d_hidden", "d_weight", "d_bias"), grads, want_grads):
        assert torch.isfinite(got).all(), what
        assert_close(got, ref_, 1e-5, what)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("path", ["4pass", "3pass", "chunked"])
def test_single_column_vocabulary_with_z_loss(path, mode):
    """V = 1: p = 1 for every token and the loss is z_loss * z^2 alone, so the label entry of d(logits) is all of
    a - 1 = 2 z_loss lse, formed from its terms (as 1 - 1 / a in fp32 it kept ~ulp(1) of it: 6e-3 off here)."""
    inp = make_inputs((9, 1, 16))
    ups = (torch.tensor(1.0, device=DEVICE),)
    kw = dict(reduction="sum", z_loss=1e-4)
    outs, grads = run(call(lce.linear_cross_entropy, sft_path=path, tma=mode, **kw), inp, ups)
    want, want_grads = run(call(ref.linear_cross_entropy, **kw), inp, ups, dtype=torch.float64)
    assert_close(outs[0], want[0], 1e-6, "loss")
    for what, got, ref_ in zip(("d_hidden", "d_weight"), grads, want_grads):
        assert_close(got, ref_, 1e-5, what)
