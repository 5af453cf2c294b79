"""The folder a run of a built-in pretrained model starts from: the converted model itself
(``mrtpo.model.pretrained``), or that model after an optional supervised warm start on the task's
references, cached under the cache directory keyed by everything that shapes it.

A pretrained model is warm-started only when asked (``--warm-steps N``; default 0): a few
dozen steps on the task's (optionally noisy, ``--warm-noise``) references calibrate the
rewards' starting pass rates. Learning rate and batch suit a 135M-parameter model; they are
part of the cache key and of the folder's warm_start.json.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import replace
from pathlib import Path

import torch

from mrtpo.replay.prompting import ChatPrompter
from mrtpo.tasks.data import noisy_reference

from .folder import build_once, save_model
from .loading import load_model
from .pretrained import CONVERSION_VERSION, builtin_folder
from .warm_start import WARM_MARKER, same_training, train_digest, warm_start

PRETRAINED_WARM_LR = 5e-5
PRETRAINED_WARM_BATCH = 8
# Forwards of at most this many examples per warm-start step, by task (gradients
# accumulated: the same step): ifbench-real's prompts are about four times longer than the
# constraints tasks', and a whole batch's activations did not fit beside other jobs.
PRETRAINED_WARM_MICRO = {"ifbench-real": 2}


def warm_settings(task_name: str, seed: int, steps: int, noise: float, dtype: str) -> dict:
    """Everything that shapes a warm-started folder: its cache key and its record."""
    out = {
        "task": task_name,
        "seed": seed,
        "steps": steps,
        "noise": noise,
        "lr": PRETRAINED_WARM_LR,
        "batch": PRETRAINED_WARM_BATCH,
        "dtype": dtype,
        "autocast": "forward",
    }
    if task_name in PRETRAINED_WARM_MICRO:  # only there: the other tasks' keys stay as they were
        out["micro_batch"] = PRETRAINED_WARM_MICRO[task_name]
    return out


def warm_key(settings: dict) -> str:
    blob = json.dumps({**settings, "version": CONVERSION_VERSION}, sort_keys=True).encode()
    return hashlib.sha1(blob).hexdigest()[:10]


def initial_folder(
    name: str,
    task,
    *,
    seed: int,
    cache_dir: str | Path,
    warm_steps: int | None,
    warm_noise: float = 0.0,
    dtype: str = "float32",
    log=None,
) -> Path:
    """The folder a run of built-in ``name`` starts from: the converted model itself, or,
    with ``warm_steps`` > 0, that model after a supervised warm start on ``task``'s
    references (noisy with probability ``warm_noise`` per swappable constraint, seeded by
    ``seed``), cached under ``cache_dir`` keyed by everything that shapes it."""
    if not warm_steps:
        return builtin_folder(name, cache_dir, dtype=dtype, log=log)
    base = builtin_folder(name, cache_dir, dtype="float32", log=log)
    settings = warm_settings(task.name, seed, warm_steps, warm_noise, dtype)
    key = warm_key(settings)
    folder = Path(cache_dir) / f"{name}-{task.name.replace(':', '_')}-seed{seed}-{key}"
    # built once under a lock and published whole (two processes that want the same folder
    # build it once); a broken one, or one warm-started on another training set, again
    return build_once(
        folder,
        WARM_MARKER,
        lambda: _warm_start(base, name, task, settings, log=log),
        accept=same_training(task),
        log=log,
    )


def _warm_start(base: Path, name: str, task, settings: dict, *, log):
    """The converted model at ``base`` warm-started on ``task``'s references as ``settings``
    say: ``(save, info)`` for ``publish_folder``."""
    seed, noise, dtype = settings["seed"], settings["noise"], settings["dtype"]
    # float32 weights (bfloat16 ones would round small updates away), bf16 autocast forwards
    # (the backward and optimizer step outside autocast)
    model, tok = load_model(base, dtype=torch.float32)
    examples = list(task.train)
    if noise > 0:
        rng = random.Random(seed + 7919)
        examples = [replace(ex, reference=noisy_reference(rng, ex, noise)) for ex in examples]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        loss = warm_start(
            model,
            ChatPrompter(tok),
            examples,
            steps=settings["steps"],
            batch=PRETRAINED_WARM_BATCH,
            lr=PRETRAINED_WARM_LR,
            seed=seed,
            log=log,
            autocast=torch.bfloat16,
            micro_batch=settings.get("micro_batch"),
        )
    info = {"model": name, **settings, "final_loss": loss, "train_digest": train_digest(task)}
    return (lambda tmp: save_model(model.to(getattr(torch, dtype)), tok, tmp)), info
