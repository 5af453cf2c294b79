"""The supervised warm start: a short cross-entropy pass on a task's gold references (so that
reinforcement learning starts with some signal), and what a warm-started folder records of
it (`WARM_MARKER`, the training set's digest, `same_training`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import random

import torch

from mrtpo.replay.prompting import ChatPrompter
from mrtpo_kernels import linear_logprobs

from .access import last_hidden, lm_head, logit_transform


def _reference_of(example) -> str:
    ref = getattr(example, "reference", None)
    if ref is None:
        raise ValueError(f"task: example {example.id!r} has no gold reference to warm-start on")
    return ref


def supervised_batch(prompter: ChatPrompter, examples, *, device="cpu"):
    """Right-padded (prompt + reference + EOS) ids, mask and labels (-100 off the response)."""
    tok = prompter.tokenizer
    rows, labels = [], []
    for ex in examples:
        p = prompter.encode(ex.prompt).ids
        r = tok(_reference_of(ex), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(p + r)
        labels.append([-100] * len(p) + r)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    lab = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (row, lr) in enumerate(zip(rows, labels)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        lab[i, : len(row)] = torch.tensor(lr)
    # hidden at position t predicts token t + 1
    return ids.to(device), mask.to(device), lab[:, 1:].to(device)


def warm_start(
    model,
    prompter: ChatPrompter,
    examples,
    *,
    steps,
    batch,
    lr,
    seed=0,
    log=None,
    autocast=None,
    micro_batch=None,
):
    """A short supervised pass (cross-entropy on the gold responses) with AdamW and a
    cosine schedule. ``autocast`` (a dtype, e.g. torch.bfloat16): the decoder's forwards run
    under torch.autocast; the loss, backward and optimizer step stay outside it (whole
    steps inside a CPU bf16 autocast region wrecked a 135M model within a dozen steps
    although its gradients matched float32's). ``micro_batch``: forwards of at most this
    many examples, their gradients accumulated into the same step (the same mean loss over
    the batch's response tokens; less activation memory for long prompts); None: one
    forward per batch. With ``micro_batch``, AdamW also runs one parameter at a time.
    Returns the mean loss of the last 10 steps."""
    if not examples:
        raise ValueError("examples: the task has no training examples")
    if micro_batch is not None and (not isinstance(micro_batch, int) or micro_batch < 1):
        raise ValueError(f"micro_batch: expected an int >= 1 or None, got {micro_batch!r}")
    rng = random.Random(seed)
    # the micro-batched (low-memory) path also updates one parameter at a time: the
    # multi-tensor AdamW holds temporaries the size of all the weights
    foreach = None if micro_batch is None else False
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=foreach)
    weight_fn = lambda: lm_head(model)
    head_kw = logit_transform(model)  # the model's logit scale / softcap, if any
    model.train()
    losses = []
    order: list[int] = []
    device = next(model.parameters()).device
    chunk = batch if micro_batch is None else micro_batch
    for step in range(steps):
        if len(order) < batch:
            perm = list(range(len(examples)))
            rng.shuffle(perm)
            order.extend(perm)
        idx, order = order[:batch], order[batch:]
        chosen = [examples[i] for i in idx]
        parts = [
            supervised_batch(prompter, chosen[j : j + chunk], device=device)
            for j in range(0, len(chosen), chunk)
        ]
        n_kept = sum(int((lab != -100).sum()) for _, _, lab in parts)
        for g in opt.param_groups:
            g["lr"] = lr * 0.5 * (1.0 + math.cos(math.pi * step / max(steps, 1)))
        opt.zero_grad(set_to_none=True)
        loss_value = 0.0
        for ids, mask, labels in parts:
            amp = contextlib.nullcontext()
            if autocast is not None:
                amp = torch.autocast(ids.device.type, dtype=autocast)
            with amp:
                h = last_hidden(model, ids, mask)[:, :-1]
            w, b = weight_fn()
            keep = labels != -100
            logp = linear_logprobs(h[keep], w, labels[keep], bias=b, **head_kw)
            # one forward: the batch's mean, as before; several: each part's share of it
            loss = -logp.mean() if len(parts) == 1 else -logp.sum() / n_kept
            loss.backward()
            loss_value += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss_value)
        if log is not None and (step % 25 == 0 or step == steps - 1):
            log(f"warm start {step + 1}/{steps}: loss {losses[-1]:.3f}")
    model.eval()
    tail = losses[-10:]
    return sum(tail) / max(len(tail), 1)


# The marker of a warm-started folder (tiny or built-in model): its settings and final loss.
WARM_MARKER = "warm_start.json"
# Tasks whose training set changed since warm starts recorded the digest of theirs: a warm
# start cached before is not trusted for these (the tools split, issue 41), for the others it is.
_RESPLIT = frozenset({"tools"})


def train_digest(task) -> str:
    """A digest of ``task``'s training examples (ids, prompts, references): what a warm
    start was trained on, recorded in its marker."""
    blob = json.dumps([[ex.id, ex.prompt, ex.reference] for ex in task.train]).encode()
    return hashlib.sha1(blob).hexdigest()[:16]


def same_training(task):
    """``accept`` for ``build_once``: refuses a warm start recorded as trained on another
    training set than ``task``'s (its data or split changed since)."""
    digest = train_digest(task)

    def accept(info: dict) -> str | None:
        have = info.get("train_digest")
        if have is None and task.name not in _RESPLIT:
            return None  # cached before digests were recorded: trusted
        if have != digest:
            return f"it was warm-started on another training set of {task.name!r}"
        return None

    return accept
