"""A comparison's report outputs (`mrtpo compare`): its Markdown table with the claim's
verdict (`write_markdown`, `claim_verdict`) and its plot (`plot_compare`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .run_report import pyplot
from .stats import (
    CLAIM_RATIO,
    MIN_SEEDS,
    compare_to_gdpo,
    mean_std,
    moving_average,
    steps_or_budget,
)

ALGO_COLORS = {"grpo": "tab:blue", "gdpo": "tab:orange", "mrtpo": "tab:green"}


# the other variants (mrtpo:specific, ...) in order, none repeating a colour above
_MORE_COLORS = (
    "tab:red",
    "tab:purple",
    "tab:brown",
    "tab:pink",
    "tab:olive",
    "tab:cyan",
    "tab:gray",
    "black",
    "gold",
    "navy",
)


def algo_colors(algos) -> dict[str, str]:
    """A distinct colour for each algorithm (the three base ones keep theirs)."""
    out, spare = {}, iter(_MORE_COLORS)
    for a in algos:
        out[a] = ALGO_COLORS.get(a) or next(spare, None)
    return out


def fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _ci(c, key, fmt_):
    lo, hi = c[key]
    return f"95% CI {fmt_(lo)} to {fmt_(hi)}"


def _verdict_text(c) -> str:
    if c["verdict"] is None and c["n"] >= MIN_SEEDS:  # starts that already met the target
        return (
            f"**no verdict**: {c['steps_n']} of {c['n']} paired seeds left to measure the "
            f"steps to target, a verdict needs at least {MIN_SEEDS}"
        )
    if c["verdict"] is None:
        return (
            f"**no verdict**: {c['n']} paired seed(s), a verdict needs at least {MIN_SEEDS} "
            "(with fewer, no interval can exclude chance)"
        )
    return (
        f"claim (steps ratio <= {CLAIM_RATIO} with its interval below 1, AUC difference's "
        f"interval above 0) **{c['verdict']}**"
    )


def _steps_text(m, r2) -> str:
    """The steps ratio of a paired comparison, saying which seeds' start already met the
    target (steps to target 0: left out of the ratio, `mrtpo.training.stats._measures`)."""
    met = ", ".join(str(s) for s in m.get("start_met") or ())
    if m["ratio"] is None:
        return (
            "steps to target: not compared, the start already meets the target on every "
            f"seed ({met}: held-out steps to target 0)"
        )
    text = f"steps to target **{m['ratio']:.2f}x** ({_ci(m, 'ci', r2)}, sign-flip p = {m['p']:.3f})"
    if met:
        text += (
            f" over {m['steps_n']} paired seeds (seed(s) {met} left out: the start already "
            "meets the target)"
        )
    return text


def claim_verdict(summary, steps: int) -> list[str]:
    """The claim's lines: per MRTPO variant, the paired comparison with GDPO on the held-out
    curve first (the training curve where the runs have no evaluations), then the training
    curve, then equal wall-clock (`mrtpo.training.stats.compare_to_gdpo`)."""
    lines = []
    comp = compare_to_gdpo(summary, steps)
    r2, d3 = (lambda x: f"{x:.2f}"), (lambda x: f"{x:+.3f}")
    for algo, c in comp.items():
        parts = [(c["curve"], c)]
        if c["curve"] == "held-out":
            parts.append(("training", c["training"]))
        for name, m in parts:
            lines.append(
                f"- {algo} / GDPO on the {name} curve ({m['n']} paired seeds): "
                f"{_steps_text(m, r2)}; AUC "
                f"difference **{m['auc_diff']:+.3f}** ({_ci(m, 'auc_ci', d3)}, p = "
                f"{m['auc_p']:.3f})"
                + (
                    " (a run that never reached the target counts the step budget)"
                    if m["censored"]
                    else ""
                )
                + (f": {_verdict_text(c)}" if m is c else "")
            )
        w = c.get("wallclock")
        if w is not None:
            lines.append(
                f"- {algo} / GDPO at equal wall-clock (held-out curve against training "
                f"seconds, up to the shorter run's time): AUC difference {w['auc_diff']:+.3f} "
                f"({_ci(w, 'auc_ci', d3)}, p = {w['auc_p']:.3f}); seconds to target "
                + (
                    "not compared (the start already meets the target)"
                    if w["time_ratio"] is None
                    else f"{w['time_ratio']:.2f}x"
                    + ("" if w["time_ci"] is None else f" ({_ci(w, 'time_ci', r2)})")
                )
                + (
                    ""
                    if summary["settings"].get("baseline_replay") is False
                    else " (GDPO's runs replayed for their relevance metrics: their seconds "
                    "include a replay that GDPO does not need; --no-baseline-replay removes it)"
                )
            )
    for algo, rs in summary["runs"].items():
        if not algo.startswith("mrtpo"):
            continue
        p, _ = mean_std([r["credit_precision"] for r in rs])
        u, _ = mean_std([r["uniform_share"] for r in rs])
        if p is not None and u:
            lines.append(
                f"- {algo} credit precision {p:.2f} vs uniform share {u:.2f} ({p / u:.1f}x uniform)"
            )
    return lines


def _start(args) -> str:
    if args.train.model is not None:
        return f"the model in `{args.train.model}`"
    if args.init_seed is not None:
        return (
            f"the same warm-started tiny model ({args.train.tiny.for_task(args.task).warm_steps} "
            "supervised steps, "
            + (
                f"references' swappable constraints wrong with probability "
                f"{args.train.tiny.warm_noise:g} each, "
                if args.train.tiny.warm_noise
                else ""
            )
            + f"task data and init of seed {args.init_seed}); the seed varies sampling and "
            "data order"
        )
    return "the warm-started tiny model of that seed (all algorithms of a seed share it)"


def write_markdown(summary, path: Path, args) -> Path:
    runs, names = summary["runs"], summary["reward_names"] or []
    st = summary["settings"]
    all_runs = [r for rs in runs.values() for r in rs]
    start = {n: mean_std([r["start_pass"][n] for r in all_runs])[0] for n in names}
    start_all = mean_std([r["start_all_pass"] for r in all_runs])[0]
    lines = [
        f"# MRTPO vs GDPO on the built-in {args.task} task",
        "",
        f"Command: `{summary['command']}` -- {summary['wall_s'] / 60:.1f} min wall "
        f"({summary['train_s'] / 60:.1f} min of training summed over runs, "
        f"{summary['jobs']} job(s), CPU). Rewards: {', '.join(names)}. "
        f"Each (algorithm, seed) trains {args.steps} steps from {_start(args)}; "
        f"{st.get('prompts_per_step')} prompts x "
        f"{st.get('group_size')} responses per step. Target: all-pass rate "
        f">= {args.target} (moving average over {args.window} training steps).",
        "",
        "Starting pass rates (step 1, mean over all runs): "
        + ", ".join(f"{n} {fmt(start[n])}" for n in names)
        + f"; all pass {fmt(start_all)}.",
        "",
        "## The claim",
        "",
        *claim_verdict(summary, args.steps),
        "",
        *_heldout_table(runs, names, args),
        "## Results on the training curve (mean +- std over seeds)",
        "",
        "| algo | steps to target (per seed) | AUC | final all-pass | "
        + " | ".join(f"final {n}" for n in names)
        + " | credit precision | uniform share | relevance precision | s/step | "
        "rollout / replay / update s |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|",
    ]
    for algo, rs in runs.items():
        per_seed = ", ".join(
            str(r["steps_to_target"]) if r["steps_to_target"] else f">{args.steps}" for r in rs
        )
        mean_steps = statistics.fmean(steps_or_budget(rs, args.steps))
        cells = [algo, f"{mean_steps:.1f} ({per_seed})"]
        for key in ("auc", "final_all_pass"):
            m, s = mean_std([r[key] for r in rs])
            cells.append(f"{fmt(m, 3)} +- {fmt(s, 3)}")
        for n in names:
            m, s = mean_std([r["final_pass"][n] for r in rs])
            cells.append(f"{fmt(m)} +- {fmt(s)}")
        for key in ("credit_precision", "uniform_share", "relevance_precision"):
            cells.append(fmt(mean_std([r[key] for r in rs])[0]))
        cells.append(fmt(mean_std([r.get("step_time") for r in rs])[0]))
        phases = ("rollout_time", "replay_time", "update_time")
        cells.append(" / ".join(fmt(mean_std([r.get(k) for r in rs])[0]) for k in phases))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Credit precision per reward (allocation mass on the response tokens the reward "
        "concerns / uniform share):",
        "",
        "| algo | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for algo, rs in runs.items():
        cells = [algo]
        for n in names:
            p, _ = mean_std([r["precision"][n] for r in rs])
            u, _ = mean_std([r["uniform"][n] for r in rs])
            cells.append(f"{fmt(p)} / {fmt(u)}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Relevance diagnostics per reward, where the run computed relevance: share of "
        "responses whose top-relevance token is one the verifier names / chance (the mean "
        "share of named tokens), and the rank AUC of the relevance, named vs other tokens "
        "(chance 0.5):",
        "",
        "| algo | " + " | ".join(f"{n} top-hit / chance | {n} AUC" for n in names) + " |",
        "|---|" + "---|---|" * len(names),
    ]
    for algo, rs in runs.items():
        cells = [algo]
        for n in names:
            hit = mean_std([(r.get("top_hit") or {}).get(n) for r in rs])[0]
            ch = mean_std([(r.get("top_hit_chance") or {}).get(n) for r in rs])[0]
            auc_ = mean_std([(r.get("rank_auc") or {}).get(n) for r in rs])[0]
            cells += [f"{fmt(hit)} / {fmt(ch)}", fmt(auc_)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Definitions: held-out all-pass = share of the held-out answers (the first "
        "`eval_prompts` prompts of the task's eval split, `eval_samples` answers each, a fixed "
        "sampling seed) passing every reward, evaluated before the first step, every "
        "`eval_every` steps and after the last; held-out steps to target = first evaluated "
        "step reaching the target; held-out AUC = area under the held-out curve over steps "
        "(trapezoids) / steps; intervals = paired percentile bootstrap (4000 draws) resampling "
        "the seeds both arms ran, p = exact two-sided sign-flip p-value of the per-seed "
        "differences; equal wall-clock = the held-out curve against training seconds "
        "(rollout + replay + update), compared up to the shorter run's time. Training curve: "
        "steps to target = first step where the trailing mean of the batch "
        "all-pass rate reaches the target (never reached: counted as the budget, shown as "
        "`>N`); AUC = mean batch all-pass rate over all steps; final = mean of "
        "the last window of steps; credit precision = share of a reward's allocation-weight "
        "mass on the response tokens it concerns (constraints: the verifier's "
        "`relevant_chars`; SQL: identifiers of the schema / gold tables and, for sql_match, "
        "literals; tools: the called name, the argument keys, the argument values; "
        "responses where those tokens are a proper non-empty subset), uniform share = the "
        "same for uniform weights, relevance precision = the same share of the JS-distance "
        "mass; s/step = rollout + replay + update seconds per step.",
        "",
        "![curves](compare.png)",
        "",
        "Settings: `" + json.dumps(st) + "`",
        "",
    ]
    path.write_text("\n".join(lines))
    return path


def _heldout_table(runs, names, args) -> list[str]:
    """The held-out curve's table (runs with evaluations only), or no lines."""
    if not all(r.get("heldout") for rs in runs.values() for r in rs):
        return []
    lines = [
        "## Results on held-out prompts (mean +- std over seeds)",
        "",
        "| algo | steps to target (per seed) | held-out AUC | start all-pass | final all-pass | "
        + " | ".join(f"final {n}" for n in names)
        + " | answers per evaluation |",
        "|---|---|---|---|---|" + "---|" * len(names) + "---|",
    ]
    for algo, rs in runs.items():
        hs = [r["heldout"] for r in rs]
        reached = [h["steps_to_target"] for h in hs]
        shown = {None: f">{args.steps}", 0: "0 (the start meets the target)"}
        per_seed = ", ".join(shown.get(x, str(x)) for x in reached)
        mean_steps = statistics.fmean(args.steps if x is None else x for x in reached)
        cells = [algo, f"{mean_steps:.1f} ({per_seed})"]
        for key in ("auc", "start_all_pass", "final_all_pass"):
            m, s = mean_std([h[key] for h in hs])
            cells.append(f"{fmt(m, 3)} +- {fmt(s, 3)}")
        for n in names:
            m, s = mean_std([h["final_pass"][n] for h in hs])
            cells.append(f"{fmt(m)} +- {fmt(s)}")
        cells.append(str(hs[0]["answers"]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def plot_compare(summary, path: Path, args) -> Path:
    plt = pyplot()
    runs, names = summary["runs"], summary["reward_names"] or []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    colors = algo_colors(runs)
    ax = axes[0]
    for algo, rs in runs.items():
        curves = [moving_average(r["curve"], args.window) for r in rs]
        n = min(len(c) for c in curves)
        steps = list(range(1, n + 1))
        mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        (line,) = ax.plot(steps, mean, label=algo, lw=2, color=colors[algo])
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
        hs = [r.get("heldout") for r in rs]
        if all(hs) and len({tuple(h["steps"]) for h in hs}) == 1:
            ys = [statistics.fmean(h["curve"][i] for h in hs) for i in range(len(hs[0]["steps"]))]
            ax.plot(
                hs[0]["steps"],
                ys,
                ls="--",
                marker="o",
                ms=3,
                color=colors[algo],
                label=f"{algo} held-out",
            )
    ax.axhline(args.target, color="k", ls=":", lw=1, label=f"target {args.target}")
    ax.set(
        xlabel="step",
        ylabel=f"all-pass rate ({args.window}-step mean)",
        title="learning curves (mean over seeds, band = min-max; dashed: held-out)",
        ylim=(0, 1),
    )
    ax.legend()
    ax = axes[1]
    width = 0.8 / (len(runs) + 1)
    xs = range(len(names))
    for a_i, (algo, rs) in enumerate(runs.items()):
        vals = [mean_std([r["precision"][n] for r in rs])[0] or 0 for n in names]
        ax.bar(
            [x + a_i * width for x in xs],
            vals,
            width,
            label=f"{algo} allocation",
            color=colors[algo],
        )
    uni = [mean_std([r["uniform"][n] for rs in runs.values() for r in rs])[0] or 0 for n in names]
    ax.bar([x + len(runs) * width for x in xs], uni, width, color="grey", label="uniform")
    ax.set_xticks([x + width * len(runs) / 2 for x in xs], names, fontsize=8)
    ax.set(ylabel="share of weight mass on relevant tokens", title="credit precision", ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
