"""``MRTPOConfig``: TRL's ``GRPOConfig`` with MRTPO's options, and their checks (the
fields' ``ValueError`` names the field). docs/trl.md lists the fields.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import torch
from transformers.utils import is_torch_bf16_gpu_available, is_torch_xla_available
from trl import GRPOConfig

from mrtpo.allocation import CREDIT_MODES, REPLAY_RELEVANCES, Allocation
from mrtpo.training.method_options import METHOD_OPTIONS

__all__ = ["CREDIT_MODES", "OPTIONS", "RELEVANCES", "TRL_OPTIONS", "MRTPOConfig"]

# the relevance forms the TRL replay can give (mrtpo.allocation holds the vocabularies)
RELEVANCES = REPLAY_RELEVANCES

# MRTPO's options that `mrtpo train` lacks, described as mrtpo.training.method_options describes the
# shared ones (the keywords of mrtpo.training.config_fields.setting)
TRL_OPTIONS: dict[str, dict] = {
    "replay_micro_batch": dict(default=16, help="completions per replay chunk", lo=1),
    "replay_max_tokens": dict(
        default=None,
        help="padded prompt + completion tokens per replay chunk (None: no limit); bounds "
        "the replay's memory",
        kind="int",
        lo=1,
    ),
    "advantages": dict(
        default=True,
        help="MRTPO's token advantages; False keeps TRL's own (only the fused log-probs and "
        "loss are used)",
    ),
}
# every MRTPO field of MRTPOConfig -> its description (filled by _option, in field order)
OPTIONS: dict[str, dict] = {}


def _option(name: str, *, choices=None, note: str = ""):
    """The MRTPOConfig field ``mrtpo_<name>``, from the description of option ``name``
    (``METHOD_OPTIONS``, shared with ``mrtpo train``, else ``TRL_OPTIONS``): its default, its
    help (with ``note`` after it) and its choices (``choices``: a narrower vocabulary). The
    field's metadata holds only what TRL's parser passes to argparse (help, choices)."""
    desc = dict(METHOD_OPTIONS[name] if name in METHOD_OPTIONS else TRL_OPTIONS[name])
    if choices is not None:
        desc["choices"] = choices
    if note:
        desc["help"] += f"; {note}"
    OPTIONS[f"mrtpo_{name}"] = desc
    metadata = {"help": f"MRTPO: {desc['help']}."}
    if desc.get("choices"):
        metadata["choices"] = desc["choices"]
    return field(default=desc["default"], metadata=metadata)


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

    MRTPO's fields (``mrtpo_alpha``, ``mrtpo_relevance``, ...) are described in ``OPTIONS``:
    those ``mrtpo train`` shares take its descriptions (``mrtpo.training.method_options``), so each
    help text is written once; docs/trl.md's table of them is generated from ``OPTIONS``.
    """

    mrtpo_alpha: float = _option("alpha")
    mrtpo_gamma: float = _option("gamma")
    mrtpo_relevance: str = _option(
        "relevance",
        choices=REPLAY_RELEVANCES,
        note="here js or specific: the others need `mrtpo train`'s replays",
    )
    mrtpo_stop_credit: str = _option("stop_credit")
    mrtpo_truncated_credit: str = _option(
        "truncated_credit",
        note="TRL's mask_truncated_completions drops such rows from the loss anyway",
    )
    mrtpo_replay_micro_batch: int = _option("replay_micro_batch")
    mrtpo_replay_max_tokens: int | None = _option("replay_max_tokens")
    mrtpo_replay_all: bool = _option("replay_all")
    mrtpo_advantages: bool = _option("advantages")
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


def _accelerator_available() -> bool:
    """A device other than the CPU that the Trainer would use (CUDA, XPU, MPS, ...)."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        available = acc.is_available()
    else:  # pragma: no cover - torch without torch.accelerator
        available = torch.cuda.is_available()
    return bool(available) or is_torch_xla_available()


_OPTION_NAMES = tuple(OPTIONS)
# the constructor keywords of earlier versions -> the MRTPOConfig fields (deprecated)
_DEPRECATED_KWARGS = {
    "mrtpo_alpha": "mrtpo_alpha",
    "mrtpo_gamma": "mrtpo_gamma",
    "mrtpo_micro_batch": "mrtpo_replay_micro_batch",
    "mrtpo_max_tokens": "mrtpo_replay_max_tokens",
    "mrtpo_advantages": "mrtpo_advantages",
}


def _check_options(o: dict) -> dict:
    """MRTPO's options checked against their descriptions (``OPTIONS``), each ValueError
    naming its field; returns them normalized, with ``mrtpo_allocation`` (the three
    allocation decisions, checked by ``mrtpo.allocation``)."""
    out = dict(o)
    for name, desc in OPTIONS.items():
        if desc.get("choices"):
            continue  # the allocation decisions, below
        out[name] = _checked(name, desc, o[name])
    out["mrtpo_allocation"] = Allocation.checked(
        o["mrtpo_relevance"],
        o["mrtpo_stop_credit"],
        o["mrtpo_truncated_credit"],
        relevances=OPTIONS["mrtpo_relevance"]["choices"],
        names={k: f"mrtpo_{k}" for k in ("relevance", "stop_credit", "truncated_credit")},
    )
    return out


def _checked(name: str, desc: dict, v):
    """One option's value checked against its description: a number in its range, a
    positive integer (None where that is the default), a bool."""
    kind = desc.get("kind") or type(desc["default"]).__name__
    if kind == "bool":
        if not isinstance(v, bool):
            raise ValueError(f"{name}: expected a bool, got {v!r}")
        return v
    if kind == "int":
        if v is None and desc["default"] is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < desc["lo"]:
            raise ValueError(f"{name}: expected a positive integer, got {v!r}")
        return int(v)
    if isinstance(v, (bool, str, bytes)) or v is None:
        raise ValueError(f"{name}: expected a number, got {type(v).__name__} {v!r}")
    try:
        x = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{name}: expected a number, got {type(v).__name__}") from None
    lo, hi = desc.get("lo"), desc.get("hi")
    if desc.get("open_lo") and lo == 0 and hi is None:
        if not (x > 0 and math.isfinite(x)):
            raise ValueError(f"{name}: expected a positive finite number, got {x}")
    elif not lo <= x <= hi:
        raise ValueError(f"{name}: expected a number in [{lo:g}, {hi:g}], got {x}")
    return x


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
