"""Shared benchmark plumbing: same-run ceilings, run metadata, CSV output, plots' labels.

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

__all__ = ["capture_graph", "git_sha", "graph_ms", "measure_ceilings", "pick_fastest", "rel_err", "run_meta",
           "time_cuda", "write_csv"]


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

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg_origin = tuning.load_config().origin
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
