# Issue 25, item 2: seed 4 of both arms in a second lane, so that the 5 seeds finish within
# one session once item 3's first pair had freed a core. The same runs `command.sh` would
# make for seed 4 (each arm's seed-0 config.json from that compare folder with the seed set
# to 4: same code, settings, warm start), trained by rerun_config.py into a folder of their
# own; command.sh was stopped before it reached seed 4. Same fixed checkout (d5e8129).
# Usage: bash command_seed4.sh [CHECKOUT]. Resumable: rerun the script as it is.
# lane_run.sh is the copy beside this script (the fixed commit predates it); CHECKOUT (or $W)
# is the fixed checkout, default the checkout holding this script; PY names the interpreter
# (default CHECKOUT/.venv/bin/python).
set -u
L=$(cd "$(dirname "$0")/../scripts" && pwd)/lane_run.sh || exit 2
W=$(cd "${1:-${W:-$(dirname "$0")/../../..}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: CHECKOUT $W holds no mrtpo/: not a checkout" >&2; exit 2; }
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
for a in gdpo mrtpo; do
  bash "$L" runs/k3-100/constraints-real runs/k3-100-lane2 "$a" 4
done
