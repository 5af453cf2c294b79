# Issue 25, item 2: seed 4 of both arms in a second lane, so that the 5 seeds finish within
# one session once item 3's first pair had freed a core. The same runs `command.sh` would
# make for seed 4 (each arm's seed-0 config.json from that compare folder with the seed set
# to 4: same code, settings, warm start), trained by rerun_config.py into a folder of their
# own; command.sh was stopped before it reached seed 4. Same fixed checkout (/work/wt26).
# Resumable: rerun the script as it is.
set -u
W=${W:-/work/wt26}
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
for a in gdpo mrtpo; do
  bash /work/main/docs/results/scripts/lane_run.sh runs/k3-100/constraints-real runs/k3-100-lane2 "$a" 4
done
