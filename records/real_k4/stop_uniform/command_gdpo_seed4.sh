# Issue 25, item 1: GDPO's seed 4 (the JS arms' seed 4 ran in the session before), from the
# same fixed checkout as command.sh / command_seeds34.sh (d4adf57, a git worktree of it,
# the C++ extension copied in). The warm-started folder is rebuilt in this worktree's cache:
# the check (GDPO seed 0 for 5 steps against the recorded gdpo-seed0) says whether it is the
# folder the other arms' seeds 0-4 started from (first step that differs: None = the same).
# Resumable: rerun the script as it is.
# Usage: bash command_gdpo_seed4.sh [CHECKOUT] -- CHECKOUT (or $W) is the fixed checkout,
# default the checkout holding this script; PY names the interpreter (default CHECKOUT/.venv/bin/python);
# REC the recorded runs (default runs beside this script).
set -u
H=$(cd "$(dirname "$0")/../../../.." && pwd) || exit 2
W=$(cd "${1:-${W:-$H}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: CHECKOUT $W holds no mrtpo/: not a checkout" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
REC=$(cd "${REC:-$H/records/real_k4/stop_uniform/runs}" && pwd) || exit 2
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
S=records/scripts/rerun_config.py
mkdir -p runs/k4-stop
run() { src=$1; dst=$2; shift 2
  $PY $S "$REC/$src" "runs/k4-stop/$dst" "$@" > "runs/k4-stop/$dst.log" 2>&1; }
run gdpo-seed0 gdpo-seed0-check5 --steps 5
run gdpo-seed0 gdpo-seed4 --steps 100 --set seed=4
