"""TRL adapter, the trainer: ``MRTPOGRPOTrainer``, TRL's GRPOTrainer with the contrastive
replay on each generation batch, MRTPO (B, T) token advantages and the loss fused with the
LM head (the functions of ``mrtpo.integrations.trl``), and the wrapper that lets a reward
function name its prompt spans.

``MRTPOGRPOTrainer`` subclasses ``trl.GRPOTrainer``, so it is built on first use (TRL is
imported only then): ``from mrtpo.integrations.trl_trainer import MRTPOGRPOTrainer``. The
earlier ``from mrtpo.integrations.trl import MRTPOGRPOTrainer`` gives the same class.
"""

from __future__ import annotations

import functools

import torch

from mrtpo_kernels import ADVANTAGE_DEFAULTS, linear_logprobs

from ..spans import score_and_spans
from .common import require
from .trl import LOSS_TYPES, _check_scale_rewards, fused_policy_loss, mrtpo_advantages_for_grpo

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
        if isinstance(out, (str, bytes)) or not isinstance(out, (list, tuple)):
            raise ValueError(
                f"reward function {self.__name__!r}: expected a list with one output per "
                f"sample, got {type(out).__name__}"
            )
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
            else:
                # Whether this process replays depends on its rows (another may name spans
                # where this one names none), so the replay runs no collective; the logging
                # after it runs the same ones on every process, replayed or not.
                rep = None
                if spans is not None:
                    rep = self._mrtpo_replay(inputs, output, spans, mode)
                    relevance, has_info = rep.relevance, rep.has_info
                else:
                    relevance = torch.zeros((k, b, t), dtype=torch.float32, device=mask.device)
                    has_info = torch.zeros((b, k), dtype=torch.bool, device=mask.device)
                self._log_replay(rep, mode)
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
            self.last_replay = dict(
                prompts=[x["prompt"] for x in inputs], spans=spans,
                completion_ids=output["completion_ids"], replay=rep,
            )  # fmt: skip
            return rep

        def _log_replay(self, rep, mode):
            """One all-reduce, run by every process whatever its rows hold (``rep`` None: this
            process replayed nothing): the replay's seconds averaged over the processes that
            replayed, and per reward its relevance summed over the tokens of the samples it
            names spans of, over every process."""
            dev = self.accelerator.device
            k = len(self.reward_func_names)
            local = torch.zeros(2 + 2 * k, dtype=torch.float64, device=dev)
            if rep is not None:
                local[0], local[1] = float(rep.seconds), 1.0
                m = rep.response_mask.to(dev).double()
                for j in range(k):
                    w = m * rep.has_info[:, j].to(dev).double()[:, None]
                    local[2 + 2 * j] = (rep.relevance[j].to(dev).double() * w).sum()
                    local[3 + 2 * j] = w.sum()
            tot = self.accelerator.reduce(local, reduction="sum").cpu()
            metrics = self._metrics[mode]
            if float(tot[1]) > 0:
                metrics["mrtpo/replay_seconds"].append(float(tot[0] / tot[1]))
            for j, name in enumerate(self.reward_func_names):
                rel, count = float(tot[2 + 2 * j]), float(tot[3 + 2 * j])
                if count > 0:
                    metrics[f"mrtpo/relevance/{name}"].append(rel / count)

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
