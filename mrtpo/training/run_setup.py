"""A training run's setup, resume and checkpoint glue (`mrtpo.training.trainer.Trainer`): the seeds
and the device, the initial model (a model folder, a built-in model converted once, or the
task's tiny default), the refusal to resume a run of other trajectory-changing settings, the
checkpoint's save and load through ``mrtpo.training.checkpoint.RunDir``, and the run's result."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mrtpo.model.builtin import is_builtin
from mrtpo.model.folder import check_model_folder
from mrtpo.model.initial import initial_folder
from mrtpo.model.loading import default_model, load_model, save_model
from mrtpo.model.pretrained import stored_dtype

from .checkpoint import RunDir, rng_state, set_rng_state
from .config import TrainConfig


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


@dataclass
class TrainResult:
    out: Path
    metrics: list[dict]
    metrics_path: Path
    curves_path: Path
    html_path: Path
    checkpoint: Path


def refuse_other_config(saved: dict, cfg: TrainConfig, where: Path) -> None:
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


def initial_model(cfg: TrainConfig, task, device: torch.device, dtype: torch.dtype, log):
    """The run's initial policy and tokenizer on ``device`` in ``dtype``, and the folder it
    comes from: ``cfg.model`` (a built-in model converted once, warm-started where
    --warm-steps asks), or the task's tiny default model, built once in ``cfg.cache_dir``."""
    if cfg.model is not None:
        init_path = Path(cfg.model)
        if is_builtin(cfg.model):  # converted once; warm-started where --warm-steps asks
            init_path = initial_folder(
                cfg.model,
                task,
                seed=cfg.seed if cfg.init_seed is None else cfg.init_seed,
                cache_dir=cfg.cache_dir,
                warm_steps=cfg.tiny.warm_steps,
                warm_noise=cfg.tiny.warm_noise,
                dtype=stored_dtype(dtype),
                log=log,
            )
        model, tok = load_model(init_path, dtype=dtype, device=device)
    else:
        init_seed = cfg.seed if cfg.init_seed is None else cfg.init_seed
        model, tok = default_model(
            task, seed=init_seed, cache_dir=cfg.cache_dir, cfg=cfg.tiny, log=log
        )
        key = cfg.tiny.for_task(task.name).key()
        init_path = Path(cfg.cache_dir) / f"{task.name}-seed{init_seed}-{key}"
        model = model.to(device=device, dtype=dtype)
    return model, tok, init_path


def save_run_checkpoint(
    run_dir: RunDir, *, step: int, model, tok, opt, sampler, samples, cfg: TrainConfig
) -> None:
    """Commit the checkpoint of ``step``: the model folder, the optimizer, the random
    states, the prompt sampler and the kept tokens.html samples, with the run's config."""
    run_dir.save(
        step=step,
        save_model=lambda path: save_model(model, tok, path),
        state={
            "step": step,
            "optimizer": opt.state_dict(),
            "rng": rng_state(),
            "sampler": sampler.state(),
            "samples": samples,
        },
        config=cfg.to_dict(),
    )


def load_run_checkpoint(
    run_dir: RunDir, meta: dict, model, opt, sampler, *, dtype, device, log
) -> tuple[int, list[dict]]:
    """Load the committed checkpoint (``meta`` its meta) into ``model``, ``opt``,
    ``sampler`` and the random states; its step and kept samples. A checkpoint whose model
    folder is broken is refused, naming the step."""
    ckpt_dir = run_dir.checkpoint
    problem = check_model_folder(ckpt_dir / "model")
    if problem:
        raise ValueError(f"checkpoint: {problem} (the checkpoint of step {meta['step']})")
    state = run_dir.load_state()
    loaded, _ = load_model(ckpt_dir / "model", dtype=dtype, device=device, what="checkpoint")
    model.load_state_dict(loaded.state_dict())
    opt.load_state_dict(state["optimizer"])
    sampler.load(state["sampler"])
    set_rng_state(state["rng"])
    step = int(meta["step"])
    samples = state.get("samples", [])
    log(f"resumed from {ckpt_dir} at step {step}")
    return step, samples
