"""bench/step_model.py: the step model's arithmetic, its check against committed CPU records
(a prediction within the stated tolerance, and a deliberately wrong part that misses it),
the GPU table's directions, and its record kept in step with the code."""

from __future__ import annotations

import ast
from dataclasses import replace
from pathlib import Path

import pytest

from bench import step_model as sm

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "bench" / "results" / "step-model-2026-12-06.md"


def _parts(**kw):
    base = dict(
        responses=2,
        K=4,
        kept=6,
        generation=10.0,
        update=30.0,
        info_forward=8.0,
        unit_per_pair=4.0,
        js_per_side=0.5,
        advantages_gdpo=0.1,
        advantages_mrtpo=0.3,
        head_pass=1.0,
    )
    base.update(kw)
    return sm.Parts(**base)


def test_step_times_by_mode():
    p = _parts()
    extra = 6 * 4.0 + (2 + 6) * 0.5  # units of the kept pairs, JS sides
    sep = sm.step_times(p, "separate")
    assert sep["gdpo"] == pytest.approx(10 + 30 + 0.1 + 8)
    assert sep["mrtpo"] == pytest.approx(10 + 30 + 0.3 + 8 + extra)
    own = sm.step_times(p, "own-forward")
    assert own["gdpo"] == pytest.approx(10 + 30 + 0.1 + 1)  # the update's head pass only
    assert own["mrtpo"] == pytest.approx(10 + 30 + 0.3 + 8 + extra)
    upd = sm.step_times(p, "from-update")
    assert upd["mrtpo"] == pytest.approx(10 + 30 + 0.3 + 1 + extra)
    assert upd["ratio"] == pytest.approx(upd["mrtpo"] / upd["gdpo"])
    assert sep["generation_share"] == pytest.approx(10 / sep["gdpo"])
    # nothing kept: MRTPO pays only its advantage op and, in own-forward, the forward
    none = sm.step_times(_parts(kept=0), "from-update")
    assert none["mrtpo"] - none["gdpo"] == pytest.approx(2 * 0.5 + 0.2)


def test_bad_input_names_the_argument():
    with pytest.raises(ValueError, match="kept"):
        _parts(kept=9)
    with pytest.raises(ValueError, match="unit_per_pair"):
        _parts(unit_per_pair=-1.0)
    with pytest.raises(ValueError, match="responses"):
        _parts(responses=0)
    with pytest.raises(ValueError, match="mode"):
        sm.step_times(_parts(), "fused")
    with pytest.raises(ValueError, match="donor"):
        sm.transfer(_parts(), _parts(info_forward=0.0))
    with pytest.raises(ValueError, match="decoder_share"):
        sm.h200_rates(0.0)
    with pytest.raises(SystemExit):
        sm.main(["record"])  # --out missing


def test_transfer_carries_costs_relative_to_the_forward():
    donor = _parts(info_forward=4.0, unit_per_pair=2.0, js_per_side=0.4, head_pass=0.5)
    got = sm.transfer(_parts(info_forward=16.0, head_pass=0.0), donor)  # f: 2 -> 8 per response
    assert got.unit_per_pair == pytest.approx(8.0)
    assert got.js_per_side == pytest.approx(1.6)
    assert got.head_pass == pytest.approx(2.0)


def test_prediction_matches_a_committed_record():
    """method-step-2026-12-05: each MRTPO variant's ratio predicted from GDPO's step of the
    same batch and u / f, j / f of the other variant (every pair replayed <-> half)."""
    rows = sm.check_rows(records=("method-step-2026-12-05",), k4=None)
    held = [r for r in rows if r["held"]]
    assert len(held) == 8  # tiny 1k, 4k, 16k and SmolLM2 1k, both variants of each
    assert {r["variant"] for r in held} == {"mrtpo", "mrtpo-half"}
    for r in held:
        assert r["measured"] > 1.3  # the records' own ratios, not a default
        assert abs(r["error"]) <= sm.TOLERANCE, r


def test_prediction_matches_the_k4_training_runs():
    rows = sm.check_rows(records=(), k4=sm.K4_RECORD)
    assert [r["case"].split(" (")[0] for r in rows] == [
        f"K = 4 training, run {i}" for i in (1, 2, 4, 6)
    ]
    for r in rows:
        assert 0.25 < r["generation_share"] < 0.45
        assert abs(r["error"]) <= sm.TOLERANCE, r


@pytest.mark.parametrize("scale", [2.0, 0.4])
def test_a_wrong_part_misses_the_tolerance(scale):
    """The replay unit's cost carried wrong by ``scale``: the check must fail."""
    rows = sm.check_rows(records=("method-step-2026-12-05",), k4=sm.K4_RECORD, scale_unit=scale)
    held = [r for r in rows if r["held"]]
    assert any(abs(r["error"]) > sm.TOLERANCE for r in held)


def test_strict_check_passes_on_every_record(capsys):
    assert sm.main(["check", "--strict"]) == 0
    assert "all within it" in capsys.readouterr().out


def test_ignoring_the_pairs_kept_misses_the_tolerance():
    """A model whose replay cost did not follow the pairs kept (the full replay's cost
    carried whole into the half-skipped step) is caught by the half rows."""
    cases = sm.method_step_cases("method-step-2026-12-05")
    misses = 0
    for c in cases:
        if c.variant != "mrtpo-half" or c.tokens < sm.MIN_TOKENS:
            continue
        full = next(
            d for d in cases if d.group == c.group and d.tokens == c.tokens and d.variant == "mrtpo"
        )
        wrong = replace(sm.transfer(c.parts, full.parts), kept=full.parts.kept)
        err = sm.step_times(wrong)["ratio"] / c.measured - 1
        misses += abs(err) > sm.TOLERANCE
    assert misses >= 3


def test_gpu_ratio_directions():
    rates = sm.h200_rates()
    assert rates.policy_loss > 500 and rates.js > 500 and rates.gemm > 700  # read, not typed
    shape = sm.target_shape()
    assert (shape.d, shape.vocab) == (4096, 151936)
    kw = dict(K=4, keep=0.5, length=4096, generation_share=0.5)
    r = sm.gpu_ratio(shape, rates, **kw)
    assert 1.0 < r < 3.0
    assert sm.gpu_ratio(shape, rates, **dict(kw, K=2)) < r
    assert sm.gpu_ratio(shape, rates, **dict(kw, keep=1.0)) > r
    assert sm.gpu_ratio(shape, rates, **dict(kw, generation_share=0.85)) < r
    assert sm.gpu_ratio(shape, rates, **dict(kw, mode="from-update")) < r
    assert sm.gpu_ratio(shape, rates, **dict(kw, unit_efficiency=1.5)) > r
    # the closed form the record gives: 1 + (1 - g)(q K + 1) / 3, within a few percent
    assert r == pytest.approx(1 + 0.5 * (0.5 * 4 + 1) / 3, rel=0.05)
    g = sm.needed_share(shape, rates, 1.15, K=4, keep=0.5, length=4096)
    assert sm.gpu_ratio(shape, rates, **dict(kw, generation_share=g)) == pytest.approx(1.15, 1e-3)
    with pytest.raises(ValueError, match="generation_share"):
        sm.gpu_ratio(shape, rates, **dict(kw, generation_share=1.0))


def test_record_is_the_model_on_the_committed_records():
    text = RECORD.read_text()
    assert sm.check_table(sm.check_rows()) in text
    assert sm.gpu_tables() in text
    assert "No GPU step is\nmeasured in this project yet" in text


STEP_MODEL_MODULES = {
    "step_model.py",
    "step_model_parts.py",
    "step_model_records.py",
    "step_model_check.py",
    "step_model_gpu.py",
    "step_model_report.py",
}


def test_public_api_only():
    files = sorted((ROOT / "bench").glob("step_model*.py"))
    assert {f.name for f in files} == STEP_MODEL_MODULES
    for f in files:
        tree = ast.parse(f.read_text())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        assert not names & {"mrtpo", "mrtpo_kernels", "torch"}, f.name


def test_split_by_concern_within_500_lines():
    """Issue 44: each step-model module at most 500 lines; the names tests and docs use
    stay importable from ``bench.step_model``, defined once in their own module."""
    for name in STEP_MODEL_MODULES:
        lines = (ROOT / "bench" / name).read_text().count("\n")
        assert lines <= 500, (name, lines)
    homes = {
        "step_model_parts": ("Parts", "step_times", "transfer"),
        "step_model_records": ("Case", "method_step_cases", "k4_cases", "profile_parts"),
        "step_model_check": ("check_rows", "check_table", "summary"),
        "step_model_gpu": ("Shape", "GpuRates", "h200_rates", "gpu_ratio", "gpu_tables"),
        "step_model_report": ("render_record",),
    }
    for module, names in homes.items():
        for name in names:
            assert getattr(sm, name).__module__ == f"bench.{module}", name
    assert set(sm.__all__) <= set(vars(sm))
