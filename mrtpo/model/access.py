"""Model access for every caller (the trainer, the replay, the integrations): a Hugging Face
causal LM's decoder, its last hidden states (after the final norm), its LM head and the
head's logit transform, and its decoder layers (with a gradient-checkpointing context).

The trainer and the fused ops need only the decoder's last hidden states and the LM head's
weight (and bias); `logit_transform` reads from the model's config what its forward does to
the logits after the head (a scale, a soft cap), as the fused ops' keywords.
"""

from __future__ import annotations

import contextlib
import math

import torch


def decoder(model):
    """The decoder stack whose ``last_hidden_state`` (after the final norm) feeds the LM head."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None:
        raise ValueError(
            f"model: {type(model).__name__} has no base model attribute "
            f"{model.base_model_prefix!r}; expected a Hugging Face *ForCausalLM model"
        )
    return base


def lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head's weight (V, d) (the tied embedding where tied) and bias or None."""
    head = model.get_output_embeddings()
    if head is None or getattr(head, "weight", None) is None:
        raise ValueError(f"model: {type(model).__name__} has no output embeddings (LM head)")
    return head.weight, getattr(head, "bias", None)


# The config fields that transform a Hugging Face model's logits after its LM head, in the
# order its forward applies them (then generation divides by the temperature): Cohere and
# Cohere2 multiply by ``logit_scale``, Granite (and GraniteMoe) divide by
# ``logits_scaling``, Gemma 2 and 3 cap with ``final_logit_softcapping``.
LOGIT_SCALE_FIELDS = ("logit_scale", "logits_scaling")
SOFTCAP_FIELD = "final_logit_softcapping"
# multipliers whose place in the model's forward the fused head does not know: refused
UNSUPPORTED_LOGIT_FIELDS = ("lm_head_multiplier", "output_multiplier")


def logit_transform(model) -> dict:
    """The LM head's logit transform of ``model`` as the fused ops' keywords: ``{"logit_scale":
    s, "softcap": c}`` for ``linear_logprobs``, ``linear_js_distance`` and
    ``linear_policy_loss``, read from its (text) config: ``logit_scale`` (Cohere, Cohere2)
    multiplies, ``logits_scaling`` (Granite) divides (s = 1 / it), ``final_logit_softcapping``
    (Gemma 2, Gemma 3) caps; ``{}`` where the config sets none (the plain head, bit for
    bit). A config that sets ``lm_head_multiplier`` or ``output_multiplier`` is refused
    (ValueError), as is a value the ops would refuse."""
    config = getattr(model, "config", None)
    if config is None:
        return {}
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    for name in UNSUPPORTED_LOGIT_FIELDS:
        value = getattr(config, name, None)
        if value is not None and value != 1.0:
            raise ValueError(
                f"model.config.{name}: the fused LM head supports logit_scale, "
                f"logits_scaling and final_logit_softcapping; a model with {name}={value} "
                "is not supported"
            )
    scale = 1.0
    for name in LOGIT_SCALE_FIELDS:
        value = getattr(config, name, None)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not (math.isfinite(value) and value != 0):
            raise ValueError(f"model.config.{name}: expected a finite non-zero number, got {value}")
        scale = scale * (float(value) if name == "logit_scale" else 1.0 / float(value))
    cap = getattr(config, SOFTCAP_FIELD, None)
    if cap is not None and not (isinstance(cap, (int, float)) and cap > 0 and math.isfinite(cap)):
        raise ValueError(
            f"model.config.{SOFTCAP_FIELD}: expected None or a positive finite number, got {cap!r}"
        )
    out = {}
    if scale != 1.0:
        out["logit_scale"] = scale
    if cap is not None:
        out["softcap"] = float(cap)
    return out


def last_hidden(model, input_ids, attention_mask) -> torch.Tensor:
    """(B, L, d) last hidden states for left/right-padded input; positions count only the
    tokens the attention mask keeps, so padding does not shift them."""
    return decoder_output(model, input_ids, attention_mask).last_hidden_state


def decoder_output(model, input_ids, attention_mask, use_cache: bool = False):
    """The decoder's output for left/right-padded input (``last_hidden``'s forward), with
    its key/value cache where ``use_cache``."""
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return decoder(model)(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
    )


def decoder_layers(model) -> list:
    """The decoder's layers (the blocks a residual stream runs through): the model's
    transformers ``GradientCheckpointingLayer`` modules, else ``decoder(model).layers``."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # an older transformers: the layer list itself
        GradientCheckpointingLayer = ()  # noqa: N806
    found = [
        m
        for m in model.modules()
        if GradientCheckpointingLayer and isinstance(m, GradientCheckpointingLayer)
    ]
    if found:
        return found
    layers = getattr(decoder(model), "layers", None)
    if layers is None or not len(layers):
        raise ValueError(
            f"model: {type(model).__name__} has no decoder layers to checkpoint "
            "(no GradientCheckpointingLayer modules, no .layers)"
        )
    return list(layers)


@contextlib.contextmanager
def gradient_checkpointing(model, enabled: bool = True):
    """Within: every decoder layer run with gradient keeps only its inputs and recomputes
    its activations in the backward (``torch.utils.checkpoint``, non-reentrant, which
    replays the autocast state). The activations held for the backward of a teacher-forced
    forward fall from every layer's intermediates to one (tokens, d) input per layer (plus
    one layer's intermediates while it is recomputed), for about one more forward of
    compute. Unlike ``model.gradient_checkpointing_enable()`` it does not need train mode
    (the trainer's forwards run in eval mode: no dropout). Forwards without gradient run
    as they are. ``enabled=False``: a no-op."""
    if not enabled:
        yield
        return
    from torch.utils.checkpoint import checkpoint

    layers = decoder_layers(model)
    before = [layer.__dict__.get("forward") for layer in layers]
    for layer in layers:
        run = layer.forward

        def forward(*args, _run=run, **kwargs):
            if not torch.is_grad_enabled():
                return _run(*args, **kwargs)
            return checkpoint(_run, *args, use_reentrant=False, **kwargs)

        layer.forward = forward
    try:
        yield
    finally:
        for layer, old in zip(layers, before):
            if old is None:
                del layer.forward
            else:
                layer.forward = old
