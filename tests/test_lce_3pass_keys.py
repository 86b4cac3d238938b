"""The 3-pass paths' cached launches (sft.cached_launch): several problems in one cache lifetime, each of which
must get its own launch (sizes, options, upstream-gradient flags, dtypes): every call's gradients against fp64."""
import torch

from hopperkern import lce
from hopperkern.lce import reference as lce_ref
from hopperkern.lce import sft
from hopperkern.tma.launcher import clear_plans

from conftest import DEVICE


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def inputs(N=19, V=70, H=40, dtype=torch.float32, seed=0, ignore=-100):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn((N, H), generator=gen).to(dtype)
    w = (torch.randn((V, H), generator=gen) * H ** -0.5).to(dtype)
    y = torch.randint(0, V, (N,), generator=gen)
    y[::5] = ignore
    return h.to(DEVICE), w.to(DEVICE), y.to(DEVICE)


def sft_step(N=19, H=40, dtype=torch.float32, path="3pass", **kw):
    h, w, y = inputs(N=N, H=H, dtype=dtype, ignore=kw.get("ignore_index", -100))
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    refs = [t.double().requires_grad_() for t in (h, w)]
    grads = torch.autograd.grad(lce.linear_cross_entropy(*leaves, y, reduction="sum", sft_path=path, **kw), leaves)
    want = torch.autograd.grad(lce_ref.linear_cross_entropy(*refs, y, reduction="sum", **kw), refs)
    return [rel(g, r) for g, r in zip(grads, want)]


def rl_step(N=19, with_entropy=True, **kw):
    h, w, y = inputs(N=N)
    gen = torch.Generator().manual_seed(7)
    gl, ge = (torch.randn(N, generator=gen).to(DEVICE) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (h, w)]
    refs = [t.double().requires_grad_() for t in (h, w)]
    lp, ent = lce.linear_logprobs_entropy(*leaves, y, grad_path="3pass", **kw)
    rlp, rent = lce_ref.linear_logprobs_entropy(*refs, y, **kw)
    if with_entropy:
        grads = torch.autograd.grad((lp, ent), leaves, (gl, ge))
        want = torch.autograd.grad((rlp, rent), refs, (gl.double(), ge.double()))
    else:
        grads = torch.autograd.grad(lp, leaves, gl)
        want = torch.autograd.grad(rlp, refs, gl.double())
    return [rel(g, r) for g, r in zip(grads, want)]


def test_sft_3pass_keys():
    """Token counts, temperature, z-loss, ignore_index and label smoothing (fp32 logits path) each their own launch."""
    clear_plans()
    for kw in (dict(), dict(N=23), dict(temperature=2.0), dict(z_loss=1e-2), dict(ignore_index=3),
               dict(label_smoothing=0.1), dict(label_smoothing=0.3), dict(label_smoothing=0.1, N=23)):
        assert max(sft_step(**kw)) < 1e-5, kw
    n = len(sft._LAUNCHES)
    assert n >= 8, n


def test_sft_chunked_fp16_keys():
    """fp16 chunked (d_weight kernel and split rounding) at two hidden sizes and two token counts."""
    clear_plans()
    for kw in (dict(H=40), dict(H=48), dict(H=40, N=23)):
        errs = sft_step(dtype=torch.float16, path="chunked", **kw)
        assert max(errs) < 5e-3, (kw, errs)


def test_rl_3pass_keys():
    """RL with and without an entropy gradient, another token count and temperature."""
    clear_plans()
    for kw in (dict(), dict(with_entropy=False), dict(N=23), dict(temperature=2.0)):
        assert max(rl_step(**kw)) < 1e-5, kw
