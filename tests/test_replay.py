"""Contrastive replay: the prompt without a reward's spans, the batched padded forwards, and
the relevance / old log-probs against direct unpadded float64 computations."""

from __future__ import annotations

import copy

import pytest
import torch

from mrtpo.integrations.common import has_info_from_spans, padded_from_packed
from mrtpo.model.loading import (
    TinyConfig,
    build_tiny_model,
    build_tokenizer,
    decoder_layers,
    lm_head,
    task_texts,
)
from mrtpo.replay.api import CallableLM, contrastive_replay, replay_relevance
from mrtpo.replay.prompting import ChatPrompter, merge_spans
from mrtpo.replay.teacher_forcing import forward_responses, forward_shared_prompts, teacher_batch
from mrtpo.tasks.builtin import load_task
from mrtpo_kernels import linear_js_distance
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


def _three_rows():
    """The tiny setup and three rows over both prompts (two sharing the first), each with
    one reward's spans: (tok, model, prompter, texts, spans, prompt ids, responses)."""
    tok, model, pr = _setup()
    texts = [PROMPTS[0], PROMPTS[0], PROMPTS[1]]
    p0, p1 = PROMPTS
    spans = [
        [((p0.index("Start"), p0.index("Include")),), ()],
        [((p0.index("Include"), len(p0)),), ()],
        [(), ((p1.index("End"), len(p1)),)],
    ]
    prompt_ids = [pr.encode(t).ids for t in texts]
    responses = [[20, 21, 22], [23, tok.eos_token_id], [24, 25, 26, tok.eos_token_id]]
    return tok, model, pr, texts, spans, prompt_ids, responses


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


def test_replay_without_old_logprobs_computes_the_with_information_logits_once(monkeypatch):
    """old_logprobs=False (mrtpo train on-policy, where the old log-probs are the update's
    own): no log-prob op on the with-information hidden states, so the JS is the only pass
    of them through the LM head; the relevance (and the hidden states) are the same bit for
    bit, and the old log-probs are None."""
    import mrtpo.replay.engine as replay_mod

    tok, model, pr, texts, spans, prompt_ids, responses = _three_rows()
    calls = {"n": 0}
    real = replay_mod.linear_logprobs

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(replay_mod, "linear_logprobs", counted)
    kw = dict(temperature=0.7, micro_batch=2)
    full = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, **kw)
    with_lp = calls["n"]
    calls["n"] = 0
    lean = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, old_logprobs=False,
                              **kw)  # fmt: skip
    assert with_lp == 2 and calls["n"] == 0  # one per chunk of 2 rows, then none
    assert lean.old_logprobs is None and full.old_logprobs.shape == (9,)
    assert torch.equal(lean.relevance, full.relevance) and lean.relevance.abs().sum() > 0
    assert torch.equal(lean.hidden_p, full.hidden_p) and lean.replayed == full.replayed
    # pointwise needs the log-probs still (the log-ratio), but returns no old log-probs
    calls["n"] = 0
    pw = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, old_logprobs=False,
                            pointwise=True, **kw)  # fmt: skip
    assert calls["n"] > 0 and pw.old_logprobs is None and torch.equal(pw.relevance, full.relevance)


def test_replay_takes_the_with_information_hidden_states_given():
    """hidden_p given (mrtpo train on-policy: its update's forward): the replay runs only the
    prompts (their caches) instead of its with-information forward, and the relevance is
    the JS of the hidden states given: bit for bit the replay's own where they are its own
    (the same prompt caches), different where they differ; a wrong shape is a ValueError
    naming hidden_p."""
    tok, model, pr, texts, spans, prompt_ids, responses = _three_rows()
    kw = dict(temperature=0.7, micro_batch=2, old_logprobs=False)
    own = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, **kw)
    forwards = []
    hook = decoder_layers(model)[0].register_forward_hook(lambda m, a, o: forwards.append(1))
    given = contrastive_replay(model, pr, texts, prompt_ids, responses, spans,
                               hidden_p=own.hidden_p.clone(), **kw)  # fmt: skip
    n_given = len(forwards)
    forwards.clear()
    contrastive_replay(model, pr, texts, prompt_ids, responses, spans, **kw)
    hook.remove()
    assert n_given < len(forwards)  # the prompts alone, not prompt + responses
    assert torch.equal(given.relevance, own.relevance) and own.relevance.abs().sum() > 0
    moved = own.hidden_p + 0.5 * torch.randn_like(own.hidden_p)
    other = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, hidden_p=moved,
                               **kw)  # fmt: skip
    assert not torch.equal(other.relevance, own.relevance)
    assert torch.equal(other.relevance == 0, own.relevance == 0)  # the same pairs replayed
    with pytest.raises(ValueError, match="hidden_p"):
        contrastive_replay(model, pr, texts, prompt_ids, responses, spans,
                           hidden_p=own.hidden_p[:-1], **kw)  # fmt: skip


def test_replay_takes_the_prompt_caches_given_with_the_hidden_states():
    """prompt_caches given with hidden_p (mrtpo train on-policy: both from the update's
    forward): the replay runs no forward of a full prompt, only its units. Caches equal to
    the replay's own (prompt_caches) give the relevance bit for bit; caches taken from a
    teacher-forced forward of prompt + response (response_hidden(prefixes=)) hold the same
    keys and values to float32 rounding, and the relevance agrees to it. A cache given
    without hidden_p, or not a dict, is a ValueError naming prompt_caches."""
    from mrtpo.replay.teacher_forcing import prompt_caches, response_hidden

    tok, model, pr, texts, spans, prompt_ids, responses = _three_rows()
    kw = dict(temperature=0.7, micro_batch=4, old_logprobs=False)
    own = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, **kw)
    hp = own.hidden_p.clone()
    with torch.no_grad():
        mine: dict = {}
        prompt_caches(model, prompt_ids, tok.pad_token_id, micro_batch=4, device="cpu",
                      prefixes=mine)  # fmt: skip
        tf: dict = {}
        tb = teacher_batch(prompt_ids, responses, tok.pad_token_id, "cpu")
        h_tf = response_hidden(model, tb, prompts=prompt_ids, prefixes=tf)
    assert set(tf) == set(mine) == {tuple(p) for p in prompt_ids}
    for key in mine:
        for (ka, va), (kb, vb) in zip(mine[key], tf[key]):
            assert ka.shape == kb.shape == (1, 1, len(key), ka.shape[-1])
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_tf, hp, rtol=1e-5, atol=1e-6)

    prompt_rows = []  # decoder forwards over a whole full prompt (the prompt-cache forwards)
    hook = decoder_layers(model)[0].register_forward_hook(
        lambda m, a, o: prompt_rows.append(o[0].shape[1] if isinstance(o, tuple) else o.shape[1])
    )
    longest = max(len(p) for p in prompt_ids)
    alone = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, hidden_p=hp, **kw)
    n_alone = sum(1 for w in prompt_rows if w == longest)
    prompt_rows.clear()
    given = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, hidden_p=hp,
                               prompt_caches=mine, **kw)  # fmt: skip
    n_given = sum(1 for w in prompt_rows if w == longest)
    prompt_rows.clear()
    from_tf = contrastive_replay(model, pr, texts, prompt_ids, responses, spans, hidden_p=hp,
                                 prompt_caches=tf, **kw)  # fmt: skip
    hook.remove()
    assert n_alone >= 1 and n_given == 0 and sum(1 for w in prompt_rows if w == longest) == 0
    assert own.relevance.abs().sum() > 0
    assert torch.equal(alone.relevance, own.relevance)
    assert torch.equal(given.relevance, own.relevance)
    torch.testing.assert_close(from_tf.relevance, own.relevance, rtol=1e-4, atol=1e-5)
    assert given.replayed == from_tf.replayed == own.replayed
    with pytest.raises(ValueError, match="prompt_caches"):
        contrastive_replay(model, pr, texts, prompt_ids, responses, spans, prompt_caches=mine,
                           **kw)  # fmt: skip
    with pytest.raises(ValueError, match="prompt_caches"):
        contrastive_replay(model, pr, texts, prompt_ids, responses, spans, hidden_p=hp,
                           prompt_caches=[mine], **kw)  # fmt: skip
    with pytest.raises(ValueError, match="prompts"):
        response_hidden(model, tb, prompts=prompt_ids[:1], prefixes={})


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


# --------------------------------------------------------------------------- replay_relevance
# The framework-neutral replay: plain and chat prompts, padded responses, (K, B, T) out.

SYSTEM_TEMPLATE = (  # like SmolLM2's: a system turn is added when the prompt has none
    "{% if messages[0]['role'] != 'system' %}<|system|>\nYou are a helpful assistant.<|end|>\n"
    "{% endif %}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _padded(rows, width, pad, side="right"):
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        a = 0 if side == "right" else width - len(r)
        ids[i, a : a + len(r)] = torch.tensor(r, dtype=torch.long)
        mask[i, a : a + len(r)] = 1
    return ids, mask


def _f64_relevance(model, tok_ids_full, tok_ids_without, response, tau):
    """float64 JS from full logits: one unpadded forward per prompt."""
    m64 = copy.deepcopy(model).double()
    r = list(response)
    with torch.no_grad():
        p, q = list(tok_ids_full), list(tok_ids_without)
        lp = m64(torch.tensor([p + r])).logits[0, len(p) - 1 : len(p) - 1 + len(r)]
        lq = m64(torch.tensor([q + r])).logits[0, len(q) - 1 : len(q) - 1 + len(r)]
    return js_distance_ref(lp, lq, temperature=tau)


@pytest.mark.parametrize("task_name", ["constraints", "sql", "tools"])
def test_replay_relevance_equals_contrastive_replay_on_builtin_tasks(task_name):
    """The trainer's packed replay and the neutral one agree on a built-in task's prompts
    and verdict spans, and both agree with a float64 recomputation from full logits."""
    task = load_task(task_name, seed=0)
    texts = task_texts(task)[:60]
    tok = build_tokenizer(texts, vocab_size=400)
    model = build_tiny_model(tok, TINY, seed=1).eval()
    pr = ChatPrompter(tok)
    examples = task.train[:3]
    prompts, responses, spans = [], [], []
    gen = torch.Generator().manual_seed(0)
    for ex in examples:
        for g in range(2):
            text = ex.reference or "ok"
            ids = tok(text, add_special_tokens=False)["input_ids"][: 6 + 3 * g]
            if g:
                ids = ids + torch.randint(5, len(tok), (2,), generator=gen).tolist()
            resp_text = tok.decode(ids)
            prompts.append(ex.prompt)
            responses.append(ids)
            spans.append([list(v(ex, resp_text).spans) for v in task.verifiers])
    responses[1] = []  # a masked truncation
    assert any(s for row in spans for s in row), "the task's verifiers named no span"
    tau = 0.8
    prompt_ids = [pr.encode(p).ids for p in prompts]
    old = contrastive_replay(
        model, pr, prompts, prompt_ids, responses, spans, temperature=tau, micro_batch=3
    )
    new = replay_relevance(
        model, prompts, responses, spans, tokenizer=tok, chat_template=True,
        prompt_ids=prompt_ids, temperature=tau, micro_batch=2,
    )  # fmt: skip
    k = len(task.verifiers)
    assert new.relevance.shape == (k, len(prompts), max(map(len, responses)))
    torch.testing.assert_close(
        new.relevance, padded_from_packed(old.relevance, new.response_mask), rtol=1e-5, atol=1e-6
    )
    assert torch.equal(new.has_info, has_info_from_spans(spans))
    torch.testing.assert_close(new.old_logprobs[new.response_mask], old.old_logprobs)
    # the relevance as the trainer computed it before this engine: unshared full forwards
    # of every row, then one JS call over all rows
    hp = forward_responses(model, prompt_ids, responses, tok.pad_token_id, micro_batch=1,
                           device="cpu")  # fmt: skip
    hq = hp.unsqueeze(0).repeat(k, 1, 1)
    starts = [0]
    for r in responses:
        starts.append(starts[-1] + len(r))
    for i in range(len(prompts)):
        for j in range(k):
            if spans[i][j] and responses[i]:
                q = pr.encode(prompts[i], remove=spans[i][j]).ids
                hq[j, starts[i] : starts[i + 1]] = forward_responses(
                    model, [q], [responses[i]], tok.pad_token_id, micro_batch=1, device="cpu"
                )
                want = _f64_relevance(model, prompt_ids[i], q, responses[i], tau)
                got = new.relevance[j, i, : len(responses[i])].double()
                torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
    w, b = lm_head(model)
    before = linear_js_distance(hp, hq, w, bias=b, temperature=tau)
    torch.testing.assert_close(old.relevance, before, rtol=1e-4, atol=1e-5)
    assert new.replayed == sum(bool(s) and bool(r) for row, r in zip(spans, responses)
                               for s in row)  # fmt: skip


def _chat_setup(template=None):
    tok = build_tokenizer(PROMPTS * 4 + ["hello blue owls", "gold rain bye now", "be brief"],
                          vocab_size=300)  # fmt: skip
    if template is not None:
        tok.chat_template = template
    model = build_tiny_model(tok, TINY, seed=0).eval()
    return tok, model


@pytest.mark.parametrize("template", [None, SYSTEM_TEMPLATE], ids=["plain", "adds-system"])
def test_replay_relevance_chat_prompts(template):
    """Chat prompts with and without a system message, under a template that adds its own
    system turn: spans are (message, start, end) in the caller's messages; a span at the very
    start and end of a message, one covering a whole user message, overlapping spans, a
    reward without spans; left- and right-padded responses give the same result; float64
    recomputation from full logits."""
    tok, model = _chat_setup(template)
    u0, u1 = PROMPTS
    sys_msg = {"role": "system", "content": "be brief"}
    prompts = [
        [{"role": "user", "content": u0}],
        [{"role": "user", "content": u0}],
        [sys_msg, {"role": "user", "content": u1}],
        [sys_msg, {"role": "user", "content": u1}],
    ]
    spans = [
        [[(0, 0, 5)], [(0, len(u0) - 6, len(u0))], []],  # very start, very end, none
        [[(0, 0, 5)], [(0, len(u0) - 6, len(u0))], []],
        [[(1, 0, len(u1))], [(1, 3, 12), (1, 8, 20), (-1, 30, 31)], [(0, 0, 8)]],  # whole
        [[(1, 0, len(u1))], [(8, 20)], [(0, 0, 8)]],  # (start, end): the last user message
    ]
    responses = [[10, 11, 12, tok.eos_token_id], [], [15, 16, 17], [13, 14]]
    tau = 1.1
    rel = {}
    for side in ("right", "left"):
        ids, mask = _padded(responses, 5, tok.pad_token_id, side)
        out = replay_relevance(model, prompts, ids, spans, response_mask=mask, tokenizer=tok,
                               temperature=tau, micro_batch=1)  # fmt: skip
        assert out.relevance.shape == (3, 4, 5)
        assert torch.all(out.relevance[:, ~mask.bool()] == 0)
        rel[side] = out.relevance[:, mask.bool()]
    torch.testing.assert_close(rel["left"], rel["right"], rtol=1e-5, atol=1e-6)
    assert out.has_info.tolist() == [[True, True, False]] * 2 + [[True, True, True]] * 2
    assert torch.all(out.relevance[2, :2] == 0)

    def enc(messages):
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tok(text, add_special_tokens=False)["input_ids"]

    if template is not None:
        assert "You are a helpful assistant." in tok.decode(enc(prompts[0]))
    cut = {  # the prompts without each reward's spans, written out by hand
        (0, 0): [{"role": "user", "content": u0[5:]}],
        (0, 1): [{"role": "user", "content": u0[:-6]}],
        (2, 0): [sys_msg, {"role": "user", "content": ""}],
        (2, 1): [sys_msg, {"role": "user", "content": u1[:3] + u1[20:30] + u1[31:]}],
        (2, 2): [{"role": "system", "content": ""}, {"role": "user", "content": u1}],
        (3, 1): [sys_msg, {"role": "user", "content": u1[:8] + u1[20:]}],
    }
    for (i, k), without in cut.items():
        r = responses[i]
        want = _f64_relevance(model, enc(prompts[i]), enc(without), r, tau)
        got = out.relevance[k, i][mask[i].bool()].double()  # left-padded: the mask's tokens
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
        assert got.max() > 0
    assert torch.all(out.relevance[:, 1] == 0)  # empty response


def test_replay_relevance_plain_prompts_and_callable_model():
    """Plain prompts tokenized as they are (TRL's plain-text datasets), a list of responses,
    and the same model given as a CallableLM (whole-row forwards, no cache sharing)."""
    tok, model = _chat_setup()
    p0, p1 = PROMPTS
    prompts = [p0, p0, p1]
    spans = [[[(p0.index("Start"), p0.index("Include"))]], [[(p0.index("Start"), len(p0))]],
             [[(0, 5), (3, 9)]]]  # fmt: skip
    responses = [[10, 11, 12], [13], [14, 15]]
    tau = 0.9
    out = replay_relevance(model, prompts, responses, spans, tokenizer=tok, temperature=tau)
    assert out.relevance.shape == (1, 3, 3) and out.response_mask.sum().item() == 6
    for i, p in enumerate(prompts):
        without = p
        for a, e in reversed(merge_spans(spans[i][0])):
            without = without[:a] + without[e:]
        want = _f64_relevance(model, tok(p)["input_ids"], tok(without)["input_ids"],
                              responses[i], tau)  # fmt: skip
        torch.testing.assert_close(out.relevance[0, i, : len(responses[i])].double(), want,
                                   rtol=1e-3, atol=1e-4)  # fmt: skip
    w, b = lm_head(model)

    def hidden(input_ids, attention_mask, position_ids):
        out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False)  # fmt: skip
        return out.last_hidden_state

    via_fn = replay_relevance(CallableLM(hidden, w, b), prompts, responses, spans,
                              tokenizer=tok, temperature=tau, micro_batch=2)  # fmt: skip
    torch.testing.assert_close(via_fn.relevance, out.relevance, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(via_fn.old_logprobs, out.old_logprobs, rtol=1e-5, atol=1e-5)


def test_replay_relevance_takes_spans_as_integer_arrays():
    """Issue 41, item 11: spans given as a numpy array or a tensor (one span per row, or a
    list of 1-D rows) replay as the same spans given as tuples; a float array is refused,
    naming the sample and the reward."""
    import numpy as np

    tok, model = _chat_setup()
    p0, p1 = PROMPTS
    lists = [[[(0, 5), (9, 14)], []], [[(3, 8)], [(0, 4)]]]
    arrays = [[np.array([[0, 5], [9, 14]]), np.zeros((0, 2), dtype=np.int64)],
              [[torch.tensor([3, 8])], torch.tensor([[0, 4]])]]  # fmt: skip
    ok = dict(tokenizer=tok, temperature=1.0)
    want = replay_relevance(model, [p0, p1], [[10, 11], [12]], lists, **ok)
    got = replay_relevance(model, [p0, p1], [[10, 11], [12]], arrays, **ok)
    assert torch.equal(got.relevance, want.relevance) and bool(want.relevance.any())
    assert torch.equal(got.has_info, want.has_info)
    with pytest.raises(ValueError, match=r"spans\[1\]\[0\]: spans given as an array must be "
                                         r"integers"):  # fmt: skip
        replay_relevance(model, [p0, p1], [[10], [12]], [[[], []], [np.array([[0.0, 2.0]]), []]],
                         **ok)  # fmt: skip


def test_replay_of_a_span_covering_the_whole_plain_prompt():
    """Issue 41, item 4: spans covering a whole plain prompt left no token and the decoder
    died ("cannot reshape tensor of 0 elements"). That replay runs after the one-token
    context of the model's BOS token, else its EOS (this tokenizer adds no BOS): the response
    after no prompt at all, checked against float64 logits; a chat prompt keeps the
    template's frame. Without any such token it is a ValueError naming sample and reward."""
    tok, model = _chat_setup()
    p0, p1 = PROMPTS
    assert tok("")["input_ids"] == [] and model.config.bos_token_id is None
    eos = model.config.eos_token_id
    spans = [[[(0, len(p0))], [(0, 5)]], [[(0, 10), (8, len(p1))], []]]
    responses = [[10, 11, 12], [13, 14]]
    out = replay_relevance(model, [p0, p1], responses, spans, tokenizer=tok, temperature=0.8)
    assert out.has_info.tolist() == [[True, True], [True, False]]
    for i, p in enumerate((p0, p1)):
        want = _f64_relevance(model, tok(p)["input_ids"], [eos], responses[i], 0.8)
        got = out.relevance[0, i, : len(responses[i])].double()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-4)
        assert bool((got > 0).all())
    # a BOS in the model's config is taken first
    bos_model = copy.deepcopy(model)
    bos_model.config.bos_token_id = 7
    out7 = replay_relevance(bos_model, [p0], [responses[0]], [spans[0][:1]], tokenizer=tok,
                            temperature=0.8)  # fmt: skip
    want = _f64_relevance(model, tok(p0)["input_ids"], [7], responses[0], 0.8)
    torch.testing.assert_close(out7.relevance[0, 0].double(), want, rtol=1e-3, atol=1e-4)
    # mrtpo train's packed front end: the chat template's frame stays
    pr = ChatPrompter(tok)
    rep = contrastive_replay(model, pr, [p0], [pr.encode(p0).ids], [responses[0]],
                             [[[(0, len(p0))]]], temperature=0.8)  # fmt: skip
    assert pr.encode("").ids and bool((rep.relevance > 0).all())
    # neither a BOS nor an EOS known: refused, naming the sample and the reward
    w, b = lm_head(model)

    def hidden(input_ids, attention_mask, position_ids):
        out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False)  # fmt: skip
        return out.last_hidden_state

    def encode(prompt):
        return tok(prompt)["input_ids"]

    with pytest.raises(ValueError, match=r"spans\[1\]\[0\]: the prompt without these spans "
                                         r"renders to no token"):  # fmt: skip
        replay_relevance(CallableLM(hidden, w, b), [p0, p1], responses,
                         [[[(0, 5)], []], spans[1]], encode=encode, temperature=0.8)  # fmt: skip
    with pytest.raises(ValueError, match="prompts: sample 1 renders to no token"):
        replay_relevance(model, [p0, ""], responses, [[[], []], [[], []]], tokenizer=tok,
                         temperature=0.8)  # fmt: skip


def test_replay_relevance_tokens_merged_across_the_cut():
    """The prompt without a span is tokenized afresh, so tokens merging across the cut are
    the shorter prompt's real tokens (not the full prompt's tokens with some deleted)."""
    tok, model = _chat_setup()
    p = "hello blue owls"
    span = (p.index("blue") - 1, p.index("blue") + 4)  # " blue": "hello" and " owls" meet
    out = replay_relevance(model, [p], [[10, 11]], [[[span]]], tokenizer=tok, temperature=1.0,
                           add_special_tokens=False)  # fmt: skip
    full = tok(p, add_special_tokens=False)["input_ids"]
    cut = tok("hello owls", add_special_tokens=False)["input_ids"]
    want = _f64_relevance(model, full, cut, [10, 11], 1.0)
    torch.testing.assert_close(out.relevance[0, 0].double(), want, rtol=1e-3, atol=1e-4)


def test_replay_relevance_errors():
    tok, model = _chat_setup()
    p = PROMPTS[0]
    ok = dict(tokenizer=tok, temperature=1.0)
    with pytest.raises(ValueError, match=r"spans\[0\]\[0\].*ends past"):
        replay_relevance(model, [p], [[5]], [[[(0, len(p) + 1)]]], **ok)
    with pytest.raises(ValueError, match="names message 3"):
        replay_relevance(model, [[{"role": "user", "content": p}]], [[5]], [[[(3, 0, 1)]]], **ok)
    with pytest.raises(ValueError, match="sample 1 needs one entry per reward"):
        replay_relevance(model, [p, p], [[5], [6]], [[[]], [[], []]], **ok)
    with pytest.raises(ValueError, match="prompt_ids: row 0"):
        replay_relevance(model, [p], [[5]], [[[]]], prompt_ids=[[1, 2, 3]], **ok)
    with pytest.raises(ValueError, match="tokenizer, encode"):
        replay_relevance(model, [p], [[5]], [[[]]], temperature=1.0)
    with pytest.raises(ValueError, match="prompts: expected a string or a list"):
        replay_relevance(model, [3], [[5]], [[[]]], **ok)
    none = replay_relevance(model, [], [], [], num_rewards=2, **ok)
    assert none.relevance.shape == (2, 0, 0) and none.has_info.shape == (0, 2)


def test_span_convention():
    """mrtpo.replay.spans: what a reward function may return, and span checks."""
    import numpy as np

    from mrtpo.replay.spans import normalize_spans, prompt_without_spans, score_and_spans
    from mrtpo.verifiers.base import Verdict

    assert score_and_spans(0.5) == (0.5, None)
    assert score_and_spans((1.0, [(0, 3)])) == (1.0, [(0, 3)])
    assert score_and_spans((1.0, None)) == (1.0, None)
    assert score_and_spans(Verdict(0.0, ((2, 4),))) == (0.0, [(2, 4)])
    with pytest.raises(ValueError, match="must be \\(score, spans\\)"):
        score_and_spans((1.0, [], "x"))
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello world"},
            {"role": "assistant", "content": "hi"}]  # fmt: skip
    assert normalize_spans(msgs, [(0, 5), (-2, 3, 8), (1, np.int64(4), 6)]) == {1: [(0, 8)]}
    assert normalize_spans("abcdef", [(1, 1), (2, 4), (3, 6)]) == {None: [(2, 6)]}
    assert normalize_spans("abc", []) == {} and normalize_spans("abc", None) == {}
    out = prompt_without_spans(msgs, normalize_spans(msgs, [(1, 0, 11)]))
    assert out[1]["content"] == "" and msgs[1]["content"] == "hello world"  # copied
    with pytest.raises(ValueError, match="no user message"):
        normalize_spans([{"role": "system", "content": "x"}], [(0, 1)])
    with pytest.raises(ValueError, match="not a string"):
        normalize_spans([{"role": "user", "content": [{"type": "text"}]}], [(0, 0, 1)])
    with pytest.raises(ValueError, match="non-integer"):
        normalize_spans("abc", [(True, 2)])
    with pytest.raises(ValueError, match="0 <= start <= end"):
        normalize_spans("abc", [(2, 1)])


def test_replay_relevance_token_budget():
    """max_tokens bounds each chunk's padded prompt + response tokens (groups are split, a
    row over the budget is a chunk of its own): the same relevance, more forwards."""
    tok, model = _chat_setup()
    p0, p1 = PROMPTS
    prompts = [p0] * 3 + [p1] * 3
    spans = [[[(0, 5)], [(p0.index("Start"), p0.index("Include"))]]] * 3 + [[[(0, 5)], []]] * 3
    responses = [[10, 11, 12], [13], [14, 15], [16, 17, 18, 19], [], [20]]
    base = replay_relevance(model, prompts, responses, spans, tokenizer=tok, temperature=0.8)
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda mod, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
        with_kwargs=True,
    )
    try:
        got = replay_relevance(model, prompts, responses, spans, tokenizer=tok,
                               temperature=0.8, max_tokens=100)  # fmt: skip
    finally:
        hook.remove()
    torch.testing.assert_close(got.relevance, base.relevance, rtol=1e-5, atol=1e-6)
    assert got.replayed == base.replayed == 3 * 2 + 2
    assert len(shapes) > 4  # the budget split the work into more forwards
    assert all(b * t <= 100 or b == 1 for b, t in shapes), shapes  # each forward in budget
    assert any(b > 1 for b, _ in shapes)  # and still batched several rows
    with pytest.raises(ValueError, match="max_tokens"):
        replay_relevance(model, prompts, responses, spans, tokenizer=tok, temperature=0.8,
                         max_tokens=0)  # fmt: skip


# --------------------------------------------------------------------------- replay_mask


def _random_rewards(gen, sizes, k):
    """(n, K) rewards over groups of ``sizes``: per (group, reward) all equal, all zero, a
    response at its group's mean, binary or graded, at random; group ids (n,)."""
    cols, gids = [], []
    for g, size in enumerate(sizes):
        block = torch.empty((size, k), dtype=torch.float32)
        for j in range(k):
            kind = int(torch.randint(0, 5, (1,), generator=gen))
            if kind == 0:  # zero variance
                block[:, j] = float(torch.randint(0, 2, (1,), generator=gen))
            elif kind == 1:  # all zero
                block[:, j] = 0.0
            elif kind == 2 and size >= 3:  # one response at the group's mean (0.5)
                block[:, j] = torch.tensor([0.0, 1.0] * size)[:size]
                block[0, j], block[1, j] = 0.0, 1.0
                block[2:, j] = 0.5 if size % 2 else block[2:, j]
                if size % 2 == 0:
                    block[2, j], block[3, j] = 0.5, 0.5
            elif kind == 3:
                block[:, j] = torch.randint(0, 2, (size,), generator=gen).float()
            else:
                block[:, j] = torch.rand(size, generator=gen).round(decimals=1)
        cols.append(block)
        gids += [g] * size
    return torch.cat(cols), torch.tensor(gids)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_replay_mask_leaves_token_advantages_bit_for_bit(k):
    """Zeroing the relevance of every pair replay_mask_from_rewards leaves out (and, either
    way, has_info of those pairs) gives token advantages equal bit for bit to the full
    relevance's, whatever the options: those pairs have lambda_k A_k = 0, so their weights
    multiply 0, and the divisor D (batch std, cancellation floor) reads only the A_k."""
    from mrtpo.replay.api import replay_mask_from_rewards
    from mrtpo_kernels import mrtpo_token_advantages

    gen = torch.Generator().manual_seed(k)
    options = [
        {},
        {"alpha": 0.5, "gamma": 2.0},
        {"clip": (0.2, 3.0), "batch_norm": "token"},
        {"weights": torch.tensor([1.0, 0.0, 2.0, 0.5][:k]), "delta": 0.0},
        {"eps": 0.0, "eps_batch": 1e-4},
    ]
    skipped_any = kept_any = False
    for trial in range(12):
        sizes = [int(torch.randint(1, 6, (1,), generator=gen)) for _ in range(4)]
        rewards, gids = _random_rewards(gen, sizes, k)
        n = rewards.shape[0]
        lengths = torch.randint(1, 9, (n,), generator=gen)
        cu = torch.zeros(n + 1, dtype=torch.long)
        cu[1:] = lengths.cumsum(0)
        rel = torch.rand((k, int(cu[-1])), generator=gen)
        rel[rel < 0.3] = 0.0
        if trial % 3 == 0:  # some all-zero relevance rows
            rel[:, cu[0] : cu[1]] = 0.0
        has_info = torch.rand((n, k), generator=gen) < 0.8
        opts = options[trial % len(options)]
        mask_opts = {key: opts[key] for key in ("weights", "eps") if key in opts}
        keep = replay_mask_from_rewards(rewards, gids, has_info=has_info, **mask_opts)
        assert not bool((keep & ~has_info).any())
        tok_mask = torch.zeros_like(rel, dtype=torch.bool)
        for i in range(n):
            tok_mask[:, cu[i] : cu[i + 1]] = keep[i][:, None]
        skipped = rel * tok_mask  # the skipped pairs' relevance is 0
        full = mrtpo_token_advantages(rewards, gids, rel, has_info=has_info, cu_seqlens=cu,
                                      **opts)  # fmt: skip
        for info in (has_info, has_info & keep):
            part = mrtpo_token_advantages(rewards, gids, skipped, has_info=info,
                                          cu_seqlens=cu, **opts)  # fmt: skip
            assert torch.equal(part.token, full.token), (k, trial, opts)
        skipped_any |= bool((has_info & ~keep).any())
        kept_any |= bool(keep.any())
    assert skipped_any and kept_any  # both kinds of pair were met


def test_replay_mask_from_rewards_rules():
    from mrtpo.replay.api import replay_mask_from_rewards

    rewards = torch.tensor([
        [1.0, 1.0, 0.0, 0.3],   # group 0: reward 0 zero variance, reward 2 one at the mean
        [1.0, 0.0, 1.0, 0.3],
        [1.0, 1.0, 0.5, 0.3],
        [0.7, 0.2, 0.1, 0.9],   # group 1: a group of one
    ])  # fmt: skip
    gids = torch.tensor([0, 0, 0, 1])
    got = replay_mask_from_rewards(rewards, gids)
    want = torch.tensor([[False, True, True, False], [False, True, True, False],
                         [False, True, False, False], [False] * 4])  # fmt: skip
    assert torch.equal(got, want)
    info = [[True, True, False, True], [True, False, True, True], [True] * 4, [True] * 4]
    assert torch.equal(replay_mask_from_rewards(rewards, gids, has_info=info),
                       want & torch.tensor(info))  # fmt: skip
    # a reward weighted 0 moves nothing
    w = torch.tensor([1.0, 0.0, 1.0, 1.0])
    assert not replay_mask_from_rewards(rewards, gids, weights=w)[:, 1].any()
    # whole rows: every pair with spans of a row with one pair that moves
    rows = replay_mask_from_rewards(rewards, gids, has_info=info, whole_rows=True)
    assert rows.tolist() == [[True, True, False, True], [True, False, True, True],
                             [True] * 4, [False] * 4]  # fmt: skip
    with pytest.raises(ValueError, match="whole_rows"):
        replay_mask_from_rewards(rewards, gids, whole_rows=True)
    with pytest.raises(ValueError, match="has_info"):
        replay_mask_from_rewards(rewards, gids, has_info=torch.ones(4, 3, dtype=torch.bool))


def _group_batch():
    """Two groups of 4 and a group of one on two prompts, K = 4 rewards (reward 3 without
    spans on the second prompt), rewards with zero-variance groups, an all-zero reward and
    responses at their group's mean."""
    p0, p1 = PROMPTS
    s0 = [[(0, 5)], [(p0.index("Start"), p0.index("Include"))], [(p0.index("Include"), len(p0))],
          [(p0.index("blue"), p0.index("blue") + 4)]]  # fmt: skip
    s1 = [[(0, 5)], [(p1.index("Include"), p1.index("End"))], [(p1.index("End"), len(p1))], []]
    prompts = [p0] * 4 + [p1] * 4 + [p1]
    spans = [s0] * 4 + [s1] * 5
    responses = [[10, 11, 12], [13, 14], [15], [16, 17, 18, 19], [20, 21], [22], [23, 24, 25],
                 [26, 27], [28, 29, 30]]  # fmt: skip
    rewards = torch.tensor([
        [1.0, 0.0, 0.5, 0.0], [1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.5, 0.0],
        [0.0, 1.0, 1.0, 0.2], [0.0, 1.0, 0.0, 0.4], [0.0, 1.0, 1.0, 0.6], [0.0, 1.0, 0.0, 0.8],
        [1.0, 0.0, 1.0, 0.3],
    ])  # fmt: skip
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2])
    return prompts, spans, responses, rewards, gids


@pytest.mark.parametrize("amp", ["none", "bfloat16"])
def test_replay_mask_full_and_skipped_replay_give_the_same_token_advantages(amp):
    """The engine with replay_mask: the replayed pairs' relevance is the full replay's bit
    for bit (a replay forward holds one (group, reward) unit whatever else is skipped), the
    skipped pairs' is 0, and so the token advantages are equal (torch.equal). Under autocast
    to bf16 too, where the JS runs on the bf16 head (the CPU's bf16-operand GEMMs)."""
    import contextlib

    from mrtpo.integrations.common import padded_token_advantages
    from mrtpo.replay.api import replay_mask_from_rewards

    tok, model = _chat_setup()
    prompts, spans, responses, rewards, gids = _group_batch()
    info = has_info_from_spans(spans)
    keep = replay_mask_from_rewards(rewards, gids, has_info=info)
    # group 0: rewards 0 and 3 zero variance, reward 2's rows 0 and 3 at the mean; group 1:
    # rewards 0 and 1 zero variance (reward 3 names no span); group 2, a group of one: none
    assert keep.sum() == 4 + 2 + 4 and not keep[8].any() and not keep[:, [0, 3]].any()
    kw = dict(tokenizer=tok, temperature=0.9, micro_batch=16)
    ctx = contextlib.nullcontext if amp == "none" else (
        lambda: torch.autocast("cpu", dtype=torch.bfloat16))  # fmt: skip
    with ctx():
        full = replay_relevance(model, prompts, responses, spans, **kw)
        part = replay_relevance(model, prompts, responses, spans, replay_mask=keep, **kw)
    assert torch.equal(part.has_info, full.has_info) and torch.equal(part.replayed_pairs, keep)
    assert part.skipped == int(info.sum()) - 10 and full.skipped == 0
    on = keep.t()[:, :, None] & full.response_mask[None]
    assert torch.equal(part.relevance[on], full.relevance[on])
    assert bool((part.relevance[~on] == 0).all()) and bool((full.relevance[on] > 0).any())
    assert torch.equal(part.old_logprobs, full.old_logprobs)
    for opts in ({}, {"alpha": 0.7, "gamma": 2.0}, {"batch_norm": "token"}):
        a = padded_token_advantages(rewards, gids, full.response_mask, full.relevance,
                                    full.has_info, **opts).token  # fmt: skip
        b = padded_token_advantages(rewards, gids, part.response_mask, part.relevance,
                                    part.has_info, **opts).token  # fmt: skip
        assert torch.equal(a, b)
    # nested lists work as the mask too
    with ctx():
        again = replay_relevance(model, prompts, responses, spans, replay_mask=keep.tolist(),
                                 **kw)  # fmt: skip
    assert torch.equal(again.relevance, part.relevance)


def test_replay_js_takes_the_bf16_head_under_bf16_autocast(monkeypatch):
    """Under autocast to bf16 the JS gets the LM head and the hidden states in bf16 (as the
    model's own head runs under autocast), and fp32 otherwise; the relevance moves only by
    the bf16 rounding of its operands."""
    import mrtpo.replay.engine as replay_mod

    tok, model = _chat_setup()
    prompts, spans, responses, _, _ = _group_batch()
    seen = []
    real = replay_mod.linear_js_distance

    def spy(hp, hq, w, **k):
        seen.append((hp.dtype, hq.dtype, w.dtype))
        return real(hp, hq, w, **k)

    monkeypatch.setattr(replay_mod, "linear_js_distance", spy)
    kw = dict(tokenizer=tok, temperature=0.9, micro_batch=16)
    fp32 = replay_relevance(model, prompts, responses, spans, **kw)
    assert seen and set(seen) == {(torch.float32,) * 3}
    seen.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = replay_relevance(model, prompts, responses, spans, **kw)
    assert seen and set(seen) == {(torch.bfloat16,) * 3}
    assert lm_head(model)[0].dtype == torch.float32  # the model's head is left as it was
    on = fp32.has_info.t()[:, :, None] & fp32.response_mask[None]
    moved = (low.relevance[on] - fp32.relevance[on]).abs().max()
    assert 0 < moved < 0.05  # 6e-5 here


def test_replay_mask_skipped_rows_get_no_replay_forward():
    """A row whose every pair is skipped gets the with-information forward only; a skipped
    (group, reward) unit gets no forward at all."""
    from mrtpo.replay.api import replay_mask_from_rewards

    tok, model = _chat_setup()
    prompts, spans, responses, rewards, gids = _group_batch()
    keep = replay_mask_from_rewards(rewards, gids, has_info=has_info_from_spans(spans))
    w, b = lm_head(model)
    rows_seen = []

    def hidden(input_ids, attention_mask, position_ids):
        rows_seen.append(input_ids.shape[0])
        out = model.model(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids, use_cache=False)  # fmt: skip
        return out.last_hidden_state

    lm = CallableLM(hidden, w, b)
    kw = dict(tokenizer=tok, temperature=0.9, micro_batch=16)
    full = replay_relevance(lm, prompts, responses, spans, **kw)
    n_full = sum(rows_seen)
    rows_seen.clear()
    part = replay_relevance(lm, prompts, responses, spans, replay_mask=keep, **kw)
    # with information: 9 rows; replays: group 0's rewards 1 and 2 (4 rows each, reward 2's
    # unit whole although two of its rows are skipped), the second prompt's reward 2 (its 5
    # rows: groups 1 and 2 share the prompt); nothing else
    assert sum(rows_seen) == 9 + 4 + 4 + 5 and part.replayed == 13
    assert n_full == 9 + full.replayed and full.replayed == 4 * 4 + 3 * 5
    nothing = replay_relevance(lm, prompts, responses, spans,
                               replay_mask=torch.zeros_like(keep), **kw)  # fmt: skip
    assert nothing.replayed == 0 and bool((nothing.relevance == 0).all())
    assert nothing.skipped == int(has_info_from_spans(spans).sum())
    torch.testing.assert_close(nothing.old_logprobs, full.old_logprobs, rtol=0, atol=0)


def test_contrastive_replay_mask_with_control_and_pointwise():
    """mrtpo train's engine: skipped pairs get 0 relevance and log-ratio, the kept pairs
    the full replay's values bit for bit; a row with nothing kept gets no control replay."""
    tok, model, pr = _setup()
    prompts, spans, responses, rewards, gids = _group_batch()
    ids = [pr.encode(p).ids for p in prompts]
    control = [[(5, 9)]] * len(prompts)
    keep = torch.zeros((9, 4), dtype=torch.bool)
    keep[0:4, 1] = True  # one (group, reward) unit
    kw = dict(temperature=0.8, micro_batch=16, control=control, pointwise=True)
    full = contrastive_replay(model, pr, prompts, ids, responses, spans, **kw)
    part = contrastive_replay(model, pr, prompts, ids, responses, spans, replay_mask=keep, **kw)
    assert part.replayed == 4 + 4 and part.pairs == 4 and part.skipped == full.pairs - 4
    n0 = sum(len(r) for r in responses[:4])
    assert torch.equal(part.relevance[1, :n0], full.relevance[1, :n0])
    assert torch.equal(part.logratio[1, :n0], full.logratio[1, :n0])
    assert torch.equal(part.control[:n0], full.control[:n0])
    assert bool((part.relevance[[0, 2, 3]] == 0).all())
    assert bool((part.relevance[1, n0:] == 0).all())
    assert bool((part.control[n0:] == 0).all()) and bool((part.logratio[:, n0:] == 0).all())
    assert torch.equal(part.old_logprobs, full.old_logprobs)
    with pytest.raises(ValueError, match="replay_mask"):
        contrastive_replay(model, pr, prompts, ids, responses, spans, temperature=0.8,
                           replay_mask=keep[:, :3])  # fmt: skip


def test_replay_relevance_bad_mask_token_ids_and_num_rewards():
    """Issue 32, item 9, and the mask's checks: ValueErrors naming the argument."""
    tok, model = _chat_setup()
    p = PROMPTS[0]
    ok = dict(tokenizer=tok, temperature=1.0)
    v = lm_head(model)[0].shape[0]
    with pytest.raises(ValueError, match=rf"responses: sample 1 has token id {v}\b"):
        replay_relevance(model, [p, p], [[5], [6, v]], [[[]], [[]]], **ok)
    with pytest.raises(ValueError, match="responses: sample 0 has token id -1"):
        replay_relevance(model, [p], torch.tensor([[-1, 3]]), [[[]]], **ok)
    with pytest.raises(ValueError, match="num_rewards: expected an int >= 0"):
        replay_relevance(model, [], [], [], num_rewards=-1, **ok)
    with pytest.raises(ValueError, match="num_rewards"):
        replay_relevance(model, [], [], [], num_rewards=1.5, **ok)
    for bad, what in (([[True, False]], "sample 0 needs one entry"),
                      (torch.ones(1, 2), "bool"), ([[2]], "expected a bool"),
                      (torch.ones(2, 1, dtype=torch.bool), "shape")):  # fmt: skip
        with pytest.raises(ValueError, match=f"replay_mask: .*{what}"):
            replay_relevance(model, [p], [[5]], [[[(0, 5)]]], replay_mask=bad, **ok)
