"""The held-out table of a comparison's committed runs (config.json + metrics.jsonl per
``<algo>-seed<s>`` folder): per run, then each MRTPO variant against GDPO over the seeds both
finished, with the analysis fixed in `mrtpo.training.stats.compare_to_gdpo` (paired bootstrap,
sign-flip p, verdict only with enough pairs). Reads only the files given.

    python records/scripts/heldout_table.py RUNS_DIR --target 0.5 --steps 100
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mrtpo.training.report import claim_verdict, fmt
from mrtpo.training.stats import run_folder, summarize_run


def load(runs: Path, target: float, window: int, steps: int) -> dict:
    out: dict[str, list] = {}
    names = None
    for d in sorted(runs.iterdir()):
        found = run_folder(d.name)  # seed01 is refused, naming it (else one seed with seed1)
        if found is None or not (d / "metrics.jsonl").is_file():
            continue
        algo, seed = found
        rows = []
        for line in (d / "metrics.jsonl").read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a torn last line of a run still going
                break
        if len(rows) < steps:
            print(f"{d.name}: {len(rows)} of {steps} steps, left out")
            continue
        names = [k[len("pass/") :] for k in rows[0] if k.startswith("pass/")]
        s = summarize_run(rows[:steps], names, target, window)
        s["seed"] = seed
        s["wall_s"] = sum(sum(v for k, v in r["time"].items() if k != "replays") for r in rows)
        out.setdefault(algo, []).append(s)
    return {"runs": out, "reward_names": names, "settings": {"baseline_replay": False}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("--target", type=float, required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--window", type=int, default=5)
    args = ap.parse_args(argv)
    try:
        summary = load(args.runs, args.target, args.window, args.steps)
    except ValueError as err:  # a run folder that is refused (seed01): one line, status 2
        ap.error(str(err))
    print(
        "| run | held-out steps to target | held-out AUC | held-out start -> final all-pass "
        "| training steps to target | training AUC | training s |"
    )
    print("|---|---|---|---|---|---|---|")
    for algo, rs in summary["runs"].items():
        for r in sorted(rs, key=lambda r: r["seed"]):
            h = r["heldout"] or {}
            reached = h.get("steps_to_target")
            t_reached = r["steps_to_target"]
            print(
                f"| {algo} seed {r['seed']} | {f'>{args.steps}' if reached is None else reached}"
                f" | {fmt(h.get('auc'), 3)} | {fmt(h.get('start_all_pass'))} -> "
                f"{fmt(h.get('final_all_pass'))} | "
                f"{f'>{args.steps}' if t_reached is None else t_reached} | {fmt(r['auc'], 3)} | "
                f"{r['wall_s']:.0f} |"
            )
    print()
    for line in claim_verdict(summary, args.steps):
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
