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
