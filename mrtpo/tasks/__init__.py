"""The built-in tasks (``--task``): ``builtin`` holds the tasks and ``load_task``; ``data``
their offline data (the shop database and its questions, tool definitions, constraint
prompts, readers of packaged benchmark data). The verifiers that reward them are their own
wing, ``mrtpo.verifiers``, which the framework adapters use without any task.

The names of ``mrtpo.tasks.builtin`` import from here too (``from mrtpo.tasks import
load_task``, the path the docs use).
"""

from __future__ import annotations

from mrtpo._lazy import lazy_exports

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

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
