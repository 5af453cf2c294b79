"""The relevance modes a training step asks (mrtpo/replay/relevance_modes.py), without a model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mrtpo.replay.api import ReplayResult, control_span
from mrtpo.replay.relevance_modes import RELEVANCE_MODES, relevance_mode, step_mode
from mrtpo.training.config import RELEVANCES
from mrtpo_kernels import specific_relevance

LENGTHS = torch.tensor([3, 2])
K, N = 2, 5


def _replay(relevance=True, logratio=False):
    g = torch.Generator().manual_seed(0)
    return ReplayResult(
        hidden_p=torch.zeros(N, 4),
        old_logprobs=torch.zeros(N),
        relevance=torch.rand(K, N, generator=g, dtype=torch.float64) if relevance else None,
        replayed=K * len(LENGTHS),
        logratio=torch.rand(K, N, generator=g, dtype=torch.float64) if logratio else None,
    )


def _no_oracle():
    raise AssertionError("only the oracle mode reads the verifiers' tokens")


def test_one_mode_per_relevance_setting():
    assert tuple(RELEVANCE_MODES) == RELEVANCES
    assert all(relevance_mode(name).name == name for name in RELEVANCES)
    with pytest.raises(ValueError, match="relevance: expected one of .*got 'jsd'"):
        relevance_mode("jsd")


def test_baselines_ask_the_js_mode():
    for algo in ("grpo", "gdpo"):
        assert step_mode(algo, "control").name == "js"
    assert step_mode("mrtpo", "control").name == "control"


def test_what_each_mode_asks_of_the_replay():
    prompt = "Write about rain. Include the word blue. End with the end."
    spans = [[[(18, 40)], []]]
    examples = [SimpleNamespace(prompt=prompt)]
    asks = {
        name: (mode.control_spans(examples, spans), mode.pointwise)
        for name, mode in RELEVANCE_MODES.items()
    }
    want_control = [control_span(prompt, spans[0])]
    assert want_control[0]  # the prompt has an unchecked stretch to remove
    assert asks == {
        "js": (None, False),
        "specific": (None, False),
        "control": (want_control, False),
        "logratio": (None, True),
        "oracle": (None, False),
    }


def test_step_relevance_per_mode():
    rep = _replay()
    for name in ("js", "specific", "control"):
        got = relevance_mode(name).relevance(rep, K, LENGTHS, _no_oracle)
        assert got.dtype == torch.float32 and torch.equal(got, rep.relevance.float())
    rep_lr = _replay(logratio=True)
    got = relevance_mode("logratio").relevance(rep_lr, K, LENGTHS, _no_oracle)
    assert torch.equal(got, rep_lr.logratio.float())
    oracle = torch.tensor([[1.0, 0, 0, 1, 0], [0, 0, 0, 0, 1]])
    assert relevance_mode("oracle").relevance(rep, K, LENGTHS, lambda: oracle) is oracle
    # no replay (a baseline without --replay-for-baselines): zeros of the step's shape
    none = relevance_mode("js").relevance(_replay(relevance=False), K, LENGTHS, _no_oracle)
    assert torch.equal(none, torch.zeros(K, N))


def test_allocating_relevance_per_mode():
    rel = _replay().relevance
    has_info = torch.tensor([[True, True], [True, False]])
    d_ctrl = torch.tensor([0.1, 0.0, 0.2, 0.05, 0.0], dtype=torch.float64)
    cu = torch.tensor([0, 3, 5])
    for name in ("js", "logratio", "oracle"):
        assert relevance_mode(name).allocating(rel, has_info, LENGTHS, d_ctrl) is rel
    got = relevance_mode("specific").allocating(rel, has_info, LENGTHS, d_ctrl)
    torch.testing.assert_close(got, specific_relevance(rel, has_info, cu_seqlens=cu))
    got = relevance_mode("control").allocating(rel, has_info, LENGTHS, d_ctrl)
    want = specific_relevance(rel, has_info, control=d_ctrl, cu_seqlens=cu)
    torch.testing.assert_close(got, want)
    assert not torch.allclose(want, specific_relevance(rel, has_info, cu_seqlens=cu))
    with pytest.raises(ValueError, match="relevance: 'control' needs the control replay"):
        relevance_mode("control").allocating(rel, has_info, LENGTHS)
