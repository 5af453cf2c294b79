"""verl adapter: MRTPO as an outcome advantage estimator, and fused log-probs for rmpad.

verl's advantage estimators take ``token_level_rewards`` (bs, response_length),
``response_mask`` (bs, response_length) and ``index`` (a numpy array of per-sample uid
strings; samples with the same uid answer the same prompt) and return
``(advantages, returns)``, both (bs, response_length); outcome estimators return the
advantages twice. MRTPO needs more than one scalar reward per sample: the K rewards, the
per-token relevance from the contrastive replay and which rewards have verifier spans.
verl's generic estimator call passes only its standard arguments, so those three travel in
the batch under the keys below (batch dimension first, as a DataProto batch requires):

    data.batch["mrtpo_rewards"]    (bs, K) or (bs, K, response_length)
    data.batch["mrtpo_relevance"]  (bs, K, response_length)
    data.batch["mrtpo_has_info"]   (bs, K) bool

``compute_mrtpo_advantage_for_batch(data)`` reads them (and ``data.non_tensor_batch["uid"]``)
and writes ``advantages`` and ``returns``; ``register_with_verl()`` registers an estimator
named "mrtpo" that finds them when verl hands it the batch. verl is imported only there.

The advantage settings: ``settings=`` one ``AdvantageSettings`` and/or its fields as
keywords in verl's names (``epsilon``, ``epsilon_batch`` for eps, eps_batch), defaults
``VERL_ADVANTAGE_DEFAULTS`` (batch_norm "token", verl's convention), checked once
(``mrtpo_kernels.advantage_settings``) and carried to the op as one value.

The contrastive replay in verl's actor workers, which fills ``mrtpo_relevance`` and
``mrtpo_has_info``, is ``mrtpo.integrations.verl_replay``; the fused LM head (log-probs,
policy loss, the fused-kernel forward) is ``mrtpo.integrations.verl_fused``; their names are
importable from here.
"""

from __future__ import annotations

import dataclasses

import torch

from mrtpo_kernels import (
    ADVANTAGE_DEFAULTS,
    AdvantageSettings,
    advantage_settings,
)

from .common import (
    check_tensor,
    group_ids_from_index,
    padded_token_advantages,
    require,
)
from .verl_fused import (
    fused_causal_lm_forward,
    install_fused_forward,
    logprobs_from_hidden,
    policy_loss_from_hidden,
)
from .verl_replay import (
    HAS_INFO_KEY,
    RELEVANCE_KEY,
    REPLAY_MASK_KEY,
    REPLAY_METHOD,
    REWARDS_KEY,
    SPANS_KEY,
    fill_mrtpo_relevance,
    install_replay_hook,
    mrtpo_actor_worker_class,
    replay_options,
    set_replay_mask,
    worker_compute_relevance,
)

__all__ = [
    "HAS_INFO_KEY",
    "RELEVANCE_KEY",
    "REPLAY_MASK_KEY",
    "REPLAY_METHOD",
    "REWARDS_KEY",
    "SPANS_KEY",
    "VERL_ADVANTAGE_DEFAULTS",
    "VERL_OPTION_NAMES",
    "compute_mrtpo_advantage_for_batch",
    "compute_mrtpo_outcome_advantage",
    "fill_mrtpo_relevance",
    "fused_causal_lm_forward",
    "install_compute_advantage_patch",
    "install_fused_forward",
    "install_replay_hook",
    "logprobs_from_hidden",
    "mrtpo_actor_worker_class",
    "policy_loss_from_hidden",
    "register_with_verl",
    "replay_options",
    "set_replay_mask",
    "worker_compute_relevance",
]

ESTIMATOR_NAME = "mrtpo"

# verl's advantage defaults: the library's, but whitened over response tokens as verl's GDPO
VERL_ADVANTAGE_DEFAULTS = dataclasses.replace(ADVANTAGE_DEFAULTS, batch_norm="token")
# verl's keyword -> AdvantageSettings field (verl calls eps epsilon)
VERL_OPTION_NAMES = {
    **{f.name: f.name for f in dataclasses.fields(AdvantageSettings)},
    "epsilon": "eps",
    "epsilon_batch": "eps_batch",
}
del VERL_OPTION_NAMES["eps"], VERL_OPTION_NAMES["eps_batch"]
# the keywords the estimator takes besides the settings' fields
_OTHER_OPTIONS = ("reward_weights", "settings")


def _settings(options: dict, where: str) -> AdvantageSettings:
    """The checked settings of verl's options (``settings`` and the fields in verl's names;
    ``reward_weights`` is skipped): any other keyword is a ValueError naming it."""
    return advantage_settings(
        options.get("settings"),
        options,
        defaults=VERL_ADVANTAGE_DEFAULTS,
        names=VERL_OPTION_NAMES,
        also=_OTHER_OPTIONS,
        where=where,
    )


def _sequence_rewards(rewards: torch.Tensor) -> torch.Tensor:
    """(B, K) rewards from (B, K) or per-token (B, K, T) rewards (summed over T)."""
    check_tensor("token_level_rewards", rewards, ndim=(2, 3), floating=True)
    return rewards.sum(dim=-1) if rewards.dim() == 3 else rewards


@torch.no_grad()
def compute_mrtpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index,
    relevance: torch.Tensor,
    has_info: torch.Tensor,
    *,
    reward_weights: torch.Tensor | None = None,
    settings: AdvantageSettings | None = None,
    config=None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MRTPO token advantages in verl's estimator shapes.

    Args:
        token_level_rewards: (bs, K) sequence rewards, one column per verifier, or
            (bs, K, response_length) per-token rewards (summed over tokens, as verl's
            outcome estimators do with their single reward).
        response_mask: (bs, response_length), 1 on response tokens.
        index: (bs,) group keys, e.g. verl's ``non_tensor_batch["uid"]`` (numpy strings).
        relevance: (K, bs, response_length) JS relevance (e.g. ``relevance_from_hidden``).
        has_info: (bs, K) bool, whether reward k's verifier names prompt spans for sample i.
        reward_weights: optional (K,) lambda_k.
        settings: the advantage settings as one ``AdvantageSettings`` (default
            ``VERL_ADVANTAGE_DEFAULTS``); ``options`` put its fields over it in verl's names
            (``VERL_OPTION_NAMES``): alpha, gamma, delta, clip, batch_norm, nan,
            scale_rewards as in ``mrtpo_token_advantages``; epsilon: added to each group's
            std (verl's name for eps); epsilon_batch: for the batch std. batch_norm defaults
            to "token", verl's convention (its GDPO whitens over the response tokens); with
            it alpha = 0 gives verl's GDPO advantages.
        config, other keywords: accepted and ignored, so verl's keyword call fits (the
            batch and registration functions refuse unknown option names).

    Returns:
        (advantages, returns), both (bs, response_length) float32 (float64 for float64
        rewards), 0 where ``response_mask`` is 0; returns is the same tensor as advantages.
    """
    known = {k: v for k, v in options.items() if k in VERL_OPTION_NAMES}
    s = advantage_settings(
        settings,
        known,
        defaults=VERL_ADVANTAGE_DEFAULTS,
        names=VERL_OPTION_NAMES,
        where="compute_mrtpo_outcome_advantage",
    )
    rewards = _sequence_rewards(token_level_rewards)
    check_tensor("response_mask", response_mask, ndim=2)
    group_ids = group_ids_from_index(index, device=rewards.device)
    if group_ids.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"index: expected {rewards.shape[0]} group keys (one per sample), "
            f"got {group_ids.shape[0]}"
        )
    out = padded_token_advantages(
        rewards,
        group_ids,
        response_mask,
        relevance,
        has_info,
        mask_name="response_mask",
        weights=reward_weights,
        settings=s,
    )
    return out.token, out.token


def _batch_inputs(batch, where: str):
    keys = set(batch.keys())  # a TensorDict refuses `in` on itself but not on its keys
    missing = [k for k in (REWARDS_KEY, RELEVANCE_KEY, HAS_INFO_KEY) if k not in keys]
    if missing:
        raise ValueError(
            f"{where}: the batch lacks {missing}. Put the K rewards (bs, K), the relevance "
            f"(bs, K, response_length) and has_info (bs, K) in data.batch under "
            f"{REWARDS_KEY!r}, {RELEVANCE_KEY!r}, {HAS_INFO_KEY!r} before computing advantages"
        )
    relevance = batch[RELEVANCE_KEY]
    check_tensor(RELEVANCE_KEY, relevance, ndim=3, floating=True)
    return batch[REWARDS_KEY], relevance.transpose(0, 1), batch[HAS_INFO_KEY]


def compute_mrtpo_advantage_for_batch(data, **options):
    """Fill ``data.batch["advantages"]`` and ``data.batch["returns"]`` of a verl DataProto.

    Reads ``response_mask`` (or, in older verl, the last response_length columns of
    ``attention_mask``), ``non_tensor_batch["uid"]`` and the three MRTPO keys of this module;
    ``options`` (``reward_weights``, ``settings`` and the settings' fields in verl's names:
    ``alpha``, ``gamma``, ``epsilon``, ``epsilon_batch``, ``batch_norm``, ``delta``, ``clip``,
    ``nan``, ``scale_rewards``) go to ``compute_mrtpo_outcome_advantage``; any other name
    is a ValueError. Works with any object having ``batch`` (a mapping of tensors) and
    ``non_tensor_batch`` (a mapping); returns ``data``.
    """
    _settings(options, "compute_mrtpo_advantage_for_batch")
    batch = data.batch
    rewards, relevance, has_info = _batch_inputs(batch, "data.batch")
    if "response_mask" in set(batch.keys()):
        mask = batch["response_mask"]
    else:
        mask = batch["attention_mask"][:, -relevance.shape[-1] :]
    if "uid" not in data.non_tensor_batch:
        raise ValueError('data.non_tensor_batch: expected "uid" (the group key of each sample)')
    adv, ret = compute_mrtpo_outcome_advantage(
        rewards, mask, data.non_tensor_batch["uid"], relevance, has_info, **options
    )
    batch["advantages"] = adv
    batch["returns"] = ret
    return data


def _make_estimator(options: dict):
    def compute_mrtpo_estimator(token_level_rewards, response_mask, index=None, **kwargs):
        # verl passes token_level_rewards (bs, T) (the sum of all rewards) and, in some
        # versions, the whole batch; the MRTPO inputs come from kwargs or that batch.
        batch = kwargs.pop("batch", None)
        kwargs.pop("config", None)
        kwargs.pop("non_tensor_batch", None)
        if all(k in kwargs for k in (REWARDS_KEY, RELEVANCE_KEY, HAS_INFO_KEY)):
            rewards = kwargs.pop(REWARDS_KEY)
            relevance = kwargs.pop(RELEVANCE_KEY).transpose(0, 1)
            has_info = kwargs.pop(HAS_INFO_KEY)
        elif batch is not None:
            rewards, relevance, has_info = _batch_inputs(batch, "the batch verl passed")
        else:
            raise ValueError(
                "mrtpo estimator: verl called it without the MRTPO inputs (this verl passes "
                "only token_level_rewards, response_mask and index to estimators). Call "
                "mrtpo.integrations.verl.compute_mrtpo_advantage_for_batch(data) in your "
                "compute_advantage step instead; see docs/integrations.md"
            )
        if index is None:
            raise ValueError("index: the mrtpo estimator needs the uid of every sample")
        kwargs = {k: v for k, v in kwargs.items() if k in _OPTION_NAMES}
        return compute_mrtpo_outcome_advantage(
            rewards, response_mask, index, relevance, has_info, **{**options, **kwargs}
        )

    compute_mrtpo_estimator.mrtpo_options = dict(options)
    return compute_mrtpo_estimator


_OPTION_NAMES = frozenset((*VERL_OPTION_NAMES, *_OTHER_OPTIONS))


def register_with_verl(
    name: str = ESTIMATOR_NAME,
    *,
    patch_compute_advantage: bool = False,
    allow_unknown_version: bool = False,
    **options,
):
    """Register MRTPO in verl's advantage-estimator registry under ``name`` ("mrtpo").

    Uses ``verl.trainer.ppo.core_algos.register_adv_est`` (verl's decorator; its registry is
    ``ADV_ESTIMATOR_REGISTRY``). ``options`` (as ``compute_mrtpo_advantage_for_batch``'s:
    settings, alpha, gamma, epsilon, reward_weights, ...; checked now) are bound to the
    registered function. Calling it again replaces an earlier MRTPO
    registration. Run it in the process that computes advantages (verl's driver).

    verl 0.9.1's ``compute_advantage`` passes the batch only to an estimator named "gdpo",
    so the registered function alone cannot find the MRTPO inputs there: pass
    ``patch_compute_advantage=True`` to also install ``install_compute_advantage_patch``
    (version-checked).

    Returns the registered function. Raises ImportError naming verl when it is missing.
    """
    _settings(options, "register_with_verl")
    core_algos = require("verl.trainer.ppo.core_algos", "register_with_verl")
    register = getattr(core_algos, "register_adv_est", None)
    if register is None:
        raise ImportError(
            "register_with_verl: this verl has no verl.trainer.ppo.core_algos.register_adv_est "
            "(older versions lack the estimator registry); call "
            "compute_mrtpo_advantage_for_batch(data) from your compute_advantage instead"
        )
    fn = _make_estimator(options)
    registry = getattr(core_algos, "ADV_ESTIMATOR_REGISTRY", None)
    previous = registry.get(name) if isinstance(registry, dict) else None
    if patch_compute_advantage:
        install_compute_advantage_patch(
            name, allow_unknown_version=allow_unknown_version, **options
        )
    if previous is not None and hasattr(previous, "mrtpo_options"):
        registry[name] = fn  # replace our own earlier registration
        return fn
    return register(name)(fn)


# verl releases whose ray_trainer.compute_advantage this module's patch was written against:
# they hand the whole batch only to an estimator named "gdpo", which cannot be re-registered.
PATCHED_VERL_VERSIONS = ("0.9.1",)


def install_compute_advantage_patch(
    name: str = ESTIMATOR_NAME, *, allow_unknown_version=False, **options
):
    """Opt-in: make ``algorithm.adv_estimator=<name>`` work through verl's own driver.

    Wraps ``verl.trainer.ppo.ray_trainer.compute_advantage`` so that for ``name`` it fills
    the batch with ``compute_mrtpo_advantage_for_batch(data, **options)`` (after verl's own
    ``response_mask`` step) and calls verl's function for every other estimator. Installed
    once; calling again replaces the options. Raises RuntimeError on a verl version not in
    ``PATCHED_VERL_VERSIONS`` unless ``allow_unknown_version``.

    Returns the wrapper (its ``original`` attribute is verl's function).
    """
    _settings(options, "install_compute_advantage_patch")
    verl = require("verl", "install_compute_advantage_patch")
    version = getattr(verl, "__version__", "unknown")
    if version not in PATCHED_VERL_VERSIONS and not allow_unknown_version:
        raise RuntimeError(
            f"install_compute_advantage_patch: verl {version} is not a version this patch "
            f"was written against ({', '.join(PATCHED_VERL_VERSIONS)}); check that "
            "verl.trainer.ppo.ray_trainer.compute_advantage(data, adv_estimator, ...) still "
            "has that form, then pass allow_unknown_version=True"
        )
    ray_trainer = require("verl.trainer.ppo.ray_trainer", "install_compute_advantage_patch")
    current = ray_trainer.compute_advantage
    original = getattr(current, "original", current)
    bound = dict(options)

    def compute_advantage(data, adv_estimator, *args, **kwargs):
        key = getattr(adv_estimator, "value", adv_estimator)
        if key != name:
            return original(data, adv_estimator, *args, **kwargs)
        if "response_mask" not in set(data.batch.keys()):
            data.batch["response_mask"] = ray_trainer.compute_response_mask(data)
        return compute_mrtpo_advantage_for_batch(data, **bound)

    compute_advantage.original = original
    compute_advantage.mrtpo_options = bound
    ray_trainer.compute_advantage = compute_advantage
    return compute_advantage
