"""GDPO's step with and without the separate old-log-prob forward, side by side (issue 43,
item 1).

Two trainers in one process from the same warm start and seed, ``--algo gdpo
--no-baseline-replay``, one PPO epoch and one minibatch: ``new`` takes the old log-probs
from the update's own forward (``mrtpo.training.trainer.separate_old_forward`` False), ``old`` runs
the no-grad forward for them first (``Trainer.force_old_forward``). Their steps alternate,
the order swapped every step, one thread, so that both see the same load; the record gives
the load (``uptime``) before and after, per step each arm's phases, and the ratio of the
median step times (the first step of each left out, a warm-up).

    python -m bench.old_logprob_forward --steps 8 --cache-dir runs/olf-cache \
        --out runs/olf --record bench/results/old-logprob-forward-DATE.md

The built-in tiny model on the default task (``constraints``: 8 prompts x 8 samples, 32
new tokens, micro-batches of 16).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "(uptime unavailable)"


def configs(args):
    from mrtpo.training.config import TrainConfig

    common = dict(
        algo="gdpo", replay_for_baselines=False, steps=args.steps, seed=0, device="cpu",
        cache_dir=args.cache_dir, ppo_epochs=1, minibatches=1, overwrite=True, eval_every=0,
    )  # fmt: skip
    return {name: TrainConfig(**common, out=str(Path(args.out) / name)) for name in ("new", "old")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--cache-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--record", default=None)
    args = ap.parse_args(argv)

    import torch

    from mrtpo.training.trainer import Trainer, separate_old_forward

    torch.set_num_threads(1)
    cfgs = configs(args)
    trainers = {}
    for name, cfg in cfgs.items():
        trainers[name] = Trainer(cfg)
        trainers[name].force_old_forward = name == "old"
    assert not separate_old_forward(cfgs["new"])
    load_before = uptime()
    rows = {"new": [], "old": []}
    t_start = time.perf_counter()
    for i in range(args.steps):
        order = ("new", "old") if i % 2 == 0 else ("old", "new")
        for name in order:
            t0 = time.perf_counter()
            row = trainers[name].train_step()
            row["time"]["step"] = time.perf_counter() - t0
            rows[name].append(row)
    wall = time.perf_counter() - t_start
    load_after = uptime()

    lines = [
        "# GDPO's step with and without the old-log-prob forward (issue 43, item 1)",
        "",
        f"Command: `python -m bench.old_logprob_forward {' '.join(argv or sys.argv[1:])}`",
        "",
        f"Model: the built-in tiny model; {args.steps} steps per arm, "
        "alternating (order swapped every step), one thread, one process.",
        "",
        f"Load before: `{load_before}`",
        f"Load after: `{load_after}` (wall {wall:.0f} s)",
        "",
        "| step | arm | mean response tokens | rollout s | replay s | update s | step s |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    for i in range(args.steps):
        for name in ("new", "old"):
            t = rows[name][i]["time"]
            lines.append(
                f"| {i + 1} | {name} | {rows[name][i]['response_len']:.1f} | "
                f"{t['rollout']:.3f} | {t['replay']:.3f} | {t['update']:.3f} | {t['step']:.3f} |"
            )
    med = {}
    for name in ("new", "old"):
        ts = [r["time"] for r in rows[name][1:]]
        med[name] = {k: statistics.median(t[k] for t in ts) for k in
                     ("rollout", "replay", "update", "step")}  # fmt: skip
    lines += [
        "",
        "Medians over steps 2.. (step 1 a warm-up):",
        "",
        "| arm | rollout s | replay s | update s | step s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("new", "old"):
        m = med[name]
        lines.append(f"| {name} | {m['rollout']:.3f} | {m['replay']:.3f} | {m['update']:.3f} | "
                     f"{m['step']:.3f} |")  # fmt: skip
    ratio = med["new"]["step"] / med["old"]["step"]
    paired = statistics.median(
        a["time"]["step"] / b["time"]["step"] for a, b in zip(rows["new"][1:], rows["old"][1:])
    )
    saved = med["old"]["replay"] - med["new"]["replay"]
    lines += [
        "",
        f"Step ratio new / old (medians): **{ratio:.3f}** (the median of the per-step "
        f"ratios, each step's pair run back to back: {paired:.3f}); the replay phase (the "
        f"old-log-prob forward, and the advantages) {med['old']['replay']:.3f} s -> "
        f"{med['new']['replay']:.3f} s ({saved:.3f} s saved); the update "
        f"{med['old']['update']:.3f} s -> {med['new']['update']:.3f} s (its extra head pass).",
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.record:
        Path(args.record).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
