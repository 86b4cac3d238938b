"""python -m hopperkern.info: collect() never raises and is JSON-able; render() shows every section, escaped."""

import dataclasses
import importlib
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

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


GPU_ONLY = ("NVIDIA driver", "CUDA runtime")  # environment entries that need a CUDA GPU


def test_collect_is_plain_json():
    import numpy

    data = info.collect()
    assert json.loads(json.dumps(data)) == data  # no tuples, objects or NaNs hiding in it
    env = data["environment"]
    assert (env["torch"], env["triton"], env["numpy"]) == (torch.__version__, triton.__version__, numpy.__version__)
    assert env["torch.version.cuda"] == (torch.version.cuda or "none (CPU build)")
    assert all(not str(v).startswith("could not collect") for k, v in env.items() if k not in GPU_ONLY)
    for key in GPU_ONLY:
        if torch.cuda.is_available():
            assert re.fullmatch(r"\d+\.\d+(\.\d+)?( \(.*\))?", env[key]), (key, env[key])
        else:
            assert env[key] == "could not collect: RuntimeError: no CUDA GPU is available"
    assert data["capability"]["interpreter"] == tma.capability().interpreter
    assert data["capability"]["hopper_mma"] is tma.capability().hopper_mma
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
    assert set(data) == {"hopperkern", "installation", "environment", "capability", "interpreter", "settings",
                         "tma_mode", "families", "tuning"}


def test_module_entry_point_json():
    out = subprocess.run([sys.executable, "-m", "hopperkern.info", "--json"], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["environment"]["triton"] == triton.__version__


def test_markup_in_data_is_escaped(monkeypatch, tmp_path):
    weird = "[tma] needs [bold]Hopper[/bold]"
    assert Text.from_markup(weird).plain == " needs Hopper"  # unescaped, rich eats every tag
    _fake_capability(monkeypatch, Capability(
        cuda_available=True, interpreter=False, device_name="GPU [x]", compute_capability=(8, 0), sm_count=1,
        triton_version="3.6.0", tensor_descriptors=True, tma=False, reasons=(weird,)))
    missing = str(tmp_path / "[red]nowhere.json")
    monkeypatch.setenv("HOPPERKERN_CONFIG", missing)
    data = info.collect()
    assert data["families"][0] == {"family": "matmul", "tma": "no", "why": [weird],
                                   "last_launch": data["families"][0]["last_launch"]}
    text = _rendered(data)
    assert weird in text and "GPU [x]" in text and missing in text


def test_collect_never_raises(monkeypatch):
    def boom(*args, **kwargs):
        raise RuntimeError("probe [exploded]")

    monkeypatch.setattr(tma, "capability", boom)
    monkeypatch.setattr(tuning, "config_search", boom)
    monkeypatch.setattr(info, "_torch_cuda", boom)
    monkeypatch.setattr(info, "_installation", boom)
    monkeypatch.setattr(capmod, "nvidia_driver_version", boom)
    monkeypatch.setattr(tma, "interpreter_active", boom)
    data = info.collect()
    failed = "could not collect: RuntimeError: probe [exploded]"
    assert data["capability"] == data["tuning"] == data["environment"]["torch.version.cuda"] == failed
    assert data["installation"] == data["environment"]["NVIDIA driver"] == failed
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
    """A GPU with no tuning file of its architecture: info reports the defaults and the files it looked for, with
    no warning; the warning stays due for the program's first op."""
    untuned = dataclasses.replace(H200, device_name="NVIDIA Untuned Test GPU", compute_capability=(8, 0))
    _fake_capability(monkeypatch, untuned)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning belongs to the ops; info reports the same facts
        t = info.collect()["tuning"]
    assert t["loaded"] == "built-in defaults" and t["why"] == "current GPU" and t["error"] is None
    assert t["looked_for"] == [str(d / "NVIDIA_Untuned_Test_GPU.json") for d in tuning.packaged_config_dirs()]
    assert t["hint"] == "tune this GPU with: python -m hopperkern.tune --out configs/" and t["closest_to"] is None
    with pytest.warns(UserWarning, match="no tuning file found"):
        tuning.load_config()


def test_hopper_gpu_without_a_file_reports_the_closest_file(monkeypatch):
    """An H20 has no file of its own: info names the H200 file it would load, and why."""
    _fake_capability(monkeypatch, dataclasses.replace(H200, device_name="NVIDIA H20", sm_count=78))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = info.collect()
    t = data["tuning"]
    assert Path(t["loaded"]).name == "NVIDIA_H200.json" and t["tuned_on"] == "NVIDIA H200"
    assert t["closest_to"] == "NVIDIA H20"
    assert t["why"] == "closest file of the same architecture (sm_90): no file for NVIDIA H20 (current GPU)"
    assert t["hint"].startswith("tune this GPU with: python -m hopperkern.tune")
    text = _rendered(data)
    assert "NVIDIA_H200.json" in text and "closest file of the same architecture (sm_90)" in text
    # Every file the package ships, by name.
    assert t["shipped"] == ["NVIDIA_H100_80GB_HBM3.json", "NVIDIA_H200.json"]
    assert "shipped files" in text and "NVIDIA_H100_80GB_HBM3.json, NVIDIA_H200.json" in text


def test_tuning_file_of_another_triton_is_reported(tmp_path, monkeypatch):
    p = tmp_path / "NVIDIA_H200.json"
    p.write_text(json.dumps({"schema_version": 1, "device_name": "NVIDIA H200", "triton_version": "2.0.0"}))
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    _fake_capability(monkeypatch, H200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data = info.collect()
    running = tma.capability().triton_version
    assert data["tuning"]["triton_mismatch"] == (f"tuned with triton 2.0.0, this process runs triton {running}: its "
                                                 "launch configs are used, but may no longer be the fastest")
    assert "tuned with triton 2.0.0, this process runs triton" in _rendered(data)


def test_tuning_file_in_use(tmp_path, monkeypatch):
    p = tmp_path / "NVIDIA_H200.json"
    p.write_text(json.dumps({"schema_version": 1, "device_name": "NVIDIA H200", "triton_version": "3.6.0"}))
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    _fake_capability(monkeypatch, H200)
    t = info.collect()["tuning"]
    assert (t["found"], t["loaded"], t["why"]) == (str(p), str(p), "HOPPERKERN_CONFIG folder, current GPU")
    assert (t["tuned_on"], t["tuned_with_triton"], t["entries"]) == ("NVIDIA H200", "3.6.0", {"lce": [], "moe": []})
    assert "hint" not in t and t["closest_to"] is None


def test_tuning_file_error_is_reported(tmp_path, monkeypatch):
    p = tmp_path / "broken.json"
    p.write_text('{"schema_version": 1, "lce": {"forward:bfloat16:H4096": {"64": {"block_m": 48}}}}')
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(p))
    t = info.collect()["tuning"]
    assert t["loaded"] is None
    assert t["error"].startswith(f"TuningFileError: {p}: field 'lce.forward:bfloat16:H4096.64.block_m'")
    text = _rendered(info.collect())
    assert "nothing: the file is unusable" in text and "block_m must be a power of two, got 48" in text


# ---------------------------------------------------------------------------------------------------------------
# installation, driver and runtime versions, tensor descriptors


def test_installation_names_the_imported_package_and_its_git_revision():
    import hopperkern

    where = info.collect()["installation"]
    pkg = Path(hopperkern.__file__).resolve().parent
    assert where["path"] == str(pkg)
    assert where["kind"].startswith(("editable install", "wheel install", "not installed", "imported from"))
    if (pkg.parent / ".git").exists():
        head = subprocess.run(["git", "-C", str(pkg.parent), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
        assert where["git"].startswith(head)
    else:
        assert where["git"] is None
    assert f"{pkg} (" in _rendered(info.collect())


class _Dist:
    """A stand-in for importlib.metadata's distribution of hopperkern."""

    version = "0.1.0"

    def __init__(self, site, direct_url):
        self.site, self.direct_url = site, direct_url

    def read_text(self, name):
        return json.dumps(self.direct_url) if name == "direct_url.json" and self.direct_url is not None else None

    def locate_file(self, name):
        return self.site


@pytest.mark.parametrize("direct_url, site, kind", [
    (None, "SITE", "wheel install"),
    ({"url": "file:///wheels/hopperkern-0.1.0-py3-none-any.whl", "archive_info": {}}, "SITE",
     "wheel install from file:///wheels/hopperkern-0.1.0-py3-none-any.whl"),
    ({"url": "file://SRC", "dir_info": {"editable": True}}, "/elsewhere", "editable install of SRC"),
    ({"url": "file:///other/checkout", "dir_info": {"editable": True}}, "/elsewhere",
     "imported from a source tree; hopperkern 0.1.0 is an editable install of /other/checkout"),
    (None, "/elsewhere", "imported from a source tree; hopperkern 0.1.0 is installed at /elsewhere"),
])
def test_installation_kinds(direct_url, site, kind, monkeypatch):
    from importlib import metadata

    import hopperkern

    root = str(Path(hopperkern.__file__).resolve().parent.parent)
    if direct_url:
        direct_url = json.loads(json.dumps(direct_url).replace("SRC", root))
    monkeypatch.setattr(metadata, "distribution", lambda name: _Dist(root if site == "SITE" else site, direct_url))
    assert info._installation()["kind"] == kind.replace("SRC", root)


def test_installation_without_a_distribution(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    assert info._installation()["kind"] == "not installed: imported from a source tree on the path"


def test_numpy_missing_is_said(monkeypatch):
    real = info._version

    def version(module):
        if module == "numpy":
            raise ModuleNotFoundError("No module named 'numpy'")
        return real(module)

    monkeypatch.setattr(info, "_version", version)
    assert info.collect()["environment"]["numpy"] == ("not installed (only Triton's CPU interpreter needs it: pip "
                                                      'install "hopperkern[interpreter]")')


@pytest.mark.parametrize("proc, version", [
    ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n", "550.54.15"),
    ("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  570.86.10  Release Build  (dvs-builder@U16)\n",
     "570.86.10"),
])
def test_nvidia_driver_version_from_proc(proc, version, monkeypatch):
    monkeypatch.setattr(capmod, "_cuda_available", lambda: True)
    monkeypatch.setattr(capmod, "_proc_driver_text", lambda: proc)
    assert capmod.nvidia_driver_version() == version


def test_nvidia_driver_version_unreadable_is_could_not_collect(monkeypatch):
    """A GPU, but neither /proc nor nvidia-smi answers: the report says so instead of raising."""
    monkeypatch.setattr(capmod, "_cuda_available", lambda: True)
    monkeypatch.setattr(capmod, "_proc_driver_text", lambda: "")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(RuntimeError, match="no /proc/driver/nvidia/version and nvidia-smi failed"):
        capmod.nvidia_driver_version()
    assert info.collect()["environment"]["NVIDIA driver"].startswith(
        "could not collect: RuntimeError: no /proc/driver/nvidia/version and nvidia-smi failed")


def test_cuda_runtime_version_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(capmod, "_cuda_available", lambda: False)
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        capmod.cuda_runtime_version()
    with pytest.raises(RuntimeError, match="no CUDA GPU is available"):
        capmod.nvidia_driver_version()


def test_installation_strings_are_escaped(monkeypatch):
    monkeypatch.setattr(info, "_installation", lambda: {"path": "/opt/[bold]site[/bold]/hopperkern",
                                                        "kind": "wheel install", "git": "[red]abc1234"})
    text = _rendered(info.collect())
    assert "/opt/[bold]site[/bold]/hopperkern (wheel install)" in text and "[red]abc1234" in text


def test_cpu_without_interpreter_does_not_claim_tensor_descriptors(monkeypatch):
    """Triton has the descriptor API, but with no GPU and the interpreter off nothing can use it: the report says
    "no" and why, never a bare "yes"."""
    cpu = Capability(cuda_available=False, interpreter=False, device_name=None, compute_capability=None,
                     sm_count=None, triton_version="3.6.0", tensor_descriptors=True, tma=False,
                     reasons=("no CUDA GPU is available (and Triton's interpreter is off)",))
    _fake_capability(monkeypatch, cpu)
    data = info.collect()
    assert (data["capability"]["triton_has_tensor_descriptors"], data["capability"]["tma"]) == (True, False)
    text = _rendered(data)
    assert re.search(r"tensor descriptors \(TMA\) here +│ no: no CUDA GPU is available", text), text
    assert not re.search(r"tensor descriptors[^│\n]*│ yes", text)
    _fake_capability(monkeypatch, H200)
    assert re.search(r"tensor descriptors \(TMA\) here +│ yes", _rendered(info.collect()))
