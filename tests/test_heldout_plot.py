"""records/scripts/heldout_plot.py on two tiny synthetic arms: the PNG is written, the
curves read from the "eval" entries, and an arm set without a shared seed is refused."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "records" / "scripts" / "heldout_plot.py"


def _module():
    spec = importlib.util.spec_from_file_location("heldout_plot", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(folder: Path, evals: list[float]) -> None:
    folder.mkdir(parents=True)
    rows = []
    for i, v in enumerate(evals):
        rows.append({"step": i * 10 or 1, "eval": [{"step": i * 10, "all_pass": v}]})
    (folder / "metrics.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n{torn")


def test_heldout_plot_reads_evals_and_writes_png(tmp_path):
    mod = _module()
    _run(tmp_path / "runs" / "gdpo-seed0", [0.0, 0.1, 0.2])
    _run(tmp_path / "runs" / "mrtpo-seed0", [0.0, 0.2, 0.3])
    _run(tmp_path / "runs" / "mrtpo-seed1", [0.0, 0.2, 0.3])  # no GDPO partner: left out
    data = mod.curves(tmp_path / "runs")
    assert data["gdpo"][0] == [(0, 0.0), (10, 0.1), (20, 0.2)]
    assert set(data["mrtpo"]) == {0, 1}
    out = tmp_path / "p.png"
    assert mod.main([str(tmp_path / "runs"), str(out), "--target", "0.15"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_heldout_plot_needs_a_shared_seed(tmp_path):
    mod = _module()
    _run(tmp_path / "runs" / "gdpo-seed0", [0.0, 0.1])
    _run(tmp_path / "runs" / "mrtpo-seed1", [0.0, 0.2])
    with pytest.raises(ValueError, match="no seed"):
        mod.plot(mod.curves(tmp_path / "runs"), tmp_path / "p.png", None, "t")


def test_heldout_plot_reads_seeds_as_written_and_refuses_seed01(tmp_path):
    """Issue 41, item 9: seed1 and seed01 were read as one seed (the last one read won)."""
    mod = _module()
    _run(tmp_path / "runs" / "mrtpo-seed1", [0.0, 0.2])
    _run(tmp_path / "runs" / "mrtpo-seed10", [0.0, 0.3])
    assert set(mod.curves(tmp_path / "runs")["mrtpo"]) == {1, 10}
    _run(tmp_path / "runs" / "mrtpo-seed01", [0.0, 0.9])
    with pytest.raises(ValueError, match="'mrtpo-seed01' writes its seed with a leading zero"):
        mod.curves(tmp_path / "runs")
