"""The comparison's statistics (mrtpo.training.stats): paired intervals, the sign-flip p-value, the
held-out curve's measures, the verdict's rules, equal wall-clock."""

from __future__ import annotations

import itertools

import pytest

from mrtpo.training.report import claim_verdict
from mrtpo.training.stats import (
    MIN_SEEDS,
    bootstrap_ratio,
    compare_to_gdpo,
    curve_auc,
    heldout_summary,
    paired_bootstrap,
    run_folder,
    sign_flip_p,
    summarize_run,
)


def test_sign_flip_p_is_exact():
    assert sign_flip_p([1.0] * 6) == pytest.approx(2 / 64)  # only all + or all - as extreme
    assert sign_flip_p([1.0] * 5) == pytest.approx(2 / 32)
    assert sign_flip_p([1.0, -1.0]) == 1.0
    d = [0.3, -0.1, 0.2, 0.25, 0.05]
    obs = abs(sum(d))
    brute = sum(
        abs(sum(s * x for s, x in zip(signs, d))) >= obs - 1e-12
        for signs in itertools.product((1, -1), repeat=len(d))
    )
    assert sign_flip_p(d) == pytest.approx(brute / 32)
    many = sign_flip_p([0.1] * 30, draws=20_000)  # Monte Carlo beyond 20 pairs
    assert 0.0 < many < 1e-3
    with pytest.raises(ValueError, match="at least one"):
        sign_flip_p([])


def test_sign_flip_p_refuses_non_finite_differences_and_never_goes_below_its_floor():
    """Issue 41, item 2: a NaN or infinite difference gave p = 0.0 (every comparison with
    NaN is False: no sign pattern counted, not even the observed one)."""
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(ValueError, match=r"sign_flip_p: diffs\[2\] is .*finite"):
            sign_flip_p([0.1, 0.2, bad, 0.3])
    # finite differences whose sum overflows a float (the observed |sum| was inf - inf =
    # NaN): the test does not depend on the scale, and p is never below 2 / 2^n
    for d in ([1e308] * 4, [1e308, -1e308, 1e308, 1e308], [5e-324] * 3, [1.5e308, 1e-300]):
        assert sign_flip_p(d) >= 2 / 2 ** len(d)
    assert sign_flip_p([1e308] * 6) == pytest.approx(2 / 64)
    assert sign_flip_p([1e308, 1e308, -1e308]) == sign_flip_p([1.0, 1.0, -1.0])
    assert sign_flip_p([0.0, 0.0]) == 1.0


def test_paired_bootstrap_uses_the_pairing():
    # seeds differ a lot, MRTPO is ahead of GDPO by 0.05 on every seed: paired, the interval
    # excludes 0; resampling each arm on its own (the old analysis), it does not
    g = [0.1, 0.5, 0.3, 0.8, 0.2, 0.6]
    m = [x + 0.05 for x in g]
    lo, hi = paired_bootstrap(m, g, diff=True)
    assert lo == pytest.approx(0.05) and hi == pytest.approx(0.05)
    u_lo, u_hi = bootstrap_ratio(m, g, diff=True)
    assert u_lo < 0 < u_hi
    r_lo, r_hi = paired_bootstrap([2.0, 4.0, 6.0], [4.0, 8.0, 12.0])
    assert r_lo == pytest.approx(0.5) and r_hi == pytest.approx(0.5)
    with pytest.raises(ValueError, match="equal"):
        paired_bootstrap([1.0], [1.0, 2.0])


def test_curve_auc():
    assert curve_auc([(0, 0.0), (10, 1.0)]) == pytest.approx(0.5)
    assert curve_auc([(0, 0.2), (5, 0.2), (10, 0.6)]) == pytest.approx(0.3)
    assert curve_auc([(0, 0.0), (10, 1.0)], until=5) == pytest.approx(0.25)  # cut inside
    assert curve_auc([(0, 0.0), (10, 1.0)], until=20) == pytest.approx(0.75)  # holds the last
    assert curve_auc([(0, 1.0)]) is None


def _rows(all_pass, evals, seconds=1.0):
    """Metrics rows of a run: training all-pass per step, held-out evaluations
    {step: all_pass}, each step taking ``seconds``."""
    rows = []
    for i, x in enumerate(all_pass, start=1):
        row = {"step": i, "all_pass": x, "pass/r": x, "time": {"rollout": seconds, "replay": 0.0,
               "update": 0.0, "replays": 3}}  # fmt: skip
        evs = [s for s in sorted(evals) if (s == 0 and i == 1) or (s == i and s > 0)]
        if evs:
            row["eval"] = [
                {"step": s, "all_pass": evals[s], "pass": {"r": evals[s]}, "answers": 8}
                for s in evs
            ]
        rows.append(row)
    return rows


def test_heldout_summary():
    rows = _rows([0.1, 0.2, 0.3, 0.4], {0: 0.1, 2: 0.5, 4: 0.7}, seconds=2.0)
    h = heldout_summary(rows, ["r"], target=0.5)
    assert h["steps"] == [0, 2, 4] and h["curve"] == [0.1, 0.5, 0.7]
    assert h["steps_to_target"] == 2 and h["seconds_to_target"] == pytest.approx(4.0)
    assert h["auc"] == pytest.approx((0.3 * 2 + 0.6 * 2) / 4)
    assert h["final_pass"] == {"r": 0.7} and h["train_s"] == pytest.approx(8.0)
    assert heldout_summary(rows, ["r"], target=0.9)["steps_to_target"] is None
    assert heldout_summary(_rows([0.1], {}), ["r"], 0.5) is None


def _summary(pairs, *, steps=4, heldout=True):
    """A comparison's summary from per seed (gdpo, mrtpo) held-out curves."""
    runs = {"gdpo": [], "mrtpo": []}
    for seed, (g, m) in enumerate(pairs):
        for algo, curve in (("gdpo", g), ("mrtpo", m)):
            evals = dict(zip([0, 2, 4], curve)) if heldout else {}
            s = summarize_run(_rows([curve[-1]] * steps, evals), ["r"], 0.5, 1)
            s["seed"] = seed
            runs[algo].append(s)
    return {"runs": runs, "settings": {"baseline_replay": False}}


def test_no_verdict_with_too_few_seeds():
    # two seeds, MRTPO far ahead on both: intervals but no verdict
    s = _summary([((0.1, 0.2, 0.3), (0.1, 0.6, 0.9))] * 2)
    c = compare_to_gdpo(s, 4)["mrtpo"]
    assert c["n"] == 2 and c["curve"] == "held-out"
    assert c["verdict"] is None and not c["holds"]
    text = "\n".join(claim_verdict(s, 4))
    assert "no verdict" in text and "holds" not in text.replace("does not hold", "")
    one = compare_to_gdpo(_summary([((0.1, 0.2, 0.3), (0.1, 0.6, 0.9))]), 4)["mrtpo"]
    assert one["verdict"] is None  # the old analysis printed "claim holds" here


def test_verdict_needs_the_auc_interval_above_zero():
    # MRTPO reaches the target in half the steps on every seed (GDPO never does), and its
    # held-out AUC is ahead on average, but behind on three seeds of six: the AUC interval
    # crosses 0
    ahead = ((0.1, 0.3, 0.45), (0.1, 0.55, 0.9))  # AUC 0.2875 vs 0.525
    behind = ((0.1, 0.45, 0.45), (0.0, 0.5, 0.0))  # AUC 0.3625 vs 0.25
    pairs = [ahead] * 3 + [behind] * 3
    c = compare_to_gdpo(_summary(pairs), 4)["mrtpo"]
    assert c["n"] == MIN_SEEDS and c["ratio"] == pytest.approx(0.5) and c["ci"][1] < 1
    assert c["auc_diff"] > 0 and c["auc_ci"][0] < 0 < c["auc_ci"][1]
    assert c["verdict"] == "does not hold"
    # every seed ahead by the same margin: both intervals clear, the claim holds
    c = compare_to_gdpo(_summary([ahead] * MIN_SEEDS), 4)["mrtpo"]
    assert c["ratio"] == pytest.approx(2 / 4) and c["ci"][1] < 1 and c["auc_ci"][0] > 0
    assert c["verdict"] == "holds" and c["p"] == pytest.approx(2 / 64)
    assert "**holds**" in "\n".join(claim_verdict(_summary([ahead] * MIN_SEEDS), 4))


def test_pairs_by_seed_and_falls_back_to_the_training_curve():
    s = _summary([((0.1, 0.3, 0.45), (0.1, 0.55, 0.9))] * 3, heldout=False)
    s["runs"]["mrtpo"] = s["runs"]["mrtpo"][:2]  # seed 2 of MRTPO missing: two pairs
    c = compare_to_gdpo(s, 4)["mrtpo"]
    assert c["curve"] == "training" and c["n"] == 2 and c["wallclock"] is None


def test_a_start_that_already_meets_the_target_is_reported_as_such():
    """Issue 41, item 1: held-out steps to target 0 (the evaluation before the first step
    already meets the target) in GDPO's runs ended in a ZeroDivisionError (a steps ratio
    over zero steps), after all the training, and no table was written."""
    met = ((0.6, 0.7, 0.8), (0.6, 0.8, 0.9))  # held-out all-pass at step 0 >= 0.5
    s = _summary([met] * MIN_SEEDS)
    c = compare_to_gdpo(s, 4)["mrtpo"]
    assert c["curve"] == "held-out" and c["n"] == MIN_SEEDS and c["steps_n"] == 0
    assert c["start_met"] == list(range(MIN_SEEDS))
    assert c["ratio"] is None and c["ci"] is None and c["p"] is None
    assert c["auc_diff"] > 0 and c["auc_ci"][0] > 0  # the AUC keeps every pair
    assert c["verdict"] is None and not c["holds"]
    assert c["wallclock"]["time_ratio"] is None and c["wallclock"]["auc_diff"] > 0
    text = "\n".join(claim_verdict(s, 4))
    assert "the start already meets the target on every seed (0, 1, 2, 3, 4, 5" in text
    assert "0 of 6 paired seeds left to measure the steps to target" in text
    # some seeds' start meets the target: they are left out of the steps ratio, by name
    ahead = ((0.1, 0.3, 0.45), (0.1, 0.55, 0.9))
    s = _summary([met, ahead, ahead])
    c = compare_to_gdpo(s, 4)["mrtpo"]
    assert c["start_met"] == [0] and c["steps_n"] == 2 and c["n"] == 3
    assert c["ratio"] == pytest.approx(2 / 4) and c["ci"] == pytest.approx((0.5, 0.5))
    assert c["p"] == pytest.approx(2 / 4)  # over the two seeds left
    assert c["wallclock"]["time_n"] == 2 and c["wallclock"]["time_ratio"] == pytest.approx(0.5)
    assert "over 2 paired seeds (seed(s) 0 left out: the start already meets" in "\n".join(
        claim_verdict(s, 4)
    )


def test_a_repeated_seed_is_not_another_pair():
    """Issue 41, item 9: three seeds listed twice gave n = 6, p = 0.031 and "holds"."""
    ahead = ((0.1, 0.3, 0.45), (0.1, 0.55, 0.9))
    s = _summary([ahead] * 3)
    assert compare_to_gdpo(s, 4)["mrtpo"]["n"] == 3
    for arm in ("mrtpo", "gdpo"):
        twice = _summary([ahead] * 3)
        twice["runs"][arm] = twice["runs"][arm] * 2
        with pytest.raises(ValueError, match=f"runs: {arm} lists seed 0 twice"):
            compare_to_gdpo(twice, 4)
        with pytest.raises(ValueError, match="distinct seed"):
            claim_verdict(twice, 4)
    both = _summary([ahead] * 3)
    both["runs"] = {a: rs * 2 for a, rs in both["runs"].items()}
    with pytest.raises(ValueError, match="seed 0 twice"):
        compare_to_gdpo(both, 4)


def test_run_folder_names_are_read_by_distinct_seed():
    assert run_folder("mrtpo-seed1") == ("mrtpo", 1)
    assert run_folder("mrtpo:specific:gamma=2-seed10") == ("mrtpo:specific:gamma=2", 10)
    assert run_folder("gdpo-seed0") == ("gdpo", 0)
    for other in ("mrtpo", "mrtpo-seed", "mrtpo-seedx", "mrtpo-seed-1", "seed1", "notes.md"):
        assert run_folder(other) is None
    for padded in ("mrtpo-seed01", "gdpo-seed00", "mrtpo-seed007"):
        with pytest.raises(ValueError, match=f"folder '{padded}' writes its seed with a leading"):
            run_folder(padded)


def test_equal_wall_clock():
    # MRTPO's steps take twice GDPO's seconds: at equal steps it is ahead, at equal
    # wall-clock it is not
    g_rows = _rows([0.5] * 4, {0: 0.0, 2: 0.5, 4: 1.0}, seconds=1.0)
    m_rows = _rows([0.5] * 4, {0: 0.0, 2: 1.0, 4: 1.0}, seconds=2.0)
    runs = {"gdpo": [], "mrtpo": []}
    for seed in range(MIN_SEEDS):
        for algo, rows in (("gdpo", g_rows), ("mrtpo", m_rows)):
            r = summarize_run(rows, ["r"], 0.5, 1)
            r["seed"] = seed
            runs[algo].append(r)
    c = compare_to_gdpo({"runs": runs, "settings": {"baseline_replay": False}}, 4)["mrtpo"]
    assert c["auc_diff"] > 0
    w = c["wallclock"]
    # up to GDPO's 4 s: GDPO's curve 0 -> 1 over 4 s (AUC 0.5); MRTPO's 0 -> 1 over 4 s
    assert w["auc_diff"] == pytest.approx(0.0, abs=1e-12)
    assert w["time_ratio"] == pytest.approx(4.0 / 2.0)  # 4 s to target against 2 s
