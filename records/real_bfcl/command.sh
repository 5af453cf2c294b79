# Issue 25, item 3: tool calling on SmolLM2-135M-Instruct, on the Berkeley Function Calling
# Leaderboard's simple Python cases (`--task tools-bfcl`, offline from the bfcl-eval wheel),
# GDPO against MRTPO's default (the JS form), 100 steps, seeds 0-2. Warm start 25 steps on
# the cases' references (calibration in records/issue25_k3_tools.md), target all-pass
# 0.35, both set before the runs. From a fixed checkout (a git worktree of d5e8129: the
# commit in the record; `mrtpo compare` reuses and resumes runs by a key that hashes the
# sources), the C++ extension copied in, runs/cache linked to the main checkout's. One run at
# a time (--jobs 1, one thread): the other core trains item 2. Resumable: rerun the script as
# it is. Order: seed-major, GDPO then MRTPO per seed, so stopping early leaves whole pairs.
# Usage: bash command.sh [CHECKOUT] -- CHECKOUT (or $W) is the fixed checkout, default the
# checkout holding this script; PY names the interpreter (default CHECKOUT/.venv/bin/python).
set -u
W=$(cd "${1:-${W:-$(dirname "$0")/../../..}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: CHECKOUT $W holds no mrtpo/: not a checkout" >&2; exit 2; }
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
PY=${PY:-.venv/bin/python}
$PY -m mrtpo compare --task tools-bfcl \
  --model smollm2-135m-instruct --warm-steps 25 --autocast bfloat16 \
  --algos gdpo,mrtpo --seeds 3 --steps 100 --prompts-per-step 2 --group-size 4 \
  --max-new-tokens 64 --micro-batch 8 --lr 2e-5 --target 0.35 --jobs 1 --threads 1 \
  --no-baseline-replay --checkpoint-every 5 --out runs/bfcl-100 --results runs/bfcl-100-results
