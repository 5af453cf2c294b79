# Issue 25, item 2: K = 3 (constraints-real: start_phrase, keyword_include, end_phrase) on
# SmolLM2-135M-Instruct for 100 steps, 5 seeds, GDPO against MRTPO's default (the JS form),
# from a harder start than issue 17's 40-step runs: warm-start noise 0.8 instead of 0.6
# (calibration: runs/calib/k3_noise0.8.log, recorded in records/issue25_k3_tools.md),
# target all-pass 0.5, both set before the runs. Run from a fixed checkout of the commit in
# the record (a git worktree of d5e8129; `mrtpo compare` reuses and resumes runs by a key
# that hashes the sources), the C++ extension copied in, runs/cache linked to the main
# checkout's. One run at a time (--jobs 1, one thread): the other core trains item 3.
# Resumable: rerun the script as it is (finished runs are reused, a stopped one resumes
# from its checkpoint). Order: seed-major, GDPO then MRTPO per seed, so stopping early
# leaves whole pairs.
# Usage: bash command.sh [CHECKOUT] -- CHECKOUT (or $W) is the fixed checkout, default the
# checkout holding this script; PY names the interpreter (default CHECKOUT/.venv/bin/python).
set -u
W=$(cd "${1:-${W:-$(dirname "$0")/../../..}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: CHECKOUT $W holds no mrtpo/: not a checkout" >&2; exit 2; }
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
$PY -m mrtpo compare --task constraints-real \
  --model smollm2-135m-instruct --warm-steps 30 --warm-noise 0.8 --autocast bfloat16 \
  --algos gdpo,mrtpo --seeds 5 --steps 100 --prompts-per-step 2 --group-size 4 \
  --max-new-tokens 32 --micro-batch 8 --lr 2e-5 --target 0.5 --jobs 1 --threads 1 \
  --no-baseline-replay --checkpoint-every 5 --out runs/k3-100 --results runs/k3-100-results
