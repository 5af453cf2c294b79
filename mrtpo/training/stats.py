"""Statistics of `mrtpo compare` (pure Python, no torch).

Per algorithm, over seeds:

- steps to target: the first step at which the moving average (over ``window`` steps) of
  the training batch's all-pass rate reaches ``target``; a run that never
  reaches it counts as ``steps`` (a lower bound, marked with ">").
- final pass rates: each reward's and the all-pass rate, averaged over the last
  ``window`` steps.
- credit precision: the share of each reward's allocation-weight mass that lands on the
  response tokens its constraint concerns (``relevant_chars`` of the verifier, mapped to
  tokens), next to the share a uniform allocation gives (relevant tokens / response
  tokens). Under grpo/gdpo the weights are uniform, so their credit precision is the
  uniform share; "relevance precision" is the same share of the JS-distance mass, which
  contrastive replay measures under every algorithm.

- held-out curve: the pass rates of the held-out evaluations (`mrtpo.training.heldout`: a fixed set
  of eval prompts, evaluated before the first step, every ``eval_every`` steps and after the
  last). Its AUC is the area under the curve over the policy's steps (trapezoids) divided by
  the steps; its steps to target, the first evaluated step whose held-out all-pass reaches
  the target (0 where the start already meets it: such a pair is reported as such and left
  out of the steps and time ratios, which are undefined on it). The training curve's
  measures are kept beside it, second.
- wall-clock: each step's training seconds (rollout + replay + update; evaluations excluded)
  summed give the clock a run's curve is read against, for the comparison at equal
  wall-clock.

The claim tested, per MRTPO variant (``mrtpo:specific:gamma=2``, see
``mrtpo.training.config.parse_variant``), on the held-out curve where the runs have one: seeds are
paired (seed s of MRTPO and of GDPO share the warm start and the seed), and the analysis is
fixed here, before any run. Over the seeds both arms have, `paired_bootstrap` resamples the
seed indices (the same index for both arms) to give 95% percentile intervals of the steps
ratio mean(MRTPO) / mean(GDPO) and of the mean per-seed AUC difference, and
`sign_flip_p` the exact two-sided sign-flip (permutation) p-value of the per-seed
differences. A verdict is given only with at least ``MIN_SEEDS`` pairs (below that no
interval can exclude chance: with n pairs the smallest two-sided sign-flip p-value is
2 / 2^n); it holds when the steps ratio is at most 0.75 with its interval's upper end below
1 and the AUC difference's interval lies above 0; `compare_to_gdpo` measures it.
"""

from __future__ import annotations

import math
import random
import re
import statistics

CLAIM_RATIO = 0.75
MIN_SEEDS = 6  # paired seeds a verdict needs: 2 / 2**6 < 0.05 <= 2 / 2**5


def moving_average(xs: list[float], window: int) -> list[float]:
    out = []
    for i in range(len(xs)):
        part = xs[max(0, i - window + 1) : i + 1]
        out.append(sum(part) / len(part))
    return out


def steps_to_target(metrics: list[dict], target: float, window: int) -> int | None:
    """First step whose trailing ``window``-step mean all-pass rate is >= target (the
    average needs ``window`` steps: no early luck from one batch), or None."""
    ma = moving_average([m["all_pass"] for m in metrics], window)
    for i, v in enumerate(ma):
        if i + 1 >= window and v >= target:
            return metrics[i]["step"]
    return None


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def auc(metrics: list[dict]) -> float:
    """Area under the all-pass curve per step: the mean batch all-pass rate over the run
    (1.0 = every response passed every reward at every step)."""
    return statistics.fmean(m["all_pass"] for m in metrics)


def bootstrap_ratio(a: list[float], b: list[float], *, draws=4000, seed=0, diff=False):
    """Percentile 95% interval of mean(a) / mean(b) (or mean(a) - mean(b) with ``diff``),
    resampling the seeds of a and of b independently with replacement."""
    rng = random.Random(seed)
    stat = (lambda x, y: x - y) if diff else (lambda x, y: x / y)
    vals = []
    for _ in range(draws):
        ra = [a[rng.randrange(len(a))] for _ in a]
        rb = [b[rng.randrange(len(b))] for _ in b]
        vals.append(stat(statistics.fmean(ra), statistics.fmean(rb)))
    vals.sort()
    return vals[int(0.025 * draws)], vals[min(draws - 1, int(0.975 * draws))]


def paired_bootstrap(a, b, *, draws=4000, seed=0, diff=False):
    """Percentile 95% interval of mean(a) / mean(b) (or of the mean of a - b with ``diff``)
    where a[i] and b[i] are one seed's pair: the seed indices are resampled with
    replacement, the same index for both arms."""
    if len(a) != len(b) or not a:
        raise ValueError(
            f"paired_bootstrap: expected two equal non-empty lists, got {len(a)} "
            f"and {len(b)} values"
        )
    rng = random.Random(seed)
    n, vals = len(a), []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        ma = statistics.fmean(a[i] for i in idx)
        mb = statistics.fmean(b[i] for i in idx)
        vals.append(ma - mb if diff else ma / mb)
    vals.sort()
    return vals[int(0.025 * draws)], vals[min(draws - 1, int(0.975 * draws))]


def sign_flip_p(diffs, *, exact_up_to=20, draws=200_000, seed=0) -> float:
    """Two-sided p-value of the paired differences' mean under the null that each pair's
    sign is a coin flip: the share of the 2^n sign patterns whose |mean| is at least the
    observed one (exact up to ``exact_up_to`` pairs, else ``draws`` random patterns).

    The differences must be finite (a NaN or infinite one is a ValueError naming it: no
    p-value, rather than a p of 0). They are scaled by a power of two (exact) so that no
    sum overflows: the test does not depend on their scale, and the exact p-value is never
    below 2 / 2^n (the observed pattern and its mirror image count)."""
    d = [float(x) for x in diffs]
    n = len(d)
    if n == 0:
        raise ValueError("sign_flip_p: expected at least one paired difference")
    bad = next((i for i, x in enumerate(d) if not math.isfinite(x)), None)
    if bad is not None:
        raise ValueError(
            f"sign_flip_p: diffs[{bad}] is {d[bad]!r}; the paired differences must be finite "
            "(a NaN or infinite difference has no sign-flip p-value)"
        )
    top = max(abs(x) for x in d)
    if top > 0:
        shift = math.frexp(top)[1]  # top / 2^shift in [0.5, 1): the sums stay below n
        d = [math.ldexp(x, -shift) for x in d]
    observed = abs(sum(d)) - 1e-12 * max(1.0, sum(abs(x) for x in d))  # ties count as extreme
    if n <= exact_up_to:
        hits = 0
        for mask in range(1 << n):
            total = sum(-x if mask >> i & 1 else x for i, x in enumerate(d))
            hits += abs(total) >= observed
        return hits / (1 << n)
    rng = random.Random(seed)
    hits = sum(
        abs(sum(x if rng.random() < 0.5 else -x for x in d)) >= observed for _ in range(draws)
    )
    return (hits + 1) / (draws + 1)


def evaluations(metrics: list[dict]) -> list[dict]:
    """Every held-out evaluation in a run's metrics rows (`mrtpo.training.heldout`), by step."""
    out = [e for row in metrics for e in row.get("eval") or ()]
    return sorted(out, key=lambda e: e["step"])


def curve_auc(points, until=None) -> float | None:
    """Area under the piecewise-linear curve through ``points`` [(x, y)] (sorted by x), from
    its first x to ``until`` (default: its last x; a curve that stops before ``until``
    holds its last value), divided by that length; None with fewer than two points."""
    if len(points) < 2:
        return None
    x0 = points[0][0]
    end = points[-1][0] if until is None else until
    if end <= x0:
        return None
    pts = list(points)
    if pts[-1][0] < end:
        pts.append((end, pts[-1][1]))
    area = 0.0
    for (xa, ya), (xb, yb) in zip(pts, pts[1:]):
        if xa >= end:
            break
        if xb > end:  # cut the last piece at ``end``
            yb = ya + (yb - ya) * (end - xa) / (xb - xa)
            xb = end
        area += (xb - xa) * (ya + yb) / 2
    return area / (end - x0)


def step_seconds(row: dict) -> float:
    """A step's training seconds: rollout, replay and update (evaluations excluded)."""
    return sum(v for k, v in row["time"].items() if k != "replays")


def heldout_summary(metrics: list[dict], names, target: float) -> dict | None:
    """The held-out curve's measures (module doc), or None for a run without evaluations."""
    evs = evaluations(metrics)
    if not evs:
        return None
    clock = [0.0]
    for row in metrics:
        clock.append(clock[-1] + step_seconds(row))
    reached = next((e["step"] for e in evs if e["all_pass"] >= target), None)
    return {
        "steps_to_target": reached,
        "seconds_to_target": None if reached is None else clock[reached],
        "auc": curve_auc([(e["step"], e["all_pass"]) for e in evs]),
        "start_all_pass": evs[0]["all_pass"],
        "final_all_pass": evs[-1]["all_pass"],
        "final_pass": {n: evs[-1]["pass"].get(n) for n in names},
        "steps": [e["step"] for e in evs],
        "curve": [e["all_pass"] for e in evs],
        "curves": {n: [e["pass"].get(n) for e in evs] for n in names},
        "seconds": [clock[e["step"]] if e["step"] < len(clock) else None for e in evs],
        "train_s": clock[-1],
        "answers": evs[-1]["answers"],
    }


def summarize_run(metrics: list[dict], names, target: float, window: int) -> dict:
    tail = metrics[-window:]
    first = metrics[0]
    out = {
        "steps_to_target": steps_to_target(metrics, target, window),
        "auc": auc(metrics),
        "final_all_pass": _mean([m["all_pass"] for m in tail]),
        "final_pass": {n: _mean([m[f"pass/{n}"] for m in tail]) for n in names},
        "start_all_pass": first["all_pass"],
        "start_pass": {n: first[f"pass/{n}"] for n in names},
        "credit_precision": _mean([m.get("credit_precision") for m in metrics]),
        "uniform_share": _mean([m.get("uniform_share") for m in metrics]),
        "relevance_precision": _mean([m.get("relevance_precision") for m in metrics]),
        "precision": {n: _mean([m.get(f"precision/{n}") for m in metrics]) for n in names},
        "uniform": {n: _mean([m.get(f"uniform/{n}") for m in metrics]) for n in names},
        "initial_all_pass": _mean([m["all_pass"] for m in metrics[:window]]),
        "curve": [m["all_pass"] for m in metrics],
        "curves": {n: [m[f"pass/{n}"] for m in metrics] for n in names},
        "step_time": _mean([step_seconds(m) for m in metrics]),
        "replay_time": _mean([m["time"]["replay"] for m in metrics]),
        "rollout_time": _mean([m["time"]["rollout"] for m in metrics]),
        "update_time": _mean([m["time"]["update"] for m in metrics]),
        # relevance diagnostics (None where a run has no relevance, e.g. GDPO without replay)
        "top_hit": {n: _mean([m.get(f"top_hit/{n}") for m in metrics]) for n in names},
        "top_hit_chance": {
            n: _mean([m.get(f"top_hit_chance/{n}") for m in metrics]) for n in names
        },
        "rank_auc": {n: _mean([m.get(f"rank_auc/{n}") for m in metrics]) for n in names},
        "heldout": heldout_summary(metrics, names, target),
    }
    return out


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def steps_or_budget(rs, budget):
    return [r["steps_to_target"] or budget for r in rs]


def _by_seed(runs, algo: str) -> dict:
    """``runs`` by seed; a seed listed twice is a ValueError naming it (a repeated seed is
    the same pair again, not another one: counted twice it shrinks the p-value and gets
    round ``MIN_SEEDS``)."""
    out = {}
    for r in runs:
        seed = r["seed"]
        if seed in out:
            raise ValueError(
                f"runs: {algo} lists seed {seed!r} twice; pairs are by distinct seed (a "
                "repeated seed is not another pair): keep one run per seed"
            )
        out[seed] = r
    return out


def _paired(g_runs, m_runs, algo: str = "mrtpo"):
    """The (GDPO, MRTPO) summaries of the seeds both arms ran, by distinct seed."""
    g, m = _by_seed(g_runs, "gdpo"), _by_seed(m_runs, algo)
    return [(g[s], m[s]) for s in sorted(m) if s in g]


RUN_FOLDER = re.compile(r"(.+)-seed(\d+)")


def run_folder(name: str) -> tuple[str, int] | None:
    """(algo, seed) of a comparison's run folder ``<algo>-seed<s>``, or None for another
    name. The seed is written as compare writes it, in decimal without leading zeros: a
    folder such as ``mrtpo-seed01`` is a ValueError naming it (read as seed 1 it would be
    merged with ``mrtpo-seed1``; read as another seed it would pair with nothing)."""
    m = RUN_FOLDER.fullmatch(name)
    if m is None:
        return None
    digits = m.group(2)
    if digits != str(int(digits)):
        raise ValueError(
            f"runs: folder {name!r} writes its seed with a leading zero; run folders are "
            f"<algo>-seed<s> with s as compare writes it ({m.group(1)}-seed{int(digits)}): "
            "rename it"
        )
    return m.group(1), int(digits)


def _measures(pairs, steps_of, auc_of, budget) -> dict:
    """Steps ratio and AUC difference over paired seeds, with paired intervals and p-values.

    A pair whose start already meets the target (steps to target 0: the held-out evaluation
    before the first step reached it, in either arm) says nothing about how fast training
    gets there: its seed is listed under ``start_met`` and left out of the steps ratio, its
    interval and p-value (over ``steps_n`` pairs; None where no pair is left: a ratio of
    zero steps is not defined). The AUC difference keeps every pair."""
    g_steps = [budget if steps_of(g) is None else steps_of(g) for g, _ in pairs]
    m_steps = [budget if steps_of(m) is None else steps_of(m) for _, m in pairs]
    g_auc = [auc_of(g) for g, _ in pairs]
    m_auc = [auc_of(m) for _, m in pairs]
    d_auc = [m - g for m, g in zip(m_auc, g_auc)]
    moved = [i for i, (g, m) in enumerate(zip(g_steps, m_steps)) if g > 0 and m > 0]
    gs, ms = [g_steps[i] for i in moved], [m_steps[i] for i in moved]
    return {
        "n": len(pairs),
        "steps_n": len(moved),
        "start_met": [m["seed"] for i, (_, m) in enumerate(pairs) if i not in moved],
        "ratio": statistics.fmean(ms) / statistics.fmean(gs) if moved else None,
        "ci": paired_bootstrap(ms, gs) if moved else None,
        "p": sign_flip_p([m - g for m, g in zip(ms, gs)]) if moved else None,
        "auc_diff": statistics.fmean(d_auc),
        "auc_ci": paired_bootstrap(m_auc, g_auc, diff=True),
        "auc_p": sign_flip_p(d_auc),
        "censored": any(steps_of(r) is None for pair in pairs for r in pair),
        "per_seed": [
            {"seed": m["seed"], "gdpo_steps": gs, "mrtpo_steps": ms, "auc_diff": d}
            for (_, m), gs, ms, d in zip(pairs, g_steps, m_steps, d_auc)
        ],
    }


def _verdict(c: dict) -> str | None:
    """None below ``MIN_SEEDS`` pairs, or below ``MIN_SEEDS`` pairs whose start did not
    already meet the target (no steps ratio to test on the others)."""
    if c["n"] < MIN_SEEDS or c["steps_n"] < MIN_SEEDS:
        return None
    ok = c["ratio"] <= CLAIM_RATIO and c["ci"][1] < 1.0 and c["auc_ci"][0] > 0.0
    return "holds" if ok else "does not hold"


def _wallclock(pairs) -> dict | None:
    """The held-out comparison at equal wall-clock: per pair, the area under each held-out
    curve drawn against training seconds, up to the shorter run's training time, and the
    training seconds to the target (a run that never reached it counts its whole time; a
    pair whose start already met the target, 0 s, is left out of the time ratio, as of the
    steps ratio: None where none is left)."""
    if not all(g["heldout"] and m["heldout"] for g, m in pairs):
        return None
    d_auc, g_t, m_t = [], [], []
    for g, m in pairs:
        gh, mh = g["heldout"], m["heldout"]
        until = min(gh["train_s"], mh["train_s"])
        aucs = [
            curve_auc([(t, y) for t, y in zip(h["seconds"], h["curve"]) if t is not None], until)
            for h in (gh, mh)
        ]
        if None in aucs:
            return None
        d_auc.append(aucs[1] - aucs[0])
        if gh["steps_to_target"] == 0 or mh["steps_to_target"] == 0:
            continue  # the start already met the target: no time to it
        for h, out in ((gh, g_t), (mh, m_t)):
            t = h["seconds_to_target"]
            out.append(h["train_s"] if t is None else t)
    timed = bool(g_t) and statistics.fmean(g_t) > 0
    return {
        "auc_diff": statistics.fmean(d_auc),
        "auc_ci": paired_bootstrap(d_auc, [0.0] * len(d_auc), diff=True),
        "auc_p": sign_flip_p(d_auc),
        "time_n": len(g_t),
        "time_ratio": statistics.fmean(m_t) / statistics.fmean(g_t) if timed else None,
        "time_ci": paired_bootstrap(m_t, g_t) if timed and min(g_t) > 0 else None,
    }


def compare_to_gdpo(summary, steps: int) -> dict[str, dict]:
    """Per MRTPO variant, over the seeds both it and GDPO ran (module doc): on the held-out
    curve where every paired run has one (else the training curve), the steps-to-target
    ratio and the AUC difference with paired bootstrap intervals and sign-flip p-values,
    the verdict (None below ``MIN_SEEDS`` pairs); the same on the training curve under
    ``training``, and the held-out comparison at equal wall-clock under ``wallclock``."""
    runs = summary["runs"]
    if "gdpo" not in runs:
        return {}
    out = {}
    for algo, rs in runs.items():
        if not algo.startswith("mrtpo"):
            continue
        pairs = _paired(runs["gdpo"], rs, algo)
        if not pairs:
            continue
        training = _measures(pairs, lambda r: r["steps_to_target"], lambda r: r["auc"], steps)
        heldout = None
        if all(g.get("heldout") and m.get("heldout") for g, m in pairs) and all(
            r["heldout"]["auc"] is not None for pair in pairs for r in pair
        ):
            heldout = _measures(
                pairs,
                lambda r: r["heldout"]["steps_to_target"],
                lambda r: r["heldout"]["auc"],
                steps,
            )
        c = dict(heldout or training)
        c["curve"] = "held-out" if heldout else "training"
        c["training"] = training
        c["wallclock"] = _wallclock(pairs) if heldout else None
        c["verdict"] = _verdict(c)
        c["holds"] = c["verdict"] == "holds"
        out[algo] = c
    return out
