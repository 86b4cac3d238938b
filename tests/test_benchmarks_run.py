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
