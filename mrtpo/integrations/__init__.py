"""Thin adapters that put MRTPO credit assignment and the fused kernels into existing
trainers: TRL (``mrtpo.integrations.trl``), verl (``mrtpo.integrations.verl``) and OpenRLHF
(``mrtpo.integrations.openrlhf``), with the shared pieces in ``mrtpo.integrations.common``.

Importing these modules imports no trainer framework, except
``mrtpo.integrations.trl_trainer`` (``MRTPOGRPOTrainer(trl.GRPOTrainer)``, the ``trl``
extra); the few other functions that need one import it when called and name it in the
error when it is missing. See docs/integrations.md and docs/trl.md.
"""

from .common import (
    consecutive_group_ids,
    group_ids_from_index,
    has_info_from_spans,
    padded_from_packed,
    padded_token_advantages,
    relevance_from_hidden,
)

__all__ = [
    "consecutive_group_ids",
    "group_ids_from_index",
    "has_info_from_spans",
    "padded_from_packed",
    "padded_token_advantages",
    "relevance_from_hidden",
]
