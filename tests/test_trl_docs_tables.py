"""docs/trl.md's table of MRTPOConfig's fields and its logged-metrics tables are generated from
code (tools/docs_pages.py), and the help of an option that ``mrtpo train`` shares is written
once (``mrtpo.training.method_options``); a field or a logged name missing from the tables
fails here (issue 44 item 4)."""

from __future__ import annotations

import sys
from dataclasses import fields
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import docs_pages  # noqa: E402
from test_integrations_trl_replay import (  # noqa: E402
    PROMPTS,
    WORDS,
    ends_bye,
    says_word,
    tiny_model,
    word_spans,  # noqa: E402
)

from mrtpo.integrations.trl_grpo import metrics  # noqa: E402
from mrtpo.integrations.trl_grpo.config import OPTIONS, TRL_OPTIONS  # noqa: E402
from mrtpo.integrations.trl_trainer import MRTPOConfig, MRTPOGRPOTrainer  # noqa: E402
from mrtpo.training.config import TrainConfig  # noqa: E402
from mrtpo.training.method_options import METHOD_OPTIONS  # noqa: E402
from mrtpo_kernels import ADVANTAGE_DEFAULTS  # noqa: E402

DOC = (ROOT / "docs" / "trl.md").read_text()


def test_every_mrtpo_field_is_described_once_and_in_the_generated_table():
    mrtpo_fields = [f for f in fields(MRTPOConfig) if f.name.startswith("mrtpo_")]
    assert [f.name for f in mrtpo_fields] == list(OPTIONS)
    table = docs_pages.section("trl-config")
    for f in mrtpo_fields:
        row = next(r for r in table.splitlines() if r.startswith(f"| `{f.name}` |"))
        short = f.name.removeprefix("mrtpo_")
        desc = METHOD_OPTIONS.get(short) or TRL_OPTIONS[short]
        assert desc["help"] in OPTIONS[f.name]["help"]
        assert f.metadata["help"] == f"MRTPO: {OPTIONS[f.name]['help']}."
        assert f.default == desc["default"]
        if short in METHOD_OPTIONS:  # the same option in `mrtpo train`: the same description
            train = next(g for g in fields(TrainConfig) if g.name == short)
            assert train.metadata["help"] == desc["help"] and train.default == desc["default"]
            assert f"`--{short.replace('_', '-')}`" in row
    assert set(OPTIONS) >= {"mrtpo_replay_all"}  # the field the hand table lacked
    assert (OPTIONS["mrtpo_alpha"]["default"], OPTIONS["mrtpo_gamma"]["default"]) == (
        ADVANTAGE_DEFAULTS.alpha,
        ADVANTAGE_DEFAULTS.gamma,
    )
    assert '| `mrtpo_relevance` | "js" | "js", "specific" |' in table
    assert "| `mrtpo_alpha` | 1.0 | [0, 1] |" in table


def test_trl_md_holds_the_generated_tables_not_hand_copies():
    assert DOC.count("<!-- generated: trl-config -->") == 1
    assert DOC.count("<!-- generated: trl-metrics -->") == 1
    filled = docs_pages.fill(DOC)
    assert "| `mrtpo_replay_all` |" in filled and "| `mrtpo_replay_all` |" not in DOC
    assert "| `mrtpo/replay_seconds` |" in filled and "mrtpo/replay_seconds` |" not in DOC


def test_every_name_a_training_run_logs_is_in_the_metrics_tables(tmp_path):
    """Two steps of a real trainer (two rewards naming spans, a third without, beta > 0,
    completions logged): each name in ``log_history`` matches a row of the generated tables,
    and every MRTPO row was logged."""
    torch.manual_seed(0)
    model, tok = tiny_model()

    def length(completions, **kw):
        return [min(len(c), 20) / 20.0 for c in completions]

    config = MRTPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.1, temperature=1.3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
        log_completions=True, mrtpo_replay_all=True,
    )  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, "topic": WORDS * 2})
    trainer = MRTPOGRPOTrainer(
        model=model, reward_funcs=[says_word, ends_bye, length], args=config, train_dataset=ds,
        processing_class=tok, reward_spans=[word_spans, None, None],
    )  # fmt: skip
    trainer.train()
    logged = {k for entry in trainer.state.log_history for k in entry if k != "step"}
    missing = sorted(k for k in logged if not metrics.documented(k))
    assert missing == [], f"logged but not in docs/trl.md's tables: {missing}"
    names = trainer.reward_func_names
    for row in metrics.OWN_METRICS:
        for pattern in row:
            want = {pattern.format(reward=r) for r in names} if "{reward}" in pattern else {pattern}
            assert want & logged, f"{pattern}: in the table but never logged"
    table = docs_pages.section("trl-metrics")
    for row in (*metrics.OWN_METRICS, *metrics.TRL_METRICS):
        for name in row:
            assert f"`{name.replace('{reward}', '<reward>')}`" in table
    for column in metrics.COMPLETION_COLUMNS:
        assert f"| `{column}` |" in table
    assert not metrics.documented("mrtpo/not_a_metric")
