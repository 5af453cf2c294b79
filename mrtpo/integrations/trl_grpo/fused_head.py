"""The fused LM head of ``MRTPOGRPOTrainer``: the log-probs (old, reference, current) from
``linear_logprobs`` on the decoder's hidden states, and the loss from ``fused_policy_loss``,
with the metrics TRL's ``_compute_loss`` logs. No (B, T, V) logits are formed.

``FusedHead`` is a mixin placed before ``GRPOTrainer`` in ``MRTPOGRPOTrainer``'s bases: it
overrides TRL's ``_get_per_token_logps_and_entropies`` and ``_compute_loss`` (the latter
falls back to TRL's own, fed by the fused log-probs, for the settings it does not
reproduce). It reads the trainer's attributes (``accelerator``, ``temperature``, ...) and
``_mrtpo_head_kw`` (the model's logit transform).
"""

from __future__ import annotations

import sys

import torch
from transformers.models.mixtral.modeling_mixtral import (
    load_balancing_loss_func as mixtral_load_balancing_loss,
)

from mrtpo.integrations.trl import LOSS_TYPES, fused_policy_loss
from mrtpo.model.loading import decoder, lm_head
from mrtpo_kernels import linear_logprobs


class FusedHead:
    """The log-prob and loss methods of ``MRTPOGRPOTrainer`` (see the module)."""

    # ------------------------------------------------------------ log-probs
    def _completion_hidden(self, model, input_ids, attention_mask, logits_to_keep):
        return self._completion_hidden_and_head(model, input_ids, attention_mask, logits_to_keep)[0]

    def _completion_hidden_and_head(
        self, model, input_ids, attention_mask, logits_to_keep, router_aux=False
    ):
        """The hidden states that predict the last ``logits_to_keep`` tokens, and the LM
        head's weight and bias as the forward held them (on FSDP the unsharded tensors of
        the head's unit, through which the gradient reaches the shards; on ZeRO-3 the
        partitioned parameters, which ``_head_pass`` has DeepSpeed gather). ``router_aux``: a
        fourth element, the MoE load-balancing loss of this forward (``_router_aux_loss``)."""
        # the backbone under the trainer's autocast, as the model's wrapped forward runs it;
        # the head then runs in the weight's dtype
        inner = self.accelerator.unwrap_model(model)
        router = {"output_router_logits": True} if router_aux else {}
        if inner is model:
            weight, bias = lm_head(model)
            with self.accelerator.autocast():
                out = decoder(model)(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **router
                )
                aux = _router_aux_loss(model, out, attention_mask) if router_aux else None
            hidden = out.last_hidden_state[:, -logits_to_keep - 1 : -1]
            return (hidden.to(weight.dtype), weight, bias) + ((aux,) if router_aux else ())
        # Wrapped for several processes (DDP, FSDP): the forward must go through the
        # wrapper, which synchronizes the gradients (and on FSDP gathers each unit); with
        # the head swapped for a stand-in that returns its input, the "logits" are the last
        # hidden states, and the fused head reads the weight the forward held.
        head = inner.get_output_embeddings()
        capture = _HeadCapture(head)
        inner.set_output_embeddings(capture)
        try:
            with self.accelerator.autocast():
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    use_cache=False,
                    logits_to_keep=logits_to_keep + 1,
                    **router,
                )
        finally:
            inner.set_output_embeddings(head)
        weight, bias = capture.held if capture.held is not None else lm_head(inner)
        hidden = out.logits[:, :-1].to(weight.dtype)
        if not router_aux:
            return hidden, weight, bias
        if getattr(out, "aux_loss", None) is None:  # the model's own forward computes it
            raise ValueError(
                f"router_aux_loss_coef: {type(inner).__name__} returned no "
                "aux_loss with output_router_logits=True"
            )
        return hidden, weight, bias, out.aux_loss

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        given = [k for k, v in multimodal.items() if v is not None]
        if given:
            raise ValueError(
                f"{given[0]}: multimodal inputs are not supported by the "
                "fused LM head (it runs the text decoder only)"
            )
        batch_size = batch_size or input_ids.size(0)
        logps, ents, auxes = [], [], []
        for s in range(0, input_ids.size(0), batch_size):
            ids, am = input_ids[s : s + batch_size], attention_mask[s : s + batch_size]
            hidden, weight, bias, *aux = self._completion_hidden_and_head(
                model, ids, am, logits_to_keep, router_aux=compute_aux_loss
            )
            auxes += aux
            labels = ids[:, -logits_to_keep:].masked_fill(am[:, -logits_to_keep:] == 0, -100)

            def head_pass(h, w, b, labels=labels):
                return linear_logprobs(
                    h,
                    w,
                    labels,
                    bias=b,
                    temperature=self.temperature,
                    return_entropy=compute_entropy,
                    **self._mrtpo_head_kw,
                )

            out = self._head_pass(model, head_pass, hidden, weight, bias)
            if compute_entropy:
                logps.append(out[0])
                # as TRL: the entropies carry a gradient only where the entropy bonus uses
                # them; otherwise they feed logging and the entropy mask alone
                bonus = getattr(self, "_entropy_bonus_enabled", True)
                ents.append(out[1] if bonus else out[1].detach())
            else:
                logps.append(out)
        aux_loss = torch.stack(auxes).mean() if compute_aux_loss else None  # as TRL: chunk mean
        return (torch.cat(logps), torch.cat(ents) if compute_entropy else None, aux_loss)

    # ------------------------------------------------------------ loss
    def _fused_loss_applies(self, inputs) -> bool:
        return (
            self.loss_type in LOSS_TYPES
            and self.importance_sampling_level == "token"
            and not self._entropy_bonus_enabled
            and self.top_entropy_quantile >= 1.0
            and self.off_policy_mask_threshold is None
            and self.args.delta is None
            and not (self.use_vllm and self.vllm_importance_sampling_correction)
        )

    def _compute_loss(self, model, inputs):
        if not self._fused_loss_applies(inputs):
            return super()._compute_loss(model, inputs)  # TRL's loss, fused log-probs
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        t = completion_ids.size(1)
        hidden, weight, bias, *aux = self._completion_hidden_and_head(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, inputs["completion_mask"]], dim=1),
            t,
            router_aux=self.aux_loss_enabled,
        )
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        token_normalizer = None
        if self.loss_type == "dapo":
            token_normalizer = (
                inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            )
            if mode == "train":
                token_normalizer = token_normalizer * accumulation / self.args.steps_per_generation
        labels = completion_ids.masked_fill(mask == 0, -100)

        def head_pass(h, w, b):
            loss, _ = fused_policy_loss(
                h,
                w,
                completion_ids,
                mask,
                inputs.get("old_per_token_logps"),
                inputs["advantages"],
                epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                beta=self.beta,
                ref_per_token_logps=inputs.get("ref_per_token_logps"),
                loss_type=self.loss_type,
                temperature=self.temperature,
                max_completion_length=self.max_completion_length,
                token_normalizer=token_normalizer,
                lm_head_bias=b,
                use_bias_correction_kl=bool(self.args.use_bias_correction_kl),
                **self._mrtpo_head_kw,
            )
            with torch.no_grad():  # the metrics TRL's _compute_loss logs, from one more pass
                logp, entropy = linear_logprobs(
                    h.detach(),
                    w.detach(),
                    labels,
                    bias=None if b is None else b.detach(),
                    temperature=self.temperature,
                    return_entropy=True,
                    **self._mrtpo_head_kw,
                )
            return loss, logp, entropy

        loss, logp, entropy = self._head_pass(model, head_pass, hidden, weight, bias)
        if self.loss_type != "dapo":
            loss = loss / accumulation
        if self.aux_loss_enabled:  # as TRL: the coefficient times the aux loss per micro-batch
            loss = loss + self.router_aux_loss_coef * aux[0] / accumulation
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux[0].detach()).mean().item()
            )
        self._log_fused_metrics(logp, entropy, mask, inputs, mode)
        return loss

    def _head_pass(self, model, fn, hidden, weight, bias):
        """``fn(hidden, weight, bias)``, the fused LM head, where the engine holds the head's
        parameters in full. Under DeepSpeed ZeRO-3 the forward has released them (``weight``
        is a partitioned parameter): ``fn`` then runs as the head module's own forward, so
        that ZeRO-3's hooks gather the head before it and release it after, gather it again
        for its backward (the weight gradient reaches the partitioned parameter through
        ZeRO-3's reduce-scatter) and release it after; the same collectives on every rank.
        Elsewhere (one process, DDP, ZeRO-1/2, FSDP1/FSDP2, whose forward left the head's
        unit gathered) it is ``fn`` called directly."""
        if not _partitioned(weight):
            return fn(hidden, weight, bias)
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        return _as_module_forward(
            head, lambda h: fn(h, head.weight, getattr(head, "bias", None)), hidden
        )

    @torch.no_grad()
    def _log_fused_metrics(self, logp, entropy, mask, inputs, mode):
        # The metrics TRL's _compute_loss logs, from the no-grad pass of the fused head
        # (``logp``, ``entropy``: (B, T) of the completion tokens).
        old = inputs.get("old_per_token_logps")
        old = logp if old is None else old
        ratio = torch.exp(logp - old)
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        m = mask.to(logp.dtype)

        def global_masked_mean(x):
            totals = self.accelerator.reduce(torch.stack([(x * m).sum(), m.sum()]), reduction="sum")
            return (totals[0] / totals[1].clamp(min=1.0)).item()

        def masked_seq_mean(x):
            return (x * m).sum(-1) / m.sum(-1)

        metrics = self._metrics[mode]
        if self.beta != 0.0:
            diff = inputs["ref_per_token_logps"] - logp
            kl = torch.exp(diff) - diff - 1
            if self.args.use_bias_correction_kl:
                kl = kl * ratio
            metrics["kl"].append(global_masked_mean(kl))
        metrics["entropy"].append(global_masked_mean(entropy))
        low = ((ratio < 1 - self.epsilon_low) & (adv < 0)).to(m.dtype)
        high = ((ratio > 1 + self.epsilon_high) & (adv > 0)).to(m.dtype)
        metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
        metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
        metrics["clip_ratio/region_mean"].append(global_masked_mean(torch.maximum(low, high)))
        gathered_low = self.accelerator.gather(masked_seq_mean(low))
        gathered_high = self.accelerator.gather(masked_seq_mean(high))
        metrics["clip_ratio/low_min"].append(_nan_reduce(gathered_low, torch.min))
        metrics["clip_ratio/high_max"].append(_nan_reduce(gathered_high, torch.max))


class _HeadCapture(torch.nn.Module):
    """The LM head's stand-in in the wrapped model's forward: returns the hidden states (the
    "logits") and keeps, in ``held``, the head's weight and bias as they are while the
    forward runs: on FSDP1/FSDP2 the unsharded tensors of the head's unit (the root's, which
    stays gathered until the backward), not the shards that sit there outside a forward; on
    ZeRO-3 the partitioned parameters (the head module does not run here, so DeepSpeed does
    not gather it: ``MRTPOGRPOTrainer._head_pass`` runs the fused head as its forward)."""

    def __init__(self, head):
        super().__init__()
        self.held = None
        object.__setattr__(self, "_head", head)  # not a submodule: no parameters here

    def forward(self, hidden):
        self.held = (self._head.weight, getattr(self._head, "bias", None))
        return hidden


def _router_aux_loss(model, out, attention_mask):
    """The MoE load-balancing loss of a decoder forward run with output_router_logits=True,
    as the model's own ``*ForCausalLM.forward`` computes it: its modeling module's
    ``load_balancing_loss_func`` (Mixtral's, which every MoE family copies, where a module
    has none) on the router logits of every layer, with the model's expert count and top-k
    and the attention mask (padding left out)."""
    router_logits = getattr(out, "router_logits", None)
    if not isinstance(router_logits, tuple) or not router_logits:
        raise ValueError(
            f"router_aux_loss_coef: the decoder of {type(model).__name__} "
            "returned no router logits with output_router_logits=True"
        )
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if fn is None:
        fn = mixtral_load_balancing_loss
    config = model.config.get_text_config()
    experts = (
        getattr(model, "num_experts", None)
        or getattr(config, "num_experts", None)
        or config.num_local_experts
    )
    top_k = getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok
    return fn(router_logits, experts, top_k, attention_mask)


def _partitioned(param) -> bool:
    """Whether ``param`` is a DeepSpeed ZeRO-3 parameter (partitioned outside the forward of
    its module, whatever it holds now)."""
    return hasattr(param, "ds_id") and getattr(param, "ds_status", None) is not None


def _as_module_forward(module: torch.nn.Module, fn, *inputs):
    """``fn(*inputs)`` run as ``module``'s forward (through ``module.__call__``, so that the
    hooks an engine put on the module run around it: ZeRO-3 gathers the module's
    parameters before, releases them after, and puts its backward hooks on the inputs and
    outputs); the module's own forward is back after."""
    own = module.__dict__.get("forward")  # an instance attribute the module had, if any
    module.forward = fn
    try:
        return module(*inputs)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _nan_reduce(x: torch.Tensor, fn) -> float:
    x = x[~torch.isnan(x)]
    return float("nan") if x.numel() == 0 else fn(x).item()
