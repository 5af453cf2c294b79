"""The policy update of a training step (`mrtpo.training.trainer.Trainer`): PPO epochs over
minibatches of responses, micro-batches accumulated, loss = ``linear_policy_loss`` on the
policy's hidden states and LM head (optional k3 KL to the initial model), gradient-norm
clipping, AdamW, and the check that no update made a weight non-finite. Also which forward
gives the rollout policy's log-probs (``separate_old_forward``), and the update's forwards run
before the replay (``update_forwards``; MRTPO on-policy)."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager

import numpy as np
import torch

from mrtpo.model.loading import gradient_checkpointing, lm_head, logit_transform
from mrtpo.replay.teacher_forcing import response_hidden, teacher_batch
from mrtpo_kernels import linear_logprobs, linear_policy_loss

from .checkpoint import RunDir
from .config import TrainConfig


class NonFiniteWeightsError(RuntimeError):
    """An update made weights NaN or inf: the run stops before they are saved or used."""


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


def _micro_forward(
    model, pad_token_id, ro, rows, starts, cfg: TrainConfig, device, amp, prefixes=None
):
    """One micro-batch's forward with its graph: (teacher batch, the rows' token indices in
    the packed (N,) response order given by ``starts``, response hidden states).
    ``prefixes``: a dict to fill with the rows' prompts' key/value caches from this forward
    (``response_hidden``), where gradient checkpointing is off (a checkpointed layer runs
    again in the backward, and would fill a cache a second time)."""
    prompts = [ro.prompt_ids[i] for i in rows]
    tb = teacher_batch(prompts, [ro.responses[i] for i in rows], pad_token_id, device)
    idx = torch.cat([torch.arange(int(starts[i]), int(starts[i + 1])) for i in rows])
    ckpt = gradient_checkpointing(model, cfg.gradient_checkpointing)
    if cfg.gradient_checkpointing:
        prefixes = None
    with amp(), ckpt:
        hidden = response_hidden(model, tb, prompts=prompts, prefixes=prefixes)
    return tb, idx, hidden


def update_forwards(model, pad_token_id, ro, cfg: TrainConfig, device, amp):
    """The update's forwards, run before the replay (MRTPO on-policy: one epoch, one
    minibatch): its micro-batches in the order ``ppo_update`` takes them (the epoch's
    permutation drawn here, as ``ppo_update`` would draw it), each (rows, token indices,
    batch, hidden states with their graph), the (N, d) with-information hidden
    states, detached, packed in response order, for the replay's JS, and the prompts'
    key/value caches from the same forwards (detached; empty with gradient checkpointing),
    which the replay's units start from. The graphs of
    every micro-batch are held until ``ppo_update`` runs the loss on them: the update's
    activation memory for the whole batch at once (with ``gradient_checkpointing``, one
    (tokens, d) input per layer) instead of one micro-batch's. ``amp``: a fresh autocast
    context for each forward (``Trainer._amp``)."""
    n = len(ro.responses)
    lengths = [len(r) for r in ro.responses]
    starts = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    perm = torch.randperm(n).tolist()
    model.eval()
    held, hp, prefixes = [], None, {}
    for m in range(0, n, cfg.micro_batch):
        rows = perm[m : m + cfg.micro_batch]
        tb, idx, hidden = _micro_forward(
            model, pad_token_id, ro, rows, starts, cfg, device, amp, prefixes=prefixes
        )
        if hp is None:
            hp = hidden.new_empty((starts[-1], hidden.shape[-1]))
        hp[idx.to(hp.device)] = hidden.detach()
        held.append((rows, idx, tb, hidden))
    return held, hp, prefixes


def ppo_update(
    model,
    opt: torch.optim.Optimizer,
    pad_token_id,
    ro,
    old_logp,
    adv,
    ref_logp,
    lengths,
    cfg: TrainConfig,
    device,
    amp: Callable[[], AbstractContextManager],
    after_step: Callable[[], None],
    held=None,
) -> dict:
    """PPO epochs over minibatches; the update's metrics. ``old_logp`` (N,) the rollout
    policy's log-probs, or None where the update's forwards run the rollout's weights
    (``separate_old_forward`` False): each micro-batch's own log-probs, detached, from its
    hidden states. ``held``: the update's forwards, already run (``update_forwards``; one
    epoch, one minibatch): the loss runs on their hidden states, each graph freed after its
    backward. ``amp``: a fresh autocast context for each forward; ``after_step``: called
    after each optimizer step (the trainer's finite-weights check)."""
    n = len(ro.responses)
    starts = torch.zeros(n + 1, dtype=torch.long)
    starts[1:] = torch.cumsum(lengths, 0)
    weight_bias = lambda: lm_head(model)
    head_kw = logit_transform(model)  # the model's logit scale / softcap, if any
    stats = {"loss": [], "clip_fraction": [], "mean_ratio": [], "kl": [], "grad_norm": []}
    model.eval()  # no dropout: the loss must see the rollout policy's distribution
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
            opt.zero_grad(set_to_none=True)
            for j, m in enumerate(range(0, len(mb), cfg.micro_batch)):
                rows = mb[m : m + cfg.micro_batch]
                if held is not None:  # run before the replay; freed after its backward
                    _, idx, tb, hidden = held[j]
                    held[j] = None
                else:
                    tb, idx, hidden = _micro_forward(
                        model, pad_token_id, ro, rows, starts, cfg, device, amp
                    )
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
                    old_mb = old_logp[idx].to(device)
                loss, met = linear_policy_loss(
                    hidden,
                    w,
                    tb.labels,
                    old_mb,
                    adv[idx].to(device),
                    bias=b,
                    temperature=cfg.temperature,
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    ref_logprobs=None if ref_logp is None else ref_logp[idx].to(device),
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
                model.parameters(),
                cfg.max_grad_norm if cfg.max_grad_norm > 0 else float("inf"),
            )
            stats["grad_norm"].append(float(gn))
            opt.step()
            after_step()
    opt.zero_grad(set_to_none=True)

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


def check_finite_weights(model, step: int, run_dir: RunDir) -> None:
    """After each optimizer step of the update that makes step ``step + 1``: a NaN or inf
    weight stops the run, naming the step, before the weights are saved (no checkpoint of
    them is ever written) or sampled from. One reduction per trained tensor and a single
    host sync."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named or bool(torch.stack([torch.isfinite(p).all() for _, p in named]).all()):
        return
    bad = [(n, int((~torch.isfinite(p)).sum()), p.numel()) for n, p in named]
    bad = [b for b in bad if b[1]]
    count = sum(b[1] for b in bad)
    total = sum(p.numel() for _, p in named)
    last = run_dir.committed_step()
    kept = (
        f"the last checkpoint (step {last}) in {run_dir.checkpoint} is untouched"
        if last is not None
        else "no checkpoint was saved"
    )
    raise NonFiniteWeightsError(
        f"step {step + 1}: the optimizer update made {count} of {total} weights "
        f"non-finite (NaN or inf; {len(bad)} tensors, first {bad[0][0]}); the run stopped "
        f"without saving them: {kept} (lower --lr or --max-grad-norm)"
    )
