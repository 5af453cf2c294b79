"""The contrastive replay and its prompt handling (METHOD.md sections 2, 3, 5).

- ``api``: the entry points, ``replay_relevance`` (any trainer: relevance (K, B, T) and
  has_info (B, K)) and ``contrastive_replay`` (``mrtpo train``);
- ``engine``: the teacher-forced forwards with and without each reward's spans, and the JS
  distances; ``mask``: which (response, reward) pairs can move and are replayed;
- ``teacher_forcing``: prompt + response rows for one forward, and the hidden states that
  predict each response token (the trainer's policy forwards use them too);
- ``prompting``: chat templating with character offsets, span removal, character spans to
  tokens; ``spans``: the spans as verifiers name them and the prompt without them;
- ``relevance_modes``: what a training step asks of each ``--relevance`` mode.

The entry points import from here too (``from mrtpo.replay import replay_relevance``).
"""

from __future__ import annotations

from mrtpo._lazy import lazy_exports

_EXPORTS = dict.fromkeys(
    (
        "CallableLM",
        "Replay",
        "ReplayResult",
        "contrastive_replay",
        "control_span",
        "replay_mask_from_rewards",
        "replay_relevance",
    ),
    "api",
)
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
