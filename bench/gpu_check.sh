#!/usr/bin/env bash
# The one-call GPU check (v3), run after `pip install --no-deps --no-build-isolation -e .`,
# about 8 minutes of command time (GPU_CHECK_BUDGET_S, default 480):
#   wheels (.whl/, if any) -> env -> CUDA build started in the background -> micro parts
#   (cuBLAS at the plan's shapes, the row kernels and their block x warps grid, the ops at 3
#   chunk plans, correctness beside) -> the benchmark at the target
#   shapes (Liger and Cut Cross-Entropy rows where their wheels are) -> pytest per file,
#   compile tests last.
#
#   bash bench/gpu_check.sh [--out DIR] [--dry-run]
#
# --out DIR   where results go (default $OUT); at most 8 files: summary.md, figures.jsonl,
#             env.json, results.csv, results.md, logs.tar.gz (logs, junit files, bench folder)
# --dry-run   print each step's command and check that the files and Python modules it
#             calls exist and parse, without a GPU (run by tests/test_bench.py)
# Every figure goes to figures.jsonl the moment it exists; each measurement runs in its own
# process under its own timeout; timings (CUDA events) never wait on a correctness check;
# the summary is rewritten after each step and printed last; a trap archives the logs on
# any exit. Environment: PYTHON (default python3), GPU_CHECK_BUDGET_S, GPU_CHECK_BENCH_ARGS,
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
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
if [ -z "$OUT_DIR" ]; then
  if [ "$DRY" = 1 ]; then OUT_DIR=$(mktemp -d); else
    echo "gpu_check.sh: give --out DIR or set OUT" >&2; exit 2; fi
fi
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d)          # logs, junit files and the bench folder; archived by the trap
mkdir -p "$WORK/logs" "$WORK/junit"
BUDGET=${GPU_CHECK_BUDGET_S:-480}
TEST_TIMEOUT=${GPU_CHECK_TEST_TIMEOUT:-60}
START=$(date +%s)
export MAX_JOBS=${MAX_JOBS:-16}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MRTPO_STRICT_BACKEND=1
SUMMARY="$OUT_DIR/summary.md"
FIGURES="$OUT_DIR/figures.jsonl"
STEPS="$WORK/steps.md"     # one row per finished step
FAILED=0
BUILD_PID=""

# The summary, rewritten after every step: the steps so far, then every figure so far.
write_summary() {
  [ "$DRY" = 1 ] && return 0
  {
    echo "# GPU check $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START )) s"
    echo
    echo "| step | outcome | seconds | log |"; echo "|---|---|---|---|"
    cat "$STEPS" 2>/dev/null
    echo
    "$PY" -m bench.figures "$FIGURES" 2>/dev/null || echo "(no figures yet)"
    [ -f "$OUT_DIR/results.md" ] && { echo; cat "$OUT_DIR/results.md"; }
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

# On any exit: stop the background build, archive the logs, rewrite and print the summary.
finish() {
  local rc=$?
  [ "$DRY" = 1 ] && return 0
  [ -n "$BUILD_PID" ] && kill "$BUILD_PID" 2>/dev/null
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" logs junit bench 2>/dev/null \
    || tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" logs 2>/dev/null
  write_summary
  echo "=================================== summary ==================================="
  cat "$SUMMARY"
  exit $(( rc != 0 ? rc : FAILED ))
}
trap finish EXIT
trap 'exit 130' INT TERM

# step NAME SECONDS COMMAND...: run COMMAND in its own process under timeout (at most the
# time left), log to $WORK/logs/NAME.log, one row in the summary, which is rewritten.
step() {
  local name=$1 secs=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (timeout ${secs}s): $*"
  if [ "$DRY" = 1 ]; then return 0; fi
  if [ "$secs" -le 5 ]; then
    echo "| $name | skipped | 0 | budget spent |" >> "$STEPS"; FAILED=1; write_summary
    return 1; fi
  local t0=$(date +%s) rc=0
  timeout --kill-after=10 "$secs" "$@" > "$WORK/logs/$name.log" 2>&1 || rc=$?
  local dt=$(( $(date +%s) - t0 )) verdict=ok
  [ $rc -ne 0 ] && verdict="failed (rc=$rc)" && FAILED=1
  [ $rc -eq 124 ] && verdict="timed out"
  echo "| $name | $verdict | $dt | logs/$name.log |" >> "$STEPS"
  tail -n 8 "$WORK/logs/$name.log"
  write_summary
  return $rc
}

MICRO=("$PY" -m bench.gpu_micro --out "$FIGURES")
# pytest per file, -v with a junit file each; the op tests first, torch.compile tests last
GPU_TESTS="tests/test_logprobs.py tests/test_policy_loss.py tests/test_js.py tests/test_advantages.py tests/test_bench.py tests/test_cuda_build.py"
PYTEST=("$PY" -m pytest -m gpu -o addopts= -p no:cacheprovider -v -rA --durations=15
        "--timeout=$TEST_TIMEOUT")

if [ "$DRY" = 1 ]; then
  for f in setup.py pyproject.toml bench/__main__.py bench/gpu_micro.py bench/envinfo.py \
           bench/figures.py bench/cost_model.py $GPU_TESTS; do
    [ -e "$f" ] || { echo "gpu_check.sh --dry-run: missing $f" >&2; exit 1; }
  done
  "$PY" -m py_compile setup.py bench/*.py || { echo "gpu_check.sh: a module does not parse" >&2; exit 1; }
  "$PY" -m bench.envinfo --help > /dev/null || exit 1
  "$PY" -m bench.gpu_micro --part ops --dry-run --out "$FIGURES" || exit 1
  "$PY" -m bench.figures --help > /dev/null || exit 1
  "$PY" -m bench --preset gpu-target --dry-run --out "$WORK/bench" || exit 1
fi
: > "$STEPS"
write_summary

# Peer libraries (Liger, Cut Cross-Entropy) come along as wheels in .whl/ (no network);
# installed first, so that env.json lists their versions.
if ls .whl/*.whl > /dev/null 2>&1 || [ "$DRY" = 1 ]; then
  step wheels 40 "$PY" -m pip install --no-index --no-deps --target "$PWD/build/site" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$PWD/build/site"
fi

step env 40 bash -c "nvidia-smi; \"$PY\" -m bench.envinfo --ceilings --out \"$OUT_DIR/env.json\""

# The op test files import hypothesis and scipy (their fuzz and CPU parts): where the image
# lacks them, their wheels go in .whl/ too (hypothesis needs attrs and sortedcontainers).
step test_deps 20 "$PY" -c "import hypothesis, scipy" \
  || echo "hypothesis / scipy missing: the pytest steps cannot collect the op test files"

# The CUDA extension builds in the background while the Triton measurements run; the
# tests that need it wait for it (pip install -e . may have built it already).
BUILD_CMD=(env MRTPO_SKIP_CPU_BUILD=1 "$PY" setup.py build_ext --inplace)
echo "== build (background, timeout 240s): ${BUILD_CMD[*]}"
if [ "$DRY" = 0 ] && ! "$PY" -c "import mrtpo_kernels._cuda" > /dev/null 2>&1; then
  ( t0=$(date +%s); rc=0
    timeout --kill-after=10 240 "${BUILD_CMD[@]}" > "$WORK/logs/build.log" 2>&1 || rc=$?
    v=ok; [ $rc -ne 0 ] && v="failed (rc=$rc)"
    echo "| build (background) | $v | $(( $(date +%s) - t0 )) | logs/build.log |" >> "$STEPS"
  ) &
  BUILD_PID=$!
fi

# Micro parts, each its own process: cuBLAS at the plan's shapes, the row kernels and their
# block x warps grid, then the ops at the default plan and two other chunk plans;
# correctness beside.
step micro_cublas 40 "${MICRO[@]}" --part cublas
step micro_rows 30 "${MICRO[@]}" --part rows
step micro_rows_sweep 60 "${MICRO[@]}" --part rows-sweep
step micro_ops 45 "${MICRO[@]}" --part ops
step micro_ops_buf304 40 "${MICRO[@]}" --part ops --grad-buffer-mib 304
step micro_ops_chunk128 40 "${MICRO[@]}" --part ops --chunk-mib 128 --grad-buffer-mib 800
step micro_correctness 30 "${MICRO[@]}" --part correctness

# The benchmark at the target shapes (one process per provider; liger / cce rows where
# their wheels were installed above); every row carries pred_ms and the GEMM path.
# shellcheck disable=SC2086
step bench 150 "$PY" -m bench --preset gpu-target --out "$WORK/bench" ${GPU_CHECK_BENCH_ARGS:-}
[ "$DRY" = 1 ] || cp "$WORK/bench/results.csv" "$WORK/bench/results.md" "$OUT_DIR/" 2>/dev/null

if [ -n "$BUILD_PID" ]; then wait "$BUILD_PID"; BUILD_PID=""; write_summary; fi
for f in $GPU_TESTS; do
  name=pytest_$(basename "$f" .py)
  step "$name" 30 "${PYTEST[@]}" -k "not compile" --junitxml="$WORK/junit/$name.xml" "$f"
done
# shellcheck disable=SC2086
step pytest_compile 30 "${PYTEST[@]}" -k "compile" --junitxml="$WORK/junit/compile.xml" $GPU_TESTS

if [ "$DRY" = 1 ]; then
  echo "gpu_check.sh --dry-run: all steps and files check out (out: $OUT_DIR)"
  exit 0
fi
exit $FAILED
