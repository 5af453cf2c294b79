"""bench/method_step.py at tiny sizes (16 and 64 tokens, the built-in tiny model): every
variant's CSV rows and stages, the pair counts (half of the pairs skipped in mrtpo-half),
stage times that add up to the step, the run record, the report's table and plots, one case
in its own process, and the flags' errors. No timing is compared (a shared machine)."""

from __future__ import annotations

import csv
import json
import math

import pytest

from bench import method_step as ms
from bench import method_step_batch as batch
from bench import method_step_report as report

B, K = 2, 4  # the defaults: one prompt, a group of 2, K = 4


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _check_case(rows, length, variant):
    got = {r["stage"]: r for r in rows if r["N"] == str(length) and r["provider"] == variant}
    want = ms.GDPO_STAGES if variant == "gdpo" else ms.STAGES
    assert set(got) == {"step", *want}, (length, variant, sorted(got))
    for stage, r in got.items():
        assert r["status"] == "ok" and r["op"] == "method_step" and r["model"] == "tiny"
        assert int(r["tokens"]) == B * length and int(r["K"]) == K
        assert int(r["responses"]) == B and r["dtype"] == "float32"
        for key in ("ms_p50", "cpu_ms_p50", "peak_mem_mb"):
            assert math.isfinite(float(r[key])) and float(r[key]) > 0, (stage, key)
        assert float(r["extra_mem_mb"]) >= 0
        assert r["date"] and r["commit"] and r["device"] and r["torch"]
    pairs = {"mrtpo": (B * K, 0), "mrtpo-half": (B * K // 2, B * K // 2), "gdpo": (0, 0)}
    assert (int(got["step"]["pairs"]), int(got["step"]["skipped"])) == pairs[variant]
    # the stages partition the step: their sum is the step, less the clock's own calls
    total = sum(float(r["ms_p50"]) for s, r in got.items() if s != "step")
    step = float(got["step"]["ms_p50"])
    assert 0.5 * step <= total <= step * 1.001 + 0.01, (variant, total, step)
    # the step's peak is its largest stage peak
    peak = max(float(r["peak_mem_mb"]) for s, r in got.items() if s != "step")
    assert float(got["step"]["peak_mem_mb"]) == pytest.approx(peak, rel=1e-4)
    return got


def test_tiny_run_rows_report_and_plots(tmp_path):
    import mrtpo.replay.api as rp
    import mrtpo.replay.engine as engine

    before = {n: getattr(engine, n) for n in ("_rows_hidden", "linear_js_distance")}
    before_ids = rp._stream_ids
    out = tmp_path / "res"
    argv = ["--out", str(out), "--models", "tiny", "--lengths", "16,64", "--repeats", "1",
            "--in-process"]  # fmt: skip
    rows = ms.main(argv)
    assert {n: getattr(engine, n) for n in before} == before  # the engine is restored
    assert rp._stream_ids is before_ids
    assert len(rows) == 2 * (2 * (1 + len(ms.STAGES)) + 1 + len(ms.GDPO_STAGES))
    table = _rows(out / "method_step.csv")
    assert list(table[0]) == list(ms.COLUMNS)
    assert len(table) == len(rows)
    for length in (16, 64):
        for v in ms.VARIANTS:
            _check_case(table, length, v)
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert len(runs) == 1 and runs[0]["command"].startswith("python -m bench.method_step")
    assert len(runs[0]["load_start"].split()) == 3 == len(runs[0]["load_end"].split())
    cases = [json.loads(x) for x in (out / "cases.jsonl").read_text().splitlines()]
    assert sorted((c["length"], c["variant"]) for c in cases) == sorted(
        (n, v) for n in (16, 64) for v in ms.VARIANTS
    )
    assert all(c["status"] == "ok" and set(c["stages"]) >= set(ms.GDPO_STAGES) for c in cases)
    # a second invocation appends; the report reads both
    ms.main(["--out", str(out), "--models", "tiny", "--lengths", "32", "--repeats", "1",
             "--variants", "gdpo", "--in-process"])  # fmt: skip
    assert len(_rows(out / "method_step.csv")) == len(rows) + 1 + len(ms.GDPO_STAGES)
    assert report.main(["--dir", str(out)]) == 0
    md = (out / "method_step.md").read_text()
    assert md.count("python -m bench.method_step ") == 2  # both commands, with their loads
    assert "## Headline (process CPU time)" in md
    assert "tiny, 64-token responses" in md and "of MRTPO's step" in md
    assert "half of the pairs skipped (4 of 8 replayed)" in md
    body = [ln for ln in md.splitlines() if ln.startswith("| tiny | ")]
    assert len(body) == 3 + 3 + 1 + 3  # stages table: 7 cases; memory table: 3 variants
    for name in ("method_step_time.png", "method_step_memory.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_one_case_in_its_own_process():
    spec = dict(model="tiny", length=16, variant="mrtpo-half", K=K, prompts=1, group=2,
                warmup_length=8, device="cpu", threads=1, seed=0,
                cache_dir="runs/cache")  # fmt: skip
    res = ms.run_case(spec, timeout=600)
    assert res["status"] == "ok", res
    assert set(res["stages"]) == set(ms.STAGES)
    assert res["replayed"] == res["skipped"] == B * K // 2
    assert res["skip"] in ("replay_mask", "no spans")
    assert res["peak_method"] == "VmHWM reset per stage"
    assert all(s["peak"] >= res["baseline"] * 0.9 for s in res["stages"].values())
    rows = ms.rows_of(spec, [res], {"date": "d"}, "1 / 1")
    assert [r["stage"] for r in rows] == ["step", *ms.STAGES]
    assert f"pairs skipped by {res['skip']}" in rows[0]["note"]


def test_a_failed_case_keeps_its_rows():
    spec = dict(model="tiny", length=16, variant="gdpo", K=K, threads=1)
    rows = ms.rows_of(spec, [dict(status="timeout", note="case ran past 1 s")], {}, "")
    assert {r["status"] for r in rows} == {"timeout"} and len(rows) == 1 + len(ms.STAGES)
    assert all(r["note"] == "case ran past 1 s" for r in rows)


def test_half_rewards_cannot_move():
    """mrtpo-half's batch: the odd rewards are constant in their group (A_k = 0 there), the
    others differ (A_k != 0 for every response)."""
    from mrtpo.model.loading import build_tokenizer
    from mrtpo.replay.prompting import ChatPrompter
    from mrtpo_kernels import gdpo_advantages

    tok = build_tokenizer([batch.prompt_of(p, 8)[0] for p in range(4)] * 4)
    pr = ChatPrompter(tok)
    for variant, moving in (("mrtpo", [True] * K), ("mrtpo-half", [True, False] * (K // 2))):
        b = batch.build_batch(tok, pr, prompts=2, group=3, k=K, length=5, variant=variant, seed=1)
        assert len(b["responses"]) == 6 and all(len(r) == 5 for r in b["responses"])
        assert not set(tok.all_special_ids) & {t for r in b["responses"] for t in r}
        a = gdpo_advantages(b["rewards"], b["group_ids"]).per_reward
        assert ((a != 0).all(0).tolist(), (a == 0).all(0).tolist()) == (
            moving,
            [not m for m in moving],
        )
        text, spans = batch.prompt_of(0, K)
        assert [text[s[0][0] : s[0][1]] for s in spans] == list(batch.CLAUSES[:K])


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--lengths", "0,64"], "--lengths"),
        (["--lengths", "a"], "--lengths"),
        (["--variants", "mrtpo,ppo"], "--variants"),
        (["--K", "9"], "--K"),
        (["--group", "1"], "--group"),
        (["--device", "tpu"], "--device"),
    ],
)
def test_bad_flags_are_named(tmp_path, capsys, argv, flag):
    with pytest.raises(SystemExit):
        ms.parse(["--out", str(tmp_path), *argv])
    assert flag in capsys.readouterr().err


def test_gradient_checkpointing_flag_reaches_the_policy_forward(tmp_path, monkeypatch):
    """--gradient-checkpointing: both arms' policy forward runs through the checkpoint (its
    recompute in backward), the rows say so, and the stages still partition the step."""
    import torch.utils.checkpoint as ckpt

    calls = []
    real = ckpt.checkpoint
    monkeypatch.setattr(ckpt, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "res"
    ms.main(["--out", str(out), "--models", "tiny", "--lengths", "16", "--repeats", "1",
             "--variants", "mrtpo,gdpo", "--in-process", "--gradient-checkpointing"])  # fmt: skip
    assert calls
    table = _rows(out / "method_step.csv")
    for v in ("mrtpo", "gdpo"):
        got = _check_case(table, 16, v)
        assert all("gradient checkpointing" in r["note"] for r in got.values())
    cases = [json.loads(x) for x in (out / "cases.jsonl").read_text().splitlines()]
    assert all(c["gradient_checkpointing"] for c in cases)
