#!/usr/bin/env bash
# The follow-up GPU call (after gpu_check.sh), about 4 minutes of command time:
#   1. the GPU log-prob tests and the torch.compile tests (the traced-backward fix);
#   2. the row kernels over a grid of columns-per-step x warps (gpu_micro --part rows-sweep);
#   3. the three ops at the default row configuration, at the sweep's fastest one
#      (MRTPO_ROW_BLOCK) and with the row kernels on a side stream (MRTPO_OVERLAP_ROWS=1),
#      side by side;
#   4. log-probs forward + backward at the target shape: ours, the GEMM floor and Cut
#      Cross-Entropy (its wheel in .whl/).
#
#   bash bench/gpu_tune.sh --out DIR       (default $OUT)
#
# Each step is its own process under `timeout`; figures go to DIR/figures.jsonl as they
# come; DIR/summary.md is written at the end (also on a kill: a trap).
set -u -o pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT_DIR=${OUT:-}
[ "${1:-}" = "--out" ] && OUT_DIR=${2:?--out needs a folder}
[ -n "$OUT_DIR" ] || { echo "gpu_tune.sh: give --out DIR or set OUT" >&2; exit 2; }
mkdir -p "$OUT_DIR/logs"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" MRTPO_STRICT_BACKEND=1 PYTHONUNBUFFERED=1
FIG="$OUT_DIR/figures.jsonl"
FAILED=0
finish() {
  { echo "# GPU tune $(date -u +%Y-%m-%dT%H:%M:%SZ)"; echo; cat "$OUT_DIR/steps.md" 2>/dev/null
    echo; "$PY" -m bench.figures "$FIG" 2>/dev/null
    [ -f "$OUT_DIR/bench/results.md" ] && { echo; cat "$OUT_DIR/bench/results.md"; }
  } > "$OUT_DIR/summary.md"
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$OUT_DIR" logs 2>/dev/null && rm -rf "$OUT_DIR/logs"
  cat "$OUT_DIR/summary.md"
}
trap finish EXIT
step() {
  local name=$1 secs=$2 t0 rc=0; shift 2
  t0=$(date +%s)
  echo "== $name: $*"
  timeout --kill-after=10 "$secs" "$@" > "$OUT_DIR/logs/$name.log" 2>&1 || rc=$?
  tail -n 4 "$OUT_DIR/logs/$name.log"
  [ $rc -ne 0 ] && FAILED=1
  echo "| $name | rc=$rc | $(( $(date +%s) - t0 )) s |" >> "$OUT_DIR/steps.md"
}
if ls .whl/*.whl > /dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --target "$PWD/build/site" .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:$PWD/build/site"
fi
echo "| step | outcome | time |" > "$OUT_DIR/steps.md"; echo "|---|---|---|" >> "$OUT_DIR/steps.md"
step pytest_gpu_logprobs 60 "$PY" -m pytest -m gpu -o addopts= -p no:cacheprovider -v -rA \
  tests/test_logprobs.py tests/test_js.py -k "compile or gpu"
step rows_sweep 120 "$PY" -m bench.gpu_micro --part rows-sweep --out "$FIG"
BEST=$("$PY" -m bench.figures "$FIG" --best-row-block) || BEST=""
echo "fastest row configuration: ${BEST:-none}"
step ops_default 45 "$PY" -m bench.gpu_micro --part ops --out "$FIG"
[ -n "$BEST" ] && step ops_best 45 env MRTPO_ROW_BLOCK="$BEST" "$PY" -m bench.gpu_micro --part ops --out "$FIG"
step ops_overlap 45 env MRTPO_OVERLAP_ROWS=1 "$PY" -m bench.gpu_micro --part ops --out "$FIG"
step bench_cce 120 "$PY" -m bench --preset gpu-target --ops linear_logprobs_fwd_bwd \
  --providers mrtpo-triton gemm-floor cce --out "$OUT_DIR/bench"
exit $FAILED
