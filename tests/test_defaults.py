"""One home for each default shared by several functions: the policy loss's scalar settings
(``POLICY_LOSS_DEFAULTS``, a frozen ``PolicyLossSettings``) and the token conventions every op
shares (``TEMPERATURE``, ``IGNORE_INDEX``). The advantage ops' defaults
(``ADVANTAGE_DEFAULTS``) are checked in test_advantages.py."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

import mrtpo_kernels as mk
from mrtpo.integrations import trl as trl_adapter
from mrtpo.integrations import verl as verl_adapter
from mrtpo_kernels import reference as R


def _defaults(fn) -> dict:
    return {
        n: p.default
        for n, p in inspect.signature(fn).parameters.items()
        if p.default is not inspect.Parameter.empty
    }


def test_policy_loss_settings_are_frozen_with_method_defaults():
    d = mk.POLICY_LOSS_DEFAULTS
    assert isinstance(d, mk.PolicyLossSettings)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.clip_low = 0.3
    # METHOD.md section 6's epsilon = 0.2 on both sides, no KL unless asked, no dual clip
    assert (d.temperature, d.clip_low, d.clip_high, d.beta) == (1.0, 0.2, 0.2, 0.0)
    assert (d.ignore_index, d.clip_ratio_c, d.kl_importance_weight) == (-100, math.inf, False)
    assert (mk.TEMPERATURE, mk.IGNORE_INDEX) == (d.temperature, d.ignore_index)


@pytest.mark.parametrize(
    "fn", [mk.linear_policy_loss, R.policy_loss_ref, R.linear_policy_loss_ref],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_policy_loss_keyword_defaults_come_from_the_settings(fn):
    d, got = mk.POLICY_LOSS_DEFAULTS, _defaults(fn)
    shared = {f.name for f in dataclasses.fields(d)} & set(got)
    assert {"clip_low", "clip_high", "beta", "kl_importance_weight"} <= shared
    # the public keywords' "none" is None where the settings hold inf (clip_ratio_c) or 0
    # (softcap, LogitCap's "no cap")
    for name in shared - {"clip_ratio_c", "softcap"}:
        assert got[name] == getattr(d, name), name
    assert got["clip_ratio_c"] is None
    if "softcap" in shared:
        assert got["softcap"] is None and d.softcap == 0.0 and not d.logit_cap.active


@pytest.mark.parametrize(
    "fn",
    [mk.linear_logprobs, mk.logprobs_from_logits, mk.linear_js_distance, mk.js_distance,
     R.linear_logprobs_ref, R.logprobs_from_logits_ref, R.js_distance_ref,
     trl_adapter.fused_policy_loss, verl_adapter.logprobs_from_hidden],
    ids=lambda f: f.__name__,
)  # fmt: skip
def test_token_conventions_have_one_default(fn):
    got = _defaults(fn)
    assert "temperature" in got or "ignore_index" in got
    if "temperature" in got:
        assert got["temperature"] == mk.TEMPERATURE
    if "ignore_index" in got:
        assert got["ignore_index"] == mk.IGNORE_INDEX


def test_trl_adapter_clip_defaults_are_the_settings():
    got, d = _defaults(trl_adapter.fused_policy_loss), mk.POLICY_LOSS_DEFAULTS
    assert (got["epsilon_low"], got["epsilon_high"], got["beta"]) == (
        d.clip_low, d.clip_high, d.beta,
    )  # fmt: skip
