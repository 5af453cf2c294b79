"""The built-in tasks (``--task``): ``builtin`` holds the tasks and ``load_task``; ``data``
their offline data (the shop database and its questions, tool definitions, constraint
prompts, readers of packaged benchmark data). The verifiers that reward them are their own
wing, ``mrtpo.verifiers``, which the framework adapters use without any task.

The names of ``mrtpo.tasks.builtin`` import from here too (``from mrtpo.tasks import
load_task``, the path the docs use).
"""

from __future__ import annotations

_EXPORTS = dict.fromkeys(
    (
        "BFCL_DISTRACTORS",
        "BFCL_INSTRUCTION",
        "EVAL_FRACTION",
        "FULL_CONSTRAINTS",
        "N_CONSTRAINT_EXAMPLES",
        "N_TOOL_EXAMPLES",
        "REAL_INSTRUCTION",
        "TASKS",
        "WARM_STEPS",
        "default_warm_steps",
        "load_task",
    ),
    "builtin",
)
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """The wing's public names, imported from their module on first use (PEP 562), so that
    importing one module of the wing loads none of the others."""
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
