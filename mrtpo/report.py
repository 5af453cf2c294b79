"""Report outputs of a training run: per-reward curves (PNG, matplotlib Agg) and an HTML page
of sampled responses with each token shaded by each reward's allocation weight."""

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
    ax = axes[2]
    ax.plot(steps, [m.get("loss") for m in metrics], color="tab:red", label="loss")
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shade(value: float, vmax: float) -> str:
    x = 0.0 if vmax <= 0 else max(0.0, min(1.0, value / vmax))
    return f"rgba(220, 60, 30, {0.85 * x:.3f})"


def _token_html(piece: str) -> str:
    text = html.escape(piece).replace("\n", "\u21b5<br>")
    return text if text else "&#8709;"  # the end-of-turn token shows as an empty-set sign


def write_tokens_html(samples: list[dict], reward_names, path, *, algo: str, title: str = ""):
    """One block per sampled response: the prompt, the scores, and one row per reward with
    each response token shaded by that reward's allocation weight w_k (darker = more of the
    reward's advantage). Under grpo/gdpo the applied weights are uniform, so the rows shade
    by the relevance-derived weight d_k / mean d_k that MRTPO would have used."""
    path = Path(path)
    out = [
        "<!doctype html><meta charset='utf-8'>",
        f"<title>{html.escape(title or 'tokens')}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}"
        ".tok{font-family:monospace;white-space:pre;padding:1px 0;border-right:1px solid #eee}"
        ".row{margin:2px 0;line-height:1.9}.name{display:inline-block;width:200px;"
        "font-size:12px;color:#333}.prompt{background:#f6f6f6;padding:6px;white-space:pre-wrap;"
        "font-size:12px}.span{background:#ffe08a}.fail{color:#b00}.pass{color:#070}</style>",
        f"<h2>{html.escape(title)}</h2>",
        "<p>Each row is one reward; each response token is shaded by that reward's "
        "allocation weight (hover for the weight and the JS relevance). Highlighted prompt "
        "text: the spans the verifiers checked.</p>",
    ]
    for s_i, s in enumerate(samples):
        alloc, rel = s["allocation"], s.get("relevance")
        use_rel = algo != "mrtpo" and rel is not None
        out.append(f"<h3>sample {s_i + 1} (step {s['step']})</h3>")
        spans = sorted({tuple(sp) for row in s.get("spans", []) for sp in row})
        out.append(f"<div class='prompt'>{_highlight(s['prompt'], spans)}</div>")
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
            toks = []
            for t, piece in enumerate(s["tokens"]):
                d = rel[j][t] if rel is not None else float("nan")
                toks.append(
                    f"<span class='tok' style='background:{_shade(w[t], vmax)}' "
                    f"title='w={w[t]:.2f} d={d:.3f}'>{_token_html(piece)}</span>"
                )
            out.append(
                f"<div class='row'><span class='name'{tip}>{label}</span>{''.join(toks)}</div>"
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
