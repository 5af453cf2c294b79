"""TRL adapter, the trainer: ``MRTPOGRPOTrainer``, TRL's ``GRPOTrainer`` with the contrastive
replay on each generation batch, MRTPO (B, T) token advantages and the loss fused with the
LM head (the functions of ``mrtpo.integrations.trl``); ``MRTPOConfig``, TRL's ``GRPOConfig``
with MRTPO's options; and ``verifier_reward``, which turns a built-in verifier into a TRL
reward function that names its prompt spans.

This module imports TRL (the ``trl`` extra: ``pip install -e '.[trl]'``); the framework-free
functions (``mrtpo.integrations.trl``, ``.common``) need no TRL. docs/trl.md is the guide.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import time
import warnings
from dataclasses import dataclass, field

import torch

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as exc:  # pragma: no cover - the trl extra is not installed
    raise ImportError(
        f"mrtpo.integrations.trl_trainer needs TRL ({exc}); install the trl extra: "
        "pip install -e '.[trl]' (the framework-free functions are in "
        "mrtpo.integrations.trl and need no TRL)"
    ) from exc

from mrtpo_kernels import ADVANTAGE_DEFAULTS, linear_logprobs, specific_relevance

from ..model import UNSUPPORTED_LOGIT_FIELDS, logit_transform
from ..spans import score_and_spans, span_list
from .common import consecutive_group_ids
from .engine import sharded_replay
from .trl import LOSS_TYPES, _check_scale_rewards, fused_policy_loss, mrtpo_advantages_for_grpo

__all__ = ["MRTPOConfig", "MRTPOGRPOTrainer", "verifier_reward"]

# --------------------------------------------------------------------------- the config

RELEVANCES = ("js", "specific")  # the --relevance modes the TRL replay can give
# log_completions: the advantages the model trained with, per completion (TRL's own column
# "advantage" is its per-sequence advantage, computed before MRTPO's replace it)
TRAINED_ADVANTAGE_COLUMNS = ("mrtpo_advantage_mean", "mrtpo_advantage_min", "mrtpo_advantage_max")
CREDIT_MODES = ("relevance", "uniform")  # --stop-credit, --truncated-credit


@dataclass
class MRTPOConfig(GRPOConfig):
    r"""``GRPOConfig`` with MRTPO's options (docs/METHOD.md; the ``mrtpo train`` flags of the
    same names). Every GRPOConfig field keeps its meaning; ``scale_rewards`` ("group",
    "batch", "none", or TRL's True / False) scales each reward before the weighted sum
    (docs/METHOD.md section 1; "group" is GDPO). One default differs:
    ``bf16`` left unset is False where no bf16 GPU exists (TRL's True is refused there
    unless ``use_cpu``), and ``use_cpu`` is True where no accelerator exists, so that a
    script runs unchanged on a CPU, in one process or several (``torchrun``).
    Activation checkpointing keeps TRL's default (on), set under transformers' current name
    ``activation_checkpointing`` (TRL's default under the deprecated ``gradient_checkpointing``
    made every config print a FutureWarning); passing either name works as in TRL.
    ``multi_objective_aggregation`` defaults to "normalize_then_sum" (GDPO's: each reward
    normalized in its group, then summed), the aggregation MRTPO's advantages use, so that
    TRL's own advantage (its completions table) and ``frac_reward_zero_std`` follow it too;
    another value is not used by MRTPO's advantages, and ``MRTPOGRPOTrainer`` warns once,
    naming it (``mrtpo_advantages=False`` trains with TRL's advantages, which use it).

    Parameters:
        mrtpo_alpha: share of each reward's advantage reallocated by relevance, in [0, 1];
            0 gives GDPO's advantage broadcast over tokens.
        mrtpo_gamma: sharpening exponent on the relevance, > 0.
        mrtpo_relevance: what allocates each reward: "js" (the JS distance d_k of the
            replay) or "specific" (d_k minus the mean d of the other rewards with spans,
            floored at 0; no extra forward).
        mrtpo_stop_credit: the stop token (EOS) of a finished completion: "relevance" (as any
            token) or "uniform" (its weight is 1 for every reward, GDPO's share of the stop
            decision).
        mrtpo_truncated_credit: a completion cut at ``max_completion_length``: "relevance"
            or "uniform" (every reward spread over it, as GDPO; TRL's
            ``mask_truncated_completions`` drops such rows from the loss anyway).
        mrtpo_replay_micro_batch: the replay's chunk holds at most this many completions.
        mrtpo_replay_max_tokens: and at most this many padded prompt + completion tokens
            (None: no limit).
        mrtpo_replay_all: True replays every (completion, reward) pair that names spans,
            including those whose GDPO advantage is 0 (they move no token advantage; the
            default skips them): relevance figures on every pair, at the replay's full cost.
        mrtpo_advantages: False keeps TRL's own advantages (only the fused log-probs and
            loss are used).
    """

    mrtpo_alpha: float = field(
        default=ADVANTAGE_DEFAULTS.alpha,
        metadata={
            "help": "MRTPO: share of each reward's advantage reallocated by relevance (0 = GDPO)."
        },
    )
    mrtpo_gamma: float = field(
        default=ADVANTAGE_DEFAULTS.gamma,
        metadata={"help": "MRTPO: sharpening exponent on the relevance (> 0)."},
    )
    mrtpo_relevance: str = field(
        default="js",
        metadata={"help": "MRTPO: relevance that allocates each reward.", "choices": RELEVANCES},
    )
    mrtpo_stop_credit: str = field(
        default="relevance",
        metadata={
            "help": "MRTPO: allocation on the stop token of a finished completion.",
            "choices": CREDIT_MODES,
        },
    )
    mrtpo_truncated_credit: str = field(
        default="relevance",
        metadata={
            "help": "MRTPO: allocation on a completion cut at max_completion_length.",
            "choices": CREDIT_MODES,
        },
    )
    mrtpo_replay_micro_batch: int = field(
        default=16, metadata={"help": "MRTPO: completions per replay chunk."}
    )
    mrtpo_replay_max_tokens: int | None = field(
        default=None,
        metadata={
            "help": "MRTPO: padded prompt + completion tokens per replay chunk (default: no limit)."
        },
    )
    mrtpo_replay_all: bool = field(
        default=False,
        metadata={
            "help": "MRTPO: replay pairs whose advantage is 0 too (relevance figures on "
            "every pair; the token advantages are the same)."
        },
    )
    mrtpo_advantages: bool = field(
        default=True,
        metadata={"help": "MRTPO: token advantages (False: TRL's own, fused loss only)."},
    )
    multi_objective_aggregation: str = field(
        default="normalize_then_sum",
        metadata={
            "help": "TRL's aggregation of several rewards; MRTPO's advantages always "
            "use 'normalize_then_sum' (GDPO), the default here.",
            "choices": ["normalize_then_sum", "sum_then_normalize"],
        },
    )
    # TRL's default is True under transformers' deprecated name, which transformers >= 5
    # answers with a FutureWarning on every config: unset here, and __post_init__ gives
    # TRL's True under the current name (activation_checkpointing). Passing it still works
    # (with transformers' own warning, which the user then caused).
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated alias of activation_checkpointing (default: on, as in TRL).",
            "nargs": "?",
            "const": True,
        },
    )

    def __post_init__(self):
        _checkpointing_default(self)
        # TRL's bf16 default is True, which TrainingArguments refuses on a machine without a
        # bf16 GPU (unless use_cpu): there the default is False, so that a script runs
        # unchanged on the CPU; an explicit bf16=True is left to TRL.
        if self.bf16 is None and not self.fp16 and not self.use_cpu:
            from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available

            if not is_torch_bf16_gpu_available() and not is_torch_xla_available():
                self.bf16 = False
        # Accelerate forms a process group on the CPU (gloo) only with use_cpu: without it,
        # `torchrun --nproc_per_node 2` on a machine without an accelerator started two
        # independent single-process runs (each its own rewards, no gathering).
        if not self.use_cpu and not _accelerator_available():
            self.use_cpu = True
        super().__post_init__()
        _check_options({name: getattr(self, name) for name in _OPTION_NAMES})


def _checkpointing_default(config) -> None:
    """TRL's default, checkpointing on, where neither name of the setting was given: under
    ``activation_checkpointing`` where transformers has it (no deprecation warning), else
    under ``gradient_checkpointing``."""
    if config.gradient_checkpointing is not None:
        return
    if hasattr(config, "activation_checkpointing"):
        if config.activation_checkpointing is None:
            config.activation_checkpointing = True
    else:  # pragma: no cover - transformers < 5
        config.gradient_checkpointing = True


# TRL 1.16 reads and toggles checkpointing around each generation through transformers'
# deprecated model aliases (``is_gradient_checkpointing``, ``gradient_checkpointing_disable``,
# ``gradient_checkpointing_enable``): under transformers >= 5 each prints a FutureWarning per
# process that no user line causes. Exactly those three, raised in transformers.modeling_utils,
# are ignored once a trainer exists; any other warning, and the config alias's, still shows.
_TRL_CHECKPOINTING_ALIASES = (
    r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)`"
    r" is deprecated"
)


def _ignore_trl_checkpointing_aliases() -> None:
    warnings.filterwarnings(
        "ignore",
        message=_TRL_CHECKPOINTING_ALIASES,
        category=FutureWarning,
        module=r"transformers\.modeling_utils",
    )


def _accelerator_available() -> bool:
    """A device other than the CPU that the Trainer would use (CUDA, XPU, MPS, ...)."""
    from transformers.utils import is_torch_xla_available

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        available = acc.is_available()
    else:  # pragma: no cover - torch without torch.accelerator
        available = torch.cuda.is_available()
    return bool(available) or is_torch_xla_available()


_OPTION_NAMES = (
    "mrtpo_alpha",
    "mrtpo_gamma",
    "mrtpo_relevance",
    "mrtpo_stop_credit",
    "mrtpo_truncated_credit",
    "mrtpo_replay_micro_batch",
    "mrtpo_replay_max_tokens",
    "mrtpo_replay_all",
    "mrtpo_advantages",
)
# the constructor keywords of earlier versions -> the MRTPOConfig fields (deprecated)
_DEPRECATED_KWARGS = {
    "mrtpo_alpha": "mrtpo_alpha",
    "mrtpo_gamma": "mrtpo_gamma",
    "mrtpo_micro_batch": "mrtpo_replay_micro_batch",
    "mrtpo_max_tokens": "mrtpo_replay_max_tokens",
    "mrtpo_advantages": "mrtpo_advantages",
}


def _check_options(o: dict) -> dict:
    """MRTPO's options checked, each ValueError naming its field; returns them normalized."""

    def number(name):
        v = o[name]
        if isinstance(v, (bool, str, bytes)) or v is None:
            raise ValueError(f"{name}: expected a number, got {type(v).__name__} {v!r}")
        try:
            return float(v)
        except (TypeError, ValueError):
            raise ValueError(f"{name}: expected a number, got {type(v).__name__}") from None

    def count(name, optional=False):
        v = o[name]
        if v is None and optional:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        return int(v)

    out = dict(o)
    out["mrtpo_alpha"] = alpha = number("mrtpo_alpha")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"mrtpo_alpha: expected a number in [0, 1], got {alpha}")
    out["mrtpo_gamma"] = gamma = number("mrtpo_gamma")
    if not (gamma > 0 and math.isfinite(gamma)):
        raise ValueError(f"mrtpo_gamma: expected a positive finite number, got {gamma}")
    if o["mrtpo_relevance"] not in RELEVANCES:
        raise ValueError(
            f"mrtpo_relevance: expected one of {RELEVANCES}, got {o['mrtpo_relevance']!r} "
            "(control, logratio and oracle exist in `mrtpo train` only)"
        )
    for name in ("mrtpo_stop_credit", "mrtpo_truncated_credit"):
        if o[name] not in CREDIT_MODES:
            raise ValueError(f"{name}: expected one of {CREDIT_MODES}, got {o[name]!r}")
    out["mrtpo_replay_micro_batch"] = count("mrtpo_replay_micro_batch")
    out["mrtpo_replay_max_tokens"] = count("mrtpo_replay_max_tokens", optional=True)
    for name in ("mrtpo_replay_all", "mrtpo_advantages"):
        if not isinstance(o[name], bool):
            raise ValueError(f"{name}: expected a bool, got {o[name]!r}")
    return out


def _options_of(args, deprecated: dict) -> dict:
    """MRTPO's options: ``args``' fields (an MRTPOConfig; a plain GRPOConfig gets the
    defaults), overridden by the deprecated constructor keywords (with a FutureWarning)."""
    defaults = {f: MRTPOConfig.__dataclass_fields__[f].default for f in _OPTION_NAMES}
    o = {f: getattr(args, f, defaults[f]) for f in _OPTION_NAMES}
    if deprecated:
        names = ", ".join(f"{k}= -> MRTPOConfig.{_DEPRECATED_KWARGS[k]}" for k in deprecated)
        warnings.warn(
            f"MRTPOGRPOTrainer: the keyword arguments {names} are deprecated; set them in "
            "MRTPOConfig (args=MRTPOConfig(...))",
            FutureWarning,
            stacklevel=3,
        )
        for k, v in deprecated.items():
            o[_DEPRECATED_KWARGS[k]] = v
    return _check_options(o)


# --------------------------------------------------------------------------- reward spans


class _SpanCapture:
    """A reward function that may return per sample a score, ``(score, spans)`` or an object
    with ``score`` and ``spans`` (a ``Verdict``), seen by TRL as one returning scores; the
    spans of its last call are kept in ``store[k]``.

    Its outputs may come as TRL takes them: a list, a tuple, a 1-D numpy array or tensor, or
    any other ordered sequence or iterator, with None for a missing score; anything else is
    a ValueError naming the reward function (and the sample). The user's object stays
    reachable: ``__wrapped__`` is it, ``__name__`` its name (TRL's, of a partial's function
    or of a callable's class), and any other attribute is read from it and written to it."""

    _OWN = frozenset({"fn", "k", "store", "__wrapped__", "__name__", "__qualname__", "__doc__"})

    def __init__(self, fn, k: int, store: dict):
        own = functools.partial(object.__setattr__, self)
        own("fn", fn)
        own("k", k)
        own("store", store)
        own("__wrapped__", fn)
        inner = fn
        while isinstance(inner, functools.partial):
            inner = inner.func
        own("__name__", getattr(inner, "__name__", type(inner).__name__))
        own("__qualname__", getattr(inner, "__qualname__", self.__name__))
        own("__doc__", getattr(inner, "__doc__", None))

    def __getattr__(self, name):  # only for names the wrapper itself lacks
        fn = self.__dict__.get("fn")
        if fn is None or (name.startswith("__") and name.endswith("__")):
            # special names stay the wrapper's own (copy, pickle: never the user's object)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(fn, name)

    def __setattr__(self, name, value):
        if name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.fn, name, value)

    def __delattr__(self, name):
        if name in self._OWN:
            object.__delattr__(self, name)
        else:
            delattr(self.fn, name)

    def __repr__(self):
        return f"<MRTPO span capture of {self.fn!r}>"

    def _outputs(self, out) -> list:
        """One output per sample, as a list, from whatever TRL would take."""
        from collections.abc import Iterator, Mapping, Sequence, Set

        from ..spans import _is_array

        where = f"reward function {self.__name__!r}"
        if _is_array(out):
            if len(out.shape) != 1:
                raise ValueError(
                    f"{where}: expected a list with one output per sample, or a 1-D array; "
                    f"got {type(out).__name__} of shape {tuple(out.shape)}"
                )
            if hasattr(out, "detach"):
                out = out.detach().cpu()
            return out.tolist()
        if isinstance(out, (str, bytes, Mapping, Set)) or not isinstance(out, (Sequence, Iterator)):
            raise ValueError(
                f"{where}: expected a list with one output per sample (or a tuple, a 1-D "
                f"numpy array or tensor; None entries for missing scores), got "
                f"{type(out).__name__}"
            )
        return list(out)

    def _split(self, out):
        outs = self._outputs(out)
        pairs = [
            score_and_spans(v, where=f"reward function {self.__name__!r}, sample {i}")
            for i, v in enumerate(outs)
        ]
        self.store[self.k] = [sp for _, sp in pairs]
        return [None if sc is None else float(sc) for sc, _ in pairs]

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


# --------------------------------------------------------------------------- verifiers

EXAMPLE_COLUMNS = ("prompt", "example_id", "fields", "reference")


def verifier_reward(verifier, *, spans: bool = True):
    """A TRL reward function from a built-in verifier (``mrtpo.verifiers``: the SQL,
    constraint, tool-call and BFCL verifiers of ``mrtpo.tasks.load_task(name).verifiers``,
    or any ``Verifier``: ``verifier(example, response) -> Verdict``).

    Each dataset row is the task's ``Example``: the ``prompt`` column is the example's
    prompt text, or a chat prompt whose last user message is that text; ``fields`` is
    the example's fields as a JSON string (or a dict); ``example_id`` and ``reference``
    are optional. ``example_row(example)`` builds such a row. The function returns per
    completion ``(score, spans)``: the verdict's score and the prompt spans the verifier
    checked, which ``MRTPOGRPOTrainer`` replays (offsets into the prompt text, i.e. its
    last user message on a chat prompt). With ``spans=False`` it returns the scores alone
    (for TRL's own ``GRPOTrainer``). Its ``__name__`` is the verifier's name (TRL logs
    ``rewards/<name>/mean``, MRTPO ``mrtpo/relevance/<name>``).

    A row whose ``fields`` lacks what the verifier reads (its ``fields_needed``: the
    built-in verifiers declare theirs), the column absent included, or holds it in another
    form is a ValueError naming the column, the key and the row: such a verifier would judge
    nothing real (pay 1 to any completion, or 0 to the gold answer). A completion's content
    given as a list of message parts is read as its text parts joined.
    """
    name = getattr(verifier, "name", None)
    if not callable(verifier) or not isinstance(name, str) or not name:
        raise ValueError(
            f"verifier: expected a verifier (a callable with a name, as in "
            f"mrtpo.tasks.load_task(...).verifiers), got {type(verifier).__name__}"
        )
    from mrtpo.verifiers import Example
    from mrtpo.verifiers.base import check_fields

    def reward(prompts, completions, fields=None, example_id=None, reference=None, **_):
        n = len(completions)
        for col, values in (
            ("fields", fields),
            ("example_id", example_id),
            ("reference", reference),
        ):
            if values is not None and len(values) != n:
                raise ValueError(
                    f"{col}: expected {n} values (one per completion), got {len(values)}"
                )
        out = []
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            text = _prompt_text(prompt, i)
            row = _fields_of(None if fields is None else fields[i], i)
            where = (
                f"fields: row {i}"
                if fields is not None
                else f"fields: row {i} (the dataset has no 'fields' column)"
            )
            check_fields(verifier, row, where=where)
            example = Example(
                id=str(example_id[i]) if example_id is not None else str(i),
                prompt=text,
                fields=row,
                reference=None if reference is None else reference[i],
            )
            verdict = verifier(example, _completion_text(completion, i))
            out.append(
                (float(verdict.score), list(verdict.spans)) if spans else float(verdict.score)
            )
        return out

    reward.__name__ = name
    reward.__qualname__ = name
    reward.verifier = verifier
    return reward


def example_row(example) -> dict:
    """The dataset row ``verifier_reward`` reads for a task's ``Example``: ``prompt`` (the
    prompt as one user message), ``example_id``, ``fields`` (JSON) and ``reference``."""
    return {
        "prompt": [{"role": "user", "content": example.prompt}],
        "example_id": example.id,
        "fields": json.dumps(example.fields),
        "reference": example.reference or "",
    }


def _prompt_text(prompt, i: int) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        for message in reversed(prompt):
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, str):
                    return content
    raise ValueError(
        f"prompt: sample {i} is neither a string nor a chat prompt with a user message of "
        "text content (a verifier's spans are offsets into that text)"
    )


def _completion_text(completion, i: int = 0) -> str:
    """A completion's text: a string, or the content of the last message of a chat message
    list; a content given as message parts (``[{"type": "text", "text": ...}, ...]`` or
    strings) is its text parts joined; a part of another type is an error naming the
    sample."""
    if isinstance(completion, str):
        return completion
    if not (
        isinstance(completion, (list, tuple)) and completion and isinstance(completion[-1], dict)
    ):
        raise ValueError(
            f"completions: sample {i}: expected a string or a chat message "
            f"list, got {type(completion).__name__}"
        )
    content = completion[-1].get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, (list, tuple)):
        raise ValueError(
            f"completions: sample {i}: the message content is "
            f"{type(content).__name__}, expected a string or a list of "
            "message parts"
        )
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif (
            isinstance(part, dict)
            and part.get("type", "text") == "text"
            and isinstance(part.get("text"), str)
        ):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(
                f"completions: sample {i}: content part {j} is {kind!r}, not text (a "
                "verifier judges the completion's text: give text parts)"
            )
    return "".join(texts)


def _fields_of(value, i: int) -> dict:
    if value is None:
        return {}
    if isinstance(value, (str, bytes)):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise ValueError(f"fields: sample {i} is not valid JSON ({err})") from None
    if not isinstance(value, dict):
        raise ValueError(
            f"fields: sample {i}: expected a dict (or its JSON), got {type(value).__name__}"
        )
    return value


# --------------------------------------------------------------------------- the trainer

# TRL settings the fused loss path reproduces; any other value goes to TRL's own loss code,
# fed by fused log-probs (see MRTPOGRPOTrainer). The model's logit transform (Gemma's
# final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling) goes to the fused
# ops (mrtpo.model.logit_transform); these multipliers are refused there.
_REFUSED_MODEL_SETTINGS = UNSUPPORTED_LOGIT_FIELDS


class MRTPOGRPOTrainer(GRPOTrainer):
    """GRPOTrainer with MRTPO (B, T) token advantages and a fused LM head everywhere.

    Takes GRPOTrainer's arguments; MRTPO's options are fields of ``args``, an
    ``MRTPOConfig`` (a plain ``GRPOConfig`` gets their defaults). Two more keyword
    arguments, callables like ``reward_funcs``:

    Args:
        reward_spans: one entry per reward function, ``fn_k(prompt, **columns) -> spans``
            (the prompt and the other dataset columns of one sample; spans as in
            ``mrtpo.spans``: (start, end) on a plain prompt, (message, start, end) on a
            conversational one) or None. Where None, a reward function's own outputs name
            the spans if it returns per sample ``(score, spans)`` or a ``Verdict``
            (``verifier_reward`` makes one from a built-in verifier); a reward with
            neither is spread uniformly (GDPO). On each generation batch the trainer runs
            ``mrtpo.replay.replay_relevance`` on this process's rows with the training
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

    def __init__(self, *args, relevance_fn=None, reward_spans=None, **kwargs):
        deprecated = {k: kwargs.pop(k) for k in list(kwargs) if k in _DEPRECATED_KWARGS}
        store: dict = {}
        if "reward_funcs" in kwargs:
            kwargs["reward_funcs"] = _wrap_reward_funcs(kwargs["reward_funcs"], store)
        elif len(args) >= 2:
            args = (args[0], _wrap_reward_funcs(args[1], store), *args[2:])
        model = kwargs.get("model", args[0] if args else None)
        config = kwargs.get("args", args[2] if len(args) >= 3 else None)
        if config is None:  # as GRPOTrainer does, with MRTPO's config
            name = model if isinstance(model, str) else _model_id(model) or "model"
            config = MRTPOConfig(f"{name.split('/')[-1]}-MRTPO")
            if len(args) >= 3:
                args = (*args[:2], config, *args[3:])
            else:
                kwargs["args"] = config
        options = _options_of(config, deprecated)
        _ignore_trl_checkpointing_aliases()
        with _reference_from_policy(model):
            super().__init__(*args, **kwargs)
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
        ``mrtpo train`` makes them: the relevance mode, then the stop-token and truncated
        credit (MRTPOConfig)."""
        mask = output["completion_mask"].bool()
        if self.mrtpo_relevance == "specific":
            relevance = specific_relevance(relevance, has_info)
        ids = output["completion_ids"]
        eos = torch.tensor(self.eos_token_ids, device=ids.device)
        # finished: the completion holds a stop token (TRL's mask ends at the first one)
        finished = (torch.isin(ids, eos) & mask.to(ids.device)).any(dim=1).to(mask.device)
        gamma = self.mrtpo_gamma
        if self.mrtpo_stop_credit == "uniform":  # float64 d^gamma, allocated with gamma 1
            relevance, gamma = _stop_token_at_mean(relevance, mask, finished, gamma), 1.0
        if self.mrtpo_truncated_credit == "uniform":
            has_info = has_info & finished[:, None]  # a cut completion: GDPO's broadcast
        return relevance, has_info, gamma

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
            metrics[f"mrtpo/gdpo_std/{name}"].append(float(std[:, j].mean()))
            metrics[f"mrtpo/frac_zero_std/{name}"].append(float(flat[:, j].double().mean()))
        metrics["mrtpo/frac_zero_std_all"].append(float(flat.all(dim=1).double().mean()))

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
        from mrtpo.replay import replay_mask_from_rewards

        group_ids = consecutive_group_ids(rewards.shape[0], g, device=rewards.device)
        moving = replay_mask_from_rewards(
            rewards,
            group_ids,
            weights=self.reward_weights.to(rewards.device),
            eps=1e-4,
            nan="zero",
            scale_rewards=_check_scale_rewards(self.scale_rewards),
        )
        if process_slice is not None:
            moving = moving[process_slice]
        info = torch.tensor([[bool(s) for s in row] for row in spans], dtype=torch.bool)
        if self.mrtpo_replay_all:
            return info
        moving = moving & info
        if self.mrtpo_relevance == "specific":  # r_k mixes a row's rewards: whole rows
            moving = info & moving.any(dim=1, keepdim=True)
        return moving

    @torch.no_grad()
    def _mrtpo_replay(self, inputs, output, spans, mode, replay_mask=None, lm=None):
        """The replay of this process's rows; ``lm``: the ``EngineLM`` of a sharded engine
        (``sharded_replay``), else the unwrapped model runs it."""
        from mrtpo.replay import replay_relevance

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
            metrics["mrtpo/replay_seconds"].append(float(tot[0] / tot[1]))
        metrics["mrtpo/replay/pairs"].append(float(tot[2]))
        metrics["mrtpo/replay/skipped"].append(float(tot[3] - tot[2]))
        for j, name in enumerate(self.reward_func_names):
            rel, count = float(tot[4 + 4 * j]), float(tot[5 + 4 * j])
            replayed, named_j = float(tot[6 + 4 * j]), float(tot[7 + 4 * j])
            metrics[f"mrtpo/replay/pairs/{name}"].append(replayed)
            metrics[f"mrtpo/replay/skipped/{name}"].append(named_j - replayed)
            if count > 0:  # measured: absent when no pair of it was replayed
                metrics[f"mrtpo/relevance/{name}"].append(rel / count)

    # ------------------------------------------------------------ log-probs
    def _completion_hidden(self, model, input_ids, attention_mask, logits_to_keep):
        return self._completion_hidden_and_head(model, input_ids, attention_mask, logits_to_keep)[0]

    def _completion_hidden_and_head(
        self, model, input_ids, attention_mask, logits_to_keep, router_aux=False
    ):
        """The hidden states that predict the last ``logits_to_keep`` tokens, and the LM
        head's weight and bias as the forward held them (on FSDP the unsharded tensors of
        the head's unit, through which the gradient reaches the shards; on ZeRO-3 the
        partitioned parameters, which ``_head_pass`` has DeepSpeed gather). ``router_aux``: a
        fourth element, the MoE load-balancing loss of this forward (``_router_aux_loss``)."""
        from mrtpo.model import decoder, lm_head

        # the backbone under the trainer's autocast, as the model's wrapped forward runs it;
        # the head then runs in the weight's dtype
        inner = self.accelerator.unwrap_model(model)
        router = {"output_router_logits": True} if router_aux else {}
        if inner is model:
            weight, bias = lm_head(model)
            with self.accelerator.autocast():
                out = decoder(model)(
                    input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **router
                )
                aux = _router_aux_loss(model, out, attention_mask) if router_aux else None
            hidden = out.last_hidden_state[:, -logits_to_keep - 1 : -1]
            return (hidden.to(weight.dtype), weight, bias) + ((aux,) if router_aux else ())
        # Wrapped for several processes (DDP, FSDP): the forward must go through the
        # wrapper, which synchronizes the gradients (and on FSDP gathers each unit); with
        # the head swapped for a stand-in that returns its input, the "logits" are the last
        # hidden states, and the fused head reads the weight the forward held.
        head = inner.get_output_embeddings()
        capture = _HeadCapture(head)
        inner.set_output_embeddings(capture)
        try:
            with self.accelerator.autocast():
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    use_cache=False,
                    logits_to_keep=logits_to_keep + 1,
                    **router,
                )
        finally:
            inner.set_output_embeddings(head)
        weight, bias = capture.held if capture.held is not None else lm_head(inner)
        hidden = out.logits[:, :-1].to(weight.dtype)
        if not router_aux:
            return hidden, weight, bias
        if getattr(out, "aux_loss", None) is None:  # the model's own forward computes it
            raise ValueError(
                f"router_aux_loss_coef: {type(inner).__name__} returned no "
                "aux_loss with output_router_logits=True"
            )
        return hidden, weight, bias, out.aux_loss

    def _get_per_token_logps_and_entropies(
        self,
        model,
        input_ids,
        attention_mask,
        logits_to_keep,
        batch_size=None,
        compute_entropy=False,
        compute_aux_loss=False,
        **multimodal,
    ):
        given = [k for k, v in multimodal.items() if v is not None]
        if given:
            raise ValueError(
                f"{given[0]}: multimodal inputs are not supported by the "
                "fused LM head (it runs the text decoder only)"
            )
        batch_size = batch_size or input_ids.size(0)
        logps, ents, auxes = [], [], []
        for s in range(0, input_ids.size(0), batch_size):
            ids, am = input_ids[s : s + batch_size], attention_mask[s : s + batch_size]
            hidden, weight, bias, *aux = self._completion_hidden_and_head(
                model, ids, am, logits_to_keep, router_aux=compute_aux_loss
            )
            auxes += aux
            labels = ids[:, -logits_to_keep:].masked_fill(am[:, -logits_to_keep:] == 0, -100)

            def head_pass(h, w, b, labels=labels):
                return linear_logprobs(
                    h,
                    w,
                    labels,
                    bias=b,
                    temperature=self.temperature,
                    return_entropy=compute_entropy,
                    **self._mrtpo_head_kw,
                )

            out = self._head_pass(model, head_pass, hidden, weight, bias)
            if compute_entropy:
                logps.append(out[0])
                ents.append(out[1])
            else:
                logps.append(out)
        aux_loss = torch.stack(auxes).mean() if compute_aux_loss else None  # as TRL: chunk mean
        return (torch.cat(logps), torch.cat(ents) if compute_entropy else None, aux_loss)

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
        prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
        completion_ids = inputs["completion_ids"]
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        t = completion_ids.size(1)
        hidden, weight, bias, *aux = self._completion_hidden_and_head(
            model,
            torch.cat([prompt_ids, completion_ids], dim=1),
            torch.cat([prompt_mask, inputs["completion_mask"]], dim=1),
            t,
            router_aux=self.aux_loss_enabled,
        )
        mode = "train" if self.model.training else "eval"
        accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1
        token_normalizer = None
        if self.loss_type == "dapo":
            token_normalizer = (
                inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            )
            if mode == "train":
                token_normalizer = token_normalizer * accumulation / self.args.steps_per_generation
        labels = completion_ids.masked_fill(mask == 0, -100)

        def head_pass(h, w, b):
            loss, _ = fused_policy_loss(
                h,
                w,
                completion_ids,
                mask,
                inputs.get("old_per_token_logps"),
                inputs["advantages"],
                epsilon_low=self.epsilon_low,
                epsilon_high=self.epsilon_high,
                beta=self.beta,
                ref_per_token_logps=inputs.get("ref_per_token_logps"),
                loss_type=self.loss_type,
                temperature=self.temperature,
                max_completion_length=self.max_completion_length,
                token_normalizer=token_normalizer,
                lm_head_bias=b,
                use_bias_correction_kl=bool(self.args.use_bias_correction_kl),
                **self._mrtpo_head_kw,
            )
            with torch.no_grad():  # the metrics TRL's _compute_loss logs, from one more pass
                logp, entropy = linear_logprobs(
                    h.detach(),
                    w.detach(),
                    labels,
                    bias=None if b is None else b.detach(),
                    temperature=self.temperature,
                    return_entropy=True,
                    **self._mrtpo_head_kw,
                )
            return loss, logp, entropy

        loss, logp, entropy = self._head_pass(model, head_pass, hidden, weight, bias)
        if self.loss_type != "dapo":
            loss = loss / accumulation
        if self.aux_loss_enabled:  # as TRL: the coefficient times the aux loss per micro-batch
            loss = loss + self.router_aux_loss_coef * aux[0] / accumulation
            self._metrics[mode]["aux_loss"].append(
                self.accelerator.gather_for_metrics(aux[0].detach()).mean().item()
            )
        self._log_fused_metrics(logp, entropy, mask, inputs, mode)
        return loss

    def _head_pass(self, model, fn, hidden, weight, bias):
        """``fn(hidden, weight, bias)``, the fused LM head, where the engine holds the head's
        parameters in full. Under DeepSpeed ZeRO-3 the forward has released them (``weight``
        is a partitioned parameter): ``fn`` then runs as the head module's own forward, so
        that ZeRO-3's hooks gather the head before it and release it after, gather it again
        for its backward (the weight gradient reaches the partitioned parameter through
        ZeRO-3's reduce-scatter) and release it after; the same collectives on every rank.
        Elsewhere (one process, DDP, ZeRO-1/2, FSDP1/FSDP2, whose forward left the head's
        unit gathered) it is ``fn`` called directly."""
        if not _partitioned(weight):
            return fn(hidden, weight, bias)
        head = self.accelerator.unwrap_model(model).get_output_embeddings()
        return _as_module_forward(
            head, lambda h: fn(h, head.weight, getattr(head, "bias", None)), hidden
        )

    @torch.no_grad()
    def _log_fused_metrics(self, logp, entropy, mask, inputs, mode):
        # The metrics TRL's _compute_loss logs, from the no-grad pass of the fused head
        # (``logp``, ``entropy``: (B, T) of the completion tokens).
        old = inputs.get("old_per_token_logps")
        old = logp if old is None else old
        ratio = torch.exp(logp - old)
        adv = inputs["advantages"]
        adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
        m = mask.to(logp.dtype)

        def global_masked_mean(x):
            totals = self.accelerator.reduce(torch.stack([(x * m).sum(), m.sum()]), reduction="sum")
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


class _HeadCapture(torch.nn.Module):
    """The LM head's stand-in in the wrapped model's forward: returns the hidden states (the
    "logits") and keeps, in ``held``, the head's weight and bias as they are while the
    forward runs: on FSDP1/FSDP2 the unsharded tensors of the head's unit (the root's, which
    stays gathered until the backward), not the shards that sit there outside a forward; on
    ZeRO-3 the partitioned parameters (the head module does not run here, so DeepSpeed does
    not gather it: ``MRTPOGRPOTrainer._head_pass`` runs the fused head as its forward)."""

    def __init__(self, head):
        super().__init__()
        self.held = None
        object.__setattr__(self, "_head", head)  # not a submodule: no parameters here

    def forward(self, hidden):
        self.held = (self._head.weight, getattr(self._head, "bias", None))
        return hidden


def _router_aux_loss(model, out, attention_mask):
    """The MoE load-balancing loss of a decoder forward run with output_router_logits=True,
    as the model's own ``*ForCausalLM.forward`` computes it: its modeling module's
    ``load_balancing_loss_func`` (Mixtral's, which every MoE family copies, where a module
    has none) on the router logits of every layer, with the model's expert count and top-k
    and the attention mask (padding left out)."""
    import sys

    router_logits = getattr(out, "router_logits", None)
    if not isinstance(router_logits, tuple) or not router_logits:
        raise ValueError(
            f"router_aux_loss_coef: the decoder of {type(model).__name__} "
            "returned no router logits with output_router_logits=True"
        )
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    if fn is None:
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func as fn
    config = model.config.get_text_config()
    experts = (
        getattr(model, "num_experts", None)
        or getattr(config, "num_experts", None)
        or config.num_local_experts
    )
    top_k = getattr(model, "num_experts_per_tok", None) or config.num_experts_per_tok
    return fn(router_logits, experts, top_k, attention_mask)


def _partitioned(param) -> bool:
    """Whether ``param`` is a DeepSpeed ZeRO-3 parameter (partitioned outside the forward of
    its module, whatever it holds now)."""
    return hasattr(param, "ds_id") and getattr(param, "ds_status", None) is not None


def _as_module_forward(module: torch.nn.Module, fn, *inputs):
    """``fn(*inputs)`` run as ``module``'s forward (through ``module.__call__``, so that the
    hooks an engine put on the module run around it: ZeRO-3 gathers the module's
    parameters before, releases them after, and puts its backward hooks on the inputs and
    outputs); the module's own forward is back after."""
    own = module.__dict__.get("forward")  # an instance attribute the module had, if any
    module.forward = fn
    try:
        return module(*inputs)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


def _nan_reduce(x: torch.Tensor, fn) -> float:
    x = x[~torch.isnan(x)]
    return float("nan") if x.numel() == 0 else fn(x).item()


def _stop_token_at_mean(relevance, mask, finished, gamma):
    """(K, B, T) ``relevance`` raised to ``gamma`` in float64, with the last token of each
    finished completion (at least 2 tokens) set to the mean of d^gamma over its other tokens
    (``mrtpo train --stop-credit uniform``, `mrtpo.trainer.stop_token_at_mean` on the padded
    layout): allocated with gamma 1, its weight is 1 for every reward and every other token's
    weight is what it is without the stop token. The power is handed over, not a d whose
    power it is: that d leaves float range at small gamma."""
    m = mask.bool()
    lengths = m.sum(dim=1)
    last = m & (m.long().cumsum(dim=1) == lengths[:, None])  # (B, T), one per non-empty row
    pick = finished & (lengths >= 2)
    p = relevance.clamp(min=0).double() ** gamma * m
    others = (p.sum(dim=2) - (p * last).sum(dim=2)) / (lengths - 1).clamp(min=1)  # (K, B)
    where = (last & pick[:, None])[None]
    return torch.where(where, others[:, :, None].expand_as(p), p)


def _model_id(model) -> str:
    config = getattr(model, "config", None)
    return str(getattr(config, "_name_or_path", "") or "")


def _hub_loadable(name: str) -> bool:
    """Whether TRL can load a model called ``name``: a local folder or a valid hub id."""
    import os

    if not name:
        return False
    if os.path.isdir(name):
        return True
    try:
        from huggingface_hub.utils import validate_repo_id

        validate_repo_id(name)
    except Exception:  # noqa: BLE001 - any refusal means TRL cannot load it either
        return False
    return not os.path.isabs(name) and not name.startswith((".", "~"))


@contextlib.contextmanager
def _reference_from_policy(model):
    """While GRPOTrainer builds its reference model (beta > 0), a policy passed as a model
    whose name TRL cannot load (a model built in code, or saved nowhere TRL can find)
    gets as reference a frozen copy of itself: the policy's weights at construction, its
    config, dtype and attention implementation. TRL loads any other name itself."""
    import sys

    module = sys.modules[GRPOTrainer.__module__]
    original = module.create_model_from_path
    if isinstance(model, str) or model is None or _hub_loadable(_model_id(model)):
        yield
        return

    def create(name, **kwargs):
        if name != _model_id(model):
            return original(name, **kwargs)
        ref = copy.deepcopy(model)
        dtype = kwargs.get("dtype")
        if isinstance(dtype, torch.dtype):
            ref = ref.to(dtype)
        ref.requires_grad_(False)
        return ref.eval()

    module.create_model_from_path = create
    try:
        yield
    finally:
        module.create_model_from_path = original
