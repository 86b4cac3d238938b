"""The main job: the capability report, then (on a GPU) the LCE and MoE benchmarks.

    python -m benchmarks.run [--out DIR] [--quick] [--overwrite-tracked]

Results (CSVs and plots) go to ``--out``, or to a fresh ``bench-results/<UTC time>/`` folder. A folder that holds
files tracked by git (``benchmarks/results/``: the stored H200 figures) is refused unless ``--overwrite-tracked``
says that replacing them is the point, so a run never silently rewrites the repository's own results.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path


def fresh_out_dir(root: Path = Path("bench-results")) -> Path:
    """``root/<UTC time>``: a folder no earlier run wrote to."""
    return root / time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def tracked_files(folder: Path) -> list[str]:
    """Files under ``folder`` that git tracks, as paths from the checkout's root ([] outside a git checkout,
    without git, or for a new folder)."""
    folder = folder.resolve()
    probe = folder
    while not probe.is_dir():  # git needs an existing working directory; the folder may not exist yet
        if probe.parent == probe:
            return []
        probe = probe.parent
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--full-name", "--", str(folder)], cwd=probe,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:  # not a git checkout
        return []
    return [f for f in out.stdout.split("\0") if f]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=None,
                    help="folder for the CSVs and plots (default: a fresh bench-results/<UTC time>/)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--overwrite-tracked", action="store_true",
                    help="allow --out to be a folder of git-tracked files (refreshing benchmarks/results/)")
    args = ap.parse_args(argv)
    out = args.out if args.out is not None else fresh_out_dir()
    tracked = tracked_files(out)
    if tracked and not args.overwrite_tracked:
        ap.error(f"--out {out} holds files tracked by git ({len(tracked)}, e.g. {tracked[0]}), which the benchmarks "
                 "would overwrite: name another folder, or pass --overwrite-tracked to replace them on purpose")
    from hopperkern import info

    info.main([])
    import torch

    if not torch.cuda.is_available():
        print("\nNo CUDA GPU here: the benchmarks need one (an H100/H200 for meaningful figures). Nothing was written.")
        return 0
    from benchmarks import bench_lce

    print(f"\nWriting the results to {out}/")
    extra = ["--quick"] if args.quick else []
    rc = bench_lce.main(["--out", str(out), *extra])
    try:
        from benchmarks import bench_moe
    except ImportError as exc:
        print(f"MoE benchmark unavailable: {exc}")
    else:
        rc = rc or bench_moe.main(["--out", str(out), *extra])
    return rc


if __name__ == "__main__":
    sys.exit(main())
