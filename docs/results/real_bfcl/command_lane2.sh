# Issue 25, item 3: further seeds in a lane of their own (rerun_config.py from the seed-0
# compare run of the same arm, only `seed` and `out` changed: same code, settings and warm
# start as command.sh). Used when a session's time fits one run but not command.sh's next
# pair; the table reads runs/ however the run was made. Same fixed checkout (/work/wt26).
#   bash docs/results/real_bfcl/command_lane2.sh gdpo 1
# Resumable: rerun it as it is.
set -u
W=${W:-/work/wt26}
PY=${PY:-/work/main/.venv/bin/python}
algo=$1 seed=$2
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
mkdir -p runs/bfcl-100-lane2
$PY docs/results/scripts/rerun_config.py "runs/bfcl-100/tools-bfcl/$algo-seed0" \
  "runs/bfcl-100-lane2/$algo-seed$seed" --set seed="$seed" > "runs/bfcl-100-lane2/$algo-seed$seed.log" 2>&1
