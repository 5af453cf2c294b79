"""Trainer tests on a small stand-in task (three verifiers, one without prompt spans)."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from mrtpo.training.config import TinyConfig, TrainConfig
from mrtpo.training.metrics import credit_precision
from mrtpo.training.trainer import Trainer, compute_advantages, train
from mrtpo.verifiers import Example, Task, Verdict

TOPICS = ["cats", "the sea", "red trains", "old maps", "rain", "bread", "owls", "stone walls"]
KEYWORDS = ["blue", "quiet", "seven", "gold", "warm", "late"]
ENDINGS = ["the end", "thank you", "so it goes"]


class IncludeVerifier:
    name = "include"

    def __call__(self, ex, response):
        span = tuple(ex.fields["include_span"])
        ok = re.search(rf"\b{ex.fields['keyword']}\b", response) is not None
        return Verdict(1.0 if ok else 0.0, (span,), None if ok else "keyword missing")

    def relevant_chars(self, ex, response):
        return [m.span() for m in re.finditer(rf"\b{ex.fields['keyword']}\b", response)]


class EndVerifier:
    name = "ending"

    def __call__(self, ex, response):
        span = tuple(ex.fields["end_span"])
        ok = response.strip().endswith(ex.fields["ending"])
        return Verdict(1.0 if ok else 0.0, (span,), None if ok else "wrong ending")

    def relevant_chars(self, ex, response):
        end = len(response.rstrip())
        return [(max(0, end - len(ex.fields["ending"])), end)]


class ShortVerifier:
    """Reads no specific prompt span: has_info is False for it."""

    name = "short"

    def __call__(self, ex, response):
        ok = len(response.split()) <= 8
        return Verdict(1.0 if ok else 0.0, (), None if ok else "too long")


def make_example(i: int) -> Example:
    topic = TOPICS[i % len(TOPICS)]
    kw = KEYWORDS[(i * 5) % len(KEYWORDS)]
    end = ENDINGS[(i * 7) % len(ENDINGS)]
    first = f"Write about {topic}. "
    inc = f"Include the word {kw}. "
    fin = f"End with {end}."
    prompt = first + inc + fin
    fields = {
        "keyword": kw,
        "ending": end,
        "include_span": [len(first), len(first) + len(inc)],
        "end_span": [len(first) + len(inc), len(prompt)],
    }
    return Example(f"ex{i}", prompt, fields, f"{topic} is {kw} {end}")


def standin_task() -> Task:
    examples = [make_example(i) for i in range(24)]
    return Task(
        "standin", [IncludeVerifier(), EndVerifier(), ShortVerifier()], examples[:20], examples[20:]
    )


TINY = TinyConfig(
    vocab_size=300,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    warm_steps=30,
    warm_batch=8,
    warm_lr=3e-3,
)


def tiny_config(tmp_path, **kw) -> TrainConfig:
    base = dict(
        task="standin",
        algo="mrtpo",
        steps=2,
        seed=0,
        out=str(tmp_path / "run"),
        prompts_per_step=2,
        group_size=3,
        max_new_tokens=10,
        micro_batch=4,
        minibatches=2,
        checkpoint_every=1,
        device="cpu",
        cache_dir=str(tmp_path / "cache"),
        tiny=TINY,
    )
    base.update(kw)
    return TrainConfig(**base)


def _comparable(rows):
    """Rows without their timings (the step's and each held-out evaluation's seconds)."""
    out = []
    for r in rows:
        r = {k: v for k, v in r.items() if k != "time"}
        if "eval" in r:
            r["eval"] = [{k: v for k, v in e.items() if k != "seconds"} for e in r["eval"]]
        out.append(r)
    return out


def test_two_step_train_writes_outputs(tmp_path):
    # the mixed task: the stand-in's rewards never vary in a group on the tiny model, so
    # nothing would be replayed (replay only what can move)
    res = train(tiny_config(tmp_path), task=mixed_task(), progress=False)
    assert [r["step"] for r in res.metrics] == [1, 2]
    lines = res.metrics_path.read_text().splitlines()
    assert len(lines) == 2
    row = json.loads(lines[-1])
    for name in ("include", "ending", "short", "parity", "graded"):
        assert 0.0 <= row[f"pass/{name}"] <= 1.0
    assert row["relevance/short"] is None  # no spans: no replay
    rel = [row[f"relevance/{n}"] for n in ("include", "ending", "parity", "graded")]
    assert row["replay/pairs"] > 0 and any(v is not None for v in rel)
    assert all(v is None or 0.0 <= v <= 1.0 for v in rel)
    assert res.curves_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = res.html_path.read_text()
    assert "<span class='tok'" in page and "include" in page
    assert (res.checkpoint / "state.pt").exists()


def test_same_seed_same_metrics(tmp_path):
    a = train(tiny_config(tmp_path / "a"), task=standin_task(), progress=False)
    b = train(tiny_config(tmp_path / "b"), task=standin_task(), progress=False)
    assert _comparable(a.metrics) == _comparable(b.metrics)
    c = train(tiny_config(tmp_path / "c", seed=1), task=standin_task(), progress=False)
    assert _comparable(a.metrics) != _comparable(c.metrics)


def test_resume_matches_uninterrupted_run(tmp_path):
    full = Trainer(tiny_config(tmp_path / "full", steps=3), task=standin_task())
    full.run(progress=False)
    part = tiny_config(tmp_path / "part", steps=2)
    train(part, task=standin_task(), progress=False)
    resumed = Trainer(tiny_config(tmp_path / "part", steps=3, resume=True), task=standin_task())
    assert resumed.step == 2
    resumed.run(progress=False)
    got, want = _comparable(resumed.metrics), _comparable(full.metrics)
    # the shorter run evaluated its last policy (step 2); the uninterrupted 3-step run has no
    # evaluation there, and neither has the run extended from it (issue 41, item 8)
    assert "eval" not in want[1] and "eval" not in got[1]
    assert got == want
    on_disk = [json.loads(line) for line in resumed.run_dir.metrics_path.read_text().splitlines()]
    assert _comparable(on_disk) == want
    for (na, pa), (nb, pb) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    sa, sb = full.opt.state_dict()["state"], resumed.opt.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key]["exp_avg"], sb[key]["exp_avg"])


@pytest.mark.parametrize("algo", ["grpo", "gdpo"])
def test_baseline_algorithms_run(tmp_path, algo):
    res = train(
        tiny_config(tmp_path, algo=algo, steps=1, replay_for_baselines=False),
        task=standin_task(),
        progress=False,
    )
    row = res.metrics[0]
    assert row["algo"] == algo and row["relevance/include"] is None
    assert row["time"]["replays"] == 0


@pytest.mark.parametrize("mode", ["relevance", "uniform"])
def test_truncated_credit_gives_cut_responses_the_gdpo_broadcast(tmp_path, monkeypatch, mode):
    import mrtpo.training.step_advantages as advantages_mod
    import mrtpo.training.trainer as trainer_mod

    seen = {}
    real_rollouts, real_op = trainer_mod.generate_rollouts, advantages_mod.mrtpo_token_advantages

    def rollouts(*a, **kw):
        seen["ro"] = real_rollouts(*a, **kw)
        return seen["ro"]

    def token_advantages(*a, has_info, **kw):  # the has_info the op allocates with
        seen["has_info"] = has_info.clone()
        out = real_op(*a, has_info=has_info, **kw)
        seen["alloc"] = out.allocation
        return out

    monkeypatch.setattr(trainer_mod, "generate_rollouts", rollouts)
    monkeypatch.setattr(advantages_mod, "mrtpo_token_advantages", token_advantages)
    cfg = tiny_config(tmp_path, steps=1, max_new_tokens=3, truncated_credit=mode)
    Trainer(cfg, task=mixed_task()).train_step()  # rewards that move: a replay to allocate
    cut = torch.tensor(seen["ro"].truncated)
    spans = torch.tensor([[len(s) > 0 for s in row] for row in seen["ro"].spans])
    assert cut.any() and spans.any()  # 3 tokens: answers are cut
    want = spans & ~cut[:, None] if mode == "uniform" else spans
    assert torch.equal(seen["has_info"], want)
    lengths = torch.tensor([len(r) for r in seen["ro"].responses])
    rows = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    on_cut = seen["alloc"][:, cut[rows]]
    if mode == "uniform":
        assert torch.all(on_cut == 1)  # every reward broadcast on a cut answer
    else:
        assert not torch.all(on_cut == 1)


def _toy_batch():
    torch.manual_seed(3)
    n, k = 6, 3
    rewards = torch.randint(0, 2, (n, k)).float()
    groups = torch.arange(2).repeat_interleave(3)
    lengths = torch.tensor([3, 5, 2, 4, 4, 1])
    rel = torch.rand(k, int(lengths.sum()))
    has_info = torch.tensor([[True, True, False]] * n)
    return rewards, groups, rel, has_info, lengths


def test_alpha_zero_is_gdpo():
    rewards, groups, rel, has_info, lengths = _toy_batch()
    cfg0 = TrainConfig(alpha=0.0)
    tok_m, _ = compute_advantages("mrtpo", rewards, groups, rel, has_info, lengths, cfg0)
    tok_g, alloc_g = compute_advantages("gdpo", rewards, groups, rel, has_info, lengths, cfg0)
    torch.testing.assert_close(tok_m, tok_g, rtol=1e-6, atol=1e-6)
    assert torch.all(alloc_g == 1)
    tok_m1, _ = compute_advantages("mrtpo", rewards, groups, rel, has_info, lengths, TrainConfig())
    assert not torch.allclose(tok_m1, tok_g)


@pytest.mark.parametrize("gamma", [1.0, 2.0])
def test_stop_credit_uniform_gives_the_stop_token_weight_one(gamma):
    rewards, groups, rel, has_info, lengths = _toy_batch()
    finished = torch.tensor([True, False, True, True, True, True])
    last = torch.cumsum(lengths, 0) - 1
    cfg = TrainConfig(stop_credit="uniform", gamma=gamma)
    tok, alloc = compute_advantages(
        "mrtpo", rewards, groups, rel, has_info, lengths, cfg, finished=finished
    )
    _, plain = compute_advantages(
        "mrtpo",
        rewards,
        groups,
        rel,
        has_info,
        lengths,
        TrainConfig(gamma=gamma),
        finished=finished,
    )
    ends = last[finished & (lengths >= 2)]
    torch.testing.assert_close(alloc[:2, ends], torch.ones(2, len(ends)))  # rewards with spans
    assert not torch.allclose(plain[:2, ends], torch.ones(2, len(ends)))
    # a cut response (1) and a one-token response (5) are left as they were (to float32's
    # rounding: with stop credit every d^gamma is taken in float64, see stop_token_at_mean)
    for i in (1, 5):
        torch.testing.assert_close(alloc[:, last[i]], plain[:, last[i]], rtol=2.4e-7, atol=0.0)
    # every other token keeps its relevance: the weights stay proportional to d^gamma
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    a, b = int(last[0]) - int(lengths[0]) + 1, int(last[0])
    ratio = alloc[0, a:b] / rel[0, a:b].double().pow(gamma).float()
    torch.testing.assert_close(ratio, ratio[:1].expand_as(ratio))
    assert seg.numel() == tok.numel()


def _stop_credit_reference(rel, has_info, lengths, finished, gamma, alpha, delta=1e-8):
    """METHOD.md section 4's weights with --stop-credit uniform, in float64 from scratch:
    per response and reward, w_hat = d^gamma / (mean of d^gamma over the other tokens) and
    1 at the stop token of a finished response; uniform without spans or below the floor."""
    out = torch.ones(rel.shape, dtype=torch.float64)
    a = 0
    for i, n in enumerate(lengths.tolist()):
        for k in range(rel.shape[0]):
            q = rel[k, a : a + n].double() ** gamma
            stop = bool(finished[i]) and n >= 2
            if stop:
                q[-1] = q[:-1].mean()
            mean = q.mean()
            if has_info[i, k] and mean >= max(delta, 2.0**-126):
                out[k, a : a + n] = (1 - alpha) + alpha * q / mean
        a += n
    return out


@pytest.mark.parametrize("alpha", [1.0, 0.5])
@pytest.mark.parametrize("gamma", [1e-6, 1e-3, 0.01, 0.3, 1.0, 4.0, 40.0])
def test_stop_credit_uniform_matches_a_float64_reference_at_extreme_gamma(gamma, alpha):
    """Issue 32, item 3: at gamma 0.01 the stop token's d, (mean d^gamma)^(1 / gamma),
    underflowed in float32 when most of a response's relevance is 0 (the specific mode's
    floor): weight 0 instead of 1, and the other tokens' weights shifted."""
    rewards, groups, rel, has_info, lengths = _toy_batch()
    rel[:, :3] = torch.tensor([0.0, 0.0, 0.9])  # response 0: d = 0, 0 before its stop token
    rel[:, 3:8] = torch.tensor([0.0, 0.0, 0.0, 0.3, 0.5])  # response 1: 3 of 4 others 0
    rel[1, 14:18] = torch.tensor([1e-30, 1e-5, 0.7, 0.2])  # response 4: a tiny d
    finished = torch.tensor([True, True, True, False, True, True])
    cfg = TrainConfig(stop_credit="uniform", gamma=gamma, alpha=alpha)
    tok, alloc = compute_advantages(
        "mrtpo", rewards, groups, rel, has_info, lengths, cfg, finished=finished
    )
    ref = _stop_credit_reference(rel, has_info, lengths, finished, gamma, alpha)
    # to float32's rounding of the reference (2 ulp; below float32's normal range, absolute)
    torch.testing.assert_close(alloc, ref.float(), rtol=2.4e-7, atol=2.0**-126)
    last = torch.cumsum(lengths, 0) - 1
    ends = last[finished & (lengths >= 2)]
    assert torch.all(alloc[:, ends] == 1.0)
    # mass: every response's token advantages sum to its GDPO advantage times its length
    seq, _ = compute_advantages("gdpo", rewards, groups, rel, has_info, lengths, cfg)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    sums = torch.zeros(len(lengths), dtype=torch.float64).index_add_(0, seg, tok.double())
    per_seq = seq[last].double()
    torch.testing.assert_close(sums, per_seq * lengths, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tok[ends], seq[ends], rtol=1e-6, atol=1e-6)


def test_credit_precision_against_hand_count():
    alloc = torch.tensor([[1.0, 3.0, 0.0, 2.0]])
    masks = [[torch.tensor([False, True, False])], [torch.tensor([True])]]
    has_info = torch.tensor([[True], [True]])
    prec, unif, cnt = credit_precision(alloc, masks, has_info, torch.tensor([3, 1]))
    assert prec[0] == pytest.approx(3.0 / 4.0) and unif[0] == pytest.approx(1.0 / 3.0)
    assert cnt == [1]  # the one-token response (all tokens relevant) is skipped


def test_config_validation_names_the_argument():
    with pytest.raises(ValueError, match="algo"):
        TrainConfig(algo="ppo").validate()
    with pytest.raises(ValueError, match="group_size"):
        TrainConfig(group_size=1).validate()
    with pytest.raises(ValueError, match="alpha"):
        TrainConfig(alpha=2.0).validate()
    with pytest.raises(ValueError, match="weight_decay: expected a finite"):
        TrainConfig(weight_decay=float("nan")).validate()
    with pytest.raises(ValueError, match="weight_decay: lr x weight_decay"):
        TrainConfig(lr=0.1, weight_decay=20.0).validate()
    with pytest.raises(ValueError, match="device"):
        TrainConfig(device="tpu").validate()
    with pytest.raises(ValueError, match="task"):
        TrainConfig(task="chess").validate()
    with pytest.raises(ValueError, match="tiny.warm_steps"):
        TrainConfig(tiny=TinyConfig(warm_steps=-1)).validate()
    TrainConfig(task="constraints:title,no_commas").validate()
    TrainConfig(task="standin").validate(builtin_task=False)


def test_any_local_causal_lm_untied_head(tmp_path):
    """--model PATH: a Llama with an untied LM head and no pad token trains and resumes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from mrtpo.model.loading import build_tokenizer, save_model, task_texts

    task = standin_task()
    tok = build_tokenizer(task_texts(task), vocab_size=300)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    save_model(model, tok, tmp_path / "llama")
    res = train(
        tiny_config(tmp_path, model=str(tmp_path / "llama"), steps=1), task=task, progress=False
    )
    row = res.metrics[0]  # the stand-in's rewards do not move: the replay is skipped
    assert row["step"] == 1 and row["replay/pairs"] == 0 and row["replay/skipped"] > 0
    assert row["relevance/include"] is None
    res = train(tiny_config(tmp_path, model=str(tmp_path / "llama"), steps=1, overwrite=True),
                task=mixed_task(), progress=False)  # fmt: skip
    row = res.metrics[0]  # rewards that move: the untied head serves the replay
    assert row["replay/pairs"] > 0
    assert any(row[f"relevance/{n}"] is not None for n in ("parity", "graded"))
    trained = res.checkpoint / "model"
    assert (trained / "config.json").exists()


def test_heldout_evaluations_are_logged_and_leave_training_unchanged(tmp_path):
    task = standin_task()
    cfg = tiny_config(tmp_path, steps=5, eval_every=2, eval_prompts=3, eval_samples=2)
    res = train(cfg, task=task, progress=False)
    rows = [json.loads(line) for line in res.metrics_path.read_text().splitlines()]
    at = {r["step"]: [e["step"] for e in r.get("eval", [])] for r in rows}
    assert at == {1: [0], 2: [2], 3: [], 4: [4], 5: [5]}  # before step 1, every 2, the last
    for r in rows:
        for e in r.get("eval", []):
            assert e["answers"] == 3 * 2 and 0.0 <= e["all_pass"] <= 1.0
            assert set(e["pass"]) == {"include", "ending", "short"}
            assert e["all_pass"] <= min(e["pass"].values())
    # the evaluations sample in a random state of their own: the run trains as without them
    plain = train(
        replace(cfg, eval_every=0, out=str(tmp_path / "plain")), task=task, progress=False
    )
    assert [r for r in _comparable(res.metrics) if r.pop("eval", True)] == _comparable(
        plain.metrics
    )
    # the same prompts and sampling seed every time: the same policy scores the same
    from mrtpo.training.heldout import evaluate_heldout

    trainer = Trainer(replace(cfg, out=str(tmp_path / "again")), task=task)
    try:
        a, b = trainer.evaluate(), trainer.evaluate()
    finally:
        trainer.run_dir.unlock()
    assert {k: v for k, v in a.items() if k != "seconds"} == {
        k: v for k, v in b.items() if k != "seconds"
    }
    with pytest.raises(ValueError, match="no eval prompts"):
        task.eval.clear()
        evaluate_heldout(trainer.model, trainer.prompter, task, cfg, trainer.device, step=0)


def test_heldout_evaluations_survive_resume(tmp_path):
    task = standin_task()
    cfg = tiny_config(tmp_path, steps=4, eval_every=2, eval_prompts=2, checkpoint_every=2)
    full = train(cfg, task=task, progress=False)
    part = train(replace(cfg, steps=2, out=str(tmp_path / "part")), task=task, progress=False)
    assert [e["step"] for e in part.metrics[-1]["eval"]] == [2]
    resumed = train(
        replace(cfg, out=str(tmp_path / "part"), resume=True), task=task, progress=False
    )
    assert _comparable(resumed.metrics) == _comparable(full.metrics)


def _rows_on_disk(out) -> list[dict]:
    return _comparable(
        [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    )


def test_the_eval_schedule_does_not_depend_on_how_the_run_was_split(tmp_path):
    """Issue 41, item 8: a run extended with --resume --steps kept the evaluation its shorter
    run made at its last step, so its held-out AUC and steps to target differed from the same
    run done in one go (its training bit-identical)."""
    from mrtpo.training.stats import heldout_summary

    task = standin_task()
    cfg = tiny_config(tmp_path, steps=5, eval_every=2, eval_prompts=2, checkpoint_every=1)
    full = train(cfg, task=task, progress=False)
    want = _rows_on_disk(cfg.out)
    assert [e["step"] for r in want for e in r.get("eval", [])] == [0, 2, 4, 5]
    # 3 steps (evaluated at 0, 2 and its last, 3), extended to 4, then to 5
    part = replace(cfg, out=str(tmp_path / "part"), steps=3)
    train(part, task=task, progress=False)
    assert [e["step"] for r in _rows_on_disk(part.out) for e in r.get("eval", [])] == [0, 2, 3]
    logs = []
    train(replace(part, steps=4, resume=True), task=task, progress=False, log=logs.append)
    assert any("removed the held-out evaluation of step 3" in m for m in logs), logs
    res = train(replace(part, steps=5, resume=True), task=task, progress=False)
    assert _rows_on_disk(part.out) == want and _comparable(res.metrics) == want
    names = ["include", "ending", "short"]
    assert heldout_summary(res.metrics, names, 0.5) == {
        **heldout_summary(full.metrics, names, 0.5),
        "seconds": heldout_summary(res.metrics, names, 0.5)["seconds"],
        "seconds_to_target": heldout_summary(res.metrics, names, 0.5)["seconds_to_target"],
        "train_s": heldout_summary(res.metrics, names, 0.5)["train_s"],
    }
    # a run resumed to end at a step its earlier part did not evaluate (a 5-step run's
    # checkpoint of step 3, resumed with --steps 3): the due evaluation is made, the same
    # one the 3-step run made in one go
    three = replace(cfg, out=str(tmp_path / "three"), steps=3)
    train(three, task=task, progress=False)
    want3 = _rows_on_disk(three.out)
    rows = [
        json.loads(line) for line in (tmp_path / "three/metrics.jsonl").read_text().splitlines()
    ]
    del rows[2]["eval"]
    (tmp_path / "three/metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = train(replace(three, resume=True), task=task, progress=False)
    assert _rows_on_disk(three.out) == want3 and _comparable(res.metrics) == want3


def test_match_schedule_keeps_only_the_evaluations_of_the_final_schedule():
    from mrtpo.training.heldout import match_schedule

    def rows(evals):
        return [{"step": s, **({"eval": [{"step": e} for e in evals[s]]} if evals.get(s) else {})}
                for s in range(1, max(evals) + 1)]  # fmt: skip

    r = rows({1: [0], 2: [2], 3: [3]})  # a 3-step run, every 2, extended to 6
    assert match_schedule(r, 2, 6) == ([3], False) and r == rows({1: [0], 2: [2], 3: []})
    r = rows({1: [0], 2: [2], 3: [3]})  # on the longer run's grid (every 3): kept
    assert match_schedule(r, 3, 6) == ([2], False) and r == rows({1: [0], 2: [], 3: [3]})
    r = rows({1: [0], 2: [2], 3: []})  # resumed to end at step 3: its evaluation is due
    assert match_schedule(r, 2, 3) == ([], True)
    r = rows({1: [0], 2: [], 3: [3]})  # a run resumed with fewer steps: nothing past 2 moves
    assert match_schedule(r, 2, 2) == ([], False) and r == rows({1: [0], 2: [], 3: [3]})


def test_a_task_without_eval_prompts_is_refused_before_anything_is_written(tmp_path):
    """Issue 41, item 12: refused only at step 0's evaluation, after the model was built and
    warm-started, leaving config.json and metrics.jsonl: the same command was then refused as
    "already holds a run"."""
    task = standin_task()
    task.eval.clear()
    cfg = tiny_config(tmp_path, steps=1, eval_every=1)
    with pytest.raises(ValueError, match="task: 'standin' has no eval prompts .*--eval-every 0"):
        Trainer(cfg, task=task)
    assert not Path(cfg.out).exists() and not Path(cfg.cache_dir).exists()
    with pytest.raises(ValueError, match="no eval prompts"):
        Trainer(replace(cfg, resume=True), task=task)
    assert not Path(cfg.out).exists()
    # without evaluations the task is usable; with its eval split back, the same command runs
    res = train(replace(cfg, eval_every=0), task=task, progress=False)
    assert "eval" not in res.metrics[0]
    res = train(replace(cfg, out=str(tmp_path / "b")), task=standin_task(), progress=False)
    assert [e["step"] for e in res.metrics[0]["eval"]] == [0, 1]


# --- Issue 32, items 6 and 11 --------------------------------------------------------------


def test_a_non_finite_weight_stops_the_run_before_it_is_saved(tmp_path):
    """Item 11: under --dtype float16 (now refused) every weight became NaN after one step
    while the run reported loss 0, saved the NaN weights and exited 0. Whatever makes an
    update non-finite, the run stops naming the step, and what is saved stays finite."""
    from safetensors.torch import load_file

    from mrtpo.training.trainer import NonFiniteWeightsError

    cfg = tiny_config(tmp_path, steps=3, checkpoint_every=1)
    t = Trainer(cfg, task=standin_task())
    real_step = t.opt.step

    def step(*args, **kwargs):
        out = real_step(*args, **kwargs)
        if t.step == 1:  # the update of step 2 makes one weight NaN
            with torch.no_grad():
                next(t.model.parameters()).view(-1)[3] = float("nan")
        return out

    t.opt.step = step
    with pytest.raises(NonFiniteWeightsError, match=r"step 2: .* made 1 of \d+ weights non-fin"):
        t.run(progress=False)
    out = Path(cfg.out)
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1]
    assert json.loads((out / "checkpoint" / "meta.json").read_text())["step"] == 1
    for f in (out / "checkpoint" / "model").glob("*.safetensors"):
        assert all(bool(torch.isfinite(v).all()) for v in load_file(f).values())
    again = Trainer(dataclasses.replace(cfg, resume=True), task=standin_task())
    assert again.step == 1  # the folder is free and resumable from the finite checkpoint
    again.run_dir.unlock()


def test_sampling_at_the_smallest_temperature_is_greedy(tmp_path, monkeypatch):
    """Item 6: at temperature 2^-126 (the smallest the settings take) generate's
    logits / temperature overflowed to inf and sampling raised; now every sample is the
    greedy answer, as the limit of sampling at temperature -> 0 is."""
    from mrtpo.training.rollouts import generate_rollouts

    cfg = tiny_config(tmp_path, temperature=2.0**-126, group_size=3)
    t = Trainer(cfg, task=standin_task())
    t.run_dir.unlock()
    with torch.no_grad():  # logits well past 4, where logit / 2^-126 leaves float32
        t.model.get_output_embeddings().weight.mul_(64.0)
    examples = t.task.train[:2]
    ro = generate_rollouts(t.model, t.prompter, t.task, examples, cfg, t.device)
    sample = t.model.generate

    def greedy_generate(**kw):  # one greedy answer per prompt, repeated G times
        g = kw["num_return_sequences"]
        out = sample(**{**kw, "do_sample": False, "num_return_sequences": 1})
        return out.repeat_interleave(g, dim=0)

    monkeypatch.setattr(t.model, "generate", greedy_generate)
    greedy = generate_rollouts(t.model, t.prompter, t.task, examples, cfg, t.device)
    assert ro.responses == greedy.responses
    assert len({tuple(r) for r in ro.responses[:3]}) == 1


class ParityVerifier:
    """Spans: the include sentence; score: the parity of the word count (varies in groups),
    0 on the even examples (whose groups then have nothing that moves)."""

    name = "parity"

    def __call__(self, ex, response):
        score = float(len(response.split()) % 2) if int(ex.id[2:]) % 2 else 0.0
        return Verdict(score, (tuple(ex.fields["include_span"]),))


class GradedVerifier:
    """Spans: the end sentence; a graded score in {0, 0.5, 1} (responses at a group's mean),
    1 on the even examples."""

    name = "graded"

    def __call__(self, ex, response):
        score = (sum(map(ord, response)) % 3) / 2 if int(ex.id[2:]) % 2 else 1.0
        return Verdict(score, (tuple(ex.fields["end_span"]),))


def mixed_task() -> Task:
    """The stand-in task with two rewards that vary within groups: zero-variance groups
    (include, ending), varying ones and responses at their group's mean, a reward without
    spans (short)."""
    examples = [make_example(i) for i in range(24)]
    verifiers = [IncludeVerifier(), ParityVerifier(), GradedVerifier(), EndVerifier(),
                 ShortVerifier()]  # fmt: skip
    return Task("mixed", verifiers, examples[:20], examples[20:])


@pytest.mark.parametrize(
    "settings",
    [{}, {"relevance": "specific"}, {"relevance": "control", "stop_credit": "uniform"}],
    ids=["js", "specific", "control-stop"],
)
def test_replay_skip_leaves_training_bit_for_bit(tmp_path, monkeypatch, settings):
    """mrtpo train replays only the pairs whose GDPO advantage moves (replay_mask_from_rewards):
    the token advantages, losses and trained weights are those of a full replay bit for bit
    (zero-variance groups, responses at their group's mean), the step logs its replayed and
    skipped pairs, and the relevance diagnostics are over the replayed pairs."""
    import mrtpo.training.trainer as trainer_mod

    def run(name, full):
        seen = {"adv": [], "mask": []}
        real_adv, real_mask = trainer_mod.compute_advantages, trainer_mod.replay_mask_from_rewards

        def advantages(*a, **kw):
            out = real_adv(*a, **kw)
            seen["adv"].append(out[0].clone())
            return out

        def mask(rewards, group_ids, *, has_info, whole_rows):
            got = real_mask(rewards, group_ids, has_info=has_info, whole_rows=whole_rows)
            seen["mask"].append((got, has_info.clone()))
            return has_info.clone() if full else got

        monkeypatch.setattr(trainer_mod, "compute_advantages", advantages)
        monkeypatch.setattr(trainer_mod, "replay_mask_from_rewards", mask)
        cfg = tiny_config(tmp_path / name, steps=3, group_size=4, **settings)
        cfg.cache_dir = str(tmp_path / "cache")  # one warm start for both runs
        tr = Trainer(cfg, task=mixed_task())
        tr.run(progress=False)
        monkeypatch.undo()
        return tr, seen

    full, seen_full = run("full", True)
    skip, seen_skip = run("skip", False)
    for a, b in zip(seen_full["adv"], seen_skip["adv"]):
        assert torch.equal(a, b)
    for (na, pa), (nb, pb) in zip(full.model.named_parameters(), skip.model.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    keys = ("loss", "grad_norm", "clip_fraction", "mean_ratio", "all_pass")
    skipped_total = 0
    for rf, rs, (got, info) in zip(full.metrics, skip.metrics, seen_skip["mask"]):
        assert all(rf[k] == rs[k] for k in keys)
        assert rs["replay/pairs"] == int(got.sum())
        assert rs["replay/skipped"] == int(info.sum()) - int(got.sum())
        assert rf["replay/skipped"] == 0 and rf["replay/pairs"] == int(info.sum())
        skipped_total += rs["replay/skipped"]
        if settings.get("relevance") == "specific":  # whole rows: a row all in or all out
            assert torch.equal(got, info & got.any(1, keepdim=True))
    assert skipped_total > 0  # the skip happened
    assert any(r["replay/pairs"] for r in skip.metrics)  # and some pairs were replayed


def test_replay_all_replays_every_pair_and_trains_the_same(tmp_path):
    """--replay-all: every pair with spans is replayed (none skipped); training is the
    default's bit for bit."""
    runs = {}
    for name, replay_all in (("skip", False), ("all", True)):
        cfg = tiny_config(tmp_path / name, steps=2, group_size=4, replay_all=replay_all)
        cfg.cache_dir = str(tmp_path / "cache")
        runs[name] = train(cfg, task=mixed_task(), progress=False)
    skip, every = runs["skip"].metrics, runs["all"].metrics
    assert all(r["replay/skipped"] == 0 for r in every)
    assert sum(r["replay/skipped"] for r in skip) > 0
    for a, b in zip(skip, every):
        assert a["replay/pairs"] + a["replay/skipped"] == b["replay/pairs"]
        assert all(a[k] == b[k] for k in ("loss", "grad_norm", "all_pass"))


def test_gradient_checkpointing_trains_the_same_run(tmp_path, monkeypatch):
    """--gradient-checkpointing recomputes the decoder's activations in the backward: the same
    run, metric for metric (the recompute is the same arithmetic), and the final weights
    equal; the trainer's model has no patched layer left after a step."""
    import torch.utils.checkpoint as ckpt

    from mrtpo.model.loading import decoder_layers

    calls = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = Trainer(tiny_config(tmp_path / "a", steps=2), task=mixed_task())
    a.run(progress=False)
    assert not calls
    b = Trainer(tiny_config(tmp_path / "b", steps=2, gradient_checkpointing=True),
                task=mixed_task())  # fmt: skip
    b.run(progress=False)
    assert calls  # the update's forwards went through the checkpoint
    ra = [
        json.loads(x) for x in (tmp_path / "a" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    rb = [
        json.loads(x) for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert _comparable(ra) == _comparable(rb)
    for pa, pb in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(pa, pb)
    assert not any("forward" in layer.__dict__ for layer in decoder_layers(b.model))


def _counted_run(tmp_path, name, *, force=False, same_batching_old=False, from_update=True,
                 **kw):  # fmt: skip
    """A run of the mixed task (group size 4, one response per micro-batch); counts the
    replay's calls and the decoder forwards inside them (a hook on the first layer), and all
    decoder forwards; keeps each step's (advantages, allocation).
    ``force``: the old path (``Trainer.force_old_forward``). ``same_batching_old``: the
    forced path's old log-probs from a no-grad forward batched as the update's (one row per
    forward), instead of the replay's packed one. ``from_update``:
    ``Trainer.replay_from_update``."""
    import mrtpo.training.trainer as trainer_mod
    from mrtpo.model.loading import decoder_layers, lm_head, logit_transform
    from mrtpo.replay.teacher_forcing import forward_responses
    from mrtpo_kernels import linear_logprobs

    base = dict(steps=2, group_size=4, micro_batch=1, minibatches=1)
    cfg = tiny_config(tmp_path / name, **{**base, **kw})
    cfg.cache_dir = str(tmp_path / "cache")  # one warm start for every run
    tr = Trainer(cfg, task=mixed_task())
    tr.force_old_forward = force
    tr.replay_from_update = from_update
    seen = {"calls": 0, "forwards": 0, "in_replay": False, "all_forwards": 0, "adv": []}

    def hook(*_):
        seen["forwards"] += seen["in_replay"]
        seen["all_forwards"] += 1

    decoder_layers(tr.model)[0].register_forward_hook(hook)
    real = trainer_mod.contrastive_replay
    real_adv = trainer_mod.compute_advantages

    def advantages(*a, **k):
        out = real_adv(*a, **k)
        seen["adv"].append(tuple(t.detach().clone() for t in out))
        return out

    def replay(model, prompter, texts, prompt_ids, responses, *a, **k):
        seen["calls"] += 1
        seen["in_replay"] = True
        try:
            out = real(model, prompter, texts, prompt_ids, responses, *a, **k)
        finally:
            seen["in_replay"] = False
        if same_batching_old:
            h = forward_responses(model, prompt_ids, responses, prompter.tokenizer.pad_token_id,
                                  micro_batch=1, device=tr.device)  # fmt: skip
            w, b = lm_head(model)
            labels = torch.cat([torch.tensor(r) for r in responses])
            out.old_logprobs = linear_logprobs(
                h, w, labels, bias=b, temperature=cfg.temperature, **logit_transform(model)
            )
        return out

    trainer_mod.contrastive_replay = replay
    trainer_mod.compute_advantages = advantages
    try:
        tr.run(progress=False)
    finally:
        trainer_mod.contrastive_replay = real
        trainer_mod.compute_advantages = real_adv
    return tr, seen


@pytest.mark.parametrize("algo", ["gdpo", "mrtpo"])
def test_on_policy_update_takes_old_logprobs_from_its_own_forward(tmp_path, algo):
    """One PPO epoch, one minibatch: the update's only optimizer step follows all of its
    forwards, so the old log-probs are its own, detached (importance ratio exactly 1, no
    clipping), and GDPO (--no-baseline-replay) runs no replay forward (MRTPO's still runs,
    for the JS; here from its own with-information forward, Trainer.replay_from_update
    False, so that only the old log-probs differ). Against the
    old path (the separate no-grad forward, Trainer.force_old_forward):
    - where that forward is batched as the update's (one row per forward), the same
      arithmetic as the update's grad forward: ratio exactly 1 there too, and the weights
      after the steps equal bit for bit;
    - the replay's own forward (packed rows, the prompt's key/value cache shared by its
      group, chunks of 2 x micro_batch rows) sums in another order, so its log-probs differ
      from the update's in the last bits (float32 ulps), the ratio is 1 +- ~1e-7 and the
      gradients scale by it: the weights agree to 1e-6 (lr / 200), not bit for bit."""
    kw = {"algo": algo, "replay_for_baselines": False, "from_update": False}
    new, seen_new = _counted_run(tmp_path, "new", **kw)
    same, seen_same = _counted_run(tmp_path, "same", force=True, same_batching_old=True, **kw)
    old, seen_old = _counted_run(tmp_path, "old", force=True, **kw)
    for tr in (new, same):
        assert all(r["mean_ratio"] == 1.0 and r["clip_fraction"] == 0.0 for r in tr.metrics)
    # the separate forward runs on the old path only (MRTPO's replay runs on both)
    assert seen_new["calls"] == (2 if algo == "mrtpo" else 0)
    assert seen_old["calls"] == seen_same["calls"] == 2
    assert seen_old["forwards"] > 0
    if algo == "mrtpo":
        assert seen_new["forwards"] == seen_old["forwards"]
    keys = ("loss", "grad_norm", "all_pass", "replay/pairs")
    for rn, rs in zip(new.metrics, same.metrics):
        assert all(rn[k] == rs[k] for k in keys)
    for (na, pa), (_, pb), (_, pc) in zip(
        new.model.named_parameters(), same.model.named_parameters(), old.model.named_parameters()
    ):
        assert torch.equal(pa, pb), na
        torch.testing.assert_close(pa, pc, rtol=0.0, atol=1e-6)


def test_mrtpo_on_policy_takes_the_with_information_side_from_the_update_forward(tmp_path):
    """MRTPO, one PPO epoch of one minibatch: the update's forwards run first, their hidden
    states (detached) feed the replay's JS and so the advantages, and the loss then runs on
    the same forwards; the replay runs only the prompts (for the caches its replays start
    from) instead of its with-information forward. The same training as the replay's own
    forward (Trainer.replay_from_update False): the advantages and allocation weights agree
    to float32 rounding (the update's padded forward and the replay's packed one sum in
    another order), the replayed pairs are the same, the weights after the steps agree to
    1e-6 (lr / 200); fewer decoder forwards in all and inside the replay."""
    kw = {"algo": "mrtpo", "replay_for_baselines": False}
    new, seen_new = _counted_run(tmp_path, "from_update", **kw)
    old, seen_old = _counted_run(tmp_path, "own_forward", from_update=False, **kw)
    assert seen_new["calls"] == seen_old["calls"] == 2
    assert seen_new["forwards"] < seen_old["forwards"]
    assert seen_new["all_forwards"] < seen_old["all_forwards"]
    assert len(seen_new["adv"]) == len(seen_old["adv"]) == 2
    moved = 0.0
    for (adv_n, alloc_n), (adv_o, alloc_o) in zip(seen_new["adv"], seen_old["adv"]):
        torch.testing.assert_close(adv_n, adv_o, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(alloc_n, alloc_o, rtol=1e-5, atol=1e-6)
        moved += float((alloc_o - 1).abs().sum())
    assert moved > 0  # the relevance moved some allocation weight off 1: the JS ran
    for rn, ro in zip(new.metrics, old.metrics):
        assert rn["replay/pairs"] == ro["replay/pairs"] and rn["mean_ratio"] == 1.0
    for (na, pa), (_, pb) in zip(new.model.named_parameters(), old.model.named_parameters()):
        torch.testing.assert_close(pa, pb, rtol=0.0, atol=1e-6, msg=na)


@pytest.mark.parametrize("micro_batch,taken", [(1, False), (64, True)], ids=["split", "one"])
def test_replay_from_update_auto_takes_the_update_forward_only_in_one_micro_batch(
    tmp_path, monkeypatch, micro_batch, taken
):
    """The default ``replay_from_update = "auto"``: the with-information side comes from the
    update's forwards where the batch is one update micro-batch (nothing held beyond what the
    update holds), and from the replay's own forward where the update splits the batch (the
    whole batch's graphs are not held at once)."""
    calls = []
    real = Trainer._update_forwards

    def counted(self, ro):
        calls.append(len(ro.responses))
        return real(self, ro)

    monkeypatch.setattr(Trainer, "_update_forwards", counted)
    cfg = tiny_config(tmp_path / "run", algo="mrtpo", steps=1, group_size=4,
                      micro_batch=micro_batch, minibatches=1)  # fmt: skip
    cfg.cache_dir = str(tmp_path / "cache")
    tr = Trainer(cfg, task=mixed_task())
    assert tr.replay_from_update == "auto"
    tr.run(progress=False)
    assert bool(calls) is taken
    assert all(n <= micro_batch for n in calls)


@pytest.mark.parametrize("ckpt", [False, True], ids=["plain", "checkpointed"])
def test_on_policy_replay_takes_the_prompt_caches_from_the_update_forward(
    tmp_path, monkeypatch, ckpt
):
    """MRTPO on-policy (the update's forwards run first): the key/value caches the replay's
    units start from come from those same forwards, so the replay runs no forward of a full
    prompt (``prompt_caches`` is never asked for one). With gradient checkpointing the
    update's layers run again in the backward, so no cache is taken there and the replay
    runs its prompts as before. Either way pairs are replayed and the ratio is exactly 1."""
    import mrtpo.replay.engine as engine

    asked = []
    real = engine.prompt_caches

    def counted(model, prompts, *a, **k):
        asked.append(len(prompts))
        return real(model, prompts, *a, **k)

    monkeypatch.setattr(engine, "prompt_caches", counted)
    cfg = tiny_config(tmp_path / "run", algo="mrtpo", steps=2, group_size=4, micro_batch=64,
                      minibatches=1, gradient_checkpointing=ckpt)  # fmt: skip
    tr = Trainer(cfg, task=mixed_task())
    tr.run(progress=False)
    pairs = sum(r["replay/pairs"] or 0 for r in tr.metrics)
    assert pairs > 0 and all(r["mean_ratio"] == 1.0 for r in tr.metrics)
    assert (sum(asked) > 0) is ckpt


@pytest.mark.parametrize("kw", [{"ppo_epochs": 2}, {"minibatches": 2}], ids=["epochs", "mb"])
def test_the_old_logprob_forward_runs_where_the_policy_moves(tmp_path, kw):
    """Several PPO epochs or several minibatches per step: the policy moves before a later
    forward of the update, so the old log-probs come from the separate no-grad forward (the
    replay's with-information forward, run once per step) and the ratio is not held at 1."""
    from mrtpo.training.trainer import separate_old_forward

    tr, seen = _counted_run(
        tmp_path, "moving", algo="gdpo", replay_for_baselines=False, micro_batch=2, **kw
    )
    assert separate_old_forward(tr.cfg)
    assert seen["calls"] == 2 and seen["forwards"] > 0
    assert any(r["mean_ratio"] != 1.0 for r in tr.metrics)  # the second pass sees new weights
    assert not separate_old_forward(replace(tr.cfg, ppo_epochs=1, minibatches=1))


@pytest.mark.parametrize("from_update", [True, False], ids=["from_update", "own_forward"])
def test_on_policy_replay_reuses_the_update_forwards_weight_casts(tmp_path, from_update):
    """Under autocast to bf16, MRTPO on-policy: the update's forwards and the replay run in
    one autocast region, so the replay's forwards use the bf16 copies of the weights that
    autocast made for the update's forwards and cast no weight again (one cast of the
    weights fewer a step). Where the replay runs its own with-information forward instead,
    it casts each weight once, as before. Counted as copies of one decoder weight (the first
    layer's query projection) to bf16 inside the replay."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import mrtpo.training.trainer as trainer_mod
    from mrtpo.model.loading import decoder_layers

    cfg = tiny_config(tmp_path / "run", algo="mrtpo", steps=2, group_size=4, micro_batch=64,
                      minibatches=1, autocast="bfloat16")  # fmt: skip
    tr = Trainer(cfg, task=mixed_task())
    tr.replay_from_update = from_update
    weight = decoder_layers(tr.model)[0].self_attn.q_proj.weight
    casts = []

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and args[0] is weight:
                casts.append(kwargs.get("dtype"))
            return func(*args, **kwargs)

    real = trainer_mod.contrastive_replay

    def replay(*a, **k):
        with Casts():
            return real(*a, **k)

    trainer_mod.contrastive_replay = replay
    try:
        tr.run(progress=False)
    finally:
        trainer_mod.contrastive_replay = real
    pairs = [r["replay/pairs"] or 0 for r in tr.metrics]
    assert all(p > 0 for p in pairs)  # every step replayed (a forward in each replay)
    assert casts == ([] if from_update else [torch.bfloat16] * 2)
