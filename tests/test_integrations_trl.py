"""A real TRL GRPOTrainer with the fused MRTPO loss: 2 steps on a tiny Qwen2 built in code,
beta > 0 with TRL's KL bias correction, truncated completions masked, two reward functions.
On every batch the fused loss, its gradients and the logged metrics must equal TRL's own
``_compute_loss`` (TRL's log-prob code, TRL's loss code) on the same inputs."""

import math
import types

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from mrtpo.integrations import trl_trainer  # noqa: E402
from mrtpo.model import TinyConfig, build_tiny_model, build_tokenizer  # noqa: E402

PROMPTS = ["count the apples", "name a colour", "add two and three", "spell cat"]


def reward_length(completions, **kwargs):
    return [float(len(c)) / 10.0 for c in completions]


def reward_vowels(completions, **kwargs):
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


def tiny_model_with_eos_bias(seed=0):
    tok = build_tokenizer(PROMPTS * 8 + ["the quick brown fox jumps over the lazy dog"] * 8)
    cfg = TinyConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
                     num_kv_heads=1, max_positions=128)  # fmt: skip
    model = build_tiny_model(tok, cfg, seed=seed)
    # An untied head with a bias that favours EOS: some completions end, others are
    # truncated (and masked), and the bias path of the fused head is exercised too.
    head = torch.nn.Linear(cfg.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 4.0
    model.config.tie_word_embeddings = False
    model.lm_head = head
    return model, tok


def make_trainer(tmp_path, cls, **overrides):
    torch.manual_seed(0)
    model, tok = tiny_model_with_eos_bias()
    # beta > 0: TRL loads its reference model from the policy's path
    model.save_pretrained(tmp_path / "policy")
    model.config._name_or_path = str(tmp_path / "policy")
    args = dict(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.1,
        use_bias_correction_kl=True, mask_truncated_completions=True, num_iterations=2,
        loss_type="grpo", temperature=1.3, logging_steps=1, report_to=[], save_strategy="no",
        use_cpu=True, bf16=False, seed=0, multi_objective_aggregation="normalize_then_sum",
    )  # fmt: skip
    args.update(overrides)
    config = trl.GRPOConfig(**args)
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 4})
    return cls(model=model, reward_funcs=[reward_length, reward_vowels], args=config,
               train_dataset=ds, processing_class=tok)  # fmt: skip


def checking_class(records):
    base = trl_trainer.MRTPOGRPOTrainer

    class Checking(base):
        def _compute_loss(self, model, inputs):
            params = [p for p in model.parameters() if p.requires_grad]
            before = {k: len(v) for k, v in self._metrics["train"].items()}
            fused = super()._compute_loss(model, inputs)
            fused_metrics = {k: v[before.get(k, 0) :] for k, v in self._metrics["train"].items()}
            g_fused = torch.autograd.grad(fused, params, retain_graph=True, allow_unused=True)
            # TRL's own log-probs (its patched forward) and TRL's own loss, same inputs
            self._get_per_token_logps_and_entropies = types.MethodType(
                trl.GRPOTrainer._get_per_token_logps_and_entropies, self
            )
            try:
                before = {k: len(v) for k, v in self._metrics["train"].items()}
                ref = trl.GRPOTrainer._compute_loss(self, model, inputs)
                ref_metrics = {k: v[before.get(k, 0) :] for k, v in self._metrics["train"].items()}
            finally:
                del self._get_per_token_logps_and_entropies
            g_ref = torch.autograd.grad(ref, params, allow_unused=True)
            records.append(
                dict(fused=fused.detach(), ref=ref.detach(), g_fused=g_fused, g_ref=g_ref,
                     m_fused=fused_metrics, m_ref=ref_metrics,
                     mask=inputs["completion_mask"].clone(), adv=inputs["advantages"].clone(),
                     off_policy=inputs.get("old_per_token_logps") is not None)
            )  # fmt: skip
            return fused

    return Checking


@pytest.mark.parametrize(
    "overrides",
    [
        dict(),  # grpo, beta > 0, bias-corrected KL: linear_policy_loss(kl_importance_weight)
        dict(loss_type="dapo", use_bias_correction_kl=False),  # linear_policy_loss itself
        dict(loss_type="bnpo", top_entropy_quantile=0.5, delta=1.5),  # TRL's loss code
    ],
    ids=["grpo-biascorr", "dapo-op", "bnpo-trl-features"],
)
def test_grpo_trainer_fused_loss_equals_trl(tmp_path, overrides):
    records = []
    trainer = make_trainer(tmp_path, checking_class(records), **overrides)
    trainer.train()
    assert len(records) >= 2
    assert any(r["off_policy"] for r in records)  # num_iterations=2: old != current
    masks = torch.cat([r["mask"] for r in records])
    assert bool((masks.sum(1) == 0).any()), "expected some truncated (masked) completions"
    assert bool((masks.sum(1) > 0).any())
    for r in records:
        assert r["adv"].dim() == 2  # MRTPO token advantages reached the loss
        assert torch.all(r["adv"][r["mask"] == 0] == 0)
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
    logged = trainer.state.log_history[0]
    for key in ("kl", "entropy", "clip_ratio/region_mean", "reward"):
        assert key in logged


def test_grpo_trainer_refuses_aux_loss(tmp_path):
    with pytest.raises(ValueError, match="router_aux_loss_coef"):
        mixin = trl_trainer._trainer_mixin()
        obj = mixin.__new__(mixin)
        obj.aux_loss_enabled = True

        class Base:
            def __init__(self, *a, **k):
                pass

        type("T", (mixin, Base), {}).__init__(obj)


def test_grpo_trainer_refuses_scale_rewards_batch(tmp_path):
    with pytest.raises(ValueError, match="scale_rewards"):
        make_trainer(tmp_path, trl_trainer.MRTPOGRPOTrainer, scale_rewards="batch")


def test_the_earlier_trainer_path_gives_the_same_class_and_loads_nothing_back():
    """``from mrtpo.integrations.trl import MRTPOGRPOTrainer`` (the earlier path) is the
    trainer module's class; importing ``trl.py`` alone loads neither the trainer's module
    nor TRL (the trainer imports the functions' module, not the reverse)."""
    import subprocess
    import sys

    from mrtpo.integrations.trl import MRTPOGRPOTrainer

    assert MRTPOGRPOTrainer is trl_trainer.MRTPOGRPOTrainer
    code = (
        "import sys, mrtpo.integrations.trl as t; "
        "print(sorted(m for m in ('mrtpo.integrations.trl_trainer', 'trl') if m in sys.modules)); "
        "t.MRTPOGRPOTrainer; print('mrtpo.integrations.trl_trainer' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr


# --------------------------------------------------------------------------- hostile inputs


def _loss_inputs(b=3, t=4, d=8, v=11):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, d, generator=g)
    weight = torch.randn(v, d, generator=g)
    ids = torch.randint(0, v, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[0, 2:] = 0
    adv = torch.randn(b, t, generator=g)
    return hidden, weight, ids, mask, adv


@pytest.mark.parametrize(
    "bad", [-4.0, 0, 0.0, float("nan"), float("inf"), "8", True, None, torch.tensor([2.0, 3.0]),
            torch.tensor(-1.0), torch.tensor(0.0), torch.tensor(float("nan")),
            torch.tensor(True)],
)  # fmt: skip
def test_fused_policy_loss_refuses_a_bad_token_normalizer(bad):
    """Issue 32, item 10: a negative token_normalizer flipped the loss's sign, 0 gave inf,
    NaN gave NaN; each is refused, naming the argument."""
    from mrtpo.integrations.trl import fused_policy_loss

    hidden, weight, ids, mask, adv = _loss_inputs()
    if bad is None:  # None is the default (this batch's token count): only refused by name
        loss, _ = fused_policy_loss(hidden, weight, ids, mask, None, adv, loss_type="dapo",
                                    token_normalizer=bad)  # fmt: skip
        assert torch.isfinite(loss)
        return
    with pytest.raises(ValueError, match="token_normalizer"):
        fused_policy_loss(hidden, weight, ids, mask, None, adv, loss_type="dapo",
                          token_normalizer=bad)  # fmt: skip


def test_fused_policy_loss_token_normalizer_scales_dapo_only():
    from mrtpo.integrations.trl import fused_policy_loss

    hidden, weight, ids, mask, adv = _loss_inputs()
    tokens = float(mask.sum())
    base, _ = fused_policy_loss(hidden, weight, ids, mask, None, adv, loss_type="dapo")
    for norm in (2.5, torch.tensor(2.5), torch.tensor([2.5]), 3):
        loss, _ = fused_policy_loss(hidden, weight, ids, mask, None, adv, loss_type="dapo",
                                    token_normalizer=norm)  # fmt: skip
        torch.testing.assert_close(loss, base * tokens / float(norm))
    with pytest.raises(ValueError, match="token_normalizer: used by loss_type 'dapo' only"):
        fused_policy_loss(hidden, weight, ids, mask, None, adv, loss_type="grpo",
                          token_normalizer=2.0)  # fmt: skip


class _WithSpans:
    def __init__(self, score, spans):
        self.score, self.spans = score, spans


def test_span_capture_reads_none_spans_as_no_spans():
    """Issue 32, item 15: ``spans=None`` (a pair or a Verdict-like object) means "no spans",
    as the replay reads None; a bare score too."""
    store = {}
    cap = trl_trainer._SpanCapture(
        lambda completions, **kw: [(1.0, None), _WithSpans(0.5, None), 0.25, (0.0, [(0, 2)])],
        0, store,
    )  # fmt: skip
    assert cap(completions=["a"] * 4) == [1.0, 0.5, 0.25, 0.0]
    assert store[0] == [None, None, None, [(0, 2)]]


@pytest.mark.parametrize(
    "outputs, match",
    [
        ([(1.0, [(0, 1)]), (1.0, 5)], r"reward function 'my_reward', sample 1: spans must be"),
        ([_WithSpans(1.0, 7)], r"reward function 'my_reward', sample 0: spans must be"),
        ([(1.0, "0-3")], r"reward function 'my_reward', sample 0: spans must be"),
        ([0.5, ("a", [])], r"reward function 'my_reward', sample 1: expected a score"),
        ([[1.0, []]], r"reward function 'my_reward', sample 0: expected a score"),
        ([(1.0, [], "x")], r"reward function 'my_reward', sample 0: a tuple output"),
        (1.0, r"reward function 'my_reward': expected a list with one output per sample"),
        ("1.0", r"reward function 'my_reward': expected a list with one output per sample"),
    ],
    ids=["pair-int-spans", "object-int-spans", "string-spans", "string-score", "list-pair",
         "triple", "bare-float", "string"],
)  # fmt: skip
def test_span_capture_malformed_outputs_name_the_reward_and_sample(outputs, match):
    """A malformed reward output was a bare TypeError inside the span capture; now a
    ValueError naming the reward function and the sample."""

    def my_reward(completions, **kw):
        return outputs

    cap = trl_trainer._SpanCapture(my_reward, 0, {})
    with pytest.raises(ValueError, match=match):
        cap(completions=["a", "b"])
