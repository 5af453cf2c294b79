"""``MRTPOGRPOTrainer``: TRL's ``GRPOTrainer`` with the contrastive replay on each
generation batch, MRTPO (B, T) token advantages (``mrtpo_advantages_for_grpo``) and the loss
fused with the LM head (``FusedHead``). docs/trl.md is the guide.
"""

from __future__ import annotations

import time
import warnings

import torch
from trl import GRPOTrainer

from mrtpo.allocation.tensors import allocation_inputs
from mrtpo.integrations.common import consecutive_group_ids
from mrtpo.integrations.engine import sharded_replay
from mrtpo.integrations.trl import _check_scale_rewards, _trl_settings, mrtpo_advantages_for_grpo
from mrtpo.model.loading import UNSUPPORTED_LOGIT_FIELDS, logit_transform
from mrtpo.replay.api import replay_mask_from_rewards, replay_relevance
from mrtpo.replay.relevance_modes import relevance_mode
from mrtpo.replay.spans import span_list

from . import metrics as logged
from .config import _DEPRECATED_KWARGS, MRTPOConfig, _options_of
from .fused_head import FusedHead
from .patches import _ignore_trl_checkpointing_aliases, _model_id, _reference_from_policy
from .rewards import _wrap_reward_funcs

__all__ = ["TRAINED_ADVANTAGE_COLUMNS", "MRTPOGRPOTrainer"]

# log_completions: the advantages the model trained with, per completion (TRL's own column
# "advantage" is its per-sequence advantage, computed before MRTPO's replace it)
TRAINED_ADVANTAGE_COLUMNS = tuple(logged.COMPLETION_COLUMNS)

# TRL settings the fused loss path reproduces; any other value goes to TRL's own loss code,
# fed by fused log-probs (see MRTPOGRPOTrainer). The model's logit transform (Gemma's
# final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling) goes to the fused
# ops (mrtpo.model.loading.logit_transform); these multipliers are refused there.
_REFUSED_MODEL_SETTINGS = UNSUPPORTED_LOGIT_FIELDS


class MRTPOGRPOTrainer(FusedHead, GRPOTrainer):
    """GRPOTrainer with MRTPO (B, T) token advantages and a fused LM head everywhere.

    Takes GRPOTrainer's arguments, as keywords (``model=``, ``reward_funcs=``, ``args=``,
    ...); MRTPO's options are fields of ``args``, an
    ``MRTPOConfig`` (a plain ``GRPOConfig`` gets their defaults). Two more keyword
    arguments, callables like ``reward_funcs``:

    Args:
        reward_spans: one entry per reward function, ``fn_k(prompt, **columns) -> spans``
            (the prompt and the other dataset columns of one sample; spans as in
            ``mrtpo.replay.spans``: (start, end) on a plain prompt, (message, start, end) on a
            conversational one) or None. Where None, a reward function's own outputs name
            the spans if it returns per sample ``(score, spans)`` or a ``Verdict``
            (``verifier_reward`` makes one from a built-in verifier); a reward with
            neither is spread uniformly (GDPO). On each generation batch the trainer runs
            ``mrtpo.replay.api.replay_relevance`` on this process's rows with the training
            model (whatever generated them, vLLM included).
        relevance_fn: override of the replay: ``fn(trainer, inputs, output) ->
            (relevance (K, B, T), has_info (B, K))`` for this process's rows.

    The keywords ``mrtpo_alpha``, ``mrtpo_gamma``, ``mrtpo_micro_batch``,
    ``mrtpo_max_tokens`` and ``mrtpo_advantages`` of earlier versions still work, with a
    FutureWarning; they override the config's fields.

    Logged per step, beside TRL's metrics (docs/trl.md, "Logged metrics"):
    ``mrtpo/gdpo_std/<reward>``, ``mrtpo/frac_zero_std/<reward>``,
    ``mrtpo/frac_zero_std_all``, ``mrtpo/replay_seconds``, ``mrtpo/relevance/<reward>``,
    ``mrtpo/replay/pairs`` and ``mrtpo/replay/skipped`` (in all and per reward).
    ``trainer.last_replay`` keeps the last batch's prompts, spans, completion ids and
    ``Replay`` (relevance, has_info) for inspection.

    Log-probs (old, reference and current) come from ``linear_logprobs`` on the
    decoder's hidden states, so no (B, T, V) logits are formed. The loss is
    ``fused_policy_loss`` for loss types grpo/bnpo/dapo/dr_grpo at token-level
    importance sampling, with or without ``use_bias_correction_kl``; every other
    setting (entropy bonus, top_entropy_quantile, off_policy_mask_threshold, delta,
    sequence-level importance sampling, vLLM importance weights, other loss types) runs
    TRL's own ``_compute_loss`` on those fused log-probs, so nothing is dropped. A MoE
    model's router aux loss (``router_aux_loss_coef``) is taken from the decoder's router
    logits with the architecture's own ``load_balancing_loss_func`` and added as TRL adds
    it. The model's logit scaling and final-logit softcapping (Gemma 2 / 3, Cohere, Cohere2,
    Granite) are read from its config and applied by the fused ops as the model applies
    them. Multimodal inputs are refused.

    With ``beta > 0`` TRL loads its reference model from the policy's name; a policy
    passed as a model TRL cannot load by name (built in code, or converted and saved
    where its name does not point) gets as reference a frozen copy of itself, its
    weights at construction.
    """

    _name = "MRTPO"
    _tag_names = ["trl", "grpo", "mrtpo"]

    def __init__(
        self,
        *,
        model,
        reward_funcs=None,
        args=None,
        relevance_fn=None,
        reward_spans=None,
        **kwargs,
    ):
        deprecated = {k: kwargs.pop(k) for k in list(kwargs) if k in _DEPRECATED_KWARGS}
        store: dict = {}
        reward_funcs = _wrap_reward_funcs(reward_funcs, store)
        if args is None:  # as GRPOTrainer does, with MRTPO's config
            name = model if isinstance(model, str) else _model_id(model) or "model"
            args = MRTPOConfig(f"{name.split('/')[-1]}-MRTPO")
        options = _options_of(args, deprecated)
        _ignore_trl_checkpointing_aliases()
        with _reference_from_policy(model):
            super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self._mrtpo_span_store = store
        for key, value in options.items():
            setattr(self, key, value)
        self.relevance_fn = relevance_fn
        # the fused ops' logit_scale / softcap, as the model's forward applies them (a
        # setting in _REFUSED_MODEL_SETTINGS raises here)
        self._mrtpo_head_kw = logit_transform(self.model)
        if self.mrtpo_advantages:
            _check_scale_rewards(self.scale_rewards)
            aggregation = getattr(self.args, "multi_objective_aggregation", None)
            if aggregation != "normalize_then_sum":
                warnings.warn(
                    f"multi_objective_aggregation={aggregation!r} is not what MRTPO trains "
                    "with: its advantages normalize each reward in its group, then sum "
                    "(GDPO, 'normalize_then_sum', MRTPOConfig's default); only TRL's own "
                    "advantage column and frac_reward_zero_std use it. Set "
                    "multi_objective_aggregation='normalize_then_sum', or "
                    "mrtpo_advantages=False to train with TRL's advantages",
                    UserWarning,
                    stacklevel=2,
                )
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
                raise ValueError(
                    f"reward_spans[{j}]: expected a callable or None, got {type(fn).__name__}"
                )
        self.reward_spans = list(reward_spans)

    def end_training(self, settle_seconds: float = 0.25) -> None:
        """Close the process group at the end of a script run under several processes
        (``torchrun``); with one process, only Accelerate's own ``end_training``.

        Every process waits for the others, then sleeps ``settle_seconds`` (releasing the
        GIL) before the group is destroyed. The pause matters with gloo: its worker thread
        frees the last collective's tensors after the collective has returned, and that
        free takes the GIL. A group torn down before then (by ``destroy_process_group``,
        by the DDP model's garbage collection or at interpreter exit) can deadlock the
        process in the group's destructor or abort it ("terminate called without an
        active exception", exit -6) although every step trained: PyTorch's gloo backend,
        seen here about once in ten two-process runs of the TRL example."""
        if (
            isinstance(settle_seconds, bool)
            or not isinstance(settle_seconds, (int, float))
            or not 0 <= settle_seconds <= 60
        ):
            raise ValueError(
                f"settle_seconds: expected a number of seconds in [0, 60], got {settle_seconds!r}"
            )
        self._settle(settle_seconds)
        self.accelerator.end_training()

    def train(self, *args, **kwargs):
        """``GRPOTrainer.train``; with several processes it then settles the collectives as
        ``end_training`` does (every process waits, gloo's worker frees the last tensors),
        so that a script that ends without ``end_training`` does not abort at exit."""
        out = super().train(*args, **kwargs)
        self._settle(0.25)
        return out

    def _settle(self, seconds: float) -> None:
        if self.accelerator.num_processes > 1:
            self.accelerator.wait_for_everyone()
            time.sleep(seconds)  # releases the GIL: gloo's worker can free its last work

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
        self._log_group_stats(rewards, g, mode)
        mask = output["completion_mask"]
        b, t = mask.shape
        k = rewards.shape[1]
        spans = self._mrtpo_spans(inputs, k)
        self._mrtpo_span_store.clear()
        rank = self.accelerator.process_index
        process_slice = None if rewards.shape[0] == b else slice(rank * b, (rank + 1) * b)
        if self.relevance_fn is not None:
            relevance, has_info = self.relevance_fn(self, inputs, output)
        else:
            # Whether this process replays depends on its rows (another may name spans
            # where this one names none). With replicated parameters (DDP, ZeRO-1/2) the
            # replay runs no collective; on a sharded engine (FSDP1/2, ZeRO-3) every
            # process enters `sharded_replay`, which gathers the LM head and runs the
            # decoder forwards in lockstep (dummy ones where a process has none left)
            # through the wrapped model (mrtpo/integrations/engine.py). The logging after
            # it runs the same collectives on every process, replayed or not.
            # Only the (completion, reward) pairs whose GDPO advantage is not exactly 0 are
            # replayed (the rewards of every process are known here): the token advantages
            # are the same bit for bit as a full replay's.
            rep = None
            named = 0
            with sharded_replay(self.model, device=self.accelerator.device) as lm:
                if spans is not None:
                    moving = self._replay_mask(rewards, g, spans, process_slice)
                    named = sum(bool(s) for row in spans for s in row)
                    if bool(moving.any()):
                        rep = self._mrtpo_replay(inputs, output, spans, mode, moving, lm=lm)
            if rep is not None:
                relevance, has_info = rep.relevance, rep.has_info
            else:
                relevance = torch.zeros((k, b, t), dtype=torch.float32, device=mask.device)
                has_info = torch.zeros((b, k), dtype=torch.bool, device=mask.device)
            self._log_replay(rep, mode, named, spans)
        relevance, has_info, gamma = self._allocating(
            relevance.to(mask.device), has_info.to(mask.device).bool(), output
        )
        output["advantages"] = mrtpo_advantages_for_grpo(
            rewards,
            g,
            mask,
            relevance,
            has_info,
            reward_weights=self.reward_weights.to(rewards.device),
            alpha=self.mrtpo_alpha,
            gamma=gamma,
            scale_rewards=self.scale_rewards,
            process_slice=process_slice,
        )
        if self.log_completions:
            self._log_trained_advantages(output)
        return output

    def _log_trained_advantages(self, output):
        """Columns of TRL's completions table (``log_completions``), beside TRL's
        ``advantage`` (TRL's own per-sequence advantage, which the model does not train
        with): per completion the mean, min and max over its completion tokens of the MRTPO
        token advantages the loss uses (NaN for a completion without a token), gathered
        over processes in TRL's row order."""
        adv = output["advantages"].detach().float()
        m = output["completion_mask"].bool()
        if "tool_mask" in output:
            m = m & output["tool_mask"].bool()
        count = m.sum(dim=1)
        nan = torch.tensor(float("nan"), device=adv.device)
        empty = count == 0
        mean = torch.where(empty, nan, (adv * m).sum(dim=1) / count.clamp(min=1))
        low = torch.where(empty, nan, adv.masked_fill(~m, float("inf")).amin(dim=1))
        high = torch.where(empty, nan, adv.masked_fill(~m, float("-inf")).amax(dim=1))
        stats = torch.stack([mean, low, high], dim=1).to(self.accelerator.device)
        stats = self.accelerator.gather(stats).cpu()
        for j, column in enumerate(TRAINED_ADVANTAGE_COLUMNS):
            self._logs["extra"][column].extend(stats[:, j].tolist())

    def _allocating(self, relevance, has_info, output):
        """The relevance, has_info and gamma that allocate each reward, from the replay's, as
        ``mrtpo train`` makes them (``mrtpo.allocation.tensors.allocation_inputs``: the
        truncated credit, the relevance form, the stop credit of MRTPOConfig)."""
        mask = output["completion_mask"].bool()
        ids = output["completion_ids"]
        eos = torch.tensor(self.eos_token_ids, device=ids.device)
        # finished: the completion holds a stop token (TRL's mask ends at the first one)
        finished = (torch.isin(ids, eos) & mask.to(ids.device)).any(dim=1).to(mask.device)
        return allocation_inputs(
            self.mrtpo_allocation,
            relevance,
            has_info,
            self.mrtpo_gamma,
            mask=mask,
            finished=finished,
        )

    def _log_group_stats(self, rewards, g, mode):
        """MRTPO's own GDPO statistics of the step (the rewards gathered over processes, so
        no collective): per reward, the mean over groups of its group std (the std MRTPO
        divides by with scale_rewards "group"; a missing reward counts 0, as in the
        advantages) and the share of
        groups where it does not vary (its advantage is 0 there); and the share of groups
        where no reward varies (MRTPO's advantage is 0 for the whole group)."""
        r = torch.nan_to_num(rewards.detach().double(), nan=0.0)
        if g < 2 or r.shape[0] % g:
            return
        grouped = r.view(-1, g, r.shape[1])  # (groups, G, K)
        std = grouped.std(dim=1)  # unbiased, as METHOD.md section 1
        flat = grouped.amax(dim=1) == grouped.amin(dim=1)  # zero variance, tested exactly
        metrics = self._metrics[mode]
        for j, name in enumerate(self.reward_func_names):
            metrics[logged.GDPO_STD.format(reward=name)].append(float(std[:, j].mean()))
            metrics[logged.FRAC_ZERO_STD.format(reward=name)].append(
                float(flat[:, j].double().mean())
            )
        metrics[logged.FRAC_ZERO_STD_ALL].append(float(flat.all(dim=1).double().mean()))

    # ------------------------------------------------------------ replay
    def _mrtpo_spans(self, inputs, k):
        """(B, K) spans of this process's rows, or None when no reward names any."""
        spans = [[None] * k for _ in inputs]
        found = False
        for j in range(k):
            fn, captured = self.reward_spans[j], self._mrtpo_span_store.get(j)
            if fn is not None:
                name = getattr(fn, "__name__", type(fn).__name__)
                for i, x in enumerate(inputs):
                    cols = {c: v for c, v in x.items() if c != "prompt"}
                    where = f"reward_spans[{j}] ({name!r}), sample {i}"
                    spans[i][j] = span_list(fn(x["prompt"], **cols), where=where)
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

    def _replay_mask(self, rewards, g, spans, process_slice):
        """(B, K) bool: this process's pairs that name spans and whose GDPO advantage over
        the whole batch (every process's rewards, grouped by ``g``) is not exactly 0."""
        group_ids = consecutive_group_ids(rewards.shape[0], g, device=rewards.device)
        moving = replay_mask_from_rewards(
            rewards,
            group_ids,
            weights=self.reward_weights.to(rewards.device),
            settings=_trl_settings(None, {"scale_rewards": self.scale_rewards}, "scale_rewards"),
        )  # the GDPO part of the settings mrtpo_advantages_for_grpo computes the advantages with
        if process_slice is not None:
            moving = moving[process_slice]
        info = torch.tensor([[bool(s) for s in row] for row in spans], dtype=torch.bool)
        if self.mrtpo_replay_all:
            return info
        moving = moving & info
        if relevance_mode(self.mrtpo_relevance).mixes_rewards:  # r_k reads the row: whole rows
            moving = info & moving.any(dim=1, keepdim=True)
        return moving

    @torch.no_grad()
    def _mrtpo_replay(self, inputs, output, spans, mode, replay_mask=None, lm=None):
        """The replay of this process's rows; ``lm``: the ``EngineLM`` of a sharded engine
        (``sharded_replay``), else the unwrapped model runs it."""
        model = self.accelerator.unwrap_model(self.model) if lm is None else self.model
        was_training = model.training
        model.eval()
        try:
            with self.accelerator.autocast():
                rep = replay_relevance(
                    model if lm is None else lm,
                    [x["prompt"] for x in inputs],
                    output["completion_ids"],
                    spans,
                    response_mask=output["completion_mask"],
                    encode=_trl_prompt_encoder(self),
                    prompt_ids=output["prompt_ids"],
                    prompt_mask=output["prompt_mask"],
                    temperature=self.temperature,
                    micro_batch=self.mrtpo_replay_micro_batch,
                    max_tokens=self.mrtpo_replay_max_tokens,
                    pad_token_id=self._tokenizer.pad_token_id,
                    replay_mask=replay_mask,
                )
        finally:
            model.train(was_training)
        self.last_replay = dict(
            prompts=[x["prompt"] for x in inputs],
            spans=spans,
            completion_ids=output["completion_ids"],
            replay=rep,
        )
        return rep

    def _log_replay(self, rep, mode, named: int = 0, spans=None):
        """One all-reduce, run by every process whatever its rows hold (``rep`` None: this
        process replayed nothing): the replay's seconds averaged over the processes that
        replayed, the pairs replayed and the pairs with spans skipped (their advantage is 0)
        over every process, in all and per reward, and per reward its relevance summed over
        the tokens of the pairs replayed, over every process. ``named``: this process's
        pairs with spans; ``spans``: its (B, K) spans (None: none named).

        ``mrtpo/relevance/<reward>``: the mean relevance over the tokens of that reward's
        pairs replayed, absent in a step where none was (it named no span, or every pair
        it named was skipped: ``mrtpo/replay/skipped/<reward>`` tells which)."""
        dev = self.accelerator.device
        k = len(self.reward_func_names)
        local = torch.zeros(4 + 4 * k, dtype=torch.float64, device=dev)
        local[3] = float(named)
        for j in range(k):
            local[7 + 4 * j] = float(sum(bool(row[j]) for row in spans or ()))
        if rep is not None:
            local[0], local[1] = float(rep.seconds), 1.0
            pairs = rep.replayed_pairs.to(dev)
            local[2] = float(pairs.sum())
            m = rep.response_mask.to(dev).double()
            for j in range(k):
                w = m * pairs[:, j].double()[:, None]
                local[4 + 4 * j] = (rep.relevance[j].to(dev).double() * w).sum()
                local[5 + 4 * j] = w.sum()
                local[6 + 4 * j] = float(pairs[:, j].sum())
        tot = self.accelerator.reduce(local, reduction="sum").cpu()
        metrics = self._metrics[mode]
        if float(tot[1]) > 0:
            metrics[logged.REPLAY_SECONDS].append(float(tot[0] / tot[1]))
        metrics[logged.REPLAY_PAIRS].append(float(tot[2]))
        metrics[logged.REPLAY_SKIPPED].append(float(tot[3] - tot[2]))
        for j, name in enumerate(self.reward_func_names):
            rel, count = float(tot[4 + 4 * j]), float(tot[5 + 4 * j])
            replayed, named_j = float(tot[6 + 4 * j]), float(tot[7 + 4 * j])
            metrics[logged.REPLAY_PAIRS_OF.format(reward=name)].append(replayed)
            metrics[logged.REPLAY_SKIPPED_OF.format(reward=name)].append(named_j - replayed)
            if count > 0:  # measured: absent when no pair of it was replayed
                metrics[logged.RELEVANCE.format(reward=name)].append(rel / count)


def _trl_prompt_encoder(trainer):
    """How GRPOTrainer tokenizes a prompt (``_tokenize_prompts``), one prompt at a time."""
    proc = trainer.processing_class

    def encode(prompt):
        if isinstance(prompt, str):
            return proc(text=[prompt])["input_ids"][0]
        out = proc.apply_chat_template(
            conversation=[prompt],
            tools=trainer.tools or None,
            chat_template=trainer.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=True,
            **trainer.chat_template_kwargs,
        )
        return out["input_ids"][0]

    return encode
