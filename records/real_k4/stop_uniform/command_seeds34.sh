# Issue 25, item 1: seeds 3 and 4 of GDPO, the JS form and the JS form with --stop-credit
# uniform, K = 4, from the same fixed checkout as command.sh (a git worktree of d4adf57), and
# seeds 0-2 of GDPO and of the JS form again there. The recorded settings, with the seed
# changed for seeds 3 and 4 (init_seed stays 0: every K = 4 run starts from the same warm
# start). Why seeds 0-2 again: the check that runs first (GDPO seed 0 for 15 steps against
# its record) differs from step 1 on, in its rollouts: the warm-started folder was rebuilt
# in this session's cache (same settings and key) and does not equal the one the recorded
# runs used bit for bit, so every arm is compared on runs made here from the same folder.
# Ordered so that whole seeds of every arm come first (seeds 0-3, then 4). Resumable: rerun
# the script as it is. Stopped for time (2026-12-03 15:20 UTC) after seeds 0-3 of every arm:
# gdpo-seed4, mrtpo-seed4 and mrtpo-stopuniform-seed4 have not run.
# Usage: bash command_seeds34.sh [CHECKOUT] -- CHECKOUT (or $W) is the fixed checkout, default the
# checkout holding this script; PY names the interpreter (default CHECKOUT/.venv/bin/python);
# REC the recorded runs (default ../runs beside this script).
set -u
H=$(cd "$(dirname "$0")/../../../.." && pwd) || exit 2
W=$(cd "${1:-${W:-$H}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: CHECKOUT $W holds no mrtpo/: not a checkout" >&2; exit 2; }
PY=${PY:-.venv/bin/python}
REC=$(cd "${REC:-$H/records/real_k4/runs}" && pwd) || exit 2
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
S=records/scripts/rerun_config.py
mkdir -p runs/k4-stop
run() { src=$1; dst=$2; shift 2
  $PY $S "$REC/$src" "runs/k4-stop/$dst" "$@" > "runs/k4-stop/$dst.log" 2>&1; }
( run gdpo-seed0 gdpo-seed0-check --steps 15
  run mrtpo-seed2 mrtpo-seed2 --steps 100
  run gdpo-seed2 gdpo-seed2 --steps 100
  run gdpo-seed0 gdpo-seed3 --steps 100 --set seed=3
  run mrtpo-seed0 mrtpo-seed3 --steps 100 --set seed=3
  run gdpo-seed0 gdpo-seed4 --steps 100 --set seed=4
  run mrtpo-seed0 mrtpo-seed4 --steps 100 --set seed=4 ) &
( run mrtpo-seed0 mrtpo-stopuniform-seed3 --steps 100 --set stop_credit=uniform --set seed=3
  run mrtpo-seed0 mrtpo-seed0 --steps 100
  run gdpo-seed0 gdpo-seed0 --steps 100
  run mrtpo-seed1 mrtpo-seed1 --steps 100
  run gdpo-seed1 gdpo-seed1 --steps 100
  run mrtpo-seed0 mrtpo-stopuniform-seed4 --steps 100 --set stop_credit=uniform --set seed=4 ) &
wait
