"""Relevance diagnostics (top-token hit rate, rank AUC, their chance levels) and credit
metrics for answers cut at the token cap."""

from __future__ import annotations

import itertools

import pytest
import torch

from mrtpo.tasks.builtin import load_task
from mrtpo.training.metrics import relevance_diagnostics, relevant_token_masks
from mrtpo.training.rollouts import Rollouts


def _auc_by_pairs(rel, mask):
    pos = [r for r, m in zip(rel, mask) if m]
    neg = [r for r, m in zip(rel, mask) if not m]
    score = 0.0
    for p, q in itertools.product(pos, neg):
        score += 1.0 if p > q else 0.5 if p == q else 0.0
    return score / (len(pos) * len(neg))


def test_diagnostics_against_hand_counts():
    # two responses (4 and 5 tokens), two rewards
    lengths = torch.tensor([4, 5])
    rel = torch.tensor(
        [
            [0.1, 0.9, 0.2, 0.2, 0.5, 0.5, 0.1, 0.3, 0.0],
            [0.3, 0.3, 0.3, 0.3, 0.0, 0.2, 0.4, 0.4, 0.1],
        ]
    )
    m = lambda *xs: torch.tensor(xs, dtype=torch.bool)
    masks = [
        [m(0, 1, 0, 0), m(1, 0, 0, 0)],
        [m(0, 1, 0, 0, 0), m(0, 0, 1, 0, 0)],
    ]
    has_info = torch.tensor([[True, True], [True, True]])
    hit, chance, auc = relevance_diagnostics(rel, masks, has_info, lengths)
    # reward 0: response 0 top token 1 (named) -> 1; response 1 tie of tokens 0 and 1,
    # one named -> 1/2
    assert hit[0] == pytest.approx((1.0 + 0.5) / 2)
    assert chance[0] == pytest.approx((1 / 4 + 1 / 5) / 2)
    # reward 1: response 0 constant -> hit = chance 1/4; response 1 tie of tokens 2, 3, one
    # named -> 1/2
    assert hit[1] == pytest.approx((0.25 + 0.5) / 2)
    want0 = (
        _auc_by_pairs(rel[0, :4].tolist(), masks[0][0])
        + _auc_by_pairs(rel[0, 4:].tolist(), masks[1][0])
    ) / 2
    want1 = (
        _auc_by_pairs(rel[1, :4].tolist(), masks[0][1])
        + _auc_by_pairs(rel[1, 4:].tolist(), masks[1][1])
    ) / 2
    assert auc[0] == pytest.approx(want0) and auc[1] == pytest.approx(want1)
    assert auc[1] != pytest.approx(0.5)  # the second response ranks its named token high


def test_diagnostics_skip_what_says_nothing():
    lengths = torch.tensor([3, 3, 3])
    rel = torch.rand(1, 9)
    masks = [
        [torch.tensor([True, True, True])],  # every token named: no ranking to judge
        [None],  # the verifier names nothing
        [torch.tensor([False, True, False])],  # no spans (has_info False)
    ]
    has_info = torch.tensor([[True], [True], [False]])
    hit, chance, auc = relevance_diagnostics(rel, masks, has_info, lengths)
    assert hit == [None] and chance == [None] and auc == [None]


def test_end_phrase_tokens_of_a_cut_answer_are_not_credit_targets():
    task = load_task("constraints-real", seed=0)
    ex = task.train[0]
    text = ex.reference
    offsets = [(i, i + 1) for i in range(len(text))]
    ro = Rollouts(
        examples=[ex, ex],
        group_ids=torch.tensor([0, 0]),
        prompt_ids=[[1], [1]],
        responses=[list(range(len(text)))] * 2,
        texts=[text, text],
        offsets=[offsets, offsets],
        rewards=torch.ones(2, 3),
        spans=[[(), (), ()]] * 2,
        reasons=[[None] * 3] * 2,
        truncated=[False, True],
    )
    names = [v.name for v in task.verifiers]
    end = names.index("end_phrase")
    masks = relevant_token_masks(task, ro)
    assert masks[0][end] is not None and bool(masks[0][end].any())
    assert masks[1][end] is None  # cut at the cap: the end was never reached
    start = names.index("start_phrase")
    assert torch.equal(masks[0][start], masks[1][start])  # the start is judged either way


def test_real_task_asks_for_one_sentence_with_the_same_rewards():
    real, plain = load_task("constraints-real", seed=3), load_task("constraints", seed=3)
    assert [v.name for v in real.verifiers] == [v.name for v in plain.verifiers]
    assert all(ex.prompt.startswith("Write one sentence about ") for ex in real.train)
    four = load_task("constraints-real:start_phrase,keyword_include,end_phrase,no_commas")
    assert len(four.verifiers) == 4
    for ex in four.train[:20]:
        assert all(float(v(ex, ex.reference).score) == 1.0 for v in four.verifiers)
