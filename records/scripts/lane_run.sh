# One run in a lane of its own: rerun_config.py on an arm's seed-0 run of a `mrtpo compare`
# folder with only the seed changed (same code, settings and warm start as compare would
# use; `out` is the lane's folder). For a session whose time fits one more run but not the
# compare script's next pair; the record's table reads runs/ however a run was made.
#   bash records/scripts/lane_run.sh COMPARE_TASK_DIR LANE_DIR ALGO SEED
# Run from the fixed checkout (cwd); PY names the interpreter (default .venv/bin/python in the
# cwd). Resumable: rerun it as it is.
set -u
[ $# -eq 4 ] || { echo "usage: $0 COMPARE_TASK_DIR LANE_DIR ALGO SEED" >&2; exit 2; }
compare=$1 lane=$2 algo=$3 seed=$4
PY=${PY:-.venv/bin/python}
mkdir -p "$lane"
$PY records/scripts/rerun_config.py "$compare/$algo-seed0" "$lane/$algo-seed$seed" \
  --set seed="$seed" > "$lane/$algo-seed$seed.log" 2>&1
