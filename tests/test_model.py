"""The built-in tokenizer and model: round trip, offsets, span-to-token mapping, chat
template, the hidden states that feed the LM head, save/load."""

from __future__ import annotations

import re

import pytest
import torch

from mrtpo.model.loading import (
    TinyConfig,
    build_tiny_model,
    build_tokenizer,
    last_hidden,
    lm_head,
    load_model,
    save_model,
)
from mrtpo.replay.prompting import (
    ChatPrompter,
    merge_spans,
    remove_spans,
    response_offsets,
    spans_to_token_mask,
)

CORPUS = [
    'Write a short note about a garden. Start your answer with "to begin". '
    'Include the word "happy". End your answer with "see you soon".',
    "to begin. bees visit every flower. roses grow by the wall. i think of happy. see you soon",
    "SELECT COUNT(*) FROM orders WHERE year = 2024",
    '{"name": "send_message", "arguments": {"to": "Cleo", "text": "good morning"}}',
] * 5

TINY = TinyConfig(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1
)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(CORPUS, vocab_size=320)


@pytest.mark.parametrize(
    "text",
    [
        "plain words here",
        "  leading and trailing  ",
        "tabs\tand\nnew lines\n\n***\n",
        "unicode: caf\u00e9 \u00fc\u00df \u4e2d\u6587 \U0001f600",
        "",
        '"quotes", commas; <<t>>',
    ],
)
def test_round_trip_and_offsets(tok, text):
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    assert tok.decode(enc["input_ids"]) == text
    offsets = enc["offset_mapping"]
    # offsets tile the text left to right without gaps
    pos = 0
    for a, b in offsets:
        assert a <= pos <= b or a == pos
        pos = max(pos, b)
    assert pos == len(text)


def test_response_offsets_tile_the_text(tok):
    text = "to begin. i think of happy. see you soon"
    ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    decoded, offsets = response_offsets(tok, ids)
    assert decoded == text
    assert "".join(decoded[a:b] for a, b in offsets) == text
    assert offsets[-1][0] == offsets[-1][1] == len(text)  # the end-of-turn token is empty


def test_spans_to_token_mask_covers_exactly_the_span(tok):
    text = CORPUS[0]
    span = (text.index("Include"), text.index("End"))
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    offsets = enc["offset_mapping"]
    mask = spans_to_token_mask(offsets, [span])
    covered = set()
    for (a, b), m in zip(offsets, mask.tolist()):
        overlaps = a < span[1] and span[0] < b
        assert m == overlaps
        if m:
            covered.update(range(a, b))
    assert set(range(*span)) <= covered
    assert not spans_to_token_mask(offsets, []).any()


def test_merge_and_remove_spans():
    assert merge_spans([(5, 8), (0, 2), (7, 10), (3, 3)]) == [(0, 2), (5, 10)]
    assert remove_spans("abcdefghij", [(5, 8), (0, 2), (7, 10)]) == "cde"
    with pytest.raises(ValueError, match="spans"):
        remove_spans("abc", [(1, 9)])


@pytest.mark.parametrize(
    "span, why",
    [
        ((-3, 2), "expected 0 <= start <= end, got the span (-3, 2)"),
        ((2, -1), "expected 0 <= start <= end, got the span (2, -1)"),
        ((4, 2), "expected 0 <= start <= end, got the span (4, 2)"),
        ((1.5, 3), "integer character offsets, got (1.5, 3)"),
        ((1, 2.0), "integer character offsets"),
        ((True, 2), "integer character offsets"),
        (("1", 2), "integer character offsets"),
        ((1, 2, 3), "integer character offsets"),
        ((1, 7), "span (1, 7) ends past the text (length 6)"),
    ],
)
def test_a_negative_fractional_or_reversed_span_is_refused(tok, span, why):
    """Issue 32, item 16: Python's slicing took (-3, 2) from the end and int() cut 1.5 to 1,
    so the prompt "without" the span came out longer than the prompt."""
    with pytest.raises(ValueError, match=re.escape(why)) as err:
        remove_spans("abcdef", [(0, 1), span])
    assert str(err.value).startswith("spans: ")
    pr = ChatPrompter(tok)
    with pytest.raises(ValueError, match=re.escape(why)) as err:
        pr.encode("abcdef", remove=[span])
    assert str(err.value).startswith("remove: ")
    # integer types other than int are offsets too; an empty span removes nothing
    assert remove_spans("abcdef", [(torch.tensor(1), torch.tensor(3)), (5, 5)]) == "adef"


def test_chat_template_and_prompt_token_mask(tok):
    pr = ChatPrompter(tok)
    prompt = CORPUS[0]
    enc = pr.encode(prompt)
    rendered = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    assert enc.text == rendered == pr.prefix + prompt + pr.suffix
    assert enc.ids == tok(rendered, add_special_tokens=False)["input_ids"]
    assert enc.ids[0] == tok.convert_tokens_to_ids("<|user|>")
    span = (prompt.index("Include"), prompt.index("End"))
    mask = enc.token_mask([span])
    chosen = "".join(enc.text[a:b] for (a, b), m in zip(enc.offsets, mask.tolist()) if m)
    assert prompt[span[0] : span[1]] in chosen
    assert len(chosen) < len(prompt[span[0] : span[1]]) + 10


def test_last_hidden_feeds_the_lm_head_with_left_padding(tok):
    model = build_tiny_model(tok, TINY, seed=1).eval()
    w, b = lm_head(model)
    assert b is None and w is model.get_input_embeddings().weight  # tied
    ids = torch.tensor([[tok.pad_token_id] * 3 + [5, 9, 11, 40], [7, 8, 9, 10, 11, 12, 13]])
    mask = (ids != tok.pad_token_id).long()
    with torch.no_grad():
        h = last_hidden(model, ids, mask)
        ref = model(input_ids=ids[1:], attention_mask=mask[1:]).logits
        torch.testing.assert_close(h[1:] @ w.T, ref, rtol=1e-5, atol=1e-5)
        alone = last_hidden(model, ids[:1, 3:], mask[:1, 3:])
        torch.testing.assert_close(h[0, 3:], alone[0], rtol=1e-5, atol=1e-5)


def test_save_load_round_trip(tok, tmp_path):
    model = build_tiny_model(tok, TINY, seed=2).eval()
    save_model(model, tok, tmp_path / "m")
    model2, tok2 = load_model(tmp_path / "m")
    ids = torch.tensor([tok(CORPUS[1], add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, model2(ids).logits)
    assert tok2.decode(ids[0]) == CORPUS[1]
    assert tok2.chat_template == tok.chat_template
    with pytest.raises(ValueError, match="model"):
        load_model(tmp_path / "missing")


def test_tokenizer_arguments_are_checked():
    with pytest.raises(ValueError, match="vocab_size"):
        build_tokenizer(CORPUS, vocab_size=100)
    with pytest.raises(ValueError, match="texts"):
        build_tokenizer([], vocab_size=320)


def test_warm_start_micro_batches_take_the_same_steps(tok):
    """Gradients accumulated over forwards of 1 or 2 examples give the step of one forward
    over the batch (the mean loss over all of its response tokens, not a mean of means)."""
    from mrtpo.model.loading import warm_start
    from mrtpo.verifiers import Example

    examples = [
        Example(id=str(i), prompt=CORPUS[i % 4][: 20 + 7 * i], reference=CORPUS[i % 3][: 9 + 5 * i])
        for i in range(6)
    ]
    pr = ChatPrompter(tok)
    states, losses = [], []
    for micro in (None, 1, 2):
        model = build_tiny_model(tok, TINY, seed=3)
        losses.append(
            warm_start(model, pr, examples, steps=3, batch=4, lr=1e-2, seed=0, micro_batch=micro)
        )
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    init = build_tiny_model(tok, TINY, seed=3).state_dict()
    assert any(not torch.equal(init[k], v) for k, v in states[0].items())  # it trained
    for other in states[1:]:
        for k, v in states[0].items():
            torch.testing.assert_close(other[k], v, rtol=1e-4, atol=1e-5)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    assert losses[2] == pytest.approx(losses[0], rel=1e-5)
    with pytest.raises(ValueError, match="micro_batch: expected an int >= 1"):
        warm_start(model, pr, examples, steps=1, batch=2, lr=1e-2, micro_batch=0)


@pytest.mark.parametrize("amp", ["none", "bfloat16"])
def test_gradient_checkpointing_same_gradients_fewer_saved_activations(amp):
    """Within ``gradient_checkpointing`` a teacher-forced forward with gradient keeps about
    one (tokens, d) input per layer instead of every intermediate, and the gradients are
    the same bit for bit (fp32, and under bf16 autocast, whose state the recompute replays);
    forwards without gradient and the layers are as before once it exits."""
    import contextlib

    from mrtpo.model.loading import (
        build_tiny_model,
        build_tokenizer,
        decoder_layers,
        gradient_checkpointing,
        last_hidden,
    )

    tok = build_tokenizer(["the quick brown fox jumps over the lazy dog"] * 4, vocab_size=300)
    model = build_tiny_model(tok, TinyConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                                             num_layers=3, num_heads=2, num_kv_heads=1),
                             seed=0).eval()  # fmt: skip
    layers = decoder_layers(model)
    assert len(layers) == 3
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.get_input_embeddings().num_embeddings, (2, 40), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :7] = 0  # a left-padded row
    ctx = contextlib.nullcontext if amp == "none" else (
        lambda: torch.autocast("cpu", dtype=torch.bfloat16))  # fmt: skip

    def run(enabled):
        model.zero_grad(set_to_none=True)
        saved = [0]

        def pack(t):
            saved[0] += t.numel()
            return t

        with gradient_checkpointing(model, enabled), ctx():
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                h = last_hidden(model, ids, mask)
                loss = (h.float().square() * mask[..., None]).sum()
        loss.backward()
        return [p.grad.clone() for p in model.parameters()], saved[0], h.detach()

    g0, n0, h0 = run(False)
    g1, n1, h1 = run(True)
    assert torch.equal(h0, h1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert n1 * 4 < n0, (n0, n1)
    assert not any("forward" in layer.__dict__ for layer in layers)  # restored
    with torch.no_grad(), ctx():  # no gradient: the layers run as they are
        plain = last_hidden(model, ids, mask)
        with gradient_checkpointing(model):
            assert torch.equal(last_hidden(model, ids, mask), plain)


# --------------------------------------------------------------------------------------------
# The tiny model's warm-start cache: built once under a lock, published whole, checked

WARM = TinyConfig(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    warm_steps=30,
    warm_batch=4,
)


def _default_model_in_process(cache: str, log: str, out: str, barrier) -> None:
    """One run's ask for the tiny model on a cold cache: waits for the other run, then asks."""
    import hashlib
    import os

    from mrtpo.model.loading import default_model
    from mrtpo.tasks.builtin import load_task

    task = load_task("constraints", seed=0)

    def note(msg):
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {msg}\n")

    barrier.wait(120)
    model, _ = default_model(task, seed=0, cache_dir=cache, cfg=WARM, log=note)
    digest = hashlib.sha1()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode() + t.detach().cpu().numpy().tobytes())
    with open(out, "w") as f:
        f.write(digest.hexdigest())


@pytest.mark.slow
def test_two_runs_on_a_cold_cache_warm_start_the_tiny_model_once(tmp_path):
    """Issue 41 item 10: two runs started together on a cold cache both warm-started and
    wrote the same folder in place, and loads by one failed while the other wrote. Now one
    warm-starts (under the build lock), the other waits and loads the published folder."""
    import json
    import multiprocessing as mp

    cache, log = tmp_path / "cache", tmp_path / "log"
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(2)
    outs = [tmp_path / f"out{i}" for i in (0, 1)]
    procs = [
        ctx.Process(target=_default_model_in_process, args=(str(cache), str(log), str(o), barrier))
        for o in outs
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    assert [p.exitcode for p in procs] == [0, 0]
    builders = {line.split()[0] for line in log.read_text().splitlines() if "warm start" in line}
    assert len(builders) == 1, log.read_text()[-500:]
    assert outs[0].read_text() == outs[1].read_text()  # the same weights, loaded by both
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    info = json.loads((folder / "warm_start.json").read_text())
    assert info["files"]["model.safetensors"] == (folder / "model.safetensors").stat().st_size
    assert not [p.name for p in cache.iterdir() if p.name.endswith((".tmp", ".old"))]


def test_a_broken_or_stale_tiny_model_cache_is_built_again(tmp_path):
    """A warm-started folder whose weights are cut short, or that was trained on another
    training set (the tools split changed in issue 41), is warm-started again, and the log
    names it; one cached before digests were recorded is kept where its task did not change."""
    import json

    from mrtpo.model.loading import default_model
    from mrtpo.tasks.builtin import load_task

    task = load_task("constraints", seed=0)
    logs: list[str] = []
    default_model(task, cache_dir=tmp_path, cfg=WARM, log=logs.append)
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    built = lambda: sum("warm start 1/" in m for m in logs)  # noqa: E731
    assert built() == 1
    default_model(task, cache_dir=tmp_path, cfg=WARM, log=logs.append)
    assert built() == 1  # whole: loaded as it is

    weights = folder / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    model, _ = default_model(task, cache_dir=tmp_path, cfg=WARM, log=logs.append)
    assert built() == 2
    assert any(str(folder) in m and "model.safetensors" in m for m in logs), logs

    mark = folder / "warm_start.json"
    info = json.loads(mark.read_text())
    mark.write_text(json.dumps({k: v for k, v in info.items() if k != "train_digest"}))
    default_model(task, cache_dir=tmp_path, cfg=WARM, log=logs.append)
    assert built() == 2  # an older cache of an unchanged task: kept
    mark.write_text(json.dumps({**info, "train_digest": "another"}))
    default_model(task, cache_dir=tmp_path, cfg=WARM, log=logs.append)
    assert built() == 3
    assert any(str(folder) in m and "another training set" in m for m in logs), logs

    tools = load_task("tools", seed=0)
    default_model(tools, cache_dir=tmp_path, cfg=WARM, log=logs.append)
    (tfolder,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("tools-")]
    mark = tfolder / "warm_start.json"
    info = json.loads(mark.read_text())
    mark.write_text(json.dumps({k: v for k, v in info.items() if k != "train_digest"}))
    default_model(tools, cache_dir=tmp_path, cfg=WARM, log=logs.append)
    assert built() == 5  # tools' split changed: a cache from before is not trusted
