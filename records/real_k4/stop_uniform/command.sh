# Issue 25, item 1: the paper's JS form with the stop token's credit at weight 1 for every
# reward (--stop-credit uniform), K = 4, the recorded runs' settings (records/real_k4/runs:
# same seeds, warm start, batch, target 0.3 set before the first K = 4 run) with that one
# setting changed; and the sharper form's seed 2 with it, which stopped at 56 of 100 steps.
# From a fixed checkout of d4adf57 (a git worktree, PYTHONPATH pointing at it,
# the C++ extension copied in), one thread per run, two lanes side by side. Resumable (a
# checkpoint every 5 steps): rerun the script as it is.
# Usage: bash command.sh [CHECKOUT] -- CHECKOUT (or $W) is the fixed checkout, default the
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
# the warm-started starting folder once (every run here has init_seed 0), before two runs
# could both write it
$PY - "$REC/mrtpo-seed0/config.json" <<'PYEOF'
import json
import sys
from mrtpo.config import TrainConfig
from mrtpo.pretrained import initial_folder
from mrtpo.tasks import load_task
c = TrainConfig.from_dict(json.load(open(sys.argv[1])))
print(initial_folder(c.model, load_task(c.task, seed=c.init_seed), seed=c.init_seed,
      cache_dir=c.cache_dir, warm_steps=c.tiny.warm_steps, warm_noise=c.tiny.warm_noise, log=print))
PYEOF
lane() { for a in "$@"; do
  src=${a%%:*}; dst=${a#*:}
  $PY $S "$REC/$src" "runs/k4-stop/$dst" --steps 100 --set stop_credit=uniform > "runs/k4-stop/$dst.log" 2>&1
done; }
mkdir -p runs/k4-stop
lane mrtpo-seed0:mrtpo-stopuniform-seed0 mrtpo-seed2:mrtpo-stopuniform-seed2 &
lane mrtpo-seed1:mrtpo-stopuniform-seed1 mrtpo-specific-gamma2-seed2:sharper-stopuniform-seed2 &
wait
