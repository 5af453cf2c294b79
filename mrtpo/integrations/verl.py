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

The contrastive replay in verl's actor workers, which fills ``mrtpo_relevance`` and
``mrtpo_has_info``, is ``mrtpo.integrations.verl_replay``; its names are importable from here.
"""

from __future__ import annotations

import torch

from mrtpo_kernels import (
    ADVANTAGE_DEFAULTS,
    POLICY_LOSS_DEFAULTS,
    linear_logprobs,
    linear_policy_loss,
)

from ..model import logit_transform
from .common import (
    check_tensor,
    config_value,
    group_ids_from_index,
    padded_token_advantages,
    require,
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
    alpha: float = ADVANTAGE_DEFAULTS.alpha,
    gamma: float = ADVANTAGE_DEFAULTS.gamma,
    epsilon: float = ADVANTAGE_DEFAULTS.eps,
    epsilon_batch: float | None = ADVANTAGE_DEFAULTS.eps_batch,
    batch_norm: str = "token",
    delta: float = ADVANTAGE_DEFAULTS.delta,
    clip: tuple[float, float] | None = ADVANTAGE_DEFAULTS.clip,
    nan: str = ADVANTAGE_DEFAULTS.nan,
    config=None,
    **unused,
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
        alpha, gamma, delta, clip, batch_norm, nan: as in ``mrtpo_token_advantages``.
            batch_norm defaults to "token", verl's convention (its GDPO whitens over the
            response tokens); with it alpha = 0 gives verl's GDPO advantages.
        epsilon: added to each group's std (verl's name); epsilon_batch: for the batch std.
        config, unused: accepted and ignored, so verl's keyword call fits.

    Returns:
        (advantages, returns), both (bs, response_length) float32 (float64 for float64
        rewards), 0 where ``response_mask`` is 0; returns is the same tensor as advantages.
    """
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
        alpha=alpha,
        gamma=gamma,
        eps=epsilon,
        eps_batch=epsilon_batch,
        batch_norm=batch_norm,
        delta=delta,
        clip=clip,
        nan=nan,
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


def _check_options(options: dict, where: str) -> None:
    """A ValueError naming every option that is not one of ``_OPTION_NAMES``."""
    unknown = sorted(set(options) - _OPTION_NAMES)
    if unknown:
        raise ValueError(
            f"{where}: unknown options {', '.join(map(repr, unknown))}; expected some of "
            f"{sorted(_OPTION_NAMES)}"
        )


def compute_mrtpo_advantage_for_batch(data, **options):
    """Fill ``data.batch["advantages"]`` and ``data.batch["returns"]`` of a verl DataProto.

    Reads ``response_mask`` (or, in older verl, the last response_length columns of
    ``attention_mask``), ``non_tensor_batch["uid"]`` and the three MRTPO keys of this module;
    ``options`` (``reward_weights``, ``alpha``, ``gamma``, ``epsilon``, ``epsilon_batch``,
    ``batch_norm``, ``delta``, ``clip``, ``nan``) go to ``compute_mrtpo_outcome_advantage``;
    any other name is a ValueError. Works with any object having ``batch`` (a mapping of
    tensors) and ``non_tensor_batch`` (a mapping); returns ``data``.
    """
    _check_options(options, "compute_mrtpo_advantage_for_batch")
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


_OPTION_NAMES = frozenset(
    (
        "reward_weights",
        "alpha",
        "gamma",
        "epsilon",
        "epsilon_batch",
        "batch_norm",
        "delta",
        "clip",
        "nan",
    )
)


def register_with_verl(
    name: str = ESTIMATOR_NAME,
    *,
    patch_compute_advantage: bool = False,
    allow_unknown_version: bool = False,
    **options,
):
    """Register MRTPO in verl's advantage-estimator registry under ``name`` ("mrtpo").

    Uses ``verl.trainer.ppo.core_algos.register_adv_est`` (verl's decorator; its registry is
    ``ADV_ESTIMATOR_REGISTRY``). ``options`` (alpha, gamma, epsilon, reward_weights, ...)
    are bound to the registered function. Calling it again replaces an earlier MRTPO
    registration. Run it in the process that computes advantages (verl's driver).

    verl 0.9.1's ``compute_advantage`` passes the batch only to an estimator named "gdpo",
    so the registered function alone cannot find the MRTPO inputs there: pass
    ``patch_compute_advantage=True`` to also install ``install_compute_advantage_patch``
    (version-checked).

    Returns the registered function. Raises ImportError naming verl when it is missing.
    """
    _check_options(options, "register_with_verl")
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


def logprobs_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = POLICY_LOSS_DEFAULTS.temperature,
    return_entropy: bool = False,
    *,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = POLICY_LOSS_DEFAULTS.ignore_index,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    process_group=None,
):
    """Per-token log-probs (and entropy) for verl's rmpad layout, never forming logits.

    Args:
        hidden: (N, d) or (1, N, d) last hidden states of the packed (padding-removed)
            sequences, as verl's rmpad forward gives them.
        lm_head_weight: (V, d), or this rank's (V / R, d) shard of a vocabulary-parallel
            head with ``process_group``; lm_head_bias: optional (V,) (its shard).
        labels: (N,) or (1, N) next tokens (verl's ``input_ids_rmpad_rolled``).
        temperature: the rollout temperature (verl divides the logits by it).
        logit_scale, softcap: the model's logit transform before the temperature
            (``mrtpo.model.logit_transform(model)`` reads them from its config: Cohere's
            ``logit_scale``, Gemma 2 / 3's ``final_logit_softcapping``); the defaults are
            the plain head.
        process_group: a vocabulary-parallel head (see ``linear_logprobs``).

    Returns:
        log_probs of labels' shape in float32 (and entropy of that shape when asked),
        differentiable with respect to hidden, weight and bias.
    """
    check_tensor("hidden", hidden, ndim=(2, 3), floating=True)
    check_tensor("labels", labels, ndim=(1, 2))
    if hidden.dim() == 3 and hidden.shape[0] != 1:
        raise ValueError(
            f"hidden: expected (N, d) or (1, N, d) packed hidden states, got "
            f"{tuple(hidden.shape)}; for padded (B, T, d) input call linear_logprobs"
        )
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"labels: expected shape {tuple(hidden.shape[:-1])} (hidden without d), "
            f"got {tuple(labels.shape)}"
        )
    return linear_logprobs(
        hidden,
        lm_head_weight,
        labels,
        bias=lm_head_bias,
        temperature=temperature,
        ignore_index=ignore_index,
        return_entropy=return_entropy,
        logit_scale=logit_scale,
        softcap=softcap,
        process_group=process_group,
    )


def policy_loss_from_hidden(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    config=None,
    clip_ratio: float = 0.2,
    clip_ratio_low: float | None = None,
    clip_ratio_high: float | None = None,
    clip_ratio_c: float | None = 3.0,
    loss_agg_mode: str = "token-mean",
    cu_seqlens: torch.Tensor | None = None,
    norm_len: float | None = None,
    temperature: float = POLICY_LOSS_DEFAULTS.temperature,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = POLICY_LOSS_DEFAULTS.ignore_index,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    process_group=None,
):
    """verl's vanilla PPO policy loss (dual clip included) with the LM head fused in.

    Args:
        hidden, lm_head_weight, labels, lm_head_bias, temperature: as
            ``logprobs_from_hidden`` (packed (N, d) / (1, N, d), or padded (B, T, d)).
        old_log_prob, advantages: per token, labels' shape; tokens outside the response
            carry ``ignore_index`` in labels.
        config: verl's actor config (``actor_rollout_ref.actor``), a mapping or an object;
            its ``clip_ratio``, ``clip_ratio_low``, ``clip_ratio_high``, ``clip_ratio_c``
            and ``loss_agg_mode`` override the keyword defaults, which are verl's.
        clip_ratio_c: verl's dual clip (default 3): a token with A < 0 has its loss capped
            at -A clip_ratio_c (``linear_policy_loss(clip_ratio_c=...)``); None: off.
        loss_agg_mode: "token-mean", "seq-mean-token-mean" or "seq-mean-token-sum-norm";
            the sequence modes on packed input need ``cu_seqlens``.
        logit_scale, softcap: the model's logit transform (as ``logprobs_from_hidden``).
        process_group: a vocabulary-parallel head (see ``linear_policy_loss``), with or
            without a logit transform.

    Returns:
        (loss, metrics) as ``linear_policy_loss``; metrics["dual_clip_fraction"] is verl's
        pg_clipfrac_lower.
    """
    clip_ratio = config_value(config, "clip_ratio", clip_ratio)
    low = config_value(config, "clip_ratio_low", clip_ratio_low)
    high = config_value(config, "clip_ratio_high", clip_ratio_high)
    clip_ratio_c = config_value(config, "clip_ratio_c", clip_ratio_c)
    loss_agg_mode = config_value(config, "loss_agg_mode", loss_agg_mode)
    return linear_policy_loss(
        hidden,
        lm_head_weight,
        labels,
        old_log_prob,
        advantages,
        bias=lm_head_bias,
        temperature=temperature,
        clip_low=clip_ratio if low is None else low,
        clip_high=clip_ratio if high is None else high,
        ignore_index=ignore_index,
        aggregation=loss_agg_mode,
        cu_seqlens=cu_seqlens,
        norm_len=norm_len,
        clip_ratio_c=clip_ratio_c,
        logit_scale=logit_scale,
        softcap=softcap,
        process_group=process_group,
    )


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
    _check_options(options, "install_compute_advantage_patch")
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


def fused_causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    output_attentions=None,
    output_hidden_states=None,
    return_dict=None,
    cache_position=None,
    logits_to_keep=0,
    temperature: float = POLICY_LOSS_DEFAULTS.temperature,
    shift_labels=None,
    **unused,
):
    """A causal LM forward for verl's fused-kernel actor path, on ``linear_logprobs``.

    verl's actor with ``actor_rollout_ref.model.use_fused_kernels=True`` replaces the model's
    forward by one that returns ``log_probs`` and ``entropy`` of the next tokens (computed
    from the last hidden states and the LM head) instead of logits, and reads those two
    fields. This forward has the same arguments and output (verl's ``CausalLMOutputForPPO``):
    the decoder runs as usual, then ``linear_logprobs`` gives the log-probs and entropies of
    the labels rolled by one (``shift_labels`` when verl passes them) without the
    (tokens, V) logits, under the model's own logit transform (its config's
    ``logit_scale``, ``logits_scaling``, ``final_logit_softcapping``:
    ``mrtpo.model.logit_transform``). Install it with ``install_fused_forward(model)``.
    """
    from verl.models.transformers.dense_common import CausalLMOutputForPPO

    outputs = self.model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=past_key_values,
        inputs_embeds=inputs_embeds,
        use_cache=use_cache,
        output_attentions=output_attentions,
        output_hidden_states=output_hidden_states,
        cache_position=cache_position,
    )
    hidden = outputs[0]
    if shift_labels is not None:
        rolled = shift_labels
    elif labels is not None:
        rolled = torch.roll(labels, shifts=-1, dims=-1)
    elif input_ids is not None:
        rolled = torch.roll(input_ids, shifts=-1, dims=-1)
    else:
        raise ValueError("input_ids: needs input_ids, labels or shift_labels")
    head = self.get_output_embeddings()
    log_probs, entropy = linear_logprobs(
        hidden,
        head.weight,
        rolled,
        bias=getattr(head, "bias", None),
        temperature=temperature,
        return_entropy=True,
        **logit_transform(self),
    )
    return CausalLMOutputForPPO(
        log_probs=log_probs,
        entropy=entropy,
        past_key_values=outputs.past_key_values,
        hidden_states=outputs.hidden_states,
        attentions=outputs.attentions,
    )


def install_fused_forward(model):
    """Make verl's fused-kernel actor path compute log-probs with ``linear_logprobs``.

    Call it on the actor's Hugging Face causal LM after verl's ``apply_monkey_patch`` (which,
    with ``use_fused_kernels=True``, installs verl's own fused forward); it sets the model
    class's forward to ``fused_causal_lm_forward``, as verl's patch does. Text models with a
    plain ``model.model`` decoder and an unsharded LM head only (verl's vision-language
    forwards differ). A model whose config scales or softcaps its logits (Cohere's
    ``logit_scale``, Granite's ``logits_scaling``, Gemma 2 / 3's
    ``final_logit_softcapping``) gets the same transform in the fused head; a config with a
    multiplier whose place the fused head does not know (``lm_head_multiplier``,
    ``output_multiplier``) is refused here (ValueError), not at the first forward.
    Returns the model.
    """
    require("verl.models.transformers.dense_common", "install_fused_forward")
    logit_transform(model)  # refuses what the forward could not reproduce, now
    if not hasattr(model, "model") or model.get_output_embeddings() is None:
        raise ValueError("model: expected a causal LM with .model (the decoder) and an LM head")
    model.__class__.forward = fused_causal_lm_forward
    return model
