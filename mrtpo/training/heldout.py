"""Held-out evaluation: the policy's pass rates on a fixed set of the task's eval prompts.

The training curve (`all_pass` of each step's batch) is measured on the prompts the policy
is trained on, 8 answers at a time. The held-out curve is what a claim should rest on: every
``eval_every`` steps, and before the first and after the last, the first ``eval_prompts``
prompts of the task's eval split (disjoint from its training prompts) get ``eval_samples``
sampled answers each, at the training temperature, scored by the same verifiers.

The schedule depends on ``eval_every`` and the run's total steps only, not on how the run
was split: a run extended with ``--resume --steps N`` (as ``mrtpo compare`` extends a shorter
run) drops from metrics.jsonl the evaluation its shorter part made at its last step where
the longer run has none (`match_schedule`, rewritten atomically at the resume), so that its
rows, held-out AUC and steps to target are those of the run done in one go.

The sampling runs in a random state of its own, seeded by ``eval_seed`` each time
(`torch.random.fork_rng`): the same prompts and seed at every evaluation, so two points of a
curve, or two runs' curves, differ only by their policies; and the training run's own random
stream is untouched (a run with evaluations trains exactly as one without).

An evaluation is a dict, kept in the metrics row of the step after which it ran (the one
before the first step rides in step 1's row): ``{"step": s, "all_pass": x, "pass": {reward:
x}, "answers": n, "truncated": share, "seconds": t}``, ``step`` being the number of updates
the evaluated policy has had. `mrtpo.training.stats.evaluations` collects them from a run's rows.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import replace

import torch

from .metrics import PASS_THRESHOLD
from .rollouts import generate_rollouts


def eval_due(step: int, every: int, last: int) -> bool:
    """Whether the policy after ``step`` updates is evaluated: at 0, every ``every`` steps
    and at the run's last step (``every`` = 0: never). A function of ``every`` and the run's
    total steps only, whatever the run's parts (`match_schedule`)."""
    return every > 0 and (step % every == 0 or step == last)


def match_schedule(rows: list[dict], every: int, last: int) -> tuple[list[int], bool]:
    """Bring the evaluations in the metrics ``rows`` of a resumed run to the schedule of the
    run it now is (``every``, ``last`` total steps): an evaluation not due there -- the one a
    shorter run made at its own last step, before ``--resume --steps`` extended it -- is
    removed from its row (in place). Returns (the steps of the evaluations removed, whether
    the policy of the last row's step is due an evaluation that row lacks: a run resumed to
    end at a step its earlier part did not evaluate). Evaluations past ``last`` are left
    alone."""
    removed = []
    for row in rows:
        evs = row.get("eval")
        if not evs:
            continue
        keep = [e for e in evs if e["step"] > last or eval_due(e["step"], every, last)]
        if len(keep) != len(evs):
            removed += [e["step"] for e in evs if e not in keep]
            if keep:
                row["eval"] = keep
            else:
                del row["eval"]
    missing = False
    if rows:
        step = rows[-1]["step"]
        have = {e["step"] for e in rows[-1].get("eval") or ()}
        missing = step <= last and eval_due(step, every, last) and step not in have
    return removed, missing


def check_eval_split(task, cfg) -> None:
    """A run that evaluates (``cfg.eval_every`` > 0) needs eval prompts: a task whose eval
    split is empty is a ValueError naming it, asked before the run writes anything or builds
    a model (not at step 0's evaluation, after both)."""
    if cfg.eval_every > 0 and not len(task.eval):
        raise ValueError(
            f"task: {task.name!r} has no eval prompts (its eval split is empty), and the run "
            f"evaluates on them every {cfg.eval_every} steps (--eval-every); give a task with "
            "an eval split, or --eval-every 0 for no held-out evaluation"
        )


@torch.no_grad()
def evaluate_heldout(model, prompter, task, cfg, device, *, step: int, amp=None) -> dict:
    """One held-out evaluation of ``model`` after ``step`` updates (see the module doc)."""
    examples = list(task.eval[: cfg.eval_prompts])
    if not examples:
        raise ValueError(f"task: {task.name!r} has no eval prompts to evaluate on")
    t0 = time.perf_counter()
    gen_cfg = replace(cfg, group_size=cfg.eval_samples)
    devices = [device] if device.type == "cuda" else []
    was_training = model.training
    model.eval()
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.eval_seed)
        with amp if amp is not None else contextlib.nullcontext():
            ro = generate_rollouts(model, prompter, task, examples, gen_cfg, device)
    model.train(was_training)
    passed = ro.rewards >= PASS_THRESHOLD
    names = [v.name for v in task.verifiers]
    return {
        "step": step,
        "all_pass": float(passed.all(1).float().mean()),
        "pass": {n: float(passed[:, j].float().mean()) for j, n in enumerate(names)},
        "answers": len(ro.responses),
        "truncated": sum(ro.truncated) / len(ro.truncated) if ro.truncated else None,
        "seconds": time.perf_counter() - t0,
    }
