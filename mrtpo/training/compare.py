"""``mrtpo compare``: the method's claim, measured on a built-in task (``--task``).

Every algorithm is trained with every seed, with identical settings, from the same
warm-started model: by default one model (``--init-seed``, cached) shared by every run, so
that seeds vary only sampling and data order, as when runs start from one pretrained model.
What is measured, and the claim, are in `mrtpo.training.stats`; the Markdown table and the plot
in `mrtpo.training.compare_report`. Results go to ``<results>/<task>/``. Each run lives in
``<out>/<task>/<variant>-seed<s>``; a finished run there with the same key (`run_key`: every
trajectory setting, the number of steps, the device and CPU threads, the code and the
versions of torch and transformers) is reused, one of the same key that stopped before the
end (killed, or made with fewer ``--steps``) is resumed from its checkpoint, anything else is
trained again (``--rerun`` retrains every run).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

from mrtpo.model.builtin import is_builtin
from mrtpo.model.initial import initial_folder
from mrtpo.model.loading import default_model
from mrtpo.model.pretrained import stored_dtype
from mrtpo.tasks.builtin import load_task

from .checkpoint import write_atomic
from .cli_args import command_line
from .compare_report import fmt, plot_compare, write_markdown
from .config import CompareConfig, task_slug
from .heldout import check_eval_split
from .stats import summarize_run


def _done_path(run_cfg) -> Path:
    return Path(run_cfg.out) / "compare_run.json"


# the modules that only run comparisons or the command line: editing them changes no run
_NOT_IN_RUNS = {
    "training/compare.py",
    "training/report.py",
    "training/stats.py",
    "cli.py",
    "training/cli_args.py",
    "demo.py",
    "__main__.py",
    "integrations",
}


def code_fingerprint() -> str:
    """A hash of the code a run executes: the sources of mrtpo (less `_NOT_IN_RUNS`) and
    mrtpo_kernels, mrtpo's data files, and the C++/CUDA sources where the checkout has
    them. An edited verifier, task or kernel makes earlier runs stale."""
    import mrtpo_kernels

    here = Path(__file__).resolve().parents[1]  # mrtpo/
    roots = [here, Path(mrtpo_kernels.__file__).resolve().parent, here.parent / "csrc"]
    digest = hashlib.sha1()
    for root in roots:
        if not root.is_dir():
            continue
        for path in sorted(root.rglob("*")):
            rel = path.relative_to(root)
            if root == here and (rel.parts[0] in _NOT_IN_RUNS or rel.as_posix() in _NOT_IN_RUNS):
                continue
            built = "__pycache__" in rel.parts or path.suffix in (".pyc", ".so", ".o")
            if path.is_file() and not built:
                digest.update(f"{root.name}/{rel.as_posix()}\0".encode())
                digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def model_fingerprint(folder) -> str:
    """A hash of a model folder's content (every file's name and bytes: weights, config,
    tokenizer): a run is reused only from the same model, not from the same path after the
    model in it was replaced."""
    digest = hashlib.sha1()
    root = Path(folder)
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        digest.update(f"{path.relative_to(root).as_posix()}\0".encode())
        with path.open("rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def run_key(run_cfg) -> dict:
    """Every setting that changes what a run computes, as JSON: the trajectory settings,
    the number of steps, the device and CPU threads it computes with (they change the
    order of floating-point sums), the code it runs (`code_fingerprint`) and the versions
    of torch and transformers. A run is reused only under the same key."""
    import torch
    import transformers

    from .trainer import resolve_device

    key = json.loads(json.dumps(run_cfg.trajectory()))
    key["steps"] = run_cfg.steps
    key["device"] = str(resolve_device(run_cfg.device))
    key["threads"] = run_cfg.threads or torch.get_num_threads()
    key["code"] = code_fingerprint()
    if run_cfg.model is not None and not is_builtin(run_cfg.model):
        key["model_content"] = model_fingerprint(run_cfg.model)
    key["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
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
    done["how"] = f"resumed from step {found}" if action == "resume" else "trained"
    if action == "fresh" and found not in (None, "--rerun"):
        done["how"] += f"; replaced a run {found}"
    return done


def _tasks(cfg: CompareConfig, task) -> dict:
    """The task of each seed the runs load it with (``task`` for all, where given), each
    checked as a run will check it (`check_eval_split`): a task the runs cannot use is
    refused before any model is built or run folder written."""
    seeds = {cfg.init_seed} if cfg.init_seed is not None else set(range(cfg.seeds))
    tasks = {s: task if task is not None else load_task(cfg.task, seed=s) for s in sorted(seeds)}
    for t in tasks.values():
        if not t.verifiers:
            raise ValueError("task: it has no verifiers (no rewards)")
        check_eval_split(t, cfg.train)
    return tasks


def _prepare_models(cfg: CompareConfig, tasks: dict, log):
    """Warm-start (or find in the cache) every initial model before any run starts, so
    parallel runs never build the same cache entry at once."""
    builtin = is_builtin(cfg.train.model)
    if cfg.train.model is not None and not builtin:
        return
    for s, t in tasks.items():
        if builtin:
            initial_folder(
                cfg.train.model,
                t,
                seed=s,
                cache_dir=cfg.train.cache_dir,
                warm_steps=cfg.train.tiny.warm_steps,
                warm_noise=cfg.train.tiny.warm_noise,
                dtype=stored_dtype(cfg.train.dtype),
                log=log,
            )
            continue
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
    _prepare_models(cfg, _tasks(cfg, task), log)
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
        h = s.get("heldout")
        held = ""
        if h is not None:
            h_reached = h["steps_to_target"]
            if h_reached == 0:
                h_reached = "0 (the start already meets the target)"
            held = (
                f"held-out: steps to target {f'>{cfg.steps}' if h_reached is None else h_reached}"
                f", AUC {fmt(h['auc'])}, final all-pass {fmt(h['final_all_pass'])}; training: "
            )
        log(
            f"{d['algo']} seed {s['seed']}: {held}steps to target {reached}, AUC {fmt(s['auc'])}, "
            f"final all-pass {fmt(s['final_all_pass'])}, credit precision "
            f"{fmt(s['credit_precision'])} (uniform {fmt(s['uniform_share'])}), "
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
    write_atomic(out / "summary.json", json.dumps(summary, indent=1))
    write_atomic(results / "summary.json", json.dumps(_without_curves(summary), indent=1))
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
        "baseline_replay": t.replay_for_baselines,
        "eval_every": t.eval_every,
        "eval_prompts": t.eval_prompts,
        "eval_samples": t.eval_samples,
        "eval_seed": t.eval_seed,
        "warm_steps": t.tiny.for_task(cfg.task).warm_steps,
        "warm_noise": t.tiny.warm_noise,
        "model": t.model,
    }
