"""What ``MRTPOGRPOTrainer`` logs, named and defined once: MRTPO's own metrics (the names the
trainer writes, ``{reward}`` standing for each reward function's name), TRL's metrics as this
trainer logs them, and the columns it adds to TRL's completions table. docs/trl.md's "Logged
metrics" tables are generated from these (tools/docs_pages.py), and a test trains and checks
that every name a step logs is in them (tests/test_trl_docs_tables.py).
"""

from __future__ import annotations

import re

__all__ = ["COMPLETION_COLUMNS", "OWN_METRICS", "TRL_METRICS", "documented"]

# MRTPO's own metric names, as the trainer writes them
GDPO_STD = "mrtpo/gdpo_std/{reward}"
FRAC_ZERO_STD = "mrtpo/frac_zero_std/{reward}"
FRAC_ZERO_STD_ALL = "mrtpo/frac_zero_std_all"
RELEVANCE = "mrtpo/relevance/{reward}"
REPLAY_PAIRS = "mrtpo/replay/pairs"
REPLAY_SKIPPED = "mrtpo/replay/skipped"
REPLAY_PAIRS_OF = "mrtpo/replay/pairs/{reward}"
REPLAY_SKIPPED_OF = "mrtpo/replay/skipped/{reward}"
REPLAY_SECONDS = "mrtpo/replay_seconds"

# Each row: the names it covers -> their definition.
OWN_METRICS: dict[tuple[str, ...], str] = {
    (GDPO_STD,): "mean over the step's groups of the unbiased std of that reward within the "
    "group (all processes; a missing reward counts 0): what its GDPO advantage divides by "
    '(with `scale_rewards` "group"; "batch" divides by the reward\'s batch std, "none" by '
    "nothing)",
    (FRAC_ZERO_STD,): "share of groups in which that reward does not vary (its advantage is 0 "
    "there)",
    (FRAC_ZERO_STD_ALL,): "share of groups in which no reward varies (the whole group's MRTPO "
    "advantage is 0)",
    (RELEVANCE,): "mean relevance d_k over the completion tokens of that reward's replayed "
    "pairs (completions whose prompt it names spans of, and whose GDPO advantage for it is "
    "not 0; every one with spans under `mrtpo_replay_all=True`), over all processes. Absent "
    "in a step where none of its pairs was replayed: it named no span "
    "(`mrtpo/replay/pairs/<reward>` and `mrtpo/replay/skipped/<reward>` both 0), or every "
    "pair it named was skipped (`skipped/<reward>` > 0; its relevance was not measured, as "
    "its advantage moved no token); `mrtpo_replay_all=True` measures every pair with spans, "
    "at the replay's full cost. Averaged by TRL over the steps of a logging window that "
    "have it",
    (REPLAY_PAIRS,): "(completion, reward) pairs replayed in the step, all processes",
    (REPLAY_SKIPPED,): "pairs with spans not replayed because the reward's GDPO advantage for "
    "that completion is exactly 0 (they move no token advantage; relevance 0); `pairs + "
    "skipped` = the pairs that named spans. 0 under `mrtpo_replay_all=True`",
    (REPLAY_PAIRS_OF, REPLAY_SKIPPED_OF): "the same for one reward (0 and 0 for a reward that "
    "named no span)",
    (REPLAY_SECONDS,): "wall time of the replay, averaged over the processes that replayed; "
    "absent when none did",
}

TRL_METRICS: dict[tuple[str, ...], str] = {
    ("loss",): "the training loss (averaged over the logging window)",
    ("grad_norm", "learning_rate", "epoch"): "the Trainer's",
    ("num_tokens",): "prompt and completion tokens seen so far, all processes",
    (
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
    ): "completion lengths in tokens, all processes",
    ("completions/clipped_ratio",): "share of completions cut at `max_completion_length` (no "
    "stop token)",
    (
        "completions/mean_terminated_length",
        "completions/min_terminated_length",
        "completions/max_terminated_length",
    ): "lengths of the completions that ended with a stop token",
    ("rewards/{reward}/mean", "rewards/{reward}/std"): "mean and std of that reward over the "
    "batch (all processes; missing values left out)",
    ("reward",): "mean over the batch of the weighted sum of rewards",
    ("reward_std",): "std over the batch of that weighted sum (TRL's aggregation)",
    ("frac_reward_zero_std",): "TRL's zero-std share under its aggregation: with "
    '"sum_then_normalize", the share of samples whose group\'s weighted reward sum does not '
    'vary; with "normalize_then_sum" (`MRTPOConfig`\'s default), 1 when the batch std of the '
    "summed group-normalized rewards is 0, else 0",
    ("entropy",): "mean entropy of the policy's next-token distribution over completion tokens",
    ("kl",): "(beta > 0) mean k3 KL to the reference over completion tokens (times the "
    "importance ratio with `use_bias_correction_kl`)",
    (
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
    ): "share of completion tokens clipped below (ratio < 1 - epsilon, negative advantage), "
    "above (ratio > 1 + epsilon_high, positive advantage), either",
    ("clip_ratio/low_min", "clip_ratio/high_max"): "min (max) over completions of the "
    "per-completion share clipped below (above)",
    ("aux_loss",): "(a MoE model with `output_router_logits`) the router load-balancing loss "
    "of the step's forwards, as TRL logs it; `router_aux_loss_coef` times it is added to the "
    "loss",
    ("step_time",): "seconds of the step",
    (
        "train_runtime",
        "train_samples_per_second",
        "train_steps_per_second",
        "total_flos",
        "train_loss",
    ): "the Trainer's summary, logged once at the end of `train()`",
}

# The columns MRTPOGRPOTrainer adds to TRL's completions table (log_completions=True)
COMPLETION_COLUMNS: dict[str, str] = {
    "mrtpo_advantage_mean": "mean over the completion's tokens of MRTPO's token advantages "
    "(the advantages the model trained with; NaN for a completion without a token)",
    "mrtpo_advantage_min": "their min over the completion's tokens",
    "mrtpo_advantage_max": "their max over the completion's tokens",
}


def _pattern(name: str) -> re.Pattern:
    return re.compile(re.escape(name).replace(re.escape("{reward}"), r"[^/]+") + r"\Z")


def documented(name: str) -> bool:
    """Whether the logged name ``name`` is a row's name (``{reward}``: any reward's name)."""
    return any(
        _pattern(n).match(name)
        for table in (OWN_METRICS, TRL_METRICS)
        for row in table
        for n in row
    )
