"""No warning the user did not cause: MRTPOConfig and a tiny MRTPOGRPOTrainer's training
emit no FutureWarning about gradient checkpointing (TRL 1.16's default under transformers'
deprecated name, and TRL's calls of the deprecated model aliases around generation), while
checkpointing stays on as TRL's default has it and an explicit alias still warns."""

import warnings

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from mrtpo.integrations.trl_trainer import MRTPOConfig, MRTPOGRPOTrainer  # noqa: E402
from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer  # noqa: E402

PROMPTS = ["count the apples", "name a colour", "add two and three", "spell cat"]


def reward_length(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def _checkpointing_warnings(caught):
    return [
        str(w.message)
        for w in caught
        if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)
    ]


def test_tiny_trl_training_emits_no_checkpointing_future_warning(tmp_path):
    torch.manual_seed(0)
    tok = build_tokenizer(PROMPTS * 8)
    cfg = TinyConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, max_positions=128)  # fmt: skip
    model = build_tiny_model(tok, cfg, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # every warning, each time it is raised
        config = MRTPOConfig(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
            num_generations=4, max_completion_length=4, max_steps=2, report_to=[],
            save_strategy="no", logging_steps=1,
        )  # fmt: skip
        trainer = MRTPOGRPOTrainer(
            model=model, processing_class=tok, args=config, reward_funcs=[reward_length],
            train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * 2}),
        )  # fmt: skip
        trainer.train()
        assert _checkpointing_warnings(caught) == []
        # TRL's default is kept: checkpointing on, under both names
        assert config.gradient_checkpointing is True
        if hasattr(config, "activation_checkpointing"):
            assert config.activation_checkpointing is True
        # an alias the user passes is theirs: transformers' warning still shows
        explicit = MRTPOConfig(output_dir=str(tmp_path / "b"), gradient_checkpointing=False)
        assert explicit.gradient_checkpointing is False
        if hasattr(explicit, "activation_checkpointing"):
            assert explicit.activation_checkpointing is False
            assert _checkpointing_warnings(caught)
    assert trainer.state.global_step == 2
