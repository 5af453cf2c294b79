"""Contrastive replay: the prompt without a reward's spans, the batched padded forwards, and
the relevance / old log-probs against direct unpadded float64 computations."""

from __future__ import annotations

import torch

from mrtpo.model import TinyConfig, build_tiny_model, build_tokenizer, lm_head
from mrtpo.prompting import ChatPrompter
from mrtpo.replay import (
    contrastive_replay,
    forward_responses,
    forward_shared_prompts,
    teacher_batch,
)
from mrtpo_kernels.reference import js_distance_ref, logprobs_from_logits_ref

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


def test_replay_prompt_is_the_prompt_without_the_spans():
    tok, _, pr = _setup()
    p = PROMPTS[0]
    spans = [(p.index("Start"), p.index("Include")), (p.index("blue") - 1, p.index("blue") + 5)]
    full, minus = pr.encode(p), pr.encode(p, remove=spans)
    stripped = p[: spans[0][0]] + p[spans[0][1] : spans[1][0]] + p[spans[1][1] :]
    assert minus.text == pr.prefix + stripped + pr.suffix
    assert minus.text == tok.apply_chat_template(
        [{"role": "user", "content": stripped}], tokenize=False, add_generation_prompt=True
    )
    assert minus.ids == tok(minus.text, add_special_tokens=False)["input_ids"]
    # the template's tokens are intact at both ends
    n_suffix = len(tok(pr.suffix, add_special_tokens=False)["input_ids"])
    assert minus.ids[:2] == full.ids[:2] and minus.ids[-n_suffix:] == full.ids[-n_suffix:]
    assert len(minus.ids) < len(full.ids)


def test_teacher_batch_layout_matches_unpadded_forwards():
    tok, model, pr = _setup()
    prompts = [pr.encode(p).ids for p in PROMPTS]
    responses = [[10, 11, 12, tok.eos_token_id], [13, 14]]
    tb = teacher_batch(prompts, responses, tok.pad_token_id, "cpu")
    assert tb.response_mask.sum(1).tolist() == [4, 2]
    h = forward_responses(model, prompts, responses, tok.pad_token_id, micro_batch=1, device="cpu")
    h_all = forward_responses(
        model, prompts, responses, tok.pad_token_id, micro_batch=8, device="cpu"
    )
    torch.testing.assert_close(h, h_all, rtol=1e-5, atol=1e-5)
    w, _ = lm_head(model)
    with torch.no_grad():
        for i, (p, r) in enumerate(zip(prompts, responses)):
            logits = model(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
            start = sum(len(x) for x in responses[:i])
            torch.testing.assert_close(
                h[start : start + len(r)] @ w.T, logits, rtol=1e-4, atol=1e-4
            )


def test_relevance_and_old_logprobs_against_direct_computation():
    tok, model, pr = _setup()
    texts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    p0 = PROMPTS[0]
    s_start = (p0.index("Start"), p0.index("Include"))
    s_inc = (p0.index("Include"), len(p0))
    p1 = PROMPTS[1]
    spans = [
        [(s_start,), (s_inc,), ()],
        [(s_start,), (), ()],
        [(), ((p1.index("Include"), p1.index("End")),), ((p1.index("End"), len(p1)),)],
    ]
    prompt_ids = [pr.encode(t).ids for t in texts]
    responses = [[20, 21, 22], [23, tok.eos_token_id], [24, 25, 26, 27, tok.eos_token_id]]
    tau = 0.7
    rep = contrastive_replay(
        model, pr, texts, prompt_ids, responses, spans, temperature=tau, micro_batch=2,
        pointwise=True,
    )  # fmt: skip
    n_tok = sum(map(len, responses))
    assert rep.relevance.shape == (3, n_tok) and rep.replayed == 5
    assert rep.logratio.shape == (3, n_tok)
    w, _ = lm_head(model)
    m64 = model.double()
    pos = 0
    with torch.no_grad():
        for i, (t, r) in enumerate(zip(texts, responses)):
            p = prompt_ids[i]
            lp = m64(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
            old = logprobs_from_logits_ref(lp / tau, torch.tensor(r))
            torch.testing.assert_close(
                rep.old_logprobs[pos : pos + len(r)].double(), old, rtol=1e-4, atol=1e-4
            )
            for k in range(3):
                got = rep.relevance[k, pos : pos + len(r)].double()
                if not spans[i][k]:
                    assert torch.all(got == 0)
                    assert torch.all(rep.logratio[k, pos : pos + len(r)] == 0)
                    continue
                q = pr.encode(t, remove=spans[i][k]).ids
                lq = m64(torch.tensor([q + r])).logits[0, len(q) - 1 : len(q) - 1 + len(r)]
                want = js_distance_ref(lp, lq, temperature=tau)
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
                assert got.max() > 0
                # logratio: |log p(y_t | prompt) - log p(y_t | prompt without the spans)|
                new = logprobs_from_logits_ref(lq / tau, torch.tensor(r))
                torch.testing.assert_close(
                    rep.logratio[k, pos : pos + len(r)].double(), (old - new).abs(),
                    rtol=1e-3, atol=1e-4,
                )  # fmt: skip
            pos += len(r)


def test_replay_can_be_skipped():
    tok, model, pr = _setup()
    rep = contrastive_replay(
        model,
        pr,
        [PROMPTS[0]],
        [pr.encode(PROMPTS[0]).ids],
        [[5, 6]],
        [[((0, 5),)]],
        temperature=1.0,
        replay=False,
    )
    assert rep.relevance is None and rep.replayed == 0 and rep.old_logprobs.shape == (2,)


def test_shared_prompt_cache_equals_separate_forwards():
    """Each distinct prompt run once, its key/value cache shared by the rows after it:
    the same hidden states as one full forward per row, in the rows' order."""
    tok, model, pr = _setup()
    a, b = (pr.encode(p).ids for p in PROMPTS)
    prompts = [a, b, a, a, b, b[:-3]]  # interleaved repeats and a shorter prompt
    responses = [[10, 11], [12], [13, 14, 15, tok.eos_token_id], [16], [17, 18, 19], [20, 21]]
    want = forward_responses(
        model, prompts, responses, tok.pad_token_id, micro_batch=1, device="cpu"
    )
    for mb in (1, 2, 16):
        got = forward_shared_prompts(
            model, prompts, responses, tok.pad_token_id, micro_batch=mb, device="cpu"
        )
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
