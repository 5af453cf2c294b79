"""MRTPO's step against GDPO's on the K = 4 real-model task, side by side (issue 33, item 4).

Two ``mrtpo train`` runs at once, one thread each, from the same warm start and seed, with
issue 25's settings (records/real_k4/command.sh: SmolLM2-135M-Instruct, 2 prompts x 4
samples, 32 new tokens, bfloat16 autocast): GDPO and MRTPO. MRTPO replays only the
(response, reward) pairs whose GDPO advantage is not 0
(``mrtpo.replay.api.replay_mask_from_rewards``).
Writes a Markdown record with the command, the load (``uptime``) before, during (every 30 s)
and after, per step each run's phases, MRTPO's replayed and skipped pairs, and the step-time
ratio. GDPO is given twice the steps and stopped when MRTPO ends, so that every MRTPO step
runs beside a GDPO step (the ratio uses the first ``--steps`` of each).

    python -m bench.k4_step_time --steps 10 --out runs/k4-step-time \
        --record bench/results/k4-step-time-DATE.md

``--control``: GDPO beside GDPO instead (the same computation twice, the second copy in
``gdpo-control``): what the protocol itself reads when nothing differs, the noise floor of
the ratio on this machine (its process-to-process spread).

The model is converted once into ``--cache-dir`` and warm-started once there (the same
folder serves both runs); both happen before the two timed runs start.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

TASK = "constraints-real:start_phrase,keyword_include,end_phrase,letter_frequency"
SETTINGS = [
    "--task", TASK, "--model", "smollm2-135m-instruct", "--warm-steps", "30",
    "--warm-noise", "0.6", "--autocast", "bfloat16", "--prompts-per-step", "2",
    "--group-size", "4", "--max-new-tokens", "32", "--micro-batch", "8", "--lr", "2e-5",
    "--threads", "1", "--no-baseline-replay", "--init-seed", "0",
]  # fmt: skip


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "(uptime unavailable)"


def warm_start(cache_dir: str) -> Path:
    """Convert and warm-start the model once (what both runs then load)."""
    import torch

    from mrtpo.model.initial import initial_folder
    from mrtpo.model.pretrained import stored_dtype
    from mrtpo.tasks.builtin import load_task

    return initial_folder(
        "smollm2-135m-instruct", load_task(TASK, seed=0), seed=0, cache_dir=cache_dir,
        warm_steps=30, warm_noise=0.6, dtype=stored_dtype(torch.float32), log=print,
    )  # fmt: skip


def _load1(line: str) -> str:
    """The 1-minute load average of an ``uptime`` line."""
    part = line.rpartition("load average:")[2].strip()
    return part.split(",")[0] if part else "?"


def step_seconds(row: dict) -> float:
    return sum(v for k, v in row["time"].items() if k != "replays")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/k4-step-time"))
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--record", type=Path, required=True, help="the Markdown file to write")
    ap.add_argument(
        "--control",
        action="store_true",
        help="GDPO beside GDPO (the protocol's noise floor) instead of MRTPO beside GDPO",
    )
    ap.add_argument(
        "--summarize",
        action="store_true",
        help="only write the record from the runs already in --out (and its loads.txt)",
    )
    args = ap.parse_args(argv)
    if args.summarize:
        loads = (args.out / "loads.txt").read_text().splitlines()
        return summarize(args, loads[0], loads[-1], loads[1:-1], float("nan"))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    folder = warm_start(args.cache_dir)
    print(f"warm start: {folder}")
    load_before = uptime()
    procs = {}
    t0 = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    base, timed = arms(args.control)
    for arm in (base, timed):
        steps = args.steps * (2 if arm == base else 1)
        algo = arm.split("-")[0]
        cmd = [sys.executable, "-m", "mrtpo", "train", *SETTINGS, "--algo", algo,
               "--seed", str(args.seed), "--steps", str(steps), "--out", str(args.out / arm),
               "--overwrite", "--checkpoint-every", str(steps), "--cache-dir",
               args.cache_dir, "--quiet"]  # fmt: skip
        log = open(args.out / f"{arm}.log", "w")
        procs[arm] = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    loads = []
    while procs[timed].poll() is None:
        time.sleep(30)
        loads.append(uptime())
    wall = time.time() - t0
    load_after = uptime()
    first = procs[base]
    if first.poll() is None:  # it was given more steps on purpose: stop it (our own child)
        first.terminate()
        first.wait()
    elif first.returncode:
        print(f"{base} failed ({first.returncode}); see {args.out / (base + '.log')}")
        return 1
    if procs[timed].returncode:
        print(f"{timed} failed ({procs[timed].returncode}); see {args.out / (timed + '.log')}")
        return 1
    (args.out / "loads.txt").write_text("\n".join([load_before, *loads, load_after]) + "\n")
    return summarize(args, load_before, load_after, loads, wall)


def arms(control: bool) -> tuple[str, str]:
    """The run given twice the steps (the baseline) and the timed run, as folder names."""
    return ("gdpo", "gdpo-control") if control else ("gdpo", "mrtpo")


def summarize(args, load_before: str, load_after: str, loads: list, wall: float) -> int:
    control = getattr(args, "control", False)
    base, timed = arms(control)
    rows = {
        a: [json.loads(x) for x in (args.out / a / "metrics.jsonl").read_text().splitlines()]
        for a in (base, timed)
    }
    m = rows[timed][: args.steps]
    g = rows[base][: len(m)]
    command = (
        f"python -m bench.k4_step_time --steps {args.steps} --seed {args.seed} "
        f"--out {args.out} --record {args.record}" + (" --control" if control else "")
    )
    each = " ".join(["mrtpo train", *SETTINGS, "--algo A", f"--seed {args.seed}"])
    B, T = ("GDPO", "GDPO (control)") if control else ("GDPO", "MRTPO")
    if control:
        title = "GDPO beside GDPO, K = 4 real-model task: the side-by-side protocol's noise floor"
        intro = (
            "Two identical `mrtpo train --algo gdpo` runs at once (one thread each, same "
            "warm start and seed: the same computation, step for step), issue 25's "
            "settings. Whatever their ratio is, it is the machine, not the method: the "
            "noise floor of the MRTPO / GDPO ratio measured the same way."
        )
        arms_line = (
            f"Each run: `{each}` with A = gdpo. The first gets twice the steps and "
            "is stopped when the second ends."
        )
    else:
        title = "MRTPO / GDPO step time, K = 4 real-model task, side by side (issue 33, item 4)"
        intro = (
            "Two `mrtpo train` runs at once (one thread each, same warm start and seed), "
            "issue 25's settings; MRTPO replays only the (response, reward) pairs whose "
            "GDPO advantage A_k is not 0 (token advantages bit for bit those of a full "
            "replay)."
        )
        arms_line = (
            f"Each run (A = gdpo, mrtpo): `{each}`. GDPO gets twice the steps and is "
            "stopped when MRTPO ends, so every MRTPO step ran beside a GDPO step."
        )
    lines = [
        f"# {title}",
        "",
        intro + " A 2-core machine shared with other agents: the ratio is measured side by "
        "side and the load is stated.",
        "",
        "Command (from the checkout's root; `PYTHONPATH=.`, `OMP_NUM_THREADS=1`):",
        "",
        f"    {command}",
        "",
        arms_line,
        "",
        f"- load before: `{load_before}`",
        f"- load every 30 s while {T} ran (1-minute averages): "
        f"{', '.join(_load1(x) for x in loads) or '-'}",
        f"- load after: `{load_after}`",
        f"- wall time of the {T} run: {wall:.0f} s",
        "",
        f"| step | {B} s (rollout / replay / update) | {T} s (rollout / replay / update) "
        f"| pairs replayed | skipped | {T} / {B} |",
        "|---|---|---|---|---|---|",
    ]
    ratios = []
    for a, b in zip(g, m):
        sg, sm = step_seconds(a), step_seconds(b)
        ratios.append(sm / sg)
        tg, tm = a["time"], b["time"]
        lines.append(
            f"| {b['step']} | {sg:.2f} ({tg['rollout']:.2f} / {tg['replay']:.2f} / "
            f"{tg['update']:.2f}) | {sm:.2f} ({tm['rollout']:.2f} / {tm['replay']:.2f} / "
            f"{tm['update']:.2f}) | {b.get('replay/pairs')} | {b.get('replay/skipped')} | "
            f"{sm / sg:.3f} |"
        )
    tot_g, tot_m = sum(map(step_seconds, g)), sum(map(step_seconds, m))
    tot2_g, tot2_m = sum(map(step_seconds, g[1:])), sum(map(step_seconds, m[1:]))
    med_g = statistics.median([step_seconds(r) for r in g[1:]] or [float("nan")])
    med_m = statistics.median([step_seconds(r) for r in m[1:]] or [float("nan")])
    rep_g = statistics.median([r["time"]["replay"] for r in g[1:]] or [float("nan")])
    rep_m = statistics.median([r["time"]["replay"] for r in m[1:]] or [float("nan")])
    upd_g = statistics.median([r["time"]["update"] for r in g[1:]] or [float("nan")])
    upd_m = statistics.median([r["time"]["update"] for r in m[1:]] or [float("nan")])
    pairs = sum(b.get("replay/pairs") or 0 for b in m)
    skipped = sum(b.get("replay/skipped") or 0 for b in m)
    lines += [
        "",
        f"- {len(m)} steps side by side. From step 2 on (step 1 loads lazily and ran while "
        f"the machine was loaded most): {B} {tot2_g:.1f} s, {T} {tot2_m:.1f} s: **ratio "
        f"{tot2_m / max(tot2_g, 1e-9):.3f}**; median step {B} {med_g:.1f} s, {T} "
        f"{med_m:.1f} s (ratio {med_m / med_g:.3f}); median of the per-step ratios "
        f"{statistics.median(ratios[1:] or [float('nan')]):.3f}. All steps: {B} "
        f"{tot_g:.1f} s, {T} {tot_m:.1f} s ({tot_m / tot_g:.3f}).",
        f"- replay phase, median from step 2 on: {B} {rep_g:.2f} s (its old-log-prob "
        f"forward), {T} {rep_m:.2f} s; update phase (the same code in both): {B} "
        f"{upd_g:.2f} s, {T} {upd_m:.2f} s ({upd_m / upd_g:.3f}).",
    ]
    if not control:
        lines += [
            f"- pairs with spans: {pairs + skipped}, replayed {pairs}, skipped {skipped} "
            f"({skipped / max(1, pairs + skipped):.0%}).",
            "- the rollouts differ after step 1 (the two policies part after their first "
            "update), so a per-step ratio also carries the response lengths.",
        ]
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
