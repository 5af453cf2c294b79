"""``mrtpo compare``: the method's claim, measured on a built-in task (``--task``).

Every algorithm is trained with every seed, with identical settings, from the same
warm-started model: by default one model (``--init-seed``, cached) shared by every run, so
that seeds vary only sampling and data order, as when runs start from one pretrained model.
Reported per algorithm, over seeds:

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

The claim tested: MRTPO reaches the target in at most 0.75x GDPO's steps on average over
seeds, and its credit precision is well above uniform.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from .config import CompareConfig
from .model import default_model
from .report import pyplot
from .tasks import load_task
from .trainer import train

CLAIM_RATIO = 0.75
ALGO_COLORS = {"grpo": "tab:blue", "gdpo": "tab:orange", "mrtpo": "tab:green"}


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


def summarize_run(metrics: list[dict], names, target: float, window: int) -> dict:
    tail = metrics[-window:]
    out = {
        "steps_to_target": steps_to_target(metrics, target, window),
        "final_all_pass": _mean([m["all_pass"] for m in tail]),
        "final_pass": {n: _mean([m[f"pass/{n}"] for m in tail]) for n in names},
        "credit_precision": _mean([m.get("credit_precision") for m in metrics]),
        "uniform_share": _mean([m.get("uniform_share") for m in metrics]),
        "relevance_precision": _mean([m.get("relevance_precision") for m in metrics]),
        "precision": {n: _mean([m.get(f"precision/{n}") for m in metrics]) for n in names},
        "uniform": {n: _mean([m.get(f"uniform/{n}") for m in metrics]) for n in names},
        "initial_all_pass": _mean([m["all_pass"] for m in metrics[:window]]),
        "curve": [m["all_pass"] for m in metrics],
    }
    return out


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def task_slug(task: str) -> str:
    """A file-name form of a task name (``constraints:a,b`` -> ``constraints-a-b``)."""
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in task)


def _train_seed(cfg: CompareConfig, seed: int, task=None) -> list[tuple[str, dict, list[str]]]:
    """Every algorithm of one seed (run in the parent or in a worker process)."""
    import torch

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    out = []
    for algo in cfg.algos:
        t0 = time.perf_counter()
        res = train(cfg.run_config(algo, seed), task=task, progress=False)
        names = [k[len("pass/") :] for k in res.metrics[0] if k.startswith("pass/")]
        s = summarize_run(res.metrics, names, cfg.target, cfg.window)
        s["seed"], s["wall_s"] = seed, time.perf_counter() - t0
        out.append((algo, s, names))
    return out


def _prepare_models(cfg: CompareConfig, task, log):
    """Warm-start (or find in the cache) every initial model before any run starts, so
    parallel seeds never build the same cache entry at once."""
    if cfg.train.model is not None:
        return
    seeds = {cfg.init_seed} if cfg.init_seed is not None else set(range(cfg.seeds))
    for s in sorted(seeds):
        t = task if task is not None else load_task(cfg.task, seed=s)
        default_model(t, seed=s, cache_dir=cfg.train.cache_dir, cfg=cfg.train.tiny, log=log)


def run_compare(cfg: CompareConfig, *, task=None, log=print) -> dict:
    """Train every (algo, seed) and write the table and plot; returns the summary. ``task``
    replaces the built-in ``cfg.task`` (tests pass a small one)."""
    cfg.validate(builtin_task=task is None)
    out = Path(cfg.out)
    results = Path(cfg.results)
    runs: dict[str, list[dict]] = {a: [] for a in cfg.algos}
    names = None
    t_start = time.perf_counter()
    _prepare_models(cfg, task, log)
    seeds = list(range(cfg.seeds))
    if cfg.jobs > 1 and len(seeds) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(min(cfg.jobs, len(seeds)), mp_context=ctx) as pool:
            per_seed = list(pool.map(_train_seed, [cfg] * len(seeds), seeds))
    else:
        per_seed = [_train_seed(cfg, seed, task) for seed in seeds]
    for seed_runs in per_seed:
        for algo, s, run_names in seed_runs:
            names = run_names
            runs[algo].append(s)
            reached = s["steps_to_target"] or f">{cfg.steps}"
            log(
                f"{algo} seed {s['seed']}: steps to target {reached}, final all-pass "
                f"{_fmt(s['final_all_pass'])}, credit precision {_fmt(s['credit_precision'])} "
                f"(uniform {_fmt(s['uniform_share'])}), {s['wall_s']:.0f} s"
            )
    total = time.perf_counter() - t_start
    summary = {"settings": _settings(cfg), "reward_names": names, "runs": runs, "wall_s": total}
    results.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    stem = f"compare_{task_slug(cfg.task)}"
    md = write_markdown(summary, results / f"{stem}.md", cfg)
    png = plot_compare(summary, results / f"{stem}.png", cfg)
    log(f"\nwrote {md} and {png} ({total / 60:.1f} min)")
    return summary


def _settings(cfg: CompareConfig) -> dict:
    t = cfg.train
    return {
        "task": cfg.task,
        "algos": list(cfg.algos),
        "seeds": cfg.seeds,
        "init_seed": cfg.init_seed,
        "steps": cfg.steps,
        "target": cfg.target,
        "window": cfg.window,
        "prompts_per_step": t.prompts_per_step,
        "group_size": t.group_size,
        "max_new_tokens": t.max_new_tokens,
        "temperature": t.temperature,
        "lr": t.lr,
        "ppo_epochs": t.ppo_epochs,
        "minibatches": t.minibatches,
        "alpha": t.alpha,
        "gamma": t.gamma,
        "warm_steps": t.tiny.warm_steps,
        "model": t.model,
    }


def claim_verdict(summary, steps: int) -> list[str]:
    runs = summary["runs"]
    lines = []
    if "mrtpo" in runs and "gdpo" in runs:
        m = [r["steps_to_target"] or steps for r in runs["mrtpo"]]
        g = [r["steps_to_target"] or steps for r in runs["gdpo"]]
        censored = any(r["steps_to_target"] is None for r in runs["mrtpo"] + runs["gdpo"])
        ratio = statistics.fmean(m) / statistics.fmean(g)
        ok = ratio <= CLAIM_RATIO
        lines.append(
            f"- Steps to target, MRTPO / GDPO (mean over seeds): {statistics.fmean(m):.1f} / "
            f"{statistics.fmean(g):.1f} = **{ratio:.2f}** (claim: <= {CLAIM_RATIO}): "
            f"**{'holds' if ok else 'does not hold'}**"
            + (" (runs that never reached the target count as the step budget)" if censored else "")
        )
    if "mrtpo" in runs:
        p, _ = _stats([r["credit_precision"] for r in runs["mrtpo"]])
        u, _ = _stats([r["uniform_share"] for r in runs["mrtpo"]])
        if p is not None and u is not None:
            lines.append(
                f"- MRTPO credit precision {p:.2f} vs uniform share {u:.2f} ({p / u:.1f}x uniform)"
            )
    return lines


def _start(args: CompareConfig) -> str:
    if args.train.model is not None:
        return f"the model in `{args.train.model}`"
    if args.init_seed is not None:
        return (
            f"the same warm-started tiny model ({args.train.tiny.warm_steps} supervised steps, "
            f"task data and init of seed {args.init_seed}); the seed varies sampling and data order"
        )
    return "the warm-started tiny model of that seed (all algorithms of a seed share it)"


def write_markdown(summary, path: Path, args) -> Path:
    runs, names = summary["runs"], summary["reward_names"] or []
    st = summary["settings"]
    lines = [
        f"# MRTPO vs GDPO vs GRPO on the built-in {args.task} task",
        "",
        f"Generated by `mrtpo compare --task {args.task} --algos {','.join(args.algos)} "
        f"--seeds {args.seeds}` "
        f"({summary['wall_s'] / 60:.1f} min on CPU). Rewards: {', '.join(names)}. "
        f"Each (algorithm, seed) trains {args.steps} steps from {_start(args)}; "
        f"{st.get('prompts_per_step')} prompts x "
        f"{st.get('group_size')} responses per step. Target: all-pass rate "
        f">= {args.target} (moving average over {args.window} training steps).",
        "",
        "## The claim",
        "",
        *claim_verdict(summary, args.steps),
        "",
        "## Results (mean +- std over seeds)",
        "",
        "| algo | steps to target (per seed) | initial all-pass | final all-pass | "
        + " | ".join(f"final {n}" for n in names)
        + " | credit precision | uniform share | relevance precision |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|---|",
    ]
    for algo, rs in runs.items():
        per_seed = ", ".join(
            str(r["steps_to_target"]) if r["steps_to_target"] else f">{args.steps}" for r in rs
        )
        mean_steps = statistics.fmean(r["steps_to_target"] or args.steps for r in rs)
        cells = [algo, f"{mean_steps:.1f} ({per_seed})"]
        for key in ("initial_all_pass", "final_all_pass"):
            m, s = _stats([r[key] for r in rs])
            cells.append(f"{_fmt(m)} +- {_fmt(s)}")
        for n in names:
            m, s = _stats([r["final_pass"][n] for r in rs])
            cells.append(f"{_fmt(m)} +- {_fmt(s)}")
        for key in ("credit_precision", "uniform_share", "relevance_precision"):
            m, s = _stats([r[key] for r in rs])
            cells.append(_fmt(m))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Credit precision per reward (MRTPO allocation mass on the tokens the constraint "
        "concerns / uniform share):",
        "",
        "| algo | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for algo, rs in runs.items():
        cells = [algo]
        for n in names:
            p, _ = _stats([r["precision"][n] for r in rs])
            u, _ = _stats([r["uniform"][n] for r in rs])
            cells.append(f"{_fmt(p)} / {_fmt(u)}")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Definitions: steps to target = first step where the trailing mean of the batch "
        "all-pass rate reaches the target (never reached: counted as the budget, shown as "
        "`>N`); final = mean of the last window of steps; credit precision = share of a "
        "reward's allocation-weight mass on the response tokens its verifier's "
        "`relevant_chars` names (responses where those tokens are a proper non-empty "
        "subset), uniform share = the same for uniform weights, relevance precision = the "
        "same share of the JS-distance mass from contrastive replay.",
        "",
        f"![curves](compare_{task_slug(args.task)}.png)",
        "",
        "Settings: `" + json.dumps(st) + "`",
        "",
    ]
    path.write_text("\n".join(lines))
    return path


def plot_compare(summary, path: Path, args) -> Path:
    plt = pyplot()
    runs, names = summary["runs"], summary["reward_names"] or []
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    for algo, rs in runs.items():
        curves = [moving_average(r["curve"], args.window) for r in rs]
        n = min(len(c) for c in curves)
        steps = list(range(1, n + 1))
        mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        (line,) = ax.plot(steps, mean, label=algo, lw=2, color=ALGO_COLORS.get(algo))
        ax.fill_between(steps, lo, hi, color=line.get_color(), alpha=0.15)
    ax.axhline(args.target, color="k", ls=":", lw=1, label=f"target {args.target}")
    ax.set(
        xlabel="step",
        ylabel=f"all-pass rate ({args.window}-step mean)",
        title="learning curves (mean over seeds, band = min-max)",
        ylim=(0, 1),
    )
    ax.legend()
    ax = axes[1]
    width = 0.8 / (len(runs) + 1)
    xs = range(len(names))
    for a_i, (algo, rs) in enumerate(runs.items()):
        vals = [_stats([r["precision"][n] for r in rs])[0] or 0 for n in names]
        ax.bar(
            [x + a_i * width for x in xs],
            vals,
            width,
            label=f"{algo} allocation",
            color=ALGO_COLORS.get(algo),
        )
    uni = [_stats([r["uniform"][n] for rs in runs.values() for r in rs])[0] or 0 for n in names]
    ax.bar([x + len(runs) * width for x in xs], uni, width, color="grey", label="uniform")
    ax.set_xticks([x + width * len(runs) / 2 for x in xs], names, fontsize=8)
    ax.set(ylabel="share of weight mass on relevant tokens", title="credit precision", ylim=(0, 1))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
