# The table of records/issue25_k3_tools.md for this item, from the committed runs
# (runs/*/config.json and metrics.jsonl): per run, then MRTPO against GDPO over the seeds both
# have (target 0.5, set before the runs). Reads only committed files.
set -eu
cd "$(dirname "$0")/../../.."
PY=${PY:-.venv/bin/python}
$PY records/scripts/runs_summary.py records/real_k3_100/runs --target 0.5
