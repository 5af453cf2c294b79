# One (arm, seed) lane of the pre-registered ifbench-real comparison (PREREGISTRATION.md):
# `mrtpo train` with the registered settings into RUNS/ARM-seedSEED, resumed from its
# checkpoint when one is there (rerun the script as it is after a stop; a finished run is
# left as it is). Run from the fixed checkout named in the record (cwd); PY names the
# interpreter, RUNS the folder of the lanes (default runs/ifbench). Afterwards it checks that
# the run's metrics carry the held-out evaluations ("eval" in its rows) and exits 3 if not: the runs
# are only valid from a checkout whose trainer logs it (issue 34, item 1).
#   bash records/ifbench/lane.sh ARM SEED      ARM: gdpo | mrtpo, SEED: 0, 1, ...
set -u
arm=${1:?arm: gdpo or mrtpo} seed=${2:?seed: an integer}
case $arm in gdpo | mrtpo) ;; *) echo "arm: expected gdpo or mrtpo, got '$arm'" >&2; exit 2 ;; esac
case $seed in '' | *[!0-9]*) echo "seed: expected an integer >= 0, got '$seed'" >&2; exit 2 ;; esac
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs/ifbench}
STEPS=100
out="$RUNS/$arm-seed$seed"
mkdir -p "$RUNS"
export OMP_NUM_THREADS=1
if grep -qE "^\{\"step\": $STEPS," "$out/metrics.jsonl" 2>/dev/null; then
  echo "$out: finished ($STEPS steps)"
else
  if [ -d "$out/checkpoint" ]; then mode=--resume; else mode=--overwrite; fi
  $PY -m mrtpo train --task ifbench-real --model smollm2-135m-instruct \
    --algo "$arm" --seed "$seed" --steps $STEPS \
    --warm-steps 30 --warm-noise 0.6 --autocast bfloat16 \
    --prompts-per-step 2 --group-size 4 --max-new-tokens 64 --micro-batch 2 --lr 2e-5 \
    --no-baseline-replay --checkpoint-every 5 --threads 1 --device cpu --quiet \
    --eval-every 10 --eval-prompts 15 --eval-samples 4 --eval-seed 0 \
    --cache-dir runs/cache --out "$out" $mode > "$out.log" 2>&1 || {
    echo "$out: training failed, see $out.log" >&2
    exit 1
  }
fi
if ! grep -q '"eval": \[{' "$out/metrics.jsonl"; then
  echo "$out: metrics.jsonl has no held-out evaluations (\"eval\"): not a valid lane" >&2
  exit 3
fi
echo "$out: done"
