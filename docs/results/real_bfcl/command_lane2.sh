# Issue 25, item 3: further seeds in a lane of their own (rerun_config.py from the seed-0
# compare run of the same arm, only `seed` and `out` changed: same code, settings and warm
# start as command.sh). Used when a session's time fits one run but not command.sh's next
# pair; the table reads runs/ however the run was made. Same fixed checkout (/work/wt26).
#   bash docs/results/real_bfcl/command_lane2.sh gdpo 1
# Resumable: rerun it as it is.
set -u
W=${W:-/work/wt26}
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
bash /work/main/docs/results/scripts/lane_run.sh runs/bfcl-100/tools-bfcl runs/bfcl-100-lane2 "$1" "$2"
