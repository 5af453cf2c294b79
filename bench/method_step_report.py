"""The table, headline and plots of ``python -m bench.method_step``'s results.

    python -m bench.method_step_report --dir DIR [--no-plots]

Reads DIR/method_step.csv and DIR/runs.jsonl; writes DIR/method_step.md and
DIR/method_step_time.png (time per stage, stacked, against the response length, relative to
GDPO's step of the same length) and DIR/method_step_memory.png (peak memory beyond the
step's start against the response tokens, log-log, with a slope-1 guide).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .method_step import STAGES, VARIANTS
from .results import num, read_rows

LABEL = {"mrtpo": "MRTPO", "mrtpo-half": "MRTPO, half the pairs skipped", "gdpo": "GDPO"}
REPLAY_STAGES = ("replay", "js")


def collect(rows: list[dict]) -> dict:
    """{(model, N): {variant: {stage: row}}}, the latest row of each (a CSV that several
    runs appended to may hold a case more than once)."""
    out: dict = {}
    for r in rows:
        key = (r["model"], int(r["N"]))
        out.setdefault(key, {}).setdefault(r["provider"], {})[r["stage"]] = r
    return out


# stage times: the process CPU time where the rows have it (one thread on the CPU: the
# compute, much less stretched by other jobs than the wall time), else the wall time
TIME = {"key": "ms_p50"}


def time_key(rows: list[dict]) -> str:
    have = [r for r in rows if r.get("status") == "ok"]
    return "cpu_ms_p50" if have and all(r.get("cpu_ms_p50") for r in have) else "ms_p50"


def _ms(stages: dict, stage: str, key: str | None = None) -> float:
    r = stages.get(stage)
    ok = r is not None and r["status"] == "ok"
    return (num(r, key or TIME["key"]) or 0.0) if ok else 0.0


def _ok(stages: dict | None) -> bool:
    return bool(stages) and stages.get("step", {}).get("status") == "ok"


def _f(x, nd=0) -> str:
    return "-" if x is None else f"{x:,.{nd}f}"


def table(cases: dict) -> list[str]:
    head = ("| model | tokens per response | variant | pairs replayed / skipped | step wall ms "
            "| step ms | "
            + " | ".join(STAGES) + " | replay + JS share | step / GDPO | peak extra MiB "
            "| extra / GDPO's |")  # fmt: skip
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for (model, n), by in sorted(cases.items()):
        gdpo = by.get("gdpo")
        g_ms = _ms(gdpo, "step") if _ok(gdpo) else None
        g_mem = num(gdpo["step"], "extra_mem_mb") if _ok(gdpo) else None
        for v in VARIANTS:
            st = by.get(v)
            if st is None:
                continue
            if not _ok(st):
                r = st.get("step") or next(iter(st.values()))
                lines.append(f"| {model} | {n} | {v} | {r['status']}: {r['note']} |"
                             + " |" * (len(STAGES) + 6))  # fmt: skip
                continue
            step = st["step"]
            ms = _ms(st, "step")
            share = sum(_ms(st, s) for s in REPLAY_STAGES) / ms if ms else None
            extra = num(step, "extra_mem_mb")
            cells = [
                model,
                str(n),
                v,
                f"{step['pairs']} / {step['skipped']}",
                _f(_ms(st, "step", "ms_p50")),
                _f(ms),
            ]
            cells += [_f(_ms(st, s)) if s in st else "-" for s in STAGES]
            cells += [
                f"{share:.0%}" if share is not None and v != "gdpo" else "-",
                f"{ms / g_ms:.2f}" if g_ms else "-",
                _f(extra, 1),
                f"{extra / g_mem:.2f}" if g_mem and extra is not None else "-",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def headline(cases: dict) -> list[str]:
    out = []
    models = sorted({m for m, _ in cases})
    for model in models:
        ns = sorted(n for m, n in cases if m == model and _ok(cases[(m, n)].get("mrtpo"))
                    and _ok(cases[(m, n)].get("gdpo")))  # fmt: skip
        if not ns:
            out.append(f"- {model}: no length with both MRTPO and GDPO measured.")
            continue
        n = ns[-1]
        mr, gd = cases[(model, n)]["mrtpo"], cases[(model, n)]["gdpo"]
        ms, g_ms = _ms(mr, "step"), _ms(gd, "step")
        rep, js = _ms(mr, "replay"), _ms(mr, "js")
        e_m, e_g = num(mr["step"], "extra_mem_mb"), num(gd["step"], "extra_mem_mb")
        p_m, p_g = num(mr["step"], "peak_mem_mb"), num(gd["step"], "peak_mem_mb")
        wall = _ms(mr, "step", "ms_p50") / _ms(gd, "step", "ms_p50")
        line = (
            f"- {model}, {n}-token responses ({mr['step']['responses']} responses, K = "
            f"{mr['step']['K']}): the replay is {(rep + js) / ms:.0%} of MRTPO's step "
            f"(replay forwards {rep / ms:.0%}, fused JS {js / ms:.0%}); the step takes "
            f"{ms / g_ms:.2f}x GDPO's (wall time {wall:.2f}x); peak memory {p_m:,.0f} MiB "
            f"against GDPO's {p_g:,.0f} "
            f"MiB ({e_m:,.0f} against {e_g:,.0f} MiB beyond the step's start"
            + (f", {e_m / e_g:.2f}x)." if e_g else ").")
        )
        half = cases[(model, n)].get("mrtpo-half")
        if _ok(half) and rep:
            line += (
                f" With half of the pairs skipped ({half['step']['pairs']} of "
                f"{mr['step']['pairs']} replayed), the replay forwards take "
                f"{_ms(half, 'replay') / rep:.2f}x the full replay's time and the step "
                f"{_ms(half, 'step') / g_ms:.2f}x GDPO's."
            )
        out.append(line)
    return out


def linearity(cases: dict) -> list[str]:
    """Peak extra memory per model and variant at every length, with the growth per added
    response token since the previous length (KiB): a constant growth is linear in the
    length; the fixed part (parameter gradients, kernel scratch) shows at the first."""
    lines = ["| model | variant | " + " | ".join(f"{n} tok" for n in _lengths(cases)) + " |"]
    lines.append("|" + "---|" * (lines[0].count("|") - 1))
    for model in sorted({m for m, _ in cases}):
        for v in VARIANTS:
            cells, prev = [], None
            for n in _lengths(cases):
                st = cases.get((model, n), {}).get(v)
                if not _ok(st):
                    cells.append("-")
                    continue
                ex, tok = num(st["step"], "extra_mem_mb"), num(st["step"], "tokens")
                worst = max(((num(r, "extra_mem_mb") or 0), s) for s, r in st.items()
                            if s != "step")  # fmt: skip
                cell = f"{ex:,.0f} MiB ({worst[1]})"
                if prev is not None and tok > prev[1]:
                    cell += f", {(ex - prev[0]) * 1024 / (tok - prev[1]):+,.1f} KiB/token"
                cells.append(cell)
                prev = (ex, tok)
            if any(c != "-" for c in cells):
                lines.append(f"| {model} | {v} | " + " | ".join(cells) + " |")
    return lines


def _lengths(cases: dict) -> list[int]:
    return sorted({n for _, n in cases})


def markdown(rows: list[dict], runs: list[dict]) -> str:
    TIME["key"] = time_key(rows)
    what = "process CPU time" if TIME["key"] == "cpu_ms_p50" else "wall time"
    cases = collect(rows)
    first = rows[0] if rows else {}
    lines = [
        "# One method step at long responses: MRTPO against GDPO (`python -m bench.method_step`)",
        "",
        f"Device: {first.get('device', '?')}; torch {first.get('torch', '?')}; commit "
        f"{first.get('commit', '?')}.",
        "",
        "## Runs",
        "",
        "| command | started (UTC) | `uptime` load at start | at end |",
        "|---|---|---|---|",
    ]
    for r in runs:
        lines.append(f"| `{r['command']}` | {r['started']} | {r['load_start']} | "
                     f"{r['load_end']} |")  # fmt: skip
    lines += ["", f"## Headline ({what})", "", *headline(cases), "",
              f"## Stages (ms of {what}, medians)", ""]  # fmt: skip
    lines += table(cases)
    lines += [
        "",
        "Stages: `info_forward` the with-information forward without gradient and the old "
        "log-probs (GDPO's only forward before its update); `replay` the forwards without each "
        "reward's spans; `js` the fused JS one-vs-many; `advantages` the token advantages "
        "(GDPO: its per-response advantages); `policy_forward` the policy's forward with "
        "gradient; `loss_forward` the fused policy loss; `backward` its backward through the "
        "LM head and the decoder. Replay + JS share: of MRTPO's step. Peak extra: the "
        "largest stage peak less the memory held at the step's start (interpreter, model, "
        "batch); step / GDPO and extra / GDPO's: against GDPO's step of the same batch, "
        "measured in the same run, interleaved.",
        "",
        "## Peak memory beyond the step's start (the stage holding it; growth per added "
        "response token since the previous length)",
        "",
        *linearity(cases),
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    TIME["key"] = time_key(rows)
    what = "CPU time" if TIME["key"] == "cpu_ms_p50" else "wall time"
    cases = collect(rows)
    models = sorted({m for m, _ in cases})
    paths = []
    # time per stage, stacked, each length relative to GDPO's step
    fig, axes = plt.subplots(1, len(models), figsize=(6.5 * len(models) + 1.2, 4.6),
                             squeeze=False)  # fmt: skip
    colors = {s: f"C{i}" for i, s in enumerate(STAGES)}
    for ax, model in zip(axes[0], models):
        ns = [n for n in _lengths(cases) if (model, n) in cases]
        width = 0.8 / len(VARIANTS)
        for i, n in enumerate(ns):
            by = cases[(model, n)]
            g_ms = _ms(by["gdpo"], "step") if _ok(by.get("gdpo")) else None
            for j, v in enumerate(VARIANTS):
                st = by.get(v)
                if not _ok(st) or not g_ms:
                    continue
                x, bottom = i + (j - (len(VARIANTS) - 1) / 2) * width, 0.0
                for s in STAGES:
                    h = _ms(st, s) / g_ms
                    ax.bar(x, h, width * 0.95, bottom=bottom, color=colors[s],
                           label=s if (i, j) == (0, 0) else None)  # fmt: skip
                    bottom += h
                ax.text(x, bottom, {"mrtpo": "M", "mrtpo-half": "H", "gdpo": "G"}[v],
                        ha="center", va="bottom", fontsize=7)  # fmt: skip
        ticks = []
        for n in ns:
            gd = cases[(model, n)].get("gdpo")
            g = _ms(gd, "step") if _ok(gd) else None
            ticks.append(f"{n}" + (f"\nGDPO {g / 1e3:.3g} s" if g else ""))
        ax.set_xticks(range(len(ns)), ticks, fontsize=8)
        ax.set_xlabel("tokens per response")
        ax.set_ylabel(f"step {what} / GDPO's step at that length")
        ax.set_title(f"{model}: M = MRTPO, H = half the pairs skipped, G = GDPO", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles[::-1], labels[::-1], fontsize=8, loc="center right")
    fig.tight_layout(rect=(0, 0, 0.86, 1))
    path = out / "method_step_time.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    # peak memory beyond the step's start against the response tokens
    fig, ax = plt.subplots(figsize=(7, 4.6))
    styles = {"mrtpo": "-", "mrtpo-half": ":", "gdpo": "--"}
    for mi, model in enumerate(models):
        for v in VARIANTS:
            pts = [(num(st["step"], "tokens"), num(st["step"], "extra_mem_mb"))
                   for (m, n), by in sorted(cases.items()) if m == model
                   for st in [by.get(v)] if _ok(st)]  # fmt: skip
            pts = [(t, e) for t, e in pts if t and e]
            if not pts:
                continue
            ax.plot(*zip(*pts), styles[v], marker="o", color=f"C{mi}",
                    label=f"{model}: {LABEL[v]}")  # fmt: skip
            if v == "gdpo":  # a slope-1 guide through the longest point
                t1, e1 = pts[-1]
                ts = [t for t, _ in pts]
                ax.plot(ts, [e1 * t / t1 for t in ts], color="0.6", lw=0.8, alpha=0.7)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("response tokens in the step")
    ax.set_ylabel("peak memory beyond the step's start, MiB")
    ax.set_title("Peak memory of one step (grey: proportional to the tokens, through GDPO's "
                 "longest point)",
                 fontsize=9)  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "method_step_memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    paths.append(path)
    return paths


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.method_step_report", description=__doc__)
    ap.add_argument("--dir", required=True, help="the --out folder of python -m bench.method_step")
    ap.add_argument("--no-plots", action="store_true", help="the Markdown only")
    args = ap.parse_args(argv)
    d = Path(args.dir)
    if not (d / "method_step.csv").is_file():
        print(f"python -m bench.method_step_report: --dir {d} has no method_step.csv",
              file=sys.stderr)  # fmt: skip
        return 2
    rows = read_rows(str(d / "method_step.csv"))
    runs = []
    if (d / "runs.jsonl").is_file():
        runs = [json.loads(x) for x in (d / "runs.jsonl").read_text().splitlines() if x.strip()]
    (d / "method_step.md").write_text(markdown(rows, runs))
    print(d / "method_step.md")
    if not args.no_plots:
        for p in plot(rows, d):
            print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
