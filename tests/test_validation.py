"""Bad input gets a ValueError that names the argument; inputs are left untouched."""

from __future__ import annotations

import pytest
import torch

import mrtpo_kernels as mk


def _lp_args(n=4, v=10, d=3):
    return torch.randn(n, d), torch.randn(v, d), torch.randint(0, v, (n,))


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda h, w, y: (h, w, y[:-1]), "labels"),
        (lambda h, w, y: (h, w[:, :2], y), "weight"),
        (lambda h, w, y: (h, w.double(), y), "weight"),
        (lambda h, w, y: (h, w, y.float()), "labels"),
        (lambda h, w, y: (h[0], w, y[0]), "hidden"),
        (lambda h, w, y: (h[:0], w, y[:0]), "hidden"),
        (lambda h, w, y: (h, w, y.clone().fill_(10)), "labels"),
        (lambda h, w, y: (h, w, y.clone().fill_(-5)), "labels"),
        (lambda h, w, y: (h, w[:0], y), "weight"),
        (lambda h, w, y: (h, "w", y), "weight"),
    ],
)
def test_linear_logprobs_bad_input(mutate, match):
    h, w, y = mutate(*_lp_args())
    with pytest.raises(ValueError, match=match):
        mk.linear_logprobs(h, w, y)


def test_linear_logprobs_bad_scalars_and_bias():
    h, w, y = _lp_args()
    with pytest.raises(ValueError, match="temperature"):
        mk.linear_logprobs(h, w, y, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        mk.linear_logprobs(h, w, y, temperature=float("nan"))
    with pytest.raises(ValueError, match="bias"):
        mk.linear_logprobs(h, w, y, bias=torch.zeros(3))
    with pytest.raises(ValueError, match="backend"):
        mk.linear_logprobs(h, w, y, backend="tpu")
    with pytest.raises(ValueError, match="backend"):
        mk.linear_logprobs(h, w, y, backend="cuda")  # CPU tensors


def test_device_mismatch_is_named():
    h, w, y = _lp_args()
    meta = torch.empty(10, 3, device="meta")
    with pytest.raises(ValueError, match="weight"):
        mk.linear_logprobs(h, meta, y)


def test_js_bad_input():
    hp, w = torch.randn(4, 3), torch.randn(10, 3)
    with pytest.raises(ValueError, match="hidden_q"):
        mk.linear_js_distance(hp, torch.randn(5, 3), w)
    with pytest.raises(ValueError, match="hidden_q"):
        mk.linear_js_distance(hp, torch.randn(2, 4, 4), w)
    with pytest.raises(ValueError, match="hidden_q"):
        mk.linear_js_distance(hp, torch.randn(2, 4, 3).double(), w)
    with pytest.raises(ValueError, match="logits_q"):
        mk.js_distance(torch.randn(4, 10), torch.randn(4, 9))
    with pytest.raises(ValueError, match="hidden_p"):
        mk.linear_js_distance(hp[:0], hp[:0], w)


def test_policy_loss_bad_input():
    h, w, y = _lp_args()
    old, adv = torch.zeros(4), torch.zeros(4)
    with pytest.raises(ValueError, match="advantages"):
        mk.linear_policy_loss(h, w, y, old, torch.zeros(5))
    with pytest.raises(ValueError, match="old_logprobs"):
        mk.linear_policy_loss(h, w, y, torch.zeros(4, dtype=torch.long), adv)
    with pytest.raises(ValueError, match="aggregation"):
        mk.linear_policy_loss(h, w, y, old, adv, aggregation="mean")
    with pytest.raises(ValueError, match="cu_seqlens"):
        mk.linear_policy_loss(h, w, y, old, adv, aggregation="seq-mean-token-mean")
    with pytest.raises(ValueError, match="clip_low"):
        mk.linear_policy_loss(h, w, y, old, adv, clip_low=-0.1)


def _adv_args(n=4, k=2, t=5):
    rewards = torch.rand(n, k)
    gid = torch.tensor([0, 0, 1, 1])
    rel = torch.rand(k, n * t)
    cu = torch.arange(0, n * t + 1, t)
    return rewards, gid, rel, cu, torch.ones(n, k, dtype=torch.bool)


def test_advantages_bad_input():
    rewards, gid, rel, cu, hi = _adv_args()
    with pytest.raises(ValueError, match="rewards"):
        mk.gdpo_advantages(rewards[:0], gid[:0])
    with pytest.raises(ValueError, match="group_ids"):
        mk.gdpo_advantages(rewards, gid[:3])
    with pytest.raises(ValueError, match="group_ids"):
        mk.gdpo_advantages(rewards, gid.float())
    bad = rewards.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(ValueError, match="rewards"):
        mk.gdpo_advantages(bad, gid)
    with pytest.raises(ValueError, match="weights"):
        mk.gdpo_advantages(rewards, gid, weights=torch.ones(3))
    with pytest.raises(ValueError, match="batch_norm"):
        mk.gdpo_advantages(rewards, gid, batch_norm="group")
    with pytest.raises(ValueError, match="lengths"):
        mk.gdpo_advantages(rewards, gid, batch_norm="token")
    with pytest.raises(ValueError, match="relevance"):
        mk.mrtpo_token_advantages(rewards, gid, rel[:1], has_info=hi, cu_seqlens=cu)
    with pytest.raises(ValueError, match="has_info"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi[:, :1], cu_seqlens=cu)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi)
    with pytest.raises(ValueError, match="cu_seqlens"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu + 1)
    empty = torch.tensor([0, 5, 5, 10, 20])
    with pytest.raises(ValueError, match="no valid token"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=empty)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    with pytest.raises(ValueError, match="no valid token"):
        mk.mrtpo_token_advantages(rewards, gid, rel.view(2, 4, 5), has_info=hi, response_mask=mask)
    with pytest.raises(ValueError, match="alpha"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu, alpha=1.5)
    with pytest.raises(ValueError, match="gamma"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu, gamma=0)


def test_inputs_not_modified():
    rewards, gid, rel, cu, hi = _adv_args()
    copies = [x.clone() for x in (rewards, gid, rel, cu, hi)]
    mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu, gamma=2.0)
    for a, b in zip((rewards, gid, rel, cu, hi), copies):
        assert torch.equal(a, b)
    h, w, y = _lp_args()
    hc, wc = h.clone(), w.clone()
    mk.linear_logprobs(h, w, y, return_entropy=True)
    assert torch.equal(h, hc) and torch.equal(w, wc)
