"""Draw time and memory against N, one PNG per op (and K), one line per provider and d.

    python -m bench.plot --csv bench/results/cpu-.../results.csv --out DIR

Rows with status "estimated" are drawn as hollow markers on the memory axis (not run).
"""

from __future__ import annotations

import argparse
import os
import sys

from .results import num, read_rows


def plot(rows: list[dict], out_dir: str) -> list[str]:
    """Write the PNGs; return their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    # a CSV that several runs appended to may hold a cell more than once: the latest wins
    latest: dict[tuple, dict] = {}
    for r in rows:
        latest[(r["op"], r["provider"], r["N"], r["K"], r["d"], r["dtype"])] = r
    groups: dict[tuple[str, str, str], list[dict]] = {}
    for r in latest.values():
        groups.setdefault((r["op"], r["K"], r["dtype"]), []).append(r)
    paths = []
    for (op, k, dtype), rs in sorted(groups.items()):
        fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4.2))
        lines: dict[tuple[str, str], list[dict]] = {}
        for r in rs:
            lines.setdefault((r["provider"], r["d"]), []).append(r)
        drawn = 0
        colors = {key: f"C{i % 10}" for i, key in enumerate(sorted(lines))}
        for (prov, d), pts in sorted(lines.items()):
            color = colors[(prov, d)]
            pts = sorted(pts, key=lambda r: int(r["N"]))
            label = f"{prov} d={d}" if d not in ("", "0") else prov
            ok = [r for r in pts if r["status"] == "ok"]
            if ok:
                xs = [int(r["N"]) for r in ok]
                ax_t.plot(xs, [num(r, "ms_p50") for r in ok], marker="o", color=color, label=label)
                ax_m.plot(xs, [num(r, "peak_mem_mb") for r in ok], marker="o", color=color)
                drawn += 1
            est = [r for r in pts if r["status"] == "estimated"]
            if est:
                ax_m.plot(
                    [int(r["N"]) for r in est],
                    [num(r, "peak_mem_mb") for r in est],
                    linestyle="none",
                    marker="o",
                    mfc="none",
                    color=color,
                    label=f"{label}: estimated, not run",
                )
                drawn += 1
        if not drawn:
            plt.close(fig)
            continue
        title = op + (f" K={k}" if k not in ("", "0") else "") + f" ({dtype})"
        for ax, ylabel in ((ax_t, "time per call, ms (median)"), (ax_m, "peak memory, MiB")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("N (tokens)")
            ax.set_ylabel(ylabel)
            ax.grid(True, which="both", alpha=0.3)
        ax_t.set_title(title)
        ax_m.set_title(f"{title}: memory")
        ax_t.legend(fontsize=7)
        if ax_m.get_legend_handles_labels()[0]:  # hollow markers: estimated, not run
            ax_m.legend(fontsize=7)
        fig.tight_layout()
        name = op + (f"_k{k}" if k not in ("", "0") else "") + f"_{dtype}.png"
        path = os.path.join(out_dir, name)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.plot", description=__doc__)
    ap.add_argument("--csv", required=True, help="results CSV written by python -m bench")
    ap.add_argument("--out", required=True, help="folder for the PNG files")
    args = ap.parse_args(argv)
    if not os.path.exists(args.csv):
        print(f"python -m bench.plot: --csv {args.csv} does not exist", file=sys.stderr)
        return 2
    paths = plot(read_rows(args.csv), args.out)
    for p in paths:
        print(p)
    return 0 if paths else 1


if __name__ == "__main__":
    raise SystemExit(main())
