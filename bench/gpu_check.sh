#!/usr/bin/env bash
# The one-call GPU check: environment report, build, GPU tests, benchmark at the target
# shapes, results under the output folder. Each step is time-boxed; the whole run stays
# within GPU_CHECK_BUDGET_S (default 480 s) so that it ends well inside 9 minutes.
#
#   bash bench/gpu_check.sh [--out DIR] [--dry-run]
#
# --out DIR   where results go (default $OUT)
# --dry-run   print each step's command and check that the files and Python modules it
#             calls exist and parse, without a GPU (run by tests/test_bench.py)
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S, GPU_CHECK_BENCH_ARGS (extra
# arguments for python -m bench), MAX_JOBS (default 16).
set -u -o pipefail

cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-}
DRY=0
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT_DIR=${2:?--out needs a folder}; shift 2 ;;
    --out=*) OUT_DIR=${1#--out=}; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$OUT_DIR" ]; then
  if [ "$DRY" = 1 ]; then OUT_DIR=$(mktemp -d); else
    echo "gpu_check.sh: give --out DIR or set OUT" >&2; exit 2; fi
fi
mkdir -p "$OUT_DIR/logs"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
BUDGET=${GPU_CHECK_BUDGET_S:-480}
START=$(date +%s)
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MRTPO_STRICT_BACKEND=1
SUMMARY="$OUT_DIR/gpu_check.md"
FAILED=0

# step NAME SECONDS COMMAND...: run COMMAND under timeout, at most the time left in the
# budget; log to $OUT_DIR/logs/NAME.log; record the outcome in the summary.
step() {
  local name=$1 secs=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (timeout ${secs}s): $*"
  if [ "$DRY" = 1 ]; then return 0; fi
  if [ "$secs" -le 5 ]; then
    echo "| $name | skipped | 0 | budget spent |" >> "$SUMMARY"; FAILED=1; return 1; fi
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$secs" "$@" > "$OUT_DIR/logs/$name.log" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 )) verdict=ok
  [ $rc -ne 0 ] && verdict="failed (rc=$rc)" && FAILED=1
  [ $rc -eq 124 ] && verdict="timed out"
  echo "| $name | $verdict | $dt | logs/$name.log |" >> "$SUMMARY"
  tail -n 15 "$OUT_DIR/logs/$name.log"
  return $rc
}

# --dry-run: the files and modules every step calls must exist and parse.
if [ "$DRY" = 1 ]; then
  for f in setup.py pyproject.toml tests bench/__main__.py bench/cell.py bench/envinfo.py \
           bench/plot.py bench/shapes.py; do
    [ -e "$f" ] || { echo "gpu_check.sh --dry-run: missing $f" >&2; exit 1; }
  done
  "$PY" -m py_compile setup.py bench/*.py || { echo "gpu_check.sh: a module does not parse" >&2; exit 1; }
  "$PY" -m bench.envinfo --help > /dev/null || exit 1
  "$PY" -m bench.plot --help > /dev/null || exit 1
  "$PY" -m bench --preset gpu-target --dry-run --out "$OUT_DIR/bench" || exit 1
fi

[ "$DRY" = 1 ] || {
  echo "# GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo
  echo "| step | outcome | seconds | log |"
  echo "|---|---|---|---|"
} > "$SUMMARY"

step env 60 bash -c "nvidia-smi; nvcc --version; \"$PY\" -m bench.envinfo --ceilings --out \"$OUT_DIR/env.json\""

# Peer libraries come along as wheels in .whl/ (no network on the GPU machine).
if ls .whl/*.whl > /dev/null 2>&1 || [ "$DRY" = 1 ]; then
  step wheels 60 "$PY" -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

step build 200 "$PY" setup.py build_ext --inplace

step pytest 100 "$PY" -m pytest -q -m gpu -o addopts= -p no:cacheprovider tests

# shellcheck disable=SC2086
step bench 400 "$PY" -m bench --preset gpu-target --out "$OUT_DIR/bench" ${GPU_CHECK_BENCH_ARGS:-}

step plot 30 "$PY" -m bench.plot --csv "$OUT_DIR/bench/results.csv" --out "$OUT_DIR/bench/plots"

if [ "$DRY" = 1 ]; then
  echo "gpu_check.sh --dry-run: all steps and files check out (out: $OUT_DIR)"
  exit 0
fi
{
  echo
  echo "Total $(( $(date +%s) - START )) s. Environment and ceilings: env.json."
  echo
  [ -f "$OUT_DIR/bench/results.md" ] && cat "$OUT_DIR/bench/results.md"
} >> "$SUMMARY"
cp "$SUMMARY" "$OUT_DIR/summary.md" 2>/dev/null
echo "gpu_check.sh: done in $(( $(date +%s) - START )) s; summary $SUMMARY"
exit $FAILED
