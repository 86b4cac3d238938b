"""The device-side reduction of a sum or mean loss (hopperkern.lce.sft.loss_scale / loss_total) and the eager 4-pass
path's single autograd node (LceReducedFunction), under the interpreter on CPU tensors (both memory paths)."""

import pytest
import torch

from conftest import DEVICE
from hopperkern import lce
from hopperkern.lce import reference as ref
from hopperkern.lce import sft
from hopperkern.lce.ops import LceReducedFunction
from test_lce import MODES, SHAPE, assert_close, call, make_inputs, run, upstream


@pytest.mark.parametrize("N", [0, 1, 63, 64, 65, 200, 2500])
@pytest.mark.parametrize("mean", [True, False], ids=["mean", "sum"])
@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32])
def test_loss_scale_and_total(N, mean, label_dtype):
    """scale = 1 / max(1, kept tokens) (mean) or 1 (sum), exactly; total = scale * sum(loss) to fp32 rounding of
    an fp64 sum; share = scale for every token. Sizes around the interpreter's 64-token step and beyond the GPU's
    1024, none kept, none at all; a non-default ignore_index."""
    g = torch.Generator(device=DEVICE).manual_seed(N)
    labels = torch.randint(0, 50, (N,), generator=g, device=DEVICE).to(label_dtype)
    labels[torch.rand(N, generator=g, device=DEVICE) < 0.3] = -7
    loss = torch.rand(N, generator=g, device=DEVICE, dtype=torch.float32) * 5
    scale = sft.loss_scale(labels, -7, mean)
    count = int((labels != -7).sum())
    expect = torch.tensor(1.0 / max(count, 1) if mean else 1.0, dtype=torch.float32)
    assert scale.shape == (1,) and scale.dtype == torch.float32
    assert scale.item() == expect.item()
    total, share = sft.loss_total(loss, scale, share=True)
    assert total.shape == () and total.dtype == torch.float32
    exact = loss.double().sum() * expect.double()
    assert abs(total.item() - exact.item()) <= 1e-6 * max(1.0, abs(exact.item()))
    assert share.shape == (N,) and share.dtype == torch.float32 and bool((share == expect).all())
    assert sft.loss_total(loss, scale)[1] is None
    plain, ones = sft.loss_total(loss, None, share=True)  # no scale: a sum
    assert abs(plain.item() - loss.double().sum().item()) <= 1e-6 * max(1.0, loss.double().sum().item())
    assert bool((ones == 1.0).all()) and ones.shape == (N,)


@pytest.mark.parametrize("label_dtype", [torch.int64, torch.int32])
def test_loss_scale_is_correctly_rounded(label_dtype):
    """1 / count rounded once to fp32 for every count up to 300 and a few larger ones (a GPU's approximate fp32
    division is 1 ulp off at some of them), with a positive ignore_index."""
    for count in list(range(0, 301)) + [1023, 1024, 1025, 4097, 65537]:
        labels = torch.full((count + 3,), 2, dtype=label_dtype, device=DEVICE)
        labels[count:] = 7  # the ignored label
        expect = torch.tensor(1.0 / max(count, 1), dtype=torch.float32).item()
        assert sft.loss_scale(labels, 7, True).item() == expect, count


def test_reduction_inputs_are_checked():
    """The reductions read flat contiguous fp32 losses and a fp32 [1] scale: anything else raises."""
    loss = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="flat contiguous"):
        sft.loss_total(torch.ones(8, 2, device=DEVICE)[:, 0], None)
    with pytest.raises(TypeError, match="fp32"):
        sft.loss_total(loss.double(), None)
    with pytest.raises(TypeError, match="fp32"):
        sft.loss_total(loss, torch.ones(2, device=DEVICE))
    with pytest.raises(ValueError, match="flat contiguous"):
        sft.loss_scale(torch.zeros(4, 2, dtype=torch.long, device=DEVICE), -100, True)


def test_loss_total_all_ignored_and_nan():
    """No kept token: a mean of 0.0 (scale 1 over losses of 0); a NaN loss (an unchecked bad label) stays NaN."""
    labels = torch.full((9,), -100, device=DEVICE)
    assert sft.loss_scale(labels, -100, True).item() == 1.0
    assert sft.loss_total(torch.zeros(9, device=DEVICE), sft.loss_scale(labels, -100, True))[0].item() == 0.0
    loss = torch.ones(9, device=DEVICE)
    loss[4] = float("nan")
    assert torch.isnan(sft.loss_total(loss, torch.ones(1, device=DEVICE))[0])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_eager_4pass_reduction(reduction, mode):
    """An eager 4-pass sum or mean with autograd is one LceReducedFunction node whose loss and gradients match the
    fp64 reference (ignored tokens, bias, z-loss and label smoothing included), the no-grad call (which takes the
    label's logit by a row dot product instead of from the tiles) and the per-token losses reduced with torch."""
    inp = make_inputs(SHAPE, bias=True, ignore=0.3)
    kw = dict(reduction=reduction, label_smoothing=0.1, z_loss=0.01, tma=mode, sft_path="4pass")
    h = inp.hidden.clone().requires_grad_()
    out = lce.linear_cross_entropy(h, inp.weight, inp.labels, bias=inp.bias, **kw)
    assert type(out.grad_fn).__name__ == "LceReducedFunctionBackward"
    (loss,), grads = run(call(lce.linear_cross_entropy, **kw), inp, [upstream(())])
    kr = dict(reduction=reduction, label_smoothing=0.1, z_loss=0.01)
    (expect,), expect_grads = run(call(ref.linear_cross_entropy, **kr), inp, [upstream(())],
                                  dtype=torch.float64)
    assert_close(loss, expect, 1e-5, "loss")
    for g, e, name in zip(grads, expect_grads, ("d_hidden", "d_weight", "d_bias")):
        assert_close(g, e, 1e-5, name)
    with torch.no_grad():
        nograd = lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, bias=inp.bias, **kw)
        per_token = lce.linear_cross_entropy(inp.hidden, inp.weight, inp.labels, bias=inp.bias,
                                             **dict(kw, reduction="none"))
    assert_close(nograd, loss, 1e-6, "no-grad call")
    torch_reduced = per_token.sum() / (inp.kept.sum() if reduction == "mean" else 1)
    assert_close(loss, torch_reduced, 1e-6, "vs torch's reduction")


@pytest.mark.parametrize("mode", MODES)
def test_eager_4pass_reduction_backward_twice(mode):
    """Through a retained graph the second backward adds the same gradients again (the token shares are kept,
    not consumed)."""
    inp = make_inputs(SHAPE, ignore=0.2)
    h = inp.hidden.clone().requires_grad_()
    loss = lce.linear_cross_entropy(h, inp.weight, inp.labels, tma=mode, sft_path="4pass")
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    loss.backward()
    torch.testing.assert_close(h.grad, 2 * first, rtol=0, atol=0)


def test_eager_4pass_reduction_errors_before_launch():
    """Validation still runs first: a label of the wrong dtype raises TypeError with nothing launched."""
    inp = make_inputs(SHAPE)
    with pytest.raises(TypeError):
        lce.linear_cross_entropy(inp.hidden.requires_grad_(), inp.weight, inp.labels.float(), sft_path="4pass")


def test_reduced_function_is_the_eager_path_only(monkeypatch):
    """An eager sum or mean with tokens takes it; reduction="none" and a call without tokens do not (traced calls
    take the custom op: test_lce.py's torch.compile tests)."""
    inp = make_inputs(SHAPE)
    called = []
    real = LceReducedFunction.apply
    monkeypatch.setattr(LceReducedFunction, "apply", lambda *a: called.append(1) or real(*a))
    h = inp.hidden.clone().requires_grad_()
    out = lce.linear_cross_entropy(h, inp.weight, inp.labels, reduction="none", sft_path="4pass")
    assert out.shape == inp.labels.shape and not called
    lce.linear_cross_entropy(h, inp.weight, inp.labels, sft_path="4pass")
    assert called == [1]
    empty = lce.linear_cross_entropy(h[:0], inp.weight, inp.labels[:0], sft_path="4pass")
    assert called == [1] and empty.item() == 0.0
