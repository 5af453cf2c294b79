"""TRL adapter: MRTPO token advantages for GRPOTrainer, and its loss fused with the LM head.

TRL's GRPOTrainer keeps, per batch: ``rewards_per_func`` (B, K) (one column per reward
function, gathered over processes), ``reward_weights`` (K,), groups of ``num_generations``
consecutive samples per prompt, ``completion_ids`` and ``completion_mask`` (B, T),
``old_per_token_logps`` (B, T) (None when it reuses the current policy's) and a (B,)
sequence advantage that its loss broadcasts over tokens. MRTPO replaces the (B,) advantage
by a (B, T) token advantage; ``fused_policy_loss`` takes (B, T) (or (B,)) advantages and
the policy's last hidden states in place of logits. Nothing here imports TRL.

``MRTPOGRPOTrainer``, the GRPOTrainer that uses them, and its ``MRTPOConfig`` are in
``mrtpo.integrations.trl_trainer``, which imports TRL (and this module; never the reverse).
"""

from __future__ import annotations

import dataclasses
import math

import torch

from mrtpo_kernels import (
    ADVANTAGE_DEFAULTS,
    POLICY_LOSS_DEFAULTS,
    AdvantageSettings,
    advantage_settings,
    linear_logprobs,
    linear_policy_loss,
)
from mrtpo_kernels import settings as env

from .common import (
    check_shape,
    check_tensor,
    consecutive_group_ids,
    padded_token_advantages,
)

__all__ = [
    "LOSS_TYPES",
    "TRL_ADVANTAGE_DEFAULTS",
    "fused_policy_loss",
    "mrtpo_advantages_for_grpo",
]

# TRL loss type -> linear_policy_loss aggregation.
LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


# TRL's scale_rewards -> the GDPO variant (METHOD.md section 1): TRL's booleans are its
# own aliases, True for "group" and False for "none"
_TRL_VALUES = {"scale_rewards": {True: "group", False: "none"}}

# TRL's advantage defaults: its eps constant 1e-4 for the group and batch stds (eps_batch
# follows eps), and a missing reward (NaN) counted as 0
TRL_ADVANTAGE_DEFAULTS = dataclasses.replace(ADVANTAGE_DEFAULTS, eps=1e-4, nan="zero")


def _trl_settings(settings, options, where: str) -> AdvantageSettings:
    """The checked settings of a TRL call: ``settings`` (default ``TRL_ADVANTAGE_DEFAULTS``)
    with its fields as keywords put over it, scale_rewards in TRL's vocabulary."""
    return advantage_settings(
        settings, options, defaults=TRL_ADVANTAGE_DEFAULTS, values=_TRL_VALUES, where=where
    )


def _check_scale_rewards(scale_rewards) -> str:
    """TRL's ``scale_rewards`` as the advantage ops' name: "group", "batch" or "none"."""
    return _trl_settings(None, {"scale_rewards": scale_rewards}, "scale_rewards").scale_rewards


@torch.no_grad()
def mrtpo_advantages_for_grpo(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    completion_mask: torch.Tensor,
    relevance: torch.Tensor,
    has_info: torch.Tensor,
    *,
    reward_weights: torch.Tensor | None = None,
    process_slice: slice | None = None,
    settings: AdvantageSettings | None = None,
    **options,
) -> torch.Tensor:
    """MRTPO (B, T) token advantages from GRPOTrainer's tensors.

    Args:
        rewards_per_func: (B_all, K) rewards of every sample of the step (TRL gathers them
            over processes), NaN where a reward function returned None.
        num_generations: G; samples g*G .. g*G+G-1 answer the same prompt.
        completion_mask: (B, T), 1 on completion tokens (rows of this process).
        relevance: (K, B, T) per-token relevance of this process's rows
            (``relevance_from_hidden``).
        has_info: (B, K) bool, whether reward k's verifier names spans of sample i's prompt.
        reward_weights: optional (K,) (TRL's ``reward_weights``).
        process_slice: the rows of this process among the B_all gathered samples (TRL's
            ``process_slice``); None when B_all = B (one process).
        settings: the advantage settings as one ``AdvantageSettings`` (default
            ``TRL_ADVANTAGE_DEFAULTS``); ``options``, its fields as keywords, are put over
            it (any other keyword is a ValueError naming it):
            alpha, gamma, delta, clip, batch_norm: as in ``mrtpo_token_advantages``
            (batch_norm "token" with one process only).
            eps, eps_batch: added to the group and batch stds; default 1e-4 for both, TRL's
            constant, so that alpha = 0 gives TRL's ``multi_objective_aggregation=
            "normalize_then_sum"`` (GDPO) advantages.
            scale_rewards: TRL's option, applied to each reward before the weighted sum
            (METHOD.md section 1): "group" or True (r - group mean over the group std +
            eps: GDPO, TRL's ``normalize_then_sum``), "batch" (over the reward's std over
            the whole gathered batch + eps) or "none" or False (not divided).
            nan: "zero" (default: a missing reward, NaN in TRL, counts as a reward of 0 in
            its group's statistics; TRL's own GDPO leaves it out of them instead, so the
            two agree only when no reward is missing) or "error".

    Returns:
        (B, T) float32 token advantages, 0 where ``completion_mask`` is 0.
    """
    s = _trl_settings(settings, options, "mrtpo_advantages_for_grpo")
    check_tensor("rewards_per_func", rewards_per_func, ndim=2, floating=True)
    check_tensor("completion_mask", completion_mask, ndim=2)
    check_tensor("relevance", relevance, ndim=3, floating=True)
    check_tensor("has_info", has_info, ndim=2)
    b_all, k = rewards_per_func.shape
    group_ids = consecutive_group_ids(b_all, num_generations, device=rewards_per_func.device)
    if process_slice is None:
        return padded_token_advantages(
            rewards_per_func,
            group_ids,
            completion_mask,
            relevance,
            has_info,
            mask_name="completion_mask",
            weights=reward_weights,
            settings=s,
        ).token.float()  # float64 with float64 relevance (stop credit's d^gamma): as TRL's

    # Several processes: the group and batch statistics need every sample's rewards, the
    # reallocation only this process's relevance. The other rows join with one placeholder
    # token and no spans: they weigh in the statistics (batch_norm="sequence" counts
    # responses, not tokens) and their (uniform) weights never touch this process's rows.
    if not isinstance(process_slice, slice):
        raise ValueError(f"process_slice: expected a slice, got {type(process_slice).__name__}")
    if s.batch_norm == "token":
        raise ValueError(
            "batch_norm: 'token' weighs each response by its token count, which the other "
            "processes' rows do not carry here (process_slice); use 'sequence'"
        )
    rows = range(b_all)[process_slice]
    b, t = completion_mask.shape
    if len(rows) != b:
        raise ValueError(
            f"process_slice: selects {len(rows)} of the {b_all} samples, but completion_mask "
            f"has {b} rows"
        )
    if relevance.shape[0] != k:
        raise ValueError(
            f"relevance: expected K = {k} rewards in dimension 0 (from rewards_per_func), "
            f"got {relevance.shape[0]}"
        )
    check_shape("relevance", relevance, (k, b, t), "(K, B, T) for this process's rows")
    check_shape("has_info", has_info, (b, k), "(B, K) for this process's rows")
    dev = rewards_per_func.device
    idx = torch.tensor(list(rows), dtype=torch.long, device=dev)
    mask_all = torch.zeros((b_all, t), dtype=torch.bool, device=dev)
    mask_all[idx] = completion_mask.to(dev).bool()
    rel_all = torch.zeros((k, b_all, t), dtype=relevance.dtype, device=dev)
    rel_all[:, idx] = relevance.to(dev)
    info_all = torch.zeros((b_all, k), dtype=torch.bool, device=dev)
    info_all[idx] = has_info.to(dev).bool()
    token = padded_token_advantages(
        rewards_per_func,
        group_ids,
        mask_all,
        rel_all,
        info_all,
        mask_name="completion_mask",
        weights=reward_weights,
        settings=s,
    ).token
    return token[idx].float()


def fused_policy_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = POLICY_LOSS_DEFAULTS.clip_low,
    epsilon_high: float = POLICY_LOSS_DEFAULTS.clip_high,
    beta: float = POLICY_LOSS_DEFAULTS.beta,
    ref_per_token_logps: torch.Tensor | None = None,
    loss_type: str = "grpo",
    temperature: float = POLICY_LOSS_DEFAULTS.temperature,
    max_completion_length: int | None = None,
    token_normalizer: float | torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = POLICY_LOSS_DEFAULTS.ignore_index,
    use_bias_correction_kl: bool = False,
    logit_scale: float = 1.0,
    softcap: float | None = None,
):
    """GRPOTrainer's clipped loss with the LM head fused in: no (B, T, V) logits.

    Args:
        hidden: (B, T, d) last hidden states that predict the completion tokens (the model's
            hidden states at positions -T-1 .. -2 of prompt + completion).
        lm_head_weight: (V, d); lm_head_bias: optional (V,).
        completion_ids: (B, T) sampled tokens; completion_mask: (B, T) 0/1.
        old_per_token_logps: (B, T) rollout log-probs, or None (TRL's single-iteration case:
            the current log-probs, detached; computed here without gradient, which costs
            one more pass of the LM head).
        advantages: (B, T) token advantages (``mrtpo_advantages_for_grpo``) or (B,).
        epsilon_low, epsilon_high: TRL's clip range; beta and ref_per_token_logps (B, T):
            TRL's k3 KL penalty.
        loss_type: "grpo" (mean over sequences of each one's token mean), "bnpo" / "dapo"
            (mean over all completion tokens), "dr_grpo" (token sum over B x
            ``max_completion_length``).
        temperature: TRL's sampling temperature (logits are divided by it).
        max_completion_length: dr_grpo's normalizer, TRL's ``args.max_completion_length``;
            default T (the padded width, which is what TRL uses only when they agree).
        token_normalizer: for "dapo" only, TRL's ``num_items_in_batch / num_processes`` (the
            token count of the whole accumulated batch); default this batch's token count.
            A positive finite number, or a one-element tensor holding one (ValueError
            otherwise: a negative one would flip the loss's sign, 0 make it inf).
        use_bias_correction_kl: TRL's option (its default is True): the k3 KL term of each
            token is multiplied by the importance ratio exp(logp - old), not detached, as
            TRL does; ``linear_policy_loss(kl_importance_weight=True)`` computes it in the
            same single fused pass (gradient in the forward).
        logit_scale, softcap: the model's logit transform before the temperature
            (``mrtpo.model.loading.logit_transform`` reads them from its config: Cohere's
            logit_scale, Granite's 1 / logits_scaling, Gemma's final_logit_softcapping).

    Returns:
        (loss, metrics) as ``linear_policy_loss``: a scalar with gradients to hidden, weight
        and bias, and detached clip_fraction, mean_ratio (and kl with beta).
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {sorted(LOSS_TYPES)}, got {loss_type!r}")
    check_tensor("hidden", hidden, ndim=3, floating=True)
    check_tensor("completion_ids", completion_ids, ndim=2)
    check_tensor("completion_mask", completion_mask, ndim=2)
    b, t = completion_ids.shape
    check_shape("hidden", hidden, (b, t, hidden.shape[-1]), "(B, T, d) like completion_ids")
    check_shape("completion_mask", completion_mask, (b, t), "(B, T) like completion_ids")
    check_tensor("advantages", advantages, ndim=(1, 2), floating=True)
    if advantages.dim() == 1:
        check_shape("advantages", advantages, (b,), "(B,) or (B, T)")
        advantages = advantages.unsqueeze(1).expand(b, t)
    else:
        check_shape("advantages", advantages, (b, t), "(B, T) like completion_ids")
    if completion_ids.dtype.is_floating_point or completion_ids.dtype == torch.bool:
        raise ValueError(f"completion_ids: expected an integer tensor, got {completion_ids.dtype}")
    mask = completion_mask.to(device=completion_ids.device).bool()
    labels = completion_ids.long().masked_fill(~mask, ignore_index)

    if old_per_token_logps is None:
        with torch.no_grad():
            old_per_token_logps = linear_logprobs(
                hidden.detach(),
                lm_head_weight.detach(),
                labels,
                bias=None if lm_head_bias is None else lm_head_bias.detach(),
                temperature=temperature,
                ignore_index=ignore_index,
                logit_scale=logit_scale,
                softcap=softcap,
            )
    else:
        check_tensor("old_per_token_logps", old_per_token_logps, ndim=2, floating=True)
        check_shape("old_per_token_logps", old_per_token_logps, (b, t), "(B, T)")
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("ref_per_token_logps: beta != 0 needs the reference log-probs")
        check_tensor("ref_per_token_logps", ref_per_token_logps, ndim=2, floating=True)
        check_shape("ref_per_token_logps", ref_per_token_logps, (b, t), "(B, T)")
    if token_normalizer is not None:
        token_normalizer = _check_token_normalizer(token_normalizer, loss_type)
    norm_len = None
    if loss_type == "dr_grpo":
        norm_len = float(t if max_completion_length is None else max_completion_length)
        if not norm_len > 0:
            raise ValueError(f"max_completion_length: expected > 0, got {max_completion_length}")

    loss, metrics = linear_policy_loss(
        hidden,
        lm_head_weight,
        labels,
        old_per_token_logps,
        advantages,
        bias=lm_head_bias,
        temperature=temperature,
        clip_low=epsilon_low,
        clip_high=epsilon_high,
        ignore_index=ignore_index,
        aggregation=LOSS_TYPES[loss_type],
        ref_logprobs=ref_per_token_logps if beta != 0.0 else None,
        beta=beta,
        norm_len=norm_len,
        kl_importance_weight=bool(use_bias_correction_kl),
        logit_scale=logit_scale,
        softcap=softcap,
    )

    # The library averages over sequences that have a token; TRL averages over all B rows
    # (a row masked out entirely, as TRL does with truncated completions, still counts).
    if loss_type in ("grpo", "dr_grpo"):
        present = mask.any(dim=1).sum().to(loss.dtype)
        loss = loss * (present / b)
    elif loss_type == "dapo" and token_normalizer is not None:
        tokens = mask.sum().clamp(min=1).to(loss.dtype)
        norm = torch.as_tensor(token_normalizer, dtype=loss.dtype, device=loss.device)
        loss = loss * (tokens / norm)
    return loss, metrics


def _check_token_normalizer(x, loss_type: str):
    """A positive finite number or a one-element real tensor holding one (its value checked
    when the value checks are on: ``mrtpo_kernels.settings``), for loss type "dapo" only."""
    if loss_type != "dapo":
        raise ValueError(
            f"token_normalizer: used by loss_type 'dapo' only (its token count over the "
            f"accumulated batch), got it with loss_type {loss_type!r}"
        )

    def positive_finite(v):
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"token_normalizer: expected a positive finite number, got {v}")
        return v

    if not isinstance(x, torch.Tensor):
        if isinstance(x, (str, bytes, bool)) or x is None:
            raise ValueError(f"token_normalizer: expected a number, got {type(x).__name__}")
        try:
            v = float(x)
        except (TypeError, ValueError):
            raise ValueError(
                f"token_normalizer: expected a number, got {type(x).__name__}"
            ) from None
        return positive_finite(v)
    if x.numel() != 1 or x.dtype == torch.bool or x.dtype.is_complex:
        raise ValueError(
            f"token_normalizer: expected a number or a one-element real tensor, got a "
            f"{x.dtype} tensor of shape {tuple(x.shape)}"
        )
    if env.value_checks() and not torch.compiler.is_compiling():
        positive_finite(float(x.item()))
    return x.reshape(())
