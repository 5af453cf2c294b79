"""bench/replay_onpolicy.py on a tiny trainer under bf16 autocast: the on-policy replay is
timed in both autocast regions, replays the same pairs and gives the same relevance bit for
bit (sharing the update's region reuses its bf16 weight copies: the same values, one cast
fewer), and bad settings name the argument."""

from __future__ import annotations

import pytest
import torch
from test_trainer import mixed_task, tiny_config

from bench.replay_onpolicy import replay_times
from mrtpo.training.rollouts import generate_rollouts
from mrtpo.training.trainer import Trainer


def test_replay_onpolicy_times_both_regions_with_the_same_relevance(tmp_path):
    cfg = tiny_config(tmp_path / "run", algo="mrtpo", steps=1, group_size=4, micro_batch=64,
                      minibatches=1, autocast="bfloat16")  # fmt: skip
    tr = Trainer(cfg, task=mixed_task())
    examples = [tr.task.train[i] for i in tr.sampler.take(cfg.prompts_per_step)]
    with tr._amp():
        ro = generate_rollouts(tr.model, tr.prompter, tr.task, examples, cfg, tr.device)
    shared = replay_times(tr, cfg, ro, region="shared", repeats=2)
    separate = replay_times(tr, cfg, ro, region="separate", repeats=2)
    assert shared["pairs"] == separate["pairs"] > 0
    assert torch.equal(shared["relevance"], separate["relevance"])
    assert bool((shared["relevance"] > 0).any())
    for row in (shared, separate):
        assert 0 < row["min_s"] <= row["median_s"]
        # median_s is rounded to 4 decimals, s_per_pair (from the unrounded median) to 5
        tol = 5.1e-5 / row["pairs"] + 5.1e-6
        assert row["s_per_pair"] == pytest.approx(row["median_s"] / row["pairs"], abs=tol)
    with pytest.raises(ValueError, match="region"):
        replay_times(tr, cfg, ro, region="both", repeats=1)
    with pytest.raises(ValueError, match="repeats"):
        replay_times(tr, cfg, ro, region="shared", repeats=0)
