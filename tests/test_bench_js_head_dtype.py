"""bench.js_head_dtype at a tiny shape: three ways timed, each checked against float64."""

from __future__ import annotations

import pytest


def test_js_head_dtype_bench_writes_its_record(tmp_path):
    from bench import js_head_dtype

    rec = tmp_path / "rec.md"
    assert js_head_dtype.main(["--tokens", "9", "--streams", "2", "--d", "16", "--vocab",
                               "700", "--repeats", "1", "--record", str(rec)]) == 0  # fmt: skip
    text = rec.read_text()
    for way in js_head_dtype.WAYS:
        assert f"| {way} |" in text
    assert "Load before:" in text and "--vocab 700" in text
    res = js_head_dtype.run(type("A", (), dict(tokens=5, streams=1, d=8, vocab=300,
                                                 repeats=1, seed=1))())  # fmt: skip
    assert max(res["max_err_vs_float64"].values()) < 1e-5
    assert 0 < res["bf16_vs_fp32_max_abs"] < 0.05


def test_js_head_dtype_bench_rejects_bad_sizes(tmp_path):
    from bench import js_head_dtype

    with pytest.raises(ValueError, match="--vocab"):
        js_head_dtype.main(["--vocab", "0", "--record", str(tmp_path / "r.md")])


def test_js_head_dtype_record_carries_the_replay_rows(tmp_path):
    """The whole-replay section (``--replay``, a real-model run) as the record writes it."""
    import argparse

    from bench import js_head_dtype

    args = argparse.Namespace(tokens=9, streams=1, d=8, vocab=300, repeats=1, seed=0,
                              replay=3, record=tmp_path / "r.md")  # fmt: skip
    res = js_head_dtype.run(args)
    res["replay"] = {"fp32 head": {"total": 2.0, "js": 0.8},
                     "autocast head (bf16)": {"total": 1.8, "js": 0.5},
                     "pairs": 20, "rows": 8, "repeats": 3}  # fmt: skip
    js_head_dtype.write_record(args, res, "l0", "l1")
    text = args.record.read_text()
    assert "| fused JS | 0.800 | 0.500 | 0.62 |" in text
    assert "| whole replay | 2.000 | 1.800 | 0.90 |" in text
    assert "--replay 3" in text and "20 pairs" in text
