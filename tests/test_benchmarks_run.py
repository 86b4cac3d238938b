"""python -m benchmarks.run (the README's main job): where it writes, and that it never overwrites tracked files."""

import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import run


@pytest.fixture
def repo(tmp_path):
    """A git checkout with one tracked results file (results/lce.csv) and an untracked folder (mine/)."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "lce.csv").write_text("stored\n")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "old.csv").write_text("mine\n")
    subprocess.run(["git", "add", "results/lce.csv"], cwd=tmp_path, check=True)
    return tmp_path


def test_tracked_files(repo):
    assert run.tracked_files(repo / "results") == ["results/lce.csv"]
    assert run.tracked_files(repo / "mine") == []
    assert run.tracked_files(repo / "new" / "deeper") == []  # does not exist yet
    assert run.tracked_files(repo.parent / "elsewhere") == []  # outside any checkout


def test_refuses_a_folder_of_tracked_files(repo, capsys):
    with pytest.raises(SystemExit) as exc:
        run.main(["--out", str(repo / "results")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "holds files tracked by git (1, e.g. results/lce.csv)" in err and "--overwrite-tracked" in err
    assert (repo / "results" / "lce.csv").read_text() == "stored\n"


def test_without_a_gpu_reports_and_writes_nothing(repo, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert run.main(["--out", str(repo / "new")]) == 0
    assert "Nothing was written" in capsys.readouterr().out
    assert not (repo / "new").exists()
    # Asked for explicitly, a tracked folder passes the check (the GPU run would then refresh it).
    assert run.main(["--out", str(repo / "results"), "--overwrite-tracked"]) == 0


def test_default_is_a_fresh_folder(tmp_path):
    out = run.fresh_out_dir(tmp_path / "bench-results")
    assert out.parent == tmp_path / "bench-results" and not out.exists()


# ---------------------------------------------------------------------------------------------------------------
# plots redrawn from the stored CSVs (no GPU)

RESULTS = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
PLOTTED = [("bench_lce", "lce"), ("bench_moe", "moe"), ("bench_moe_train", "moe_train")]


@pytest.mark.parametrize("module, family", PLOTTED)
def test_plot_from_a_stored_csv(module, family, tmp_path):
    """`--plot-from` redraws a stored CSV without a GPU; the plot names the GPU, the versions and the dtype."""
    pytest.importorskip("matplotlib")
    import importlib

    csv_path = RESULTS / f"{family}_NVIDIA_H200.csv"
    if not csv_path.is_file():
        pytest.skip("no stored results")
    bench = importlib.import_module(f"benchmarks.{module}")
    assert bench.main(["--plot-from", str(csv_path), "--out", str(tmp_path)]) == 0
    assert (tmp_path / f"{family}_NVIDIA_H200.png").stat().st_size > 10_000
    from benchmarks.common import load_csv, run_label

    assert run_label(load_csv(csv_path)[0]).startswith("NVIDIA H200, bf16, torch ")


@pytest.mark.parametrize("module, family", PLOTTED)
def test_plot_without_matplotlib_says_so(module, family, tmp_path, monkeypatch, capsys):
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    bench = importlib.import_module(f"benchmarks.{module}")
    assert bench.main(["--plot-from", str(RESULTS / f"{family}_NVIDIA_H200.csv"), "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err == (f"{module}: matplotlib is not installed, so no plot was drawn (the CSV has every figure): "
                   'pip install "hopperkern[bench]"\n')
    bench.plot([], tmp_path / "x.png")  # a benchmark run keeps its CSV and says the same
    assert "matplotlib is not installed" in capsys.readouterr().err and not (tmp_path / "x.png").exists()


def test_pyproject_extras_and_license():
    import tomllib

    root = RESULTS.parent.parent
    project = tomllib.loads((root / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert any(d.startswith("numpy") for d in extras["interpreter"]) and any(d.startswith("numpy") for d in
                                                                             extras["test"])
    assert any(d.startswith("matplotlib") for d in extras["bench"])
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (root / "LICENSE").read_text()
    assert "Apache License\n                           Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_best_public_figures_only_for_their_gpu():
    """The public MoE latencies were measured on one GPU: rows of another get no ratio to them."""
    from benchmarks import bench_moe

    assert bench_moe.best_public_us("qwen3-30B-A3B", 1, "NVIDIA H200") == bench_moe.BEST_PUBLIC_US["qwen3-30B-A3B"][0]
    assert bench_moe.best_public_us("qwen3-30B-A3B", 1, "NVIDIA H100 80GB HBM3") is None
    assert bench_moe.best_public_us("qwen3-30B-A3B", 3, "NVIDIA H200") is None  # off the grid
    stored = RESULTS / "moe_NVIDIA_H100_80GB_HBM3.csv"
    if stored.is_file():
        from benchmarks.common import load_csv

        assert not any(r.get("vs_best_public") for r in load_csv(stored))


def test_moe_kernel_parts_sum_each_kernel_family_per_call(monkeypatch):
    from benchmarks import bench_moe

    profile = [("_align_small_kernel", 30.0), ("_gate_up_kernel", 200.0), ("_down_direct_kernel", 100.0),
               ("_down_kernel", 50.0), ("_topk_sum_kernel", 20.0), ("void at::native::fill", 10.0)]
    monkeypatch.setattr(bench_moe, "kernel_profile", lambda fn, calls: profile)
    assert bench_moe.kernel_parts(lambda: None, calls=10) == {
        "kernel_us_align": 3.0, "kernel_us_gate_up": 20.0, "kernel_us_down": 15.0, "kernel_us_topk_sum": 2.0,
        "kernel_us_other": 1.0}
