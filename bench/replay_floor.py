"""The replay beside its floors, as ratios in one process (issue 43 item 3).

    python -m bench.replay_floor --out DIR [--models tiny,smollm2-135m-instruct]
        [--lengths 256,1024,4096] [--K 4] [--group 2] [--repeats 3] [--threads 1]
        [--parts units,js]

Two questions, each answered by a ratio of two timings taken alternately in one process
(so that the machine's load drifts over both):

- **units / packed**: the replay's unit forwards as the engine runs them (``mrtpo.replay.engine``:
  per reward, the group's rows after the prompt without that reward's spans, started from
  the full prompt's key/value cache at their common prefix: ``prompt_caches`` then
  ``_rows_hidden(prefix=)``, no gradient) against one packed no-grad forward of the same
  tokens (every unit's prompt suffix and responses as the rows of one batch, right-padded,
  no cache). The floor is the model's batched rate on these tokens; the done-when of issue
  43 asks for the units within 1.10x of it.
- **JS / GEMM floor**: ``linear_js_distance`` one-vs-K on the with-information hidden states
  and the K replays' (N = group x length tokens) against ``bench.gemm_floor.js_gemms``: the
  same chunk plan's head GEMMs alone (the (1 + K) streams stacked, no row work). The
  done-when asks for the JS within 1.2x of it.

The batch is ``bench.method_step_batch``'s (one prompt naming K clauses, reward k's span clause k,
``--group`` responses of random token ids of each length). The tiny model is built in code;
SmolLM2-135M-Instruct is the built-in pretrained model (float32, converted into
``--cache-dir`` once). Rows go to DIR/replay_floor.csv (one per model, length and part, with
the medians, p20/p80 and the ratio); DIR/runs.jsonl keeps the command and the ``uptime``
load at start and end. ``--record PATH`` writes the Markdown table with the verdicts.
"""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ("date", "commit", "model", "length", "K", "group", "tokens", "part", "ms_p20",
           "ms_p50", "ms_p80", "floor_ms_p50", "ratio", "target", "verdict", "threads",
           "repeats", "load_avg")  # fmt: skip
TARGETS = {"units": 1.10, "js": 1.2}  # issue 43's done-when: at most this many times the floor


def uptime() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "(uptime unavailable)"


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()  # fmt: skip
    except OSError:
        return ""


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def prepare(model, tok, *, k: int, group: int, length: int):
    """The unit forwards' inputs of one batch: the full prompt, per reward its prompt
    without spans and the cached prefix it starts from, the responses; and the packed
    batch of the same tokens."""
    import torch

    from bench.method_step_batch import build_batch
    from mrtpo.replay.engine import _shared_prefix, _start_token, _stream_ids
    from mrtpo.replay.prompting import ChatPrompter
    from mrtpo.replay.teacher_forcing import prompt_caches

    prompter = ChatPrompter(tok)
    b = build_batch(tok, prompter, prompts=1, group=group, k=k, length=length, variant="mrtpo",
                    seed=0)  # fmt: skip
    full = b["prompt_ids"][0]
    encode = lambda t: prompter.encode(t).ids  # noqa: E731
    streams = _stream_ids(b["texts"][:1], b["spans"][:1], encode, _start_token(model, tok))[0]
    prefixes: dict = {}
    with torch.no_grad():
        prompt_caches(model, [full], tok.pad_token_id, micro_batch=1, device="cpu",
                      prefixes=prefixes)  # fmt: skip
    units = []
    for ids in streams:
        pre = _shared_prefix(prefixes, full, ids)
        n_pre = 0 if pre is None else int(pre[0][0].shape[2])
        units.append((list(ids), pre, n_pre))
    responses = b["responses"]
    rows = [ids[n_pre:] + r for ids, _, n_pre in units for r in responses]
    width = max(map(len, rows))
    pad = tok.pad_token_id or 0
    packed = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        packed[i, : len(r)] = torch.as_tensor(r)
        mask[i, : len(r)] = 1
    return dict(full=full, units=units, responses=responses, packed=packed, mask=mask,
                tokens=sum(map(len, rows)))  # fmt: skip


def run_units(model, tok, prep):
    """The engine's unit forwards (``_rows_hidden`` after the cached prefix), one per
    reward; returns the K (group x length, d) hidden states."""
    from mrtpo.replay.engine import _rows_hidden

    out = []
    for ids, pre, _ in prep["units"]:
        g = len(prep["responses"])
        out.append(_rows_hidden(model, [ids] * g, prep["responses"], tok.pad_token_id or 0, g,
                                "cpu", prefix=pre))  # fmt: skip
    return out


def run_packed(model, prep):
    """One no-grad forward of the same tokens: every unit's rows in one batch."""
    import torch

    from mrtpo.model.loading import last_hidden

    with torch.no_grad():
        return last_hidden(model, prep["packed"], prep["mask"])


PAIRS = {"units": "packed", "js": "js_floor"}  # each part and the floor it is timed against


def measure(model, tok, *, k, group, length, repeats, parts=tuple(PAIRS)):
    import torch

    from bench.gemm_floor import js_gemms
    from mrtpo.model.loading import lm_head
    from mrtpo.replay.engine import _rows_hidden
    from mrtpo_kernels import linear_js_distance

    prep = prepare(model, tok, k=k, group=group, length=length)
    weight = lm_head(model)[0].detach()
    with torch.no_grad():
        hp = _rows_hidden(model, [prep["full"]] * group, prep["responses"], tok.pad_token_id or 0,
                          group, "cpu")  # fmt: skip
        hq = torch.stack(run_units(model, tok, prep))
    calls = {
        "units": lambda: run_units(model, tok, prep),
        "packed": lambda: run_packed(model, prep),
        "js": lambda: linear_js_distance(hp, hq, weight),
        "js_floor": lambda: js_gemms(hp, hq, weight),
    }
    timed = set(parts) | {PAIRS[x] for x in parts}  # each part and its floor
    calls = {n: f for n, f in calls.items() if n in timed}
    times = {name: [] for name in calls}
    with torch.no_grad():
        for fn in calls.values():  # warm-up
            fn()
        for r in range(repeats):
            order = list(calls) if r % 2 == 0 else list(reversed(calls))
            for name in order:
                t = time.perf_counter()
                calls[name]()
                times[name].append((time.perf_counter() - t) * 1e3)
    return prep["tokens"], hp.shape[0], times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.replay_floor", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--models", default="tiny,smollm2-135m-instruct")
    ap.add_argument("--lengths", default="256,1024,4096")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--group", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--parts", default="units,js", help="which of units, js to time")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-dir", default="runs/cache", help="where built-in models are cached")
    ap.add_argument("--record", type=Path, default=None, help="write the Markdown table here")
    args = ap.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",") if x]
    models = [m for m in args.models.split(",") if m]
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths: expected positive ints, got {args.lengths!r}")
    if args.K < 1 or args.group < 1 or args.repeats < 1:
        raise ValueError("--K, --group, --repeats: expected positive ints")
    parts = [x for x in args.parts.split(",") if x]
    if not parts or any(x not in PAIRS for x in parts):
        raise ValueError(f"--parts: expected some of {','.join(PAIRS)}, got {args.parts!r}")
    import torch

    from bench.method_step_batch import build_model

    if args.threads:
        torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    load0 = uptime()
    cmd = "python -m bench.replay_floor " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows = []
    for name in models:
        model, tok = build_model(name, max(lengths) + 256, args.cache_dir, "cpu")
        for length in lengths:
            tokens, n_js, t = measure(model, tok, k=args.K, group=args.group, length=length,
                                      repeats=args.repeats, parts=parts)  # fmt: skip
            for part, floor in ((x, PAIRS[x]) for x in parts):
                ratio = statistics.median(t[part]) / statistics.median(t[floor])
                rows.append({
                    "date": time.strftime("%Y-%m-%d", time.gmtime()), "commit": _commit(),
                    "model": name, "length": length, "K": args.K, "group": args.group,
                    "tokens": tokens if part == "units" else n_js, "part": part,
                    "ms_p20": round(_pct(t[part], 0.2), 4),
                    "ms_p50": round(statistics.median(t[part]), 4),
                    "ms_p80": round(_pct(t[part], 0.8), 4),
                    "floor_ms_p50": round(statistics.median(t[floor]), 4),
                    "ratio": round(ratio, 3), "target": TARGETS[part],
                    "verdict": "met" if ratio <= TARGETS[part] else "missed",
                    "threads": args.threads, "repeats": args.repeats, "load_avg": uptime(),
                })  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
        del model
    csv_path = args.out / "replay_floor.csv"
    new = not csv_path.exists()
    with open(csv_path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        if new:
            w.writeheader()
        w.writerows(rows)
    with open(args.out / "runs.jsonl", "a") as f:
        f.write(json.dumps({"command": cmd, "load_start": load0, "load_end": uptime()}) + "\n")
    if args.record:
        lines = [f"Command: `{cmd}`", "", f"Load at start: `{load0}`", f"Load at end: `{uptime()}`",
                 "", "| model | length | part | tokens | ms p50 (p20-p80) | floor ms p50 | ratio | "
                 "target | verdict |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in rows:
            lines.append(f"| {r['model']} | {r['length']} | {r['part']} | {r['tokens']} | "
                         f"{r['ms_p50']} ({r['ms_p20']}-{r['ms_p80']}) | {r['floor_ms_p50']} | "
                         f"{r['ratio']} | {r['target']} | {r['verdict']} |")  # fmt: skip
        args.record.write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
