"""The TRL, verl and OpenRLHF adapters against the library's own results on the same data.

None of the frameworks is installed here: the adapters are checked on tensors in the
frameworks' layouts, verl's registry through a stand-in module with the same entry point.
"""

from __future__ import annotations

import importlib
import math
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from mrtpo.integrations import common, openrlhf, trl, verl
from mrtpo_kernels import (
    gdpo_advantages,
    linear_js_distance,
    linear_logprobs,
    mrtpo_token_advantages,
)
from mrtpo_kernels.reference import (
    linear_logprobs_ref,
    linear_policy_loss_ref,
    mrtpo_token_advantages_ref,
)

B, K, T, D, V = 8, 3, 7, 5, 37


def _batch(seed=0, b=B, k=K, t=T, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 3, (b, k), generator=g).to(dtype)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).to(torch.long)
    relevance = torch.rand((k, b, t), generator=g, dtype=dtype) * mask
    has_info = torch.rand((b, k), generator=g) > 0.3
    has_info[:, 0] = False  # one reward without spans (plain GDPO broadcast)
    return rewards, mask, relevance, has_info


def _uids(b=B, seed=0):
    """Four groups of two, as verl's uid strings in an object array, interleaved."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(b, generator=g).tolist()
    names = [f"uid-{j // 2:03d}" for j in range(b)]
    uids = np.empty(b, dtype=object)
    for pos, src in enumerate(perm):
        uids[pos] = names[src]
    ids = torch.tensor([int(u.split("-")[1]) for u in uids])
    return uids, ids


# --------------------------------------------------------------------------- verl


def test_verl_equals_library_with_uid_strings():
    rewards, mask, rel, info = _batch()
    uids, ids = _uids()
    adv, ret = verl.compute_mrtpo_outcome_advantage(
        rewards, mask, uids, rel, info, alpha=0.7, gamma=1.5
    )
    # verl's convention by default: the batch std over response tokens
    lib = mrtpo_token_advantages(
        rewards, ids, rel, has_info=info, response_mask=mask, alpha=0.7, gamma=1.5,
        batch_norm="token",
    )  # fmt: skip
    assert adv.shape == (B, T) and ret is adv
    torch.testing.assert_close(adv, lib.token, rtol=0, atol=0)
    assert bool((adv[mask == 0] == 0).all())
    assert bool((adv[mask == 1] != 0).any())


def test_verl_equals_float64_reference():
    rewards, mask, rel, info = _batch(seed=3, dtype=torch.float64)
    uids, ids = _uids(seed=3)
    adv, _ = verl.compute_mrtpo_outcome_advantage(
        rewards, mask, list(uids), rel, info, batch_norm="sequence"
    )
    lengths = mask.sum(1).tolist()
    ref, _ = mrtpo_token_advantages_ref(
        rewards, ids, [rel[:, i, :n] for i, n in enumerate(lengths)], has_info=info
    )
    for i, n in enumerate(lengths):
        torch.testing.assert_close(adv[i, :n], ref[i], rtol=1e-9, atol=1e-9)


def test_verl_alpha_zero_is_gdpo_broadcast_and_token_rewards_sum():
    rewards, mask, rel, info = _batch(seed=1)
    uids, ids = _uids(seed=1)
    per_token = torch.zeros((B, K, T))
    last = mask.sum(1) - 1
    per_token[torch.arange(B), :, last] = rewards  # verl puts the score on the last token
    adv, _ = verl.compute_mrtpo_outcome_advantage(
        per_token, mask, uids, rel, info, alpha=0.0, batch_norm="sequence"
    )
    gdpo = gdpo_advantages(rewards, ids)
    torch.testing.assert_close(adv, gdpo.sequence[:, None] * mask, rtol=1e-6, atol=1e-6)


def test_verl_batch_helper_and_registry(monkeypatch):
    rewards, mask, rel, info = _batch(seed=2)
    uids, ids = _uids(seed=2)
    expected = mrtpo_token_advantages(
        rewards, ids, rel, has_info=info, response_mask=mask, gamma=2.0, batch_norm="token"
    ).token
    batch = {
        "response_mask": mask,
        "token_level_rewards": torch.zeros(B, T),
        verl.REWARDS_KEY: rewards,
        verl.RELEVANCE_KEY: rel.transpose(0, 1).contiguous(),  # batch dimension first
        verl.HAS_INFO_KEY: info,
    }
    data = SimpleNamespace(batch=dict(batch), non_tensor_batch={"uid": uids})
    verl.compute_mrtpo_advantage_for_batch(data, gamma=2.0)
    torch.testing.assert_close(data.batch["advantages"], expected, rtol=0, atol=0)
    torch.testing.assert_close(data.batch["returns"], expected, rtol=0, atol=0)

    # A stand-in for verl.trainer.ppo.core_algos with its registry entry point.
    registry = {}

    def register_adv_est(name):
        def deco(fn):
            if name in registry and registry[name] is not fn:
                raise ValueError(f"{name} already registered")
            registry[name] = fn
            return fn

        return deco

    core = types.ModuleType("verl.trainer.ppo.core_algos")
    core.register_adv_est = register_adv_est
    core.ADV_ESTIMATOR_REGISTRY = registry
    for name in ("verl", "verl.trainer", "verl.trainer.ppo"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "verl.trainer.ppo.core_algos", core)

    fn = verl.register_with_verl(gamma=2.0)
    assert registry["mrtpo"] is fn
    # verl's generic call: standard keywords, plus the batch in versions that pass it.
    adv, ret = registry["mrtpo"](
        token_level_rewards=batch["token_level_rewards"], response_mask=mask, index=uids,
        config=None, batch=batch,
    )  # fmt: skip
    torch.testing.assert_close(adv, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="compute_mrtpo_advantage_for_batch"):
        registry["mrtpo"](token_level_rewards=batch["token_level_rewards"],
                          response_mask=mask, index=uids, config=None)  # fmt: skip
    fn2 = verl.register_with_verl(gamma=1.0)  # replaces our own earlier registration
    assert registry["mrtpo"] is fn2
    with pytest.raises(ValueError, match="options"):
        verl.register_with_verl(gama=1.0)


def test_verl_missing_framework(monkeypatch):
    monkeypatch.setitem(sys.modules, "verl", None)  # makes `import verl` fail
    with pytest.raises(ImportError, match="'verl'"):
        verl.register_with_verl()


def test_adapters_do_not_import_frameworks(monkeypatch):
    for name in ("verl", "trl", "openrlhf"):
        monkeypatch.setitem(sys.modules, name, None)
    for mod in (common, verl, trl, openrlhf):
        importlib.reload(mod)


def test_verl_logprobs_from_hidden_rmpad():
    g = torch.Generator().manual_seed(4)
    n = 13
    h = torch.randn((1, n, D), generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn((V, D), generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, V, (1, n), generator=g)
    logp, ent = verl.logprobs_from_hidden(h, w, labels, 0.7, True)
    ref = linear_logprobs_ref(h[0], w, labels[0], temperature=0.7)
    assert logp.shape == (1, n) and ent.shape == (1, n)
    torch.testing.assert_close(logp[0].double(), ref, rtol=1e-6, atol=1e-6)
    gup = torch.randn(1, n, generator=g, dtype=torch.float64)
    (logp.double() * gup).sum().backward()
    gh, gw = h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    (ref * gup[0]).sum().backward()
    torch.testing.assert_close(gh, h.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw, w.grad, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="hidden"):
        verl.logprobs_from_hidden(torch.randn(2, n, D), torch.randn(V, D), labels.expand(2, n))


# --------------------------------------------------------------------------- TRL


def test_trl_groups_consecutive_generations():
    rewards, mask, rel, info = _batch(seed=5)
    g = 4
    adv = trl.mrtpo_advantages_for_grpo(rewards, g, mask, rel, info, gamma=1.3)
    lib = mrtpo_token_advantages(
        rewards,
        torch.arange(B) // g,
        rel,
        has_info=info,
        response_mask=mask,
        gamma=1.3,
        eps=1e-4,
    ).token
    torch.testing.assert_close(adv, lib, rtol=0, atol=0)
    strided = mrtpo_token_advantages(
        rewards,
        torch.arange(B) % (B // g),
        rel,
        has_info=info,
        response_mask=mask,
        gamma=1.3,
        eps=1e-4,
    ).token
    assert (adv - strided).abs().max() > 1e-3  # the grouping is what is checked


def test_trl_alpha_zero_is_trl_normalize_then_sum():
    """TRL's GDPO option, written out: per reward and group (r - mean) / (std + 1e-4), the
    weighted sum, then (s - mean) / (std + 1e-4) over the batch, broadcast over tokens."""
    rewards, mask, rel, info = _batch(seed=14, b=12)
    w = torch.tensor([1.0, 0.3, 2.0])
    g = 3
    adv = trl.mrtpo_advantages_for_grpo(rewards, g, mask, rel, info, reward_weights=w, alpha=0.0)
    grouped = rewards.view(-1, g, K)
    std_k = grouped.std(dim=1, keepdim=True)
    per_k = torch.where(std_k > 0, (grouped - grouped.mean(1, keepdim=True)) / (std_k + 1e-4), 0)
    s = (per_k.reshape(-1, K) * w).sum(1)
    seq = (s - s.mean()) / (s.std() + 1e-4)
    torch.testing.assert_close(adv, seq[:, None] * mask, rtol=1e-5, atol=1e-6)
    full = trl.mrtpo_advantages_for_grpo(rewards, g, mask, rel, info, reward_weights=w)
    assert (full - adv).abs().max() > 1e-3  # alpha = 1 does reallocate


def _trl_scaled(r, g, scale, eps=1e-4):
    """TRL's GRPO scaling of one reward (its sum_then_normalize with a single reward), written
    out: r minus its group mean, divided by the group's std + eps ("group"), by the std of r
    over the whole batch + eps ("batch"), or by nothing ("none")."""
    grouped = r.view(-1, g)
    centred = (grouped - grouped.mean(1, keepdim=True)).reshape(-1)
    if scale == "group":
        return centred / (grouped.std(1).repeat_interleave(g) + eps)
    if scale == "batch":
        return centred / (r.std() + eps)
    return centred


@pytest.mark.parametrize("scale_rewards", [True, "group", "batch", "none", False])
def test_trl_scale_rewards_variants(scale_rewards):
    """TRL's scale_rewards values (its booleans too) are GDPO variants: each reward scaled as
    TRL's GRPO scales its reward, then the weighted sum normalized over the batch (alpha = 0:
    broadcast over tokens); "group" is TRL's normalize_then_sum. alpha > 0 reallocates from
    the same A_k (the float64 reference), on one process or sliced over several."""
    rewards, mask, rel, info = _batch(seed=15, b=12)
    rewards[:, 1] *= 5.0  # rewards of different units: the variants differ
    w = torch.tensor([1.0, 0.3, 2.0])
    g = 3
    name = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    per_k = torch.stack([_trl_scaled(rewards[:, j].double(), g, name) for j in range(K)], 1)
    s = (per_k * w.double()).sum(1)
    seq = (s - s.mean()) / (s.std() + 1e-4)
    kw = dict(reward_weights=w, scale_rewards=scale_rewards)
    adv = trl.mrtpo_advantages_for_grpo(rewards, g, mask, rel, info, alpha=0.0, **kw)
    torch.testing.assert_close(adv, (seq[:, None] * mask).float(), rtol=1e-5, atol=1e-6)
    full = trl.mrtpo_advantages_for_grpo(rewards, g, mask, rel, info, alpha=0.7, **kw)
    ref, _ = mrtpo_token_advantages_ref(
        rewards.double(), torch.arange(12) // g, [rel[:, i, : int(mask[i].sum())].double()
                                                  for i in range(12)],
        has_info=info, weights=w.double(), alpha=0.7, eps=1e-4, scale_rewards=name,
    )  # fmt: skip
    torch.testing.assert_close(full[mask.bool()].double(), torch.cat(ref), rtol=0, atol=1e-5)
    for sl in (slice(0, 6), slice(6, 12)):
        part = trl.mrtpo_advantages_for_grpo(rewards, g, mask[sl], rel[:, sl], info[sl],
                                             alpha=0.7, process_slice=sl, **kw)  # fmt: skip
        torch.testing.assert_close(part, full[sl], rtol=0, atol=0)


def test_trl_reward_weights_and_nan_like_nansum():
    rewards, mask, rel, info = _batch(seed=6)
    rewards[2, 1] = math.nan
    w = torch.tensor([1.0, 0.5, 2.0])
    adv = trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info, reward_weights=w)
    lib = mrtpo_token_advantages(
        torch.nan_to_num(rewards, nan=0.0), torch.arange(B) // 2, rel, has_info=info,
        response_mask=mask, weights=w, eps=1e-4,
    ).token  # fmt: skip
    torch.testing.assert_close(adv, lib, rtol=0, atol=0)


def test_trl_process_slice_matches_global():
    rewards, mask, rel, info = _batch(seed=7, b=12)
    full = trl.mrtpo_advantages_for_grpo(rewards, 3, mask, rel, info, alpha=0.5)
    for sl in (slice(0, 6), slice(6, 12)):
        part = trl.mrtpo_advantages_for_grpo(
            rewards, 3, mask[sl], rel[:, sl], info[sl], alpha=0.5, process_slice=sl
        )
        torch.testing.assert_close(part, full[sl], rtol=0, atol=0)


def test_trl_empty_completion_row_keeps_mass():
    rewards, mask, rel, info = _batch(seed=8)
    mask[3] = 0  # a truncated completion TRL masked out
    rel = rel * mask
    adv = trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info)
    gdpo = gdpo_advantages(rewards, torch.arange(B) // 2, eps=1e-4)
    assert bool((adv[3] == 0).all())
    lengths = mask.sum(1).float()
    rows = lengths > 0
    torch.testing.assert_close(
        adv.sum(1)[rows], (lengths * gdpo.sequence)[rows], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("value", [float("nan"), -1.0, float("inf")])
def test_empty_row_padding_relevance_is_not_read(value):
    """An empty (fully masked) row's padding may hold anything: NaN, negative or infinite
    relevance there changes nothing and fails nothing, in every adapter."""
    rewards, mask, rel, info = _batch(seed=9)
    mask[3] = 0
    mask[5, 2:] = 0
    rel = rel * mask
    want = trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info)
    dirty = rel.clone()
    dirty[:, 3] = value  # every position of the empty row, the placeholder's included
    dirty[:, 5, 2:] = value  # the padding of a row that has tokens
    got = trl.mrtpo_advantages_for_grpo(rewards, 2, mask, dirty, info)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got = openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, mask, dirty, info)
    torch.testing.assert_close(
        got, openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, mask, rel, info)
    )
    uid = np.array([f"u{i // 2}" for i in range(B)], dtype=object)
    adv, _ = verl.compute_mrtpo_outcome_advantage(
        rewards, mask, uid, dirty, info, batch_norm="sequence"
    )
    ref, _ = verl.compute_mrtpo_outcome_advantage(
        rewards, mask, uid, rel, info, batch_norm="sequence"
    )
    torch.testing.assert_close(adv, ref, rtol=0, atol=0)
    assert torch.isnan(dirty).any() or (dirty < 0).any() or torch.isinf(dirty).any()


def _policy_inputs(seed, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    rewards, mask, rel, info = _batch(seed=seed)
    hidden = torch.randn((B, T, D), generator=g, dtype=dtype)
    weight = torch.randn((V, D), generator=g, dtype=dtype)
    ids = torch.randint(0, V, (B, T), generator=g)
    old = torch.randn((B, T), generator=g, dtype=dtype) * 0.4 - 3.0
    refl = torch.randn((B, T), generator=g, dtype=dtype) * 0.3 - 3.0
    adv = trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info).to(dtype)
    return hidden, weight, ids, mask, old, refl, adv


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_trl_fused_loss_matches_reference(loss_type, beta):
    hidden, weight, ids, mask, old, refl, adv = _policy_inputs(9)
    old = linear_logprobs_ref(hidden, weight, ids, temperature=0.9).detach() + old + 3.0
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss, metrics = trl.fused_policy_loss(
        h1, w1, ids, mask, old, adv, epsilon_low=0.2, epsilon_high=0.28, beta=beta,
        ref_per_token_logps=refl, loss_type=loss_type, temperature=0.9,
        max_completion_length=11,
    )  # fmt: skip
    loss.backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    labels = ids.masked_fill(mask == 0, -100)
    ref, ref_metrics = linear_policy_loss_ref(
        h2.reshape(-1, D), w2, labels.reshape(-1), old.reshape(-1), adv.reshape(-1),
        temperature=0.9, clip_low=0.2, clip_high=0.28, beta=beta,
        ref_logprobs=refl.reshape(-1) if beta else None, aggregation=trl.LOSS_TYPES[loss_type],
        seq_ids=torch.arange(B).repeat_interleave(T), num_seqs=B, norm_len=11.0,
    )  # fmt: skip
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(
        metrics["clip_fraction"].double(), ref_metrics["clip_fraction"], rtol=0, atol=1e-9
    )
    assert ref_metrics["clip_fraction"] > 0  # the clip branch is exercised


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_trl_fused_loss_trl_normalizers(loss_type):
    """TRL's own formulas where they differ from the library's: an all-masked row still
    counts in TRL's mean over B, and dapo divides by the accumulated token count."""
    hidden, weight, ids, mask, old, _, adv = _policy_inputs(10)
    mask[5] = 0
    h1 = hidden.clone().requires_grad_()
    # token_normalizer is dapo's alone (the trainer passes it there only); elsewhere it is
    # refused rather than ignored
    norm = dict(token_normalizer=40.0) if loss_type == "dapo" else {}
    if loss_type != "dapo":
        with pytest.raises(ValueError, match="token_normalizer: used by loss_type 'dapo' only"):
            trl.fused_policy_loss(hidden, weight, ids, mask, None, adv, loss_type=loss_type,
                                  max_completion_length=9, token_normalizer=40.0)  # fmt: skip
    loss, _ = trl.fused_policy_loss(
        h1, weight, ids, mask, None, adv, loss_type=loss_type, max_completion_length=9, **norm
    )  # fmt: skip
    loss.backward()
    h2 = hidden.clone().requires_grad_()
    logp = linear_logprobs_ref(h2, weight, ids.masked_fill(mask == 0, -100))
    ratio = torch.exp(logp - logp.detach())  # old = current, detached (TRL, one iteration)
    per_tok = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv)
    m = mask.double()
    if loss_type == "grpo":
        want = ((per_tok * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    elif loss_type == "dr_grpo":
        want = (per_tok * m).sum() / (B * 9)
    else:
        want = (per_tok * m).sum() / 40.0
    want.backward()
    torch.testing.assert_close(loss.double(), want, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(h1.grad, h2.grad, rtol=1e-6, atol=1e-9)


def test_trl_fused_loss_sequence_advantages_broadcast():
    hidden, weight, ids, mask, old, _, _ = _policy_inputs(11)
    seq = torch.randn(B, dtype=torch.float64)
    a, _ = trl.fused_policy_loss(hidden, weight, ids, mask, old, seq)
    b, _ = trl.fused_policy_loss(hidden, weight, ids, mask, old, seq[:, None].expand(B, T))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------- OpenRLHF


def test_openrlhf_equals_library():
    rewards, mask, rel, info = _batch(seed=12)
    adv = openrlhf.mrtpo_token_advantages_from_experience(
        rewards, 4, mask, rel, info, batch_norm="token", alpha=0.8
    )
    lib = mrtpo_token_advantages(
        rewards, torch.arange(B) // 4, rel, has_info=info, response_mask=mask,
        batch_norm="token", alpha=0.8,
    ).token  # fmt: skip
    torch.testing.assert_close(adv, lib, rtol=0, atol=0)


def test_openrlhf_experiences_of_different_widths():
    rewards, mask, rel, info = _batch(seed=15, b=12)
    expected = mrtpo_token_advantages(
        rewards, torch.arange(12) // 3, rel, has_info=info, response_mask=mask
    ).token
    parts = [slice(0, 4), slice(4, 8), slice(8, 12)]  # groups of 3 span experiences
    widths = [int(mask[p].sum(1).max()) for p in parts]
    assert len(set(widths)) > 1
    out = openrlhf.mrtpo_token_advantages_for_experiences(
        [rewards[p] for p in parts], 3, [mask[p, :a] for p, a in zip(parts, widths)],
        [rel[:, p, :a] for p, a in zip(parts, widths)], [info[p] for p in parts],
    )  # fmt: skip
    for p, a, o in zip(parts, widths, out):
        assert o.shape == (4, a)
        torch.testing.assert_close(o, expected[p, :a], rtol=0, atol=0)
        assert bool((expected[p, a:] == 0).all())


# --------------------------------------------------------------------------- common


def test_relevance_from_hidden_equals_full_padded():
    g = torch.Generator().manual_seed(13)
    _, mask, _, info = _batch(seed=13)
    hp = torch.randn((B, T, D), generator=g)
    hq = hp + 0.5 * torch.randn((K, B, T, D), generator=g)
    w = torch.randn((V, D), generator=g)
    rel = common.relevance_from_hidden(hp, hq, w, mask, temperature=0.8)
    full = linear_js_distance(hp, hq, w, temperature=0.8)
    m = mask.bool()
    torch.testing.assert_close(rel[:, m], full[:, m], rtol=1e-6, atol=1e-6)
    assert bool((rel[:, ~m] == 0).all()) and bool((full[:, ~m] > 0).all())
    rel_info = common.relevance_from_hidden(hp, hq, w, mask, temperature=0.8, has_info=info)
    torch.testing.assert_close(rel_info, rel * info.t()[..., None], rtol=1e-6, atol=1e-6)


def test_padded_from_packed_round_trip():
    _, mask, rel, _ = _batch(seed=16)
    packed = rel[:, mask.bool()]
    torch.testing.assert_close(common.padded_from_packed(packed, mask), rel, rtol=0, atol=0)
    one = common.padded_from_packed(packed[0], mask, fill=-1.0)
    assert bool((one[mask == 0] == -1).all())
    with pytest.raises(ValueError, match="values"):
        common.padded_from_packed(packed[:, :-1], mask)


def test_has_info_from_spans_and_group_ids():
    spans = [[[], [(0, 4)], [(5, 9), (10, 12)]], [[], [], [(1, 2)]]]
    info = common.has_info_from_spans(spans)
    assert info.tolist() == [[False, True, True], [False, False, True]]
    assert common.has_info_from_spans([], num_rewards=3).shape == (0, 3)
    with pytest.raises(ValueError, match="spans: sample 1"):
        common.has_info_from_spans([[[], []], [[]]])
    ids = common.group_ids_from_index(np.array(["b", "a", "b", "c"], dtype=object))
    assert ids.tolist() == [0, 1, 0, 2]
    assert common.consecutive_group_ids(6, 3).tolist() == [0, 0, 0, 1, 1, 1]


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    rewards, mask, rel, info = _batch()
    uids, _ = _uids()
    with pytest.raises(ValueError, match="relevance: expected K = 3"):
        verl.compute_mrtpo_outcome_advantage(rewards, mask, uids, rel[:2], info)
    with pytest.raises(ValueError, match="has_info"):
        verl.compute_mrtpo_outcome_advantage(rewards, mask, uids, rel, info[:, :2])
    with pytest.raises(ValueError, match="relevance"):
        verl.compute_mrtpo_outcome_advantage(rewards, mask, uids, rel[:, :, :-1], info)
    with pytest.raises(ValueError, match="response_mask"):
        verl.compute_mrtpo_outcome_advantage(rewards, mask[:-1], uids, rel, info)
    with pytest.raises(ValueError, match="index"):
        verl.compute_mrtpo_outcome_advantage(rewards, mask, uids[:-1], rel, info)
    with pytest.raises(ValueError, match="data.batch"):
        verl.compute_mrtpo_advantage_for_batch(
            SimpleNamespace(batch={"response_mask": mask}, non_tensor_batch={"uid": uids})
        )
    with pytest.raises(ValueError, match="group size"):
        trl.mrtpo_advantages_for_grpo(rewards, 3, mask, rel, info)
    for bad in ("std", 1, None):
        with pytest.raises(ValueError, match="scale_rewards"):
            trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info, scale_rewards=bad)
    with pytest.raises(ValueError, match="process_slice"):
        trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info, process_slice=slice(0, 4))
    with pytest.raises(ValueError, match="action_mask"):
        openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, mask[:, None], rel, info)
    with pytest.raises(ValueError, match="relevance: expected K"):
        openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, mask, rel[:1], info)
    hidden, weight, ids, mask2, old, _, adv = _policy_inputs(0)
    with pytest.raises(ValueError, match="loss_type"):
        trl.fused_policy_loss(hidden, weight, ids, mask2, old, adv, loss_type="sapo")
    with pytest.raises(ValueError, match="advantages"):
        trl.fused_policy_loss(hidden, weight, ids, mask2, old, adv[:, :-1])
    with pytest.raises(ValueError, match="hidden"):
        trl.fused_policy_loss(hidden[:, :-1], weight, ids, mask2, old, adv)
    with pytest.raises(ValueError, match="ref_per_token_logps"):
        trl.fused_policy_loss(hidden, weight, ids, mask2, old, adv, beta=0.1)
    with pytest.raises(ValueError, match="hidden_without_info"):
        common.relevance_from_hidden(hidden, hidden[None, :, :-1], weight, mask2, temperature=1.0)
    # linear_logprobs itself still guards the head: d must match.
    with pytest.raises(ValueError, match="weight"):
        linear_logprobs(hidden, weight[:, :-1], ids)
