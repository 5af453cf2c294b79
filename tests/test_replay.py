"""Contrastive replay: the prompt without a reward's spans, the batched padded forwards, and
the relevance / old log-probs against direct unpadded float64 computations."""

from __future__ import annotations

import copy

import pytest
import torch

from mrtpo.integrations.common import has_info_from_spans, padded_from_packed
from mrtpo.model import TinyConfig, build_tiny_model, build_tokenizer, lm_head, task_texts
from mrtpo.prompting import ChatPrompter, merge_spans
from mrtpo.replay import CallableLM, contrastive_replay, replay_relevance
from mrtpo.tasks import load_task
from mrtpo.teacher_forcing import forward_responses, forward_shared_prompts, teacher_batch
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
    """mrtpo.spans: what a reward function may return, and span checks."""
    import numpy as np

    from mrtpo.spans import normalize_spans, prompt_without_spans, score_and_spans
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
