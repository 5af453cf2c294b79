"""MRTPO in TRL, laid out as TRL lays out its GRPO trainer: ``config`` (``MRTPOConfig``,
TRL's ``GRPOConfig`` with MRTPO's options), ``rewards`` (reward functions that name prompt
spans, ``verifier_reward``), ``trainer`` (``MRTPOGRPOTrainer``), ``fused_head`` (its fused
log-probs and loss) and ``patches`` (what it changes in TRL while it builds).

This package imports TRL (the ``trl`` extra: ``pip install -e '.[trl]'``); the framework-free
functions (``mrtpo.integrations.trl``, ``.common``) need no TRL. docs/trl.md is the guide;
``mrtpo.integrations.trl_trainer`` re-exports the public names.
"""

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - the trl extra is not installed
    raise ImportError(
        f"{__name__} needs TRL ({exc}); install the trl extra: pip install -e '.[trl]' (the "
        "framework-free functions are in mrtpo.integrations.trl and need no TRL)"
    ) from exc

from .config import CREDIT_MODES, RELEVANCES, MRTPOConfig
from .rewards import EXAMPLE_COLUMNS, example_row, verifier_reward
from .trainer import TRAINED_ADVANTAGE_COLUMNS, MRTPOGRPOTrainer

__all__ = [
    "CREDIT_MODES",
    "EXAMPLE_COLUMNS",
    "RELEVANCES",
    "TRAINED_ADVANTAGE_COLUMNS",
    "MRTPOConfig",
    "MRTPOGRPOTrainer",
    "example_row",
    "verifier_reward",
]
