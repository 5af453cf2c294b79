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
