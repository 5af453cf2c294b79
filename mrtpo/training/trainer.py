"""The MRTPO training loop: rollouts, rewards, contrastive replay, advantages, the fused
clipped policy loss, AdamW, checkpoints and metrics. Uses only the public API of
mrtpo_kernels.

One step:
1. B prompts; G sampled responses each with ``generate`` (temperature, no top-k/top-p by
   default), cut after the first end-of-turn token.
2. Every verifier scores every response: rewards (n, K) and each verdict's prompt spans.
3. Contrastive replay (``mrtpo.replay.api``): the with-information forward gives the old
   log-probs (only where the policy moves during the update, ``separate_old_forward``;
   otherwise the update's own, detached, and the replay runs no log-prob op: the JS is the
   only head pass over its with-information hidden states, which under MRTPO are the
   update's own too, from its forwards run before the replay, ``replay_from_update``); the
   forwards without each reward's spans give
   the relevance d (K, N). Under
   mrtpo only the pairs whose GDPO advantage A_k is not 0 are replayed
   (``replay_mask_from_rewards``; the token advantages are the same bit for bit), and the
   relevance metrics are over those pairs.
4. Advantages: ``grpo`` (the summed reward through ``gdpo_advantages`` with K = 1, uniform
   over tokens), ``gdpo`` (``gdpo_advantages``, uniform), ``mrtpo``
   (``mrtpo_token_advantages``, packed with cu_seqlens).
5. PPO epochs over minibatches of responses, micro-batches accumulated, loss =
   ``linear_policy_loss`` on the policy's hidden states and LM head (optional k3 KL to the
   initial model), gradient-norm clipping, AdamW.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mrtpo.allocation import Allocation
from mrtpo.allocation.tensors import (
    allocation_inputs,
    stop_token_at_mean,  # noqa: F401 - its import path before
)
from mrtpo.model.builtin import is_builtin
from mrtpo.model.folder import check_model_folder
from mrtpo.model.initial import initial_folder
from mrtpo.model.loading import (
    default_model,
    gradient_checkpointing,
    lm_head,
    load_model,
    logit_transform,
    save_model,
)
from mrtpo.model.pretrained import stored_dtype
from mrtpo.replay.api import ReplayResult, contrastive_replay, replay_mask_from_rewards
from mrtpo.replay.prompting import ChatPrompter
from mrtpo.replay.relevance_modes import step_mode
from mrtpo.replay.teacher_forcing import forward_responses, response_hidden, teacher_batch
from mrtpo.tasks.builtin import load_task
from mrtpo_kernels import (
    gdpo_advantages,
    linear_logprobs,
    linear_policy_loss,
    mrtpo_token_advantages,
)

from .checkpoint import RunDir, rng_state, set_rng_state, write_atomic
from .config import TrainConfig
from .heldout import check_eval_split, eval_due, evaluate_heldout, match_schedule
from .metrics import format_eval, format_step, relevant_token_masks, step_metrics
from .report import pair_status, plot_curves, write_tokens_html
from .rollouts import PromptSampler, generate_rollouts


def seed_everything(seed: int):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {name!r} was asked for but CUDA is not available")
    return dev


def separate_old_forward(cfg: TrainConfig) -> bool:
    """Whether the update needs the rollout policy's log-probs from a no-grad forward of
    their own: where the policy moves between the rollout and a forward of the update,
    i.e. several PPO epochs (``ppo_epochs``) or several optimizer steps per epoch
    (``minibatches``). With one of each the update's only optimizer step comes after all of
    its forwards, which therefore run the rollout's weights: the old log-probs are then the
    update's own, detached (one head pass over its hidden states, no model forward; the
    importance ratio is exactly 1), and a GDPO or GRPO step runs no replay forward at all
    (MRTPO's replay still runs, for the JS)."""
    return cfg.ppo_epochs > 1 or cfg.minibatches > 1


def oracle_relevance(task, ro, lengths) -> torch.Tensor:
    """(K, N) 1 on the response tokens each reward's verifier names (`relevant_token_masks`:
    ``relevant_chars`` or the SQL / tools analogue), 0 elsewhere: a diagnostic upper bound on
    credit precision (1), not the method. A response whose verifier names no token, or all
    of them, gets 0 everywhere, so its allocation stays uniform (below delta)."""
    masks = relevant_token_masks(task, ro)
    rel = torch.zeros((len(task.verifiers), int(lengths.sum())), dtype=torch.float32)
    a = 0
    for i, n in enumerate(lengths.tolist()):
        for k, m in enumerate(masks[i]):
            if m is not None and 0 < int(m[:n].sum()) < n:
                rel[k, a : a + min(n, m.shape[0])] = m[:n].float()
        a += n
    return rel


def compute_advantages(
    algo, rewards, group_ids, relevance, has_info, lengths, cfg, control=None, finished=None
):
    """Token advantages (N,) packed, and the allocation weights (K, N) actually applied.
    Under mrtpo, ``relevance`` (K, N) allocates as ``cfg``'s allocation decisions make it
    (``mrtpo.allocation.tensors.allocation_inputs``: ``cfg.truncated_credit`` on the
    responses not ``finished`` (n,) bool, the relevance form ``cfg.relevance``, with
    ``control`` the d_ctrl (N,) of the control form, and ``cfg.stop_credit`` on the stop
    token of each finished response; ``finished`` None: neither credit rule applies)."""
    cu = torch.zeros(len(lengths) + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    k, n_tok = rewards.shape[1], int(cu[-1])
    uniform = torch.ones((k, n_tok), dtype=torch.float32)
    if algo == "mrtpo":
        allocation = Allocation(cfg.relevance, cfg.stop_credit, cfg.truncated_credit)
        relevance, has_info, gamma = allocation_inputs(
            allocation,
            relevance,
            has_info,
            cfg.gamma,
            lengths=lengths,
            finished=finished,
            control=control,
        )
        ta = mrtpo_token_advantages(
            rewards,
            group_ids,
            relevance,
            has_info=has_info,
            cu_seqlens=cu,
            alpha=cfg.alpha,
            gamma=gamma,
            batch_norm=cfg.batch_norm,
        )
        return ta.token.float(), ta.allocation.float()
    summed = rewards.sum(1, keepdim=True) if algo == "grpo" else rewards
    g = gdpo_advantages(summed, group_ids, batch_norm=cfg.batch_norm, lengths=lengths)
    return g.sequence.float().repeat_interleave(lengths), uniform


class NonFiniteWeightsError(RuntimeError):
    """An update made weights NaN or inf: the run stops before they are saved or used."""


@dataclass
class TrainResult:
    out: Path
    metrics: list[dict]
    metrics_path: Path
    curves_path: Path
    html_path: Path
    checkpoint: Path


def _refuse_other_config(saved: dict, cfg: TrainConfig, where: Path) -> None:
    """Resume only a run of the same trajectory-changing settings."""
    want = cfg.trajectory()
    have = TrainConfig.from_dict(saved).trajectory()
    diff = [k for k in want if want[k] != have.get(k)]
    if diff:
        pairs = ", ".join(f"{k}={have.get(k)!r} (asked: {want[k]!r})" for k in diff)
        raise ValueError(
            f"resume: the run in {str(where)!r} was made with {pairs}; resume it with the same "
            "settings, or start another --out (or --overwrite it)"
        )


class Trainer:
    """One training run: loads the task (refusing one it cannot use before ``cfg.out`` is
    touched), prepares ``cfg.out`` (before any model is built), then loads or builds the
    model and, with ``cfg.resume``, the checkpoint."""

    # an internal switch (tests, benchmarks): True takes the old log-probs from the replay's
    # no-grad forward even where ``separate_old_forward`` says the update's own are the same
    force_old_forward = False
    # MRTPO on-policy (where ``separate_old_forward`` is False): the with-information hidden
    # states come from the update's own forward, held with its graph until the advantages
    # exist, instead of a replay forward of their own. "auto": where the batch is one update
    # micro-batch (the graphs held are then the ones the update holds anyway); True: always
    # (the whole batch's graphs held at once); False: the replay's own forward (the
    # side-by-side test and benchmarks)
    replay_from_update = "auto"

    def __init__(self, cfg: TrainConfig, *, task=None, log=None):
        try:
            self._init(cfg, task=task, log=log)
        except BaseException:
            if hasattr(self, "run_dir"):
                self.run_dir.unlock()  # the folder's lock is held only by a trainer that runs
            raise

    def _init(self, cfg: TrainConfig, *, task=None, log=None):
        self.cfg = cfg.validate(builtin_task=task is None)
        self.log = log or (lambda msg: None)
        self.out = Path(cfg.out)
        self.run_dir = RunDir(self.out)
        self.ckpt_dir = self.run_dir.checkpoint
        if task is None:
            task = load_task(cfg.task, seed=cfg.seed if cfg.init_seed is None else cfg.init_seed)
        self.task = task
        self.k = len(task.verifiers)
        # a task the run cannot use is refused before --out is touched: a refusal after
        # config.json and metrics.jsonl were written made the same command "already holds a run"
        if self.k == 0:
            raise ValueError("task: it has no verifiers (no rewards)")
        check_eval_split(task, cfg)
        meta = self._prepare_out()
        self.reward_names = [v.name for v in task.verifiers]
        self.device = resolve_device(cfg.device)
        dtype = getattr(torch, cfg.dtype)

        if cfg.model is not None:
            self.init_path = Path(cfg.model)
            if is_builtin(cfg.model):  # converted once; warm-started where --warm-steps asks
                self.init_path = initial_folder(
                    cfg.model,
                    task,
                    seed=cfg.seed if cfg.init_seed is None else cfg.init_seed,
                    cache_dir=cfg.cache_dir,
                    warm_steps=cfg.tiny.warm_steps,
                    warm_noise=cfg.tiny.warm_noise,
                    dtype=stored_dtype(dtype),
                    log=self.log,
                )
            model, tok = load_model(self.init_path, dtype=dtype, device=self.device)
        else:
            init_seed = cfg.seed if cfg.init_seed is None else cfg.init_seed
            model, tok = default_model(
                task, seed=init_seed, cache_dir=cfg.cache_dir, cfg=cfg.tiny, log=self.log
            )
            key = cfg.tiny.for_task(task.name).key()
            self.init_path = Path(cfg.cache_dir) / f"{task.name}-seed{init_seed}-{key}"
            model = model.to(device=self.device, dtype=dtype)
        self.ref = None
        if cfg.kl_beta > 0:
            self.ref = copy.deepcopy(model).eval().requires_grad_(False)
        self.model, self.tok = model.eval(), tok
        self.prompter = ChatPrompter(tok)
        self.step = 0
        self.sampler = PromptSampler(len(task.train), cfg.seed)
        seed_everything(cfg.seed)
        if cfg.freeze_embeddings:
            model.get_input_embeddings().weight.requires_grad_(False)
            head = model.get_output_embeddings()
            if head is not None:
                head.weight.requires_grad_(False)
        self.opt = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(0.9, 0.99),
        )
        self.samples: list[dict] = []
        if meta is not None:
            self._load_checkpoint(meta)
        self.metrics: list[dict] = self.run_dir.start_metrics(self.step)
        write_atomic(self.run_dir.config_path, json.dumps(cfg.to_dict(), indent=1))

    # -- checkpoints ---------------------------------------------------------------------------
    def _prepare_out(self) -> dict | None:
        """Create and lock --out, refuse a folder the trainer did not make, a run without
        --resume or --overwrite and the resume of another run, repair what a kill left (and
        say what it found); the committed checkpoint's meta when resuming from one."""
        cfg = self.cfg
        return self.run_dir.prepare(
            resume=cfg.resume,
            overwrite=cfg.overwrite,
            check_config=lambda saved: _refuse_other_config(saved, cfg, self.out),
            log=self.log,
        )

    def save_checkpoint(self):
        self.run_dir.save(
            step=self.step,
            save_model=lambda path: save_model(self.model, self.tok, path),
            state={
                "step": self.step,
                "optimizer": self.opt.state_dict(),
                "rng": rng_state(),
                "sampler": self.sampler.state(),
                "samples": self.samples,
            },
            config=self.cfg.to_dict(),
        )

    def _load_checkpoint(self, meta: dict):
        problem = check_model_folder(self.ckpt_dir / "model")
        if problem:
            raise ValueError(f"checkpoint: {problem} (the checkpoint of step {meta['step']})")
        state = self.run_dir.load_state()
        model, _ = load_model(
            self.ckpt_dir / "model",
            dtype=getattr(torch, self.cfg.dtype),
            device=self.device,
            what="checkpoint",
        )
        self.model.load_state_dict(model.state_dict())
        self.opt.load_state_dict(state["optimizer"])
        self.sampler.load(state["sampler"])
        set_rng_state(state["rng"])
        self.step = int(meta["step"])
        self.samples = state.get("samples", [])
        self.log(f"resumed from {self.ckpt_dir} at step {self.step}")

    # -- one step -----------------------------------------------------------------------------
    def _amp(self):
        """The model's forwards under ``--autocast`` (a no-op context when it is "none"). The
        decoder's residual stream stays in the weights' dtype, so the hidden states that
        reach the fused LM-head ops (and their fp32 accumulation) keep it too."""
        if self.cfg.autocast == "none":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=getattr(torch, self.cfg.autocast))

    def train_step(self) -> dict:
        cfg, t0 = self.cfg, time.perf_counter()
        examples = [self.task.train[i] for i in self.sampler.take(cfg.prompts_per_step)]
        self.model.eval()
        with self._amp():
            ro = generate_rollouts(self.model, self.prompter, self.task, examples, cfg, self.device)
        t1 = time.perf_counter()
        want_replay = cfg.algo == "mrtpo" or cfg.replay_for_baselines
        own_old = not (self.force_old_forward or separate_old_forward(cfg))
        mode = step_mode(cfg.algo, cfg.relevance)
        has_info = torch.tensor([[len(s) > 0 for s in row] for row in ro.spans], dtype=torch.bool)
        has_info = has_info.reshape(len(ro.spans), self.k)
        # under mrtpo, only the pairs whose advantage can move a token are replayed (the
        # baselines' replay, a diagnostic, replays every pair)
        moving = None
        if cfg.algo == "mrtpo" and not cfg.replay_all:
            moving = replay_mask_from_rewards(
                ro.rewards, ro.group_ids, has_info=has_info, whole_rows=mode.mixes_rewards
            )
        rep = ReplayResult(None, None, None, 0)  # no forward: nothing replayed, no old log-probs
        held, hp_update, t_held = None, None, 0.0
        from_update = self.replay_from_update
        if from_update == "auto":
            from_update = len(ro.responses) <= cfg.micro_batch
        if cfg.algo == "mrtpo" and want_replay and own_old and from_update:
            held, hp_update = self._update_forwards(ro)
            t_held = time.perf_counter() - t1
        if want_replay or not own_old:
            with self._amp():
                rep = contrastive_replay(
                    self.model,
                    self.prompter,
                    [ex.prompt for ex in ro.examples],
                    ro.prompt_ids,
                    ro.responses,
                    ro.spans,
                    temperature=cfg.temperature,
                    micro_batch=cfg.micro_batch * 2,
                    replay=want_replay,
                    control=mode.control_spans(ro.examples, ro.spans),
                    pointwise=mode.pointwise,
                    replay_mask=moving,
                    # on-policy the old log-probs are the update's own: the with-information
                    # logits are then computed once, by the JS
                    old_logprobs=not own_old,
                    hidden_p=hp_update,
                )
        lengths = torch.tensor([len(r) for r in ro.responses], dtype=torch.long)
        have_rel = rep.relevance is not None
        relevance = mode.relevance(
            rep, self.k, lengths, oracle=lambda: oracle_relevance(self.task, ro, lengths)
        )
        d_ctrl = None if rep.control is None else rep.control.float().cpu()
        finished = None  # unknown: neither credit rule applies
        if ro.truncated is not None:
            finished = ~torch.tensor(ro.truncated, dtype=torch.bool)
        adv, alloc = compute_advantages(
            cfg.algo,
            ro.rewards,
            ro.group_ids,
            relevance,
            has_info,
            lengths,
            cfg,
            d_ctrl,
            finished=finished,
        )
        ref_logp = None
        if self.ref is not None:
            with self._amp():
                h_ref = forward_responses(
                    self.ref,
                    ro.prompt_ids,
                    ro.responses,
                    self.tok.pad_token_id,
                    micro_batch=cfg.micro_batch * 2,
                    device=self.device,
                )
            w_ref, b_ref = lm_head(self.ref)
            labels = torch.cat([torch.tensor(r) for r in ro.responses]).to(self.device)
            with torch.no_grad():
                ref_logp = linear_logprobs(
                    h_ref,
                    w_ref,
                    labels,
                    bias=b_ref,
                    temperature=cfg.temperature,
                    **logit_transform(self.ref),
                ).cpu()
        t2 = time.perf_counter()
        old_logp = None if own_old else rep.old_logprobs.detach().float().cpu()
        upd = self._update(ro, old_logp, adv, ref_logp, lengths, held=held)
        t3 = time.perf_counter()
        self.step += 1
        # credit and relevance diagnostics over the pairs replayed (a skipped pair's
        # relevance is 0 and its allocation uniform, by construction)
        judged = has_info if moving is None else has_info & moving
        row = step_metrics(
            self.task, cfg, self.step, ro, relevance if have_rel else None, judged, alloc, lengths
        )
        row.update(upd)
        row["replay/pairs"] = rep.pairs if have_rel else None
        row["replay/skipped"] = rep.skipped if have_rel else None
        row["time"] = {
            "rollout": t1 - t0,
            "replay": t2 - t1 - t_held,
            "update": t3 - t2 + t_held,  # with its forward, where the replay took it first
            "replays": rep.replayed,
        }
        # judged: the pairs the replay ran (tokens.html labels the others and says why)
        self._keep_samples(
            ro, relevance, alloc, lengths, have_rel, has_info, judged if have_rel else None
        )
        return row

    def _update_forwards(self, ro):
        """The update's forwards, run before the replay (MRTPO on-policy: one epoch, one
        minibatch): its micro-batches in the order ``_update`` takes them (the epoch's
        permutation drawn here, as ``_update`` would draw it), each (rows, token indices,
        batch, hidden states with their graph), and the (N, d) with-information hidden
        states, detached, packed in response order, for the replay's JS. The graphs of
        every micro-batch are held until ``_update`` runs the loss on them: the update's
        activation memory for the whole batch at once (with ``gradient_checkpointing``, one
        (tokens, d) input per layer) instead of one micro-batch's."""
        cfg = self.cfg
        n = len(ro.responses)
        lengths = [len(r) for r in ro.responses]
        starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        perm = torch.randperm(n).tolist()
        self.model.eval()
        held, hp = [], None
        for m in range(0, n, cfg.micro_batch):
            rows = perm[m : m + cfg.micro_batch]
            tb = teacher_batch(
                [ro.prompt_ids[i] for i in rows],
                [ro.responses[i] for i in rows],
                self.tok.pad_token_id,
                self.device,
            )
            idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows])
            ckpt = gradient_checkpointing(self.model, cfg.gradient_checkpointing)
            with self._amp(), ckpt:
                hidden = response_hidden(self.model, tb)
            if hp is None:
                hp = hidden.new_empty((starts[-1], hidden.shape[-1]))
            hp[idx.to(hp.device)] = hidden.detach()
            held.append((rows, idx, tb, hidden))
        return held, hp

    def _update(self, ro, old_logp, adv, ref_logp, lengths, held=None):
        """PPO epochs over minibatches. ``old_logp`` (N,) the rollout policy's log-probs, or
        None where the update's forwards run the rollout's weights (``separate_old_forward``
        False): each micro-batch's own log-probs, detached, from its hidden states.
        ``held``: the update's forwards, already run (``_update_forwards``; one epoch, one
        minibatch): the loss runs on their hidden states, each graph freed after its
        backward."""
        cfg = self.cfg
        n = len(ro.responses)
        starts = torch.zeros(n + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(lengths, 0)
        weight_bias = lambda: lm_head(self.model)
        head_kw = logit_transform(self.model)  # the model's logit scale / softcap, if any
        stats = {"loss": [], "clip_fraction": [], "mean_ratio": [], "kl": [], "grad_norm": []}
        self.model.eval()  # no dropout: the loss must see the rollout policy's distribution
        if held is not None and (cfg.ppo_epochs > 1 or cfg.minibatches > 1):
            raise ValueError(
                "held: the update's forwards can be run first only for one epoch of one minibatch"
            )
        for _ in range(cfg.ppo_epochs):
            if held is None:
                perm = torch.randperm(n).tolist()
            else:
                perm = [r for rows, *_ in held for r in rows]
            per_mb = math.ceil(n / cfg.minibatches)
            for s in range(0, n, per_mb):
                mb = perm[s : s + per_mb]
                mb_tokens = int(lengths[mb].sum())
                self.opt.zero_grad(set_to_none=True)
                for j, m in enumerate(range(0, len(mb), cfg.micro_batch)):
                    rows = mb[m : m + cfg.micro_batch]
                    if held is not None:  # run before the replay; freed after its backward
                        _, idx, tb, hidden = held[j]
                        held[j] = None
                    else:
                        tb = teacher_batch(
                            [ro.prompt_ids[i] for i in rows],
                            [ro.responses[i] for i in rows],
                            self.tok.pad_token_id,
                            self.device,
                        )
                        idx = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in rows])
                        ckpt = gradient_checkpointing(self.model, cfg.gradient_checkpointing)
                        with self._amp(), ckpt:
                            hidden = response_hidden(self.model, tb)
                    w, b = weight_bias()
                    if old_logp is None:  # the same policy: ratio exactly 1
                        with torch.no_grad():
                            old_mb = linear_logprobs(
                                hidden.detach(),
                                w.detach(),
                                tb.labels,
                                bias=None if b is None else b.detach(),
                                temperature=cfg.temperature,
                                **head_kw,
                            ).float()
                    else:
                        old_mb = old_logp[idx].to(self.device)
                    loss, met = linear_policy_loss(
                        hidden,
                        w,
                        tb.labels,
                        old_mb,
                        adv[idx].to(self.device),
                        bias=b,
                        temperature=cfg.temperature,
                        clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high,
                        ref_logprobs=None if ref_logp is None else ref_logp[idx].to(self.device),
                        beta=cfg.kl_beta,
                        **head_kw,
                    )
                    share = idx.numel() / mb_tokens
                    (loss * share).backward()
                    stats["loss"].append(loss.item() * share)
                    stats["clip_fraction"].append((float(met["clip_fraction"]), idx.numel()))
                    stats["mean_ratio"].append((float(met["mean_ratio"]), idx.numel()))
                    if "kl" in met:
                        stats["kl"].append((float(met["kl"]), idx.numel()))
                gn = torch.nn.utils.clip_grad_norm_(
                    self.model.parameters(),
                    cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"),
                )
                stats["grad_norm"].append(float(gn))
                self.opt.step()
                self._check_finite_weights()
        self.opt.zero_grad(set_to_none=True)

        def wmean(pairs):
            tot = sum(c for _, c in pairs)
            return sum(v * c for v, c in pairs) / tot if tot else None

        n_mb = max(1, cfg.ppo_epochs * math.ceil(n / math.ceil(n / cfg.minibatches)))
        return {
            "loss": sum(stats["loss"]) / n_mb,
            "clip_fraction": wmean(stats["clip_fraction"]),
            "mean_ratio": wmean(stats["mean_ratio"]),
            "kl": wmean(stats["kl"]),
            "grad_norm": sum(stats["grad_norm"]) / len(stats["grad_norm"]),
        }

    def _check_finite_weights(self) -> None:
        """After each optimizer step: a NaN or inf weight stops the run, naming the step,
        before the weights are saved (no checkpoint of them is ever written) or sampled
        from. One reduction per trained tensor and a single host sync."""
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        if not named or bool(torch.stack([torch.isfinite(p).all() for _, p in named]).all()):
            return
        bad = [(n, int((~torch.isfinite(p)).sum()), p.numel()) for n, p in named]
        bad = [b for b in bad if b[1]]
        count = sum(b[1] for b in bad)
        total = sum(p.numel() for _, p in named)
        last = self.run_dir.committed_step()
        kept = (
            f"the last checkpoint (step {last}) in {self.ckpt_dir} is untouched"
            if last is not None
            else "no checkpoint was saved"
        )
        raise NonFiniteWeightsError(
            f"step {self.step + 1}: the optimizer update made {count} of {total} weights "
            f"non-finite (NaN or inf; {len(bad)} tensors, first {bad[0][0]}); the run stopped "
            f"without saving them: {kept} (lower --lr or --max-grad-norm)"
        )

    def _keep_samples(self, ro, relevance, alloc, lengths, have_relevance, has_info, replayed):
        starts = torch.zeros(len(lengths) + 1, dtype=torch.long)
        starts[1:] = torch.cumsum(lengths, 0)
        picks = list(range(0, len(ro.responses), self.cfg.group_size))
        picks += [i for i in range(len(ro.responses)) if i not in picks]
        status = pair_status(ro.rewards, ro.group_ids, has_info, replayed)
        samples = []
        for i in picks[: self.cfg.html_samples]:
            a, b = int(starts[i]), int(starts[i + 1])
            pieces = [ro.texts[i][s:e] for s, e in ro.offsets[i]]
            samples.append(
                {
                    "step": self.step,
                    "prompt": ro.examples[i].prompt,
                    "response": ro.texts[i],
                    "tokens": pieces,
                    "scores": ro.rewards[i].tolist(),
                    "reasons": ro.reasons[i],
                    "spans": [list(map(list, s)) for s in ro.spans[i]],
                    "allocation": alloc[:, a:b].tolist(),
                    "relevance": relevance[:, a:b].tolist() if have_relevance else None,
                    "replay": status[i],  # "replayed" or why not (report.NOT_REPLAYED)
                }
            )
        self.samples = samples

    def evaluate(self) -> dict:
        """The held-out evaluation of the current policy (`mrtpo.training.heldout`)."""
        return evaluate_heldout(
            self.model,
            self.prompter,
            self.task,
            self.cfg,
            self.device,
            step=self.step,
            amp=self._amp(),
        )

    def _match_eval_schedule(self) -> None:
        """A resumed run's evaluations on the schedule of the run it now is, not of its
        parts (`mrtpo.training.heldout.match_schedule`): the one a shorter run made at its last step
        and this run has not is removed; one due at the step resumed at and missing is made
        now (the loaded policy is that step's and an evaluation samples in a random state of
        its own: the same evaluation as in one go). metrics.jsonl is rewritten atomically."""
        cfg = self.cfg
        removed, missing = match_schedule(self.metrics, cfg.eval_every, cfg.steps)
        for step in removed:
            self.log(
                f"resume: removed the held-out evaluation of step {step} from metrics.jsonl "
                f"(a {cfg.steps}-step run evaluates every {cfg.eval_every} steps and at its last)"
            )
        if missing:
            self.metrics[-1]["eval"] = [*(self.metrics[-1].get("eval") or ()), self.evaluate()]
            self.log(f"resume: evaluated the policy of step {self.step} (due, and missing)")
        if removed or missing:
            self.run_dir.rewrite_metrics(self.metrics)

    # -- the loop -----------------------------------------------------------------------------
    def run(self, *, progress: bool = True) -> TrainResult:
        try:
            return self._run(progress=progress)
        finally:
            self.run_dir.unlock()

    def _run(self, *, progress: bool = True) -> TrainResult:
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not progress,
            desc=cfg.algo,
            dynamic_ncols=True,
        )
        pending = []  # the evaluation before the first step rides in step 1's row
        if self.step == 0 and eval_due(0, cfg.eval_every, cfg.steps):
            pending.append(self.evaluate())
        elif self.step > 0:
            self._match_eval_schedule()
        try:
            while self.step < cfg.steps:
                row = self.train_step()
                if eval_due(self.step, cfg.eval_every, cfg.steps):
                    pending.append(self.evaluate())
                if pending:
                    row["eval"], pending = pending, []
                self.metrics.append(row)
                self.run_dir.append_metrics(row)
                bar.update(1)
                bar.set_postfix(all_pass=f"{row['all_pass']:.2f}", loss=f"{row['loss']:.3f}")
                if progress:
                    bar.write(format_step(row, self.reward_names, cfg.steps))
                    for ev in row.get("eval") or ():
                        bar.write(format_eval(ev, self.reward_names))
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self.save_checkpoint()
        finally:
            bar.close()
            self.run_dir.close()
        curves = plot_curves(
            self.metrics,
            self.reward_names,
            self.out / "curves.png",
            title=f"{self.task.name} / {cfg.algo} / seed {cfg.seed}",
        )
        html = write_tokens_html(
            self.samples,
            self.reward_names,
            self.out / "tokens.html",
            algo=cfg.algo,
            title=f"{self.task.name} / {cfg.algo}",
        )
        return TrainResult(
            self.out, self.metrics, self.run_dir.metrics_path, curves, html, self.ckpt_dir
        )


def train(cfg: TrainConfig, *, task=None, progress: bool = True, log=None) -> TrainResult:
    """Run (or resume) a training run; writes metrics.jsonl, curves.png, tokens.html and a
    checkpoint under ``cfg.out``."""
    return Trainer(cfg, task=task, log=log).run(progress=progress)
