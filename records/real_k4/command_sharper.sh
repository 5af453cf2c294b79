# The sharper variant of the tiny-model screen on the same K = 4 configuration: the command of
# command.sh with mrtpo:specific:gamma=2 added, from the same fixed checkout (a303fe0), so the
# finished gdpo and mrtpo runs are reused and only the new variant trains. Resumable (a
# checkpoint every 5 steps): rerun it as it is. State when last stopped (2026-12-02 03:12 UTC):
# mrtpo-specific-gamma2 seed 0 at 11 steps, seed 1 at 12, seed 2 not started; no result yet.
# Usage: bash records/real_k4/command_sharper.sh [WORKTREE] -- WORKTREE (or $W) is the
# worktree command.sh made, default wt-a303fe0 beside the checkout holding this script; PY
# names the interpreter (default WORKTREE/.venv/bin/python).
set -u
M=$(cd "$(dirname "$0")/../../.." && pwd) || exit 2
W=$(cd "${1:-${W:-$M/../wt-a303fe0}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: WORKTREE $W holds no mrtpo/: not a checkout" >&2; exit 2; }
cd "$W" || exit 2
PY=${PY:-.venv/bin/python}
OMP_NUM_THREADS=1 $PY -m mrtpo compare \
  --task constraints-real:start_phrase,keyword_include,end_phrase,letter_frequency \
  --model smollm2-135m-instruct --warm-steps 30 --warm-noise 0.6 --autocast bfloat16 \
  --algos gdpo,mrtpo,mrtpo:specific:gamma=2 --seeds 3 --steps 100 --prompts-per-step 2 \
  --group-size 4 --max-new-tokens 32 --micro-batch 8 --lr 2e-5 --target 0.3 --jobs 2 \
  --threads 1 --no-baseline-replay --checkpoint-every 5 --out runs/real-k4 \
  --results runs/real-k4-results
