"""Report outputs: of a training run (mrtpo/training/run_report.py), per-reward curves (PNG,
matplotlib Agg) and an HTML page of sampled responses with each token shaded by each reward's
allocation weight; of a comparison (`mrtpo compare`, mrtpo/training/compare_report.py), its Markdown
table with the claim's verdict and its plot. Both modules' public names are importable from
here."""

from __future__ import annotations

from .compare_report import (
    ALGO_COLORS,
    algo_colors,
    claim_verdict,
    fmt,
    plot_compare,
    write_markdown,
)
from .run_report import (
    NOT_REPLAYED,
    curves_figure,
    pair_status,
    plot_curves,
    pyplot,
    write_tokens_html,
)

__all__ = [
    "ALGO_COLORS",
    "NOT_REPLAYED",
    "algo_colors",
    "claim_verdict",
    "curves_figure",
    "fmt",
    "pair_status",
    "plot_compare",
    "plot_curves",
    "pyplot",
    "write_markdown",
    "write_tokens_html",
]
