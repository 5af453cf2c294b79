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

The claim tested, per MRTPO variant (``mrtpo:specific:gamma=2``, see
``mrtpo.config.parse_variant``): it reaches the target in at most 0.75x GDPO's steps on
average over seeds with the upper end of the bootstrap 95% interval below 1, and its area
under the all-pass curve is larger. Results go to ``<results>/<task>/``. Each run lives in
``<out>/<task>/<variant>-seed<s>``; a finished run there with the same key (`run_key`: every
trajectory setting, the number of steps, the device and CPU threads) is reused, one of the
same key that stopped before the end (killed, or made with fewer ``--steps``) is resumed
from its checkpoint, anything else is trained again (``--rerun`` retrains every run).
"""

from __future__ import annotations

import json
import random
import statistics
import time
from dataclasses import fields, replace
from pathlib import Path

from .checkpoint import write_atomic
from .config import COMPARE_FIXED, CompareConfig, flag_of, task_slug
from .model import default_model
from .report import pyplot
from .tasks import load_task

CLAIM_RATIO = 0.75
ALGO_COLORS = {"grpo": "tab:blue", "gdpo": "tab:orange", "mrtpo": "tab:green"}
# the other variants (mrtpo:specific, ...) in order, none repeating a colour above
_MORE_COLORS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan",
                "tab:gray", "black", "gold", "navy")  # fmt: skip


def algo_colors(algos) -> dict[str, str]:
    """A distinct colour for each algorithm (the three base ones keep theirs)."""
    out, spare = {}, iter(_MORE_COLORS)
    for a in algos:
        out[a] = ALGO_COLORS.get(a) or next(spare, None)
    return out


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
    }
    return out


def _fmt(x, digits=2):
    return "-" if x is None else f"{x:.{digits}f}"


def _stats(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None, None
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def _done_path(run_cfg) -> Path:
    return Path(run_cfg.out) / "compare_run.json"


def run_key(run_cfg) -> dict:
    """Every setting that changes what a run computes, as JSON: the trajectory settings,
    the number of steps, and the device and CPU threads it computes with (they change the
    order of floating-point sums). A run is reused only under the same key."""
    import torch

    from .trainer import resolve_device

    key = json.loads(json.dumps(run_cfg.trajectory()))
    key["steps"] = run_cfg.steps
    key["device"] = str(resolve_device(run_cfg.device))
    key["threads"] = run_cfg.threads or torch.get_num_threads()
    return key


def _record(run_cfg) -> dict | None:
    """This comparison's record of the run in ``run_cfg.out`` (its key, whether it finished),
    or None."""
    try:
        saved = json.loads(_done_path(run_cfg).read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) and isinstance(saved.get("key"), dict) else None


def _full_history(run_cfg) -> list[dict] | None:
    """The run's metrics rows if they are exactly steps 1..``steps``, else None."""
    try:
        text = (Path(run_cfg.out) / "metrics.jsonl").read_text()
        rows = [json.loads(line) for line in text.splitlines()]
    except (OSError, ValueError):
        return None
    steps = [r.get("step") if isinstance(r, dict) else None for r in rows]
    return rows if steps == list(range(1, run_cfg.steps + 1)) else None


def _without_steps(key: dict) -> dict:
    return {k: v for k, v in key.items() if k != "steps"}


def plan_run(run_cfg, key: dict, *, rerun: bool = False) -> tuple[str, object]:
    """What to do with the folder of one run: ("reuse", metrics) for a finished run of the
    same key; ("resume", step) for a run of the same key but its length that stopped at or
    before ``steps`` (a killed run, or a shorter one to extend); ("fresh", reason) otherwise."""
    if rerun:
        return "fresh", "--rerun"
    record = _record(run_cfg)
    if record is None:
        return "fresh", None
    if _without_steps(record["key"]) != _without_steps(key):
        return "fresh", "made with other settings"
    metrics = _full_history(run_cfg)
    if record["key"] == key and record.get("complete") and metrics is not None:
        return "reuse", metrics
    from .checkpoint import RunDir

    step = RunDir(run_cfg.out).committed_step() or 0
    if step > run_cfg.steps:
        return "fresh", f"made with more steps ({step})"
    return "resume", step


def _train_one(cfg: CompareConfig, algo: str, seed: int, task=None) -> dict:
    """One (algo, seed) run: its saved metrics when it already finished with the same key
    (unless ``cfg.rerun``), its continuation when it stopped early, else a fresh run; runs
    in the parent or in a worker process."""
    import torch

    from .trainer import Trainer

    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    run_cfg = cfg.run_config(algo, seed)
    key = run_key(run_cfg)
    action, found = plan_run(run_cfg, key, rerun=cfg.rerun)
    if action == "reuse":
        # the target and window are not run settings: summarize the saved metrics under this
        # comparison's (a rerun with another --target reuses the runs)
        metrics = found
        names = [k[len("pass/") :] for k in metrics[0] if k.startswith("pass/")]
        s = summarize_run(metrics, names, cfg.target, cfg.window)
        s["seed"], s["wall_s"] = seed, _record(run_cfg)["summary"]["wall_s"]
        return {"algo": algo, "names": names, "summary": s, "how": "reused"}
    if action == "resume":
        run_cfg = replace(run_cfg, resume=True, overwrite=False)
    t0 = time.perf_counter()
    trainer = Trainer(run_cfg, task=task)
    write_atomic(_done_path(run_cfg), json.dumps({"algo": algo, "key": key, "complete": False}))
    res = trainer.run(progress=False)
    names = [k[len("pass/") :] for k in res.metrics[0] if k.startswith("pass/")]
    s = summarize_run(res.metrics, names, cfg.target, cfg.window)
    s["seed"], s["wall_s"] = seed, time.perf_counter() - t0
    done = {"algo": algo, "names": names, "summary": s, "key": key, "complete": True}
    write_atomic(_done_path(run_cfg), json.dumps(done))
    how = f"resumed from step {found}" if action == "resume" else "trained"
    if action == "fresh" and found:
        how += f"; replaced a run {found}" if found != "--rerun" else ""
    done["how"] = how
    return done


def _prepare_models(cfg: CompareConfig, task, log):
    """Warm-start (or find in the cache) every initial model before any run starts, so
    parallel runs never build the same cache entry at once."""
    if cfg.train.model is not None:
        return
    seeds = {cfg.init_seed} if cfg.init_seed is not None else set(range(cfg.seeds))
    for s in sorted(seeds):
        t = task if task is not None else load_task(cfg.task, seed=s)
        default_model(t, seed=s, cache_dir=cfg.train.cache_dir, cfg=cfg.train.tiny, log=log)


def results_dir(cfg: CompareConfig) -> Path:
    """``<results>/<task>``: the task's Markdown table and plots."""
    return Path(cfg.results) / task_slug(cfg.task)


def run_compare(cfg: CompareConfig, *, task=None, log=print) -> dict:
    """Train every (algo, seed) -- reusing finished runs -- and write the table and plots;
    returns the summary. ``task`` replaces the built-in ``cfg.task`` (tests pass one)."""
    cfg.validate(builtin_task=task is None)
    out = Path(cfg.out) / task_slug(cfg.task)
    results = results_dir(cfg)
    runs: dict[str, list[dict]] = {a: [] for a in cfg.algos}
    names = None
    t_start = time.perf_counter()
    _prepare_models(cfg, task, log)
    todo = [(a, s) for s in range(cfg.seeds) for a in cfg.algos]
    if cfg.jobs > 1 and len(todo) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor

        if task is not None:
            raise ValueError("jobs: a task object runs in one process; use --jobs 1")
        ctx = mp.get_context("spawn")
        with ProcessPoolExecutor(min(cfg.jobs, len(todo)), mp_context=ctx) as pool:
            futures = [pool.submit(_train_one, cfg, a, s) for a, s in todo]
            done = [f.result() for f in futures]
    else:
        done = [_train_one(cfg, a, s, task) for a, s in todo]
    for d in done:
        s = d["summary"]
        names = d["names"]
        runs[d["algo"]].append(s)
        reached = s["steps_to_target"] or f">{cfg.steps}"
        log(
            f"{d['algo']} seed {s['seed']}: steps to target {reached}, AUC {_fmt(s['auc'])}, "
            f"final all-pass {_fmt(s['final_all_pass'])}, credit precision "
            f"{_fmt(s['credit_precision'])} (uniform {_fmt(s['uniform_share'])}), "
            f"{s['wall_s']:.0f} s" + (f" ({d['how']})" if d["how"] != "trained" else "")
        )
    total = time.perf_counter() - t_start
    summary = {
        "settings": _settings(cfg),
        "command": command_line(cfg),
        "reward_names": names,
        "runs": runs,
        "wall_s": total,
        "train_s": sum(r["wall_s"] for rs in runs.values() for r in rs),
        "jobs": cfg.jobs,
    }
    results.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    (results / "summary.json").write_text(json.dumps(_without_curves(summary), indent=1))
    md = write_markdown(summary, results / "compare.md", cfg)
    png = plot_compare(summary, results / "compare.png", cfg)
    log(f"\nwrote {md} and {png} ({total / 60:.1f} min)")
    return summary


def _without_curves(summary):
    slim = dict(summary)
    slim["runs"] = {
        a: [{k: v for k, v in r.items() if k not in ("curve", "curves")} for r in rs]
        for a, rs in summary["runs"].items()
    }
    return slim


def command_line(cfg: CompareConfig) -> str:
    """The ``mrtpo compare`` command that gives ``cfg`` (flags that differ from defaults)."""
    default = CompareConfig()
    parts = ["mrtpo compare", f"--task {cfg.task}"]
    for f in fields(cfg):
        if f.name in ("task", "train"):
            continue
        v, d = getattr(cfg, f.name), getattr(default, f.name)
        if v != d:
            if isinstance(v, bool):
                parts.append(flag_of(f))
            else:
                parts.append(f"{flag_of(f)} {','.join(v) if isinstance(v, tuple) else v}")
    for f in fields(cfg.train):
        v, d = getattr(cfg.train, f.name), getattr(default.train, f.name)
        if f.name in COMPARE_FIXED or f.metadata.get("cli") is False or v == d:
            continue
        if f.name == "tiny":
            if v.warm_steps != d.warm_steps:
                parts.append(f"--warm-steps {v.warm_steps}")
            if v.warm_noise != d.warm_noise:
                parts.append(f"--warm-noise {v.warm_noise}")
            continue
        if isinstance(v, bool):
            parts.append(flag_of(f))
        else:
            parts.append(f"{flag_of(f)} {v}")
    return " ".join(parts)


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
        "relevance": t.relevance,
        "warm_steps": t.tiny.for_task(cfg.task).warm_steps,
        "warm_noise": t.tiny.warm_noise,
        "model": t.model,
    }


def _steps(rs, budget):
    return [r["steps_to_target"] or budget for r in rs]


def compare_to_gdpo(summary, steps: int) -> dict[str, dict]:
    """Per MRTPO variant: steps-to-target ratio to GDPO with its bootstrap 95% interval,
    AUC difference with its interval, and whether the claim's conditions hold."""
    runs = summary["runs"]
    if "gdpo" not in runs:
        return {}
    g_steps, g_auc = _steps(runs["gdpo"], steps), [r["auc"] for r in runs["gdpo"]]
    out = {}
    for algo, rs in runs.items():
        if not algo.startswith("mrtpo"):
            continue
        m_steps, m_auc = _steps(rs, steps), [r["auc"] for r in rs]
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


def claim_verdict(summary, steps: int) -> list[str]:
    lines = []
    comp = compare_to_gdpo(summary, steps)
    for algo, c in comp.items():
        lines.append(
            f"- {algo} / GDPO steps to target: **{c['ratio']:.2f}** (95% CI {c['ci'][0]:.2f}-"
            f"{c['ci'][1]:.2f}); AUC difference {c['auc_diff']:+.3f} (95% CI "
            f"{c['auc_ci'][0]:+.3f} to {c['auc_ci'][1]:+.3f}): claim (<= {CLAIM_RATIO}, upper "
            f"end < 1, larger AUC) **{'holds' if c['holds'] else 'does not hold'}**"
            + (
                " (runs that never reached the target count as the step budget)"
                if c["censored"]
                else ""
            )
        )
    for algo, rs in summary["runs"].items():
        if not algo.startswith("mrtpo"):
            continue
        p, _ = _stats([r["credit_precision"] for r in rs])
        u, _ = _stats([r["uniform_share"] for r in rs])
        if p is not None and u:
            lines.append(
                f"- {algo} credit precision {p:.2f} vs uniform share {u:.2f} ({p / u:.1f}x uniform)"
            )
    return lines


def _start(args: CompareConfig) -> str:
    if args.train.model is not None:
        return f"the model in `{args.train.model}`"
    if args.init_seed is not None:
        return (
            f"the same warm-started tiny model ({args.train.tiny.for_task(args.task).warm_steps} "
            "supervised steps, "
            + (
                f"references' swappable constraints wrong with probability "
                f"{args.train.tiny.warm_noise:g} each, "
                if args.train.tiny.warm_noise
                else ""
            )
            + f"task data and init of seed {args.init_seed}); the seed varies sampling and "
            "data order"
        )
    return "the warm-started tiny model of that seed (all algorithms of a seed share it)"


def write_markdown(summary, path: Path, args) -> Path:
    runs, names = summary["runs"], summary["reward_names"] or []
    st = summary["settings"]
    all_runs = [r for rs in runs.values() for r in rs]
    start = {n: _stats([r["start_pass"][n] for r in all_runs])[0] for n in names}
    start_all = _stats([r["start_all_pass"] for r in all_runs])[0]
    lines = [
        f"# MRTPO vs GDPO on the built-in {args.task} task",
        "",
        f"Command: `{summary['command']}` -- {summary['wall_s'] / 60:.1f} min wall "
        f"({summary['train_s'] / 60:.1f} min of training summed over runs, "
        f"{summary['jobs']} job(s), CPU). Rewards: {', '.join(names)}. "
        f"Each (algorithm, seed) trains {args.steps} steps from {_start(args)}; "
        f"{st.get('prompts_per_step')} prompts x "
        f"{st.get('group_size')} responses per step. Target: all-pass rate "
        f">= {args.target} (moving average over {args.window} training steps).",
        "",
        "Starting pass rates (step 1, mean over all runs): "
        + ", ".join(f"{n} {_fmt(start[n])}" for n in names)
        + f"; all pass {_fmt(start_all)}.",
        "",
        "## The claim",
        "",
        *claim_verdict(summary, args.steps),
        "",
        "## Results (mean +- std over seeds)",
        "",
        "| algo | steps to target (per seed) | AUC | final all-pass | "
        + " | ".join(f"final {n}" for n in names)
        + " | credit precision | uniform share | relevance precision | s/step | replay s/step |",
        "|---|---|---|---|" + "---|" * len(names) + "---|---|---|---|---|",
    ]
    for algo, rs in runs.items():
        per_seed = ", ".join(
            str(r["steps_to_target"]) if r["steps_to_target"] else f">{args.steps}" for r in rs
        )
        mean_steps = statistics.fmean(_steps(rs, args.steps))
        cells = [algo, f"{mean_steps:.1f} ({per_seed})"]
        for key in ("auc", "final_all_pass"):
            m, s = _stats([r[key] for r in rs])
            cells.append(f"{_fmt(m, 3)} +- {_fmt(s, 3)}")
        for n in names:
            m, s = _stats([r["final_pass"][n] for r in rs])
            cells.append(f"{_fmt(m)} +- {_fmt(s)}")
        for key in ("credit_precision", "uniform_share", "relevance_precision"):
            cells.append(_fmt(_stats([r[key] for r in rs])[0]))
        for key in ("step_time", "replay_time"):
            cells.append(_fmt(_stats([r.get(key) for r in rs])[0]))
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Credit precision per reward (allocation mass on the response tokens the reward "
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
        "`>N`); ratio interval = percentile bootstrap (4000 draws) resampling each "
        "algorithm's seeds; AUC = mean batch all-pass rate over all steps; final = mean of "
        "the last window of steps; credit precision = share of a reward's allocation-weight "
        "mass on the response tokens it concerns (constraints: the verifier's "
        "`relevant_chars`; SQL: identifiers of the schema / gold tables and, for sql_match, "
        "literals; tools: the called name, the argument keys, the argument values; "
        "responses where those tokens are a proper non-empty subset), uniform share = the "
        "same for uniform weights, relevance precision = the same share of the JS-distance "
        "mass; s/step = rollout + replay + update seconds per step.",
        "",
        "![curves](compare.png)",
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
    colors = algo_colors(runs)
    ax = axes[0]
    for algo, rs in runs.items():
        curves = [moving_average(r["curve"], args.window) for r in rs]
        n = min(len(c) for c in curves)
        steps = list(range(1, n + 1))
        mean = [statistics.fmean(c[i] for c in curves) for i in range(n)]
        lo = [min(c[i] for c in curves) for i in range(n)]
        hi = [max(c[i] for c in curves) for i in range(n)]
        (line,) = ax.plot(steps, mean, label=algo, lw=2, color=colors[algo])
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
            color=colors[algo],
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
