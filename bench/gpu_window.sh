#!/usr/bin/env bash
# The GPU window of issue 35 (v4): every step drives a decision, and the rule of each is
# written here before the window runs (bench/gpu_window.py's THRESHOLDS, quoted verbatim;
# tests/test_bench.py checks they agree). The steps' time limits add up to 460 s, inside
# GPU_WINDOW_BUDGET_S (default 540, under the device call's 600 s; each step is cut to what
# is left), so one device call holds the whole window.
#
#   bash bench/peer_wheels.sh                 # here, once: the pinned peer wheels into .whl/
#   device run, kind nvidia-h200, carry [".whl"]:  bash bench/gpu_window.sh --out "$OUT"
#   bash bench/gpu_window.sh [--out DIR] [--dry-run]
#
# Ask for the H200 (kind nvidia-h200): the first record (bench/results/gpu-2026-12-04-h200.md)
# and the cost model's fit are an H200's; the summary names the GPU and says whether its
# timings compare with that record.
#
# Steps (each its own process under timeout; records appended to DIR/figures.jsonl as they
# come, the summary rewritten after every step, so a timeout keeps what came before), in
# this order, limits in seconds:
#   wheels       30  peer wheels from .whl/ (bench/peer_wheels.sh), when present
#   state        15  nvidia-smi GPU name, clocks, power, temperature, throttle reasons: before
#   peers       110  log-probs fwd+bwd: ours, Liger (accum_dtype=float32, default), Cut
#                    Cross-Entropy (cce_exact / filter_eps=None, default); each one's log-probs
#                    and gradients against float64 (early: it needs the wheels, and it is the
#                    comparison a window exists for)
#   timeline     90  torch.profiler, one call per op, default and MRTPO_OVERLAP_ROWS=1
#   ab          100  default / overlap / low-memory backward interleaved in one process
#   cublas       50  logits GEMM at 128-aligned rows and the plan's, fp32 vs bf16 out; dh, dW
#                    at K = 2048 / 4096
#   rows         50  the row kernels at in-op sizes back to back (and the split-row stats kernel)
#   state        15  the same as before: after
#
# Decisions (the rules, fixed before any figure exists):
#   state: clocks: an SM clock under 90% of its max, or any active throttle reason other than idle, before or after, marks every timing of the window as throttled
#   timeline: idle gaps: more than 3 ms of idle time between kernels in one call of an op -> fold the small kernels into the row kernel where they take more than 1 ms, else capture the chunk loop in a CUDA graph; 3 ms or less -> neither
#   ab_overlap: overlap: kept only if MRTPO_OVERLAP_ROWS=1 is at least 2% faster than the default on both the policy loss and log-probs (medians, same process); else removed
#   ab_low_memory: low-memory backward: made the default (MRTPO_LOW_MEMORY=1) if it is within 3% of the default's time on both ops (it drops the 2.4 GB fp32 dW accumulator)
#   cublas_rows: chunk rows: round the logits chunk to a multiple of 128 rows if the best 128-aligned row count gets at least 3% more TFLOP/s than the plan's 410 rows
#   cublas_k: gradient buffer: 4096 rows if dW at K = 4096 gets at least 5% more TFLOP/s than at K = 2048 (and the memory target still holds), else 2048
#   rows: row kernels: a kernel under 2.5 TB/s back to back at in-op size is the next kernel to rewrite; the split-row statistics kernel replaces the one-program-per-row one if it is at least 1.2x faster
#   peers: peers: ours must be faster than Liger (accum_dtype=float32) and Cut Cross-Entropy (cce_exact) on log-probs fwd+bwd at no more extra memory than theirs; a miss is recorded as a miss
#
# The cost model's prediction for the window (bench/cost_model.py, refit on the first run):
# `python -m bench.cost_model table` (docs/kernels.md keeps it); every ab record carries
# its pred_ms.
#
# --out DIR   where results go (default $OUT); at most 8 files: summary.md, figures.jsonl,
#             traces.tar.gz (the chrome traces), logs.tar.gz
# --dry-run   every step on the CPU at tiny shapes under TRITON_INTERPRET=1 (profiling on
#             the CPU's own events, nvidia-smi skipped): the plumbing, not the figures (run by
#             tests/test_bench.py). The peers run their real call paths, kernels included,
#             where .whl/ holds their wheels (installed into a scratch folder), in fp16 (the
#             interpreter does no bf16 arithmetic) and with libdevice's log1p / tanh given
#             interpreter versions (bench/gpu_window_peers.py's interpreter_libdevice); a
#             peer whose wheel is absent is skipped with a line
# Environment: PYTHON (default python3), GPU_WINDOW_BUDGET_S.
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
    -h|--help) sed -n '2,55p' "$0"; exit 0 ;;
    *) echo "gpu_window.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -n "$OUT_DIR" ] || { echo "gpu_window.sh: give --out DIR or set OUT" >&2; exit 2; }
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
WORK=$(mktemp -d)
mkdir -p "$WORK/logs" "$WORK/traces"
BUDGET=${GPU_WINDOW_BUDGET_S:-540}
START=$(date +%s)
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" MRTPO_STRICT_BACKEND=1 PYTHONUNBUFFERED=1
SUMMARY="$OUT_DIR/summary.md"
FIG="$OUT_DIR/figures.jsonl"
STEPS="$WORK/steps.md"
FAILED=0
WIN=("$PY" -m bench.gpu_window --out "$FIG" --traces "$WORK/traces")
if [ "$DRY" = 1 ]; then
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=1
  WIN+=(--device cpu --n 40 --d 16 --v 3000 --chunk-mib 1 --grad-buffer-mib 1 --rounds 2)
fi

# The GPU's name, for the record, and whether its timings compare with the first window's
# (an H200's, as is the cost model's fit).
if [ "$DRY" = 1 ]; then
  GPU="none (dry run on the CPU)"
else
  GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1)
  GPU=${GPU:-unknown (no nvidia-smi)}
fi
case "$GPU" in
  *H200*) COMPARABLE="yes: an H200, as the first record (bench/results/gpu-2026-12-04-h200.md)" ;;
  *) COMPARABLE="no: the first record (bench/results/gpu-2026-12-04-h200.md) and the cost model's fit are an H200's; compare within this window only" ;;
esac

write_summary() {
  {
    echo "# GPU window $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - START )) s"
    [ "$DRY" = 1 ] && echo && echo "(dry run: CPU, tiny shapes; no figure here means anything)"
    echo
    echo "GPU: $GPU. Timings comparable with the first record: $COMPARABLE."
    echo
    echo "| step | outcome | seconds |"; echo "|---|---|---|"
    cat "$STEPS" 2>/dev/null
    echo
    "$PY" -m bench.figures "$FIG" 2>/dev/null || echo "(no figures yet)"
  } > "$SUMMARY.tmp" && mv "$SUMMARY.tmp" "$SUMMARY"
}

finish() {
  local rc=$?
  tar -czf "$OUT_DIR/traces.tar.gz" -C "$WORK" traces 2>/dev/null
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" logs 2>/dev/null
  write_summary
  rm -rf "$WORK"
  echo "=================================== summary ==================================="
  cat "$SUMMARY"
  exit $(( rc != 0 ? rc : FAILED ))
}
trap finish EXIT
trap 'exit 130' INT TERM

# step NAME SECONDS COMMAND...: COMMAND in its own process under timeout (at most the time
# left), logged to logs/NAME.log, one row in the summary, which is rewritten.
step() {
  local name=$1 secs=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - START) ))
  [ "$DRY" = 1 ] && secs=$(( secs * 10 ))  # the interpreter is slow; the budget is not the GPU's
  [ "$DRY" = 0 ] && [ "$secs" -gt "$left" ] && secs=$left
  echo "== $name (timeout ${secs}s): $*"
  if [ "$secs" -le 5 ]; then
    echo "| $name | skipped: budget spent | 0 |" >> "$STEPS"; FAILED=1; write_summary
    return 1; fi
  local t0 rc=0
  t0=$(date +%s)
  timeout --kill-after=10 "$secs" "$@" > "$WORK/logs/$name.log" 2>&1 || rc=$?
  local verdict=ok
  [ $rc -ne 0 ] && verdict="failed (rc=$rc)" && FAILED=1
  [ $rc -eq 124 ] && verdict="timed out"
  echo "| $name | $verdict | $(( $(date +%s) - t0 )) |" >> "$STEPS"
  tail -n 6 "$WORK/logs/$name.log"
  write_summary
  return $rc
}

: > "$STEPS"
write_summary
# The peers' wheels (bench/peer_wheels.sh) beside the machine's torch and triton; the dry run
# installs them into its scratch folder, the checkout's build/ untouched.
SITE="$PWD/build/site"
[ "$DRY" = 1 ] && SITE="$WORK/site"
if ls .whl/*.whl > /dev/null 2>&1; then
  step wheels 30 "$PY" -m pip install --quiet --no-index --no-deps --no-compile --upgrade \
    --target "$SITE" .whl/*.whl && export PYTHONPATH="$PYTHONPATH:$SITE"
fi
step state_before 15 "${WIN[@]}" --part state --tag before
step peers 110 "${WIN[@]}" --part peers
step timeline 90 "${WIN[@]}" --part timeline
step ab 100 "${WIN[@]}" --part ab
step cublas 50 "${WIN[@]}" --part cublas
step rows 50 "${WIN[@]}" --part rows
step state_after 15 "${WIN[@]}" --part state --tag after
exit $FAILED
