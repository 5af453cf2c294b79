"""A training run's report outputs: per-reward curves (PNG, matplotlib Agg) and an HTML page
of sampled responses with each token shaded by each reward's allocation weight (and why a
pair shows no replay, `pair_status`)."""

from __future__ import annotations

import html
from pathlib import Path


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
