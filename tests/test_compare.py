"""``mrtpo compare``: variants, bootstrap interval, resumable runs, per-task results folder,
and a 2-step smoke run of every built-in task family and every relevance variant."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_trainer import TINY, standin_task

import mrtpo.training.compare as compare
from mrtpo.replay.api import control_span
from mrtpo.tasks.builtin import load_task
from mrtpo.training.compare import plan_run, run_compare, run_key
from mrtpo.training.config import CompareConfig, TrainConfig, check_algos, parse_variant
from mrtpo.training.metrics import analogue_chars
from mrtpo.training.stats import bootstrap_ratio

_REAL_FINGERPRINT = compare.code_fingerprint


@pytest.fixture(autouse=True)
def _fixed_code(monkeypatch):
    """The code fingerprint of these runs, fixed: the working tree may change while a test
    runs (`test_an_edit_of_the_code_retrains` changes it on purpose)."""
    monkeypatch.setattr(compare, "code_fingerprint", lambda: "code-under-test")


def _cfg(tmp_path, task="constraints", algos=("gdpo", "mrtpo"), seeds=1, steps=2, **train):
    base = dict(
        prompts_per_step=2,
        group_size=2,
        max_new_tokens=6,
        micro_batch=4,
        device="cpu",
        threads=1,
        checkpoint_every=2,
        html_samples=1,
        cache_dir=str(tmp_path / "cache"),
        tiny=TINY,
    )
    base.update(train)
    return CompareConfig(
        task=task,
        algos=tuple(algos),
        seeds=seeds,
        steps=steps,
        window=1,
        out=str(tmp_path / "runs"),
        results=str(tmp_path / "res"),
        train=TrainConfig(**base),
    )


def test_variant_labels():
    assert parse_variant("mrtpo") == ("mrtpo", {})
    assert parse_variant("mrtpo:specific") == ("mrtpo", {"relevance": "specific"})
    assert parse_variant("mrtpo:control:gamma=2") == (
        "mrtpo",
        {"relevance": "control", "gamma": 2.0},
    )
    assert parse_variant("mrtpo:specific:gamma=2:stop_credit=uniform") == (
        "mrtpo",
        {"relevance": "specific", "gamma": 2.0, "stop_credit": "uniform"},
    )
    bad_labels = ("gdpo:specific", "mrtpo:sharp", "mrtpo:beta=1", "mrtpo:gamma=x", "foo")
    for bad in (*bad_labels, "mrtpo:stop_credit=eos", "mrtpo:truncated_credit=1"):
        with pytest.raises(ValueError):
            parse_variant(bad)
    assert check_algos(("gdpo", "mrtpo:specific", "mrtpo:gamma=2")) is None
    # Issue 32, item 4: a setting given twice was accepted and the last value won
    for twice in (
        "mrtpo:gamma=2:gamma=3",
        "mrtpo:gamma=2:gamma=2",
        "mrtpo:specific:control",
        "mrtpo:specific:relevance=control",
        "mrtpo:stop_credit=uniform:stop_credit=relevance",
    ):
        with pytest.raises(ValueError, match="set twice") as err:
            parse_variant(twice)
        assert repr(twice) in str(err.value)
        assert repr(twice) in check_algos(("gdpo", twice))
    assert "mrtpo:sharp" in check_algos(("mrtpo:sharp",))
    cfg = CompareConfig(algos=("mrtpo:control:gamma=2",))
    run = cfg.run_config("mrtpo:control:gamma=2", 1)
    assert (run.algo, run.relevance, run.gamma, run.seed) == ("mrtpo", "control", 2.0, 1)
    assert run.out.endswith("constraints/mrtpo-control-gamma2-seed1")


def test_bootstrap_interval_contains_the_ratio_and_shrinks_with_spread():
    lo, hi = bootstrap_ratio([30, 32, 28, 31, 29], [40, 41, 39, 42, 38])
    assert lo < 30 / 40 < hi and hi < 1.0
    wide = bootstrap_ratio([10, 50, 30, 45, 15], [40, 20, 60, 35, 45])
    assert wide[1] - wide[0] > hi - lo
    assert bootstrap_ratio([1.0], [1.0]) == (1.0, 1.0)
    d_lo, d_hi = bootstrap_ratio([0.5, 0.6], [0.4, 0.4], diff=True)
    assert 0.1 - 1e-12 <= d_lo <= d_hi <= 0.2 + 1e-12


def test_control_span_is_unchecked_and_of_similar_length():
    prompt = "Write about rain. Include the word cat. End with bye."
    spans = [[(18, 39)], [(40, 53)], []]
    ((a, b),) = control_span(prompt, spans)
    assert prompt[a:b] == "Write about rain."
    assert control_span(prompt, [[], []]) == []
    assert control_span(prompt, [[(0, len(prompt))]]) == []
    long = "word " * 40 + "Check this."
    ((a, b),) = control_span(long, [[(len(long) - 11, len(long))]])
    assert b <= len(long) - 11 and 8 <= b - a <= 20 and long[a:b].strip() == long[a:b]


def test_sql_and_tool_credit_spans():
    sql = load_task("sql", seed=0)
    ex = next(e for e in sql.train if "WHERE" in e.reference and "'" in e.reference)
    q = ex.reference
    by = {v.name: analogue_chars(v, ex, q) for v in sql.verifiers}
    literals = [q[a:b] for a, b in by["sql_match"] if q[a] == "'"]
    assert literals and all(lit in q for lit in literals)
    assert all(q[a:b].isidentifier() for a, b in by["sql_schema"])
    assert set(by["sql_runs"]) <= set(by["sql_match"])
    tools = load_task("tools", seed=0)
    ex = tools.train[0]
    call = ex.reference
    by = {v.name: analogue_chars(v, ex, call) for v in tools.verifiers}
    assert [call[a:b] for a, b in by["tool_name"]] == [json.dumps(ex.fields["gold"]["name"])]
    keys = [json.loads(call[a:b]) for a, b in by["tool_schema"]]
    assert keys == list(ex.fields["gold"]["arguments"])
    vals = [json.loads(call[a:b]) for a, b in by["tool_args"]]
    assert vals == list(ex.fields["gold"]["arguments"].values())
    assert by["tool_format"] is None
    assert analogue_chars(tools.verifiers[1], ex, "not json") == []


def test_compare_variants_resume_and_results_folder(tmp_path):
    algos = ("gdpo", "mrtpo", "mrtpo:specific", "mrtpo:control:gamma=2")
    cfg = _cfg(tmp_path, algos=algos, seeds=1)
    logs = []
    summary = run_compare(cfg, task=standin_task(), log=logs.append)
    assert [len(summary["runs"][a]) for a in algos] == [1, 1, 1, 1]
    res = tmp_path / "res" / "constraints"
    md = (res / "compare.md").read_text()
    assert "## The claim" in md and "95% CI" in md and "| mrtpo:specific |" in md
    assert "Starting pass rates" in md and "mrtpo compare --task constraints" in md
    assert (res / "compare.png").read_bytes()[:4] == b"\x89PNG"
    g = summary["runs"]["gdpo"][0]
    assert g["credit_precision"] == pytest.approx(g["uniform_share"])  # uniform weights
    for a in algos:
        for r in summary["runs"][a]:
            assert 0.0 <= r["auc"] <= 1.0 and len(r["curve"]) == 2
    # a second call reuses every finished run and gives the same numbers
    logs2 = []
    again = run_compare(cfg, task=standin_task(), log=logs2.append)
    assert sum("(reused)" in line for line in logs2) == 4
    assert (
        again["runs"]["mrtpo:specific"][0]["curve"] == summary["runs"]["mrtpo:specific"][0]["curve"]
    )
    # another target reuses the runs but measures steps to target under the new target
    low = replace(cfg, target=1e-9, window=1)
    logs_t = []
    relaxed = run_compare(low, task=standin_task(), log=logs_t.append)
    assert sum("(reused)" in line for line in logs_t) == 4
    for a in algos:
        curve = summary["runs"][a][0]["curve"]
        first = next((i + 1 for i, v in enumerate(curve) if v >= 1e-9), None)
        assert relaxed["runs"][a][0]["steps_to_target"] == first
        assert relaxed["runs"][a][0]["curve"] == curve
    # the reused summary comes from the run's metrics, not from what the last call saved
    done = tmp_path / "runs" / "constraints" / "gdpo-seed0" / "compare_run.json"
    saved = json.loads(done.read_text())
    saved["summary"]["steps_to_target"] = 999
    done.write_text(json.dumps(saved))
    again2 = run_compare(low, task=standin_task(), log=lambda _: None)
    assert (
        again2["runs"]["gdpo"][0]["steps_to_target"]
        == relaxed["runs"]["gdpo"][0]["steps_to_target"]
    )
    # another setting is not reused
    other = _cfg(tmp_path, algos=("gdpo",), seeds=1, lr=1e-3)
    logs3 = []
    run_compare(other, task=standin_task(), log=logs3.append)
    assert not any("(reused)" in line for line in logs3)


@pytest.mark.parametrize(
    "task,algos",
    [
        ("constraints-full", ("gdpo", "mrtpo:specific", "mrtpo:logratio")),
        ("sql", ("mrtpo:control",)),
        ("tools", ("mrtpo", "mrtpo:oracle")),
    ],
)
def test_two_step_smoke_on_builtin_tasks(tmp_path, task, algos):
    cfg = _cfg(tmp_path, task=task, algos=algos)
    summary = run_compare(cfg, log=lambda msg: None)
    names = summary["reward_names"]
    assert names == [v.name for v in load_task(task, seed=0).verifiers]
    for a in algos:
        (r,) = summary["runs"][a]
        assert set(r["start_pass"]) == set(names) and len(r["curve"]) == 2
    assert (tmp_path / "res" / task / "compare.md").is_file()


def test_oracle_relevance_puts_every_allocation_on_the_verifier_tokens(monkeypatch):
    # the diagnostic relevance: 1 on the tokens each verifier names, so every reward whose
    # verifier names a proper subset of a response allocates only there (precision 1)
    from types import SimpleNamespace

    import mrtpo.training.step_advantages as step_advantages

    b = lambda *xs: torch.tensor(xs, dtype=torch.bool)
    masks = [[b(1, 0, 0, 1), None], [b(1, 1, 1), b(0, 1, 0)]]

    task = SimpleNamespace(verifiers=[object(), object()])
    monkeypatch.setattr(step_advantages, "relevant_token_masks", lambda t, ro: masks)
    rel = step_advantages.oracle_relevance(task, None, torch.tensor([4, 3]))
    want = torch.tensor([[1, 0, 0, 1, 0, 0, 0], [0, 0, 0, 0, 0, 1, 0]], dtype=torch.float32)
    assert torch.equal(rel, want)  # all-true and None masks: 0 (uniform allocation)


def _fake_compare_run(run_cfg, key, *, rows, step, complete):
    out = Path(run_cfg.out)
    out.mkdir(parents=True)
    text = "".join(json.dumps({"step": i + 1, "all_pass": 0.0}) + "\n" for i in range(rows))
    (out / "metrics.jsonl").write_text(text)
    if step is not None:
        (out / "checkpoint").mkdir()
        (out / "checkpoint" / "meta.json").write_text(json.dumps({"format": 1, "step": step}))
    record = {"algo": "gdpo", "key": key, "complete": complete, "summary": {"wall_s": 1.0}}
    (out / "compare_run.json").write_text(json.dumps(record))


def test_reuse_is_keyed_by_every_setting_of_a_run_and_partial_runs_resume(tmp_path):
    cfg = _cfg(tmp_path, algos=("gdpo",), steps=4)
    run = cfg.run_config("gdpo", 0)
    key = run_key(run)
    assert key["steps"] == 4 and key["device"] == "cpu" and key["threads"] == 1
    assert key["code"] == "code-under-test" and set(key["versions"]) == {"torch", "transformers"}
    cases = [  # (the record's key, metrics rows, checkpoint step, finished) -> plan
        (key, 4, 4, True, ("reuse", None)),
        ({**key, "steps": 2}, 2, 2, True, ("resume", 2)),  # made with fewer --steps
        ({**key, "steps": 6}, 6, 6, True, ("fresh", "made with more steps (6)")),
        (key, 3, 2, False, ("resume", 2)),  # killed at step 3, checkpoint at 2
        (key, 2, 2, True, ("resume", 2)),  # marked finished, history short: not complete
        (key, 0, None, False, ("resume", 0)),  # killed before the first checkpoint
        ({**key, "lr": 1.0}, 4, 4, True, ("fresh", "made with other settings")),
        ({**key, "threads": 2}, 4, 4, True, ("fresh", "made with other settings")),
        ({**key, "device": "cuda:0"}, 4, 4, True, ("fresh", "made with other settings")),
        ({**key, "code": "edited"}, 4, 4, True, ("fresh", "made with other settings")),
        ({**key, "versions": {}}, 4, 4, True, ("fresh", "made with other settings")),
    ]
    for i, (saved, rows, step, complete, want) in enumerate(cases):
        r = replace(run, out=str(tmp_path / f"case{i}"))
        _fake_compare_run(r, saved, rows=rows, step=step, complete=complete)
        action, found = plan_run(r, key)
        if action == "reuse":
            found = None if [m["step"] for m in found] == [1, 2, 3, 4] else found
        assert (action, found) == want, (i, action, found)
    assert plan_run(replace(run, out=str(tmp_path / "none")), key) == ("fresh", None)
    assert plan_run(replace(run, out=str(tmp_path / "case0")), key, rerun=True)[0] == "fresh"


def test_more_steps_resume_the_shorter_runs_instead_of_reusing_them(tmp_path):
    short = _cfg(tmp_path, algos=("gdpo",), steps=2)
    first = run_compare(short, task=standin_task(), log=lambda _: None)
    logs = []
    longer = run_compare(replace(short, steps=3), task=standin_task(), log=logs.append)
    assert not any("(reused)" in line for line in logs), logs
    assert sum("(resumed from step 2)" in line for line in logs) == 1, logs
    curve = longer["runs"]["gdpo"][0]["curve"]
    assert len(curve) == 3 and curve[:2] == first["runs"]["gdpo"][0]["curve"]
    # held-out evaluations as in a 3-step run done in one go: before the first step and after
    # the last, not also at the 2-step run's last step (issue 41, item 8)
    assert first["runs"]["gdpo"][0]["heldout"]["steps"] == [0, 2]
    assert longer["runs"]["gdpo"][0]["heldout"]["steps"] == [0, 3]
    logs = []
    again = run_compare(replace(short, steps=3), task=standin_task(), log=logs.append)
    assert (
        sum("(reused)" in line for line in logs) == 1 and again["runs"]["gdpo"][0]["curve"] == curve
    )


def test_a_start_that_already_meets_the_target_is_reported_and_the_table_written(
    tmp_path, monkeypatch
):
    """Issue 41, item 1: with the start's held-out all-pass already at the target (held-out
    steps to target 0), the comparison ended in a ZeroDivisionError after all the training,
    and neither the table nor the plot was written."""
    import mrtpo.training.trainer as trainer_module

    def meets(model, prompter, task, cfg, device, *, step, amp=None):
        names = [v.name for v in task.verifiers]
        return {"step": step, "all_pass": 1.0, "pass": dict.fromkeys(names, 1.0), "answers": 4,
                "truncated": 0.0, "seconds": 0.0}  # fmt: skip

    monkeypatch.setattr(trainer_module, "evaluate_heldout", meets)
    cfg = replace(_cfg(tmp_path, seeds=2), target=0.5)
    logs = []
    summary = run_compare(cfg, task=standin_task(), log=logs.append)
    assert all(r["heldout"]["steps_to_target"] == 0 for rs in summary["runs"].values() for r in rs)
    res = tmp_path / "res" / "constraints"
    md = (res / "compare.md").read_text()
    assert "not compared, the start already meets the target on every seed (0, 1" in md
    assert "0 (the start meets the target), 0 (the start meets the target)" in md
    assert "## Results on the training curve" in md
    assert (res / "compare.png").read_bytes()[:4] == b"\x89PNG"
    assert sum("steps to target 0 (the start already meets the target)" in m for m in logs) == 4


def test_a_task_without_eval_prompts_is_refused_before_any_model_or_run(tmp_path):
    """Issue 41, item 12: through compare too, refused before the models are warm-started
    and any run folder written."""
    task = standin_task()
    task.eval.clear()
    cfg = _cfg(tmp_path, algos=("gdpo",))
    with pytest.raises(ValueError, match="task: 'standin' has no eval prompts"):
        run_compare(cfg, task=task, log=lambda _: None)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_every_variant_is_checked_before_any_run_trains(tmp_path):
    for bad, needle in (
        ("mrtpo:alpha=2", "alpha in 'mrtpo:alpha=2'"),
        ("mrtpo:gamma=inf", "gamma"),
    ):
        cfg = _cfg(tmp_path, algos=("gdpo", bad))
        with pytest.raises(ValueError, match=f"algos: .*{needle}"):
            run_compare(cfg, task=standin_task(), log=lambda _: None)
        assert not (tmp_path / "runs").exists() and not (tmp_path / "cache").exists()


def test_an_edit_of_the_code_retrains(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path, algos=("gdpo",), steps=1)
    run_compare(cfg, task=standin_task(), log=lambda _: None)
    logs = []
    run_compare(cfg, task=standin_task(), log=logs.append)
    assert sum("(reused)" in line for line in logs) == 1
    monkeypatch.setattr(compare, "code_fingerprint", lambda: "a verifier was edited")
    logs = []
    run_compare(cfg, task=standin_task(), log=logs.append)
    assert sum("replaced a run made with other settings" in line for line in logs) == 1, logs


def test_code_fingerprint_reads_the_sources():
    first = _REAL_FINGERPRINT()
    assert len(first) == 16 and int(first, 16) >= 0


def test_reuse_key_holds_the_model_content_not_its_path(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen2"}')
    (folder / "model.safetensors").write_bytes(b"weights-a")
    cfg = TrainConfig(model=str(folder), out=str(tmp_path / "run"))
    key = run_key(cfg)
    assert key["model_content"] == compare.model_fingerprint(folder)
    assert run_key(cfg) == key
    (folder / "model.safetensors").write_bytes(b"weights-b")  # the model replaced in place
    replaced = run_key(cfg)
    assert replaced["model_content"] != key["model_content"] and replaced != key
    (folder / "model.safetensors").write_bytes(b"weights-a")
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert run_key(cfg)["model_content"] != key["model_content"]
    copy = tmp_path / "elsewhere"
    copy.mkdir()
    (copy / "config.json").write_text('{"model_type": "qwen2"}')
    (copy / "model.safetensors").write_bytes(b"weights-a")
    assert compare.model_fingerprint(copy) == key["model_content"]
    assert "model_content" not in run_key(TrainConfig(out=str(tmp_path / "run")))
