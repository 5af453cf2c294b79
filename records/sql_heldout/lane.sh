# One (arm, seed) lane of the pre-registered sql-real held-out comparison (PREREGISTRATION.md):
# `mrtpo train` with the registered settings into RUNS/ARM-seedSEED, resumed from its
# checkpoint when one is there (rerun the script as it is after a stop; a finished run is
# left as it is). Run from the fixed checkout named in the record (cwd); PY names the
# interpreter, RUNS the folder of the lanes (default runs/sql-heldout), CACHE the model cache
# (default runs/sql-cache: the converted model and each seed's warm start, built once under
# the cache's lock). Afterwards it checks that the run's metrics carry the held-out
# evaluations ("eval" in its rows, 21 of them: steps 0, 5, ..., 100) and exits 3 if not.
#   bash records/sql_heldout/lane.sh ARM SEED      ARM: gdpo | mrtpo, SEED: 0, 1, ...
set -u
arm=${1:?arm: gdpo or mrtpo} seed=${2:?seed: an integer}
case $arm in gdpo | mrtpo) ;; *) echo "arm: expected gdpo or mrtpo, got '$arm'" >&2; exit 2 ;; esac
case $seed in '' | [0-9] | [1-9]*[0-9]) ;; *) seed=x ;; esac
case $seed in *[!0-9]*) echo "seed: expected an integer >= 0 without leading zeros, got '$2'" >&2; exit 2 ;; esac
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs/sql-heldout}
CACHE=${CACHE:-runs/sql-cache}
STEPS=100
EVALS=21 # steps 0, 5, ..., 100
out="$RUNS/$arm-seed$seed"
mkdir -p "$RUNS"
export OMP_NUM_THREADS=1
if grep -qE "^\{\"step\": $STEPS," "$out/metrics.jsonl" 2>/dev/null; then
  echo "$out: finished ($STEPS steps)"
else
  if [ -d "$out/checkpoint" ]; then mode=--resume; else mode=--overwrite; fi
  $PY -m mrtpo train --task sql-real --model smollm2-135m-instruct \
    --algo "$arm" --seed "$seed" --steps $STEPS \
    --warm-steps 20 --autocast bfloat16 \
    --prompts-per-step 2 --group-size 4 --max-new-tokens 64 --micro-batch 8 --lr 2e-5 \
    --no-baseline-replay --checkpoint-every 5 --threads 1 --device cpu --quiet \
    --eval-every 5 --eval-prompts 32 --eval-samples 4 --eval-seed 0 \
    --cache-dir "$CACHE" --out "$out" $mode > "$out.log" 2>&1 || {
    echo "$out: training failed, see $out.log" >&2
    exit 1
  }
fi
n=$(grep -oE '\{"step": [0-9]+, "all_pass"' "$out/metrics.jsonl" | wc -l) # the evaluations
if [ "$n" -lt $EVALS ]; then
  echo "$out: metrics.jsonl holds $n held-out evaluations (\"eval\"), expected $EVALS: not a valid lane" >&2
  exit 3
fi
echo "$out: done"
