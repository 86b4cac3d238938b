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
    "triton_version": "3.6.0",
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
    p = _write(tmp_path / "NVIDIA_H200_NVL.json", VALID)
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    cfg = load_config("NVIDIA H200 NVL")
    assert cfg.origin == str(p)
    assert cfg.why == "HOPPERKERN_CONFIG folder, device name 'NVIDIA H200 NVL' given by the caller"


def test_current_gpu_in_hopperkern_config_folder(tmp_path, monkeypatch):
    fake = Capability(cuda_available=True, interpreter=False, device_name="NVIDIA H200", compute_capability=(9, 0),
                      sm_count=132, triton_version="3.6.0", tensor_descriptors=True, tma=True, reasons=())
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
    path, looked, why = tuning.config_search("Test GPU")
    assert path is None
    assert looked == [str(tmp_path / "Test_GPU.json")] + [str(d / "Test_GPU.json")
                                                        for d in tuning.packaged_config_dirs()]
    assert why == "device name 'Test GPU' given by the caller"


# ---------------------------------------------------------------------------------------------------------------
# packaged files: a wheel's hopperkern/configs/ and a checkout's top-level configs/


@pytest.mark.parametrize("layout", ["checkout", "wheel"])
def test_packaged_file_is_found(layout, tmp_path):
    """Copy the package into the layout a checkout or an installed wheel has, and load a packaged file there."""
    root = tmp_path / layout
    shutil.copytree(Path(hopperkern.__file__).parent, root / "hopperkern",
                    ignore=shutil.ignore_patterns("__pycache__"))
    configs = root / "configs" if layout == "checkout" else root / "hopperkern" / "configs"
    p = _write(configs / "Test_GPU.json", VALID)
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
    Bad("moe block_m mismatch", _edit(lambda d: d["moe"][MOE_KEY]["1"]["gemm2"].update(block_m=128)),
        rf"field 'moe\.{MOE_KEY}\.1': Value error, gemm1\.block_m \(64\) must equal gemm2\.block_m \(128\)",
        "the alignment pads to one block_m for both GEMMs"),
    Bad("schema_version", _edit(lambda d: d.update(schema_version=2)),
        r"field 'schema_version': Value error, schema_version must be 1, got 2", "file from a newer hopperkern"),
    Bad("non-integer bucket", _edit(lambda d: d["lce"][LCE_KEY].update(big=K64)),
        rf"field 'lce': Value error, {LCE_KEY}: token bucket must be a positive integer string, got 'big'",
        "buckets are token counts"),
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


def test_malformed_file_is_an_error_through_lookup_too(tmp_path, monkeypatch):
    """A bad file found by device name must raise, not fall back to defaults silently."""
    _write(tmp_path / "NVIDIA_H200.json", "{")
    monkeypatch.setenv("HOPPERKERN_CONFIG", str(tmp_path))
    with pytest.raises(TuningFileError, match="NVIDIA_H200.json: not valid JSON"):
        load_config("NVIDIA H200")
    assert issubclass(TuningFileError, ValueError)
