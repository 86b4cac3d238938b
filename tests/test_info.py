"""python -m hopperkern.info: collect() never raises and is JSON-able; render() shows every section, escaped."""

import importlib
import io
import dataclasses
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch
import triton
from rich.console import Console
from conftest import DEVICE
from rich.text import Text

from hopperkern import info, tma, tuning
from hopperkern.matmul import matmul
from hopperkern.tma import Capability

capmod = importlib.import_module("hopperkern.tma.capability")
FAMILIES = ["matmul", "lce.forward", "lce.backward",
            "moe.gemm1 (gate/up, rows gathered: pointer loads for activations, TMA for weights)", "moe.gemm2"]
H200 = Capability(cuda_available=True, interpreter=False, device_name="NVIDIA H200", compute_capability=(9, 0),
                  sm_count=132, triton_version="3.6.0", tensor_descriptors=True, tma=True, reasons=())


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("HOPPERKERN_TMA", "HOPPERKERN_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    tuning._WARNED.clear()
    yield
    tuning._WARNED.clear()


def _rendered(data) -> str:
    buf = io.StringIO()
    info.render(data, Console(file=buf, width=400, color_system=None))
    return buf.getvalue()


def _fake_capability(monkeypatch, cap):
    """Make every caller (info, tuning's device lookup) see ``cap``."""
    monkeypatch.setattr(tma, "capability", lambda device=None: cap)
    monkeypatch.setattr(capmod, "capability", lambda device=None: cap)


def test_collect_is_plain_json():
    data = info.collect()
    assert json.loads(json.dumps(data)) == data  # no tuples, objects or NaNs hiding in it
    env = data["environment"]
    assert (env["torch"], env["triton"]) == (torch.__version__, triton.__version__)
    assert env["torch.version.cuda"] == (torch.version.cuda or "none (CPU build)")
    assert all(not str(v).startswith("could not collect") for v in env.values())
    assert data["capability"]["interpreter"] == tma.capability().interpreter
    assert [f["family"] for f in data["families"]] == FAMILIES


def test_families_on_this_machine():
    fams = {f["family"].split()[0]: f for f in info.collect()["families"]}
    if tma.capability().tma:  # a Hopper GPU, or the interpreter (both paths run on the CPU)
        assert [fams[k]["tma"] for k in ("matmul", "lce.forward", "lce.backward", "moe.gemm2")] == ["yes"] * 4
        assert fams["moe.gemm1"]["tma"] == "partly"
    else:
        assert all(f["tma"] == "no" and f["why"] for f in fams.values())
    assert any("rows gathered by token index: pointer loads" in w for w in fams["moe.gemm1"]["why"])


def test_text_report_sections():
    data = info.collect()
    text = _rendered(data)
    for needle in ["hopperkern " + data["hopperkern"] + ": environment", "torch.version.cuda", "pydantic", "rich",
                   "GPU", "compute capability", "SMs", "Triton interpreter", "kernel families", "tuning file",
                   "would load", "because", *FAMILIES]:
        assert needle in text, needle
    assert text.rstrip().endswith(info.BUG_REPORT_LINE)
    assert "paste" in info.BUG_REPORT_LINE.lower() and "--json" in info.BUG_REPORT_LINE


def test_main_text_and_json(capsys):
    assert info.main([]) == 0
    assert "kernel families" in capsys.readouterr().out
    assert info.main(["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"hopperkern", "environment", "capability", "interpreter", "settings", "tma_mode", "families",
                         "tuning"}


def test_module_entry_point_json():
    out = subprocess.run([sys.executable, "-m", "hopperkern.info", "--json"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["environment"]["triton"] == triton.__version__


def test_markup_in_data_is_escaped(monkeypatch):
    weird = "[tma] needs [bold]Hopper[/bold]"
    assert Text.from_markup(weird).plain == " needs Hopper"  # unescaped, rich eats every tag
    _fake_capability(monkeypatch, Capability(
        cuda_available=True, interpreter=False, device_name="GPU [x]", compute_capability=(8, 0), sm_count=1,
        triton_version="3.6.0", tensor_descriptors=True, tma=False, reasons=(weird,)))
    monkeypatch.setenv("HOPPERKERN_CONFIG", "/tmp/[red]nowhere.json")
    data = info.collect()
    assert data["families"][0] == {"family": "matmul", "tma": "no", "why": [weird],
                                   "last_launch": data["families"][0]["last_launch"]}
    text = _rendered(data)
    assert weird in text and "GPU [x]" in text and "/tmp/[red]nowhere.json" in text


def test_collect_never_raises(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("probe [exploded]")

    monkeypatch.setattr(tma, "capability", boom)
    monkeypatch.setattr(tuning, "config_search", boom)
    monkeypatch.setattr(info, "_torch_cuda", boom)
    monkeypatch.setattr(tma, "interpreter_active", boom)
    data = info.collect()
    failed = "could not collect: RuntimeError: probe [exploded]"
    assert data["capability"] == data["tuning"] == data["environment"]["torch.version.cuda"] == failed
    assert data["interpreter"] == failed
    assert all(f["tma"] == "no" and f["why"][0] == failed for f in data["families"])
    json.dumps(data)
    text = _rendered(data)
    assert failed in text and text.rstrip().endswith(info.BUG_REPORT_LINE)


def test_env_tma_override_shows(monkeypatch):
    monkeypatch.setenv("HOPPERKERN_TMA", "never")
    data = info.collect()
    assert data["tma_mode"] == "never" and data["settings"]["HOPPERKERN_TMA"] == "never"
    assert all(f["tma"] == "no" and "HOPPERKERN_TMA=never" in f["why"][0] for f in data["families"])
    monkeypatch.setenv("HOPPERKERN_TMA", "fast")
    data = info.collect()
    assert data["tma_mode"].startswith("could not collect: ValueError: HOPPERKERN_TMA must be one of")
    assert data["families"][0]["why"][0].startswith("HOPPERKERN_TMA is invalid, every op will raise")


def test_last_launch_is_reported():
    matmul(torch.randn(16, 16, device=DEVICE).t(), torch.randn(16, 16, device=DEVICE), tma="auto")
    row = info.collect()["families"][0]
    assert row["last_launch"]["tma"] == {"a": False, "b": True, "c": True}
    assert "last launch (tma='auto'): a=pointer, b=TMA, c=TMA" in _rendered(info.collect())


# ---------------------------------------------------------------------------------------------------------------
# tuning section


def test_tuning_fallback_is_reported_without_a_warning(monkeypatch):
    """A GPU with no packaged tuning file: info reports the fallback and the files it looked for, no warning."""
    untuned = dataclasses.replace(H200, device_name="NVIDIA Untuned Test GPU")
    _fake_capability(monkeypatch, untuned)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning belongs to the ops; info reports the same facts
        t = info.collect()["tuning"]
    assert t["loaded"] == "built-in defaults" and t["why"] == "current GPU" and t["error"] is None
    assert t["looked_for"] == [str(d / "NVIDIA_Untuned_Test_GPU.json") for d in tuning.packaged_config_dirs()]
    assert t["hint"] == "tune this GPU with: python -m hopperkern.tune --out configs/"


def test_tuning_file_in_use(tmp_path, monkeypatch):
    p = tmp_path / "NVIDIA_H200.json"
    p.write_text(json.dumps({"schema_version": 1, "device_name": "NVIDIA H200", "triton_version": "3.6.0"}))
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    _fake_capability(monkeypatch, H200)
    t = info.collect()["tuning"]
    assert (t["found"], t["loaded"], t["why"]) == (str(p), str(p), "HOPPERKERN_CONFIG folder, current GPU")
    assert (t["tuned_on"], t["tuned_with_triton"], t["entries"]) == ("NVIDIA H200", "3.6.0", {"lce": [], "moe": []})
    assert "hint" not in t


def test_tuning_file_error_is_reported(tmp_path, monkeypatch):
    p = tmp_path / "broken.json"
    p.write_text('{"schema_version": 1, "lce": {"forward:bfloat16:H4096": {"64": {"block_m": 48}}}}')
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(p))
    t = info.collect()["tuning"]
    assert t["loaded"] is None
    assert t["error"].startswith(f"TuningFileError: {p}: field 'lce.forward:bfloat16:H4096.64.block_m'")
    text = _rendered(info.collect())
    assert "nothing: the file is unusable" in text and "block_m must be a power of two, got 48" in text
