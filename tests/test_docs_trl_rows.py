"""docs/trl.md's own code, run: the row built by hand names each constraint's sentence as
its span and `verifier_reward` scores it; the `example_row` shown is the real one; the
several-processes block keeps the global batch; the models-in-code block loads the tiny
and the warm-started model (slow). And the README's two-process line keeps the TRL quick
start's global batch."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TRL_MD = (ROOT / "docs" / "trl.md").read_text()
README = (ROOT / "README.md").read_text()


def block_after(heading: str, text: str = TRL_MD) -> str:
    """The first ```python block after ``heading``."""
    i = text.index(heading)
    return re.search(r"```python\n(.*?)\n```", text[i:], flags=re.S).group(1)


def test_rows_by_hand_name_their_sentences_and_score():
    pytest.importorskip("trl")
    scope: dict = {}
    exec(compile(block_after("A row by hand"), "docs/trl.md rows by hand", "exec"), scope)
    (row,) = scope["rows"]
    prompt = row["prompt"][-1]["content"]
    entries = json.loads(row["fields"])["constraints"]
    assert [prompt[slice(*e["span"])] for e in entries] == [
        'Include the word "salt".',
        'End your answer with "good night".',
    ]
    good = [[{"role": "assistant", "content": "The salt wind blows. good night"}]]
    bad = [[{"role": "assistant", "content": "The wind blows."}]]
    for fn, entry in zip(scope["reward_funcs"], entries):
        assert fn(prompts=[row["prompt"]], completions=good, fields=[row["fields"]]) == [
            (1.0, [tuple(entry["span"])])
        ]
        assert fn(prompts=[row["prompt"]], completions=bad, fields=[row["fields"]])[0][0] == 0.0


def test_the_example_row_shown_is_the_real_one():
    pytest.importorskip("trl")
    from mrtpo.integrations.trl_trainer import example_row
    from mrtpo.tasks.builtin import load_task

    shown = eval(block_after("What `example_row(task.train[0])` returns"))  # a literal
    assert shown == example_row(load_task("constraints-real").train[0])


def test_the_constraint_kinds_and_params_are_the_verifiers():
    from mrtpo.verifiers.constraints import KINDS, describe

    section = TRL_MD[TRL_MD.index("## Your own rows") : TRL_MD.index("## Models in code")]
    for kind in KINDS:
        assert f"`{kind}`" in section, kind
    params = {"word_count": {"relation": "at most", "n": 3}, "keyword_include": {"word": "a"},
              "keyword_exclude": {"word": "a"}, "letter_frequency": {"letter": "a", "n": 2},
              "bullet_count": {"n": 2}, "paragraph_count": {"n": 2}, "placeholders": {"n": 2},
              "sections": {"n": 2}, "start_phrase": {"phrase": "a"},
              "end_phrase": {"phrase": "a"}}  # fmt: skip
    for kind in KINDS:  # the params the page lists are all a kind's sentence needs
        assert describe(kind, params.get(kind, {}))


def test_several_processes_block_keeps_the_global_batch(monkeypatch):
    code = block_after("**The global batch grows with the processes.**")
    for processes in (1, 2, 4):
        monkeypatch.setenv("WORLD_SIZE", str(processes))
        scope: dict = {"MRTPOConfig": lambda **kw: kw}  # the settings it would pass
        exec(compile(code, "docs/trl.md several processes", "exec"), scope)
        cfg = scope["config"]
        assert cfg["per_device_train_batch_size"] * processes == 8
        assert cfg["per_device_train_batch_size"] * processes % cfg["num_generations"] == 0


def test_readme_two_process_line_keeps_the_quick_starts_global_batch():
    m = re.search(r"<!-- quickstart: trl -->\n```python\n(.*?)\n```", README, flags=re.S)
    one = int(re.search(r"per_device_train_batch_size=(\d+)", m.group(1)).group(1))
    gens = int(re.search(r"num_generations=(\d+)", m.group(1)).group(1))
    line = next(x for x in README.splitlines() if "--nproc_per_node" in x)
    processes = int(re.search(r"--nproc_per_node (\d+)", line).group(1))
    per_device = int(re.search(r"per_device_train_batch_size=(\d+)", line).group(1))
    assert per_device * processes == one and one % gens == 0


@pytest.mark.slow
def test_models_in_code_block_runs(tmp_path, monkeypatch):
    """The block as written but for the warm starts' lengths (2 tiny steps, 1 SmolLM2 step),
    into a cache of its own; the SmolLM2 half needs the [real] extra."""
    import mrtpo.tasks.builtin
    from mrtpo.model.builtin import check_available

    monkeypatch.setenv("MRTPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(mrtpo.tasks.builtin, "default_warm_steps", lambda name: 2)
    code = block_after("## Models in code")
    assert "warm_steps=30" in code
    code = code.replace("warm_steps=30", "warm_steps=1")
    if check_available("smollm2-135m-instruct") is not None:
        code = code[: code.index("# SmolLM2-135M-Instruct after")]  # the tiny half only
    scope: dict = {}
    exec(compile(code, "docs/trl.md models in code", "exec"), scope)
    assert scope["tiny_tokenizer"].chat_template
    assert (tmp_path / "cache").is_dir()
    if "model" in scope:
        assert (scope["folder"] / "warm_start.json").is_file()
        assert scope["model"].config.model_type == "llama"


@pytest.mark.slow
def test_quick_start_starts_with_every_reward_live(tmp_path, monkeypatch, models_cache):
    """The quick start as written (2 steps) but for its model: the constraints task's built-in
    tiny model, warm-started on the references as `mrtpo train --task constraints` starts
    (shared with the README's CLI quick start through the session's model cache), in place of
    SmolLM2 after its 30 warm steps, which take minutes on a CPU (the SmolLM2 figures, run
    once by hand, are in issue 45's report). At step 1 every reward scores somewhere in the
    batch and the loss and replay are live: the start the warm start exists to give."""
    pytest.importorskip("trl")
    code = block_after("## Quick start")
    model_lines = code[code.index("folder = initial_folder(") : code.index("dataset =")]
    assert '"smollm2-135m-instruct", task' in model_lines and "warm_steps=30" in model_lines
    code = code.replace(
        model_lines,
        "from mrtpo.model import default_model\nmodel, tokenizer = default_model(task, seed=0)\n",
    )
    assert 'load_task("constraints-real")' in code and "max_steps=20" in code
    code = code.replace('load_task("constraints-real")', 'load_task("constraints")')
    code = code.replace("max_steps=20", "max_steps=2")
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/trl.md quick start", "exec"), scope)
    trainer = scope["trainer"]
    assert trainer.state.global_step == 2
    first = trainer.state.log_history[0]
    names = [v.name for v in scope["task"].verifiers]
    assert names == ["start_phrase", "keyword_include", "end_phrase"]
    assert all(first[f"rewards/{name}/mean"] > 0 for name in names), first
    assert first["mrtpo/replay/pairs"] > 0 and first["loss"] != 0, first
