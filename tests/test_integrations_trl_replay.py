"""MRTPOGRPOTrainer runs the contrastive replay itself: a real TRL GRPOTrainer on a tiny Qwen2
built in code, span functions (``reward_spans``) and span-returning reward functions, no
``relevance_fn``. On the same batch its token advantages equal ``mrtpo train``'s code path
(``contrastive_replay`` then ``mrtpo_token_advantages`` on packed rows), and its relevance
equals a float64 recomputation from full logits."""

import copy
import math
import re

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from mrtpo.integrations import trl_trainer  # noqa: E402
from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer  # noqa: E402
from mrtpo.replay.api import contrastive_replay  # noqa: E402
from mrtpo.replay.prompting import ChatPrompter  # noqa: E402
from mrtpo.verifiers.base import Verdict  # noqa: E402
from mrtpo_kernels import mrtpo_token_advantages  # noqa: E402
from mrtpo_kernels.reference import js_distance_ref  # noqa: E402

WORDS = ["blue", "gold", "owls", "rain"]
PROMPTS = [f'Write a line with the word "{w}" and end with "bye".' for w in WORDS]


def quoted(prompt: str, n: int) -> tuple[int, int]:
    m = list(re.finditer(r'"([^"]+)"', prompt))[n]
    return (m.start(1), m.end(1))


def user_text(prompt):
    return prompt if isinstance(prompt, str) else prompt[-1]["content"]


def says_word(prompts, completions, **kw):  # spans from reward_spans
    out = []
    for p, c in zip(prompts, completions):
        text = c if isinstance(c, str) else c[0]["content"]
        word = user_text(p)[slice(*quoted(user_text(p), 0))]
        out.append(sum(ch in word for ch in text) / (1 + len(text)))  # graded: varies
    return out


def word_spans(prompt, **columns):
    assert "topic" in columns  # the other dataset columns reach the span function
    return [quoted(user_text(prompt), 0)]


def ends_bye(prompts, completions, **kw):  # names its own spans: (score, spans) / Verdict
    out = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        text = c if isinstance(c, str) else c[0]["content"]
        span = quoted(user_text(p), 1)  # on a chat prompt: the last user message
        score = sum(ch in "bye" for ch in text[-4:]) / 4.0
        if i % 2 == 0:
            out.append(Verdict(score, (span,)))
        else:  # (score, spans), with (message, start, end) spans on a chat prompt
            out.append((score, [span if isinstance(p, str) else (len(p) - 1, *span)]))
    return out


def length(completions, **kw):  # no spans: spread uniformly (GDPO)
    return [min(len(c if isinstance(c, str) else c[0]["content"]), 20) / 20.0 for c in completions]


def tiny_model(seed=0):
    tok = build_tokenizer(PROMPTS * 8 + [" ".join(WORDS) + " bye"] * 8)
    cfg = TinyConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, max_positions=128)  # fmt: skip
    return eos_biased_model(tok, cfg, seed), tok


def eos_biased_model(tok, cfg, seed=0):
    """A tiny model of ``cfg`` with an untied head (the embeddings' weights) whose bias is 3 on
    EOS and 0 elsewhere: some completions end, others are truncated."""
    model = build_tiny_model(tok, cfg, seed=seed)
    head = torch.nn.Linear(cfg.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 3.0
    model.config.tie_word_embeddings = False
    model.lm_head = head
    return model


def recording_class(records):
    class Recording(trl_trainer.MRTPOGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            state = copy.deepcopy(self.accelerator.unwrap_model(self.model).state_dict())
            out = super()._generate_and_score_completions(inputs)
            records.append(dict(state=state, inputs=inputs, rewards=self._mrtpo_rewards_per_func,
                                out={k: v for k, v in out.items()}, replay=self._last))  # fmt: skip
            return out

        def _mrtpo_replay(self, inputs, output, spans, mode, replay_mask=None, **kw):
            self._last = super()._mrtpo_replay(inputs, output, spans, mode, replay_mask, **kw)
            return self._last

    return Recording


def run_trainer(tmp_path, *, conversational, mask_truncated, steps=1, max_tokens=None):
    torch.manual_seed(0)
    model, tok = tiny_model()
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS] if conversational else PROMPTS
    ds = datasets.Dataset.from_dict({"prompt": prompts * 2, "topic": WORDS * 2})
    config = trl_trainer.MRTPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=steps, learning_rate=1e-2, beta=0.0,
        mask_truncated_completions=mask_truncated, loss_type="grpo", temperature=1.3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
        mrtpo_alpha=1.0, mrtpo_gamma=1.0, mrtpo_replay_micro_batch=3,
        mrtpo_replay_max_tokens=max_tokens,
    )  # fmt: skip
    records = []
    trainer = recording_class(records)(
        model=model, reward_funcs=[says_word, ends_bye, length], args=config, train_dataset=ds,
        processing_class=tok, reward_spans=[word_spans, None, None],
    )  # fmt: skip
    trainer.train()
    return trainer, records, tok


def _rows(out):
    mask = out["completion_mask"].bool()
    prompt_ids = [r[m.bool()].tolist() for r, m in zip(out["prompt_ids"], out["prompt_mask"])]
    responses = [r[m].tolist() for r, m in zip(out["completion_ids"], mask)]
    return mask, prompt_ids, responses


def _spans_of(inputs):
    spans = []
    for x in inputs:
        p = user_text(x["prompt"])
        spans.append([[quoted(p, 0)], [quoted(p, 1)], []])
    return spans


def test_trl_replay_advantages_equal_mrtpo_train_path(tmp_path):
    trainer, records, tok = run_trainer(tmp_path, conversational=True, mask_truncated=False)
    assert records
    rec = records[0]
    out = rec["out"]
    mask, prompt_ids, responses = _rows(out)
    model, _ = tiny_model()
    model.load_state_dict(rec["state"])
    model.eval()
    texts = [user_text(x["prompt"]) for x in rec["inputs"]]
    pr = ChatPrompter(tok)
    assert prompt_ids == [pr.encode(t).ids for t in texts]  # TRL rendered what mrtpo train does
    spans = _spans_of(rec["inputs"])
    rep = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, temperature=1.3)
    lengths = torch.tensor([len(r) for r in responses])
    cu = torch.zeros(len(responses) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    has_info = torch.tensor([[bool(s) for s in row] for row in spans])
    want = mrtpo_token_advantages(
        rec["rewards"], torch.arange(len(responses)) // 4, rep.relevance, has_info=has_info,
        cu_seqlens=cu, alpha=1.0, gamma=1.0, eps=1e-4, eps_batch=1e-4, batch_norm="sequence",
    ).token  # fmt: skip
    adv = out["advantages"]
    assert adv.shape == mask.shape
    torch.testing.assert_close(adv[mask], want.to(adv.dtype), rtol=1e-4, atol=1e-5)
    assert torch.all(adv[~mask] == 0)
    # the relevance moved the advantages away from the uniform (GDPO) spread
    flat = adv[mask].split(lengths.tolist())
    assert any(len(set(x.tolist())) > 1 for x in flat)
    logged = trainer.state.log_history[0]
    assert logged["mrtpo/replay_seconds"] > 0
    assert logged["mrtpo/relevance/says_word"] > 0 and logged["mrtpo/relevance/ends_bye"] > 0
    assert "mrtpo/relevance/length" not in logged


def test_trl_replay_plain_prompts_masked_truncations_float64(tmp_path):
    _, records, tok = run_trainer(
        tmp_path, conversational=False, mask_truncated=True, max_tokens=64
    )  # the replay in smaller chunks
    rec = records[0]
    out = rec["out"]
    mask, prompt_ids, responses = _rows(out)
    assert any(not r for r in responses) and any(responses)  # some truncations were masked
    model, _ = tiny_model()
    model.load_state_dict(rec["state"])
    m64 = model.double().eval()
    spans = _spans_of(rec["inputs"])
    relevance, has_info = rec["replay"].relevance, rec["replay"].has_info  # what it used
    assert has_info.tolist() == [[True, True, False]] * len(responses)
    pairs = rec["replay"].replayed_pairs  # the others' GDPO advantage is 0: not replayed
    replayed = {}
    for i, (p, r) in enumerate(zip([x["prompt"] for x in rec["inputs"]], responses)):
        if not r:
            assert torch.all(relevance[:, i] == 0)
            continue
        full = tok(p)["input_ids"]
        with torch.no_grad():
            lp = m64(torch.tensor([full + r])).logits[0, len(full) - 1 : -1]
            for k in (0, 1):
                if not pairs[i, k]:
                    assert torch.all(relevance[k, i] == 0)  # skipped
                    continue
                s, e = spans[i][k][0]
                q = tok(p[:s] + p[e:])["input_ids"]
                lq = m64(torch.tensor([q + r])).logits[0, len(q) - 1 : -1]
                want = js_distance_ref(lp, lq, temperature=1.3)
                torch.testing.assert_close(relevance[k, i][mask[i]].double(), want,
                                           rtol=1e-3, atol=1e-4)  # fmt: skip
            assert torch.all(relevance[2, i] == 0)
        replayed[i] = bool(pairs[i, :2].any())
    assert any(replayed.values())
    # the trainer's advantages came from that relevance: a masked row is all zero
    assert torch.all(out["advantages"][~mask] == 0)


def test_trl_reward_spans_errors(tmp_path):
    model, tok = tiny_model()
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                            num_generations=4, report_to=[], use_cpu=True)  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    common = dict(model=model, reward_funcs=[says_word, length], args=config, train_dataset=ds,
                  processing_class=tok)  # fmt: skip
    with pytest.raises(ValueError, match="reward_spans: expected a list of 2"):
        trl_trainer.MRTPOGRPOTrainer(**common, reward_spans=[word_spans])
    with pytest.raises(ValueError, match=r"reward_spans\[1\]: expected a callable"):
        trl_trainer.MRTPOGRPOTrainer(**common, reward_spans=[word_spans, "x"])


def test_trl_end_training_one_process(tmp_path):
    """``end_training`` closes the run: with one process it is Accelerate's own (no group to
    wait on); a bad pause is refused by name before anything closes (the two-process path
    runs in test_integrations_trl_distributed.py and the example's torchrun test)."""
    model, tok = tiny_model()
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                            num_generations=4, report_to=[], use_cpu=True)  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = trl_trainer.MRTPOGRPOTrainer(model=model, reward_funcs=[says_word, length],
                                           args=config, train_dataset=ds, processing_class=tok,
                                           reward_spans=[word_spans, None])  # fmt: skip
    for bad in (-1, float("nan"), True, "1", 61):
        with pytest.raises(ValueError, match="settle_seconds: expected a number of seconds"):
            trainer.end_training(settle_seconds=bad)
    assert trainer.accelerator.num_processes == 1
    trainer.end_training()


def test_reward_span_functions_may_return_arrays(tmp_path):
    """Issue 41, item 11: a span function returning a numpy array or a tensor failed with
    "truth value of an array is ambiguous", naming neither the function nor the sample.
    Integer arrays with one span per row are spans (an empty one: none); anything else is a
    ValueError naming the function and the sample."""
    import numpy as np

    model, tok = tiny_model()
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                            num_generations=4, report_to=[], use_cpu=True)  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "topic": WORDS})

    def array_spans(prompt, **columns):
        return np.array([quoted(user_text(prompt), 0)], dtype=np.int64)

    def tensor_spans(prompt, **columns):
        if columns["topic"] == "gold":  # none for this sample: a (0, 2) array
            return torch.zeros((0, 2), dtype=torch.long)
        return torch.tensor([quoted(user_text(prompt), 1)])

    def float_spans(prompt, **columns):
        return np.array([[0.0, 3.0]])

    trainer = trl_trainer.MRTPOGRPOTrainer(
        model=model, reward_funcs=[says_word, ends_bye, length], args=config, train_dataset=ds,
        processing_class=tok, reward_spans=[array_spans, tensor_spans, None],
    )  # fmt: skip
    inputs = [{"prompt": p, "topic": w} for p, w in zip(PROMPTS, WORDS)]
    spans = trainer._mrtpo_spans(inputs, 3)
    want = [[[quoted(p, 0)], [] if w == "gold" else [quoted(p, 1)], None]
            for p, w in zip(PROMPTS, WORDS)]  # fmt: skip
    assert spans == want
    rewards = torch.tensor([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5], [0.5, 1.0, 0.0], [1.0, 0.5, 0.0]])
    mask = trainer._replay_mask(rewards, 4, spans, None)  # read has_info from the arrays
    assert mask[:, 2].tolist() == [False] * 4 and mask[WORDS.index("gold"), 1].item() is False
    assert bool(mask[:, 0].all())
    trainer.reward_spans[0] = float_spans
    with pytest.raises(ValueError, match=r"reward_spans\[0\] \('float_spans'\), sample 0: spans "
                                         r"given as an array must be integers"):  # fmt: skip
        trainer._mrtpo_spans(inputs, 3)
    trainer.reward_spans[0] = lambda prompt, **columns: 5
    with pytest.raises(ValueError, match=r"reward_spans\[0\] \('<lambda>'\), sample 0: spans "
                                         r"must be a list"):  # fmt: skip
        trainer._mrtpo_spans(inputs, 3)


def test_trl_span_covering_the_whole_plain_prompt_trains(tmp_path):
    """Issue 41, item 4, through the trainer: a reward whose span is a whole plain prompt
    (TRL tokenizes it without BOS) made the replay run the decoder on an empty prompt. It is
    replayed after the one-token start context (docs/METHOD.md section 2), and trains."""
    torch.manual_seed(0)
    model, tok = tiny_model()

    def whole(prompt, **columns):
        return [(0, len(prompt))]

    ds = datasets.Dataset.from_dict({"prompt": PROMPTS, "topic": WORDS})
    config = trl_trainer.MRTPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=6, max_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, seed=0, logging_steps=1,
        temperature=1.3, mrtpo_replay_all=True,
    )  # fmt: skip
    trainer = trl_trainer.MRTPOGRPOTrainer(
        model=model, reward_funcs=[says_word, length], args=config, train_dataset=ds,
        processing_class=tok, reward_spans=[whole, None],
    )  # fmt: skip
    trainer.train()
    rep = trainer.last_replay["replay"]
    assert rep.has_info[:, 0].all() and not rep.has_info[:, 1].any()
    mask = rep.response_mask
    assert bool(mask.any())
    assert bool((rep.relevance[0][mask] > 0).all())  # the prompt moves every token
    logged = trainer.state.log_history[0]
    assert logged["mrtpo/relevance/says_word"] > 0 and math.isfinite(logged["loss"])


def constant_with_spans(prompts, completions, **kw):  # names spans, never varies: A_k = 0
    return [(1.0, [quoted(user_text(p), 1)]) for p in prompts]


def test_trl_replay_metrics_per_reward_with_skipped_pairs(tmp_path):
    """Issue 41, item 14: ``mrtpo/relevance/<reward>`` is averaged over replayed pairs only,
    so with the default skip it was missing for a reward that named spans, which the
    metrics table did not say, and nothing logged told why. The pairs replayed and skipped
    are now logged per reward (the table documents all three): a reward whose every pair
    was skipped has no relevance and all its pairs under skipped; one that named none has
    0 and 0; with ``mrtpo_replay_all`` every pair is replayed and measured."""
    logs = []
    for replay_all in (False, True):
        torch.manual_seed(0)
        model, tok = tiny_model()
        ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, "topic": WORDS * 2})
        config = trl_trainer.MRTPOConfig(
            output_dir=str(tmp_path / f"out{replay_all}"), per_device_train_batch_size=8,
            num_generations=4, max_completion_length=6, max_steps=1, learning_rate=1e-2,
            report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
            logging_steps=1, temperature=1.3, mrtpo_replay_all=replay_all,
        )  # fmt: skip
        trainer = trl_trainer.MRTPOGRPOTrainer(
            model=model, reward_funcs=[says_word, constant_with_spans, length], args=config,
            train_dataset=ds, processing_class=tok, reward_spans=[word_spans, None, None],
        )  # fmt: skip
        trainer.train()
        logs.append((trainer.state.log_history[0], trainer.last_replay["replay"]))
    (h, rep), (h_all, rep_all) = logs
    b = rep.has_info.shape[0]
    assert rep.has_info[:, :2].all() and not rep.has_info[:, 2].any()
    pairs = rep.replayed_pairs
    assert not pairs[:, 1].any()  # the constant reward's advantage is 0: all skipped
    assert bool(pairs[:, 0].any())
    assert h["mrtpo/replay/pairs/says_word"] == int(pairs[:, 0].sum())
    assert h["mrtpo/replay/skipped/says_word"] == b - int(pairs[:, 0].sum())
    assert h["mrtpo/replay/pairs/constant_with_spans"] == 0
    assert h["mrtpo/replay/skipped/constant_with_spans"] == b  # named spans, all skipped
    assert h["mrtpo/replay/pairs/length"] == 0 and h["mrtpo/replay/skipped/length"] == 0
    assert h["mrtpo/replay/pairs"] == int(pairs.sum())
    assert h["mrtpo/replay/skipped"] == 2 * b - int(pairs.sum())
    assert h["mrtpo/relevance/says_word"] > 0
    assert "mrtpo/relevance/constant_with_spans" not in h  # not measured
    assert "mrtpo/relevance/length" not in h  # named none
    # mrtpo_replay_all: every pair with spans replayed, so measured
    assert bool(rep_all.replayed_pairs[:, :2].all())
    assert h_all["mrtpo/replay/pairs/constant_with_spans"] == b
    assert h_all["mrtpo/replay/skipped/constant_with_spans"] == 0
    assert h_all["mrtpo/replay/skipped"] == 0
    assert h_all["mrtpo/relevance/constant_with_spans"] > 0
    assert "mrtpo/relevance/length" not in h_all


def test_trl_completions_table_carries_the_trained_advantages(tmp_path):
    """Issue 40, item 6: with ``log_completions`` TRL's table showed only TRL's per-sequence
    advantages, computed before MRTPO's replace them. The table now also carries, per
    completion, the mean, min and max of the token advantages the loss used, named
    ``mrtpo_advantage_*``; TRL's own column keeps its name and meaning."""
    import pandas as pd

    torch.manual_seed(0)
    model, tok = tiny_model()
    captured = []

    class Capturing(trl_trainer.MRTPOGRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            captured.append({k: v.clone() for k, v in out.items() if torch.is_tensor(v)})
            return out

    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 2, "topic": WORDS * 2})
    config = trl_trainer.MRTPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, seed=0, logging_steps=1,
        temperature=1.3, log_completions=True,
    )  # fmt: skip
    trainer = Capturing(
        model=model, reward_funcs=[says_word, ends_bye, length], args=config, train_dataset=ds,
        processing_class=tok, reward_spans=[word_spans, None, None],
    )  # fmt: skip
    trainer.train()
    (out,) = captured
    table = pd.read_parquet(tmp_path / "out" / "completions" / "completions_00001.parquet")
    assert len(table) == 8 and "advantage" in table  # TRL's own column, as TRL names it
    adv, mask = out["advantages"].double(), out["completion_mask"].bool()
    for i in range(8):
        row = table.iloc[i]
        tokens = adv[i][mask[i]]
        if tokens.numel() == 0:
            assert math.isnan(row["mrtpo_advantage_mean"])
            continue
        assert row["mrtpo_advantage_mean"] == pytest.approx(float(tokens.mean()), abs=1e-6)
        assert row["mrtpo_advantage_min"] == pytest.approx(float(tokens.min()), abs=1e-6)
        assert row["mrtpo_advantage_max"] == pytest.approx(float(tokens.max()), abs=1e-6)
    # the relevance moved the token advantages: a single per-sequence number cannot show them
    spread = (table["mrtpo_advantage_max"] - table["mrtpo_advantage_min"]).dropna()
    assert float(spread.max()) > 1e-3
