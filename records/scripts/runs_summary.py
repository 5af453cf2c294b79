"""Summarize the (algo, seed) runs of a `mrtpo compare` folder from their metrics.jsonl,
finished or not: per run the steps done, steps to the target, AUC over the steps common to
the compared runs, start / final pass rates, the share of answers cut at the token cap (mean
of the last window, and the largest mean over any window), credit diagnostics and seconds
per phase; then each algorithm against GDPO (or ``--base ALGO``) over the seeds both have
(steps-to-target ratio and AUC difference with percentile bootstrap intervals, as
`mrtpo compare` computes them).

    python records/scripts/runs_summary.py runs/real/constraints-real --target 0.4
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from mrtpo.training.stats import bootstrap_ratio, steps_to_target


def _rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            break  # a torn last line of a run still going
    return rows


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def _fmt(x, nd=2):
    return "-" if x is None else f"{x:.{nd}f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--target", type=float, default=0.5)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--window-final", type=int, default=10)
    ap.add_argument("--base", default="gdpo", help="the algorithm the others are compared with")
    a = ap.parse_args(argv)
    runs = {}
    for d in sorted(a.folder.iterdir()):
        m = d / "metrics.jsonl"
        if m.is_file() and "-seed" in d.name:
            algo, seed = d.name.rsplit("-seed", 1)
            rows = _rows(m)
            if rows:
                runs[(algo, int(seed))] = rows
    if not runs:
        raise SystemExit(f"folder: no runs with metrics.jsonl in {a.folder}")
    common = min(len(r) for r in runs.values())
    names = [k.split("/", 1)[1] for k in next(iter(runs.values()))[0] if k.startswith("pass/")]
    print(f"steps common to every run: {common}; target {a.target}, window {a.window}\n")
    head = ["run", "steps", "to target", f"AUC@{common}", "start all", "final all"]
    head += [f"start/final {n}" for n in names]
    head += ["cut final / peak", "credit prec / unif", "top-hit / chance", "rank AUC"]
    head += ["rollout/replay/update s"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    per = {}
    for (algo, seed), rows in sorted(runs.items()):
        st = steps_to_target(rows, a.target, a.window)
        auc = statistics.fmean(r["all_pass"] for r in rows[:common])
        per.setdefault(algo, {})[seed] = (st, auc, len(rows))
        tail = rows[-a.window_final :]
        cells = [f"{algo} s{seed}", str(len(rows)), str(st) if st else f">{len(rows)}"]
        cells += [
            _fmt(auc, 3),
            _fmt(rows[0]["all_pass"]),
            _fmt(_mean([r["all_pass"] for r in tail])),
        ]
        for n in names:
            f = _mean([r[f"pass/{n}"] for r in tail])
            cells.append(f"{_fmt(rows[0][f'pass/{n}'])} / {_fmt(f)}")
        cut = [r.get("truncated") or 0.0 for r in rows]
        peak = max(_mean(cut[i : i + a.window_final]) for i in range(len(cut)))
        cells.append(f"{_fmt(_mean(cut[-a.window_final :]))} / {_fmt(peak)}")
        cells.append(
            f"{_fmt(_mean([r.get('credit_precision') for r in rows]))} / "
            f"{_fmt(_mean([r.get('uniform_share') for r in rows]))}"
        )
        hit = _mean([_mean([r.get(f"top_hit/{n}") for n in names]) for r in rows])
        ch = _mean([_mean([r.get(f"top_hit_chance/{n}") for n in names]) for r in rows])
        cells.append(f"{_fmt(hit)} / {_fmt(ch)}")
        cells.append(_fmt(_mean([_mean([r.get(f"rank_auc/{n}") for n in names]) for r in rows])))
        ph = [_mean([r["time"][p] for r in rows]) for p in ("rollout", "replay", "update")]
        cells.append(" / ".join(_fmt(x, 1) for x in ph))
        print("| " + " | ".join(cells) + " |")
    base = per.get(a.base)
    if not base:
        return
    print()
    for algo, seeds in per.items():
        if algo == a.base:
            continue
        both = sorted(set(seeds) & set(base))
        if not both:
            continue
        budget = common
        sa = [seeds[s][0] or budget for s in both]
        sb = [base[s][0] or budget for s in both]
        ra = [seeds[s][1] for s in both]
        rb = [base[s][1] for s in both]
        ratio = statistics.fmean(sa) / statistics.fmean(sb)
        lo, hi = bootstrap_ratio(sa, sb)
        dlo, dhi = bootstrap_ratio(ra, rb, diff=True)
        print(
            f"{algo} vs {a.base} over seeds {both} (unreached = {budget} steps): steps ratio "
            f"{ratio:.2f} (95% CI {lo:.2f}-{hi:.2f}); AUC {statistics.fmean(ra):.3f} vs "
            f"{statistics.fmean(rb):.3f}, diff {statistics.fmean(ra) - statistics.fmean(rb):+.3f}"
            f" (CI {dlo:+.3f} to {dhi:+.3f})"
        )


if __name__ == "__main__":
    main()
