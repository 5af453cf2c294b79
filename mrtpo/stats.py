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

The claim tested, per MRTPO variant (``mrtpo:specific:gamma=2``, see
``mrtpo.config.parse_variant``): it reaches the target in at most 0.75x GDPO's steps on
average over seeds with the upper end of the bootstrap 95% interval below 1, and its area
under the all-pass curve is larger;
`compare_to_gdpo` measures it, with the intervals of `bootstrap_ratio`.
"""

from __future__ import annotations

import random
import statistics

CLAIM_RATIO = 0.75


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
        "step_time": _mean(
            [sum(v for k, v in m["time"].items() if k != "replays") for m in metrics]
        ),
        "replay_time": _mean([m["time"]["replay"] for m in metrics]),
        "rollout_time": _mean([m["time"]["rollout"] for m in metrics]),
        "update_time": _mean([m["time"]["update"] for m in metrics]),
        # relevance diagnostics (None where a run has no relevance, e.g. GDPO without replay)
        "top_hit": {n: _mean([m.get(f"top_hit/{n}") for m in metrics]) for n in names},
        "top_hit_chance": {
            n: _mean([m.get(f"top_hit_chance/{n}") for m in metrics]) for n in names
        },
        "rank_auc": {n: _mean([m.get(f"rank_auc/{n}") for m in metrics]) for n in names},
    }
    return out


def mean_std(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def steps_or_budget(rs, budget):
    return [r["steps_to_target"] or budget for r in rs]


def compare_to_gdpo(summary, steps: int) -> dict[str, dict]:
    """Per MRTPO variant: steps-to-target ratio to GDPO with its bootstrap 95% interval,
    AUC difference with its interval, and whether the claim's conditions hold."""
    runs = summary["runs"]
    if "gdpo" not in runs:
        return {}
    g_steps, g_auc = steps_or_budget(runs["gdpo"], steps), [r["auc"] for r in runs["gdpo"]]
    out = {}
    for algo, rs in runs.items():
        if not algo.startswith("mrtpo"):
            continue
        m_steps, m_auc = steps_or_budget(rs, steps), [r["auc"] for r in rs]
        ratio = statistics.fmean(m_steps) / statistics.fmean(g_steps)
        lo, hi = bootstrap_ratio(m_steps, g_steps)
        d_auc = statistics.fmean(m_auc) - statistics.fmean(g_auc)
        a_lo, a_hi = bootstrap_ratio(m_auc, g_auc, diff=True)
        out[algo] = {
            "ratio": ratio,
            "ci": (lo, hi),
            "auc_diff": d_auc,
            "auc_ci": (a_lo, a_hi),
            "censored": any(r["steps_to_target"] is None for r in rs + runs["gdpo"]),
            "holds": ratio <= CLAIM_RATIO and hi < 1.0 and d_auc > 0,
        }
    return out
