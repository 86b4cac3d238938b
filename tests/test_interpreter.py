"""Triton's CPU interpreter: inputs it would compute wrongly and set-ups it cannot run are refused with an error
that names the cause and the remedy, before any launch; what it computes right still runs.

The bf16 tests take the ``unpatched_interpreter`` fixture (conftest.py): the interpreter as users get it, whose
bf16 ``tl.dot`` multiplies bit patterns (triton#11584) and whose fp32 -> bf16 cast truncates. The set-ups that
need a fresh process (TRITON_INTERPRET set after import, numpy missing) run in a subprocess.
"""

import importlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import HAS_CUDA
from hopperkern import info, lce, moe, tma
from hopperkern.lce import reference as lce_ref
from hopperkern.matmul import matmul
from hopperkern.moe import configs as moe_configs
from test_lce import assert_no_worse, torch_lowp_cross_entropy
from test_matmul import assert_matches_reference
from test_moe_fused import check_against_reference
from test_moe_fused import make_inputs as moe_inputs

capmod = importlib.import_module("hopperkern.tma.capability")
ROOT = Path(__file__).resolve().parents[1]
# The refusal: the op, the dtype, the probe's finding with the upstream issue, the remedy, the pointer to info.
BF16_REFUSED = (r"cannot run bfloat16 inputs under Triton's CPU interpreter:\n(.|\n)*triton#11584(.|\n)*"
                r"use float32 or float16 inputs(.|\n)*hopperkern.lce.reference / hopperkern.moe.reference"
                r"(.|\n)*see: python -m hopperkern.info$")


@pytest.fixture(autouse=True)
def _no_tma_env(monkeypatch):
    monkeypatch.delenv("HOPPERKERN_TMA", raising=False)


def _lce_inputs(dtype=torch.float32, N=19, V=70, H=40):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(N, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).to(dtype)
    return hidden, weight, torch.randint(0, V, (N,), generator=g)


def _moe_bf16():
    return moe_inputs(9, 4, 32, 16, 2, torch.bfloat16, "cpu", seed=3)


def _gate_up_bf16():
    x, w13, _, _, ids = _moe_bf16()
    cfg = moe_configs.INTERPRETER_CONFIG.gemm1
    return moe.gate_up(x, w13, moe.direct_plan(ids, w13.shape[0], cfg.block_m), config=cfg)  # no align launch


def _lce_launch_bf16(phase):
    """The lower-level launchers, called directly (the public functions go through the custom ops)."""
    hidden, weight, labels = _lce_inputs(torch.bfloat16)
    opts = lce.LceOptions()
    if phase == "forward":
        return lce.lce_forward(hidden, weight, labels, None, opts)
    stats = torch.zeros(labels.shape[0])
    return lce.lce_backward(hidden, weight, labels, None, stats, stats, torch.ones_like(stats), None, None, None, opts)


def _autocast_lce():
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return lce.linear_cross_entropy(*_lce_inputs())


# (op name in the message, the call)
BF16_CALLS = {
    "lce bf16": ("hopperkern.lce", lambda: lce.linear_cross_entropy(*_lce_inputs(torch.bfloat16))),
    "lce under autocast(bf16), fp32 inputs": ("hopperkern.lce", _autocast_lce),
    "logprobs/entropy bf16": ("hopperkern.lce", lambda: lce.linear_logprobs_entropy(*_lce_inputs(torch.bfloat16))),
    "lce_forward bf16 (lower level)": ("lce.forward", lambda: _lce_launch_bf16("forward")),
    "lce_backward bf16 (lower level)": ("lce.backward", lambda: _lce_launch_bf16("backward")),
    "fused_moe bf16": ("moe.fused_moe", lambda: moe.fused_moe(*_moe_bf16())),
    "gate_up bf16 (lower level)": ("moe.gate_up", _gate_up_bf16),
    "matmul bf16": ("matmul", lambda: matmul(torch.randn(16, 16).bfloat16(), torch.randn(16, 16).bfloat16())),
}


# ---------------------------------------------------------------------------------------------------------------
# The dtype probe


@pytest.mark.skipif(HAS_CUDA, reason="with a GPU the interpreter is off and nothing is probed")
def test_probe_passes_the_patched_interpreter():
    """conftest's patch makes bf16 dot and cast right, and the probe sees that: the bf16 tests keep running."""
    assert tma.interpreter_problems() == ()
    assert tma.interpreter_dtype_problems(torch.bfloat16) == ()
    assert tma.interpreter_dtype_problems(torch.float16) == ()


def test_probe_finds_the_interpreters_bf16_faults(unpatched_interpreter):
    dot, cast = tma.interpreter_dtype_problems(torch.bfloat16)
    assert "computes bfloat16 tl.dot wrongly (it multiplies the raw bit patterns, triton#11584)" in dot
    assert cast.startswith("Triton's interpreter casts float32 to bfloat16 wrongly") and "truncating" in cast
    assert tma.interpreter_dtype_problems(torch.float32) == ()  # never probed: fp32 runs as on a GPU


def test_probe_only_runs_under_the_interpreter(monkeypatch):
    monkeypatch.setattr(capmod, "interpreter_active", lambda: False)
    capmod._probe_interpreter_dtype.cache_clear()
    assert tma.interpreter_dtype_problems(torch.bfloat16) == ()
    assert capmod._probe_interpreter_dtype.cache_info().currsize == 0


# ---------------------------------------------------------------------------------------------------------------
# bf16 refused, fp16 right


@pytest.fixture
def launches(monkeypatch):
    """Kernel launches under the interpreter, counted from here on (each grid run is one)."""
    from triton.runtime import interpreter

    count = []
    run = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        count.append(self)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", counted)
    return count


@pytest.mark.parametrize("name", list(BF16_CALLS))
def test_bf16_is_refused_before_any_launch(name, unpatched_interpreter, launches):
    op, fn = BF16_CALLS[name]
    for dtype in (torch.float16, torch.bfloat16):
        tma.interpreter_dtype_problems(dtype)  # the probes' own launches, before counting
    launches.clear()
    with pytest.raises(tma.UnsupportedError, match=f"^{op} " + BF16_REFUSED):
        fn()
    assert launches == [], "a kernel was launched before the refusal"


def test_bf16_routing_weight_gradient_refused(unpatched_interpreter, launches):
    """fp32 hidden with bf16 topk_weights: the forward only widens the weights (right as installed); the backward,
    which would write d_topk_weights in bf16 (truncated by this interpreter), refuses before its first launch."""
    x, w13, w2, tw, ids = moe_inputs(9, 4, 32, 16, 2, torch.float32, "cpu", seed=3)
    tw = tw.bfloat16().requires_grad_()
    out = moe.fused_moe(x, w13, w2, tw, ids)
    check_against_reference(out, (x, w13, w2, tw.detach(), ids))
    for dtype in (torch.float16, torch.bfloat16):
        tma.interpreter_dtype_problems(dtype)  # the probes' own launches, before counting
    launches.clear()
    with pytest.raises(tma.UnsupportedError, match="^moe.backward " + BF16_REFUSED):
        out.sum().backward()
    assert launches == [], "a kernel was launched before the refusal"


def test_fp16_is_right_or_refused(unpatched_interpreter):
    """fp16 under the interpreter as installed: correct against fp64 (LCE loss and grads, fused_moe, matmul)
    when the probe passes it, refused otherwise; never a silent wrong answer."""
    if tma.interpreter_dtype_problems(torch.float16):
        with pytest.raises(tma.UnsupportedError, match="cannot run float16 inputs"):
            lce.linear_cross_entropy(*_lce_inputs(torch.float16))
        return
    hidden, weight, labels = _lce_inputs(torch.float16)
    leaves = [t.clone().requires_grad_() for t in (hidden, weight)]
    loss = lce.linear_cross_entropy(*leaves, labels)
    loss.backward()
    exact = [t.double().requires_grad_() for t in (hidden, weight)]
    want = lce_ref.linear_cross_entropy(*exact, labels)
    want.backward()
    base = [t.clone().requires_grad_() for t in (hidden, weight)]
    got_torch = torch_lowp_cross_entropy(*base, labels)
    got_torch.backward()
    assert_no_worse("loss", loss, got_torch, want)
    for what, g, b, e in zip(("d_hidden", "d_weight"), leaves, base, exact):
        assert_no_worse(what, g.grad, b.grad, e.grad)

    args = moe_inputs(9, 4, 32, 16, 2, torch.float16, "cpu", seed=3)
    check_against_reference(moe.fused_moe(*args), args)

    a, b = (torch.randn(24, 24, generator=torch.Generator().manual_seed(s)).half() for s in (1, 2))
    assert_matches_reference(matmul(a, b), a, b)


def test_refusal_offers_the_dtypes_that_are_right(monkeypatch):
    """When fp16 is wrong as well, the remedy names only float32."""
    monkeypatch.setattr(capmod, "interpreter_active", lambda: True)
    monkeypatch.setattr(capmod, "interpreter_problems", lambda: ())
    monkeypatch.setattr(capmod, "_probe_interpreter_dtype", lambda dtype: ("probe says no",))
    with pytest.raises(tma.UnsupportedError, match=r"probe says no\n  - under the interpreter use float32 inputs "):
        tma.check_interpreter(torch.bfloat16, "op")


# ---------------------------------------------------------------------------------------------------------------
# Set-ups the interpreter cannot run in


def test_triton_36_with_numpy_24_is_refused(monkeypatch):
    """triton 3.6's interpreter fails on numpy 2.4; newer tritons do not."""
    monkeypatch.setattr(capmod, "interpreter_active", lambda: True)
    monkeypatch.setattr(capmod, "_numpy_version", lambda: "2.4.1")
    monkeypatch.setattr(capmod, "_triton_version", lambda: "3.6.0")
    msg = r"op cannot run under Triton's CPU interpreter in this process:(.|\n)*numpy 2.4.1(.|\n)*'numpy<2.4'"
    with pytest.raises(tma.UnsupportedError, match=msg):
        tma.check_interpreter(torch.float32, "op")
    monkeypatch.setattr(capmod, "_triton_version", lambda: "3.7.1")
    assert not any("numpy" in r for r in tma.interpreter_problems())


def _python(code: str, **env) -> subprocess.CompletedProcess:
    """``code`` in a fresh interpreter from the repository root, TRITON_INTERPRET unset unless given."""
    base = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    base["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**base, **env}, capture_output=True,
                          text=True, timeout=300)


LATE_ENV = """
import json, os, torch
from hopperkern import lce, tma
from hopperkern.matmul import matmul   # triton imported and kernels built with the interpreter off
os.environ["TRITON_INTERPRET"] = "1"
out = {}
for name, fn in [("matmul", lambda: matmul(torch.randn(8, 8), torch.randn(8, 8))),
                 ("lce", lambda: lce.linear_cross_entropy(torch.randn(4, 16), torch.randn(32, 16),
                                                          torch.randint(0, 32, (4,))))]:
    try:
        fn()
        out[name] = "ran"
    except tma.UnsupportedError as exc:
        out[name] = str(exc)
print(json.dumps(out))
"""


def test_interpret_env_set_after_import_is_refused():
    """Set after triton's import, TRITON_INTERPRET=1 cannot take effect: a clear error, not a Triton trace or a
    CUDA driver error."""
    proc = _python(LATE_ENV)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for op, name in (("matmul", "matmul"), ("hopperkern.lce", "lce")):
        assert out[name].startswith(f"{op} cannot run under Triton's CPU interpreter in this process:\n"), out[name]
        assert "TRITON_INTERPRET=1 was set after triton was imported" in out[name]
        assert "before the first import of triton or hopperkern" in out[name]
        assert out[name].endswith("see: python -m hopperkern.info")


NO_NUMPY = """
import json, sys
sys.modules["numpy"] = None  # as if numpy were not installed
out = {}
try:
    import hopperkern.lce
    out["import"] = "imported"
except ImportError as exc:
    out["import"] = str(exc)
from hopperkern import info
out["capability"] = info.collect()["capability"]
print(json.dumps(out))
"""


def test_numpy_missing_for_the_interpreter_says_what_to_do():
    """With TRITON_INTERPRET=1 and no numpy, triton itself cannot import: the ImportError says why and what to
    do, and the report (which never raises) says the same."""
    proc = _python(NO_NUMPY, TRITON_INTERPRET="1")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    want = "Triton's CPU interpreter (TRITON_INTERPRET=1) needs numpy, which triton does not install: pip install numpy"
    assert out["import"] == f"triton cannot be imported: {want}\nsee: python -m hopperkern.info"
    assert f"triton cannot be imported: {want}" in out["capability"]["reasons"]


# ---------------------------------------------------------------------------------------------------------------
# The report


def test_info_reports_the_probe(unpatched_interpreter):
    data = info.collect()
    assert data["interpreter"]["problems"] == [] and data["interpreter"]["float16"] == "right"
    assert any("triton#11584" in r for r in data["interpreter"]["bfloat16"])
    buf = io.StringIO()
    info.render(data, Console(file=buf, width=400, color_system=None))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in buf.getvalue().splitlines()
            if line.count("│") == 3 and line.split("│")[1].strip()}
    assert rows["interpreter problems"] == "none"
    assert rows["interpreter float16 (dot, cast)"] == "computed right (probed)"
    assert "triton#11584" in rows["interpreter bfloat16 (dot, cast)"]


def test_info_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(tma, "interpreter_active", lambda: False)
    assert info.collect()["interpreter"] is None
