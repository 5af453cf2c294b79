# Issue 25, item 3, seeds 1-2 on a rebuilt warm start ("warm start B"). A new machine rebuilt
# the 25-step warm start from the same code and settings, and a 3-step rerun of GDPO's seed 0
# (rerun_config.py) differed from its record from step 1 while repeating itself exactly: the
# rebuilt warm start is not the one seed 0 and the first GDPO seed 1 ran from ("warm start
# A"). So both arms' seeds 1 and 2 run here from warm start B, each seed's pair from one warm
# start; seed 0's pair stays on A. Same fixed checkout (a git worktree of d5e8129) and settings;
# rerun_config.py from each arm's seed-0 config with only `seed` and `out` changed.
#   bash records/real_bfcl/command_ws2.sh gdpo [CHECKOUT]   # one lane: seeds 1, then 2
#   bash records/real_bfcl/command_ws2.sh mrtpo [CHECKOUT]  # the other lane, side by side
# Needs runs/bfcl-100/tools-bfcl/<algo>-seed0/config.json in the worktree (a copy of the
# record's). Resumable: rerun it as it is.
# lane_run.sh is the copy beside this script (the fixed commit predates it); CHECKOUT (or $W)
# is the fixed checkout, default the checkout holding this script; PY names the interpreter
# (default CHECKOUT/.venv/bin/python).
set -u
L=$(cd "$(dirname "$0")/../scripts" && pwd)/lane_run.sh || exit 2
W=$(cd "${2:-${W:-$(dirname "$0")/../../..}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: CHECKOUT $W holds no mrtpo/: not a checkout" >&2; exit 2; }
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
for seed in 1 2; do
  bash "$L" runs/bfcl-100/tools-bfcl runs/bfcl-100-ws2 "$1" "$seed"
done
