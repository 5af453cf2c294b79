"""The verl adapter inside verl 0.9.1 itself (run by `make test-frameworks`).

Drives verl's own entry points: `ray_trainer.compute_advantage` called as verl's trainer calls
it, from verl's hydra config with `algorithm.adv_estimator=mrtpo`, on a real `DataProto`;
verl's GDPO on the same batch; verl's fused-kernel model forward and its registered policy
loss, with the log-probs from `install_fused_forward` (models that scale or softcap their
logits included). Skipped where verl is not installed
(the project's main environment).
"""

import os
import sys

import numpy as np
import pytest
import torch

verl_pkg = pytest.importorskip(
    "verl", reason="verl runs in .venv-frameworks (make test-frameworks)"
)

from hydra import compose, initialize_config_dir  # noqa: E402
from verl import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402

from mrtpo.integrations import verl  # noqa: E402
from mrtpo_kernels import mrtpo_token_advantages  # noqa: E402

B, K, P, T, G = 8, 2, 3, 6, 4


def _config(*overrides):
    d = os.path.join(os.path.dirname(verl_pkg.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=d, version_base=None):
        return compose("ppo_trainer", overrides=[f"actor_rollout_ref.rollout.n={G}", *overrides])


def _data(seed=0):
    """A DataProto as verl's trainer has it before compute_advantage (no response_mask yet)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([6, 3, 5, 1, 6, 4, 2, 6])
    response_mask = (torch.arange(T)[None] < lengths[:, None]).long()
    attention_mask = torch.cat([torch.ones(B, P, dtype=torch.long), response_mask], dim=1)
    scores = torch.rand(B, K, generator=g) * torch.tensor([1.0, 3.0])
    token_level = torch.zeros(B, T)
    token_level[torch.arange(B), lengths - 1] = scores.sum(1)
    relevance = torch.rand(B, K, T, generator=g) * response_mask[:, None]
    has_info = torch.tensor([[True, False], [True, True]] * (B // 2))
    uids = np.array([f"prompt-{i // G}" for i in range(B)], dtype=object)
    tensors = {
        "prompts": torch.randint(0, 50, (B, P), generator=g),
        "responses": torch.randint(0, 50, (B, T), generator=g),
        "attention_mask": attention_mask,
        "token_level_rewards": token_level,
        verl.REWARDS_KEY: scores,
        verl.RELEVANCE_KEY: relevance,
        verl.HAS_INFO_KEY: has_info,
    }
    non_tensors = {"uid": uids, "r0": scores[:, 0].numpy(), "r1": scores[:, 1].numpy()}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)


def _as_trainer_calls(data, cfg):
    """ray_trainer.compute_advantage with the arguments RayPPOTrainer.fit passes."""
    return ray_trainer.compute_advantage(
        data,
        adv_estimator=cfg.algorithm.adv_estimator,
        gamma=cfg.algorithm.gamma,
        lam=cfg.algorithm.lam,
        num_repeat=cfg.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
        config=cfg.algorithm,
    )


@pytest.fixture
def restore_verl():
    fn = ray_trainer.compute_advantage
    registry = dict(core_algos.ADV_ESTIMATOR_REGISTRY)
    yield
    ray_trainer.compute_advantage = fn
    core_algos.ADV_ESTIMATOR_REGISTRY.clear()
    core_algos.ADV_ESTIMATOR_REGISTRY.update(registry)


def test_compute_advantage_from_config(restore_verl):
    assert verl_pkg.__version__ in verl.PATCHED_VERL_VERSIONS
    cfg = _config("algorithm.adv_estimator=mrtpo")
    verl.register_with_verl(patch_compute_advantage=True, alpha=0.7, gamma=1.5)
    assert core_algos.get_adv_estimator_fn("mrtpo").mrtpo_options["alpha"] == 0.7
    data = _as_trainer_calls(_data(), cfg)
    b = data.batch
    mask = b["attention_mask"][:, P:]
    torch.testing.assert_close(b["response_mask"], mask, rtol=0, atol=0)  # verl's own step
    want = mrtpo_token_advantages(
        b[verl.REWARDS_KEY], torch.arange(B) // G, b[verl.RELEVANCE_KEY].transpose(0, 1),
        has_info=b[verl.HAS_INFO_KEY], response_mask=mask, alpha=0.7, gamma=1.5,
        eps=1e-6, batch_norm="token",
    ).token  # fmt: skip
    torch.testing.assert_close(b["advantages"], want, rtol=1e-6, atol=1e-6)
    assert b["returns"].data_ptr() == b["advantages"].data_ptr()
    assert (b["advantages"][mask == 0] == 0).all()
    assert b["advantages"][mask == 1].abs().min() > 0  # every response token gets credit


def test_alpha_zero_equals_verls_gdpo_on_the_same_batch(restore_verl):
    verl.register_with_verl(patch_compute_advantage=True, alpha=0.0)
    ours = _as_trainer_calls(_data(1), _config("algorithm.adv_estimator=mrtpo"))
    gdpo_cfg = _config("algorithm.adv_estimator=gdpo", "+algorithm.gdpo_reward_keys=[r0,r1]")
    theirs = _as_trainer_calls(_data(1), gdpo_cfg)  # verl's own estimator, untouched
    torch.testing.assert_close(
        ours.batch["advantages"], theirs.batch["advantages"], rtol=1e-5, atol=1e-5
    )
    # the relevance matters once alpha > 0
    verl.register_with_verl(patch_compute_advantage=True, alpha=1.0)
    moved = _as_trainer_calls(_data(1), _config("algorithm.adv_estimator=mrtpo"))
    assert not torch.allclose(moved.batch["advantages"], theirs.batch["advantages"], atol=1e-3)


def test_other_estimators_still_reach_verl(restore_verl):
    verl.register_with_verl(patch_compute_advantage=True)
    data = _as_trainer_calls(_data(2), _config("algorithm.adv_estimator=grpo"))
    adv, _ = core_algos.compute_grpo_outcome_advantage(
        data.batch["token_level_rewards"], data.batch["response_mask"], data.non_tensor_batch["uid"]
    )
    torch.testing.assert_close(data.batch["advantages"], adv, rtol=0, atol=0)


def test_without_the_patch_the_estimator_says_why(restore_verl):
    verl.register_with_verl()  # registry only: verl 0.9.1 passes no batch to it
    with pytest.raises(ValueError, match="compute_mrtpo_advantage_for_batch"):
        _as_trainer_calls(_data(3), _config("algorithm.adv_estimator=mrtpo"))


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )  # fmt: skip
    return Qwen2ForCausalLM(cfg).double()


def test_fused_forward_feeds_verls_policy_loss():
    """verl's fused-kernel forward vs ours; verl's registered policy loss on each."""
    from omegaconf import OmegaConf
    from verl.models.transformers.monkey_patch import apply_monkey_patch
    from verl.utils.config import omega_conf_to_dataclass

    model = _tiny_qwen2()
    cls = model.__class__
    original_forward = cls.forward
    g = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 97, (1, 20), generator=g)  # one packed (rmpad) row
    position_ids = torch.cat([torch.arange(12), torch.arange(8)])[None]
    temperature = 0.8
    # verl's actor config (FSDPActorConfig: clip_ratio 0.2, clip_ratio_c 3, token-mean);
    # the model section is left out: it wants a model path
    section = _config("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2")
    section = OmegaConf.to_container(section.actor_rollout_ref.actor, resolve=True)
    section.pop("model_config", None)
    actor = omega_conf_to_dataclass(OmegaConf.create(section))
    assert actor.clip_ratio_c == 3.0
    policy_loss = core_algos.get_policy_loss_fn(actor.policy_loss.loss_mode)  # "vanilla"
    old = torch.randn(1, 20, generator=g, dtype=torch.float64) * 0.3 - 4.6
    adv = torch.randn(1, 20, generator=g, dtype=torch.float64)
    mask = torch.ones(1, 20)
    mask[0, 11] = 0  # last token of the first sequence predicts across the boundary

    def run():
        model.zero_grad()
        out = model(
            input_ids=input_ids,
            position_ids=position_ids,
            temperature=temperature,
            return_dict=True,
        )
        loss, metrics = policy_loss(old, out.log_probs, adv, mask, actor.loss_agg_mode, actor)
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        return out.log_probs.detach(), out.entropy.detach(), loss.detach(), grads

    try:
        apply_monkey_patch(model, use_remove_padding=False, use_fused_kernels=True,
                           fused_kernels_backend="torch")  # fmt: skip
        assert cls.forward is not original_forward
        lp_v, ent_v, loss_v, grads_v = run()  # verl's own fused forward
        verl.install_fused_forward(model)
        assert cls.forward is verl.fused_causal_lm_forward
        lp_m, ent_m, loss_m, grads_m = run()
    finally:
        cls.forward = original_forward
    torch.testing.assert_close(lp_m.double(), lp_v.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent_m.double(), ent_v.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_m.double(), loss_v.double(), rtol=1e-5, atol=1e-6)
    for a, b in zip(grads_m, grads_v):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    # and against plain logits
    with torch.no_grad():
        logits = original_forward(model, input_ids=input_ids, position_ids=position_ids).logits
        want = torch.log_softmax(logits / temperature, -1)
        want = want.gather(-1, torch.roll(input_ids, -1, -1)[..., None])[..., 0]
    torch.testing.assert_close(lp_m.double(), want, rtol=1e-5, atol=1e-5)


def _tiny_transformed(kind):
    """A tiny float64 causal LM whose config transforms its logits: Gemma 2 caps them
    (final_logit_softcapping, small enough to bend these logits), Cohere 2 scales them."""
    import transformers

    common = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                  max_position_embeddings=64, layer_types=["full_attention"] * 2)  # fmt: skip
    torch.manual_seed(0)
    if kind == "gemma2":
        cfg = transformers.Gemma2Config(final_logit_softcapping=0.5, tie_word_embeddings=False,
                                        **common)  # fmt: skip
        return transformers.Gemma2ForCausalLM(cfg).double()
    cfg = transformers.Cohere2Config(logit_scale=-0.75, **common)
    return transformers.Cohere2ForCausalLM(cfg).double()


@pytest.mark.parametrize("kind", ["gemma2", "cohere2"])
def test_fused_forward_applies_the_models_logit_transform(kind):
    """install_fused_forward on a model that softcaps (Gemma 2) or scales (Cohere 2) its
    logits: the fused forward's log-probs, entropies and every parameter gradient equal
    those of the model's own logits (its forward applies the transform) at the temperature
    verl passes."""
    model = _tiny_transformed(kind)
    cls = model.__class__
    original_forward = cls.forward
    g = torch.Generator().manual_seed(7)
    input_ids = torch.randint(0, 97, (2, 9), generator=g)
    temperature = 0.7
    weights = torch.randn(2, 9, generator=g, dtype=torch.float64)

    def grads_of(logp, ent):
        model.zero_grad()
        ((logp * weights).sum() + 0.3 * ent.sum()).backward()
        return [p.grad.clone() for p in model.parameters() if p.grad is not None]

    logits = original_forward(model, input_ids=input_ids).logits
    raw = model.get_output_embeddings()(model.model(input_ids=input_ids)[0])
    assert float((logits - raw).abs().max()) > 1e-2  # the transform is active here
    logq = torch.log_softmax(logits / temperature, -1)
    want_lp = logq.gather(-1, torch.roll(input_ids, -1, -1)[..., None])[..., 0]
    want_ent = -(logq.exp() * logq).sum(-1)
    want_grads = grads_of(want_lp, want_ent)
    try:
        verl.install_fused_forward(model)
        out = model(input_ids=input_ids, temperature=temperature, return_dict=True)
    finally:
        cls.forward = original_forward
    torch.testing.assert_close(out.log_probs, want_lp, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.entropy, want_ent, rtol=1e-10, atol=1e-10)
    got_grads = grads_of(out.log_probs, out.entropy)
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)


def test_install_fused_forward_refuses_an_unknown_multiplier():
    """A logit multiplier whose place the fused head does not know is refused when the
    forward is installed, naming the field."""
    model = _tiny_qwen2()
    model.config.output_multiplier = 2.0
    with pytest.raises(ValueError, match="output_multiplier"):
        verl.install_fused_forward(model)


def test_verl_example_check_runs_as_written():
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-W", "ignore", str(root / "examples/verl/main_mrtpo.py"), "--check"],
        cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert "adv_estimator=mrtpo" in out.stdout and "advantages (16, 6)" in out.stdout
