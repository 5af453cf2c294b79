"""Every setting of a training run and of a comparison, in one place.

Each field of `TrainConfig`, `TinyConfig` and `CompareConfig` carries its help text, its
choices or range and its command-line group in its metadata (`setting`, in
`mrtpo.training.config_fields` with the value checks; MRTPO's own options are described in
`mrtpo.training.method_options`, shared with the framework adapters' configs). The same metadata
checks a config built in code (`TrainConfig.validate`, a `ValueError` naming the field) and,
through `mrtpo.training.cli_args` (which builds the ``mrtpo`` flags from it), values typed on the
command line. Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from mrtpo.allocation import CREDIT_MODES, RELEVANCES  # noqa: F401 - re-exported
from mrtpo.model.builtin import (
    CACHE_ENV,
    from_cache_env,
    is_builtin,
    model_defaults,
    user_cache_dir,
)
from mrtpo.model.folder import check_model_folder

from .config_fields import (  # noqa: F401 - re-exported: the names' import path before
    BATCH_NORMS,
    DTYPES,
    INT64_MAX,
    MAX_TEMPERATURE,
    MIN_TEMPERATURE,
    TASK_HELP,
    TASKS,
    _check_writable_dir,
    check_device,
    check_dtype,
    check_task,
    check_temperature,
    check_threads,
    check_value,
    model_default_note,
    setting,
    shown_int,
    usable_cpus,
    value_kind,
)
from .method_options import (  # noqa: F401 - re-exported: the names' import path before
    ALGOS,
    VARIANT_KEYS,
    check_algos,
    method_setting,
    parse_variant,
    task_slug,
    variant_slug,
)

# --------------------------------------------------------------------------------------------
# The settings


@dataclass(frozen=True)
class TinyConfig:
    """Shape of the built-in model and its warm start."""

    vocab_size: int = setting(768, "vocabulary size of the built-in tokenizer", lo=261)
    hidden_size: int = setting(96, "hidden size", lo=1)
    intermediate_size: int = setting(256, "MLP size", lo=1)
    num_layers: int = setting(3, "decoder layers", lo=1)
    num_heads: int = setting(4, "attention heads", lo=1)
    num_kv_heads: int = setting(2, "key/value heads", lo=1)
    max_positions: int = setting(1024, "longest sequence", lo=1)
    warm_steps: int | None = setting(
        None,
        "supervised warm-start steps of the built-in model (default: the task's, "
        "mrtpo.tasks.builtin.WARM_STEPS)",
        kind="int",
        lo=0,
    )
    warm_noise: float = setting(
        0.0,
        "share of warm-start references whose start phrase, keyword or end phrase is "
        "swapped for a wrong one, each independently (ifbench-real: each of its four "
        "constraints broken; calibrates the starting pass rates; "
        "mrtpo.tasks.data.noisy_reference)",
        lo=0.0,
        hi=1.0,
    )
    warm_batch: int = setting(16, "warm-start batch", lo=1)
    warm_lr: float = setting(3e-3, "warm-start learning rate", lo=0.0, open_lo=True)

    def for_task(self, task: str) -> TinyConfig:
        """This config with ``warm_steps`` resolved to ``task``'s default when unset."""
        if self.warm_steps is not None:
            return self
        from mrtpo.tasks.builtin import default_warm_steps

        return replace(self, warm_steps=default_warm_steps(task))

    def key(self) -> str:
        if self.warm_steps is None:
            raise ValueError("warm_steps: resolve it with for_task(task) before keying")
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha1(blob).hexdigest()[:10]


def _pos(default, help, **kw):
    return setting(default, help, lo=1, **kw)


@dataclass
class TrainConfig:
    """Every knob of a training run; the ``mrtpo train`` flags are built from it."""

    task: str = setting("constraints", TASK_HELP, check=check_task)
    algo: str = setting(
        "mrtpo",
        "advantage estimator: grpo (summed reward), gdpo (per-reward normalization), mrtpo "
        "(GDPO reallocated to tokens by contrastive replay)",
        choices=ALGOS,
    )
    seed: int = setting(
        0,
        "seed of sampling and data order and, unless --init-seed is given, of the task's "
        "examples and the built-in model",
        lo=0,
    )
    init_seed: int | None = setting(
        None,
        "seed of the task's examples and of the built-in model's init and warm start "
        "(default: --seed)",
        kind="int",
        lo=0,
    )
    steps: int = _pos(30, "training steps", resume_may_change=True)
    out: str = setting(
        "runs/train",
        "output folder for metrics.jsonl, curves.png, tokens.html and the checkpoint",
        kind="path",
        resume_may_change=True,
    )
    resume: bool = setting(
        False,
        "continue the run in --out from its checkpoint (same metrics as an uninterrupted run)",
        resume_may_change=True,
    )
    overwrite: bool = setting(
        False,
        "replace a run already in --out (without it, such a run is refused)",
        resume_may_change=True,
    )
    model: str | None = setting(
        None,
        "a local Hugging Face causal LM folder, or a built-in pretrained model's name "
        "(smollm2-135m-instruct: converted once from the [real] extra's GGUF, cached under "
        "--cache-dir; no download; a built-in model also sets the training flags its "
        "recorded runs used wherever they are not given, shown in their help) (default: the "
        "built-in tiny model, warm-started and cached under --cache-dir)",
        kind="path",
        metavar="PATH|NAME",
    )
    prompts_per_step: int = _pos(8, "prompts per step, B", group="rollouts")
    group_size: int = setting(8, "sampled responses per prompt, G", lo=2, group="rollouts")
    max_new_tokens: int = _pos(32, "response length cap in tokens", group="rollouts")
    temperature: float = setting(
        1.0,
        "sampling temperature, also used for log-probs and relevance; in [2^-126, 2^126] "
        "(logits are divided by it in float32)",
        check=check_temperature,
        group="rollouts",
    )
    top_k: int = setting(0, "top-k sampling, 0 = off", lo=0, group="rollouts")
    top_p: float = setting(
        1.0, "nucleus sampling, 1.0 = off", lo=0.0, hi=1.0, open_lo=True, group="rollouts"
    )
    lr: float = setting(
        2e-4, "AdamW learning rate", lo=0.0, hi=1.0, open_lo=True, group="optimization"
    )
    weight_decay: float = setting(
        0.0,
        "AdamW (decoupled) weight decay; lr x weight decay must stay below 1",
        lo=0.0,
        group="optimization",
    )
    ppo_epochs: int = _pos(1, "passes over each step's responses", group="optimization")
    minibatches: int = _pos(1, "optimizer steps per PPO epoch", group="optimization")
    micro_batch: int = _pos(
        16,
        "responses per forward; gradients accumulate over a minibatch",
        group="optimization",
    )
    clip_low: float = setting(
        0.2, "ratio clipped below at 1 - clip_low", lo=0.0, hi=1.0, group="optimization"
    )
    clip_high: float = setting(
        0.2, "ratio clipped above at 1 + clip_high", lo=0.0, group="optimization"
    )
    max_grad_norm: float = setting(1.0, "gradient-norm clip, 0 = off", lo=0.0, group="optimization")
    freeze_embeddings: bool = setting(
        False,
        "keep the token embeddings (and a tied LM head) fixed: the LM head gives every "
        "vocabulary row a gradient, however small, and Adam's normalized step moves each row "
        "by up to about the learning rate per step; fixing them limits the drift of a "
        "pretrained model's vocabulary and skips the head's weight gradient",
        group="optimization",
    )
    gradient_checkpointing: bool = setting(
        False,
        "recompute each decoder layer's activations in the backward instead of keeping them "
        "(about one more forward of compute): the update's activation memory falls from "
        "every layer's intermediates to one (tokens, hidden) tensor per layer, what long "
        "responses need; the gradients are the same",
        resume_may_change=True,
        group="optimization",
    )
    kl_beta: float = setting(
        0.0, "weight of the k3 KL to the initial model, 0 = off", lo=0.0, group="optimization"
    )
    alpha: float = method_setting("alpha", group="MRTPO")
    gamma: float = method_setting("gamma", group="MRTPO")
    relevance: str = method_setting("relevance", group="MRTPO")
    truncated_credit: str = method_setting("truncated_credit", group="MRTPO")
    stop_credit: str = method_setting("stop_credit", group="MRTPO")
    batch_norm: str = setting(
        "sequence",
        "batch statistics over responses or over tokens",
        choices=BATCH_NORMS,
        group="MRTPO",
    )
    replay_all: bool = method_setting("replay_all", group="MRTPO")
    replay_for_baselines: bool = setting(
        True,
        "skip contrastive replay under grpo/gdpo (it only feeds the relevance metrics there)",
        flag="--no-baseline-replay",
        group="MRTPO",
    )
    eval_every: int = setting(
        10,
        "steps between held-out evaluations (also before the first step and after the last); "
        "0 = none. The evaluation samples --eval-samples answers to each of the first "
        "--eval-prompts prompts of the task's eval split with a fixed seed, in a random state "
        "of its own (the training run is the same with or without it)",
        lo=0,
        group="eval",
    )
    eval_prompts: int = _pos(
        32, "held-out prompts per evaluation (the first N of the eval split)", group="eval"
    )
    eval_samples: int = _pos(2, "sampled answers per held-out prompt", group="eval")
    eval_seed: int = setting(
        0, "sampling seed of every held-out evaluation", lo=0, hi=2**63 - 1, group="eval"
    )
    checkpoint_every: int = _pos(
        10, "steps between checkpoints", group="run", resume_may_change=True
    )
    html_samples: int = setting(
        8, "responses shown in tokens.html", lo=0, group="run", resume_may_change=True
    )
    device: str = setting(
        "auto",
        "cpu, cuda, cuda:N or auto",
        check=check_device,
        group="run",
        resume_may_change=True,
    )
    dtype: str = setting(
        "float32",
        "dtype of the weights and the optimizer state (float16 is refused: AdamW's eps "
        "rounds to 0 in it and the first update makes weights NaN)",
        check=check_dtype,
        metavar="{" + ",".join(DTYPES) + "}",
        group="run",
    )
    autocast: str = setting(
        "none",
        "run the model's forwards under torch.autocast in this dtype (bfloat16: about 2x "
        "faster on a CPU with bf16 instructions) while the weights, optimizer and the fused "
        "LM-head ops stay in --dtype (float32 keeps small updates that bfloat16 weights "
        "would round away)",
        choices=("none", "bfloat16"),
        group="run",
    )
    cache_dir: str = setting(
        help="where built-in models are converted and warm-started models cached (default: "
        "$MRTPO_CACHE, else $XDG_CACHE_HOME/mrtpo, else ~/.cache/mrtpo; never the current "
        "folder)",
        factory=user_cache_dir,
        kind="path",
        group="run",
        resume_may_change=True,
    )
    threads: int = setting(
        1,
        "torch CPU threads of this process (default 1: a run beside another process, or "
        "several runs, never has more busy threads than cores; oversubscribed OpenMP threads "
        "wait on each other, 27-94 s a step against 7-8 s); 0 = torch's default, one per "
        "physical core, for a machine with nothing else running; at most the CPUs this "
        "process may use (more only contend for them, and tens of thousands crash torch)",
        lo=0,
        check=check_threads,
        group="run",
        resume_may_change=True,
    )
    tiny: TinyConfig = setting(
        help="the built-in model",
        factory=TinyConfig,
        nested=("warm_steps", "warm_noise"),
        group="run",
    )

    def validate(self, *, builtin_task: bool = True) -> TrainConfig:
        """Check every field (type, range, choices) and the rules that join fields; raise a
        ValueError naming the field. Creates no file. ``builtin_task=False``: the task is
        given as an object, its name is free."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "task" and not builtin_task:
                continue
            if f.name == "tiny":
                if not isinstance(value, TinyConfig):
                    raise ValueError(f"tiny: expected a TinyConfig, got {value!r}")
                for g in fields(TinyConfig):
                    msg = check_value(g, getattr(value, g.name))
                    if msg:
                        raise ValueError(f"tiny.{g.name}: {msg}")
                continue
            msg = check_value(f, value)
            if msg:
                raise ValueError(f"{f.name}: {msg}")
        if self.minibatches > self.prompts_per_step * self.group_size:
            raise ValueError("minibatches: expected at most one minibatch per response")
        if self.lr * self.weight_decay >= 1.0:
            raise ValueError(
                f"weight_decay: lr x weight_decay = {self.lr * self.weight_decay:g} >= 1 would "
                "flip or zero every weight at each step; expected a product below 1"
            )
        if self.resume and self.overwrite:
            raise ValueError("overwrite: cannot both resume the run in out and overwrite it")
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"device: {self.device!r} was asked for but CUDA is not available")
        msg = _check_writable_dir(self.out)
        if msg:
            raise ValueError(f"out: {msg}")
        if self.model is not None and not is_builtin(self.model):
            # a built-in name's installed-here check is the CLI's (mrtpo.model.builtin)
            msg = check_model_folder(self.model)
            if msg:
                raise ValueError(f"model: {msg}")
        if self.model is None or is_builtin(self.model):
            msg = _check_writable_dir(self.cache_dir)
            if msg and from_cache_env(self.cache_dir):  # the default: name where it came from
                msg += f" (it is ${CACHE_ENV}: point {CACHE_ENV} at a folder, or unset it)"
            if msg:
                raise ValueError(f"cache_dir: {msg}")
        return self

    def with_model_defaults(self, given=()) -> TrainConfig:
        """This config with built-in ``model``'s training settings (``train_defaults`` in
        mrtpo.model.builtin: what its recorded runs used, e.g. lr 2e-5 for
        smollm2-135m-instruct) in every field not named in ``given`` (the fields a command
        line set). A path or no model: unchanged."""
        over = {k: v for k, v in model_defaults(self.model).items() if k not in set(given)}
        return replace(self, **over) if over else self

    def trajectory(self) -> dict:
        """The settings a resumed run must share with its checkpoint."""
        d = self.to_dict()
        return {f.name: d[f.name] for f in fields(self) if not f.metadata.get("resume_may_change")}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d)
        if isinstance(d.get("tiny"), dict):
            d["tiny"] = TinyConfig(**d["tiny"])
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


# The settings `mrtpo compare` fixes per run (every other TrainConfig field is a flag).
COMPARE_FIXED = ("task", "algo", "seed", "init_seed", "steps", "out", "resume", "overwrite")


@dataclass
class CompareConfig:
    """A comparison: every algorithm trained with every seed from the same start."""

    task: str = setting("constraints", TASK_HELP, check=check_task)
    algos: tuple = setting(
        ("grpo", "gdpo", "mrtpo"),
        "comma-separated algorithms; an MRTPO variant adds ':'-separated settings, e.g. "
        "mrtpo:specific, mrtpo:control:gamma=2, mrtpo:gamma=2 (relevance, gamma, alpha)",
        kind="algos",
        check=check_algos,
    )
    seeds: int = _pos(3, "number of seeds, 0..N-1")
    steps: int = _pos(50, "training steps per run")
    target: float = setting(0.5, "target all-pass rate", lo=0.0, hi=1.0, open_lo=True)
    window: int = _pos(5, "steps in the moving average of the pass rate compared with the target")
    init_seed: int | None = setting(
        0,
        "seed of the task's examples and of the built-in model's warm start, shared by all "
        "runs so that every algorithm and seed starts from the same model",
        kind="int",
        lo=0,
    )
    out: str = setting("runs/compare", "folder for the runs", kind="path")
    results: str = setting(
        "records",
        "parent of the task's results folder (<results>/<task>/compare.md and plots)",
        kind="path",
    )
    jobs: int = _pos(1, "runs trained in parallel processes (results do not depend on it)")
    rerun: bool = setting(
        False, "train every run again (default: a finished (algo, seed) run in --out is reused)"
    )
    train: TrainConfig = setting(
        help="settings of every run", factory=lambda: TrainConfig(threads=1), nested=None
    )

    def validate(self, *, builtin_task: bool = True) -> CompareConfig:
        for f in fields(self):
            if f.name == "train" or (f.name == "task" and not builtin_task):
                continue
            msg = check_value(f, getattr(self, f.name))
            if msg:
                raise ValueError(f"{f.name}: {msg}")
        for algo in self.algos:  # every variant, before any run trains
            try:
                self.run_config(algo, 0).validate(builtin_task=builtin_task)
            except ValueError as err:
                if str(err).partition(":")[0] in parse_variant(algo)[1]:
                    raise ValueError(f"algos: {algo}: {err}") from None
                raise ValueError(f"train.{err}") from None
        return self

    def with_model_defaults(self, given=()) -> CompareConfig:
        """`TrainConfig.with_model_defaults` applied to the runs' settings (``given``: the
        fields of ``train`` a command line set)."""
        return replace(self, train=self.train.with_model_defaults(given))

    def run_config(self, algo: str, seed: int) -> TrainConfig:
        """The TrainConfig of one (algorithm or variant, seed) run: fresh, in its own folder."""
        base, over = parse_variant(algo)
        return replace(
            self.train,
            task=self.task,
            algo=base,
            seed=seed,
            init_seed=self.init_seed,
            steps=self.steps,
            out=str(Path(self.out) / task_slug(self.task) / f"{variant_slug(algo)}-seed{seed}"),
            resume=False,
            overwrite=True,
            **over,
        )
