"""tokens.html labels the (response, reward) pairs the replay skipped, and says why; every
axes of curves.png has a legend naming each of its lines."""

from __future__ import annotations

import html
import re

import torch
from test_trainer import mixed_task, tiny_config

from mrtpo.training.report import (
    NOT_REPLAYED,
    curves_figure,
    pair_status,
    pyplot,
    write_tokens_html,
)
from mrtpo.training.trainer import Trainer

NAMES = ["include", "ending", "short"]
SKIP_LABEL = "not replayed"


def test_pair_status_names_why_a_pair_was_not_replayed():
    # two groups of three; rewards: include varies in group 0 only, ending varies in both
    # with response 4 at its group's mean, short names no span
    rewards = torch.tensor(
        [[1, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 0], [0, 0.5, 0], [0, 1, 0]], dtype=torch.float32
    )
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    has_info = torch.tensor([[True, True, False]] * 6)
    replayed = has_info.clone()
    replayed[3:, 0] = False  # include did not vary in group 1
    replayed[4, 1] = False  # response 4 sits at its group's ending mean
    status = pair_status(rewards, groups, has_info, replayed)
    assert status[0] == ["replayed", "replayed", "no_spans"]
    assert status[3] == ["same_score", "replayed", "no_spans"]
    assert status[4] == ["same_score", "at_mean", "no_spans"]
    assert pair_status(rewards, groups, has_info, None)[0] == ["no_replay"] * 3


def _sample(status, algo_rel=True):
    tokens = ["The", " sea", " is", " blue"]
    return {
        "step": 3,
        "prompt": "Write about the sea. Include the word blue.",
        "tokens": tokens,
        "scores": [1.0, 0.0, 1.0],
        "reasons": [None, "wrong ending", None],
        "spans": [[[21, 43]], [[0, 20]], []],
        "allocation": [[0.5, 0.5, 1.0, 2.0], [1.0] * 4, [1.0] * 4],
        "relevance": [[0.1, 0.1, 0.2, 0.4], [0.0] * 4, [0.0] * 4] if algo_rel else None,
        "replay": status,
    }


def _rows(page):
    return re.findall(r"<div class='row[^']*'>.*?</div>", page, flags=re.S)


def test_tokens_html_labels_skipped_pairs_only(tmp_path):
    status = ["replayed", "same_score", "no_spans"]
    page = write_tokens_html(
        [_sample(status)], NAMES, tmp_path / "tokens.html", algo="mrtpo"
    ).read_text()
    rows = _rows(page)
    assert len(rows) == 3
    replayed, same, nospan = rows
    assert SKIP_LABEL not in replayed and "unreplayed" not in replayed
    assert "background:rgba" in replayed  # shaded by its weight
    assert SKIP_LABEL in same and "did not vary" in same and "A_k" in same
    assert html.escape(NOT_REPLAYED["same_score"][0]) in same
    assert "background:rgba" not in same  # not shaded as if measured
    assert html.escape(NOT_REPLAYED["no_spans"][0]) in nospan
    # the page says what the label means
    assert "not a measurement" in page


def test_tokens_html_of_older_samples_without_status(tmp_path):
    s = _sample(None)
    del s["replay"]
    page = write_tokens_html([s], NAMES, tmp_path / "t.html", algo="gdpo").read_text()
    assert all(SKIP_LABEL not in row for row in _rows(page))


def test_a_training_run_labels_exactly_its_skipped_pairs(tmp_path):
    trainer = Trainer(tiny_config(tmp_path, html_samples=6), task=mixed_task())
    res = trainer.run(progress=False)
    rows = _rows(res.html_path.read_text())
    names = [v.name for v in mixed_task().verifiers]
    assert len(rows) == len(trainer.samples) * len(names)
    statuses = [st for s in trainer.samples for st in s["replay"]]
    assert "replayed" in statuses and "no_spans" in statuses  # "short" names no span
    for row, st in zip(rows, statuses):
        if st == "replayed":
            assert SKIP_LABEL not in row
        else:
            assert html.escape(NOT_REPLAYED[st][0]) in row


def test_curves_figure_every_axes_has_a_legend_of_its_lines():
    metrics = []
    for step in range(1, 5):
        row = {"step": step, "all_pass": 0.1 * step, "loss": 0.01 * step}
        row.update({f"pass/{n}": 0.2 for n in NAMES})
        row.update({f"relevance/{n}": 0.1 for n in NAMES})
        row.update({"credit_precision": 0.3, "uniform_share": 0.1})
        metrics.append(row)
    for rows in (metrics, [{k: v for k, v in m.items() if k != "credit_precision"}
                           for m in metrics]):  # fmt: skip
        fig = curves_figure(rows, NAMES)
        try:
            assert len(fig.axes) >= 3
            for ax in fig.axes:
                lines = [ln.get_label() for ln in ax.get_lines()]
                assert lines, ax.get_title()
                legend = ax.get_legend()
                assert legend is not None, f"no legend on {ax.get_title() or ax.get_ylabel()}"
                assert {t.get_text() for t in legend.get_texts()} == set(lines)
            labels = {ln.get_label() for ax in fig.axes for ln in ax.get_lines()}
            assert "policy loss" in labels and set(NAMES) <= labels
        finally:
            pyplot().close(fig)
