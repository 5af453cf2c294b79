"""mrtpo-kernels: fused kernels for multi-reward token-level policy optimization (MRTPO).

Public API (semantics in docs/METHOD.md; every op has a float64 reference in
``mrtpo_kernels.reference``; ``OPS`` maps each op to its kernels, reference, tests and
benchmark):

- ``linear_logprobs``: per-token log-probs (and entropy) fused with the LM head, autograd.
- ``logprobs_from_logits``: the same from existing logits, streaming over the vocabulary.
- ``linear_js_distance``: per-token JS distance between two hidden streams, one-vs-many.
- ``js_distance``: the same from existing logits.
- ``linear_policy_loss``: clipped surrogate with the gradient computed in the forward pass.
- ``gdpo_advantages``, ``mrtpo_token_advantages``: GDPO and MRTPO advantages.
- ``specific_relevance``: the sharper relevance of METHOD.md section 3b (specific, control).
- ``ADVANTAGE_DEFAULTS`` (an ``AdvantageSettings``, frozen): the advantage ops'
  hyper-parameter defaults, defined once (the ops, their references, the adapters);
  ``advantage_settings``: their one check layer (an ``AdvantageSettings`` with keywords put
  over it, every field checked), which the adapters carry down to the ops as ``settings=``.
- ``POLICY_LOSS_DEFAULTS`` (a ``PolicyLossSettings``, frozen): the policy loss's scalar
  settings' defaults; ``TEMPERATURE`` and ``IGNORE_INDEX``: the defaults every op shares.

Backend queries: ``available_backends``, ``resolve_backend``, ``backend_status``.
Validation helper: ``check_tensor`` (ValueError naming the argument).
Public modules: ``mrtpo_kernels.reference`` (float64 references), ``mrtpo_kernels.settings``
(every ``MRTPO_*`` variable), ``mrtpo_kernels.chunk_plan`` (the chunk driver's plan and its
stages on their own, for benchmarks).
"""

from ._advantage_settings import advantage_settings
from ._catalog import OPS, Op
from ._dispatch import available_backends, backend_status, resolve_backend
from ._types import (
    ADVANTAGE_DEFAULTS,
    IGNORE_INDEX,
    POLICY_LOSS_DEFAULTS,
    TEMPERATURE,
    AdvantageSettings,
    GDPOAdvantages,
    PolicyLossSettings,
    TokenAdvantages,
)
from ._validation import check_tensor
from .advantages import gdpo_advantages, mrtpo_token_advantages, specific_relevance
from .js import js_distance, linear_js_distance
from .logprobs import linear_logprobs, logprobs_from_logits
from .policy_loss import linear_policy_loss

__version__ = "0.1.0"

__all__ = [
    "ADVANTAGE_DEFAULTS",
    "IGNORE_INDEX",
    "OPS",
    "POLICY_LOSS_DEFAULTS",
    "TEMPERATURE",
    "AdvantageSettings",
    "GDPOAdvantages",
    "Op",
    "PolicyLossSettings",
    "TokenAdvantages",
    "advantage_settings",
    "available_backends",
    "backend_status",
    "check_tensor",
    "gdpo_advantages",
    "js_distance",
    "linear_js_distance",
    "linear_logprobs",
    "linear_policy_loss",
    "logprobs_from_logits",
    "mrtpo_token_advantages",
    "resolve_backend",
    "specific_relevance",
]
