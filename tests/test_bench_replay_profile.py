"""bench/replay_profile.py on the tiny built-in model: every part is timed for both paths,
the two paths agree in fp32, the engine's functions are put back, and the record is written."""

from __future__ import annotations

import argparse
import contextlib
from types import SimpleNamespace

import torch

import mrtpo.replay.engine as replay_mod
from bench.replay_profile import PARTS, profile, write_record
from mrtpo.model.loading import TinyConfig, build_tiny_model, build_tokenizer
from mrtpo.replay.prompting import ChatPrompter

PROMPTS = [
    'Write a note about owls. Start with "hello". Include the word "blue".',
    'Write a note about rain. Include the word "gold". End with "bye now".',
]
TINY = TinyConfig(
    vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1
)


def _prepared():
    tok = build_tokenizer(PROMPTS * 4 + ["hello blue owls", "gold rain bye now"], vocab_size=300)
    model = build_tiny_model(tok, TINY, seed=0).eval()
    pr = ChatPrompter(tok)
    p0, p1 = PROMPTS
    s0 = [[(p0.index("Start"), p0.index("Include"))], [(p0.index("Include"), len(p0))], []]
    s1 = [[(p1.index("Include"), p1.index("End"))], [], [(p1.index("End"), len(p1))]]
    prompts = [p0] * 4 + [p1] * 4
    ro = SimpleNamespace(
        examples=[SimpleNamespace(prompt=p) for p in prompts],
        prompt_ids=[pr.encode(p).ids for p in prompts],
        spans=[s0] * 4 + [s1] * 4,
        rewards=torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 0.0, 1.0], [0.0, 0.0, 1.0],
                              [1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]),
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
    )  # fmt: skip
    tr = SimpleNamespace(k=3, tok=tok, prompter=pr, model=model, _amp=contextlib.nullcontext)
    cfg = SimpleNamespace(temperature=0.8, micro_batch=8)
    responses = [[10 + i, 20 + i, 30 + i, 40 + i, 50 + i] for i in range(8)]
    return tr, cfg, ro, responses


def test_replay_profile_times_every_part_of_both_paths(tmp_path):
    saved = {n: getattr(replay_mod, n) for n in
             ("_rows_hidden", "linear_logprobs", "linear_js_distance")}  # fmt: skip
    args = argparse.Namespace(tokens=5, repeats=2, mask="none,rewards", seed=0,
                              out=tmp_path, record=tmp_path / "record.md")  # fmt: skip
    prepared = _prepared()
    results = [profile(args, m, prepared) for m in ("none", "rewards")]
    for n, f in saved.items():  # the engine is given back its own functions
        assert getattr(replay_mod, n) is f
    full, masked = results
    # pairs with spans: 2 per row; the mask keeps group 0's reward 0 and group 1's reward 2
    assert full["pairs"] == 16 and masked["pairs"] == 8
    assert full["replayed_rows"] == 16 and masked["replayed_rows"] == 8
    for res in results:
        for name in ("old", "new"):
            s = res["summary"][name]
            assert all(s[p] > 0 for p in PARTS), (res["mask"], name, s)
            assert s["total"] >= sum(s[p] for p in PARTS)
            assert len(res["runs"][name]) == 2
        assert res["fp32_max_abs_distance_diff"] < 1e-5
        lengths = res["prompt_tokens"]
        assert 0 < max(res["suffix_tokens"]) < min(lengths)  # only a suffix is run
    write_record(args, results, "load a", "load b")
    text = args.record.read_text()
    assert text.count("| whole replay |") == 2 and "## Mask `rewards`: 8" in text
    assert "--mask none,rewards" in text and "load a" in text


def test_tail_memory_bench_runs_and_agrees(tmp_path, monkeypatch):
    """bench/tail_memory.py at a small size: both ways give the same hidden states."""
    from bench.tail_memory import main

    monkeypatch.chdir(__import__("pathlib").Path(__file__).resolve().parents[1])
    record = tmp_path / "tail.md"
    assert main(["--tokens", "24", "--piece", "8", "--out", str(tmp_path / "o"),
                 "--record", str(record)]) == 0  # fmt: skip
    rows = [x for x in record.read_text().splitlines() if x.startswith(("| same", "| mixed"))]
    assert len(rows) == 2
    for row in rows:
        assert float(row.split("|")[-2]) < 1e-5
