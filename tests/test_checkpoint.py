"""Crash consistency of a run folder: SIGKILL at every point of a checkpoint save, resume,
and get the metrics of an uninterrupted run; recovery of every leftover state; resume and
overwrite refusals."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import multiprocessing as mp
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from test_trainer import standin_task, tiny_config

from mrtpo.training.checkpoint import KILL_ENV, KILL_POINTS, MARK, META, RunDir
from mrtpo.training.config import TrainConfig
from mrtpo.training.trainer import Trainer, train

STEPS = 3


def _run_child(base: str, out: str, kill: str | None, resume: bool) -> None:
    """One training process (forked from a server that has the libraries imported)."""
    if kill:
        os.environ[KILL_ENV] = kill
    else:
        os.environ.pop(KILL_ENV, None)
    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        tiny_config(Path(base), steps=STEPS, checkpoint_every=1),
        out=out,
        resume=resume,
        overwrite=not resume,
    )
    train(cfg, task=standin_task(), progress=False)


def _rows(out: Path) -> list[dict]:
    """The metrics rows without their timings (the step's and each held-out evaluation's)."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    rows = [{k: v for k, v in json.loads(line).items() if k != "time"} for line in lines]
    for r in rows:
        if "eval" in r:
            r["eval"] = [{k: v for k, v in e.items() if k != "seconds"} for e in r["eval"]]
    return rows


@pytest.fixture(scope="module")
def forkserver():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(
        ["torch", "transformers", "transformers.models.qwen2.modeling_qwen2", "matplotlib"]
        + ["mrtpo.training.trainer", "test_trainer"]
    )
    return ctx


def _spawn(ctx, *args) -> int:
    p = ctx.Process(target=_run_child, args=args)
    p.start()
    p.join(timeout=120)
    if p.is_alive():
        p.kill()
        p.join()
        pytest.fail(f"training child {args} did not finish")
    return p.exitcode


@pytest.fixture(scope="module")
def reference(tmp_path_factory, forkserver):
    base = tmp_path_factory.mktemp("ckpt")
    out = base / "reference"
    assert _spawn(forkserver, str(base), str(out), None, False) == 0
    return base, _rows(out)


CASES = [(p, 2) for p in KILL_POINTS] + [("tmp_state", 1), ("tmp_complete", 1)]


@pytest.mark.parametrize("point, step", CASES, ids=[f"{p}@{s}" for p, s in CASES])
def test_sigkill_during_save_then_resume_matches_uninterrupted(forkserver, reference, point, step):
    base, want = reference
    out = base / f"killed-{point}-{step}"
    code = _spawn(forkserver, str(base), str(out), f"{point}:{step}", False)
    assert code == -signal.SIGKILL, f"the kill point {point} was never reached"
    assert _spawn(forkserver, str(base), str(out), None, True) == 0
    assert _rows(out) == want
    assert not (out / "checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()
    meta = json.loads((out / "checkpoint" / META).read_text())
    assert meta["step"] == STEPS and meta["metrics_rows"] == STEPS
    ref_model = sorted((base / "reference" / "checkpoint" / "model").glob("*.safetensors"))
    got_model = sorted((out / "checkpoint" / "model").glob("*.safetensors"))
    assert ref_model and [p.read_bytes() for p in ref_model] == [p.read_bytes() for p in got_model]


# --------------------------------------------------------------------------------------------
# Recovery of each leftover state, without training


def _fake_checkpoint(path: Path, step: int, *, complete: bool = True) -> None:
    path.mkdir(parents=True)
    (path / "state.pt").write_text("x")
    if complete:
        (path / META).write_text(json.dumps({"format": 1, "step": step, "config": {}}))


@pytest.mark.parametrize(
    "present, want_step",
    [
        ({"checkpoint": 2}, 2),
        ({"checkpoint": 2, "checkpoint.old": 1}, 2),  # killed while removing .old
        ({"checkpoint": 1, "checkpoint.tmp": None}, 1),  # killed while writing .tmp
        ({"checkpoint": 2, "checkpoint.old": None}, 2),  # .old partly removed
        ({"checkpoint.old": 1, "checkpoint.tmp": 2}, 2),  # killed between the renames
        ({"checkpoint.old": 1, "checkpoint.tmp": None}, 1),
        ({"checkpoint.tmp": 1}, 1),  # first save, killed before its rename
        ({"checkpoint.tmp": None}, None),  # first save, incomplete
        ({"checkpoint.old": 1}, 1),
        ({}, None),
        ({"checkpoint": 1, "checkpoint.tmp": 2}, 2),  # killed after .tmp's commit mark
        ({"checkpoint": None, "checkpoint.tmp": 2}, 2),  # an unmarked checkpoint: debris
        ({"checkpoint": None, "checkpoint.old": 1, "checkpoint.tmp": None}, 1),
    ],
)
def test_recover_every_leftover_state(tmp_path, present, want_step):
    for name, step in present.items():
        _fake_checkpoint(tmp_path / name, step or 0, complete=step is not None)
    rd = RunDir(tmp_path)
    rd.recover()
    assert not rd.tmp.exists() and not rd.old.exists()
    meta = rd.meta()
    if want_step is None:
        assert meta is None
    else:
        assert meta["step"] == want_step


# --------------------------------------------------------------------------------------------
# Refusals


def _fake_run(out: Path, cfg: TrainConfig) -> None:
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg.to_dict()))
    (out / "metrics.jsonl").write_text("")


@pytest.mark.parametrize(
    "change", [{"algo": "gdpo"}, {"task": "other"}, {"seed": 5}, {"alpha": 0.5}, {"lr": 1e-3}]
)
def test_resume_with_other_settings_is_refused(tmp_path, change):
    cfg = tiny_config(tmp_path)
    _fake_run(Path(cfg.out), cfg)
    other = dataclasses.replace(cfg, resume=True, **change)
    with pytest.raises(ValueError, match="resume: .*" + next(iter(change))):
        Trainer(other, task=standin_task())
    assert not (tmp_path / "cache").exists()  # refused before any model was built


def test_resume_may_change_steps_device_and_outputs(tmp_path):
    cfg = tiny_config(tmp_path)
    _fake_run(Path(cfg.out), cfg)
    ok = dataclasses.replace(cfg, resume=True, steps=7, html_samples=1, checkpoint_every=3)
    assert ok.trajectory() == cfg.trajectory()


def test_existing_out_needs_resume_or_overwrite(tmp_path, reference):
    cfg = tiny_config(tmp_path, steps=1, cache_dir=str(reference[0] / "cache"))
    _fake_run(Path(cfg.out), cfg)
    (Path(cfg.out) / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ValueError, match="already holds a run.*--overwrite"):
        Trainer(cfg, task=standin_task())
    assert not (Path(cfg.out) / "checkpoint").exists()
    res = train(dataclasses.replace(cfg, overwrite=True), task=standin_task(), progress=False)
    assert [r["step"] for r in _rows_of(res.metrics_path)] == [1]
    state = torch.load(res.checkpoint / "state.pt", weights_only=True)
    assert state["step"] == 1


def _rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_damaged_metrics_history_names_the_file(tmp_path, reference):
    cfg = tiny_config(tmp_path, steps=2, checkpoint_every=1, cache_dir=str(reference[0] / "cache"))
    res = train(cfg, task=standin_task(), progress=False)
    lines = res.metrics_path.read_text().splitlines()
    res.metrics_path.write_text(lines[0][:-5] + "\n" + lines[1] + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl line 1 is not valid JSON"):
        Trainer(dataclasses.replace(cfg, resume=True), task=standin_task())
    res.metrics_path.write_text(lines[0] + "\n")  # a row the checkpoint covers is missing
    with pytest.raises(ValueError, match="metrics.jsonl holds 1 complete rows"):
        Trainer(dataclasses.replace(cfg, resume=True), task=standin_task())
    res.metrics_path.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[1][:9])  # torn tail
    t = Trainer(dataclasses.replace(cfg, resume=True, steps=2), task=standin_task())
    assert [r["step"] for r in t.metrics] == [1, 2]
    assert res.metrics_path.read_text() == lines[0] + "\n" + lines[1] + "\n"


def test_recover_says_what_it_found_and_never_drops_a_complete_state(tmp_path):
    _fake_checkpoint(tmp_path / "checkpoint", 0, complete=False)
    _fake_checkpoint(tmp_path / "checkpoint.tmp", 4)
    notes = RunDir(tmp_path).recover()
    assert any("checkpoint/" in n and "no completion mark" in n for n in notes), notes
    assert any("checkpoint.tmp/" in n and "step 4" in n for n in notes), notes
    assert RunDir(tmp_path).meta()["step"] == 4
    # a partly written mark in .tmp (a kill inside its write) is no mark
    _fake_checkpoint(tmp_path / "x" / "checkpoint", 2)
    _fake_checkpoint(tmp_path / "x" / "checkpoint.tmp", 3, complete=False)
    (tmp_path / "x" / "checkpoint.tmp" / META).write_text('{"format": 1, "st')
    assert RunDir(tmp_path / "x").recover() and RunDir(tmp_path / "x").meta()["step"] == 2


def test_resume_with_an_unmarked_checkpoint_keeps_history_and_complete_states(tmp_path, reference):
    cfg = tiny_config(tmp_path, steps=2, checkpoint_every=1, cache_dir=str(reference[0] / "cache"))
    res = train(cfg, task=standin_task(), progress=False)
    history = res.metrics_path.read_bytes()
    ckpt = Path(cfg.out) / "checkpoint"
    # nothing complete beside it: refused, nothing cut or replaced
    (ckpt / META).rename(tmp_path / "meta-aside.json")
    with pytest.raises(ValueError, match="checkpoint: .*has no meta.json.*nothing was changed"):
        Trainer(dataclasses.replace(cfg, resume=True, steps=3), task=standin_task())
    assert res.metrics_path.read_bytes() == history
    assert sorted(p.name for p in ckpt.iterdir()) == ["model", "state.pt"]
    # a complete checkpoint.tmp beside it: resumed from there, and said so
    (tmp_path / "meta-aside.json").rename(ckpt / META)
    shutil.copytree(ckpt, Path(cfg.out) / "checkpoint.tmp")
    (ckpt / META).unlink()
    logs = []
    t = Trainer(
        dataclasses.replace(cfg, resume=True, steps=3), task=standin_task(), log=logs.append
    )
    assert t.step == 2 and [r["step"] for r in t.metrics] == [1, 2]
    assert res.metrics_path.read_bytes() == history
    assert any("checkpoint/" in m and "no completion mark" in m for m in logs), logs
    assert any("checkpoint.tmp/" in m and "step 2" in m for m in logs), logs
    t.run_dir.unlock()


def _mrtpo_train(tmp_path, out: Path, *args, kill: str | None = None):
    """``mrtpo train`` in its own process, on the built-in constraints task with a tiny warm
    start (cached under ``tmp_path``)."""
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop(KILL_ENV, None)
    if kill:
        env[KILL_ENV] = kill
    argv = ["--task", "constraints", "--out", str(out), "--cache-dir", str(tmp_path / "cache"),
            "--warm-steps", "5", "--prompts-per-step", "2", "--group-size", "2",
            "--max-new-tokens", "6", "--checkpoint-every", "1", "--eval-every", "2",
            "--eval-prompts", "2", "--threads", "1", "--quiet", *args]  # fmt: skip
    cmd = [sys.executable, "-m", "mrtpo", "train", *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # three `mrtpo train` processes
def test_mrtpo_train_resume_with_an_unmarked_checkpoint_beside_a_complete_tmp(tmp_path):
    """Issue 41, item 13 (open since round 3), exactly its state, through the command line:
    ``checkpoint/`` without meta.json while a complete, marked ``checkpoint.tmp/`` sits
    beside it (here a save of step 2 killed after .tmp's commit mark, then checkpoint/'s
    mark lost). Reported to train from step 0, rewrite metrics.jsonl and delete the .tmp; it
    must resume from the .tmp, keeping the history, and train as the run done in one go."""
    one_go = _mrtpo_train(tmp_path, tmp_path / "one-go", "--steps", "3")
    assert one_go.returncode == 0, one_go.stderr
    out = tmp_path / "run"
    killed = _mrtpo_train(tmp_path, out, "--steps", "3", kill="tmp_complete:2")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert json.loads((out / "checkpoint" / META).read_text())["step"] == 1
    assert json.loads((out / "checkpoint.tmp" / META).read_text())["step"] == 2
    (out / "checkpoint" / META).unlink()  # the state of the issue
    history = (out / "metrics.jsonl").read_bytes()
    assert history.count(b"\n") == 2
    resumed = _mrtpo_train(tmp_path, out, "--steps", "3", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    said = resumed.stdout
    assert "resume: removed checkpoint/ (no completion mark: incomplete)" in said, said
    assert "resume: took checkpoint.tmp/ (complete, step 2) as checkpoint/" in said, said
    assert f"resumed from {out / 'checkpoint'} at step 2" in said, said
    assert (out / "metrics.jsonl").read_bytes().startswith(history)  # the history kept
    assert _rows(out) == _rows(tmp_path / "one-go")  # and trained on from step 2, not 0
    meta = json.loads((out / "checkpoint" / META).read_text())
    assert meta["step"] == 3 and meta["metrics_rows"] == 3
    assert not (out / "checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()


def test_one_trainer_per_folder(tmp_path, reference):
    cfg = tiny_config(tmp_path, steps=1, cache_dir=str(reference[0] / "cache"))
    first = Trainer(cfg, task=standin_task())  # holds the folder until its run ends
    for again in (dataclasses.replace(cfg, resume=True), dataclasses.replace(cfg, overwrite=True)):
        with pytest.raises(ValueError, match=f"out: .* is in use: process {os.getpid()} holds"):
            Trainer(again, task=standin_task())
    assert not (Path(cfg.out) / "metrics.jsonl").read_text()  # the refused ones wrote nothing
    first.run(progress=False)
    assert [r["step"] for r in _rows_of(Path(cfg.out) / "metrics.jsonl")] == [1]
    resumed = Trainer(dataclasses.replace(cfg, resume=True, steps=1), task=standin_task())
    assert resumed.step == 1  # the lock went with the first run's end


def test_a_run_that_left_only_its_mark_does_not_block_the_next(tmp_path, reference):
    cfg = tiny_config(tmp_path, steps=1, cache_dir=str(reference[0] / "cache"))
    Path(cfg.out).mkdir()
    (Path(cfg.out) / MARK).write_text("{}")  # a run that failed before writing any file
    Trainer(cfg, task=standin_task()).run_dir.unlock()


@pytest.mark.parametrize(
    "meta, needle",
    [
        ({"format": 1, "step": "2", "config": {}}, "has no valid step"),
        ({"format": 1, "step": 2}, "holds no run config"),
        ([1, 2], "has format"),
    ],
)
def test_a_tampered_checkpoint_mark_is_named(tmp_path, meta, needle):
    _fake_checkpoint(tmp_path / "checkpoint", 2)
    (tmp_path / "checkpoint" / META).write_text(json.dumps(meta))
    (tmp_path / MARK).write_text("{}")
    with pytest.raises(ValueError, match=f"checkpoint: .*{needle}"):
        RunDir(tmp_path).prepare(resume=True, overwrite=False)
    assert (tmp_path / "checkpoint" / META).exists()  # nothing removed


def test_a_config_json_that_is_not_a_config_is_named(tmp_path):
    (tmp_path / MARK).write_text("{}")
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="out: .*config.json holds no run config"):
        RunDir(tmp_path).prepare(resume=True, overwrite=False, check_config=lambda saved: None)


# --------------------------------------------------------------------------------------------
# Issue 32, item 5: every state a save can leave, through each way of resuming a run

# (folders present, the step to resume from): a previous checkpoint of step 1, a save of
# step 2 stopped at each point of its protocol (RunDir.save), and a first save.
SAVE_STATES = {
    "writing_tmp": ({"checkpoint": 1, "checkpoint.tmp": None}, 1),
    "tmp_complete": ({"checkpoint": 1, "checkpoint.tmp": 2}, 2),
    "between_renames": ({"checkpoint.old": 1, "checkpoint.tmp": 2}, 2),
    "new_renamed": ({"checkpoint": 2, "checkpoint.old": 1}, 2),
    "old_partly_removed": ({"checkpoint": 2, "checkpoint.old": None}, 2),
    "first_save_writing": ({"checkpoint.tmp": None}, None),
    "first_save_complete": ({"checkpoint.tmp": 1}, 1),
    # not made by a save, found by round 3's probes: checkpoint/ lost its mark
    "unmarked_beside_complete_tmp": ({"checkpoint": None, "checkpoint.tmp": 2}, 2),
}
RERUN_CONFIG = Path(__file__).resolve().parents[1] / "records/scripts/rerun_config.py"


def _killed_run(out: Path, present: dict) -> bytes:
    """A run folder as a kill left it: the trainer's mark, config, 2 metrics rows and a
    torn third, and ``present``'s checkpoint folders. Returns the metrics' bytes."""
    out.mkdir(parents=True)
    (out / MARK).write_text("{}")
    (out / "config.json").write_text(json.dumps(TrainConfig(task="constraints").to_dict()))
    history = b'{"step": 1}\n{"step": 2}\n{"ste'
    (out / "metrics.jsonl").write_bytes(history)
    for name, step in present.items():
        _fake_checkpoint(out / name, step or 0, complete=step is not None)
    return history


def _resume_like_train(out: Path) -> dict | None:
    """What ``mrtpo train --resume`` does to the folder before any model is built."""
    rd = RunDir(out)
    try:
        return rd.prepare(resume=True, overwrite=False)
    finally:
        rd.unlock()


def _rerun_config_script():
    spec = importlib.util.spec_from_file_location("rerun_config", RERUN_CONFIG)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def _resume_like_rerun_config(out: Path, monkeypatch) -> dict | None:
    """records/scripts/rerun_config.py RECORDED OUT, run again after the kill, with
    the training replaced by what it does to the folder first."""
    script = _rerun_config_script()
    recorded = out.parent / "recorded"
    recorded.mkdir()
    (recorded / "config.json").write_text((out / "config.json").read_text())
    seen = []

    def train(cfg, progress):
        rd = RunDir(cfg.out)
        try:
            seen.append(rd.prepare(resume=cfg.resume, overwrite=cfg.overwrite))
        finally:
            rd.unlock()

    monkeypatch.setattr(script, "train", train)
    script.main([str(recorded), str(out)])
    return seen[0]


@pytest.mark.parametrize("how", ["train --resume", "rerun_config"])
@pytest.mark.parametrize("state", list(SAVE_STATES))
def test_every_state_a_save_leaves_resumes_from_the_newest_complete_checkpoint(
    tmp_path, monkeypatch, state, how
):
    """rerun_config.py resumed only when checkpoint/ existed: killed between a save's two
    renames (checkpoint.old/ and a complete checkpoint.tmp/, no checkpoint/) and run again,
    it overwrote the folder (the complete states and the metrics) and started at step 0."""
    present, want = SAVE_STATES[state]
    out = tmp_path / "run"
    history = _killed_run(out, present)
    if how == "rerun_config":
        meta = _resume_like_rerun_config(out, monkeypatch)
    else:
        meta = _resume_like_train(out)
    assert (None if meta is None else meta["step"]) == want
    assert not (out / "checkpoint.tmp").exists() and not (out / "checkpoint.old").exists()
    assert (out / "checkpoint").exists() == (want is not None)
    assert (out / "metrics.jsonl").read_bytes() == history  # cut only after the load


def test_rerun_config_overwrite_starts_the_folder_again(tmp_path, monkeypatch):
    out = tmp_path / "run"
    _killed_run(out, {"checkpoint.old": 1, "checkpoint.tmp": 2})
    recorded = tmp_path / "recorded"
    recorded.mkdir()
    (recorded / "config.json").write_text((out / "config.json").read_text())
    script = _rerun_config_script()
    seen = []
    monkeypatch.setattr(script, "train", lambda cfg, progress: seen.append(cfg))
    script.main([str(recorded), str(out), "--overwrite"])
    assert (seen[0].resume, seen[0].overwrite) == (False, True)
