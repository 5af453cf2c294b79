# K = 4 rewards on SmolLM2-135M-Instruct, 3 seeds x 100 steps (issue 17). Run from a fixed
# checkout of the commit in the record (compare keys reuse by a hash of the sources), with
# runs/ pointing at the main checkout's runs/; the command is resumable: rerun it as it is.
# Usage: bash records/real_k4/command.sh [WORKTREE] -- WORKTREE (or $W) is the git
# worktree of a303fe0, default wt-a303fe0 beside the checkout holding this script; when it
# does not exist yet it is made, the C++ extension copied in and runs/ and .venv linked to
# that checkout's. PY names the interpreter (default WORKTREE/.venv/bin/python).
set -u
M=$(cd "$(dirname "$0")/../../.." && pwd) || exit 2
W=${1:-${W:-$M/../wt-a303fe0}}
case $W in /*) ;; *) W=$PWD/$W ;; esac
if [ ! -e "$W" ]; then
  git -C "$M" worktree add "$W" a303fe0 && cp "$M"/mrtpo_kernels/_C*.so "$W/mrtpo_kernels/" &&
    ln -s "$M/runs" "$W/runs" && ln -s "$M/.venv" "$W/.venv" || exit 1
fi
[ -d "$W/mrtpo" ] || { echo "$0: WORKTREE $W holds no mrtpo/: not a checkout" >&2; exit 2; }
cd "$W" || exit 2
PY=${PY:-.venv/bin/python}
OMP_NUM_THREADS=1 $PY -m mrtpo compare \
  --task constraints-real:start_phrase,keyword_include,end_phrase,letter_frequency \
  --model smollm2-135m-instruct --warm-steps 30 --warm-noise 0.6 --autocast bfloat16 \
  --algos gdpo,mrtpo --seeds 3 --steps 100 --prompts-per-step 2 --group-size 4 \
  --max-new-tokens 32 --micro-batch 8 --lr 2e-5 --target 0.3 --jobs 2 --threads 1 \
  --no-baseline-replay --checkpoint-every 5 --out runs/real-k4 --results runs/real-k4-results
# the fourth kind's calibration (warm start as above, 16 prompts x 4 samples):
OMP_NUM_THREADS=1 $PY records/scripts/real_calibration.py \
  --task constraints-real:start_phrase,keyword_include,end_phrase,letter_frequency \
  --warm-steps 30 --warm-noise 0.6 --prompts 16 --group 4 --max-new-tokens 32
