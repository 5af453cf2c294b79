"""Models whose logits are scaled or softcapped after the LM head (Gemma 2 / 3's
``final_logit_softcapping``, Cohere / Cohere2's ``logit_scale``, Granite's
``logits_scaling``): ``mrtpo.model.loading.logit_transform`` reads the transform from the config,
and the fused log-probs of ``mrtpo train``'s model wrapper, the replay and the TRL trainer
equal the model's own ``log_softmax(logits / temperature)``. Tiny random models built in
code, fp32."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mrtpo_kernels as mk  # noqa: E402
from mrtpo.model.loading import build_tokenizer, last_hidden, lm_head, logit_transform  # noqa: E402
from mrtpo.replay.api import replay_relevance  # noqa: E402

PROMPTS = ["count the apples", "name a colour", "add two and three", "spell cat"]
TEMPERATURE = 0.9


def _tokenizer():
    return build_tokenizer(PROMPTS * 8 + ["the quick brown fox jumps over the lazy dog"] * 8)


def _tiny(kind: str, vocab: int, pad_id: int, seed: int = 0):
    """A one-layer random model of family ``kind`` whose logits are large enough (the head
    scaled up) that the transform changes them a lot: most pass the softcap."""
    common = dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                  pad_token_id=pad_id, tie_word_embeddings=False)  # fmt: skip
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(head_dim=16, final_logit_softcapping=3.0, **common)
        cls = transformers.Gemma2ForCausalLM
    elif kind == "gemma3":
        cfg = transformers.Gemma3TextConfig(head_dim=16, final_logit_softcapping=2.5,
                                            **common)  # fmt: skip
        cls = transformers.Gemma3ForCausalLM
    elif kind == "cohere":
        cfg = transformers.CohereConfig(logit_scale=0.0625, **common)
        cls = transformers.CohereForCausalLM
    elif kind == "cohere2":
        cfg = transformers.Cohere2Config(logit_scale=0.25, **common)
        cls = transformers.Cohere2ForCausalLM
    elif kind == "granite":
        cfg = transformers.GraniteConfig(logits_scaling=8.0, **common)
        cls = transformers.GraniteForCausalLM
    else:
        raise AssertionError(kind)
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(200.0)
    return model


KINDS = ["gemma2", "gemma3", "cohere", "cohere2", "granite"]
EXPECTED = {
    "gemma2": {"softcap": 3.0},
    "gemma3": {"softcap": 2.5},
    "cohere": {"logit_scale": 0.0625},
    "cohere2": {"logit_scale": 0.25},
    "granite": {"logit_scale": 0.125},
}


def _batch(tok, n=3, t=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, len(tok), (n, t), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    ids[0, :2] = tok.pad_token_id
    return ids, mask


def _hf_logprobs(model, ids, mask, temperature):
    """The model's own log-probs of each next token: log_softmax(logits / T) (its forward
    applies its own scaling and softcap)."""
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / temperature, -1)
    return lp.gather(-1, ids[:, 1:, None])[..., 0]


@pytest.mark.parametrize("kind", KINDS)
def test_logit_transform_reads_the_config(kind):
    tok = _tokenizer()
    model = _tiny(kind, len(tok), tok.pad_token_id)
    assert logit_transform(model) == EXPECTED[kind]
    # the transform changes this model's distribution: the plain head would be wrong
    assert EXPECTED[kind]


def test_logit_transform_of_a_plain_model_is_empty_and_multipliers_are_refused():
    cfg = transformers.Qwen2Config(vocab_size=50, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2,
                                   num_key_value_heads=1)  # fmt: skip
    model = transformers.Qwen2ForCausalLM(cfg)
    assert logit_transform(model) == {}
    model.config.final_logit_softcapping = None
    model.config.logit_scale = 1.0
    assert logit_transform(model) == {}
    model.config.lm_head_multiplier = 2.0
    with pytest.raises(ValueError, match="lm_head_multiplier"):
        logit_transform(model)
    del model.config.lm_head_multiplier
    model.config.final_logit_softcapping = -1.0
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        logit_transform(model)


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kind", KINDS)
def test_fused_logprobs_equal_the_models_own(kind, backend):
    """What ``mrtpo train``'s wrapper computes (the decoder's last hidden states, the head,
    the config's transform) equals log_softmax(model(ids).logits / T); and without the
    transform it would not."""
    tok = _tokenizer()
    model = _tiny(kind, len(tok), tok.pad_token_id)
    ids, mask = _batch(tok)
    want = _hf_logprobs(model, ids, mask, TEMPERATURE)
    with torch.no_grad():
        h = last_hidden(model, ids, mask)[:, :-1]
    w, b = lm_head(model)
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    got = mk.linear_logprobs(h, w, labels, bias=b, temperature=TEMPERATURE, backend=backend,
                             **logit_transform(model))  # fmt: skip
    keep = labels != -100
    torch.testing.assert_close(got[keep], want[keep], atol=2e-5, rtol=1e-5)
    plain = mk.linear_logprobs(h, w, labels, bias=b, temperature=TEMPERATURE, backend=backend)
    assert float((plain.detach()[keep] - want[keep]).abs().max()) > 1e-2


@pytest.mark.parametrize("kind", ["gemma2", "cohere"])
def test_replay_old_logprobs_equal_the_models_own(kind):
    """The replay's log-probs (the old log-probs of ``mrtpo train``'s loss) use the
    transform too."""
    tok = _tokenizer()
    model = _tiny(kind, len(tok), tok.pad_token_id)
    prompts = PROMPTS[:2]
    responses = [[7, 8, 9, 10], [11, 12, 13]]
    rep = replay_relevance(model, prompts, responses, [[None], [None]], tokenizer=tok,
                           temperature=TEMPERATURE, num_rewards=1)  # fmt: skip
    for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):  # each row alone
        p_ids = tok(p)["input_ids"]
        ids = torch.tensor([p_ids + r])
        want = _hf_logprobs(model, ids, torch.ones_like(ids), TEMPERATURE)[0, len(p_ids) - 1 :]
        old = rep.old_logprobs  # (B, T) padded, or (N,) packed
        got = old[i, : len(r)] if old.dim() == 2 else old[sum(map(len, responses[:i])) :][: len(r)]
        torch.testing.assert_close(got.float(), want, atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the TRL trainer

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")


def _reward(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "cohere2", "granite"])
def test_trl_trainer_logprobs_equal_the_models_own(tmp_path, kind):
    """The TRL trainer takes these models (it refused them before): its fused log-probs
    equal TRL's own ``_get_per_token_logps_and_entropies`` (the model's forward, its logits
    / temperature, log-softmax) and the model's log_softmax, entropies included; and one
    training step runs."""
    from test_integrations_trl import checking_class

    tok = _tokenizer()
    model = _tiny(kind, len(tok), tok.pad_token_id)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=4, max_steps=1, learning_rate=1e-3, beta=0.0,
        temperature=TEMPERATURE, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, seed=0, multi_objective_aggregation="normalize_then_sum",
    )  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 2})
    records = []
    cls = checking_class(records)  # each step's fused loss beside TRL's own on its inputs
    trainer = cls(model=model, reward_funcs=[_reward], args=args, train_dataset=ds,
                  processing_class=tok)  # fmt: skip
    ids, mask = _batch(tok, n=3, t=9)
    keep = 5
    got, got_ent, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, mask, keep, compute_entropy=True
    )
    want, want_ent = trl.GRPOTrainer._get_per_token_logps_and_entropies(
        trainer, trainer.model, ids, mask, keep, compute_entropy=True
    )[:2]
    own = _hf_logprobs(trainer.model, ids, mask, TEMPERATURE)[:, -keep:]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got, own, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=2e-5, rtol=1e-5)
    trainer.train()
    assert trainer.state.global_step == 1 and records
    for r in records:  # the fused loss and its gradients equal TRL's on the capped model
        torch.testing.assert_close(r["fused"], r["ref"], rtol=1e-5, atol=1e-6)
        for gf, gr in zip(r["g_fused"], r["g_ref"], strict=True):
            if gr is not None:  # fp32 rounding of the capped logits (the head scaled by 200)
                scale = max(1.0, float(gr.abs().max()))
                torch.testing.assert_close(gf, gr, rtol=1e-3, atol=1e-5 * scale)
