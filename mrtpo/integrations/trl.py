"""TRL adapter: MRTPO token advantages for GRPOTrainer, and its loss fused with the LM head.

TRL's GRPOTrainer keeps, per batch: ``rewards_per_func`` (B, K) (one column per reward
function, gathered over processes), ``reward_weights`` (K,), groups of ``num_generations``
consecutive samples per prompt, ``completion_ids`` and ``completion_mask`` (B, T),
``old_per_token_logps`` (B, T) (None when it reuses the current policy's) and a (B,)
sequence advantage that its loss broadcasts over tokens. MRTPO replaces the (B,) advantage
by a (B, T) token advantage; ``fused_policy_loss`` takes (B, T) (or (B,)) advantages and
the policy's last hidden states in place of logits. Nothing here imports TRL.
"""

from __future__ import annotations

import functools

import torch

from mrtpo_kernels import ADVANTAGE_DEFAULTS, linear_logprobs, linear_policy_loss

from ..spans import score_and_spans
from .common import (
    check_shape,
    check_tensor,
    consecutive_group_ids,
    padded_token_advantages,
    require,
)

__all__ = ["LOSS_TYPES", "fused_policy_loss", "mrtpo_advantages_for_grpo"]

# TRL loss type -> linear_policy_loss aggregation.
LOSS_TYPES = {
    "grpo": "seq-mean-token-mean",
    "bnpo": "token-mean",
    "dapo": "token-mean",
    "dr_grpo": "seq-mean-token-sum-norm",
}


def _check_scale_rewards(scale_rewards):
    if scale_rewards in (True, "group"):
        return
    raise ValueError(
        f"scale_rewards: MRTPO normalizes each reward by its group's std (GDPO, then the "
        f"weighted sum by the batch std), which is TRL's 'group'; got {scale_rewards!r}, "
        "which has no MRTPO counterpart"
    )


@torch.no_grad()
def mrtpo_advantages_for_grpo(
    rewards_per_func: torch.Tensor,
    num_generations: int,
    completion_mask: torch.Tensor,
    relevance: torch.Tensor,
    has_info: torch.Tensor,
    *,
    reward_weights: torch.Tensor | None = None,
    alpha: float = ADVANTAGE_DEFAULTS.alpha,
    gamma: float = ADVANTAGE_DEFAULTS.gamma,
    scale_rewards: bool | str = "group",
    eps: float = 1e-4,
    eps_batch: float | None = ADVANTAGE_DEFAULTS.eps_batch,
    delta: float = ADVANTAGE_DEFAULTS.delta,
    clip: tuple[float, float] | None = ADVANTAGE_DEFAULTS.clip,
    nan: str = "zero",
    process_slice: slice | None = None,
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
        alpha, gamma, delta, clip: as in ``mrtpo_token_advantages``.
        eps, eps_batch: added to the group and batch stds; default 1e-4 for both, TRL's
            constant, so that alpha = 0 gives TRL's ``multi_objective_aggregation=
            "normalize_then_sum"`` (GDPO) advantages.
        scale_rewards: TRL's option; only "group" (or True) exists for MRTPO, whose GDPO
            step divides each reward by its group std.
        nan: "zero" (default: a missing reward, NaN in TRL, counts as a reward of 0 in its
            group's statistics; TRL's own GDPO leaves it out of them instead, so the two
            agree only when no reward is missing) or "error".
        process_slice: the rows of this process among the B_all gathered samples (TRL's
            ``process_slice``); None when B_all = B (one process).

    Returns:
        (B, T) float32 token advantages, 0 where ``completion_mask`` is 0.
    """
    _check_scale_rewards(scale_rewards)
    check_tensor("rewards_per_func", rewards_per_func, ndim=2, floating=True)
    check_tensor("completion_mask", completion_mask, ndim=2)
    check_tensor("relevance", relevance, ndim=3, floating=True)
    check_tensor("has_info", has_info, ndim=2)
    b_all, k = rewards_per_func.shape
    group_ids = consecutive_group_ids(b_all, num_generations, device=rewards_per_func.device)
    if process_slice is None:
        return padded_token_advantages(
            rewards_per_func, group_ids, completion_mask, relevance, has_info,
            mask_name="completion_mask", weights=reward_weights, alpha=alpha, gamma=gamma,
            eps=eps, eps_batch=eps_batch, delta=delta, clip=clip, nan=nan,
        ).token  # fmt: skip

    # Several processes: the group and batch statistics need every sample's rewards, the
    # reallocation only this process's relevance. The other rows join with one placeholder
    # token and no spans: they weigh in the statistics (batch_norm="sequence" counts
    # responses, not tokens) and their (uniform) weights never touch this process's rows.
    if not isinstance(process_slice, slice):
        raise ValueError(f"process_slice: expected a slice, got {type(process_slice).__name__}")
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
        rewards_per_func, group_ids, mask_all, rel_all, info_all,
        mask_name="completion_mask", weights=reward_weights, alpha=alpha, gamma=gamma,
        eps=eps, eps_batch=eps_batch, delta=delta, clip=clip, nan=nan,
    ).token  # fmt: skip
    return token[idx]


def fused_policy_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    old_per_token_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    *,
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    beta: float = 0.0,
    ref_per_token_logps: torch.Tensor | None = None,
    loss_type: str = "grpo",
    temperature: float = 1.0,
    max_completion_length: int | None = None,
    token_normalizer: float | torch.Tensor | None = None,
    lm_head_bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    use_bias_correction_kl: bool = False,
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
        token_normalizer: for "dapo", TRL's ``num_items_in_batch / num_processes`` (the
            token count of the whole accumulated batch); default this batch's token count.
        use_bias_correction_kl: TRL's option (its default is True): the k3 KL term of each
            token is multiplied by the importance ratio exp(logp - old), not detached, as
            TRL does; ``linear_policy_loss(kl_importance_weight=True)`` computes it in the
            same single fused pass (gradient in the forward).

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
                hidden.detach(), lm_head_weight.detach(), labels,
                bias=None if lm_head_bias is None else lm_head_bias.detach(),
                temperature=temperature, ignore_index=ignore_index,
            )  # fmt: skip
    else:
        check_tensor("old_per_token_logps", old_per_token_logps, ndim=2, floating=True)
        check_shape("old_per_token_logps", old_per_token_logps, (b, t), "(B, T)")
    if beta != 0.0:
        if ref_per_token_logps is None:
            raise ValueError("ref_per_token_logps: beta != 0 needs the reference log-probs")
        check_tensor("ref_per_token_logps", ref_per_token_logps, ndim=2, floating=True)
        check_shape("ref_per_token_logps", ref_per_token_logps, (b, t), "(B, T)")
    norm_len = None
    if loss_type == "dr_grpo":
        norm_len = float(t if max_completion_length is None else max_completion_length)
        if not norm_len > 0:
            raise ValueError(f"max_completion_length: expected > 0, got {max_completion_length}")

    loss, metrics = linear_policy_loss(
        hidden, lm_head_weight, labels, old_per_token_logps, advantages,
        bias=lm_head_bias, temperature=temperature, clip_low=epsilon_low,
        clip_high=epsilon_high, ignore_index=ignore_index, aggregation=LOSS_TYPES[loss_type],
        ref_logprobs=ref_per_token_logps if beta != 0.0 else None, beta=beta,
        norm_len=norm_len, kl_importance_weight=bool(use_bias_correction_kl),
    )  # fmt: skip

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


# --------------------------------------------------------------------------- reward spans


class _SpanCapture:
    """A reward function that may return per sample a score, ``(score, spans)`` or an object
    with ``score`` and ``spans`` (a ``Verdict``), seen by TRL as one returning scores; the
    spans of its last call are kept in ``store[k]``."""

    def __init__(self, fn, k: int, store: dict):
        self.fn, self.k, self.store = fn, k, store
        inner = fn
        while isinstance(inner, functools.partial):
            inner = inner.func
        self.__name__ = getattr(inner, "__name__", type(inner).__name__)

    def _split(self, out):
        if out is None:
            return out
        pairs = [score_and_spans(v, where=f"reward function {self.__name__!r}, sample {i}")
                 for i, v in enumerate(out)]  # fmt: skip
        self.store[self.k] = [sp for _, sp in pairs]
        return [sc for sc, _ in pairs]

    def __call__(self, *args, **kwargs):
        return self._split(self.fn(*args, **kwargs))


class _AsyncSpanCapture(_SpanCapture):
    async def __call__(self, *args, **kwargs):
        return self._split(await self.fn(*args, **kwargs))


def _wrap_reward_funcs(reward_funcs, store: dict):
    """TRL's ``reward_funcs`` (one or a list) with every plain callable span-capturing."""
    from trl.trainer.utils import is_async_callable

    single = not isinstance(reward_funcs, (list, tuple))
    funcs = [reward_funcs] if single else list(reward_funcs)
    out = []
    for k, fn in enumerate(funcs):
        if isinstance(fn, (str, torch.nn.Module)) or not callable(fn):
            out.append(fn)  # a reward model: scores only
        else:
            cls = _AsyncSpanCapture if is_async_callable(fn) else _SpanCapture
            out.append(cls(fn, k, store))
    return out[0] if single else out


def _trl_prompt_encoder(trainer):
    """How GRPOTrainer tokenizes a prompt (``_tokenize_prompts``), one prompt at a time."""
    proc = trainer.processing_class

    def encode(prompt):
        if isinstance(prompt, str):
            return proc(text=[prompt])["input_ids"][0]
        out = proc.apply_chat_template(
            conversation=[prompt], tools=trainer.tools or None, chat_template=trainer.chat_template,
            add_generation_prompt=True, tokenize=True, return_dict=True,
            **trainer.chat_template_kwargs,
        )  # fmt: skip
        return out["input_ids"][0]

    return encode


# --------------------------------------------------------------------------- the trainer

# TRL settings the fused loss path reproduces; any other value goes to TRL's own loss code,
# fed by fused log-probs (see MRTPOGRPOTrainer).
_REFUSED_MODEL_SETTINGS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                           "lm_head_multiplier", "output_multiplier")  # fmt: skip


def _trainer_mixin():
    class MRTPOGRPOMixin:
        """GRPOTrainer with MRTPO (B, T) token advantages and a fused LM head everywhere.

        Extra keyword arguments:
            mrtpo_alpha, mrtpo_gamma: MRTPO's alpha and gamma (``mrtpo_token_advantages``).
            reward_spans: one entry per reward function, ``fn_k(prompt, **columns) ->
                spans`` (the prompt and the other dataset columns of one sample; spans as
                in ``mrtpo.spans``: (start, end) on a plain prompt, (message, start, end) on
                a conversational one) or None. Where None, a reward function's own outputs
                name the spans if it returns per sample ``(score, spans)`` or a ``Verdict``;
                a reward with neither is spread uniformly (GDPO). On each generation batch
                the trainer runs ``mrtpo.replay.replay_relevance`` on this process's rows
                with the training model (whatever generated them, vLLM included).
            relevance_fn: override: ``fn(trainer, inputs, output) -> (relevance (K, B, T),
                has_info (B, K))`` for this process's rows.
            mrtpo_micro_batch, mrtpo_max_tokens: the replay's chunk of at most that many
                responses (16) and padded prompt + response tokens (None: no limit).
            mrtpo_advantages: False keeps TRL's own advantages (only the fused loss).

        Logged per step: ``mrtpo/replay_seconds`` and, per reward with spans,
        ``mrtpo/relevance/<reward name>`` (its mean relevance over the tokens of the samples
        whose prompt it names spans of). ``trainer.last_replay`` keeps the last batch's
        prompts, spans, completion ids and ``Replay`` (relevance, has_info) for inspection.

        Log-probs (old, reference and current) come from ``linear_logprobs`` on the
        decoder's hidden states, so no (B, T, V) logits are formed. The loss is
        ``fused_policy_loss`` for loss types grpo/bnpo/dapo/dr_grpo at token-level
        importance sampling, with or without ``use_bias_correction_kl``; every other
        setting (entropy bonus, top_entropy_quantile, off_policy_mask_threshold, delta,
        sequence-level importance sampling, vLLM importance weights, other loss types) runs
        TRL's own ``_compute_loss`` on those fused log-probs, so nothing is dropped. A MoE
        router aux loss, multimodal inputs and logit scaling/softcapping are refused.
        """

        def __init__(self, *args, mrtpo_alpha=ADVANTAGE_DEFAULTS.alpha,
                     mrtpo_gamma=ADVANTAGE_DEFAULTS.gamma, relevance_fn=None,
                     reward_spans=None, mrtpo_micro_batch=16, mrtpo_max_tokens=None,
                     mrtpo_advantages=True, **kwargs):  # fmt: skip
            store: dict = {}
            if "reward_funcs" in kwargs:
                kwargs["reward_funcs"] = _wrap_reward_funcs(kwargs["reward_funcs"], store)
            elif len(args) >= 2:
                args = (args[0], _wrap_reward_funcs(args[1], store), *args[2:])
            super().__init__(*args, **kwargs)
            self._mrtpo_span_store = store
            self.mrtpo_alpha = float(mrtpo_alpha)
            self.mrtpo_gamma = float(mrtpo_gamma)
            self.relevance_fn = relevance_fn
            self.mrtpo_micro_batch = mrtpo_micro_batch
            self.mrtpo_max_tokens = mrtpo_max_tokens
            self.mrtpo_advantages = bool(mrtpo_advantages)
            if getattr(self, "aux_loss_enabled", False):
                raise ValueError(
                    "router_aux_loss_coef: the fused LM head runs the decoder without the "
                    "MoE router outputs, so the aux loss would be lost; set "
                    "router_aux_loss_coef=0.0 or use TRL's GRPOTrainer"
                )
            text_config = self.model.config.get_text_config()
            for name in _REFUSED_MODEL_SETTINGS:
                value = getattr(text_config, name, None)
                if value is not None and value != 1.0:
                    raise ValueError(
                        f"model.config.{name}: the fused LM head computes plain "
                        f"logits / temperature; a model with {name}={value} is not supported"
                    )
            if self.mrtpo_advantages:
                _check_scale_rewards(self.scale_rewards)
            k = len(self.reward_funcs)
            if reward_spans is None:
                reward_spans = [None] * k
            if not isinstance(reward_spans, (list, tuple)) or len(reward_spans) != k:
                raise ValueError(
                    f"reward_spans: expected a list of {k} entries (one per reward function, "
                    f"a span function or None), got {reward_spans!r}"
                )
            for j, fn in enumerate(reward_spans):
                if fn is not None and not callable(fn):
                    raise ValueError(f"reward_spans[{j}]: expected a callable or None, got "
                                     f"{type(fn).__name__}")  # fmt: skip
            self.reward_spans = list(reward_spans)

        # ------------------------------------------------------------ advantages
        def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
            out = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._mrtpo_rewards_per_func = out  # (B_all, K), gathered over processes
            return out

        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            if not self.mrtpo_advantages:
                return output
            mode = "train" if self.model.training else "eval"
            g = self.num_generations if mode == "train" else self.num_generations_eval
            rewards = self._mrtpo_rewards_per_func
            mask = output["completion_mask"]
            b, t = mask.shape
            k = rewards.shape[1]
            spans = self._mrtpo_spans(inputs, k)
            self._mrtpo_span_store.clear()
            if self.relevance_fn is not None:
                relevance, has_info = self.relevance_fn(self, inputs, output)
            elif spans is not None:
                relevance, has_info = self._mrtpo_replay(inputs, output, spans, mode)
            else:
                relevance = torch.zeros((k, b, t), dtype=torch.float32, device=mask.device)
                has_info = torch.zeros((b, k), dtype=torch.bool, device=mask.device)
            rank = self.accelerator.process_index
            process_slice = None if rewards.shape[0] == b else slice(rank * b, (rank + 1) * b)
            output["advantages"] = mrtpo_advantages_for_grpo(
                rewards, g, mask, relevance.to(mask.device), has_info.to(mask.device),
                reward_weights=self.reward_weights.to(rewards.device), alpha=self.mrtpo_alpha,
                gamma=self.mrtpo_gamma, scale_rewards=self.scale_rewards,
                process_slice=process_slice,
            )  # fmt: skip
            return output

        # ------------------------------------------------------------ replay
        def _mrtpo_spans(self, inputs, k):
            """(B, K) spans of this process's rows, or None when no reward names any."""
            spans = [[None] * k for _ in inputs]
            found = False
            for j in range(k):
                fn, captured = self.reward_spans[j], self._mrtpo_span_store.get(j)
                if fn is not None:
                    for i, x in enumerate(inputs):
                        cols = {c: v for c, v in x.items() if c != "prompt"}
                        spans[i][j] = fn(x["prompt"], **cols)
                elif captured is not None:
                    if len(captured) != len(inputs):
                        raise ValueError(
                            f"reward function {j}: returned {len(captured)} outputs for "
                            f"{len(inputs)} samples"
                        )
                    for i in range(len(inputs)):
                        spans[i][j] = captured[i]
                found = found or any(spans[i][j] for i in range(len(inputs)))
            return spans if found else None

        @torch.no_grad()
        def _mrtpo_replay(self, inputs, output, spans, mode):
            from mrtpo.replay import replay_relevance

            model = self.accelerator.unwrap_model(self.model)
            was_training = model.training
            model.eval()
            try:
                with self.accelerator.autocast():
                    rep = replay_relevance(
                        model, [x["prompt"] for x in inputs], output["completion_ids"], spans,
                        response_mask=output["completion_mask"], encode=_trl_prompt_encoder(self),
                        prompt_ids=output["prompt_ids"], prompt_mask=output["prompt_mask"],
                        temperature=self.temperature, micro_batch=self.mrtpo_micro_batch,
                        max_tokens=self.mrtpo_max_tokens,
                        pad_token_id=self._tokenizer.pad_token_id,
                    )  # fmt: skip
            finally:
                model.train(was_training)
            self._log_replay(rep, mode)
            self.last_replay = dict(
                prompts=[x["prompt"] for x in inputs], spans=spans,
                completion_ids=output["completion_ids"], replay=rep,
            )  # fmt: skip
            return rep.relevance, rep.has_info

        def _log_replay(self, rep, mode):
            metrics = self._metrics[mode]
            dev = self.accelerator.device
            secs = self.accelerator.reduce(torch.tensor(rep.seconds, device=dev), "mean")
            metrics["mrtpo/replay_seconds"].append(float(secs))
            m = rep.response_mask.to(dev).float()
            for j, name in enumerate(self.reward_func_names):
                w = m * rep.has_info[:, j].to(dev).float()[:, None]
                tot = torch.stack([(rep.relevance[j].to(dev) * w).sum(), w.sum()])
                tot = self.accelerator.reduce(tot, reduction="sum")
                if float(tot[1]) > 0:
                    metrics[f"mrtpo/relevance/{name}"].append(float(tot[0] / tot[1]))

        # ------------------------------------------------------------ log-probs
        def _completion_hidden(self, model, input_ids, attention_mask, logits_to_keep):
            from mrtpo.model import decoder

            # the backbone under the trainer's autocast, as the model's wrapped forward runs it;
            # the head then runs in the weight's dtype
            inner = self.accelerator.unwrap_model(model)
            weight = inner.get_output_embeddings().weight
            if inner is model:
                with self.accelerator.autocast():
                    out = decoder(model)(input_ids=input_ids, attention_mask=attention_mask,
                                         use_cache=False)  # fmt: skip
                hidden = out.last_hidden_state[:, -logits_to_keep - 1 : -1]
                return hidden.to(weight.dtype)
            # Wrapped for several processes (DDP): the forward must go through the wrapper,
            # which synchronizes the gradients; with the head swapped for the identity its
            # "logits" are the last hidden states, and the fused head reads the weight.
            head = inner.get_output_embeddings()
            inner.set_output_embeddings(torch.nn.Identity())
            try:
                with self.accelerator.autocast():
                    out = model(input_ids=input_ids, attention_mask=attention_mask,
                                use_cache=False, logits_to_keep=logits_to_keep + 1)  # fmt: skip
            finally:
                inner.set_output_embeddings(head)
            return out.logits[:, :-1].to(weight.dtype)

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                               logits_to_keep, batch_size=None,
                                               compute_entropy=False, compute_aux_loss=False,
                                               **multimodal):  # fmt: skip
            if compute_aux_loss:
                raise ValueError("router_aux_loss_coef: not supported by the fused LM head")
            given = [k for k, v in multimodal.items() if v is not None]
            if given:
                raise ValueError(f"{given[0]}: multimodal inputs are not supported by the "
                                 "fused LM head (it runs the text decoder only)")  # fmt: skip
            from mrtpo.model import lm_head

            weight, bias = lm_head(self.accelerator.unwrap_model(model))
            batch_size = batch_size or input_ids.size(0)
            logps, ents = [], []
            for s in range(0, input_ids.size(0), batch_size):
                ids, am = input_ids[s : s + batch_size], attention_mask[s : s + batch_size]
                hidden = self._completion_hidden(model, ids, am, logits_to_keep)
                labels = ids[:, -logits_to_keep:].masked_fill(am[:, -logits_to_keep:] == 0, -100)
                out = linear_logprobs(hidden, weight, labels, bias=bias,
                                      temperature=self.temperature,
                                      return_entropy=compute_entropy)  # fmt: skip
                if compute_entropy:
                    logps.append(out[0])
                    ents.append(out[1])
                else:
                    logps.append(out)
            return (torch.cat(logps), torch.cat(ents) if compute_entropy else None, None)

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
            from mrtpo.model import lm_head

            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids = inputs["completion_ids"]
            mask = inputs["completion_mask"]
            if "tool_mask" in inputs:
                mask = mask * inputs["tool_mask"]
            t = completion_ids.size(1)
            hidden = self._completion_hidden(
                model, torch.cat([prompt_ids, completion_ids], dim=1),
                torch.cat([prompt_mask, inputs["completion_mask"]], dim=1), t,
            )  # fmt: skip
            weight, bias = lm_head(self.accelerator.unwrap_model(model))
            mode = "train" if self.model.training else "eval"
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
            token_normalizer = None
            if self.loss_type == "dapo":
                token_normalizer = (
                    inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
                )
                if mode == "train":
                    token_normalizer = (
                        token_normalizer * accumulation / self.args.steps_per_generation
                    )
            beta = self.beta
            loss, _ = fused_policy_loss(
                hidden, weight, completion_ids, mask, inputs.get("old_per_token_logps"),
                inputs["advantages"], epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high, beta=beta,
                ref_per_token_logps=inputs.get("ref_per_token_logps"),
                loss_type=self.loss_type, temperature=self.temperature,
                max_completion_length=self.max_completion_length,
                token_normalizer=token_normalizer, lm_head_bias=bias,
                use_bias_correction_kl=bool(self.args.use_bias_correction_kl),
            )  # fmt: skip
            if self.loss_type != "dapo":
                loss = loss / accumulation
            self._log_fused_metrics(hidden, weight, bias, completion_ids, mask, inputs, mode)
            return loss

        @torch.no_grad()
        def _log_fused_metrics(self, hidden, weight, bias, completion_ids, mask, inputs, mode):
            # The metrics TRL's _compute_loss logs, from one no-grad pass of the fused head.
            labels = completion_ids.masked_fill(mask == 0, -100)
            logp, entropy = linear_logprobs(hidden.detach(), weight.detach(), labels,
                                            bias=None if bias is None else bias.detach(),
                                            temperature=self.temperature,
                                            return_entropy=True)  # fmt: skip
            old = inputs.get("old_per_token_logps")
            old = logp if old is None else old
            ratio = torch.exp(logp - old)
            adv = inputs["advantages"]
            adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
            m = mask.to(logp.dtype)

            def global_masked_mean(x):
                totals = self.accelerator.reduce(
                    torch.stack([(x * m).sum(), m.sum()]), reduction="sum"
                )
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

    return MRTPOGRPOMixin


def _nan_reduce(x: torch.Tensor, fn) -> float:
    x = x[~torch.isnan(x)]
    return float("nan") if x.numel() == 0 else fn(x).item()


_TRAINER_CLASS = None


def __getattr__(name):
    # MRTPOGRPOTrainer subclasses trl.GRPOTrainer, so it is built on first use (TRL is
    # imported only then).
    global _TRAINER_CLASS
    if name == "MRTPOGRPOTrainer":
        if _TRAINER_CLASS is None:
            trl = require("trl", "MRTPOGRPOTrainer")
            mixin = _trainer_mixin()
            _TRAINER_CLASS = type("MRTPOGRPOTrainer", (mixin, trl.GRPOTrainer),
                                  {"__doc__": mixin.__doc__, "__module__": __name__})  # fmt: skip
        return _TRAINER_CLASS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
