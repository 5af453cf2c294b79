"""Bad input gets a ValueError that names the argument; inputs are left untouched."""

from __future__ import annotations

import pytest
import torch

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R


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


# --------------------------------------------------------------------------- the issue-9 checks


def _pl_args(n=6, v=7, d=3):
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=gen, requires_grad=True)
    w = torch.randn(v, d, generator=gen)
    y = torch.randint(0, v, (n,), generator=gen)
    return h, w, y, torch.full((n,), -2.0), torch.randn(n, generator=gen)


@pytest.mark.parametrize("cu", [[1, 3, 6], [0, 4, 3, 6], [0, 3, 5], [0, 3, 7], [0, -1, 6]], ids=str)
def test_policy_loss_cu_seqlens_boundaries(cu):
    h, w, y, old, adv = _pl_args()
    with pytest.raises(ValueError, match=r"^cu_seqlens: expected non-decreasing boundaries"):
        mk.linear_policy_loss(
            h, w, y, old, adv, aggregation="seq-mean-token-mean", cu_seqlens=torch.tensor(cu)
        )


@pytest.mark.parametrize("norm_len", [0.0, -3.0, float("nan"), float("inf"), "8"])
def test_policy_loss_norm_len(norm_len):
    h, w, y, old, adv = _pl_args()
    with pytest.raises(ValueError, match=r"^norm_len"):
        mk.linear_policy_loss(
            h, w, y, old, adv, aggregation="seq-mean-token-sum-norm",
            cu_seqlens=torch.tensor([0, 2, 6]), norm_len=norm_len,
        )  # fmt: skip


def test_policy_loss_create_graph_raises():
    h, w, y, old, adv = _pl_args()
    loss, _ = mk.linear_policy_loss(h, w, y, old, adv)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(loss, h, create_graph=True)


def test_mean_ratio_ignores_an_ignored_minus_inf_old_logprob():
    h, w, y, old, adv = _pl_args()
    y = y.clone()
    y[2] = -100
    old = old.clone()
    old[2] = -float("inf")  # never read: token 2 is ignored
    _, m = mk.linear_policy_loss(h, w, y, old, adv)
    lp = R.linear_logprobs_ref(h.detach().double(), w.double(), y)
    keep = y != -100
    expect = torch.exp(lp[keep] - old[keep].double()).mean()
    assert torch.isfinite(m["mean_ratio"])
    assert abs(float(m["mean_ratio"]) - float(expect)) < 1e-5 * float(expect)


def test_policy_loss_non_finite_scored_old_logprob_is_named():
    h, w, y, old, adv = _pl_args()
    old = old.clone()
    old[1] = float("nan")
    with pytest.raises(ValueError, match=r"^old_logprobs"):
        mk.linear_policy_loss(h, w, y, old, adv)


@pytest.mark.parametrize("gid", [[0, 1, 2], [0, 0, 0]], ids=["groups of one", "flat group"])
def test_gdpo_eps_zero_zero_variance_gives_zero(gid):
    rewards = torch.tensor([[0.5, 1.0], [0.5, 1.0], [0.5, 1.0]])
    out = mk.gdpo_advantages(rewards, torch.tensor(gid), eps=0.0, eps_batch=0.0)
    for t in (out.per_reward, out.sequence):
        assert torch.equal(t, torch.zeros_like(t))
    assert float(out.std) == 0.0


def test_gdpo_eps_zero_single_response_gives_zero():
    out = mk.gdpo_advantages(torch.tensor([[0.3, 2.0]]), torch.tensor([4]), eps=0.0)
    assert torch.equal(out.per_reward, torch.zeros(1, 2))
    assert torch.equal(out.sequence, torch.zeros(1))
    tok = mk.mrtpo_token_advantages(
        torch.tensor([[0.3, 2.0]]), torch.tensor([4]), torch.rand(2, 3),
        has_info=torch.ones(1, 2, dtype=torch.bool), cu_seqlens=torch.tensor([0, 3]),
        eps=0.0,
    )  # fmt: skip
    assert torch.equal(tok.token, torch.zeros(3))


@pytest.mark.parametrize(
    "lengths",
    [[0, 0, 0, 0], [3, -1, 2, 2], [3, 1.5, 2, 2], [3, float("nan"), 2, 2], [2, 2, 2]],
    ids=["all zero", "negative", "fractional", "nan", "wrong length"],
)
def test_gdpo_token_lengths_checked(lengths):
    rewards, gid, *_ = _adv_args()
    with pytest.raises(ValueError, match=r"^lengths"):
        mk.gdpo_advantages(rewards, gid, batch_norm="token", lengths=torch.tensor(lengths))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_gdpo_non_finite_weights_named(bad):
    rewards, gid, *_ = _adv_args()
    with pytest.raises(ValueError, match=r"^weights"):
        mk.gdpo_advantages(rewards, gid, weights=torch.tensor([1.0, bad]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), -0.5])
def test_token_advantages_relevance_values_named(bad):
    rewards, gid, rel, cu, hi = _adv_args()
    rel = rel.clone()
    rel[1, 7] = bad
    with pytest.raises(ValueError, match=r"^relevance"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu)


def test_token_advantages_padding_relevance_never_read():
    rewards, gid, rel, cu, hi = _adv_args()
    mask = torch.ones(4, 6, dtype=torch.bool)
    mask[:, 5] = False
    padded = torch.zeros(2, 4, 6)
    padded[:, mask] = rel
    padded[:, :, 5] = float("nan")  # padding: never read
    got = mk.mrtpo_token_advantages(rewards, gid, padded, has_info=hi, response_mask=mask)
    ref = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu)
    assert torch.equal(got.token[mask], ref.token)


def test_specific_relevance_refuses_inf_keeps_nan():
    rel = torch.rand(2, 8)
    hi = torch.ones(3, 2, dtype=torch.bool)
    bad = rel.clone()
    bad[0, 1] = float("inf")
    with pytest.raises(ValueError, match=r"^relevance"):
        mk.specific_relevance(bad, has_info=hi, cu_seqlens=torch.tensor([0, 3, 5, 8]))
    nan = rel.clone()
    nan[0, 1] = float("nan")
    out = mk.specific_relevance(nan, has_info=hi, cu_seqlens=torch.tensor([0, 3, 5, 8]))
    assert bool(out[0, 1].isnan())


def test_empty_dimensions_named():
    h, w, y = _lp_args()
    with pytest.raises(ValueError, match=r"^weight"):  # V = 0
        mk.linear_logprobs(h, w[:0], y)
    with pytest.raises(ValueError, match=r"^hidden"):  # d = 0
        mk.linear_logprobs(h[:, :0], w[:, :0], y)
    with pytest.raises(ValueError, match=r"^logits"):  # V = 0
        mk.logprobs_from_logits(torch.randn(4, 0), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^rewards"):  # K = 0
        mk.gdpo_advantages(torch.zeros(4, 0), torch.tensor([0, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"^relevance"):  # K = 0
        mk.specific_relevance(
            torch.zeros(0, 8), has_info=torch.ones(3, 0, dtype=torch.bool),
            cu_seqlens=torch.tensor([0, 3, 5, 8]),
        )  # fmt: skip


def test_lists_for_tensors_named():
    rewards, gid, rel, cu, hi = _adv_args()
    with pytest.raises(ValueError, match=r"^cu_seqlens"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu.tolist())
    with pytest.raises(ValueError, match=r"^response_mask"):
        mk.mrtpo_token_advantages(
            rewards, gid, rel.view(2, 4, 5), has_info=hi, response_mask=[[1] * 5] * 4
        )
    h, w, y, old, adv = _pl_args()
    with pytest.raises(ValueError, match=r"^cu_seqlens"):
        mk.linear_policy_loss(
            h, w, y, old, adv, aggregation="seq-mean-token-mean", cu_seqlens=[0, 2, 6]
        )
    with pytest.raises(ValueError, match=r"^labels"):
        mk.linear_logprobs(h, w, y.tolist())


@pytest.mark.parametrize("clip", [(0.5,), (0.5, 2.0, 3.0), 0.5, (2.0, 3.0)], ids=str)
def test_clip_shape_and_order_named(clip):
    rewards, gid, rel, cu, hi = _adv_args()
    with pytest.raises(ValueError, match=r"^clip"):
        mk.mrtpo_token_advantages(rewards, gid, rel, has_info=hi, cu_seqlens=cu, clip=clip)


@pytest.mark.parametrize("temperature", ["0.7", None, [0.7], True])
def test_non_numeric_temperature_named(temperature):
    h, w, y = _lp_args()
    with pytest.raises(ValueError, match=r"^temperature"):
        mk.linear_logprobs(h, w, y, temperature=temperature)
    with pytest.raises(ValueError, match=r"^temperature"):
        mk.logprobs_from_logits(torch.randn(4, 10), y, temperature=temperature)


def test_bad_chunk_bytes_variable_named(monkeypatch):
    monkeypatch.setenv("MRTPO_CHUNK_BYTES", "lots")
    h, w, y = _lp_args()
    with pytest.raises(ValueError, match="MRTPO_CHUNK_BYTES"):
        mk.linear_logprobs(h, w, y, backend="torch")


def _every_temperature_call(temperature):
    """Each public op that takes a temperature, called with it (a thunk per op)."""
    h, w, y = _lp_args()
    z = torch.randn(4, 10)
    return {
        "linear_logprobs": lambda: mk.linear_logprobs(h, w, y, temperature=temperature),
        "logprobs_from_logits": lambda: mk.logprobs_from_logits(z, y, temperature=temperature),
        "linear_js_distance": lambda: mk.linear_js_distance(h, h + 1, w, temperature=temperature),
        "js_distance": lambda: mk.js_distance(z, z + 1, temperature=temperature),
        "linear_policy_loss": lambda: mk.linear_policy_loss(
            h, w, y, torch.zeros(4), torch.ones(4), temperature=temperature
        ),
    }


@pytest.mark.parametrize(
    "temperature", [1e-39, 5.8e-39, 2.0**-127, 1e-300, 5e-324, 2.0**127, 1e46, 1e300]
)
def test_temperature_outside_the_float32_scale_is_refused(temperature):
    """Outside [2^-126, 2^126] 1 / temperature is no finite normal float32: below, 2 / T is
    inf (NaN log-probs, NaN or 0 JS); above, it is 0 and a -inf logit scales to NaN. A
    ValueError naming temperature."""
    for call in _every_temperature_call(temperature).values():
        with pytest.raises(ValueError, match=r"^temperature: expected a number in \[2\^-126"):
            call()


def test_extreme_temperatures_in_range_are_accepted():
    for t in (2.0**-126, 2.0**126):
        for call in _every_temperature_call(t).values():
            call()


@pytest.mark.parametrize("ignore_index", [2**63, -(2**63) - 1, 2**70, -(2**100)])
def test_ignore_index_outside_int64_is_named(ignore_index):
    h, w, y = _lp_args()
    z = torch.randn(4, 10)
    calls = [
        lambda: mk.linear_logprobs(h, w, y, ignore_index=ignore_index),
        lambda: mk.logprobs_from_logits(z, y, ignore_index=ignore_index),
        lambda: mk.linear_policy_loss(
            h, w, y, torch.zeros(4), torch.ones(4), ignore_index=ignore_index
        ),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"^ignore_index: expected an integer in .*int64"):
            call()


def test_ignore_index_at_the_int64_ends_is_accepted():
    h, w, y = _lp_args()
    for ii in (2**63 - 1, -(2**63)):
        lp = mk.linear_logprobs(h, w, y, ignore_index=ii)
        assert bool(lp.isfinite().all())
