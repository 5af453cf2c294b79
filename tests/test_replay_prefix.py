"""The replay's cheaper forwards (issue 33 item 2): a replay unit starts from the full
prompt's key/value cache at their longest common token prefix, the JS runs only on kept
(row, reward) pairs, and teacher-forced responses go through the cache in bounded pieces
with no (rows, R, P + R) mask. Same values as plain full forwards, to float tolerance; the
replay skip's bitwise identity is in tests/test_replay.py."""

from __future__ import annotations

import pytest
import torch
from test_replay import PROMPTS, TINY  # the replay tests' prompts and tiny model shape

import mrtpo.replay.engine as replay_mod
from mrtpo.model.loading import build_tiny_model, build_tokenizer, lm_head
from mrtpo.replay.api import replay_relevance
from mrtpo.replay.engine import _replay_core, _stream_ids
from mrtpo.replay.prompting import ChatPrompter
from mrtpo.replay.teacher_forcing import (
    forward_after_prefix,
    forward_responses,
    forward_shared_prompts,
)
from mrtpo_kernels.reference import js_distance_ref


def _setup():
    tok = build_tokenizer(PROMPTS * 4 + ["hello blue owls", "gold rain bye now"], vocab_size=300)
    model = build_tiny_model(tok, TINY, seed=0).eval()
    return tok, model


class _FedTokens:
    """Counts the tokens fed to the decoder, per call: (input_ids shape, mask given)."""

    def __init__(self, model):
        self.calls = []
        self.handle = model.model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.calls.append((tuple(ids.shape), kwargs.get("attention_mask") is not None))

    def tokens(self):
        return sum(s[0] * s[1] for s, _ in self.calls)


def _plain_hidden(model, prompt, response):
    """The hidden states predicting ``response`` after ``prompt``: one unpadded forward."""
    with torch.no_grad():
        h = model.model(input_ids=torch.tensor([list(prompt) + list(response)])).last_hidden_state
    return h[0, len(prompt) - 1 : len(prompt) - 1 + len(response)]


def test_forward_after_prefix_equals_plain_forwards():
    """The prompt's first L tokens from another prompt's cache (the full prompt's), only the
    rest of the prompt and the responses run: the hidden states of full unpadded forwards."""
    tok, model = _setup()
    full = ChatPrompter(tok).encode(PROMPTS[0]).ids
    q = ChatPrompter(tok).encode(PROMPTS[0], remove=[(PROMPTS[0].index("Include"), 69)]).ids
    n = next(i for i, (a, b) in enumerate(zip(full, q)) if a != b)
    assert 0 < n < len(q) - 1
    responses = [[10, 11, 12], [13], [], [14, 15, 16, 17, tok.eos_token_id]]
    prefixes = {}
    forward_shared_prompts(model, [full, full[:-2]], [[5, 6], [7]], tok.pad_token_id,
                           micro_batch=4, device="cpu", prefixes=prefixes)  # fmt: skip
    assert set(prefixes) == {tuple(full), tuple(full[:-2])}
    for cut in (n, 1, len(q) - 1):  # the common prefix, one token, all but one of q
        src = full if cut <= n else q
        if src is q:  # a prefix longer than the common one: q's own cache
            forward_shared_prompts(model, [q], [[5]], tok.pad_token_id, micro_batch=1,
                                   device="cpu", prefixes=prefixes)  # fmt: skip
        kv = [(k[:, :, :cut], v[:, :, :cut]) for k, v in prefixes[tuple(src)]]
        got = forward_after_prefix(model, kv, q, responses, tok.pad_token_id, device="cpu")
        want = torch.cat([_plain_hidden(model, q, r) for r in responses if r])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="prefix"):
        kv = [(k, v) for k, v in prefixes[tuple(q)]]
        forward_after_prefix(model, kv, q, responses, tok.pad_token_id, device="cpu")


def test_unit_forward_feeds_only_the_prompt_suffix():
    """A replay unit feeds the model the prompt without the spans past its common prefix
    with the full prompt (at least one token), then its rows' responses; the full prompt is
    run once, in the with-information forward. Counted at the decoder's input."""
    tok, model = _setup()
    pr = ChatPrompter(tok)
    p = PROMPTS[0]
    span = (p.index("Include"), len(p))  # near the end: a long common prefix
    full = pr.encode(p).ids
    q = pr.encode(p, remove=[span]).ids
    n = next(i for i, (a, b) in enumerate(zip(full, q)) if a != b)
    assert n > len(q) // 2
    responses = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
    enc = lambda x: pr.encode(x).ids  # noqa: E731
    counter = _FedTokens(model)
    try:
        rep = replay_relevance(model, [p] * 3, responses, [[[span]]] * 3, temperature=0.9,
                               encode=enc, pad_token_id=tok.pad_token_id)  # fmt: skip
    finally:
        counter.handle.remove()
    r_width = 4
    # with information: the prompt once, the 3 responses; the unit: one packed row of q[n:]
    # and each response but its last token (which predicts nothing)
    packed = (len(q) - n) + sum(len(r) - 1 for r in responses)
    assert counter.tokens() == len(full) + 3 * r_width + packed
    assert [s for s, _ in counter.calls] == [(1, len(full)), (3, r_width), (1, packed)]
    # no mask for the unpadded responses after the prompt's cache; the packed row's 4-D one
    assert [m for _, m in counter.calls[1:]] == [False, True]
    assert rep.replayed == 3 and bool((rep.relevance > 0).any())


@pytest.mark.parametrize("why", ["eager", "sliding_window", "max_piece", "row_tokens"])
def test_unit_forward_runs_suffix_then_responses_where_it_cannot_pack(why, monkeypatch):
    """Where the packed row does not apply (attention that would not take the 4-D mask as
    given, a sliding window the mask would override, more tokens than one piece or than
    PACKED_ROW_TOKENS, past which its masked attention costs more than a forward), the unit
    runs its prompt suffix once, then the responses through its cache: the same hidden
    states as the packed row, to float tolerance."""
    tok, model = _setup()
    pr = ChatPrompter(tok)
    p = PROMPTS[0]
    full = pr.encode(p).ids
    q = pr.encode(p, remove=[(p.index("Include"), len(p))]).ids
    n = next(i for i, (a, b) in enumerate(zip(full, q)) if a != b)
    responses = [[10, 11, 12], [13, 14], [15, 16, 17, 18]]
    prefixes = {}
    forward_shared_prompts(model, [full], [[5]], tok.pad_token_id, micro_batch=1, device="cpu",
                           prefixes=prefixes)  # fmt: skip
    kv = [(k[:, :, :n], v[:, :, :n]) for k, v in prefixes[tuple(full)]]
    packed = forward_after_prefix(model, kv, q, responses, tok.pad_token_id, device="cpu")
    kw = {"max_piece": 4} if why == "max_piece" else {}
    if why == "eager":
        model.config._attn_implementation = "eager"
    elif why == "sliding_window":
        model.config.sliding_window, model.config.use_sliding_window = 4096, True
    elif why == "row_tokens":
        import mrtpo.replay.teacher_forcing as tf

        monkeypatch.setattr(tf, "PACKED_ROW_TOKENS", 4)
    counter = _FedTokens(model)
    try:
        got = forward_after_prefix(model, kv, q, responses, tok.pad_token_id, device="cpu", **kw)
    finally:
        counter.handle.remove()
    assert counter.calls[0] == ((1, len(q) - n), False)  # the suffix alone, no mask
    assert all(s[0] == 3 for s, _ in counter.calls[1:])  # then the 3 responses together
    torch.testing.assert_close(got, packed, rtol=1e-5, atol=1e-5)
    want = torch.cat([_plain_hidden(model, q, r) for r in responses])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mixed_lengths", [False, True])
def test_prefix_reuse_relevance_matches_plain_full_forwards(mixed_lengths):
    """Relevance with prefix reuse and JS on kept pairs only against per-row plain full
    forwards (fp32, unpadded, JS of the full logits) and against the engine without reuse
    (one forward per whole prompt without spans, one JS over all used rows)."""
    tok, model = _setup()
    pr = ChatPrompter(tok)
    p0, p1 = PROMPTS
    s0 = [[(0, 5)], [(p0.index("Start"), p0.index("Include"))], [(p0.index("Include"), 69)]]
    s1 = [[(p1.index("rain"), p1.index("rain") + 4)], [], [(p1.index("End"), len(p1))]]
    prompts = [p0, p0, p1, p1, p1] if mixed_lengths else [p0, p0, p0]
    spans = [s0, s0, s1, s1, s1] if mixed_lengths else [s0, s0, s0]
    responses = [[10, 11, 12], [13], [20, 21], [22, 23, 24, 25], [26, 27]][: len(prompts)]
    full = [pr.encode(p).ids for p in prompts]
    streams = _stream_ids(prompts, spans, lambda x: pr.encode(x).ids)
    kw = dict(num_streams=3, pad_id=tok.pad_token_id, temperature=0.8, micro_batch=8)
    new = _replay_core(model, full, streams, responses, **kw)
    old = _replay_core(model, full, streams, responses, reuse=False, **kw)
    torch.testing.assert_close(new.distance, old.distance, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(new.old_logprobs, old.old_logprobs, rtol=0, atol=0)
    w, _ = lm_head(model)
    pos = 0
    for i, r in enumerate(responses):
        lp = _plain_hidden(model, full[i], r) @ w.T
        for j in range(3):
            got = new.distance[j, pos : pos + len(r)]
            if streams[i][j] is None:
                assert bool((got == 0).all())
                continue
            lq = _plain_hidden(model, streams[i][j], r) @ w.T
            want = js_distance_ref(lp.double(), lq.double(), temperature=0.8).float()
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        pos += len(r)
    assert bool((new.distance > 1e-3).any())


def test_js_runs_on_kept_pairs_only_and_single_tokens_are_bitwise(monkeypatch):
    """Rows grouped by their kept rewards: the JS sees each kept (row, reward) pair once
    and no pair that was not kept (besides the few copies that keep a GEMM at 4+ rows);
    one-token responses keep the kept pairs' distances bit for bit."""
    tok, model = _setup()
    pr = ChatPrompter(tok)
    p0 = PROMPTS[0]
    s0 = [[(0, 5)], [(p0.index("Start"), p0.index("Include"))], [(p0.index("Include"), 69)]]
    responses = [[10], [11], [12, 13, 14, 15, 16], [17]]
    full = [pr.encode(p0).ids] * 4
    streams = _stream_ids([p0] * 4, [s0] * 4, lambda x: pr.encode(x).ids)
    kw = dict(num_streams=3, pad_id=tok.pad_token_id, temperature=0.8, micro_batch=8)
    ref = _replay_core(model, full, streams, responses, **kw)
    seen = []
    real = replay_mod.linear_js_distance

    def counting(hp, hq, *a, **k):
        seen.append(tuple(hq.shape[:2]))
        return real(hp, hq, *a, **k)

    monkeypatch.setattr(replay_mod, "linear_js_distance", counting)
    keep = [[True, False, False], [False, True, True], [False, True, True], [False, False, True]]
    part = _replay_core(model, full, streams, responses, keep=keep, **kw)
    # groups: {0}: row 0 (1 token, padded to 4); {1, 2}: rows 1, 2 (6 tokens); {2}: row 3
    assert sorted(seen) == sorted([(1, 4), (2, 6), (1, 4)])
    starts = [0, 1, 2, 7, 8]
    for i, row in enumerate(keep):
        for j, kp in enumerate(row):
            got = part.distance[j, starts[i] : starts[i + 1]]
            if kp:
                assert torch.equal(got, ref.distance[j, starts[i] : starts[i + 1]]), (i, j)
            else:
                assert bool((got == 0).all())


@pytest.mark.parametrize("lengths", ["same", "mixed"])
def test_tail_pieces_are_bounded_and_change_nothing(lengths):
    """Responses through the cache in pieces of at most max_piece tokens: the same hidden
    states as unpadded full forwards; a mask only where prompts are left-padded."""
    tok, model = _setup()
    pr = ChatPrompter(tok)
    a, b = (pr.encode(p).ids for p in PROMPTS)
    if lengths == "same":
        prompts, responses = [a, a, a], [[10, 11, 12, 13, 14, 15, 16], [17, 18], [19] * 5]
    else:
        prompts, responses = [a, b[:-3], a], [[10, 11, 12, 13, 14, 15, 16], [17, 18], [19] * 5]
    want = forward_responses(model, prompts, responses, tok.pad_token_id, micro_batch=1,
                             device="cpu")  # fmt: skip
    counter = _FedTokens(model)
    try:
        got = forward_shared_prompts(model, prompts, responses, tok.pad_token_id, micro_batch=8,
                                     device="cpu", max_piece=3)  # fmt: skip
    finally:
        counter.handle.remove()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    tails = counter.calls[1:]
    assert [s[1] for s, _ in tails] == [3, 3, 1] and all(s[0] == 3 for s, _ in tails)
    assert all(m == (lengths == "mixed") for _, m in tails)
    with pytest.raises(ValueError, match="max_piece"):
        forward_shared_prompts(model, prompts, responses, tok.pad_token_id, micro_batch=8,
                               device="cpu", max_piece=0)  # fmt: skip
