"""The main job: the capability report, then (on a GPU) the LCE and MoE benchmarks.

    python -m benchmarks.run --out benchmarks/results/ [--quick]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    from hopperkern import info

    info.main([])
    import torch

    if not torch.cuda.is_available():
        print("\nNo CUDA GPU here: the benchmarks need one (an H100/H200 for meaningful figures).")
        return 0
    from benchmarks import bench_lce

    extra = ["--quick"] if args.quick else []
    rc = bench_lce.main(["--out", str(args.out), *extra])
    try:
        from benchmarks import bench_moe
    except ImportError as exc:
        print(f"MoE benchmark unavailable: {exc}")
    else:
        rc = rc or bench_moe.main(["--out", str(args.out), *extra])
    return rc


if __name__ == "__main__":
    sys.exit(main())
