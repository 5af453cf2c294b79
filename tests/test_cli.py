"""The ``mrtpo`` command line: help, argument errors (one line, exit 2, before any model is
built), and short real runs."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mrtpo.cli import build_parser, main
from mrtpo.training.checkpoint import MARK

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
        (["compare", "--algos", "gdpo,mrtpo:alpha=2"], "--algos: expected a comma-separated"),
        (["compare", "--algos", "gdpo,mrtpo:gamma=0"], "gamma in 'mrtpo:gamma=0'"),
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
    (run / MARK).write_text("{}")  # a folder the trainer made
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
    from mrtpo.training.cli_args import from_namespace as config_from_namespace
    from mrtpo.training.config import CompareConfig, TrainConfig

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
    from mrtpo.training.stats import steps_to_target

    rows = [{"step": i + 1, "all_pass": v} for i, v in enumerate([0.9, 0.1, 0.5, 0.7, 0.8])]
    assert steps_to_target(rows, 0.6, 1) == 1
    assert steps_to_target(rows, 0.6, 2) == 4  # (0.5 + 0.7) / 2 = 0.6 at step 4
    assert steps_to_target(rows, 0.95, 2) is None


def test_compare_writes_table_and_plot(tmp_path):
    from test_trainer import TINY, standin_task

    from mrtpo.cli import config_from_args
    from mrtpo.training.compare import run_compare

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


# --------------------------------------------------------------------------------------------
# Broken --model folders, folders the trainer did not make, a folder in use


def _safetensors(path: Path, *, truncate: int = 0) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    data = len(header).to_bytes(8, "little") + header + b"\0" * 8
    path.write_bytes(data[: len(data) - truncate])


def _hf_folder(path: Path, *, config=None, weights=True, tokenizer=None) -> Path:
    """A folder laid out like a saved Hugging Face causal LM (not loadable: no model)."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(
        json.dumps({"model_type": "qwen2"} if config is None else config)
        if not isinstance(config, str)
        else config
    )
    if weights:
        _safetensors(path / "model.safetensors")
    (path / "tokenizer.json").write_text("{}")
    tok = {"eos_token": "</s>", "pad_token": None} if tokenizer is None else tokenizer
    (path / "tokenizer_config.json").write_text(json.dumps(tok))
    return path


def _without_pad_and_eos(path: Path) -> Path:
    """A loadable tokenizer that has neither a pad nor an end-of-sequence token."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return path


def _broken_models(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    no_shard = _hf_folder(tmp_path / "no_shard", weights=False)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors"}}
    (no_shard / "model.safetensors.index.json").write_text(json.dumps(index))
    truncated = _hf_folder(tmp_path / "truncated")
    llama = {"model_type": "llama"}  # its tokenizer class adds no pad or eos of its own
    _safetensors(truncated / "model.safetensors", truncate=3)
    return [
        (empty, "is empty"),
        (_hf_folder(tmp_path / "bad_json", config="{not json"), "config.json is not valid JSON"),
        (_hf_folder(tmp_path / "no_type", config={"hidden": 1}), "names no model_type"),
        (_hf_folder(tmp_path / "no_weights", weights=False), "has no weights"),
        (no_shard, "names model-00001-of-00002.safetensors, which is missing"),
        (truncated, "model.safetensors is truncated"),
        (_hf_folder(tmp_path / "bad_tokenizer"), "its tokenizer does not load"),
        (_without_pad_and_eos(_hf_folder(tmp_path / "no_pad_eos", config=llama)), "neither a pad"),
    ]


def test_broken_model_folders_give_one_line_naming_the_problem(tmp_path, capsys):
    for folder, needle in _broken_models(tmp_path):
        argv = _train_argv(tmp_path, "--model", str(folder), "--out", str(tmp_path / "run"))
        code, _, err = _run(argv, capsys)
        assert code == 2 and "--model: " in err and needle in err, (folder.name, err)
        assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run").exists()


def test_a_folder_the_trainer_did_not_make_is_never_overwritten(tmp_path, capsys):
    hf = _hf_folder(tmp_path / "hf-model")
    before = {p.name: p.read_bytes() for p in hf.iterdir()}
    for flag in ("--overwrite", "--resume", None):
        argv = _train_argv(tmp_path, "--out", str(hf), *([flag] if flag else []))
        code, _, err = _run(argv, capsys)
        assert code == 2 and "not a folder the trainer made" in err, err
        assert "--overwrite" not in err and len(err.strip().splitlines()) == 1
    assert {p.name: p.read_bytes() for p in hf.iterdir()} == before  # no file added or changed


def test_a_folder_in_use_is_refused(tmp_path, capsys):
    import fcntl
    import os

    from mrtpo.training.checkpoint import LOCK

    run = tmp_path / "run"
    run.mkdir()
    (run / MARK).write_text("{}")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    # another process holds the folder's lock for its whole run
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time\n"
         f"fd = os.open({str(run / LOCK)!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, str(os.getpid()).encode())\n"
         "print('locked', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        for flag in ("--resume", "--overwrite"):
            code, _, err = _run(_train_argv(tmp_path, "--out", str(run), flag), capsys)
            assert code == 2 and "--out: " in err and "in use" in err, err
            assert f"process {holder.pid}" in err and len(err.strip().splitlines()) == 1
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'
    finally:
        holder.kill()
        holder.wait()
    fd = os.open(run / LOCK, os.O_RDWR)  # the refused runs left the lock free
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    assert not (tmp_path / "cache").exists()


def test_resume_without_the_checkpoint_model_blames_the_checkpoint(tmp_path, capsys):
    import shutil

    out = tmp_path / "run"
    small = ["--warm-steps", "2", "--prompts-per-step", "2", "--group-size", "2", "--out",
             str(out), "--max-new-tokens", "4", "--algo", "gdpo"]  # fmt: skip
    assert main([*_train_argv(tmp_path), *small]) == 0
    from mrtpo.model.folder import check_model_folder

    (cached,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert check_model_folder(cached) is None  # a model the trainer saved passes the checks
    shutil.rmtree(out / "checkpoint" / "model")
    capsys.readouterr()
    code, _, err = _run([*_train_argv(tmp_path), *small, "--resume", "--steps", "2"], capsys)
    assert code == 2 and "checkpoint: " in err and "--model" not in err, err
    assert "checkpoint/model' is not a folder" in err and len(err.strip().splitlines()) == 1
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]


def test_weights_that_do_not_fit_the_model_give_one_line(tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file
    from test_trainer import standin_task
    from transformers import LlamaConfig, LlamaForCausalLM

    from mrtpo.model.loading import build_tokenizer, save_model, task_texts

    tok = build_tokenizer(task_texts(standin_task()), vocab_size=300)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    whole = save_model(LlamaForCausalLM(config), tok, tmp_path / "whole")
    name = "model.layers.0.mlp.up_proj.weight"
    cases = []
    lacking = f"lack 1 of the model's tensors ({name})"
    for case, change in (("lacking", None), ("reshaped", torch.zeros(3, 3))):
        folder = tmp_path / case
        shutil.copytree(whole, folder)
        tensors = load_file(folder / "model.safetensors")
        tensors.pop(name) if change is None else tensors.__setitem__(name, change)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        cases.append((folder, lacking if change is None else name))
    pickled = tmp_path / "pickled"
    shutil.copytree(whole, pickled)
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_text("not torch")
    cases.append((pickled, "pytorch_model.bin is not a PyTorch weight file"))
    for folder, needle in cases:
        argv = _train_argv(tmp_path, "--model", str(folder), "--out", str(tmp_path / "run"))
        code, _, err = _run(argv, capsys)
        assert code == 2 and "--model: " in err and needle in err, (folder.name, err)
        assert len(err.strip().splitlines()) == 1, err


# --- Issue 32, items 6, 7, 8, 11, 12: refused before any folder or model is made -----------

_HUGE = "9" * 5000  # past Python's int-to-string limit too


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--temperature", "1e-39"], ["--temperature: expected a number in [2^-126, 2^126]"]),
        (["--temperature", "1e39"], ["--temperature: expected a number in [2^-126, 2^126]"]),
        (["--temperature", "0"], ["--temperature"]),
        (["--seed", str(2**64)], ["--seed: expected an integer", "int64", str(2**64)]),
        (["--seed", str(2**63)], ["--seed: expected an integer"]),
        (["--seed", _HUGE], ["--seed: expected an integer", "5000 digits"]),
        (["--init-seed", str(2**64)], ["--init-seed: expected an integer"]),
        (["--steps", "1" + "0" * 400], ["--steps: expected an integer", "401 digits"]),
        (["--threads", "100000"], ["--threads: expected at most", "CPUs this process may use"]),
        (["--dtype", "float16"], ["--dtype: float16 weights cannot be trained", "eps"]),
        (["--dtype", "float16", "--autocast", "bfloat16"], ["--dtype: float16", "--autocast"]),
    ],
)
def test_out_of_range_settings_are_refused_before_any_folder_or_model(
    tmp_path, capsys, extra, needles
):
    out = tmp_path / "run"
    # compare's runs take seeds 0..N-1 (--seeds N): its --init-seed stands for --seed there
    as_compare = {"--seed": "--init-seed"}
    for command in ("train", "compare"):
        flags, want = extra, needles
        if command == "compare" and extra[0] in as_compare:
            flags = [as_compare[extra[0]], *extra[1:]]
            want = [n.replace(extra[0], flags[0]) for n in needles]
        argv = [command, "--cache-dir", str(tmp_path / "cache"), "--out", str(out), *flags]
        code, _, err = _run(argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        for needle in want:
            assert needle in err, (command, needle, err)
        assert not out.exists() and not (tmp_path / "cache").exists()


def test_the_edges_of_the_ranges_are_accepted():
    from mrtpo.training.config import MAX_TEMPERATURE, MIN_TEMPERATURE, TrainConfig, usable_cpus
    from mrtpo_kernels import _validation

    assert (MIN_TEMPERATURE, MAX_TEMPERATURE) == (
        _validation.MIN_TEMPERATURE,
        _validation.MAX_TEMPERATURE,
    )
    parser = build_parser()
    for argv in (
        ["--temperature", repr(2.0**-126)],
        ["--temperature", repr(2.0**126)],
        ["--seed", str(2**63 - 1)],
        ["--threads", str(usable_cpus())],
        ["--dtype", "bfloat16", "--autocast", "bfloat16"],
    ):
        parser.parse_args(["train", *argv])
    with pytest.raises(ValueError, match="dtype: float16"):
        TrainConfig(dtype="float16").validate()
    with pytest.raises(ValueError, match="seed: expected an integer"):
        TrainConfig(seed=2**64).validate()
    with pytest.raises(ValueError, match="temperature: expected"):
        TrainConfig(temperature=float("nan")).validate()


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--seed", str(2**64)], "--seed: expected an integer in [0, 9223372036854775807]"),
        (["--seed", "-1"], "--seed: expected an integer in [0,"),
        (["--seed", _HUGE], "5000 digits"),
        (["--vocab", "1"], "--vocab: expected an integer in [2,"),
        (["--vocab", str(10**12)], "--vocab: expected an integer in [2,"),
    ],
)
def test_demo_refuses_out_of_range_arguments_without_a_traceback(capsys, argv, needle):
    code, _, err = _run(["demo", *argv], capsys)
    assert code == 2 and needle in err and "Traceback" not in err, err
