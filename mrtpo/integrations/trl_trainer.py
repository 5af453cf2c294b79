"""TRL adapter: ``MRTPOGRPOTrainer`` (TRL's ``GRPOTrainer`` with the contrastive replay, MRTPO
(B, T) token advantages and the loss fused with the LM head), ``MRTPOConfig`` (TRL's
``GRPOConfig`` with MRTPO's options), ``verifier_reward`` and ``example_row``.

The import path of the docs and examples; the code lives in ``mrtpo.integrations.trl_grpo``
(config, rewards, trainer, fused head, patches), re-exported here. It imports TRL (the
``trl`` extra: ``pip install -e '.[trl]'``); the framework-free functions
(``mrtpo.integrations.trl``, ``.common``) need no TRL. docs/trl.md is the guide.
"""

try:
    import trl  # noqa: F401
except ImportError as exc:  # pragma: no cover - the trl extra is not installed
    raise ImportError(
        f"{__name__} needs TRL ({exc}); install the trl extra: pip install -e '.[trl]' (the "
        "framework-free functions are in mrtpo.integrations.trl and need no TRL)"
    ) from exc

from .trl_grpo import *  # noqa: E402, F403 (the TRL surface, re-exported as it is)
from .trl_grpo import __all__  # noqa: E402, F401
