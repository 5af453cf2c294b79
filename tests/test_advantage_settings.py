"""The advantage settings (issue 44, item 3): one ``AdvantageSettings`` checked in one place
(``mrtpo_kernels.advantage_settings``) and carried from every adapter down to the op, and
the reallocation kernels' output final (nothing patches it after the op)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

import mrtpo_kernels as mk
from mrtpo.integrations import common, openrlhf, trl, verl
from mrtpo_kernels import reference as R
from mrtpo_kernels._advantage_settings import FIELDS

FIELD_NAMES = set(FIELDS) | {"epsilon", "epsilon_batch"}


def _packed(seed=0, n=8, k=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 9, (n,), generator=g)
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = lengths.cumsum(0)
    rewards = torch.randn(n, k, generator=g, dtype=torch.float64)
    rel = torch.rand(k, int(cu[-1]), generator=g, dtype=torch.float64)
    has_info = torch.rand(n, k, generator=g) > 0.3
    return rewards, torch.arange(n) // 4, rel, cu, has_info


def _padded(seed=0, b=8, k=3, t=7):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(b, k, generator=g)
    mask = torch.zeros(b, t, dtype=torch.long)
    for i, n in enumerate(torch.randint(1, t + 1, (b,), generator=g).tolist()):
        mask[i, :n] = 1
    rel = torch.rand(k, b, t, generator=g) * mask
    info = torch.rand(b, k, generator=g) > 0.3
    return rewards, mask, rel, info


# --------------------------------------------------------------------------- the check layer


def test_advantage_settings_checks_every_field_and_names_the_argument():
    s = mk.advantage_settings(None, {"alpha": 1, "clip": [0.5, 2]})
    assert isinstance(s, mk.AdvantageSettings) and s.alpha == 1.0 and s.clip == (0.5, 2.0)
    assert s.batch_eps == s.eps and mk.AdvantageSettings(eps_batch=0.0).batch_eps == 0.0
    bad = {
        "alpha": 1.5,
        "gamma": 0.0,
        "eps": -1.0,
        "eps_batch": float("nan"),
        "scale_rewards": "group_norm",
        "batch_norm": "group",
        "delta": float("inf"),
        "clip": (1.5, 2.0),
        "nan": "drop",
    }
    assert set(bad) == set(FIELDS)
    for name, value in bad.items():
        with pytest.raises(ValueError, match=rf"^{name}: "):
            mk.advantage_settings(None, {name: value})
        with pytest.raises(ValueError, match=rf"^{name}: "):  # the same from a settings object
            mk.advantage_settings(dataclasses.replace(mk.ADVANTAGE_DEFAULTS, **{name: value}))
    with pytest.raises(ValueError, match="where: unknown options 'alhpa'"):
        mk.advantage_settings(None, {"alhpa": 0.5}, where="where")
    with pytest.raises(ValueError, match="^settings: expected an AdvantageSettings"):
        mk.advantage_settings({"alpha": 0.5})
    # an adapter's names and value aliases: the error names the caller's keyword
    names = {"epsilon": "eps", "alpha": "alpha"}
    with pytest.raises(ValueError, match="^epsilon: "):
        mk.advantage_settings(None, {"epsilon": -1.0}, names=names)
    with pytest.raises(ValueError, match="unknown options 'eps'"):
        mk.advantage_settings(None, {"eps": 1e-3}, names=names)
    aliases = {"scale_rewards": {True: "group", False: "none"}}
    assert mk.advantage_settings(None, {"scale_rewards": False}, values=aliases).scale_rewards == (
        "none"
    )
    with pytest.raises(ValueError, match=r"^scale_rewards: .*True for 'group'"):
        mk.advantage_settings(None, {"scale_rewards": 1}, values=aliases)  # 1 is not True


def test_checked_settings_travel_down_without_a_second_check(monkeypatch):
    from mrtpo_kernels import _advantage_settings as layer

    s = mk.advantage_settings(None, {"alpha": 0.5})
    calls = []
    real = layer._CHECKS["alpha"]
    monkeypatch.setitem(layer._CHECKS, "alpha", lambda *a: calls.append(a) or real(*a))
    assert mk.advantage_settings(s) is s and not calls  # handed down: not checked again
    assert mk.advantage_settings(s, {"gamma": 2.0}).gamma == 2.0 and len(calls) == 1
    assert s == mk.AdvantageSettings(alpha=0.5) and hash(s) == hash(mk.AdvantageSettings(0.5))
    bad = dataclasses.replace(s, alpha=5.0)  # a replaced copy is checked again
    with pytest.raises(ValueError, match="^alpha: "):
        mk.advantage_settings(bad)


# --------------------------------------------------------------------------- the ops


def test_ops_take_settings_or_keywords_not_both():
    rewards, gid, rel, cu, info = _packed()
    kw = dict(alpha=0.6, gamma=2.0, clip=(0.2, 4.0), eps_batch=0.0, scale_rewards="batch")
    s = mk.AdvantageSettings(**kw)
    by_kw = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=info, cu_seqlens=cu, **kw)
    by_s = mk.mrtpo_token_advantages(rewards, gid, rel, has_info=info, cu_seqlens=cu, settings=s)
    for a, b in zip(by_kw, by_s):
        assert torch.equal(a, b)
    g_kw = mk.gdpo_advantages(rewards, gid, eps_batch=0.0, scale_rewards="batch")
    g_s = mk.gdpo_advantages(rewards, gid, settings=s)  # alpha, gamma, clip: not used
    assert all(torch.equal(a, b) for a, b in zip(g_kw, g_s))
    ref_kw, _ = R.mrtpo_token_advantages_ref(rewards, gid, _split(rel, cu), has_info=info, **kw)
    ref_s, _ = R.mrtpo_token_advantages_ref(
        rewards, gid, _split(rel, cu), has_info=info, settings=s
    )
    assert all(torch.equal(a, b) for a, b in zip(ref_kw, ref_s))
    with pytest.raises(ValueError, match="^gamma: given both"):
        mk.mrtpo_token_advantages(
            rewards, gid, rel, has_info=info, cu_seqlens=cu, settings=s, gamma=3.0
        )
    with pytest.raises(ValueError, match="^alpha: "):
        mk.mrtpo_token_advantages(
            rewards, gid, rel, has_info=info, cu_seqlens=cu, settings=mk.AdvantageSettings(2.0)
        )


def _split(x, cu):
    return [x[:, cu[i] : cu[i + 1]] for i in range(len(cu) - 1)]


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
def test_the_kernel_output_is_the_op_output(scale_rewards):
    """The public op returns the custom op's token advantages untouched (packed layout),
    and they equal the float64 reference; alpha = 0 gives GDPO's sequence value bit for
    bit on every token."""
    rewards, gid, rel, cu, info = _packed(seed=3)
    seen = []
    op = mk.advantages.mrtpo_token_advantages_op

    def spy(*args, **kwargs):
        out = op(*args, **kwargs)
        seen.append(out)
        return out

    mp = pytest.MonkeyPatch()
    mp.setattr(mk.advantages, "mrtpo_token_advantages_op", spy)
    try:
        out = mk.mrtpo_token_advantages(
            rewards.float(), gid, rel.float(), has_info=info, cu_seqlens=cu, alpha=0.7,
            scale_rewards=scale_rewards,
        )  # fmt: skip
    finally:
        mp.undo()
    assert len(seen) == 1 and out.token is seen[0][0] and out.allocation is seen[0][1]
    ref, _ = R.mrtpo_token_advantages_ref(
        rewards, gid, _split(rel, cu), has_info=info, alpha=0.7, scale_rewards=scale_rewards
    )
    torch.testing.assert_close(out.token.double(), torch.cat(ref), atol=2e-6, rtol=0)
    for dtype in (torch.float32, torch.float64):
        flat = mk.mrtpo_token_advantages(
            rewards.to(dtype), gid, rel.to(dtype), has_info=info, cu_seqlens=cu, alpha=0.0,
            scale_rewards=scale_rewards,
        )  # fmt: skip
        seq = flat.sequence.to(flat.token.dtype).repeat_interleave(cu[1:] - cu[:-1])
        assert torch.equal(flat.token, seq)


# --------------------------------------------------------------------------- the adapters


ADAPTERS = [
    common.padded_token_advantages,
    openrlhf.mrtpo_token_advantages_from_experience,
    openrlhf.replay_masks_for_experiences,
    verl.compute_mrtpo_outcome_advantage,
    trl.mrtpo_advantages_for_grpo,
]


@pytest.mark.parametrize("fn", ADAPTERS, ids=lambda f: f.__name__)
def test_adapters_carry_settings_instead_of_restating_the_keywords(fn):
    params = inspect.signature(fn).parameters
    assert "settings" in params
    assert not FIELD_NAMES & set(params), sorted(FIELD_NAMES & set(params))
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def test_adapters_take_settings_or_keywords_alike():
    rewards, mask, rel, info = _padded()
    s = mk.AdvantageSettings(alpha=0.4, gamma=1.5, clip=(0.1, 5.0), eps=1e-4, nan="zero")
    kw = dict(alpha=0.4, gamma=1.5, clip=(0.1, 5.0), eps=1e-4, nan="zero")
    want = mk.mrtpo_token_advantages(
        rewards, torch.arange(8) // 2, rel, has_info=info, response_mask=mask.bool(), settings=s
    ).token
    got = [
        trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info, **kw),
        trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info, settings=s),
        openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, mask, rel, info, **kw),
        openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, mask, rel, info, settings=s),
        common.padded_token_advantages(rewards, torch.arange(8) // 2, mask, rel, info, **kw),
    ]
    uids = [str(i // 2) for i in range(8)]
    vkw = dict(kw, batch_norm="sequence", epsilon=kw["eps"])
    del vkw["eps"]
    got += [
        verl.compute_mrtpo_outcome_advantage(rewards, mask, uids, rel, info, **vkw)[0],
        verl.compute_mrtpo_outcome_advantage(rewards, mask, uids, rel, info, settings=s)[0],
    ]
    for i, g in enumerate(got):
        if isinstance(g, mk.TokenAdvantages):
            g = g.token
        assert torch.equal(g, want), i
    # the adapters' own defaults: TRL's eps 1e-4 and nan "zero", verl's batch_norm "token"
    assert trl.TRL_ADVANTAGE_DEFAULTS == mk.AdvantageSettings(eps=1e-4, nan="zero")
    assert verl.VERL_ADVANTAGE_DEFAULTS == mk.AdvantageSettings(batch_norm="token")
    # OpenRLHF and verl take scale_rewards now (TRL's True / False aliases stay TRL's)
    none = openrlhf.mrtpo_token_advantages_from_experience(
        rewards, 2, mask, rel, info, scale_rewards="none"
    )
    assert torch.equal(none, trl.mrtpo_advantages_for_grpo(
        rewards, 2, mask, rel, info, scale_rewards=False, eps=1e-6, nan="error"))  # fmt: skip


def test_adapters_refuse_unknown_and_bad_options_by_name():
    rewards, mask, rel, info = _padded()
    with pytest.raises(ValueError, match="mrtpo_advantages_for_grpo: unknown options 'alhpa'"):
        trl.mrtpo_advantages_for_grpo(rewards, 2, mask, rel, info, alhpa=0.5)
    with pytest.raises(ValueError, match="unknown options 'epsilon'"):
        openrlhf.mrtpo_token_advantages_from_experience(rewards, 2, mask, rel, info, epsilon=1.0)
    with pytest.raises(ValueError, match="^alpha: "):
        openrlhf.replay_masks_for_experiences([rewards], 2, alpha=-1.0)
    with pytest.raises(ValueError, match="^epsilon: "):
        verl.compute_mrtpo_outcome_advantage(
            rewards, mask, [str(i // 2) for i in range(8)], rel, info, epsilon=-1.0
        )
    with pytest.raises(ValueError, match="^batch_norm: 'token' weighs"):
        trl.mrtpo_advantages_for_grpo(
            torch.cat([rewards, rewards]), 2, mask, rel, info, batch_norm="token",
            process_slice=slice(0, 8),
        )  # fmt: skip
    with pytest.raises(ValueError, match="^scale_rewards"):
        trl._check_scale_rewards("sum")
    assert trl._check_scale_rewards(True) == "group"
