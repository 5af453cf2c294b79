# Issue 25, item 1: GDPO's seed 4 (the JS arms' seed 4 ran in the session before), from the
# same fixed checkout as command.sh / command_seeds34.sh (d4adf57, worktree at /work/wt25,
# the C++ extension copied in). The warm-started folder is rebuilt in this worktree's cache:
# the check (GDPO seed 0 for 5 steps against the recorded gdpo-seed0) says whether it is the
# folder the other arms' seeds 0-4 started from (first step that differs: None = the same).
# Resumable: rerun the script as it is.
set -u
W=${W:-/work/wt25}
PY=${PY:-/work/main/.venv/bin/python}
REC=${REC:-/work/main/docs/results/real_k4/stop_uniform/runs}
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
S=docs/results/scripts/rerun_config.py
mkdir -p runs/k4-stop
run() { src=$1; dst=$2; shift 2
  $PY $S "$REC/$src" "runs/k4-stop/$dst" "$@" > "runs/k4-stop/$dst.log" 2>&1; }
run gdpo-seed0 gdpo-seed0-check5 --steps 5
run gdpo-seed0 gdpo-seed4 --steps 100 --set seed=4
