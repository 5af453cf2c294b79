"""The held-out all-pass curves of a comparison's committed runs (``<algo>-seed<s>``
folders with metrics.jsonl): one panel per seed, the arms side by side, plus the mean over
the seeds both arms finished; the target as a dashed line. Reads only the files given.

    python records/scripts/heldout_plot.py RUNS_DIR OUT.png --target 0.15
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from mrtpo.training.stats import run_folder


def curves(runs: Path) -> dict[str, dict[int, list[tuple[int, float]]]]:
    """{algo: {seed: [(step, held-out all-pass), ...]}} from each run's "eval" entries."""
    out: dict[str, dict[int, list]] = {}
    for d in sorted(runs.iterdir()):
        found = run_folder(d.name)  # seed01 is refused, naming it (else one seed with seed1)
        if found is None or not (d / "metrics.jsonl").is_file():
            continue
        pts = []
        for line in (d / "metrics.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a torn last line of a run still going
                break
            pts += [(e["step"], e["all_pass"]) for e in row.get("eval") or []]
        if pts:
            out.setdefault(found[0], {})[found[1]] = pts
    return out


def plot(data: dict, out: Path, target: float | None, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = sorted(data, key=lambda a: (a != "gdpo", a))
    seeds = sorted(set.intersection(*(set(data[a]) for a in algos))) if algos else []
    if not seeds:
        raise ValueError(f"no seed with held-out evaluations in every arm ({', '.join(algos)})")
    panels = len(seeds) + 1
    cols = min(4, panels)
    rows = math.ceil(panels / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False,
                             sharex=True, sharey=True)  # fmt: skip
    flat = [ax for r in axes for ax in r]
    for ax, seed in zip(flat, seeds):
        for a in algos:
            xs, ys = zip(*data[a][seed])
            ax.plot(xs, ys, marker="o", ms=3, label=a)
        ax.set_title(f"seed {seed}", fontsize=9)
    ax = flat[len(seeds)]
    for a in algos:
        steps = sorted({s for seed in seeds for s, _ in data[a][seed]})
        mean = [sum(dict(data[a][seed]).get(s, math.nan) for seed in seeds) / len(seeds)
                for s in steps]  # fmt: skip
        ax.plot(steps, mean, marker="o", ms=3, label=a)
    ax.set_title(f"mean over {len(seeds)} seeds", fontsize=9)
    for ax in flat[:panels]:
        if target is not None:
            ax.axhline(target, color="grey", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
    for ax in flat[panels:]:
        ax.axis("off")
    flat[0].legend(fontsize=8)
    fig.supxlabel("step")
    fig.supylabel("held-out all-pass")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", type=Path)
    ap.add_argument("out", type=Path, help="the PNG to write")
    ap.add_argument("--target", type=float, default=None)
    ap.add_argument("--title", default="held-out all-pass, per seed")
    args = ap.parse_args(argv)
    if not args.runs.is_dir():
        raise SystemExit(f"runs: not a folder: {args.runs}")
    plot(curves(args.runs), args.out, args.target, args.title)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
