# Issue 25, item 3: further seeds in a lane of their own (rerun_config.py from the seed-0
# compare run of the same arm, only `seed` and `out` changed: same code, settings and warm
# start as command.sh). Used when a session's time fits one run but not command.sh's next
# pair; the table reads runs/ however the run was made. Same fixed checkout (d5e8129).
#   bash records/real_bfcl/command_lane2.sh gdpo 1 [CHECKOUT]
# lane_run.sh is the copy beside this script (the fixed commit predates it); CHECKOUT (or $W)
# is the fixed checkout, default the checkout holding this script; PY names the interpreter
# (default CHECKOUT/.venv/bin/python).
# Resumable: rerun it as it is.
set -u
L=$(cd "$(dirname "$0")/../scripts" && pwd)/lane_run.sh || exit 2
W=$(cd "${3:-${W:-$(dirname "$0")/../../..}}" && pwd) || exit 2
[ -d "$W/mrtpo" ] || { echo "$0: CHECKOUT $W holds no mrtpo/: not a checkout" >&2; exit 2; }
cd "$W"
export PYTHONPATH="$W" OMP_NUM_THREADS=1
bash "$L" runs/bfcl-100/tools-bfcl runs/bfcl-100-lane2 "$1" "$2"
