"""bench/replay_cost.py at a tiny size: one row per framework path with the columns the
table reports; where a row was measured, finite positive seconds, the ratio they give and
replay seconds > 0. No timing is compared (two wall-clock timings on a shared machine can
cross): the replay's extra work is checked by its count of forwards. verl and OpenRLHF rows
come from .venv-frameworks when it exists (merged into the same folder), else they say "not
installed here"."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

from bench import replay_cost as rc  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--prompts", "2", "--group", "2", "--tokens", "6", "--repeats", "3", "--warmup", "1",
        "--threads", "1"]  # fmt: skip
FVENV_PY = ROOT / ".venv-frameworks" / "bin" / "python"


def _check_measured(row):
    assert row["status"] == "ok", row
    for key in ("with_s", "without_s", "replay_s", "ratio"):
        assert isinstance(row[key], float) and math.isfinite(row[key]) and row[key] > 0, key
    assert row["ratio"] == pytest.approx(row["with_s"] / row["without_s"], rel=1e-3)
    assert row["k"] == rc.K == 3 and row["target"] == rc.TARGET
    assert math.isfinite(row["load_1m"])


def test_rows_in_this_venv(tmp_path):
    out = tmp_path / "res"
    rows = rc.main(["--out", str(out), "--cache-dir", str(tmp_path / "cache"), *TINY])
    by = {r["framework"]: r for r in rows}
    assert list(by) == list(rc.FRAMEWORKS)
    _check_measured(by["train"])
    extra = by["train"]["extra"]
    assert extra["replay_forwards_with"] > 0 == extra["replay_forwards_without"]
    assert "same batch: yes" in by["train"]["note"]
    _check_measured(by["trl"])
    for name in ("verl", "openrlhf"):
        row = by[name]
        if rc.importable(name):
            _check_measured(row)
        else:
            assert row["status"] == rc.NOT_INSTALLED and name in row["note"]
            assert row["with_s"] == row["ratio"] == ""
    # the three files agree
    saved = json.loads((out / "replay_cost.json").read_text())
    assert [r["framework"] for r in saved["rows"]] == list(rc.FRAMEWORKS)
    with open(out / "replay_cost.csv") as f:
        table = list(csv.DictReader(f))
    assert [r["framework"] for r in table] == list(rc.FRAMEWORKS)
    assert set(table[0]) == set(rc.FIELDS)
    md = (out / "replay_cost.md").read_text()
    assert md.count("\n| ") == 1 + len(rc.FRAMEWORKS)  # header + one line per row
    assert "<= 1.5" in md and "load (1 min)" in md

    # a second run from the frameworks' venv fills verl's and OpenRLHF's rows in place
    if not FVENV_PY.exists():
        pytest.skip(".venv-frameworks not built (make test-frameworks)")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [str(FVENV_PY), "-W", "ignore", "-m", "bench.replay_cost", "--out", str(out),
           "--frameworks", "verl,openrlhf", *TINY]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    merged = {r["framework"]: r for r in json.loads((out / "replay_cost.json").read_text())["rows"]}
    assert merged["train"] == json.loads(json.dumps(by["train"], default=str))  # kept
    for name in ("verl", "openrlhf"):
        _check_measured(merged[name])
        assert ".venv-frameworks" in merged[name]["python"]
        assert merged[name]["extra"] == {}


def test_not_installed_never_replaces_a_measured_row():
    old = [dict(framework="verl", status="ok", ratio=2.0)]
    new = [dict(framework="verl", status=rc.NOT_INSTALLED), dict(framework="trl", status="ok")]
    merged = rc.merge(old, new)
    assert [r["framework"] for r in merged] == ["trl", "verl"]
    assert merged[1]["status"] == "ok"
    newer = [dict(framework="verl", status="ok", ratio=3.0)]
    assert rc.merge(old, newer)[0]["ratio"] == 3.0


def test_bad_arguments_name_the_flag(capsys):
    with pytest.raises(SystemExit):
        rc.parse(["--out", "x", "--frameworks", "verl,deepspeed"])
    assert "--frameworks" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        rc.parse(["--out", "x", "--group", "1"])
    assert "--group" in capsys.readouterr().err


def test_module_runs_as_a_command():
    done = subprocess.run([sys.executable, "-m", "bench.replay_cost", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "--frameworks" in done.stdout
