"""Shared benchmark plumbing: same-run ceilings, run metadata, CSV in and out, plot set-up.

The timing helpers live in the package (:mod:`hopperkern.tune.timing`, which the tuner shares); they are
re-exported here so that every benchmark imports its plumbing from this one module.
"""

from __future__ import annotations

import csv
import os
import platform
import subprocess
from pathlib import Path

import torch

from hopperkern.tune.timing import capture_graph, graph_ms, pick_fastest, rel_err, time_cuda

__all__ = ["MATPLOTLIB_MISSING", "capture_graph", "git_sha", "graph_ms", "kernel_profile", "load_csv",
           "measure_ceilings", "pick_fastest", "pyplot", "redraw", "rel_err", "run_label", "run_meta", "time_cuda",
           "write_csv"]


def measure_ceilings() -> dict:
    """cuBLAS bf16 8192^3 rate (TFLOP/s) and device-to-device copy bandwidth (GB/s, bytes read + written),
    measured now, on random data."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms, _, _ = time_cuda(lambda: a @ b, warmup=3, reps=10)
    tflops = 2 * n**3 / ms / 1e9
    src = torch.randn(2**30 // 4, device="cuda")  # 1 GiB
    dst = torch.empty_like(src)
    ms_c, _, _ = time_cuda(lambda: dst.copy_(src), warmup=3, reps=10)
    gbs = 2 * src.numel() * 4 / ms_c / 1e6
    del a, b, src, dst
    torch.cuda.empty_cache()
    return {"cublas_bf16_tflops": tflops, "copy_gbs": gbs}


def kernel_profile(fn, calls: int = 1) -> list[tuple[str, float]]:
    """(kernel name, GPU microseconds) of every kernel that ``calls`` eager calls of ``fn`` run, in launch order
    (torch profiler, after one unprofiled call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.device_time) for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def git_sha() -> str:
    env = os.environ.get("HK_GIT_SHA")
    if env:
        return env
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def run_meta() -> dict:
    import triton

    from hopperkern import tuning

    try:
        import warnings

        warned = set(tuning._WARNED)  # the lookup below must not use up the run's own fallback warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg_origin = tuning.load_config().origin
        tuning._WARNED.intersection_update(warned)
    except Exception as exc:  # a broken file must not hide the figures
        cfg_origin = f"error: {exc}"
    if os.sep in cfg_origin:  # a file: its name only, so stored results name no machine's folders
        cfg_origin = os.path.basename(cfg_origin)
    return {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "git_sha": git_sha(),
        "tuning_file": cfg_origin,
    }


def write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)


def load_csv(path: Path) -> list[dict]:
    """Rows of a stored CSV with numbers parsed back and empty cells as None (to redraw a plot: ``--plot-from``)."""

    def num(v):
        try:
            return int(v)
        except ValueError:
            try:
                return float(v)
            except ValueError:
                return v or None

    with open(path, newline="") as f:
        return [{k: num(v) for k, v in r.items()} for r in csv.DictReader(f)]


MATPLOTLIB_MISSING = ("matplotlib is not installed, so no plot was drawn (the CSV has every figure): "
                      'pip install "hopperkern[bench]"')


def pyplot(who: str):
    """``matplotlib.pyplot`` on the Agg backend, or None after saying on stderr that matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        import sys

        print(f"{who}: {MATPLOTLIB_MISSING}", file=sys.stderr)
        return None
    return plt


def run_label(row: dict, dtype: str = "bf16") -> str:
    """``NVIDIA H200, bf16, torch 2.11.0+cu130, triton 3.6.0, hopperkern abc1234``: what a plot's figures ran on."""
    return (f"{row.get('device')}, {dtype}, torch {row.get('torch')}, triton {row.get('triton')}, "
            f"hopperkern {row.get('git_sha')}")


def redraw(csv_path: Path, out_dir: Path | None, who: str, plot) -> int:
    """``--plot-from``: draw ``plot(rows, png)`` from a stored CSV into ``out_dir/<CSV name>.png`` (default: beside
    the CSV), without a GPU. Returns the exit code: 1 when matplotlib is missing."""
    if pyplot(who) is None:
        return 1
    png = (out_dir or csv_path.parent) / csv_path.with_suffix(".png").name
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(load_csv(csv_path), png)
    print(f"{who}: drew {png} from {csv_path}")
    return 0
