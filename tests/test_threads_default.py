"""--threads defaults to one thread per process (a run beside other work never has more busy
threads than cores); `mrtpo train` notes oversubscription when the user asks for more
threads than the free cores, and the step line prints each step's seconds."""

from __future__ import annotations

import torch

from mrtpo.cli import build_parser, config_from_args, oversubscription_note
from mrtpo.training.config import TrainConfig
from mrtpo.training.metrics import format_step


def test_the_default_is_one_thread_per_process():
    assert TrainConfig().threads == 1
    cfg = config_from_args(build_parser().parse_args(["train", "--task", "constraints"]))
    assert cfg.threads == 1
    cfg = config_from_args(build_parser().parse_args(["train", "--threads", "0"]))
    assert cfg.threads == 0  # torch's default, asked for


def test_oversubscription_note():
    # the case of issue 45: two threads on two cores beside another two-thread process
    note = oversubscription_note(2, cpus=2, load=2.0)
    assert note and "--threads 1" in note and "2 CPU threads on 2 CPUs" in note
    assert oversubscription_note(0, cpus=2, load=2.0) == (
        oversubscription_note(torch.get_num_threads(), cpus=2, load=2.0)
    )
    assert oversubscription_note(1, cpus=2, load=3.0) is None  # one thread: never
    assert oversubscription_note(2, cpus=2, load=0.1) is None  # an idle machine
    assert oversubscription_note(4, cpus=8, load=3.0) is None  # enough free cores
    assert oversubscription_note(4, cpus=4, load=2.0) is not None


def test_step_line_prints_seconds_per_step():
    row = {"step": 3, "all_pass": 0.5, "pass/a": 0.5, "relevance/a": None,
           "time": {"rollout": 1.25, "replay": 0.5, "update": 0.75, "replays": 4}}  # fmt: skip
    assert format_step(row, ["a"], 40).endswith("| 2.5 s/step")
    del row["time"]
    assert "s/step" not in format_step(row, ["a"], 40)
