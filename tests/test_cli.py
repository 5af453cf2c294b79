"""The ``mrtpo`` command line: help, argument errors, forwarding, and a short real run."""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from mrtpo.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def _run(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    out = capsys.readouterr()
    return exc.value.code, out.out, out.err


def test_help_lists_every_command_and_flag(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    for cmd in ("train", "compare", "demo", "bench"):
        assert cmd in out
    code, out, _ = _run(["train", "--help"], capsys)
    assert code == 0
    parser = build_parser()
    train_parser = parser._subparsers._group_actions[0].choices["train"]
    flags = [s for a in train_parser._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) > 25
    for flag in flags:
        assert flag in out
    for action in train_parser._actions:
        assert action.help, f"{action.option_strings} has no help text"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "--algo", "ppo"], "invalid choice: 'ppo'"),
        (["train", "--task", "chess"], "invalid choice: 'chess'"),
        (["train", "--steps", "0"], "positive integer"),
        (["train", "--alpha", "1.5"], "--alpha"),
        (["train", "--temperature", "-1"], "--temperature"),
        (["train", "--group-size", "x"], "positive integer"),
        (["compare", "--algos", "gdpo,foo"], "comma-separated list"),
        (["train", "--model", "/no/such/folder"], "model:"),
        (["train", "--group-size", "1"], "group_size"),
        ([], "COMMAND"),
    ],
)
def test_bad_arguments_give_clear_errors(argv, needle, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert needle in err


def test_demo_and_bench_forward_their_arguments(monkeypatch):
    seen = {}
    bench_main = types.ModuleType("bench.__main__")
    bench_main.main = lambda argv=None: seen.setdefault("bench", argv) and 0
    demo = types.ModuleType("mrtpo.demo")
    demo.main = lambda argv=None: seen.setdefault("demo", argv) and 0
    monkeypatch.setitem(sys.modules, "bench.__main__", bench_main)
    monkeypatch.setitem(sys.modules, "mrtpo.demo", demo)
    assert main(["bench", "--op", "js", "--quick"]) == 0
    assert main(["demo", "--help"]) == 0
    assert seen == {"bench": ["--op", "js", "--quick"], "demo": ["--help"]}


def test_missing_bench_package_is_a_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "bench.__main__", None)  # import raises ImportError
    assert main(["bench"]) == 2
    assert "benchmark package is not available" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "mrtpo", "train", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and "--algo" in proc.stdout


def test_train_on_the_builtin_constraints_task(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--task",
            "constraints",
            "--algo",
            "mrtpo",
            "--steps",
            "1",
            "--out",
            str(out),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--warm-steps",
            "2",
            "--prompts-per-step",
            "2",
            "--group-size",
            "2",
            "--max-new-tokens",
            "8",
            "--quiet",
        ]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "tokens.html" in printed
    row = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert {"pass/start_phrase", "pass/keyword_include", "pass/end_phrase"} <= row.keys()
    assert (out / "curves.png").exists() and (out / "tokens.html").exists()


def test_steps_to_target_needs_a_full_window():
    from mrtpo.compare import steps_to_target

    rows = [{"step": i + 1, "all_pass": v} for i, v in enumerate([0.9, 0.1, 0.5, 0.7, 0.8])]
    assert steps_to_target(rows, 0.6, 1) == 1
    assert steps_to_target(rows, 0.6, 2) == 4  # (0.5 + 0.7) / 2 = 0.6 at step 4
    assert steps_to_target(rows, 0.95, 2) is None


def test_compare_writes_table_and_plot(tmp_path):
    from test_trainer import TINY, standin_task

    from mrtpo.compare import run_compare

    args = build_parser().parse_args([
        "compare", "--algos", "gdpo,mrtpo", "--seeds", "2", "--steps", "2", "--window", "1",
        "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res"),
        "--cache-dir", str(tmp_path / "cache"), "--warm-steps", str(TINY.warm_steps),
        "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "8",
    ])  # fmt: skip
    summary = run_compare(args, task=standin_task(), log=lambda msg: None)
    assert [len(summary["runs"][a]) for a in ("gdpo", "mrtpo")] == [2, 2]
    md = (tmp_path / "res" / "compare_constraints.md").read_text()
    assert "## The claim" in md and "| gdpo |" in md and "| mrtpo |" in md
    assert (tmp_path / "res" / "compare_constraints.png").read_bytes()[:4] == b"\x89PNG"
    gdpo = summary["runs"]["gdpo"][0]
    assert gdpo["credit_precision"] == pytest.approx(gdpo["uniform_share"])  # uniform weights
