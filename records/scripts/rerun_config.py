"""Train one run again with a recorded run's settings (its config.json), into another folder,
with the current checkout's code: how a fix is checked against a recorded trajectory.

    python records/scripts/rerun_config.py RECORDED_RUN OUT [--steps N] [--set KEY=VALUE]
        [--overwrite]

Resumable: rerun the same command (it continues from OUT's newest complete checkpoint,
wherever a kill left it; --overwrite starts OUT again). Prints the recorded
and the new run's metrics per window of 10 steps side by side at the end, and the first
step whose metrics differ.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import fields
from pathlib import Path

import torch

from mrtpo.training.config import TrainConfig
from mrtpo.training.trainer import train

KEYS = ("response_len", "truncated", "all_pass", "grad_norm")


def windows(rows, width=10):
    for a in range(0, len(rows), width):
        w = rows[a : a + width]
        yield a + 1, {k: sum((r.get(k) or 0.0) for r in w) / len(w) for k in KEYS}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "recorded", type=Path, help="a finished run's folder (config.json, metrics.jsonl)"
    )
    ap.add_argument("out", type=Path, help="the new run's folder")
    ap.add_argument("--steps", type=int, default=None, help="default: the recorded run's")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one setting (VALUE as JSON, else a string), e.g. --set algo=gdpo",
    )
    ap.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT's run (default: resume it, from its newest complete checkpoint)",
    )
    args = ap.parse_args(argv)
    d = json.loads((args.recorded / "config.json").read_text())
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in {f.name for f in fields(TrainConfig)}:
            raise SystemExit(f"--set: unknown setting {key!r}")
        try:
            d[key] = json.loads(value)
        except ValueError:
            d[key] = value
    # Always --resume (unless --overwrite): the trainer's recovery finds the newest complete
    # checkpoint whatever state a kill left (after a save's first rename there is no
    # checkpoint/, only checkpoint.old/ and a complete checkpoint.tmp/), and starts at step
    # 0 in a folder that holds no run. Deciding here on checkpoint/ alone overwrote those.
    d.update(out=str(args.out), resume=not args.overwrite, overwrite=args.overwrite)
    if args.steps is not None:
        d["steps"] = args.steps
    if d.get("threads"):  # as the CLI does: the recorded run's thread count
        torch.set_num_threads(d["threads"])
    train(TrainConfig.from_dict(d), progress=True)
    if not (args.recorded / "metrics.jsonl").exists():  # a config alone (a lane's seed source)
        print(f"{args.recorded} has no metrics.jsonl: nothing to compare the run with")
        return
    old = [json.loads(x) for x in (args.recorded / "metrics.jsonl").read_text().splitlines()]
    new = [json.loads(x) for x in (args.out / "metrics.jsonl").read_text().splitlines()]
    first = next(
        (
            a["step"]
            for a, b in zip(old, new)
            if (a["all_pass"], a["grad_norm"]) != (b["all_pass"], b["grad_norm"])
        ),
        None,
    )
    print(f"first step that differs: {first}")
    print("steps  | recorded: " + " ".join(KEYS) + " | rerun: same")
    for (s, a), (_, b) in zip(windows(old), windows(new)):
        fa = " ".join(f"{a[k]:.3g}" for k in KEYS)
        fb = " ".join(f"{b[k]:.3g}" for k in KEYS)
        print(f"{s:3d}-{s + 9:<3d} | {fa} | {fb}")


if __name__ == "__main__":
    main()
