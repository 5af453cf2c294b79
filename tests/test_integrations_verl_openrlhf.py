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


@pytest.mark.parametrize("bad", ["alhpa", "gama", "eps", "weights"])
def test_verl_batch_advantage_refuses_unknown_options(monkeypatch, bad):
    """Issue 32, item 2: a misspelled option is an error naming it, not the default."""
    with pytest.raises(ValueError, match=f"unknown option.*'{bad}'"):
        verl.compute_mrtpo_advantage_for_batch(_data(), **{bad: 0.5})
    _fake_verl(monkeypatch)
    with pytest.raises(ValueError, match=f"install_compute_advantage_patch: .*'{bad}'"):
        verl.install_compute_advantage_patch(**{bad: 0.5})
    data = _data()
    verl.compute_mrtpo_advantage_for_batch(data, alpha=0.5, gamma=2.0, epsilon=1e-6)
    assert data.batch["advantages"].shape == (8, 5)


# ----------------------------------------------------------------- replay only what can move

PROMPTS = ['Write about owls. Include the word "blue".', 'Write about rain. End with "bye now".']


def _replay_setup():
    from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer

    tok = build_tokenizer(PROMPTS * 4 + ["hello blue owls", "rain bye now"], vocab_size=300)
    cfg = TinyConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2,
                     num_heads=2, num_kv_heads=1)  # fmt: skip
    model = build_tiny_model(tok, cfg, seed=0).eval()
    p0, p1 = PROMPTS
    spans0 = [[(0, 17)], [(p0.index("Include"), len(p0))], []]
    spans1 = [[(0, 17)], [(p1.index("End"), len(p1))], [(p1.index("End"), len(p1))]]
    prompts = [p0] * 4 + [p1] * 4
    spans = [spans0] * 4 + [spans1] * 4
    responses = [[10, 11, 12], [13, 14], [15, 16, 17, 18], [19], [20, 21], [22, 23, 24],
                 [25], [26, 27, 28]]  # fmt: skip
    rewards = torch.tensor([
        [1.0, 0.0, 0.75], [1.0, 1.0, 0.25], [1.0, 0.0, 0.5], [1.0, 1.0, 0.5],  # reward 0 still
        [0.0, 1.0, 0.5], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [1.0, 1.0, 0.5],  # 1 still, 2 mean
    ])  # fmt: skip
    return tok, model, prompts, spans, responses, rewards


def _verl_batch(tok, prompts, spans, responses, rewards):
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    b, p, t = len(ids), max(map(len, ids)), max(map(len, responses))
    pr = torch.full((b, p), tok.pad_token_id)
    rs = torch.full((b, t), tok.pad_token_id)
    att = torch.zeros((b, p + t), dtype=torch.long)
    for i, (q, r) in enumerate(zip(ids, responses)):
        pr[i, p - len(q) :] = torch.tensor(q)
        rs[i, : len(r)] = torch.tensor(r)
        att[i, p - len(q) : p + len(r)] = 1
    batch = {"prompts": pr, "responses": rs, "attention_mask": att,
             "response_mask": att[:, p:], verl.REWARDS_KEY: rewards}  # fmt: skip
    ntb = {"raw_prompt": np.array(prompts, dtype=object),
           "mrtpo_spans": np.array(spans + [None], dtype=object)[:-1],
           "uid": np.array([f"g{i // 4}" for i in range(b)], dtype=object)}  # fmt: skip
    return SimpleNamespace(batch=batch, non_tensor_batch=ntb)


def test_verl_replay_mask_gives_the_full_replays_advantages():
    """The driver's set_replay_mask (whole batch) and the worker's fill_mrtpo_relevance: only
    the pairs whose advantage moves are replayed, the advantages equal bit for bit."""
    tok, model, prompts, spans, responses, rewards = _replay_setup()
    full = _verl_batch(tok, prompts, spans, responses, rewards)
    verl.fill_mrtpo_relevance(full, model, tok, temperature=0.9)
    part = _verl_batch(tok, prompts, spans, responses, rewards)
    mask = verl.set_replay_mask(part)
    assert torch.equal(part.batch[verl.REPLAY_MASK_KEY], mask)
    # reward 0 still in group 0, reward 1 in group 1, reward 2 rows at the mean (0.5)
    assert mask[:, 0].tolist() == [False] * 4 + [True] * 4
    assert not mask[4:, 1].any() and mask[:4, 1].all()
    assert mask[:, 2].tolist() == [True, True, False, False, False, True, True, False]
    verl.fill_mrtpo_relevance(part, model, tok, temperature=0.9)
    assert torch.equal(part.batch[verl.HAS_INFO_KEY], full.batch[verl.HAS_INFO_KEY])
    rel_f, rel_p = full.batch[verl.RELEVANCE_KEY], part.batch[verl.RELEVANCE_KEY]
    kept = (mask & full.batch[verl.HAS_INFO_KEY])[:, :, None].expand_as(rel_f)
    assert torch.equal(rel_p[kept], rel_f[kept]) and bool((rel_p[~kept] == 0).all())
    assert bool((rel_f[~kept] > 0).any())  # the full replay had something there
    for opts in ({}, {"alpha": 0.6, "gamma": 2.0, "batch_norm": "sequence"}):
        verl.compute_mrtpo_advantage_for_batch(full, **opts)
        verl.compute_mrtpo_advantage_for_batch(part, **opts)
        assert torch.equal(full.batch["advantages"], part.batch["advantages"])
    # without rewards or uids in the batch, no mask: every pair is replayed
    bare = _verl_batch(tok, prompts, spans, responses, rewards)
    del bare.batch[verl.REWARDS_KEY]
    assert verl.set_replay_mask(bare) is None and verl.REPLAY_MASK_KEY not in bare.batch


def test_openrlhf_replay_mask_gives_the_full_replays_advantages():
    tok, model, prompts, spans, responses, rewards = _replay_setup()
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    exps = []
    for rows in (range(0, 3), range(3, 8)):  # two experiences; group 0 spans both
        seqs = [ids[i] + responses[i] for i in rows]
        width = max(map(len, seqs))
        b = len(seqs)
        seq = torch.full((b, width), tok.pad_token_id)
        att = torch.zeros((b, width), dtype=torch.long)
        act = torch.zeros((b, width - 1), dtype=torch.long)
        for j, (i, s) in enumerate(zip(rows, seqs)):
            seq[j, width - len(s) :] = torch.tensor(s)  # left-padded
            att[j, width - len(s) :] = 1
            act[j, width - len(responses[i]) - 1 :] = 1
        exps.append(SimpleNamespace(sequences=seq, attention_mask=att, action_mask=act,
                                    prompts=[prompts[i] for i in rows],
                                    spans=[spans[i] for i in rows],
                                    rewards=rewards[list(rows)]))  # fmt: skip
    masks = openrlhf.replay_masks_for_experiences([e.rewards for e in exps], 4)
    assert [m.shape for m in masks] == [(3, 3), (5, 3)]
    outs = {}
    for name, use in (("full", False), ("part", True)):
        rel, info = [], []
        for e, m in zip(exps, masks):
            r, h = openrlhf.relevance_for_experience(
                model, e, e.spans, tokenizer=tok, temperature=0.9,
                replay_mask=m if use else None,
            )  # fmt: skip
            rel.append(r)
            info.append(h)
        outs[name] = openrlhf.mrtpo_token_advantages_for_experiences(
            [e.rewards for e in exps], 4, [e.action_mask for e in exps], rel, info
        )
        outs[name + "_rel"] = rel
    assert any(bool((a != b).any()) for a, b in zip(outs["full_rel"], outs["part_rel"]))
    for a, b in zip(outs["full"], outs["part"]):
        assert torch.equal(a, b)
