"""MRTPO's step against GDPO's on the K = 4 real-model task, side by side (issue 33, item 4).

Two ``mrtpo train`` runs at once, one thread each, from the same warm start and seed, with
issue 25's settings (docs/results/real_k4/command.sh: SmolLM2-135M-Instruct, 2 prompts x 4
samples, 32 new tokens, bfloat16 autocast): GDPO and MRTPO. MRTPO replays only the
(response, reward) pairs whose GDPO advantage is not 0 (``mrtpo.replay.replay_mask_from_rewards``).
Writes a Markdown record with the command, the load (``uptime``) before and after, per step
each run's phases, MRTPO's replayed and skipped pairs, and the step-time ratio.

    python -m bench.k4_step_time --steps 10 --out runs/k4-step-time \
        --record bench/results/k4-step-time-DATE.md

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

    from mrtpo.initial_model import initial_folder
    from mrtpo.pretrained import stored_dtype
    from mrtpo.tasks import load_task

    return initial_folder(
        "smollm2-135m-instruct", load_task(TASK, seed=0), seed=0, cache_dir=cache_dir,
        warm_steps=30, warm_noise=0.6, dtype=stored_dtype(torch.float32), log=print,
    )  # fmt: skip


def step_seconds(row: dict) -> float:
    return sum(v for k, v in row["time"].items() if k != "replays")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("runs/k4-step-time"))
    ap.add_argument("--cache-dir", default="runs/cache")
    ap.add_argument("--record", type=Path, required=True, help="the Markdown file to write")
    args = ap.parse_args(argv)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.getcwd())
    folder = warm_start(args.cache_dir)
    print(f"warm start: {folder}")
    load_before = uptime()
    procs = {}
    t0 = time.time()
    for algo in ("gdpo", "mrtpo"):
        out = args.out / algo
        cmd = [sys.executable, "-m", "mrtpo", "train", *SETTINGS, "--algo", algo,
               "--seed", str(args.seed), "--steps", str(args.steps), "--out", str(out),
               "--overwrite", "--checkpoint-every", str(args.steps), "--cache-dir",
               args.cache_dir, "--quiet"]  # fmt: skip
        args.out.mkdir(parents=True, exist_ok=True)
        log = open(args.out / f"{algo}.log", "w")
        procs[algo] = (subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), cmd)
    loads = []
    while any(p.poll() is None for p, _ in procs.values()):
        time.sleep(30)
        loads.append(uptime())
    wall = time.time() - t0
    load_after = uptime()
    for algo, (p, _) in procs.items():
        if p.returncode:
            print(f"{algo} failed ({p.returncode}); see {args.out / (algo + '.log')}")
            return 1
    rows = {
        a: [json.loads(x) for x in (args.out / a / "metrics.jsonl").read_text().splitlines()]
        for a in procs
    }
    g, m = rows["gdpo"], rows["mrtpo"]
    lines = [
        "# MRTPO / GDPO step time, K = 4 real-model task, side by side (issue 33, item 4)",
        "",
        "Two `mrtpo train` runs at once (one thread each, same warm start and seed), "
        "issue 25's settings; MRTPO replays only the (response, reward) pairs whose GDPO "
        "advantage A_k is not 0 (token advantages bit for bit those of a full replay). "
        "A shared 2-core machine: the ratio is measured side by side, the load is stated.",
        "",
        "Command (from the checkout's root):",
        "",
        "    "
        + " ".join(
            [
                "python -m bench.k4_step_time",
                f"--steps {args.steps}",
                f"--seed {args.seed}",
                f"--out {args.out}",
                f"--record {args.record}",
            ]
        ),  # fmt: skip
        "",
        "Each run: `" + " ".join(procs["mrtpo"][1][1:]).replace(" --algo mrtpo", " --algo A") + "`",
        "",
        f"- load before: `{load_before}`",
        f"- load after: `{load_after}`",
        f"- wall time of the pair: {wall:.0f} s",
        "",
        "| step | GDPO s (rollout / replay / update) | MRTPO s (rollout / replay / update) "
        "| pairs replayed | skipped | MRTPO / GDPO |",
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
    tot_g = sum(map(step_seconds, g))
    tot_m = sum(map(step_seconds, m))
    pairs = sum(b.get("replay/pairs") or 0 for b in m)
    skipped = sum(b.get("replay/skipped") or 0 for b in m)
    rep_g = sum(a["time"]["replay"] for a in g)
    rep_m = sum(b["time"]["replay"] for b in m)
    lines += [
        "",
        f"- steps: {len(m)}; total step time GDPO {tot_g:.1f} s, MRTPO {tot_m:.1f} s: "
        f"**ratio {tot_m / tot_g:.3f}** (median of the per-step ratios "
        f"{statistics.median(ratios):.3f})",
        f"- replay phase: GDPO {rep_g:.1f} s (its old-log-prob forward), MRTPO {rep_m:.1f} s",
        f"- pairs with spans: {pairs + skipped}, replayed {pairs}, skipped {skipped} "
        f"({skipped / max(1, pairs + skipped):.0%})",
        "- rollouts differ after step 1 (the two policies part after their first update), so "
        "the per-step ratio also carries the response lengths; the total is the figure.",
    ]
    args.record.parent.mkdir(parents=True, exist_ok=True)
    args.record.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
