# The tables of records/issue25_stop_credit.md from the committed runs (config.json and
# metrics.jsonl under runs/): every arm against GDPO, then against the JS form (same seeds).
# The check run (gdpo-seed0-check, 15 steps) is left out. Reads only committed files.
set -eu
cd "$(dirname "$0")/../../../.."
PY=${PY:-.venv/bin/python}
T=$(mktemp -d)
trap 'rm -rf "$T"' EXIT
for d in records/real_k4/stop_uniform/runs/*-seed[0-9]; do ln -s "$PWD/$d" "$T/"; done
# the sharper form's seeds 0 and 1 with the stop token uniform: issue 17's runs (the earlier
# warm-start folder), beside the rule
for s in 0 1; do ln -s "$PWD/records/real_k4/length/sharper-stopuniform-seed$s" "$T/"; done
$PY records/scripts/runs_summary.py "$T" --target 0.3
echo
$PY records/scripts/runs_summary.py "$T" --target 0.3 --base mrtpo | tail -n +2 | grep " vs mrtpo "
