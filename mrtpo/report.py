"""Report outputs: of a training run, per-reward curves (PNG, matplotlib Agg) and an HTML page
of sampled responses with each token shaded by each reward's allocation weight; of a
comparison (`mrtpo compare`), its Markdown table with the claim's verdict and its plot."""

from __future__ import annotations

import html
import json
import statistics
from pathlib import Path

from .stats import (
    CLAIM_RATIO,
    MIN_SEEDS,
    compare_to_gdpo,
    mean_std,
    moving_average,
    steps_or_budget,
)


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_curves(metrics: list[dict], reward_names, path, *, title: str = "") -> Path:
    """Three panels over steps: per-reward pass rate (and all-pass), per-reward mean
    relevance, and the loss. Writes ``path`` (PNG) and returns it."""
    plt = pyplot()
    path = Path(path)
    fig = curves_figure(metrics, reward_names, title=title)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def curves_figure(metrics: list[dict], reward_names, *, title: str = ""):
    """The figure of ``plot_curves``, not yet saved: every axes has a legend naming each of
    its lines."""
    plt = pyplot()
    steps = [m["step"] for m in metrics]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for name in reward_names:
        ax.plot(steps, [m.get(f"pass/{name}") for m in metrics], label=name, lw=1.2)
    ax.plot(steps, [m.get("all_pass") for m in metrics], color="k", lw=2.2, label="all pass")
    ax.set(xlabel="step", ylabel="pass rate", title="pass rate per reward", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7, ncol=2)
    ax = axes[1]
    for name in reward_names:
        ys = [m.get(f"relevance/{name}") for m in metrics]
        ys = [float("nan") if y is None else y for y in ys]
        ax.plot(steps, ys, label=name, lw=1.2)
    ax.set(xlabel="step", ylabel="mean JS distance", title="mean relevance per reward")
    ax.legend(fontsize=7, ncol=2)
    ax = axes[2]
    ax.plot(steps, [m.get("loss") for m in metrics], color="tab:red", label="policy loss")
    ax.legend(fontsize=7, loc="upper left")
    prec = [m.get("credit_precision") for m in metrics]
    if any(p is not None for p in prec):
        ax2 = ax.twinx()
        ax2.plot(
            steps,
            [float("nan") if p is None else p for p in prec],
            color="tab:green",
            label="credit precision",
        )
        uni = [m.get("uniform_share") for m in metrics]
        ax2.plot(
            steps,
            [float("nan") if u is None else u for u in uni],
            color="tab:green",
            ls="--",
            label="uniform share",
        )
        ax2.set_ylabel("share of allocation mass on relevant tokens")
        ax2.legend(fontsize=7, loc="upper right")
    ax.set(xlabel="step", ylabel="policy loss", title="loss and credit precision")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig


def _shade(value: float, vmax: float) -> str:
    x = 0.0 if vmax <= 0 else max(0.0, min(1.0, value / vmax))
    return f"rgba(220, 60, 30, {0.85 * x:.3f})"


def _token_html(piece: str) -> str:
    text = html.escape(piece).replace("\n", "\u21b5<br>")
    return text if text else "&#8709;"  # the end-of-turn token shows as an empty-set sign


# Why a (response, reward) pair of tokens.html was not replayed: its short label and the
# sentence shown beside it. Such a pair's weight (1.00) and distance (0) are placeholders.
NOT_REPLAYED = {
    "same_score": (
        "not replayed: the group's reward did not vary, so A_k = 0",
        "every response of this group scored the same on this reward, so its GDPO advantage "
        "A_k is 0 and the pair was skipped (it moves no token); weight 1.00 and distance 0 "
        "are not a measurement",
    ),
    "at_mean": (
        "not replayed: the response scored its group's mean, so A_k = 0",
        "this response scored its group's mean on this reward, so its GDPO advantage A_k is "
        "0 and the pair was skipped (it moves no token); weight 1.00 and distance 0 are not "
        "a measurement",
    ),
    "no_spans": (
        "not replayed: the reward names no span of this prompt",
        "the verifier named no prompt span for this prompt, so there is nothing to remove; "
        "its advantage is spread uniformly over the tokens, as in GDPO; weight 1.00 and "
        "distance 0 are not a measurement",
    ),
    "no_replay": (
        "not replayed: this run ran no replay",
        "the run ran no contrastive replay (--no-baseline-replay): the weights are uniform "
        "and no distance was measured",
    ),
}


def pair_status(rewards, group_ids, has_info, replayed) -> list[list[str]]:
    """Per response and reward: "replayed", or why the pair was not (a key of
    ``NOT_REPLAYED``). ``rewards`` (n, K) scores, ``group_ids`` (n,), ``has_info`` (n, K) bool
    (the reward names spans of that prompt), ``replayed`` (n, K) bool: the pairs the
    contrastive replay ran, or None where the step ran no replay."""
    import torch

    rewards = torch.as_tensor(rewards, dtype=torch.float64)
    group_ids = torch.as_tensor(group_ids).reshape(-1)
    n, k = rewards.shape
    out = []
    for i in range(n):
        group = rewards[group_ids == group_ids[i]]
        row = []
        for j in range(k):
            if replayed is None:
                row.append("no_replay")
            elif bool(replayed[i, j]):
                row.append("replayed")
            elif not bool(has_info[i, j]):
                row.append("no_spans")
            elif bool((group[:, j] == group[0, j]).all()):
                row.append("same_score")
            else:
                row.append("at_mean")
        out.append(row)
    return out


def write_tokens_html(samples: list[dict], reward_names, path, *, algo: str, title: str = ""):
    """One block per sampled response: the prompt, the scores, and one row per reward with
    each response token shaded by that reward's allocation weight w_k (darker = more of the
    reward's advantage). Under grpo/gdpo the applied weights are uniform, so the rows shade
    by the relevance-derived weight d_k / mean d_k that MRTPO would have used. A pair that
    was not replayed (a sample's ``replay`` entry other than "replayed", see
    ``pair_status``) is labelled with the reason and left unshaded: its weight 1.00 and
    distance 0 are placeholders, not measurements."""
    path = Path(path)
    out = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{html.escape(title or 'tokens')}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        ".tok{font-family:monospace;white-space:pre;padding:1px 0;border-right:1px solid #eee}"
        ".row{margin:2px 0;line-height:1.9}.name{display:inline-block;width:200px;"
        "font-size:12px;color:#333}.prompt{background:#f6f6f6;padding:6px;white-space:pre-wrap;"
        "font-size:12px}.span{background:#ffe08a}.fail{color:#b00}.pass{color:#070}"
        ".skip{display:block;font-size:11px;color:#555;font-style:italic;margin-left:200px}"
        ".row.unreplayed .tok{background:repeating-linear-gradient(45deg,#fff,#fff 3px,"
        "#eee 3px,#eee 6px)}</style>",
        f"<h2>{html.escape(title)}</h2>",
        "<p>Each row is one reward; each response token is shaded by that reward's "
        "allocation weight (hover for the weight and the JS relevance). Highlighted prompt "
        "text: the spans the verifiers checked. A row marked <i>not replayed</i> (hatched) "
        "is a pair the contrastive replay skipped, with the reason beside it: mostly a "
        "group whose reward did not vary, so its GDPO advantage A_k is 0 and no token can "
        "move; its weight 1.00 and distance 0 are not a measurement.</p>",
    ]
    for s_i, s in enumerate(samples):
        alloc, rel = s["allocation"], s.get("relevance")
        use_rel = algo != "mrtpo" and rel is not None
        out.append(f"<h3>sample {s_i + 1} (step {s['step']})</h3>")
        spans = sorted({tuple(sp) for row in s.get("spans", []) for sp in row})
        out.append(f"<div class='prompt'>{_highlight(s['prompt'], spans)}</div>")
        status = s.get("replay") or ["replayed"] * len(reward_names)  # older samples: unknown
        for j, name in enumerate(reward_names):
            w = alloc[j]
            if use_rel:
                mean = sum(rel[j]) / max(len(rel[j]), 1)
                w = [d / mean if mean > 1e-8 else 1.0 for d in rel[j]]
            vmax = max(w) if w else 1.0
            score = s["scores"][j]
            cls = "pass" if score >= 1.0 - 1e-6 else "fail"
            reason = s.get("reasons", [None] * len(reward_names))[j]
            label = f"<span class='{cls}'>{score:.2f}</span> {html.escape(name)}"
            tip = f" title='{html.escape(reason, quote=True)}'" if reason else ""
            skip = NOT_REPLAYED.get(status[j])
            toks = []
            for t, piece in enumerate(s["tokens"]):
                if skip:
                    toks.append(
                        f"<span class='tok' title='not replayed: w={w[t]:.2f} and d=0 are not "
                        f"measured'>{_token_html(piece)}</span>"
                    )
                    continue
                d = rel[j][t] if rel is not None else float("nan")
                toks.append(
                    f"<span class='tok' style='background:{_shade(w[t], vmax)}' "
                    f"title='w={w[t]:.2f} d={d:.3f}'>{_token_html(piece)}</span>"
                )
            note = ""
            if skip:
                note = (
                    f"<span class='skip' title='{html.escape(skip[1], quote=True)}'>"
                    f"{html.escape(skip[0])}; weight and distance not measured</span>"
                )
            out.append(
                f"<div class='row{' unreplayed' if skip else ''}'><span class='name'{tip}>"
                f"{label}</span>{''.join(toks)}{note}</div>"
            )
        if use_rel:
            out.append(
                f"<p><i>{html.escape(algo)} applies uniform weights; shading shows "
                "d_k / mean d_k.</i></p>"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(out))
    return path


def _highlight(prompt: str, spans) -> str:
    marks = [False] * len(prompt)
    for s, e in spans:
        for c in range(max(0, s), min(len(prompt), e)):
            marks[c] = True
    out, c = [], 0
    while c < len(prompt):
        e = c
        while e < len(prompt) and marks[e] == marks[c]:
            e += 1
        piece = html.escape(prompt[c:e])
        out.append(f"<span class='span'>{piece}</span>" if marks[c] else piece)
        c = e
    return "".join(out)


# --------------------------------------------------------------------------------------------
# The comparison's table and plot


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
    target (steps to target 0: left out of the ratio, `mrtpo.stats._measures`)."""
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
    curve, then equal wall-clock (`mrtpo.stats.compare_to_gdpo`)."""
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
