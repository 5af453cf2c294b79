"""verl adapter, the fused LM head: log-probs and the PPO policy loss from hidden states
(verl's rmpad layout), and the causal LM forward of verl's fused-kernel actor path.

Importable from ``mrtpo.integrations.verl`` (the adapter's one public module); verl is
imported only by ``fused_causal_lm_forward`` and ``install_fused_forward``.
"""

from __future__ import annotations

import torch

from mrtpo.model.loading import logit_transform
from mrtpo_kernels import POLICY_LOSS_DEFAULTS, linear_logprobs, linear_policy_loss

from .common import check_tensor, config_value, require

__all__ = [
    "fused_causal_lm_forward",
    "install_fused_forward",
    "logprobs_from_hidden",
    "policy_loss_from_hidden",
]


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
            (``mrtpo.model.loading.logit_transform(model)`` reads them from its config: Cohere's
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
    ``mrtpo.model.loading.logit_transform``). Install it with ``install_fused_forward(model)``.
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
