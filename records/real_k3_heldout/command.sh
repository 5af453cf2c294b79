# Issue 34, item 4: the K = 3 headline (constraints-real on SmolLM2-135M-Instruct, warm-start
# noise 0.8, issue 25 item 2's settings) re-measured on the held-out metric with 6 paired
# seeds. Settings, target and analysis were written in PREREGISTRATION.md before any run.
# Usage: bash command.sh [CHECKOUT] -- CHECKOUT is a fixed checkout of the commit named in
# PREREGISTRATION.md (default: the checkout holding this script) with its C++ extension
# built; the runs and the cache go under CHECKOUT/runs. Two runs at a time (--jobs 2, one
# thread each): seed s of GDPO and of MRTPO train side by side, so both arms of a pair see
# the same machine load. Resumable: rerun the script as it is (finished runs are reused, a
# stopped one resumes from its last checkpoint).
set -eu
W=$(cd "${1:-$(dirname "$0")/../../..}" && pwd)
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
exec nice -n 10 $PY -m mrtpo compare --task constraints-real \
  --model smollm2-135m-instruct --warm-steps 30 --warm-noise 0.8 --autocast bfloat16 \
  --algos gdpo,mrtpo --seeds 6 --steps 100 --prompts-per-step 2 --group-size 4 \
  --max-new-tokens 32 --micro-batch 8 --lr 2e-5 --target 0.5 --jobs 2 --threads 1 \
  --no-baseline-replay --checkpoint-every 5 --eval-every 10 --eval-prompts 32 \
  --eval-samples 2 --eval-seed 0 --cache-dir runs/cache \
  --out runs/k3-heldout --results runs/k3-heldout-results
