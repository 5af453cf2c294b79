# Copy the record of each run of a `mrtpo compare` folder (config.json, metrics.jsonl and,
# where the run finished, compare_run.json) into a committed folder; checkpoints stay behind.
# A run still going is copied as far as it got (runs_summary.py reads a torn last line).
#   bash records/scripts/collect_runs.sh CHECKOUT/runs/k3-100/constraints-real records/real_k3_100/runs
set -eu
src=$1 dst=$2
for d in "$src"/*-seed[0-9]*; do
  [ -f "$d/metrics.jsonl" ] || continue
  mkdir -p "$dst/$(basename "$d")"
  for f in config.json metrics.jsonl compare_run.json; do
    [ -f "$d/$f" ] && cp "$d/$f" "$dst/$(basename "$d")/"
  done
done
ls "$dst"
