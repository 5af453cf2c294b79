"""The ``mrtpo`` command line: help, argument errors (one line, exit 2, before any model is
built), and short real runs."""

from __future__ import annotations

import json
import subprocess
import sys
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
    for cmd in ("train", "compare", "demo"):
        assert cmd in out
    assert "bench" not in out
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
        (["train", "--algo", "ppo"], "--algo: expected one of grpo, gdpo, mrtpo"),
        (["train", "--task", "chess"], "--task: expected one of"),
        (["train", "--task", "constraints:no_such_kind"], "unknown constraint kind"),
        (["train", "--steps", "0"], "--steps: expected a number in [1"),
        (["train", "--alpha", "1.5"], "--alpha"),
        (["train", "--temperature", "-1"], "--temperature"),
        (["train", "--group-size", "x"], "--group-size: expected an integer"),
        (["compare", "--algos", "gdpo,foo"], "--algos: expected a comma-separated list"),
        (["compare", "--task", "sqll"], "--task"),
        (["compare", "--lr", "nan"], "--lr: expected a finite number"),
        (["train", "--model", "/no/such/folder"], "--model:"),
        (["train", "--group-size", "1"], "--group-size"),
        (["train", "--device", "tpu"], "--device: expected auto, cpu, cuda or cuda:N"),
        (["train", "--weight-decay", "inf"], "--weight-decay: expected a finite number"),
        (["train", "--weight-decay", "1e308"], "--weight-decay: lr x weight_decay"),
        (["train", "--lr", "10"], "--lr"),
        (["train", "--resume", "--overwrite"], "--overwrite"),
        ([], "COMMAND"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_2(argv, needle, capsys):
    code, _, err = _run(argv, capsys)
    assert code == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1, err


def _train_argv(tmp_path, *extra):
    return ["train", "--cache-dir", str(tmp_path / "cache"), "--steps", "1", "--quiet", *extra]


def test_bad_paths_fail_before_any_model_is_built(tmp_path, capsys):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    cases = [
        (["--out", str(a_file)], "--out: "),
        (["--out", str(a_file / "run")], "--out: "),
        (["--out", str(tmp_path / "run"), "--cache-dir", str(a_file)], "--cache-dir: "),
    ]
    for extra, needle in cases:
        code, _, err = _run(_train_argv(tmp_path, *extra), capsys)
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
    run = tmp_path / "old"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    code, _, err = _run(_train_argv(tmp_path, "--out", str(run)), capsys)
    assert code == 2 and "already holds a run" in err and "--overwrite" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # untouched
    assert not (tmp_path / "cache").exists()  # no model was built for any of them


def test_demo_forwards_its_arguments(monkeypatch):
    import types

    seen = {}
    demo = types.ModuleType("mrtpo.demo")
    demo.main = lambda argv=None: seen.setdefault("demo", argv) and 0
    monkeypatch.setitem(sys.modules, "mrtpo.demo", demo)
    assert main(["demo", "--help"]) == 0
    assert seen == {"demo": ["--help"]}


def test_every_config_field_has_a_flag_and_round_trips():
    from mrtpo.config import CompareConfig, TrainConfig
    from mrtpo.config import from_namespace as config_from_namespace

    argv = ["train", "--lr", "0.001", "--no-baseline-replay", "--warm-steps", "3"]
    args = build_parser().parse_args([*argv, "--task", "constraints:title,no_commas"])
    cfg = config_from_namespace(TrainConfig(), args)
    assert cfg.lr == 0.001 and cfg.replay_for_baselines is False and cfg.tiny.warm_steps == 3
    assert cfg.task == "constraints:title,no_commas"
    assert (
        config_from_namespace(TrainConfig(), build_parser().parse_args(["train"])) == TrainConfig()
    )
    args = build_parser().parse_args(["compare", "--task", "constraints-full", "--lr", "0.001"])
    cmp = config_from_namespace(CompareConfig(), args)
    assert cmp.task == "constraints-full" and cmp.train.lr == 0.001 and cmp.train.threads == 1
    assert cmp.run_config("gdpo", 2).task == "constraints-full"
    assert not hasattr(args, "algo") and not hasattr(args, "train.algo")  # fixed by compare


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
    again = ["--cache-dir", str(tmp_path / "cache"), "--warm-steps", "2", "--prompts-per-step",
             "2", "--group-size", "2", "--max-new-tokens", "8", "--quiet"]  # fmt: skip
    assert main(["train", "--out", str(out), "--resume", "--steps", "2", *again]) == 0
    printed = capsys.readouterr().out
    assert str(out) in printed and "tokens.html" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    row = rows[0]
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

    from mrtpo.cli import config_from_args
    from mrtpo.compare import run_compare

    args = build_parser().parse_args([
        "compare", "--algos", "gdpo,mrtpo", "--seeds", "2", "--steps", "2", "--window", "1",
        "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "res"),
        "--cache-dir", str(tmp_path / "cache"), "--warm-steps", str(TINY.warm_steps),
        "--prompts-per-step", "2", "--group-size", "3", "--max-new-tokens", "8",
    ])  # fmt: skip
    summary = run_compare(config_from_args(args), task=standin_task(), log=lambda msg: None)
    assert [len(summary["runs"][a]) for a in ("gdpo", "mrtpo")] == [2, 2]
    md = (tmp_path / "res" / "constraints" / "compare.md").read_text()
    assert "## The claim" in md and "| gdpo |" in md and "| mrtpo |" in md
    assert (tmp_path / "res" / "constraints" / "compare.png").read_bytes()[:4] == b"\x89PNG"
    gdpo = summary["runs"]["gdpo"][0]
    assert gdpo["credit_precision"] == pytest.approx(gdpo["uniform_share"])  # uniform weights


def test_train_with_warm_noise_smoke(tmp_path):
    # --warm-noise reaches the built-in model's warm start and its cache key
    cache = tmp_path / "cache"
    common = ["train", "--task", "constraints", "--algo", "gdpo", "--steps", "1", "--cache-dir",
              str(cache), "--warm-steps", "2", "--prompts-per-step", "2", "--group-size", "2",
              "--max-new-tokens", "4", "--no-baseline-replay", "--quiet"]  # fmt: skip
    assert main([*common, "--out", str(tmp_path / "a"), "--warm-noise", "0.5"]) == 0
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    infos = [json.loads(p.read_text()) for p in sorted(cache.glob("*/warm_start.json"))]
    assert sorted(i["config"]["warm_noise"] for i in infos) == [0.0, 0.5]
    with pytest.raises(SystemExit):
        main([*common, "--out", str(tmp_path / "c"), "--warm-noise", "1.5"])
