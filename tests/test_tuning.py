"""Tuning files: lookup order, the single fallback warning, nearest-bucket lookup, malformed-file errors."""

import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton

import hopperkern
from hopperkern import tuning
from hopperkern.tma import Capability
from hopperkern.tuning import KernelConfig, TuningFileError, load_config

capmod = importlib.import_module("hopperkern.tma.capability")
REPO = Path(__file__).resolve().parent.parent

K64 = {"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, "num_warps": 4, "num_stages": 3}
K128 = {"block_m": 128, "block_n": 256, "block_k": 64, "group_m": 8, "num_warps": 8, "num_stages": 3}
K_SMALL_H = {"block_m": 64, "block_n": 64, "block_k": 32, "num_warps": 4, "num_stages": 2}
LCE_KEY = "forward:bfloat16:H4096"
MOE_KEY = "E128_H2048_I768_bfloat16"
VALID = {
    "schema_version": 1,
    "device_name": "NVIDIA H200",
    "triton_version": triton.__version__,  # the running one: no version warning in tests that count warnings
    "lce": {LCE_KEY: {"1": K64, "64": K64, "4096": K128}, "forward:bfloat16:H1024": {"64": K_SMALL_H}},
    "moe": {MOE_KEY: {"1": {"gemm1": K64, "gemm2": K64}, "4096": {"gemm1": K128, "gemm2": K128}}},
}


@pytest.fixture(autouse=True)
def clean_tuning_state(monkeypatch):
    """Each test starts with no HOPPERKERN_CONFIG, no remembered warnings and no cached files."""
    monkeypatch.delenv("HOPPERKERN_CONFIG", raising=False)
    tuning._WARNED.clear()
    tuning._FOUND.clear()
    tuning._load_cached.cache_clear()
    yield
    tuning._WARNED.clear()
    tuning._FOUND.clear()
    tuning._load_cached.cache_clear()


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


# ---------------------------------------------------------------------------------------------------------------
# lookup order


def test_load_from_path(tmp_path):
    p = _write(tmp_path / "mine.json", VALID)
    for source in (p, str(p)):
        cfg = load_config(source)
        assert cfg.origin == str(p) and cfg.why == "path given by the caller" and not cfg.is_default
        assert cfg.device_name == "NVIDIA H200"
        assert cfg.lce_config("forward", torch.bfloat16, 100, 4096) == KernelConfig(**K64)


def test_save_round_trip(tmp_path):
    cfg = load_config(_write(tmp_path / "a.json", VALID))
    cfg.save(tmp_path / "b.json")
    again = load_config(tmp_path / "b.json")
    assert again.model_dump() == cfg.model_dump() and again.origin == str(tmp_path / "b.json")


def test_device_name_in_hopperkern_config_folder(tmp_path, monkeypatch):
    p = _write(tmp_path / "NVIDIA_H200_NVL.json", {**VALID, "device_name": "NVIDIA H200 NVL"})
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    cfg = load_config("NVIDIA H200 NVL")
    assert cfg.origin == str(p)
    assert cfg.why == "HOPPERKERN_CONFIG folder, device name 'NVIDIA H200 NVL' given by the caller"


def test_current_gpu_in_hopperkern_config_folder(tmp_path, monkeypatch):
    fake = Capability(cuda_available=True, interpreter=False, device_name="NVIDIA H200", compute_capability=(9, 0),
                      sm_count=132, triton_version=triton.__version__, tensor_descriptors=True, tma=True, reasons=())
    monkeypatch.setattr(capmod, "capability", lambda device=None: fake)
    p = _write(tmp_path / "NVIDIA_H200.json", VALID)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    cfg = load_config()
    assert (cfg.origin, cfg.why) == (str(p), "HOPPERKERN_CONFIG folder, current GPU")


def test_hopperkern_config_file_comes_first(tmp_path, monkeypatch):
    p = _write(tmp_path / "any-name.json", VALID)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(p))
    for source in (None, "NVIDIA H200"):
        cfg = load_config(source)
        assert (cfg.origin, cfg.why) == (str(p), "HOPPERKERN_CONFIG file")


def test_remembered_lookup_sees_edits_removal_and_a_new_env_value(tmp_path, monkeypatch):
    """Op calls skip the file search once a file was found, but an edited file (new mtime) is read again, a
    removed one is searched for again, and a changed HOPPERKERN_CONFIG is a new lookup."""
    import os

    p = _write(tmp_path / "a.json", VALID)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(p))
    first = load_config("NVIDIA H200")
    assert load_config("NVIDIA H200") is first  # remembered: same parsed object
    edited = json.loads(json.dumps(VALID))
    edited["lce"] = {}
    _write(p, edited)
    os.utime(p, ns=(os.stat(p).st_atime_ns, os.stat(p).st_mtime_ns + 10**9))
    again = load_config("NVIDIA H200")
    assert again is not first and again.lce == {}
    q = _write(tmp_path / "b.json", VALID)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(q))
    assert load_config("NVIDIA H200").origin == str(q)
    q.unlink()
    with pytest.raises(FileNotFoundError, match="b.json"):
        load_config("NVIDIA H200")


def test_hopperkern_config_folder_without_the_file_falls_back(tmp_path, monkeypatch):
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    with pytest.warns(UserWarning) as rec:
        cfg = load_config("Test GPU 9000")
    assert cfg.is_default
    assert str(tmp_path / "Test_GPU_9000.json") in str(rec[0].message)  # the env folder was searched first


def test_fallback_warns_once_naming_file_and_tuner():
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = load_config("Test GPU 9000")
        second = load_config("Test GPU 9000")
    assert len(rec) == 1, [str(w.message) for w in rec]
    msg = str(rec[0].message)
    assert "no tuning file found (looked for " in msg
    for d in tuning.packaged_config_dirs():
        assert str(d / "Test_GPU_9000.json") in msg
    assert msg.endswith("Tune this GPU with: python -m hopperkern.tune --out configs/")
    assert rec[0].filename == __file__  # stacklevel points at the caller
    for cfg in (first, second):
        assert cfg.is_default and cfg.origin == "built-in defaults"
        assert cfg.lce_config("forward", torch.bfloat16, 1, 4096) is None
        assert cfg.moe_config(128, 2048, 768, torch.bfloat16, 1) is None


def test_no_gpu_no_file_to_look_for():
    # On a CPU machine (interpreter) there is no device name: defaults, silently, with the reason recorded.
    if tuning._current_device_name() is not None:
        pytest.skip("a GPU is present")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config()
    assert cfg.is_default and cfg.why == "no GPU: no device file to look for"


def test_missing_explicit_path(tmp_path, monkeypatch):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match=re.escape(f"tuning file {missing} (path given by the caller) "
                                                          "does not exist")):
        load_config(missing)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(missing))
    with pytest.raises(FileNotFoundError, match=re.escape("(HOPPERKERN_CONFIG file) does not exist")):
        load_config()


def test_config_search_reports_what_it_looked_for(tmp_path, monkeypatch):
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    found = tuning.config_search("Test GPU")
    assert found.path is None and found.closest_to is None
    assert found.looked == [str(tmp_path / "Test_GPU.json")] + [str(d / "Test_GPU.json")
                                                              for d in tuning.packaged_config_dirs()]
    assert found.why == "device name 'Test GPU' given by the caller"


# ---------------------------------------------------------------------------------------------------------------
# a GPU without a file of its own: the closest file of the same architecture


def _gpu(monkeypatch, name, cc=(9, 0), sms=132):
    """Make the current GPU ``name`` for tuning's device lookups."""
    fake = Capability(cuda_available=True, interpreter=False, device_name=name, compute_capability=cc,
                      sm_count=sms, triton_version=triton.__version__, tensor_descriptors=True, tma=cc >= (9, 0),
                      reasons=())
    monkeypatch.setattr(capmod, "capability", lambda device=None: fake)


def _device_file(folder: Path, device: str, **extra) -> Path:
    return _write(folder / f"{hopperkern.tma.normalize_device_name(device)}.json",
                  {**VALID, "device_name": device, **extra})


@pytest.fixture
def only_env_folder(tmp_path, monkeypatch):
    """HOPPERKERN_CONFIG is an empty folder and no packaged folder holds files: each test writes what it needs."""
    folder = tmp_path / "configs"
    folder.mkdir()
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(folder))
    monkeypatch.setattr(tuning, "packaged_config_dirs", lambda: [tmp_path / "no-package"])
    return folder


# The shipped files: the H200's and the H100 SXM's. Every other Hopper GPU takes the closest of them.
_PACKAGED_CLOSEST = [("NVIDIA H100 PCIe", "NVIDIA_H100_80GB_HBM3", "NVIDIA H100 80GB HBM3"),
                     ("NVIDIA H800", "NVIDIA_H100_80GB_HBM3", "NVIDIA H100 80GB HBM3"),
                     ("NVIDIA H100 NVL", "NVIDIA_H100_80GB_HBM3", "NVIDIA H100 80GB HBM3"),
                     ("NVIDIA H20", "NVIDIA_H200", "NVIDIA H200"),
                     ("NVIDIA GH200 480GB", "NVIDIA_H200", "NVIDIA H200")]


@pytest.mark.parametrize("device, stem, tuned_on", _PACKAGED_CLOSEST)
def test_hopper_gpu_without_a_file_loads_the_closest_packaged_file_with_one_warning(device, stem, tuned_on,
                                                                                   monkeypatch):
    """A shipped file serves every Hopper GPU; the warning names the file looked for and the one used."""
    _gpu(monkeypatch, device)
    own = hopperkern.tma.normalize_device_name(device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        first = load_config()
        second = load_config()
    assert second is first and not first.is_default
    assert Path(first.origin) == REPO / "configs" / f"{stem}.json" and first.device_name == tuned_on
    assert first.why == f"closest file of the same architecture (sm_90): no file for {device} (current GPU)"
    msgs = [str(w.message) for w in rec if "tuned with triton" not in str(w.message)]  # the shipped file's triton
    assert len(msgs) == 1, msgs
    assert msgs[0].startswith(f"hopperkern: no tuning file for {device} (looked for ")
    assert f"{own}.json" in msgs[0] and f"using {first.origin} (tuned on {tuned_on})" in msgs[0]
    assert "the closest file of the same architecture (sm_90)" in msgs[0]
    assert msgs[0].endswith("Tune this GPU with: python -m hopperkern.tune --out configs/")
    assert all(w.filename == __file__ for w in rec)


@pytest.mark.parametrize("device", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_gpu_with_a_shipped_file_loads_it_quietly(device, monkeypatch):
    _gpu(monkeypatch, device)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cfg = load_config()
    stem = hopperkern.tma.normalize_device_name(device)
    assert Path(cfg.origin) == REPO / "configs" / f"{stem}.json" and cfg.device_name == device
    assert cfg.why.startswith("packaged"), cfg.why
    assert [str(w.message) for w in rec if "tuned with triton" not in str(w.message)] == []
    assert cfg.lce and cfg.moe  # both families tuned


def test_gpu_of_another_architecture_gets_defaults_not_a_hopper_file(monkeypatch):
    _gpu(monkeypatch, "NVIDIA A100-SXM4-80GB", cc=(8, 0), sms=108)
    with pytest.warns(UserWarning, match="no tuning file found .*NVIDIA_A100-SXM4-80GB.json.*built-in defaults"):
        cfg = load_config()
    assert cfg.is_default and cfg.why == "current GPU"


def test_closest_file_prefers_the_same_model_then_the_table(only_env_folder, monkeypatch):
    """An H100 SXM without a file: an H100 PCIe file (same model) beats the H200's; without it, an H800's (the
    same chip) beats the H200's; files of other architectures and of unknown models never count."""
    _device_file(only_env_folder, "NVIDIA H200")
    _device_file(only_env_folder, "NVIDIA A100-SXM4-80GB")
    _write(only_env_folder / "notes.json", {})
    pcie = _device_file(only_env_folder, "NVIDIA H100 PCIe")
    with pytest.warns(UserWarning, match="no tuning file for NVIDIA H100 80GB HBM3"):
        assert load_config("NVIDIA H100 80GB HBM3").origin == str(pcie)
    pcie.unlink()
    h800 = _device_file(only_env_folder, "NVIDIA H800")
    with pytest.warns(UserWarning, match=re.escape(f"using {h800} (tuned on NVIDIA H800)")):
        assert load_config("NVIDIA H100 80GB HBM3").origin == str(h800)


def test_own_file_appearing_beside_the_closest_one_is_found(only_env_folder, monkeypatch):
    """The remembered closest-file lookup is dropped when the folder changes: the GPU's own file, written by
    the tuner after the first call, is used from the next call on."""
    _device_file(only_env_folder, "NVIDIA H200")
    searches = []
    real = tuning.config_search
    monkeypatch.setattr(tuning, "config_search", lambda source=None: searches.append(source) or real(source))
    with pytest.warns(UserWarning):
        closest = load_config("NVIDIA H100 PCIe")
    assert load_config("NVIDIA H100 PCIe") is closest and len(searches) == 1  # remembered
    own = _device_file(only_env_folder, "NVIDIA H100 PCIe")
    cfg = load_config("NVIDIA H100 PCIe")
    assert (cfg.origin, cfg.why) == (str(own), "HOPPERKERN_CONFIG folder, device name 'NVIDIA H100 PCIe' given by "
                                               "the caller")
    own.unlink()
    assert load_config("NVIDIA H100 PCIe").origin == closest.origin  # warned once already: no second warning


def test_defaults_lookup_is_remembered_until_a_file_appears(only_env_folder, monkeypatch):
    searches = []
    real = tuning.config_search
    monkeypatch.setattr(tuning, "config_search", lambda source=None: searches.append(source) or real(source))
    with pytest.warns(UserWarning, match="built-in defaults"):
        assert load_config("NVIDIA H100 PCIe").is_default
    assert load_config("NVIDIA H100 PCIe").is_default and len(searches) == 1
    _device_file(only_env_folder, "NVIDIA H200")
    with pytest.warns(UserWarning, match="closest file of the same architecture"):
        assert load_config("NVIDIA H100 PCIe").device_name == "NVIDIA H200"
    assert len(searches) == 2


@pytest.mark.parametrize("device, candidates, closest", [
    ("NVIDIA H100 80GB HBM3", ["NVIDIA_H200", "NVIDIA_H100_PCIe"], ["NVIDIA_H100_PCIe", "NVIDIA_H200"]),
    ("NVIDIA H100 80GB HBM3", ["NVIDIA_H200"], ["NVIDIA_H200"]),
    ("NVIDIA H100 PCIe", ["NVIDIA_H100_NVL", "NVIDIA_H800_PCIe"], ["NVIDIA_H100_NVL", "NVIDIA_H800_PCIe"]),
    ("NVIDIA H800", ["NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"], ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"]),
    ("NVIDIA H20", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"], ["NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"]),
    ("NVIDIA GH200 480GB", ["NVIDIA_H100_80GB_HBM3", "NVIDIA_H200"], ["NVIDIA_H200", "NVIDIA_H100_80GB_HBM3"]),
    ("NVIDIA H200 NVL", ["NVIDIA_H100_NVL", "NVIDIA_H200"], ["NVIDIA_H200", "NVIDIA_H100_NVL"]),
    ("NVIDIA H20 (MIG 1g.12gb)", ["NVIDIA_H20", "NVIDIA_H200"], ["NVIDIA_H20", "NVIDIA_H200"]),
    ("NVIDIA A100-SXM4-80GB", ["NVIDIA_H200", "NVIDIA_A800"], ["NVIDIA_A800"]),
    ("NVIDIA H200", ["NVIDIA_H200", "NVIDIA_B200", "Test_GPU"], []),
])
def test_closest_devices(device, candidates, closest):
    """Same compute capability only; the same model first, then the model table, then SM counts, then names."""
    assert capmod.closest_devices(device, candidates) == closest


def test_closest_devices_of_an_unknown_gpu_use_its_own_facts():
    assert capmod.closest_devices("NVIDIA Future Hopper", ["NVIDIA_H200", "NVIDIA_A100"]) == []
    assert capmod.closest_devices("NVIDIA Future Hopper", ["NVIDIA_H20", "NVIDIA_H200", "NVIDIA_A100"],
                                  compute_capability=(9, 0), sm_count=80) == ["NVIDIA_H20", "NVIDIA_H200"]


# ---------------------------------------------------------------------------------------------------------------
# the file's own facts: device name, Triton version


def test_device_name_must_match_the_file_name(only_env_folder, monkeypatch):
    """A file found by its name must hold that GPU's tuning: a renamed copy of another GPU's file is an error,
    also when it is picked as the closest file. An explicit path may carry any name."""
    wrong = _write(only_env_folder / "NVIDIA_H100_PCIe.json", VALID)  # the H200's entries under the H100's name
    msg = (re.escape(f"{wrong}: field 'device_name' must be the name of the GPU the file is named after "
                     "(NVIDIA_H100_PCIe.json holds the GPU whose name normalizes to 'NVIDIA_H100_PCIe'), got "
                     "'NVIDIA H200'"))
    with pytest.raises(TuningFileError, match=msg):
        load_config("NVIDIA H100 PCIe")
    # As a closest file it is passed over with a warning that names the problem (a folder may hold files that are
    # no valid tuning file for their name; they must not break every op call of a GPU without its own file).
    with pytest.warns(UserWarning) as rec:
        cfg = load_config("NVIDIA H100 80GB HBM3")
    assert cfg.is_default
    assert any(re.search(msg, str(w.message)) and "passing over" in str(w.message) for w in rec), rec
    assert load_config(wrong).device_name == "NVIDIA H200"


def test_other_triton_version_warns_once(tmp_path):
    p = _write(tmp_path / "c.json", {**VALID, "triton_version": "3.0.0"})
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(3):
            load_config(p)
    msgs = [str(w.message) for w in rec]
    assert msgs == [f"hopperkern: tuning file {p} was tuned with triton 3.0.0, this process runs triton "
                    f"{triton.__version__}: its launch configs are used, but may no longer be the fastest. "
                    "Re-tune with: python -m hopperkern.tune --out configs/"]
    assert rec[0].filename == __file__


def test_same_triton_version_does_not_warn(tmp_path):
    p = _write(tmp_path / "c.json", {**VALID, "triton_version": triton.__version__})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(p)


# ---------------------------------------------------------------------------------------------------------------
# canonical order: what the tuner writes reads well and diffs well


def test_save_writes_entries_in_numeric_order(tmp_path):
    data = json.loads(json.dumps(VALID))
    data["lce"]["backward:bfloat16:H896"] = {"16384": K64, "2048": K64}
    data["moe"]["E8_H4096_I14336_bfloat16"] = {"64": data["moe"][MOE_KEY]["1"]}
    p = tmp_path / "out.json"
    tuning.TuningConfig.model_validate(data).save(p)
    text = p.read_text()
    saved = json.loads(text)
    assert list(saved) == ["schema_version", "device_name", "triton_version", "tuned_at", "tuner", "lce", "moe"]
    assert list(saved["lce"]) == ["forward:bfloat16:H1024", LCE_KEY, "backward:bfloat16:H896"]
    assert list(saved["lce"][LCE_KEY]) == ["1", "64", "4096"]
    assert list(saved["lce"]["backward:bfloat16:H896"]) == ["2048", "16384"]
    assert list(saved["moe"]) == ["E8_H4096_I14336_bfloat16", MOE_KEY]
    assert list(saved["lce"][LCE_KEY]["1"]) == ["block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages",
                                                "flatten"]
    assert '      "1": {"block_m": 64, "block_n": 128, "block_k": 64, "group_m": 8, ' in text  # one line per config
    assert load_config(p).model_dump() == tuning.TuningConfig.model_validate(data).model_dump()


def test_shipped_files_are_in_canonical_order():
    files = sorted((REPO / "configs").glob("*.json"))
    if not files:
        pytest.skip("not a source checkout")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a file tuned with another triton than this test's
        for f in files:
            assert f.read_text() == load_config(f).canonical_json(), f"{f.name}: rewrite it with TuningConfig.save"


# ---------------------------------------------------------------------------------------------------------------
# packaged files: a wheel's hopperkern/configs/ and a checkout's top-level configs/


@pytest.mark.parametrize("layout", ["checkout", "wheel"])
def test_packaged_file_is_found(layout, tmp_path):
    """Copy the package into the layout a checkout or an installed wheel has, and load a packaged file there."""
    root = tmp_path / layout
    shutil.copytree(Path(hopperkern.__file__).parent, root / "hopperkern",
                    ignore=shutil.ignore_patterns("__pycache__"))
    configs = root / "configs" if layout == "checkout" else root / "hopperkern" / "configs"
    if layout == "checkout":  # what marks a checkout: site-packages/configs/ of a wheel install is not searched
        (root / "pyproject.toml").write_text("[project]\nname = 'hopperkern'\n")
    p = _write(configs / "Test_GPU.json", {**VALID, "device_name": "Test GPU"})
    code = ("import hopperkern, hopperkern.tuning as t, warnings; warnings.simplefilter('error'); "
            "c = t.load_config('Test GPU'); print(hopperkern.__file__); print(c.origin); print(c.why)")
    env = {k: v for k, v in os.environ.items() if k != "HOPPERKERN_CONFIG"}
    env["PYTHONPATH"] = str(root)
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    where, origin, why = out.stdout.splitlines()
    assert Path(where).is_relative_to(root)  # the copy ran, not the checkout
    assert Path(origin).resolve() == p.resolve()
    assert why == "packaged file, device name 'Test GPU' given by the caller"


def test_checkout_has_a_configs_folder():
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    assert (REPO / "configs" / "README.md").is_file()
    assert REPO / "configs" in tuning.packaged_config_dirs()


def test_pyproject_ships_configs_in_the_wheel():
    if not (REPO / "pyproject.toml").is_file():
        pytest.skip("not a source checkout")
    import tomllib

    st = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "hopperkern.configs" in st["packages"]
    assert st["package-dir"]["hopperkern.configs"] == "configs"
    assert "*.json" in st["package-data"]["hopperkern.configs"]
    # every package of the source tree goes into the wheel (the tuner too: python -m hopperkern.tune)
    found = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "hopperkern").rglob("__init__.py")}
    assert found <= set(st["packages"]) and "hopperkern.tune" in found


# ---------------------------------------------------------------------------------------------------------------
# nearest bucket


@pytest.mark.parametrize("tokens, block_n", [
    (0, 128), (1, 128), (7, 128), (9, 128), (64, 128), (500, 128), (600, 256), (10**6, 256),
])
def test_nearest_lce_bucket_on_a_log_scale(tokens, block_n, tmp_path):
    # buckets 1, 64 (both K64, block_n 128) and 4096 (K128, block_n 256); 64 -> 4096 switches at 512.
    cfg = load_config(_write(tmp_path / "c.json", VALID))
    assert cfg.lce_config("forward", torch.bfloat16, tokens, 4096).block_n == block_n


@pytest.mark.parametrize("tokens, block_m", [(1, 64), (63, 64), (65, 128), (4096, 128), (10**6, 128)])
def test_nearest_moe_bucket_on_a_log_scale(tokens, block_m, tmp_path):
    # buckets 1 (block_m 64) and 4096 (block_m 128): the geometric midpoint is 64.
    cfg = load_config(_write(tmp_path / "c.json", VALID))
    moe = cfg.moe_config(128, 2048, 768, torch.bfloat16, tokens)
    assert (moe.gemm1.block_m, moe.gemm2.block_m) == (block_m, block_m)


@pytest.mark.parametrize("hidden, block_k", [(4096, 64), (3000, 64), (16384, 64), (1500, 32), (1, 32)])
def test_nearest_lce_hidden_size_on_a_log_scale(hidden, block_k, tmp_path):
    # hidden sizes 1024 (block_k 32) and 4096 (block_k 64): the geometric midpoint is 2048.
    cfg = load_config(_write(tmp_path / "c.json", VALID))
    assert cfg.lce_config("forward", torch.bfloat16, 64, hidden).block_k == block_k


def test_unknown_keys_give_none(tmp_path):
    cfg = load_config(_write(tmp_path / "c.json", VALID))
    assert cfg.lce_config("backward", torch.bfloat16, 64, 4096) is None
    assert cfg.lce_config("forward", torch.float16, 64, 4096) is None
    assert cfg.moe_config(64, 2048, 768, torch.bfloat16, 64) is None
    assert tuning.lce_key("forward", torch.bfloat16, 4096) == LCE_KEY
    assert tuning.moe_key(128, 2048, 768, torch.bfloat16) == MOE_KEY


# ---------------------------------------------------------------------------------------------------------------
# malformed files: TuningFileError naming the file and the field


@dataclass(frozen=True)
class Bad:
    name: str
    content: object  # JSON text, or a function that edits a copy of VALID
    match: str  # regex after "<file>: "
    why: str


def _edit(fn):
    def make():
        data = json.loads(json.dumps(VALID))  # no shared sub-dicts
        fn(data)
        return data

    return make


def _lce_entry(data):
    return data["lce"][LCE_KEY]["64"]


BAD_FILES = [
    Bad("broken JSON", '{"schema_version": 1,', r"not valid JSON: ", "truncated by a crashed tuner"),
    Bad("not an object", "[1, 2]", r"top level must be a JSON object, got list", "wrong top-level type"),
    Bad("unknown key", _edit(lambda d: _lce_entry(d).update(blok_m=64)),
        r"field 'lce\.forward:bfloat16:H4096\.64\.blok_m': Extra inputs are not permitted", "typo in a kernel field"),
    Bad("unknown top-level key", _edit(lambda d: d.update(lcee={})),
        r"field 'lcee': Extra inputs are not permitted", "typo in a section name"),
    Bad("non-power-of-two tile", _edit(lambda d: _lce_entry(d).update(block_n=96)),
        r"field 'lce\.forward:bfloat16:H4096\.64\.block_n': Value error, block_n must be a power of two, got 96",
        "tiles are powers of two"),
    Bad("bad warps", _edit(lambda d: _lce_entry(d).update(num_warps=3)),
        r"field 'lce\.forward:bfloat16:H4096\.64\.num_warps': Value error, "
        r"num_warps must be one of \(1, 2, 4, 8, 16\), got 3", "warps are powers of two up to 16"),
    Bad("bad stages", _edit(lambda d: _lce_entry(d).update(num_stages=0)),
        r"field 'lce\.forward:bfloat16:H4096\.64\.num_stages': Value error, num_stages must be in \[1, 8\], got 0",
        "at least one stage"),
    Bad("bad group", _edit(lambda d: _lce_entry(d).update(group_m=100)),
        r"field 'lce\.forward:bfloat16:H4096\.64\.group_m': Value error, group_m must be in \[1, 64\], got 100",
        "grouped tile order bound"),
    Bad("missing field", _edit(lambda d: _lce_entry(d).pop("block_k")),
        r"field 'lce\.forward:bfloat16:H4096\.64\.block_k': Field required", "no silent default for a tile"),
    Bad("not an integer", _edit(lambda d: _lce_entry(d).update(block_m="big")),
        r"field 'lce\.forward:bfloat16:H4096\.64\.block_m': Input should be a valid integer", "wrong type"),
    Bad("integer as a string", _edit(lambda d: _lce_entry(d).update(block_m="64")),
        r"field 'lce\.forward:bfloat16:H4096\.64\.block_m': Input should be a valid integer", "no coercion of text"),
    Bad("integer as a float", _edit(lambda d: _lce_entry(d).update(block_k=64.0)),
        r"field 'lce\.forward:bfloat16:H4096\.64\.block_k': Input should be a valid integer", "no coercion of 64.0"),
    Bad("boolean as a tile", _edit(lambda d: _lce_entry(d).update(num_stages=True)),
        r"field 'lce\.forward:bfloat16:H4096\.64\.num_stages': Input should be a valid integer",
        "true is not 1 stage"),
    Bad("flag as text", _edit(lambda d: _lce_entry(d).update(flatten="yes")),
        r"field 'lce\.forward:bfloat16:H4096\.64\.flatten': Input should be a valid boolean", "no coercion of 'yes'"),
    Bad("flag as a number", _edit(lambda d: d["moe"][MOE_KEY]["1"].update(fused_topk=1)),
        rf"field 'moe\.{MOE_KEY}\.1\.fused_topk': Input should be a valid boolean", "no coercion of 1"),
    Bad("schema_version as text", _edit(lambda d: d.update(schema_version="1")),
        r"field 'schema_version': Input should be a valid integer", "no coercion of '1'"),
    Bad("moe block_m mismatch", _edit(lambda d: d["moe"][MOE_KEY]["1"]["gemm2"].update(block_m=128)),
        rf"field 'moe\.{MOE_KEY}\.1': Value error, gemm1\.block_m \(64\) must equal gemm2\.block_m \(128\)",
        "the alignment pads to one block_m for both GEMMs"),
    Bad("schema_version", _edit(lambda d: d.update(schema_version=2)),
        r"field 'schema_version': Value error, schema_version must be 1, got 2", "file from a newer hopperkern"),
    Bad("non-integer bucket", _edit(lambda d: d["lce"][LCE_KEY].update(big=K64)),
        rf"field 'lce': Value error, {LCE_KEY}: token bucket must be a positive integer string, got 'big'",
        "buckets are token counts"),
    Bad("typo in an lce key", _edit(lambda d: d["lce"].update({"forwrd:bfloat16:H4096": d["lce"].pop(LCE_KEY)})),
        r"field 'lce': Value error, entry key must be '<forward\|backward>:<dtype>:H<hidden>' with dtype float16, "
        r"bfloat16, float32 \(e\.g\. 'forward:bfloat16:H4096'\), got 'forwrd:bfloat16:H4096'",
        "a misspelt phase would never be looked up"),
    Bad("dtype alias in an lce key", _edit(lambda d: d["lce"].update({"forward:bf16:H4096": d["lce"].pop(LCE_KEY)})),
        r"field 'lce': Value error, entry key must be .* got 'forward:bf16:H4096'", "keys use torch's dtype names"),
    Bad("zero hidden size", _edit(lambda d: d["lce"].update({"forward:bfloat16:H0": d["lce"].pop(LCE_KEY)})),
        r"field 'lce': Value error, entry key must be .* got 'forward:bfloat16:H0'", "log-scale lookup by size"),
    Bad("typo in a moe key", _edit(lambda d: d["moe"].update({"E128_H2048_I768_bfloat": d["moe"].pop(MOE_KEY)})),
        r"field 'moe': Value error, entry key must be 'E<experts>_H<hidden>_I<intermediate>_<dtype>' with dtype "
        r"float16, bfloat16, float32 \(e\.g\. 'E128_H2048_I768_bfloat16'\), got 'E128_H2048_I768_bfloat'",
        "a truncated dtype would never be looked up"),
    Bad("zero bucket", _edit(lambda d: d["moe"][MOE_KEY].update({"0": d["moe"][MOE_KEY]["1"]})),
        rf"field 'moe': Value error, {MOE_KEY}: token bucket must be a positive integer string, got '0'",
        "log-scale lookup needs positive buckets"),
]


@pytest.mark.parametrize("bad", BAD_FILES, ids=lambda b: b.name)
def test_malformed_file_names_file_and_field(bad, tmp_path):
    content = bad.content if isinstance(bad.content, str) else bad.content()
    p = _write(tmp_path / "NVIDIA_H200.json", content)
    with pytest.raises(TuningFileError, match=re.escape(str(p)) + ": " + bad.match):
        load_config(p)


@pytest.mark.parametrize("data", [b'{"schema_version": 1, "device_name": "\xff\xfe"}',
                                  '{"schema_version": 1}'.encode("utf-16"), b"[" * 100000],
                         ids=["latin-1 bytes", "utf-16", "nested past the parser's depth"])
def test_unreadable_text_is_a_tuning_file_error(data, tmp_path, monkeypatch):
    """A file that is not UTF-8, or that the JSON parser cannot take, is a TuningFileError naming it, not a bare
    UnicodeDecodeError or RecursionError; as the closest file for a GPU without one, it is passed over."""
    p = tmp_path / "NVIDIA_H800.json"
    p.write_bytes(data)
    with pytest.raises(TuningFileError, match=re.escape(str(p))):
        load_config(p)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    with pytest.warns(UserWarning, match="NVIDIA_H800.json"):
        load_config("NVIDIA H800 PCIe")


def test_a_folder_given_as_the_path_says_so(tmp_path):
    """A folder passed where load_config wants a file is named as a folder, not as a missing file."""
    with pytest.raises(FileNotFoundError, match="is a folder, not a file"):
        load_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.json")


def _edit_in_place(path: Path, text: str, bump_ns: int) -> None:
    """Rewrite ``path`` without changing its folder's listing, with a modification time surely new."""
    path.write_text(text)
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + bump_ns))


def test_closest_file_made_invalid_is_passed_over_by_the_remembered_search(tmp_path, monkeypatch):
    """A closest file edited into an invalid one while the process runs is passed over (warning, the next closest
    file), as a fresh search would, rather than raising on every later call."""
    h800 = _write(tmp_path / "NVIDIA_H800.json", {"schema_version": 1, "device_name": "NVIDIA H800"})
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config("NVIDIA H800 PCIe").origin == str(h800)
        _edit_in_place(h800, "{ not json", 10**9)
        remembered = load_config("NVIDIA H800 PCIe").origin
        tuning._FOUND.clear()
        assert remembered == load_config("NVIDIA H800 PCIe").origin != str(h800)


def test_passed_over_candidate_repaired_is_taken_by_the_remembered_search(tmp_path, monkeypatch):
    """A closer candidate the search passed over as invalid and then repaired in place is found on the next call,
    as a fresh search would find it."""
    h800 = _write(tmp_path / "NVIDIA_H800.json", "{ not json")
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_config("NVIDIA H800 PCIe").origin != str(h800)
        _edit_in_place(h800, json.dumps({"schema_version": 1, "device_name": "NVIDIA H800"}), 10**9)
        assert load_config("NVIDIA H800 PCIe").origin == str(h800)


def test_malformed_file_is_an_error_through_lookup_too(tmp_path, monkeypatch):
    """A bad file found by device name must raise, not fall back to defaults silently."""
    _write(tmp_path / "NVIDIA_H200.json", "{")
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    with pytest.raises(TuningFileError, match="NVIDIA_H200.json: not valid JSON"):
        load_config("NVIDIA H200")
    assert issubclass(TuningFileError, ValueError)


def test_closest_file_passes_over_files_that_are_not_tuning_files(tmp_path, monkeypatch):
    """A GPU without its own file takes the closest valid one: a JSON in the folder whose name mentions a model
    but is no tuning file (sweep dumps, backups with dots in the name) is passed over, never raised on every call."""
    fake = Capability(cuda_available=True, interpreter=False, device_name="NVIDIA H100 PCIe",
                      compute_capability=(9, 0), sm_count=114, triton_version="3.6.0", tensor_descriptors=True,
                      tma=True, reasons=())
    monkeypatch.setattr(capmod, "capability", lambda device=None: fake)
    _write(tmp_path / "NVIDIA_H100_sweep.json", {"runs": [1, 2]})  # not a tuning file
    _write(tmp_path / "NVIDIA_H100.old.json", VALID)  # a backup name no device normalises to
    good = _write(tmp_path / "NVIDIA_H200.json", VALID)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    monkeypatch.setattr(tuning, "packaged_config_dirs", lambda: [tmp_path / "no-package"])  # this folder only
    with pytest.warns(UserWarning, match="closest file of the same architecture"):
        cfg = load_config()
    assert cfg.origin == str(good)
