"""MRTPOGRPOTrainer where TRL's GRPOTrainer trains (issue 40): the settings TRL's own GRPO
tests exercise, each checked against TRL's code on the same batch.

- MoE models with the router auxiliary loss (tiny random Qwen3-MoE and GPT-OSS): the fused
  loss plus the load-balancing loss taken from the decoder's router logits equals TRL's loss
  (TRL's log-probs, TRL's loss code, TRL's aux loss), gradients included.
- Every ``loss_type`` TRL has (the fused ones and those that run TRL's loss code on the fused
  log-probs), with reward weights: loss, gradients and metrics equal TRL's.
- A reward model beside a reward function, on chat prompts: its scores are TRL's and the
  loss equals TRL's.
- ``scale_rewards`` (TRL's strings and booleans) with float-only rewards: the advantages
  that reach the loss are GDPO's with that scaling of each reward, which for "group" are
  TRL's ``normalize_then_sum``; each reward's scaled value is TRL's GRPO advantage for that
  scaling (its ``sum_then_normalize`` with that reward alone).

The loss comparisons reuse ``checking_class`` of test_integrations_trl: on every batch the
trainer's loss is recomputed by ``GRPOTrainer._compute_loss`` with TRL's own log-prob code.
"""

import math

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from test_integrations_trl import PROMPTS, checking_class, make_trainer  # noqa: E402

from mrtpo.integrations import trl_trainer  # noqa: E402
from mrtpo.integrations.trl_grpo import fused_head  # noqa: E402
from mrtpo.model.loading import build_tokenizer  # noqa: E402
from mrtpo_kernels import gdpo_advantages  # noqa: E402


def reward_quarter_length(completions, **kwargs):
    return [len(c) / 4.0 for c in completions]  # exact in binary: no rounding in group means


def reward_vowel_count(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def _check_records(records, *, aux=False):
    assert len(records) >= 2
    assert any(r["off_policy"] for r in records)  # num_iterations=2: old != current
    for r in records:
        assert r["adv"].dim() == 2  # MRTPO token advantages reached the loss
        torch.testing.assert_close(r["fused"], r["ref"], rtol=1e-5, atol=1e-6)
        for gf, gr in zip(r["g_fused"], r["g_ref"]):
            if gr is None:
                assert gf is None or float(gf.abs().max()) == 0.0
                continue
            torch.testing.assert_close(gf, gr, rtol=1e-4, atol=1e-6)
        assert set(r["m_fused"]) == set(r["m_ref"])
        for key, vals in r["m_ref"].items():
            for a, b in zip(r["m_fused"][key], vals):
                assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, abs=1e-5), key
        if aux:
            assert r["m_fused"]["aux_loss"] and all(v > 0 for v in r["m_fused"]["aux_loss"])


# --------------------------------------------------------------------------- MoE


def tiny_moe(kind, seed=0):
    """A tiny random MoE causal LM (4 experts, top 2). TRL turns its aux loss on because the
    config has the attribute output_router_logits (False, the default of these families:
    generation runs without router logits) and a router_aux_loss_coef."""
    from transformers import GptOssConfig, GptOssForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = build_tokenizer(PROMPTS * 8 + ["the quick brown fox jumps over the lazy dog"] * 8)
    common = dict(
        vocab_size=len(tok), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts_per_tok=2, max_position_embeddings=128,
        output_router_logits=False, router_aux_loss_coef=0.5, tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    if kind == "qwen3_moe":
        config = Qwen3MoeConfig(intermediate_size=32, moe_intermediate_size=16, num_experts=4,
                                **common)  # fmt: skip
        cls = Qwen3MoeForCausalLM
    else:
        config = GptOssConfig(intermediate_size=16, num_local_experts=4, sliding_window=8,
                              layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                              **common)  # fmt: skip
        cls = GptOssForCausalLM
    torch.manual_seed(seed)
    model = cls(config)
    with torch.no_grad():  # routers far from uniform: an aux loss well above its minimum
        for name, p in model.named_parameters():
            if "router" in name or name.endswith("gate.weight"):
                p.normal_(0.0, 1.0)
    return model, tok


@pytest.mark.parametrize(
    "kind,overrides",
    [
        ("qwen3_moe", dict(loss_type="grpo", beta=0.1)),  # fused loss, KL
        ("gpt_oss", dict(loss_type="dapo")),  # fused loss
        ("qwen3_moe", dict(loss_type="cispo")),  # TRL's loss code on the fused log-probs
    ],
    ids=["qwen3_moe-grpo-beta", "gpt_oss-dapo", "qwen3_moe-cispo"],
)
def test_moe_router_aux_loss_equals_trl(tmp_path, kind, overrides):
    model, tok = tiny_moe(kind)
    model.save_pretrained(tmp_path / "policy")  # beta > 0: TRL loads its reference by name
    model.config._name_or_path = str(tmp_path / "policy")
    args = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.0,
        num_iterations=2, temperature=1.3, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, seed=0, multi_objective_aggregation="normalize_then_sum",
    )  # fmt: skip
    args.update(overrides)
    records = []
    trainer = checking_class(records)(
        model=model, reward_funcs=[reward_quarter_length, reward_vowel_count],
        args=trl.GRPOConfig(**args), processing_class=tok,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * 4}),
    )  # fmt: skip
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5
    trainer.train()
    _check_records(records, aux=True)
    assert "aux_loss" in trainer.state.log_history[0]


def test_moe_aux_loss_is_the_models_own():
    """The aux loss the trainer adds is the one the model's own forward returns (its
    load_balancing_loss_func, padding masked), on both paths: the decoder's router logits
    (one process) and the wrapped model's forward (DDP / FSDP)."""
    for kind in ("qwen3_moe", "gpt_oss"):
        model, _ = tiny_moe(kind)
        ids = torch.randint(0, model.config.vocab_size, (3, 9))
        am = torch.ones_like(ids)
        am[0, :4] = 0  # left padding
        want = model(input_ids=ids, attention_mask=am, output_router_logits=True).aux_loss
        from mrtpo.model.loading import decoder

        out = decoder(model)(input_ids=ids, attention_mask=am, output_router_logits=True)
        got = fused_head._router_aux_loss(model, out, am)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        unpadded = fused_head._router_aux_loss(model, out, torch.ones_like(am))
        assert float((unpadded - want).abs()) > 1e-6  # the mask is what is checked


def test_moe_aux_loss_through_a_wrapped_model(tmp_path, monkeypatch):
    """Several processes wrap the model (DDP, FSDP): the forward goes through the wrapper, and
    the aux loss is the model's own forward's. It equals the one-process path's (the
    decoder's router logits), hidden states and aux loss alike, and its gradient reaches the
    routers."""
    model, tok = tiny_moe("qwen3_moe")
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                            num_generations=4, report_to=[], use_cpu=True)  # fmt: skip
    trainer = trl_trainer.MRTPOGRPOTrainer(
        model=model, reward_funcs=[reward_quarter_length], args=config, processing_class=tok,
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
    )  # fmt: skip
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == 0.5  # the config's

    class Wrapper(torch.nn.Module):  # a stand-in for DDP: forwards to the model it holds
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, **kwargs):
            return self.module(**kwargs)

    wrapped = Wrapper(trainer.model)
    unwrap = trainer.accelerator.unwrap_model
    monkeypatch.setattr(trainer.accelerator, "unwrap_model",
                        lambda m, **kw: m.module if m is wrapped else unwrap(m, **kw))  # fmt: skip
    ids = torch.randint(0, len(tok), (3, 9))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    one = trainer._completion_hidden_and_head(trainer.model, ids, am, 4, router_aux=True)
    two = trainer._completion_hidden_and_head(wrapped, ids, am, 4, router_aux=True)
    torch.testing.assert_close(two[0], one[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(two[3], one[3], rtol=0, atol=1e-7)
    assert float(one[3]) > 0.0  # (2.0 for perfectly balanced routing, top 2 of 4)
    router = [p for n, p in trainer.model.named_parameters() if n.endswith("gate.weight")]
    grads = torch.autograd.grad(two[3], router)
    assert all(float(g.abs().max()) > 0 for g in grads)


# --------------------------------------------------------------------------- loss types


@pytest.mark.parametrize(
    "overrides",
    [
        dict(loss_type="dr_grpo", reward_weights=[1.0, 0.25]),  # fused
        dict(loss_type="bnpo", use_bias_correction_kl=False, reward_weights=[2.0, 0.5]),
        dict(loss_type="cispo", beta=0.0),  # TRL's loss code from here on
        dict(loss_type="sapo"),
        dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.0),
        dict(loss_type="vespo", beta=0.0),
    ],
    ids=["dr_grpo-weights", "bnpo-weights", "cispo", "sapo", "luspo", "vespo"],
)
def test_every_loss_type_equals_trl(tmp_path, overrides):
    """beta > 0 unless said, num_iterations = 2 and masked truncations (make_trainer's
    defaults): the trainer's loss, its gradients and metrics equal TRL's on every batch."""
    records = []
    trainer = make_trainer(tmp_path, checking_class(records), **overrides)
    trainer.train()
    _check_records(records)
    masks = torch.cat([r["mask"] for r in records])
    assert bool((masks.sum(1) == 0).any()) and bool((masks.sum(1) > 0).any())
    if "reward_weights" in overrides:
        assert trainer.reward_weights.tolist() == overrides["reward_weights"]


# --------------------------------------------------------------------------- scale_rewards


def _capture_trl_advantages(monkeypatch):
    """TRL's own advantages of each generation batch, before the trainer replaces them."""
    seen = []
    original = trl.GRPOTrainer._generate_and_score_completions

    def spy(self, inputs):
        out = original(self, inputs)
        seen.append(out["advantages"].clone())
        return out

    monkeypatch.setattr(trl.GRPOTrainer, "_generate_and_score_completions", spy)
    return seen


@pytest.mark.parametrize("scale_rewards", [True, "group", "batch", "none", False])
def test_scale_rewards_against_trl(tmp_path, monkeypatch, scale_rewards):
    """Float-only rewards, no spans (MRTPO's advantages are GDPO's, broadcast over tokens):

    - the trainer's advantages are ``gdpo_advantages`` with that scaling of each reward
      (TRL's eps 1e-4); for "group" (True) they equal TRL's ``normalize_then_sum``;
    - TRL 1.16's ``normalize_then_sum`` scales by the group std whatever scale_rewards (it
      does not read it): our "batch" and "none" are not TRL's there, by definition;
    - each reward's A_k is TRL's GRPO advantage with that scaling (``sum_then_normalize``
      with the reward alone: weights (1, 0), then (0, 1))."""
    name = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    trl_adv = _capture_trl_advantages(monkeypatch)
    config = trl_trainer.MRTPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, temperature=1.3, report_to=[], use_cpu=True, bf16=False,
        seed=0, multi_objective_aggregation="normalize_then_sum", scale_rewards=scale_rewards,
        reward_weights=[1.0, 0.5],
    )  # fmt: skip
    model, tok = _tiny_dense()
    trainer = trl_trainer.MRTPOGRPOTrainer(
        model=model, reward_funcs=[reward_quarter_length, reward_vowel_count], args=config,
        processing_class=tok, train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
    )  # fmt: skip
    trainer.model.train()
    inputs = [{"prompt": p} for p in PROMPTS[:2] for _ in range(4)]
    gid = torch.arange(8) // 4
    w = torch.tensor([1.0, 0.5])

    out = trainer._generate_and_score_completions(inputs)
    rewards = trainer._mrtpo_rewards_per_func.double()
    assert bool((rewards.view(2, 4, 2).std(dim=1) > 0).any())  # some group varies
    mask = out["completion_mask"].bool()
    ours = gdpo_advantages(rewards, gid, weights=w.double(), eps=1e-4, scale_rewards=name)
    torch.testing.assert_close(out["advantages"][mask].double(),
                               ours.sequence[:, None].expand(mask.shape)[mask],
                               rtol=1e-5, atol=1e-6)  # fmt: skip
    group = gdpo_advantages(rewards, gid, weights=w.double(), eps=1e-4, scale_rewards="group")
    torch.testing.assert_close(trl_adv[-1].double(), group.sequence, rtol=1e-5, atol=1e-5)
    if name != "group":
        assert float((ours.sequence - group.sequence).abs().max()) > 1e-3

    trainer.multi_objective_aggregation = "sum_then_normalize"  # TRL's GRPO, one reward
    for j in range(2):
        trainer.reward_weights = torch.eye(2)[j]
        trainer._generate_and_score_completions(inputs)
        rewards = trainer._mrtpo_rewards_per_func.double()
        per_k = gdpo_advantages(rewards, gid, eps=1e-4, scale_rewards=name).per_reward[:, j]
        torch.testing.assert_close(trl_adv[-1].double(), per_k, rtol=1e-5, atol=1e-5)


def _tiny_dense():
    from test_integrations_trl import tiny_model_with_eos_bias

    torch.manual_seed(0)
    return tiny_model_with_eos_bias()


def test_scale_rewards_trains_and_refuses_unknown_values(tmp_path):
    """Each variant trains (MRTPO advantages reach TRL's loss); a value TRL does not know is
    refused at construction, naming scale_rewards."""
    for scale in ("batch", "none"):
        records = []
        trainer = make_trainer(tmp_path / scale, checking_class(records), scale_rewards=scale,
                               max_steps=1)  # fmt: skip
        trainer.train()
        assert records and records[0]["adv"].dim() == 2
    with pytest.raises(ValueError, match="scale_rewards"):
        make_trainer(tmp_path / "bad", trl_trainer.MRTPOGRPOTrainer, scale_rewards="std")


# --------------------------------------------------------------------------- reward models


def tiny_reward_model(tok, seed=1):
    """A tiny random sequence classifier (one score) on the policy's tokenizer: a reward
    model as TRL takes one (``AutoModelForSequenceClassification``, num_labels = 1)."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    config = Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=128, num_labels=1,
                         pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    with torch.no_grad():  # scores that differ between completions
        model.score.weight.normal_(0.0, 3.0)
    return model.eval()


def test_reward_model_and_conversational_prompts_equal_trl(tmp_path):
    """A reward model beside a reward function, chat prompts (TRL renders them with the
    template), reward weights, beta > 0, num_iterations = 2 and masked truncations: the
    reward model's scores are TRL's own (its ``_calculate_rewards``: the model scores
    prompt + completion as TRL renders them), they reach the advantages, and the fused
    loss, gradients and metrics equal TRL's on every batch."""
    from test_integrations_trl import tiny_model_with_eos_bias

    torch.manual_seed(0)
    model, tok = tiny_model_with_eos_bias()
    model.save_pretrained(tmp_path / "policy")  # beta > 0: TRL loads its reference by name
    model.config._name_or_path = str(tmp_path / "policy")
    rm = tiny_reward_model(tok)
    args = trl.GRPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.1,
        mask_truncated_completions=True, num_iterations=2, temperature=1.3, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=True, bf16=False, seed=0,
        reward_weights=[0.5, 1.0], multi_objective_aggregation="normalize_then_sum",
    )  # fmt: skip
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    records, scored = [], []

    class Recording(checking_class(records)):
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            scored.append((prompts, completions, out.detach().clone()))
            return out

    def reply_vowels(completions, **kwargs):  # chat completions: a list of messages each
        return [float(sum(ch in "aeiou" for ch in c[-1]["content"])) for c in completions]

    trainer = Recording(
        model=model, reward_funcs=[rm, reply_vowels], args=args, processing_class=tok,
        reward_processing_classes=[tok, None],
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts * 4}),
    )  # fmt: skip
    assert trainer.reward_funcs[0] is rm  # a model is TRL's to call, not wrapped
    trainer.train()
    _check_records(records)
    assert scored
    prompts_b, completions_b, rewards = scored[0]
    assert isinstance(completions_b[0], list)  # conversational: messages, not text
    from trl.data_utils import apply_chat_template

    texts = [
        apply_chat_template({"messages": p + c}, tok)["text"]
        for p, c in zip(prompts_b, completions_b, strict=True)
    ]
    enc = tok(texts, return_tensors="pt", padding=True, padding_side="right",
              add_special_tokens=False)  # fmt: skip
    with torch.no_grad():
        want = rm(**enc).logits[:, 0]
    torch.testing.assert_close(rewards[:, 0], want, rtol=1e-5, atol=1e-5)
    assert float(rewards[:, 0].std()) > 0  # the reward model moves the advantages
    log = trainer.state.log_history[0]
    assert all(f"rewards/{name}/mean" in log for name in trainer.reward_func_names)
