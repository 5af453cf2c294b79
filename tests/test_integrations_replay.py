"""Zero-length responses (TRL's masked truncated completions) through the documented replay,
the padded layout, the advantages and the loss."""

from __future__ import annotations

import torch

from mrtpo.integrations.common import has_info_from_spans, padded_from_packed
from mrtpo.integrations.trl import fused_policy_loss, mrtpo_advantages_for_grpo
from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer, lm_head
from mrtpo.replay.api import contrastive_replay
from mrtpo.replay.prompting import ChatPrompter
from mrtpo.replay.teacher_forcing import forward_shared_prompts, teacher_batch

PROMPTS = [
    'Write a note about owls. Start with "hello". Include the word "blue".',
    'Write a note about rain. Include the word "gold". End with "bye now".',
]
TINY = TinyConfig(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1
)


def _setup():
    tok = build_tokenizer(PROMPTS * 4 + ["hello blue owls", "gold rain bye now"], vocab_size=300)
    model = build_tiny_model(tok, TINY, seed=0).eval()
    return tok, model, ChatPrompter(tok)


def _spans(p):
    return [[(p.index("Include"), p.index("Include") + 24)], [(0, 5)]]


def test_replay_accepts_empty_responses():
    tok, model, pr = _setup()
    texts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    ids = [pr.encode(p).ids for p in texts]
    responses = [[10, 11, 12], [], [13, 14, tok.eos_token_id], []]  # 2 masked truncations
    spans = [_spans(p) for p in texts]
    out = contrastive_replay(model, pr, texts, ids, responses, spans, temperature=0.9)
    keep = [0, 2]
    ref = contrastive_replay(
        model, pr, [texts[i] for i in keep], [ids[i] for i in keep],
        [responses[i] for i in keep], [spans[i] for i in keep], temperature=0.9,
    )  # fmt: skip
    assert out.hidden_p.shape[0] == out.old_logprobs.shape[0] == 6
    assert out.relevance.shape == (2, 6)
    torch.testing.assert_close(out.old_logprobs, ref.old_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.relevance, ref.relevance, rtol=1e-5, atol=1e-6)
    assert out.replayed == ref.replayed == 4  # no replay for an empty response
    assert (out.relevance > 0).any()
    # every response empty: (0, d) hidden states, no rows anywhere
    h = forward_shared_prompts(model, ids, [[]] * 4, tok.pad_token_id, micro_batch=2, device="cpu")
    assert h.shape == (0, lm_head(model)[0].shape[1])
    none = contrastive_replay(model, pr, texts, ids, [[]] * 4, spans, temperature=0.9)
    assert none.old_logprobs.shape == (0,) and none.relevance.shape == (2, 0)
    tb = teacher_batch(ids[:2], [[5], []], tok.pad_token_id, "cpu")
    assert tb.response_mask.sum(1).tolist() == [1, 0] and tb.labels.tolist() == [5]


def test_empty_responses_through_advantages_and_loss():
    """TRL's layout: completion_mask rows of masked truncations are all 0."""
    tok, model, pr = _setup()
    texts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[1]]
    ids = [pr.encode(p).ids for p in texts]
    completion_ids = torch.tensor([[10, 11, 12], [20, 21, 22], [13, 14, 15], [16, 17, 18]])
    completion_mask = torch.tensor([[1, 1, 1], [0, 0, 0], [1, 1, 0], [0, 0, 0]])
    responses = [row[m.bool()].tolist() for row, m in zip(completion_ids, completion_mask)]
    spans = [_spans(p) for p in texts]
    out = contrastive_replay(model, pr, texts, ids, responses, spans, temperature=1.0)
    relevance = padded_from_packed(out.relevance, completion_mask)  # (K, B, T)
    assert relevance.shape == (2, 4, 3) and (relevance[:, [1, 3]] == 0).all()
    has_info = has_info_from_spans(spans)
    rewards = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    adv = mrtpo_advantages_for_grpo(rewards, 2, completion_mask, relevance, has_info)
    assert torch.isfinite(adv).all() and (adv[completion_mask == 0] == 0).all()
    assert (adv[0] != 0).all() and (adv[2, :2] != 0).all()
    # a masked row still counts in its group's statistics (as in TRL): its reward matters
    other = rewards.clone()
    other[1, 0] = 0.5
    moved = mrtpo_advantages_for_grpo(other, 2, completion_mask, relevance, has_info)
    assert not torch.allclose(moved[0], adv[0])
    torch.testing.assert_close(moved[[1, 3]], adv[[1, 3]], rtol=0, atol=0)
    # the fused loss: the empty rows count in TRL's row mean and get no gradient
    weight = lm_head(model)[0].detach().clone().requires_grad_(True)
    hidden = torch.randn(4, 3, weight.shape[1], requires_grad=True)
    loss, _ = fused_policy_loss(
        hidden, weight, completion_ids, completion_mask, None, adv, epsilon_low=0.2,
        epsilon_high=0.2, beta=0.0, loss_type="grpo", temperature=1.0,
        max_completion_length=3,
    )  # fmt: skip
    loss.backward()
    assert torch.isfinite(loss) and (hidden.grad[[1, 3]] == 0).all()
    assert hidden.grad[0].abs().sum() > 0
