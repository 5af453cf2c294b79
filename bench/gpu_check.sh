#!/usr/bin/env bash
# The one-call GPU check (v2), run after `pip install --no-deps --no-build-isolation -e .`:
# environment, build only if needed, micro-benchmark (correctness first), the benchmark at
# the target shapes, the GPU tests by name; the whole within GPU_CHECK_BUDGET_S (420 s).
#
#   bash bench/gpu_check.sh [--out DIR] [--dry-run]
#
# --out DIR   where results go (default $OUT); at most 8 files: summary.md, results.csv,
#             results.md, micro.json, env.json, logs.tar.gz
# --dry-run   print each step's command and check that the files and Python modules it
#             calls exist and parse, without a GPU (run by tests/test_bench.py)
# Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S, GPU_CHECK_BENCH_ARGS,
# GPU_CHECK_TEST_TIMEOUT (seconds per test, default 60), MAX_JOBS (default 16).
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
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d)          # logs and the bench folder live here; archived at the end
mkdir -p "$WORK/logs"
BUDGET=${GPU_CHECK_BUDGET_S:-420}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-60}
START=$(date +%s)
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MRTPO_STRICT_BACKEND=1
SUMMARY="$OUT_DIR/summary.md"
FAILED=0

# step NAME SECONDS COMMAND...: run COMMAND under timeout (at most the time left), log to
# $WORK/logs/NAME.log, one line per step in the summary.
step() {
  local name=$1 secs=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (timeout ${secs}s): $*"
  if [ "$DRY" = 1 ]; then return 0; fi
  if [ "$secs" -le 5 ]; then
    echo "| $name | skipped | 0 | budget spent |" >> "$SUMMARY"; FAILED=1; return 1; fi
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$secs" "$@" > "$WORK/logs/$name.log" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 )) verdict=ok
  [ $rc -ne 0 ] && verdict="failed (rc=$rc)" && FAILED=1
  [ $rc -eq 124 ] && verdict="timed out"
  echo "| $name | $verdict | $dt | logs/$name.log |" >> "$SUMMARY"
  tail -n 12 "$WORK/logs/$name.log"
  return $rc
}

# The GPU tests by name: the op tests first, torch.compile tests last.
GPU_TESTS="tests/test_triton_logprobs.py tests/test_triton_policy_loss.py tests/test_triton_js.py tests/test_triton_advantages.py tests/test_cuda_build.py tests/test_bench.py"
PYTEST=("$PY" -m pytest -m gpu -o addopts= -p no:cacheprovider -rA --durations=15
        "--timeout=$TEST_TIMEOUT")

if [ "$DRY" = 1 ]; then
  for f in setup.py pyproject.toml bench/__main__.py bench/gpu_micro.py bench/envinfo.py $GPU_TESTS; do
    [ -e "$f" ] || { echo "gpu_check.sh --dry-run: missing $f" >&2; exit 1; }
  done
  "$PY" -m py_compile setup.py bench/*.py || { echo "gpu_check.sh: a module does not parse" >&2; exit 1; }
  "$PY" -m bench.envinfo --help > /dev/null || exit 1
  "$PY" -m bench.gpu_micro --dry-run --out "$OUT_DIR/micro.json" || exit 1
  "$PY" -m bench --preset gpu-target --dry-run --out "$WORK/bench" || exit 1
else
  { echo "# GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo
    echo "| step | outcome | seconds | log |"; echo "|---|---|---|---|"; } > "$SUMMARY"
fi

step env 40 bash -c "nvidia-smi; \"$PY\" -m bench.envinfo --ceilings --out \"$OUT_DIR/env.json\""

# Peer libraries come along as wheels in .whl/ (no network on the GPU machine).
if ls .whl/*.whl > /dev/null 2>&1 || [ "$DRY" = 1 ]; then
  step wheels 40 "$PY" -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

# Build once: pip install -e . has built the extensions; only the CUDA one, only if missing.
if [ "$DRY" = 1 ] || ! "$PY" -c "import mrtpo_kernels._cuda" > /dev/null 2>&1; then
  step build 150 env MRTPO_SKIP_CPU_BUILD=1 "$PY" setup.py build_ext --inplace
fi

step micro 90 "$PY" -m bench.gpu_micro --out "$OUT_DIR/micro.json"

# shellcheck disable=SC2086
step bench 170 "$PY" -m bench --preset gpu-target --out "$WORK/bench" ${GPU_CHECK_BENCH_ARGS:-}
[ "$DRY" = 1 ] || cp "$WORK/bench/results.csv" "$WORK/bench/results.md" "$OUT_DIR/" 2>/dev/null

# shellcheck disable=SC2086
step pytest 90 "${PYTEST[@]}" -k "not compile" $GPU_TESTS
# shellcheck disable=SC2086
step pytest_compile 40 "${PYTEST[@]}" -k "compile" $GPU_TESTS

if [ "$DRY" = 1 ]; then
  echo "gpu_check.sh --dry-run: all steps and files check out (out: $OUT_DIR)"
  exit 0
fi
tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" logs bench 2>/dev/null
{
  echo
  echo "Total $(( $(date +%s) - START )) s. Environment and ceilings: env.json; stages: micro.json."
  echo
  [ -f "$OUT_DIR/micro.json" ] && { echo '```'; cat "$OUT_DIR/micro.json"; echo '```'; }
  [ -f "$OUT_DIR/results.md" ] && cat "$OUT_DIR/results.md"
  grep -hE "^(PASSED|FAILED|ERROR|SKIPPED)" "$WORK/logs/pytest.log" "$WORK/logs/pytest_compile.log" 2>/dev/null | sort | uniq -c | sort -rn | head -40
} >> "$SUMMARY"
echo "=================================== summary ==================================="
cat "$SUMMARY"
exit $FAILED
