"""bench/k4_step_time.py's record from runs already on disk (``--summarize``): the step-time
ratio from step 2 on, the per-step rows, the replayed pairs, and the control mode (GDPO
beside GDPO) that reads the protocol's noise floor."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import k4_step_time


def _write_run(folder: Path, steps: list[tuple[float, float, float]], pairs=None) -> None:
    folder.mkdir(parents=True)
    rows = []
    for i, (ro, rp, up) in enumerate(steps):
        row = {"step": i + 1, "time": {"rollout": ro, "replay": rp, "update": up, "replays": 0}}
        if pairs is not None:
            row["replay/pairs"], row["replay/skipped"] = pairs[i]
        rows.append(json.dumps(row))
    (folder / "metrics.jsonl").write_text("\n".join(rows) + "\n")


def _summarize(tmp_path, control: bool) -> str:
    out = tmp_path / "runs"
    _write_run(out / "gdpo", [(2.0, 0.5, 4.0), (2.0, 0.5, 3.5), (1.0, 0.5, 3.5), (9, 9, 9)])
    timed = [(2.0, 1.5, 4.0), (2.0, 1.5, 3.5), (1.0, 1.0, 3.5)]
    if control:
        _write_run(out / "gdpo-control", timed)
    else:
        _write_run(out / "mrtpo", timed, pairs=[(20, 12), (32, 0), (8, 24)])
    record = tmp_path / "record.md"
    args = k4_step_time.argparse.Namespace(steps=3, seed=0, out=out, record=record,
                                           control=control)  # fmt: skip
    assert k4_step_time.summarize(args, "up 1", "up 2", ["load average: 1.5, 1, 1"], 60.0) == 0
    return record.read_text()


@pytest.mark.parametrize("control", [False, True])
def test_record_ratio_from_step_two(tmp_path, control):
    text = _summarize(tmp_path, control)
    # steps 2-3: baseline 6.0 + 5.0 = 11.0 s, timed 7.0 + 5.5 = 12.5 s; GDPO's 4th step unused
    assert "**ratio 1.136**" in text
    assert "| 2 | 6.00 (2.00 / 0.50 / 3.50) | 7.00 (2.00 / 1.50 / 3.50) |" in text
    assert "update phase (the same code in both): GDPO 3.50 s" in text
    if control:
        assert text.startswith("# GDPO beside GDPO")
        assert "--control" in text and "pairs with spans" not in text
        assert "GDPO (control) / GDPO |" in text
    else:
        assert "pairs with spans: 96, replayed 60, skipped 36 (38%)" in text
        assert "--control" not in text


def test_control_arms_are_two_gdpo_runs():
    assert k4_step_time.arms(True) == ("gdpo", "gdpo-control")
    assert k4_step_time.arms(False) == ("gdpo", "mrtpo")
