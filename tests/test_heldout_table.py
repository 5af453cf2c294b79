"""records/scripts/heldout_table.py on tiny synthetic run folders: runs are read by
distinct seed (``<algo>-seed<s>``, s without leading zeros; ``seed01`` is refused, naming
the folder, not merged with ``seed1``)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "records" / "scripts" / "heldout_table.py"


def _module():
    spec = importlib.util.spec_from_file_location("heldout_table", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(folder: Path, final: float, steps: int = 4) -> None:
    """A committed run: ``steps`` metrics rows, held-out evaluations at 0, 2 and 4."""
    folder.mkdir(parents=True)
    evals = {0: 0.0, 2: final / 2, 4: final}
    rows = []
    for i in range(1, steps + 1):
        row = {"step": i, "all_pass": final, "pass/r": final,
               "time": {"rollout": 1.0, "replay": 0.0, "update": 0.0, "replays": 0}}  # fmt: skip
        at = [s for s in evals if (s == 0 and i == 1) or s == i]
        if at:
            row["eval"] = [
                {"step": s, "all_pass": evals[s], "pass": {"r": evals[s]}, "answers": 4} for s in at
            ]
        rows.append(row)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_seeds_are_read_as_written_and_seed01_is_refused(tmp_path, capsys):
    mod = _module()
    runs = tmp_path / "runs"
    for seed in (1, 10):
        _run(runs / f"gdpo-seed{seed}", 0.4)
        _run(runs / f"mrtpo-seed{seed}", 0.8)
    summary = mod.load(runs, 0.5, 1, 4)
    assert sorted(r["seed"] for r in summary["runs"]["mrtpo"]) == [1, 10]
    assert mod.main([str(runs), "--target", "0.5", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "| mrtpo seed 10 |" in out and "(2 paired seeds)" in out
    # seed01 beside seed1: read as seed 1 it was a second run of that seed (a duplicate
    # pair); it is refused, naming the folder
    _run(runs / "mrtpo-seed01", 0.9)
    with pytest.raises(ValueError, match="'mrtpo-seed01' writes its seed with a leading zero"):
        mod.load(runs, 0.5, 1, 4)
    with pytest.raises(SystemExit) as stop:
        mod.main([str(runs), "--target", "0.5", "--steps", "4"])
    assert stop.value.code == 2
    assert "mrtpo-seed01" in capsys.readouterr().err
