"""What the contrastive replay costs per step in each framework path, at K = 3 rewards.

    python -m bench.replay_cost --out DIR [--threads 1] [--model PATH|smollm2-135m-instruct]
    PYTHONPATH=. .venv-frameworks/bin/python -m bench.replay_cost --out DIR \
        --frameworks verl,openrlhf   # verl's and OpenRLHF's rows, merged into DIR

One row per framework path, each measured side by side (with and without the replay on the
same batch, interleaved A B B A over the repeats, medians reported):

- ``train``: ``mrtpo train``'s steps in process (``Trainer.train_step``, the per-phase
  timings of metrics.jsonl): ``--algo mrtpo`` against ``--algo gdpo --no-baseline-replay``.
  Before each pair the model, optimizer, RNG and prompt sampler are saved and restored, so
  both variants sample the same rollouts from the same weights.
- ``trl``: one step of the real ``MRTPOGRPOTrainer`` with ``reward_spans`` (replay on)
  against the same trainer without spans (every reward spread uniformly: GDPO); step wall
  time from a callback (generation, rewards, replay, loss, optimizer), beside TRL's logged
  ``mrtpo/replay_seconds``. Each repeat builds both trainers from the same initial weights
  and seed, so they see the same batch.
- ``verl`` and ``openrlhf`` (a proxy, stated in the row): ``fill_mrtpo_relevance`` on a
  padded ``DataProto`` / ``relevance_for_experience`` on an ``Experience``, against the same
  batch's policy forward + backward through the adapter's fused loss
  (``policy_loss_from_hidden`` / ``linear_policy_loss``). A real step also generates and
  computes old log-probs, so its ratio is lower than this one.

A framework that the running interpreter cannot import gets a row "not installed here". The
rows go to ``DIR/replay_cost.json`` (merged with the rows already there: a measured row
replaces one that was not installed), ``DIR/replay_cost.csv`` and ``DIR/replay_cost.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from .replay_paths import NEEDS, RUNNERS, K, importable

FRAMEWORKS = ("train", "trl", "verl", "openrlhf")
TARGET = 1.5
FIELDS = (
    "framework", "status", "what", "with_s", "without_s", "ratio", "target", "replay_s",
    "repeats", "prompts", "group", "tokens", "k", "model", "threads", "load_1m", "python",
    "date", "note",
)  # fmt: skip
NOT_INSTALLED = "not installed here"


def load_1m() -> float:
    return round(os.getloadavg()[0], 2)


def venv_name() -> str:
    """The running environment, as its folder name (.venv, .venv-frameworks) and Python."""
    return f"{Path(sys.prefix).name} (Python {platform.python_version()})"


# --------------------------------------------------------------------------------------------
# Rows and reports


def measure(framework: str, args) -> dict:
    import torch

    row = {f: "" for f in FIELDS}
    row.update(
        framework=framework, k=K, prompts=args.prompts, group=args.group, tokens=args.tokens,
        repeats=args.repeats, model=args.model or "tiny (built in code)", threads=args.threads,
        target=TARGET, load_1m=load_1m(), python=venv_name(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    )  # fmt: skip
    missing = [m for m in NEEDS[framework] if not importable(m)]
    if missing:
        row.update(status=NOT_INSTALLED, note=f"{', '.join(missing)} not importable by "
                   f"{sys.executable}")  # fmt: skip
        return row
    torch.manual_seed(args.seed)
    try:
        got = RUNNERS[framework](args)
    except Exception as err:  # a row that says what failed; the other rows still run
        if args.strict:
            raise
        row.update(status="error", note=f"{type(err).__name__}: {' '.join(str(err).split())}"[:300])
        return row
    row.update({k: v for k, v in got.items() if k in FIELDS})
    row["status"] = "ok"
    w, wo = row["with_s"], row["without_s"]
    row["ratio"] = w / wo if wo and wo > 0 else float("nan")
    for key in ("with_s", "without_s", "replay_s"):
        row[key] = round(float(row[key]), 6)
    row["ratio"] = round(float(row["ratio"]), 4)
    row["extra"] = {k: v for k, v in got.items() if k not in FIELDS}
    return row


def merge(old: list[dict], new: list[dict]) -> list[dict]:
    """``new`` over ``old`` by framework; a row that was not installed never replaces a
    measured one."""
    by = {r["framework"]: r for r in old}
    for r in new:
        prev = by.get(r["framework"])
        if prev is not None and r["status"] == NOT_INSTALLED and prev["status"] != NOT_INSTALLED:
            continue
        by[r["framework"]] = r
    order = {f: i for i, f in enumerate(FRAMEWORKS)}
    return sorted(by.values(), key=lambda r: order.get(r["framework"], len(order)))


def _fmt(x, nd=3) -> str:
    if isinstance(x, float):
        return "-" if math.isnan(x) else f"{x:.{nd}f}"
    return str(x) if x != "" else "-"


def markdown(rows: list[dict], header: dict) -> str:
    lines = [
        "# Contrastive replay cost per step, K = 3 (`python -m bench.replay_cost`)",
        "",
        f"Command(s): {'; '.join(header['commands'])}",
        "",
        "| framework | status | with replay s | without s | ratio | target | replay s | "
        "load (1 min) at start | what |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ok = r["status"] == "ok"
        verdict = ""
        if ok and isinstance(r["ratio"], float) and not math.isnan(r["ratio"]):
            verdict = " (meets)" if r["ratio"] <= TARGET else " (over)"
        lines.append(
            f"| {r['framework']} | {r['status']} | {_fmt(r['with_s'])} | {_fmt(r['without_s'])} "
            f"| {_fmt(r['ratio'], 2)}{verdict} | <= {TARGET} | {_fmt(r['replay_s'])} | "
            f"{r['load_1m']} | {r['what'] or r['note']} |"
        )
    lines += ["", "Per row:", ""]
    for r in rows:
        lines.append(
            f"- {r['framework']}: B = {r['prompts']} prompts x {r['group']} responses, at most "
            f"{r['tokens']} response tokens, {r['repeats']} repeats, model {r['model']}, "
            f"threads {r['threads']}, {r['python']}, {r['date']}"
            + (f"; {r['note']}" if r["note"] and r["status"] == "ok" else "")
        )
    lines += [
        "",
        "Seconds are medians over the repeats, the two variants interleaved (A B, B A, ...) on",
        "the same batch. The machine is shared: the load column is `uptime`'s 1-minute",
        "average when the row started; ratios are meaningful, absolute seconds are not.",
        "",
    ]
    return "\n".join(lines)


def write(out: Path, rows: list[dict], commands: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "replay_cost.json").write_text(json.dumps({"commands": commands, "rows": rows},
                                                     indent=1, default=str) + "\n")  # fmt: skip
    with open(out / "replay_cost.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    (out / "replay_cost.md").write_text(markdown(rows, {"commands": commands}))


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.replay_cost", description=__doc__.split(
        "\n\n")[0])  # fmt: skip
    ap.add_argument("--out", required=True, help="folder for replay_cost.{json,csv,md}")
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS),
                    help=f"comma-separated subset of {','.join(FRAMEWORKS)}")  # fmt: skip
    ap.add_argument("--model", default=None, help="a local causal LM folder or a built-in name "
                    "(smollm2-135m-instruct); default: a tiny Qwen2 built in code")  # fmt: skip
    ap.add_argument("--cache-dir", default="runs/cache", help="where built-in models are cached")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=4, help="responses per prompt")
    ap.add_argument("--tokens", type=int, default=32, help="response length cap in tokens")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats (median)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed repeats first")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strict", action="store_true", help="raise instead of an error row")
    args = ap.parse_args(argv)
    names = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    bad = [f for f in names if f not in FRAMEWORKS]
    if bad or not names:
        ap.error(f"argument --frameworks: expected names from {','.join(FRAMEWORKS)}, got "
                 f"{args.frameworks!r}")  # fmt: skip
    args.frameworks = names
    for name in ("prompts", "group", "tokens", "repeats"):
        if getattr(args, name) < (2 if name == "group" else 1):
            ap.error(f"argument --{name}: expected at least {2 if name == 'group' else 1}")
    if args.warmup < 0 or args.threads < 0:
        ap.error("argument --warmup/--threads: expected a non-negative integer")
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    command = " ".join(["python -m bench.replay_cost", *(sys.argv[1:] if argv is None else argv)])
    print(f"load at start: {os.getloadavg()}  ({platform.node()}, {sys.executable})", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        args.work = work
        for name in args.frameworks:
            row = measure(name, args)
            print(f"{name}: {row['status']} with {row['with_s']} s, without {row['without_s']} s,"
                  f" ratio {row['ratio']} ({row['note']})", flush=True)  # fmt: skip
            rows.append(row)
    old, commands = [], []
    if (out / "replay_cost.json").exists():
        prev = json.loads((out / "replay_cost.json").read_text())
        old, commands = prev["rows"], prev["commands"]
    write(out, merge(old, rows), commands + [command])
    print((out / "replay_cost.md").read_text())
    return rows


if __name__ == "__main__":
    main()
