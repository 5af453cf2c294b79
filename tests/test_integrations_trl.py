"""A real TRL GRPOTrainer with the fused MRTPO loss: 2 steps on a tiny Qwen2 built in code,
beta > 0 with TRL's KL bias correction, truncated completions masked, two reward functions.
On every batch the fused loss, its gradients and the logged metrics must equal TRL's own
``_compute_loss`` (TRL's log-prob code, TRL's loss code) on the same inputs."""

import math
import types

import numpy as np
import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from mrtpo.integrations import trl_trainer  # noqa: E402
from mrtpo.integrations.trl_grpo import rewards as trl_rewards  # noqa: E402
from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer  # noqa: E402

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


@pytest.mark.parametrize("entropy_coef", [0.1, 0.0])
def test_entropies_carry_a_gradient_only_where_the_entropy_bonus_uses_them(tmp_path, entropy_coef):
    """As TRL: with ``entropy_coef`` set the entropies are differentiable (the bonus trains
    through them); without it they are detached (logging and the entropy mask only), with
    the same values; the log-probs carry their gradient either way."""
    trainer = make_trainer(tmp_path, trl_trainer.MRTPOGRPOTrainer, entropy_coef=entropy_coef)
    assert trainer._entropy_bonus_enabled is (entropy_coef != 0.0)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10]])
    mask = torch.ones_like(ids)
    logps, ents, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, mask, logits_to_keep=4, compute_entropy=True
    )
    assert logps.requires_grad
    assert ents.requires_grad is (entropy_coef != 0.0)
    trainer._entropy_bonus_enabled = not trainer._entropy_bonus_enabled  # the other setting
    _, other, _ = trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, mask, logits_to_keep=4, compute_entropy=True
    )
    assert other.requires_grad is (entropy_coef == 0.0)
    torch.testing.assert_close(other.detach(), ents.detach(), rtol=0, atol=0)


def test_aux_loss_of_a_model_without_router_logits_is_an_error(tmp_path):
    """A config that claims router logits (TRL turns the aux loss on for any config with
    output_router_logits) on a model whose decoder returns none: the loss names
    router_aux_loss_coef instead of adding nothing. MoE models themselves: the conformance
    tests (test_integrations_trl_conformance.py)."""
    torch.manual_seed(0)
    model, tok = tiny_model_with_eos_bias()
    model.config.output_router_logits = False  # TRL reads the attribute's presence
    config = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4,
                            num_generations=4, report_to=[], use_cpu=True,
                            router_aux_loss_coef=0.01)  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = trl_trainer.MRTPOGRPOTrainer(model=model, reward_funcs=[reward_length],
                                           args=config, train_dataset=ds,
                                           processing_class=tok)  # fmt: skip
    assert trainer.aux_loss_enabled
    ids = torch.randint(0, len(tok), (2, 6))
    with pytest.raises(ValueError, match="^router_aux_loss_coef: .*no router logits"):
        trainer._get_per_token_logps_and_entropies(trainer.model, ids, torch.ones_like(ids), 3,
                                                   compute_aux_loss=True)  # fmt: skip


def test_the_trainer_is_a_grpo_trainer_and_the_functions_need_no_trl():
    """``class MRTPOGRPOTrainer(GRPOTrainer)`` at module level (a plain import, no module
    ``__getattr__``); ``mrtpo.integrations.trl`` and the other framework-free modules import
    where TRL cannot be imported, and the trainer's module then says what to install."""
    import inspect
    import subprocess
    import sys

    from mrtpo.integrations.trl_trainer import MRTPOConfig, MRTPOGRPOTrainer

    assert issubclass(MRTPOGRPOTrainer, trl.GRPOTrainer)
    assert issubclass(MRTPOConfig, trl.GRPOConfig)
    # laid out as TRL lays out GRPO (config, rewards, trainer), re-exported by trl_trainer
    assert MRTPOGRPOTrainer.__module__ == "mrtpo.integrations.trl_grpo.trainer"
    assert MRTPOConfig.__module__ == "mrtpo.integrations.trl_grpo.config"
    assert (MRTPOGRPOTrainer._name, MRTPOGRPOTrainer._tag_names) == (
        "MRTPO",
        ["trl", "grpo", "mrtpo"],
    )
    # keyword-only, as TRL's trainers are called (model=, reward_funcs=, args=, ...)
    params = list(inspect.signature(MRTPOGRPOTrainer.__init__).parameters.values())[1:]
    assert [p.name for p in params[:3]] == ["model", "reward_funcs", "args"]
    assert all(p.kind in (p.KEYWORD_ONLY, p.VAR_KEYWORD) for p in params)
    assert not hasattr(trl_trainer, "__getattr__")
    code = (
        "import sys; sys.modules['trl'] = None\n"
        "import mrtpo.integrations, mrtpo.integrations.trl, mrtpo.integrations.common\n"
        "import mrtpo.integrations.verl, mrtpo.integrations.openrlhf\n"
        "from mrtpo.integrations.trl import fused_policy_loss, mrtpo_advantages_for_grpo\n"
        "try:\n"
        "    import mrtpo.integrations.trl_trainer\n"
        "except ImportError as e:\n"
        "    print('refused:', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "refused: mrtpo.integrations.trl_trainer needs TRL" in out.stdout, out.stdout
    assert "[trl]" in out.stdout


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
    cap = trl_rewards._SpanCapture(
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

    cap = trl_rewards._SpanCapture(my_reward, 0, {})
    with pytest.raises(ValueError, match=match):
        cap(completions=["a", "b"])


def _object_array(values):
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _gen_scores(completions, **kw):
    return (0.25 * i for i in range(len(completions)))


@pytest.mark.parametrize(
    "outputs, scores, spans",
    [
        (np.array([0.5, 1.0, 0.0]), [0.5, 1.0, 0.0], [None] * 3),
        (torch.tensor([0.5, 1.0, 0.0], dtype=torch.bfloat16), [0.5, 1.0, 0.0], [None] * 3),
        ((0.5, None, 1), [0.5, None, 1.0], [None] * 3),
        ([np.float32(0.5), np.bool_(True), np.array(2.0)], [0.5, 1.0, 2.0], [None] * 3),
        ([torch.tensor(0.5), torch.tensor(1), None], [0.5, 1.0, None], [None] * 3),
        (_gen_scores(["a"] * 3), [0.0, 0.25, 0.5], [None] * 3),
        (_object_array([(1.0, np.array([[0, 2]])), (0.0, None), (0.5, [np.array([1, 3])])]),
         [1.0, 0.0, 0.5], [[(0, 2)], None, [(1, 3)]]),
        ([(1.0, torch.tensor([[0, 2], [3, 4]])), (0.0, np.zeros((0, 2), dtype=np.int64)),
          _WithSpans(0.5, np.array([[1, 3]]))],
         [1.0, 0.0, 0.5], [[(0, 2), (3, 4)], [], [(1, 3)]]),
    ],
    ids=["numpy", "tensor-bf16", "tuple-None", "numpy-scalars", "0d-tensors", "generator",
         "object-array-pairs", "array-spans"],
)  # fmt: skip
def test_span_capture_takes_the_outputs_trl_takes(outputs, scores, spans):
    """Issue 40, item 4: TRL's GRPOTrainer takes a reward function's list, tuple, numpy array
    or tensor (None entries for missing scores); the span capture refused all but lists and
    tuples ("expected a list ..., got ndarray"). Each gives its scores as floats (None kept)
    and its spans, which may be integer arrays too."""
    store = {}
    cap = trl_rewards._SpanCapture(lambda completions, **kw: outputs, 0, store)
    got = cap(completions=["a"] * 3)
    assert got == scores
    assert all(x is None or type(x) is float for x in got)
    assert store[0] == spans


@pytest.mark.parametrize(
    "outputs, match",
    [
        (np.ones((3, 1)), r"expected a list with one output per sample, or a 1-D array; "
                          r"got ndarray of shape"),
        (torch.zeros(()), r"or a 1-D array; got Tensor of shape"),
        ({"a": 1.0}, r"expected a list with one output per sample \(or a tuple, a 1-D numpy "
                     r"array or tensor; None entries for missing scores\), got dict"),
        ({1.0, 2.0}, r"got set"),
        (None, r"got NoneType"),
        (np.array(["1.0", "2.0"]), r"sample 0: expected a score"),
        ([(1.0, np.array([[0.0, 2.0]]))], r"sample 0: spans given as an array must be integers"),
        ([(1.0, np.array([0, 2]))], r"sample 0: spans given as an array must be integers of "
                                    r"shape \(n, 2\)"),
        ([np.array([1.0])], r"sample 0: expected a score"),
    ],
    ids=["2d-array", "0d-tensor", "dict", "set", "None", "string-array", "float-spans",
         "flat-span-array", "1-element-array"],
)  # fmt: skip
def test_span_capture_refuses_other_outputs_naming_the_reward(outputs, match):
    def my_reward(completions, **kw):
        return outputs

    cap = trl_rewards._SpanCapture(my_reward, 0, {})
    with pytest.raises(ValueError, match=r"reward function 'my_reward'.*" + match):
        cap(completions=["a", "b", "c"])


class Scorer:
    """A callable reward object with its own settings."""

    def __init__(self):
        self.scale, self.calls = 0.5, 0

    def __call__(self, completions, **kw):
        self.calls += 1
        return np.asarray([len(c) * self.scale for c in completions], dtype=np.float32)

    def describe(self):
        return f"scale {self.scale}"


def tensor_vowels(completions, **kw):
    return torch.tensor([float(sum(ch in "aeiou" for ch in c)) for c in completions])


def test_reward_objects_stay_reachable_and_array_rewards_train(tmp_path):
    """Issue 40, items 4 and 7: ``trainer.reward_funcs[i]`` was a wrapper hiding the user's
    object; its attributes now pass through (read and written), ``__wrapped__`` is the
    object, and the names are TRL's. Rewards returned as a numpy array and a tensor train a
    step, their values the rewards MRTPO's advantages are computed from."""
    import copy

    torch.manual_seed(0)
    model, tok = tiny_model_with_eos_bias()
    scorer = Scorer()
    tensor_vowels.unit = "vowels"
    config = trl_trainer.MRTPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=4, max_steps=1, learning_rate=1e-2, report_to=[],
        save_strategy="no", use_cpu=True, bf16=False, seed=0, logging_steps=1,
    )  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = trl_trainer.MRTPOGRPOTrainer(model=model, reward_funcs=[scorer, tensor_vowels],
                                           args=config, train_dataset=ds,
                                           processing_class=tok)  # fmt: skip
    wrapped, plain = trainer.reward_funcs
    assert trainer.reward_func_names == ["Scorer", "tensor_vowels"]
    assert wrapped.__wrapped__ is scorer and plain.__wrapped__ is tensor_vowels
    assert wrapped.__name__ == "Scorer" and plain.__name__ == "tensor_vowels"
    assert plain.__doc__ == tensor_vowels.__doc__ and wrapped.__doc__ == Scorer.__doc__
    assert wrapped.scale == 0.5 and wrapped.describe() == "scale 0.5" and plain.unit == "vowels"
    wrapped.scale = 0.25  # written to the user's object
    assert scorer.scale == 0.25 and "scale" not in vars(wrapped)
    with pytest.raises(AttributeError):
        wrapped.no_such_attribute  # noqa: B018
    dup = copy.deepcopy(wrapped)  # special names stay the wrapper's: a copy of the wrapper
    assert isinstance(dup, trl_rewards._SpanCapture) and dup.__wrapped__ is not scorer
    trainer.train()
    assert scorer.calls >= 1
    rewards = trainer._mrtpo_rewards_per_func
    assert rewards.shape == (4, 2) and bool(torch.isfinite(rewards).all())
    lengths = rewards[:, 0] / 0.25  # the object's new scale was used
    torch.testing.assert_close(lengths, lengths.round())
    assert any("loss" in h for h in trainer.state.log_history)


def _aggregation_warnings(tmp_path, config_cls, **fields):
    """The multi_objective_aggregation warnings of constructing a trainer."""
    import warnings

    torch.manual_seed(0)
    model, tok = tiny_model_with_eos_bias()
    config = config_cls(output_dir=str(tmp_path / "o"), per_device_train_batch_size=4,
                        num_generations=4, report_to=[], use_cpu=True, bf16=False,
                        **fields)  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trl_trainer.MRTPOGRPOTrainer(model=model, reward_funcs=[reward_length, reward_vowels],
                                     args=config, processing_class=tok,
                                     train_dataset=datasets.Dataset.from_dict(
                                         {"prompt": PROMPTS}))  # fmt: skip
    return [str(w.message) for w in seen if "multi_objective_aggregation" in str(w.message)]


def test_a_user_set_aggregation_other_than_gdpo_is_named_in_a_warning(tmp_path):
    """Issue 40, item 5: a multi_objective_aggregation set by the user was ignored without a
    word (MRTPO's advantages always normalize each reward in its group, then sum). MRTPOConfig
    defaults to that aggregation (GDPO's) and says nothing; any other value, in MRTPOConfig
    or a plain GRPOConfig (whose default is TRL's "sum_then_normalize"), gets one warning
    naming it, unless mrtpo_advantages=False trains with TRL's own advantages."""
    from mrtpo.integrations.trl_trainer import MRTPOConfig

    assert MRTPOConfig(output_dir=str(tmp_path), report_to=[]).multi_objective_aggregation \
        == "normalize_then_sum"  # fmt: skip
    assert _aggregation_warnings(tmp_path, MRTPOConfig) == []
    got = _aggregation_warnings(tmp_path, MRTPOConfig,
                                multi_objective_aggregation="sum_then_normalize")  # fmt: skip
    assert len(got) == 1
    assert got[0].startswith("multi_objective_aggregation='sum_then_normalize' is not what "
                             "MRTPO trains with")  # fmt: skip
    assert len(_aggregation_warnings(tmp_path, trl.GRPOConfig)) == 1
    assert (
        _aggregation_warnings(
            tmp_path, trl.GRPOConfig, multi_objective_aggregation="normalize_then_sum"
        )
        == []
    )
    assert (
        _aggregation_warnings(
            tmp_path,
            MRTPOConfig,
            mrtpo_advantages=False,
            multi_objective_aggregation="sum_then_normalize",
        )
        == []
    )


# --------------------------------------------------------------------------- MRTPOConfig

MRTPO_CLI = [
    "--mrtpo_alpha", "0.5", "--mrtpo_gamma", "2", "--mrtpo_relevance", "specific",
    "--mrtpo_stop_credit", "uniform", "--mrtpo_truncated_credit", "uniform",
    "--mrtpo_replay_micro_batch", "4", "--mrtpo_replay_max_tokens", "256",
    "--mrtpo_advantages", "false",
]  # fmt: skip
MRTPO_PARSED = dict(
    mrtpo_alpha=0.5, mrtpo_gamma=2.0, mrtpo_relevance="specific", mrtpo_stop_credit="uniform",
    mrtpo_truncated_credit="uniform", mrtpo_replay_micro_batch=4, mrtpo_replay_max_tokens=256,
    mrtpo_advantages=False,
)  # fmt: skip


def test_mrtpo_config_round_trips_through_trl_parser(tmp_path):
    """MRTPOConfig's fields parse from TRL's command line (TrlParser, an HfArgumentParser)
    and from its YAML --config, and a parsed config's fields parse back to equal values."""
    from trl import TrlParser

    from mrtpo.integrations.trl_trainer import MRTPOConfig

    parser = TrlParser((MRTPOConfig,))
    common = ["--output_dir", str(tmp_path / "o"), "--beta", "0.02", "--num_generations", "4",
              "--use_cpu", "true", "--bf16", "false"]  # fmt: skip
    (cfg,) = parser.parse_args_and_config(common + MRTPO_CLI)
    assert isinstance(cfg, MRTPOConfig)
    assert {k: getattr(cfg, k) for k in MRTPO_PARSED} == MRTPO_PARSED
    assert (cfg.beta, cfg.num_generations) == (0.02, 4)
    # a YAML config file, as `trl grpo --config` reads it
    yaml = tmp_path / "mrtpo.yaml"
    yaml.write_text("".join(f"{k}: {str(v).lower() if isinstance(v, bool) else v}\n"
                            for k, v in MRTPO_PARSED.items()))  # fmt: skip
    (from_file,) = parser.parse_args_and_config(common + ["--config", str(yaml)])
    assert {k: getattr(from_file, k) for k in MRTPO_PARSED} == MRTPO_PARSED
    # the parsed config, back through the parser
    back = {k: getattr(cfg, k) for k in MRTPO_PARSED}
    (again,) = parser.parse_dict({"output_dir": cfg.output_dir, "beta": cfg.beta,
                                  "use_cpu": True, "bf16": False, **back})  # fmt: skip
    assert {k: getattr(again, k) for k in MRTPO_PARSED} == MRTPO_PARSED
    # defaults: the library's; a bad choice is refused by the parser with the choices
    parser = TrlParser((MRTPOConfig,))  # (a --config sets the parser's defaults)
    (plain,) = parser.parse_args_and_config(common)
    assert (plain.mrtpo_alpha, plain.mrtpo_relevance, plain.mrtpo_replay_max_tokens) == (
        1.0, "js", None)  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args_and_config(common + ["--mrtpo_relevance", "oracle"])


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("mrtpo_alpha", 1.5, r"mrtpo_alpha: expected a number in \[0, 1\]"),
        ("mrtpo_alpha", "x", "mrtpo_alpha: expected a number"),
        ("mrtpo_gamma", 0.0, "mrtpo_gamma: expected a positive finite number"),
        ("mrtpo_gamma", float("inf"), "mrtpo_gamma: expected a positive finite number"),
        ("mrtpo_relevance", "control", "mrtpo_relevance: expected one of"),
        ("mrtpo_stop_credit", "none", "mrtpo_stop_credit: expected one of"),
        ("mrtpo_truncated_credit", 1, "mrtpo_truncated_credit: expected one of"),
        ("mrtpo_replay_micro_batch", 0, "mrtpo_replay_micro_batch: expected a positive int"),
        ("mrtpo_replay_max_tokens", -5, "mrtpo_replay_max_tokens: expected a positive int"),
        ("mrtpo_advantages", "yes", "mrtpo_advantages: expected a bool"),
    ],
)
def test_mrtpo_config_refuses_bad_options(tmp_path, field, value, match):
    from mrtpo.integrations.trl_trainer import MRTPOConfig

    with pytest.raises(ValueError, match=match):
        MRTPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, **{field: value})


def test_deprecated_constructor_options_warn_and_apply(tmp_path):
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                report_to=[], use_cpu=True)  # fmt: skip
    model, tok = tiny_model_with_eos_bias()
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    with pytest.warns(FutureWarning, match=r"mrtpo_micro_batch= -> MRTPOConfig\."
                      r"mrtpo_replay_micro_batch"):  # fmt: skip
        trainer = trl_trainer.MRTPOGRPOTrainer(
            model=model, reward_funcs=[reward_length], args=trl.GRPOConfig(**args),
            train_dataset=ds, processing_class=tok, mrtpo_alpha=0.25, mrtpo_micro_batch=2,
        )  # fmt: skip
    assert (trainer.mrtpo_alpha, trainer.mrtpo_replay_micro_batch) == (0.25, 2)
    assert trainer.mrtpo_gamma == 1.0  # a plain GRPOConfig: MRTPOConfig's defaults
    with pytest.raises(ValueError, match="mrtpo_alpha: expected a number in"):
        with pytest.warns(FutureWarning):
            trl_trainer.MRTPOGRPOTrainer(
                model=model, reward_funcs=[reward_length], args=trl.GRPOConfig(**args),
                train_dataset=ds, processing_class=tok, mrtpo_alpha=-1,
            )  # fmt: skip


# --------------------------------------------------------------------------- beta > 0


def test_beta_with_a_model_built_in_code_uses_a_frozen_copy_as_reference(tmp_path):
    """Issue 31, item 4: TRL loads the reference model from the policy's name, which a model
    built in code lacks ("Repo id must use alphanumeric chars"); the trainer then uses a
    frozen copy of the policy as passed, and the KL is 0 before the first update."""
    from mrtpo.integrations.trl_trainer import MRTPOConfig, MRTPOGRPOTrainer

    torch.manual_seed(0)
    model, tok = tiny_model_with_eos_bias()
    assert model.config._name_or_path == ""  # nothing saved: TRL alone cannot load it
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    config = MRTPOConfig(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=8, num_generations=4,
        max_completion_length=6, max_steps=2, learning_rate=1e-2, beta=0.1,
        temperature=1.3, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        bf16=False, seed=0,
    )  # fmt: skip
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 4})
    trainer = MRTPOGRPOTrainer(model=model, reward_funcs=[reward_length, reward_vowels],
                               args=config, train_dataset=ds, processing_class=tok)  # fmt: skip
    ref = trainer.accelerator.unwrap_model(trainer.ref_model)
    assert ref is not model and not any(p.requires_grad for p in ref.parameters())
    trainer.train()
    kls = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert len(kls) == 2 and kls[0] == pytest.approx(0.0, abs=1e-7) and kls[1] > 0
    for key, val in ref.state_dict().items():  # the reference stayed at the initial weights
        torch.testing.assert_close(val, initial[key], rtol=0, atol=0)
    moved = any(not torch.equal(v, initial[k]) for k, v in model.state_dict().items())
    assert moved


def test_mrtpo_config_runs_on_a_cpu_without_flags(tmp_path):
    """TRL's GRPOConfig defaults to bf16=True, which a machine without a bf16 GPU refuses
    unless use_cpu=True; MRTPOConfig's unset bf16 is False there, and use_cpu is True where
    no accelerator exists (else torchrun's CPU processes form no process group: the example
    under torchrun, tests/test_integrations_examples.py, sets neither)."""
    from transformers.utils import is_torch_bf16_gpu_available

    from mrtpo.integrations.trl_grpo.config import MRTPOConfig, _accelerator_available

    cfg = MRTPOConfig(output_dir=str(tmp_path))
    assert cfg.bf16 == is_torch_bf16_gpu_available()
    # no accelerator: use_cpu, without which torchrun's processes formed no process group
    assert cfg.use_cpu == (not _accelerator_available())
    if not is_torch_bf16_gpu_available():
        with pytest.raises(ValueError, match="bf16"):
            trl.GRPOConfig(output_dir=str(tmp_path))
        assert MRTPOConfig(output_dir=str(tmp_path), use_cpu=True).bf16  # TRL's default
    if not _accelerator_available():  # an explicit bf16 is kept (CPU autocast)
        explicit = MRTPOConfig(output_dir=str(tmp_path), bf16=True)
        assert explicit.bf16 and explicit.use_cpu
