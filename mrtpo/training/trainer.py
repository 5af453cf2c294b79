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
   update's own too, from its forwards run before the replay, ``replay_from_update``,
   which also give the prompts' key/value caches the replay's units start from); the
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

This module holds the run (``Trainer``, ``train``): its setup, the step above and the loop.
The parts it calls live by concern: ``mrtpo.training.step_advantages`` (4: the advantages and the
oracle relevance), ``mrtpo.training.policy_update`` (5: the update, its forwards and the
finite-weights check) and ``mrtpo.training.run_setup`` (seeds, device, the initial model, resume and
checkpoint glue); their names stay importable from here.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
from pathlib import Path

import torch

from mrtpo.allocation.tensors import stop_token_at_mean  # noqa: F401 - its import path before
from mrtpo.model.loading import lm_head, logit_transform
from mrtpo.replay.api import ReplayResult, contrastive_replay, replay_mask_from_rewards
from mrtpo.replay.prompting import ChatPrompter
from mrtpo.replay.relevance_modes import step_mode
from mrtpo.replay.teacher_forcing import forward_responses
from mrtpo.tasks.builtin import load_task
from mrtpo_kernels import linear_logprobs

from .checkpoint import RunDir, write_atomic
from .config import TrainConfig
from .heldout import check_eval_split, eval_due, evaluate_heldout, match_schedule
from .metrics import format_eval, format_step, step_metrics
from .policy_update import (
    NonFiniteWeightsError,  # noqa: F401 - importable from here as before the split
    check_finite_weights,
    ppo_update,
    separate_old_forward,
    update_forwards,
)
from .report import pair_status, plot_curves, write_tokens_html
from .rollouts import PromptSampler, generate_rollouts
from .run_setup import (
    TrainResult,
    initial_model,
    load_run_checkpoint,
    refuse_other_config,
    resolve_device,
    save_run_checkpoint,
    seed_everything,
)
from .step_advantages import compute_advantages, oracle_relevance


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
        model, tok, self.init_path = initial_model(cfg, task, self.device, dtype, self.log)
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
            check_config=lambda saved: refuse_other_config(saved, cfg, self.out),
            log=self.log,
        )

    def save_checkpoint(self):
        save_run_checkpoint(
            self.run_dir,
            step=self.step,
            model=self.model,
            tok=self.tok,
            opt=self.opt,
            sampler=self.sampler,
            samples=self.samples,
            cfg=self.cfg,
        )

    def _load_checkpoint(self, meta: dict):
        self.step, self.samples = load_run_checkpoint(
            self.run_dir,
            meta,
            self.model,
            self.opt,
            self.sampler,
            dtype=getattr(torch, self.cfg.dtype),
            device=self.device,
            log=self.log,
        )

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
        held, hp_update, caches, t_held = None, None, None, 0.0
        from_update = self.replay_from_update
        if from_update == "auto":
            from_update = len(ro.responses) <= cfg.micro_batch
        # one autocast region over the update's forwards and the replay: the replay's forwards
        # reuse the low-precision weight copies autocast cast for the update's (the weights
        # do not change before the optimizer step), one cast of the weights fewer a step
        with self._amp():
            if cfg.algo == "mrtpo" and want_replay and own_old and from_update:
                held, hp_update, caches = self._update_forwards(ro)
                t_held = time.perf_counter() - t1
            if want_replay or not own_old:
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
                    prompt_caches=caches,  # the prompts' caches from the same forwards
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

    # -- the update (`mrtpo.training.policy_update`) -----------------------------------------------
    def _update_forwards(self, ro):
        """The update's forwards, run before the replay (``update_forwards``)."""
        return update_forwards(
            self.model, self.tok.pad_token_id, ro, self.cfg, self.device, self._amp
        )

    def _update(self, ro, old_logp, adv, ref_logp, lengths, held=None):
        """PPO epochs over minibatches (``ppo_update``), each optimizer step followed by the
        finite-weights check; the update's metrics."""
        return ppo_update(
            self.model,
            self.opt,
            self.tok.pad_token_id,
            ro,
            old_logp,
            adv,
            ref_logp,
            lengths,
            self.cfg,
            self.device,
            amp=self._amp,
            after_step=self._check_finite_weights,
            held=held,
        )

    def _check_finite_weights(self) -> None:
        check_finite_weights(self.model, self.step, self.run_dir)

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
