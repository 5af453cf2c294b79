"""The relevance modes of ``--relevance`` (METHOD.md 3, 3b), one class each: what a training
step asks of its mode, in the order it asks.

1. ``control_spans(examples, spans)``: the prompt span each response's control replay removes
   (one extra replay per response), or None for no control replay.
2. ``pointwise``: whether the replay also returns the |log p(y_t)| change of the sampled
   tokens.
3. ``relevance(replay, k, lengths, oracle)``: the (K, N) relevance of the step's response
   tokens, the one its metrics report.
4. ``allocating(relevance, has_info, lengths, control)``: the relevance that allocates each
   reward's advantage (before the gamma exponent of ``mrtpo_token_advantages``), as
   ``mrtpo.allocation.tensors.allocating_relevance`` defines each form (the home of the
   allocation decisions, shared with the TRL trainer).

The trainer looks its mode up once per step (``step_mode``). The baselines (grpo, gdpo)
allocate nothing; where they replay (``--replay-for-baselines``) they report the JS distance,
so they ask the js mode.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mrtpo.allocation.tensors import allocating_relevance

from .api import ReplayResult, control_span


class RelevanceMode:
    """What every mode does unless it says otherwise: no control replay, no pointwise
    log-ratio, the replay's JS distances as the relevance, and that relevance allocating as
    it is."""

    name: str
    pointwise = False
    # whether a reward's allocating relevance reads the other rewards' d on the same
    # response: then the replay skips whole rows only (replay_mask_from_rewards(whole_rows=))
    mixes_rewards = False

    def control_spans(self, examples, spans) -> list | None:
        return None

    def _replayed(self, rep: ReplayResult) -> torch.Tensor:
        """The (K, N) tensor of the replay that this mode reads."""
        return rep.relevance

    def relevance(
        self,
        rep: ReplayResult,
        k: int,
        lengths: torch.Tensor,
        oracle: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """(K, N) float32 on the CPU; zeros where the step ran no replay (a baseline without
        --replay-for-baselines). ``oracle`` is not called by the replay modes."""
        if rep.relevance is None:
            return torch.zeros((k, int(lengths.sum())), dtype=torch.float32)
        return self._replayed(rep).float().cpu()

    def allocating(self, relevance, has_info, lengths, control=None) -> torch.Tensor:
        """The relevance form applied (``mrtpo.allocation.tensors.allocating_relevance``)."""
        return allocating_relevance(self.name, relevance, has_info, lengths, control)


class JSRelevance(RelevanceMode):
    """js: d_k, the JS distance between the replays with and without reward k's spans,
    allocates as it is."""

    name = "js"


class SpecificRelevance(RelevanceMode):
    """specific: d_k minus the mean of the other rewards' d, floored at 0
    (``specific_relevance``; no extra forward)."""

    name = "specific"
    mixes_rewards = True


class ControlRelevance(RelevanceMode):
    """control: d_k minus d_ctrl, the distance under removal of an unchecked prompt span of
    similar length (``control_span``; one extra replay per response), floored at 0."""

    name = "control"

    def control_spans(self, examples, spans) -> list:
        return [control_span(ex.prompt, sp) for ex, sp in zip(examples, spans)]


class LogRatioRelevance(RelevanceMode):
    """logratio: |log p(y_t | prompt) - log p(y_t | prompt without reward k's spans)| of the
    sampled token, from the same replays, instead of the JS distance of the whole
    distribution."""

    name = "logratio"
    pointwise = True

    def _replayed(self, rep: ReplayResult) -> torch.Tensor:
        return rep.relevance if rep.logratio is None else rep.logratio


class OracleRelevance(RelevanceMode):
    """oracle (a diagnostic, not the method): 1 on the response tokens each verifier names,
    0 elsewhere, as ``oracle()`` gives it; already the allocation's shape."""

    name = "oracle"

    def relevance(self, rep, k, lengths, oracle) -> torch.Tensor:
        return oracle()


RELEVANCE_MODES: dict[str, RelevanceMode] = {
    mode.name: mode
    for mode in (
        JSRelevance(),
        SpecificRelevance(),
        ControlRelevance(),
        LogRatioRelevance(),
        OracleRelevance(),
    )
}


def relevance_mode(name: str) -> RelevanceMode:
    """The mode called ``name`` (a ``--relevance`` value)."""
    try:
        return RELEVANCE_MODES[name]
    except KeyError:
        raise ValueError(
            f"relevance: expected one of {tuple(RELEVANCE_MODES)}, got {name!r}"
        ) from None


def step_mode(algo: str, relevance: str) -> RelevanceMode:
    """The mode a training step asks: ``relevance`` under mrtpo, js for the baselines."""
    return relevance_mode(relevance if algo == "mrtpo" else "js")
