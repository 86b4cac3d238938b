#!/usr/bin/env bash
# Everything a GPU machine checks, in one go: the report, GPU tests, tuning, benchmarks. Output lands under $1 (or $OUT).
#   bash benchmarks/on_gpu.sh OUT_DIR "STEPS"   STEPS: any of info tests cputests tune lce moe lcequick moequick,
#                                               or a Python statement to run
# Wheels in .whl/ (pydantic, Liger, CCE for a machine without a package index) are installed into a temporary folder
# first, without dependencies.
set -uo pipefail
out=${1:-${OUT:-out}}
steps=${2:-"info tests lce moe"}
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  site=$(mktemp -d) || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
    && export PYTHONPATH=$site:$PWD || exit 1
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
t0=$(date +%s)
stamp() { echo "[on_gpu +$(( $(date +%s) - t0 ))s] $*"; }
for s in $steps; do
  stamp "step $s"
  case $s in
    info) python3 -m hopperkern.info 2>&1 | tee "$out/info.txt"; python3 -m hopperkern.info --json > "$out/info.json" ;;
    tests) python3 -m pytest -m gpu -q -x --durations=10 -p no:cacheprovider 2>&1 | tail -n 60 | tee "$out/gpu_tests.txt" ;;
    cputests) python3 -m pytest -m "not gpu" -q -x -p no:cacheprovider 2>&1 | tail -n 30 | tee "$out/compiled_tests.txt" ;;
    tune) python3 -m hopperkern.tune --out configs/ 2>&1 | tee "$out/tune.txt"; cp configs/*.json "$out/" 2>/dev/null ;;
    lce) python3 -m benchmarks.bench_lce --out "$out" 2>&1 | tail -n 80 ;;
    lcequick) python3 -m benchmarks.bench_lce --out "$out" --quick 2>&1 | tail -n 60 ;;
    moe) python3 -m benchmarks.bench_moe --out "$out" 2>&1 | tail -n 80 ;;
    moequick) python3 -m benchmarks.bench_moe --out "$out" --quick 2>&1 | tail -n 60 ;;
    *) python3 -c "$s" ;;
  esac
done
stamp done
