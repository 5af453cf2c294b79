"""verl's compute_advantage patch (against a stand-in module with verl 0.9.1's signature:
the real verl runs in `make test-frameworks`) and OpenRLHF grouping by experience.index."""

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrtpo.integrations import openrlhf, verl
from mrtpo_kernels import mrtpo_token_advantages


def _fake_verl(monkeypatch, version="0.9.1"):
    calls = []

    def compute_advantage(data, adv_estimator, gamma=1.0, lam=1.0, num_repeat=1,
                          norm_adv_by_std_in_grpo=True, config=None):  # fmt: skip
        calls.append(adv_estimator)
        return data

    def compute_response_mask(data):
        raise AssertionError("response_mask is in the batch")

    pkg = types.ModuleType("verl")
    pkg.__version__ = version
    rt = types.ModuleType("verl.trainer.ppo.ray_trainer")
    rt.compute_advantage = compute_advantage
    rt.compute_response_mask = compute_response_mask
    for name, mod in (("verl", pkg), ("verl.trainer", types.ModuleType("verl.trainer")),
                      ("verl.trainer.ppo", types.ModuleType("verl.trainer.ppo")),
                      ("verl.trainer.ppo.ray_trainer", rt)):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, mod)
    return rt, calls


def _data(seed=0, b=8, k=2, t=5):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.rand(b, k, generator=g)
    mask = torch.ones(b, t, dtype=torch.long)
    mask[1, 3:] = 0
    rel = torch.rand(b, k, t, generator=g) * mask[:, None]
    info = torch.tensor([[True, False]] * b)
    uids = np.array([f"p{i // 4}" for i in range(b)], dtype=object)
    batch = {"response_mask": mask, verl.REWARDS_KEY: rewards, verl.RELEVANCE_KEY: rel,
             verl.HAS_INFO_KEY: info}  # fmt: skip
    return SimpleNamespace(batch=batch, non_tensor_batch={"uid": uids})


def test_verl_patch_routes_mrtpo_and_leaves_others(monkeypatch):
    rt, calls = _fake_verl(monkeypatch)
    fn = verl.install_compute_advantage_patch(alpha=0.5)
    assert rt.compute_advantage is fn
    data = _data()
    rt.compute_advantage(data, "mrtpo", gamma=1.0, config=None)
    b = data.batch
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    want = mrtpo_token_advantages(
        b[verl.REWARDS_KEY], ids, b[verl.RELEVANCE_KEY].transpose(0, 1),
        has_info=b[verl.HAS_INFO_KEY], response_mask=b["response_mask"], alpha=0.5,
        batch_norm="token",
    ).token  # fmt: skip
    torch.testing.assert_close(b["advantages"], want, rtol=0, atol=0)
    assert calls == []
    rt.compute_advantage(data, "grpo")
    assert calls == ["grpo"]
    # installing again replaces the options, never wraps the wrapper
    again = verl.install_compute_advantage_patch(alpha=0.0)
    assert again.original is fn.original


def test_verl_patch_refuses_unknown_version(monkeypatch):
    _fake_verl(monkeypatch, version="0.10.0")
    with pytest.raises(RuntimeError, match="0.10.0"):
        verl.install_compute_advantage_patch()
    assert verl.install_compute_advantage_patch(allow_unknown_version=True) is not None


def test_openrlhf_groups_by_index_under_dynamic_batching():
    g = torch.Generator().manual_seed(4)
    b, k, t = 8, 2, 6
    rewards = torch.rand(b, k, generator=g) * 4
    mask = torch.ones(b, t, dtype=torch.long)
    rel = torch.rand(k, b, t, generator=g)
    info = torch.ones(b, k, dtype=torch.bool)
    index = torch.arange(b)  # OpenRLHF's experience.index: rollout positions
    ordered = openrlhf.mrtpo_token_advantages_from_experience(rewards, 4, mask, rel, info)
    perm = torch.tensor([5, 0, 7, 2, 1, 6, 3, 4])  # a length-balanced reordering
    shuffled = openrlhf.mrtpo_token_advantages_from_experience(
        rewards[perm], 4, mask[perm], rel[:, perm], info[perm], index=index[perm]
    )
    torch.testing.assert_close(shuffled, ordered[perm], rtol=1e-6, atol=1e-6)
    wrong = openrlhf.mrtpo_token_advantages_from_experience(
        rewards[perm], 4, mask[perm], rel[:, perm], info[perm]
    )
    assert not torch.allclose(wrong, ordered[perm])
    parts = openrlhf.mrtpo_token_advantages_for_experiences(
        [rewards[perm[:4]], rewards[perm[4:]]], 4, [mask[perm[:4]], mask[perm[4:]]],
        [rel[:, perm[:4]], rel[:, perm[4:]]], [info[perm[:4]], info[perm[4:]]],
        index=[index[perm[:4]], index[perm[4:]]],
    )  # fmt: skip
    torch.testing.assert_close(torch.cat(parts), ordered[perm], rtol=1e-6, atol=1e-6)
    for bad in (index[:3], torch.zeros(b, dtype=torch.long), index.float(), [0.0] * b):
        with pytest.raises(ValueError, match="index"):
            openrlhf.mrtpo_token_advantages_from_experience(rewards, 4, mask, rel, info, index=bad)
    # group of row i is index[i] // n_samples_per_prompt
    torch.testing.assert_close(
        openrlhf.rollout_group_ids(index[perm], b, 4), index[perm] // 4, rtol=0, atol=0
    )


def test_verl_policy_loss_passes_verl_clip_settings_through():
    # verl's actor config: clip_ratio_low falls back to clip_ratio, clip_ratio_c (the dual
    # clip, verl's default 3) reaches linear_policy_loss; loss_agg_mode is the aggregation
    from mrtpo_kernels import linear_logprobs, linear_policy_loss

    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(12, 8, generator=g), torch.randn(40, 8, generator=g)
    lab = torch.randint(0, 40, (12,), generator=g)
    with torch.no_grad():
        cur = linear_logprobs(h, w, lab)
    old = cur - 4.0 * torch.rand(12, generator=g)  # ratios up to e^4: the dual clip binds
    adv = torch.randn(12, generator=g)
    cfg = dict(clip_ratio=0.2, clip_ratio_low=None, clip_ratio_high=0.28, clip_ratio_c=2.5,
               loss_agg_mode="token-mean")  # fmt: skip
    want, wm = linear_policy_loss(h, w, lab, old, adv, clip_low=0.2, clip_high=0.28,
                                  clip_ratio_c=2.5)  # fmt: skip
    for config in (cfg, SimpleNamespace(**cfg)):
        got, m = verl.policy_loss_from_hidden(h, w, lab, old, adv, config=config)
        assert got.item() == want.item() and m["dual_clip_fraction"] > 0
    default, _ = verl.policy_loss_from_hidden(h, w, lab, old, adv)  # verl's defaults
    verl3, m3 = linear_policy_loss(h, w, lab, old, adv, clip_ratio_c=3.0)
    assert default.item() == verl3.item() and m3["dual_clip_fraction"] > 0
    off, _ = verl.policy_loss_from_hidden(h, w, lab, old, adv, clip_ratio_c=None)
    assert off.item() != verl3.item()
