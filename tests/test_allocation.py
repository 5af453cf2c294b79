"""The allocation decisions (relevance form, stop credit, truncated credit) have one home,
``mrtpo.allocation``: one vocabulary and one check, and one function that applies them for
``mrtpo train`` (packed layout) and the TRL trainer (padded layout) alike (issue 44 item 2)."""

from __future__ import annotations

import itertools
import subprocess
import sys
from dataclasses import fields

import pytest
import torch

from mrtpo import allocation
from mrtpo.allocation import CREDIT_MODES, RELEVANCES, REPLAY_RELEVANCES, Allocation
from mrtpo.allocation.tensors import allocating_relevance, allocation_inputs, stop_token_at_mean
from mrtpo.replay import relevance_modes
from mrtpo.training import config, trainer


def test_the_vocabularies_are_defined_once():
    assert config.RELEVANCES is RELEVANCES and config.CREDIT_MODES is CREDIT_MODES
    choices = {f.name: f.metadata.get("choices") for f in fields(config.TrainConfig)}
    assert choices["relevance"] is RELEVANCES
    assert choices["stop_credit"] is CREDIT_MODES and choices["truncated_credit"] is CREDIT_MODES
    assert tuple(relevance_modes.RELEVANCE_MODES) == RELEVANCES
    assert set(REPLAY_RELEVANCES) < set(RELEVANCES)
    # the old import path of the one stop-token rule
    assert trainer.stop_token_at_mean is stop_token_at_mean


def test_the_vocabularies_import_no_torch():
    """``mrtpo.training.config`` (the command line's settings) imports the vocabularies
    without torch."""
    code = "import sys, mrtpo.allocation, mrtpo.training.config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(relevance="nope"), r"^relevance: expected one of \('js', 'specific', 'control'"),
        (dict(stop_credit="all"), r"^stop_credit: expected one of \('relevance', 'uniform'\)"),
        (dict(truncated_credit=1), r"^truncated_credit: expected one of .*got 1$"),
    ],
)
def test_a_bad_decision_is_refused_naming_it(kw, match):
    with pytest.raises(ValueError, match=match):
        Allocation.checked(**kw)


def test_an_adapter_names_its_own_field_and_the_forms_it_lacks():
    names = {"relevance": "mrtpo_relevance", "stop_credit": "mrtpo_stop_credit"}
    with pytest.raises(ValueError, match=r"^mrtpo_relevance: .*got 'control' \(control, "
                       r"logratio and oracle exist in `mrtpo train` only\)$"):  # fmt: skip
        Allocation.checked("control", relevances=REPLAY_RELEVANCES, names=names)
    with pytest.raises(ValueError, match="^mrtpo_stop_credit: "):
        Allocation.checked("js", "x", relevances=REPLAY_RELEVANCES, names=names)
    assert Allocation.checked("specific", "uniform", "uniform") == Allocation(
        "specific", "uniform", "uniform"
    )


def _batch(seed=0, k=3, b=5, t=7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([7, 1, 4, 2, 6])
    mask = torch.arange(t)[None, :] < lengths[:, None]
    padded = torch.rand(k, b, t, generator=g) * mask
    has_info = torch.rand(b, k, generator=g) > 0.3
    finished = torch.tensor([True, True, False, True, False])
    return padded, mask, lengths, has_info, finished


@pytest.mark.parametrize(
    "form, stop, cut", list(itertools.product(REPLAY_RELEVANCES, CREDIT_MODES, CREDIT_MODES))
)
def test_the_padded_layout_gives_the_packed_layouts_decisions(form, stop, cut):
    """TRL's (K, B, T) layout and ``mrtpo train``'s packed (K, N) layout get the same
    relevance, has_info and gamma from the same decisions."""
    padded, mask, lengths, has_info, finished = _batch()
    a = Allocation(form, stop, cut)
    rel_p, info_p, gamma_p = allocation_inputs(
        a, padded, has_info, 0.5, mask=mask, finished=finished
    )
    rel_k, info_k, gamma_k = allocation_inputs(
        a, padded[:, mask], has_info, 0.5, lengths=lengths, finished=finished
    )
    torch.testing.assert_close(rel_p[:, mask], rel_k, rtol=0, atol=0)
    assert torch.equal(info_p, info_k) and gamma_p == gamma_k
    assert gamma_k == (1.0 if stop == "uniform" else 0.5)
    if cut == "uniform":
        assert not info_k[~finished].any()
    else:
        assert torch.equal(info_k, has_info)
    if stop == "uniform":
        assert rel_k.dtype == torch.float64 and torch.all(rel_p[:, ~mask] == 0)


def test_the_stop_token_gets_the_mean_of_its_responses_other_tokens():
    rel = torch.tensor([[0.2, 0.4, 0.9, 0.5, 0.3]])
    lengths, finished = torch.tensor([3, 2]), torch.tensor([True, False])
    got = stop_token_at_mean(rel, lengths, finished, 2.0)
    want = rel.double() ** 2
    want[0, 2] = (0.2**2 + 0.4**2) / 2
    torch.testing.assert_close(got, want)


def test_no_decision_changes_nothing_and_unknown_finish_moves_no_token():
    padded, mask, lengths, has_info, finished = _batch()
    packed = padded[:, mask]
    rel, info, gamma = allocation_inputs(
        Allocation("js", "uniform", "uniform"), packed, has_info, 2.0, lengths=lengths
    )
    assert rel is packed and info is has_info and gamma == 2.0
    assert allocating_relevance("logratio", packed, has_info, lengths) is packed
    with pytest.raises(ValueError, match="lengths, mask: give exactly one"):
        allocation_inputs(Allocation(), packed, has_info, 1.0)
    with pytest.raises(ValueError, match="^relevance: 'control' needs"):
        allocating_relevance("control", packed, has_info, lengths)
    assert allocation.__all__ == ["CREDIT_MODES", "RELEVANCES", "REPLAY_RELEVANCES", "Allocation"]


def test_stop_credit_on_a_batch_without_tokens():
    """TRL masks truncated completions whole (``mask_truncated_completions``): a batch may
    hold no completion token at all, and a response of one token keeps its d^gamma."""
    rel = torch.zeros(2, 3, 4)
    mask = torch.zeros(3, 4, dtype=torch.bool)
    finished = torch.zeros(3, dtype=torch.bool)
    got, _, gamma = allocation_inputs(
        Allocation("js", "uniform"), rel, torch.ones(3, 2, dtype=torch.bool), 2.0,
        mask=mask, finished=finished,
    )  # fmt: skip
    assert got.shape == (2, 3, 4) and not got.any() and gamma == 1.0
    one = stop_token_at_mean(torch.tensor([[0.5, 0.2, 0.4]]), torch.tensor([1, 2]),
                             torch.tensor([True, True]), 1.0)  # fmt: skip
    torch.testing.assert_close(one, torch.tensor([[0.5, 0.2, 0.2]], dtype=torch.float64))
