"""One method step at long responses, stage by stage: MRTPO against GDPO on the same batch.

    python -m bench.method_step --out DIR [--models tiny,smollm2-135m-instruct]
        [--lengths 64,1024,4096,16384] [--K 4] [--prompts 1] [--group 2] [--repeats 2]
        [--variants mrtpo,gdpo,mrtpo-half] [--device cpu|cuda] [--threads 1]
    python -m bench.method_step_report --dir DIR      # table (Markdown) and PNG plots

A batch of ``prompts`` x ``group`` teacher-forced responses of ``length`` tokens each (random
token ids, no sampling), one prompt per group naming K clauses; reward k's verdict names
clause k (one prompt span per reward). One step, as ``mrtpo train`` runs it (the rollout
aside), cut into stages, each timed with its peak memory:

- ``info_forward``: the with-information forward without gradient and the old log-probs
  (``contrastive_replay``, the shared replay engine of mrtpo/replay/engine.py: the only forward
  GDPO runs before its update);
- ``replay``: the forwards of the prompts without each reward's spans (and the engine's
  copies of hidden states for them);
- ``js``: the fused JS one-vs-many (``mrtpo_kernels.linear_js_distance``);
- ``advantages``: ``mrtpo_token_advantages`` (GDPO: ``gdpo_advantages``), through the
  trainer's ``compute_advantages``;
- ``policy_forward``: the policy's forward with gradient (teacher-forced, one micro-batch);
- ``loss_forward``: ``mrtpo_kernels.linear_policy_loss``;
- ``backward``: ``loss.backward()`` through the LM head and the decoder.

The stages of the replay engine are told apart by wrapping the functions it calls
(``_rows_hidden``: with-information or replay forward, by its prompts; ``linear_logprobs``;
``linear_js_distance``) for the duration of the call: the engine itself runs unchanged, and
every second of it falls into one stage.

Variants: ``mrtpo`` (every (response, reward) pair replayed), ``gdpo`` (no replay, uniform
advantages), ``mrtpo-half`` (half of the rewards have zero variance in their group, so half
of the pairs have A_k = 0: skipped through the engine's ``replay_mask`` where the installed
mrtpo.replay.api has one, else by giving those rewards no spans, which skips the same replay
forwards; the CSV note says which).

Every case (model, length, variant, repeat) runs in a fresh process: a warm-up step at
``--warmup-length`` tokens, then the measured step. Memory: on the CPU the process's peak
RSS per stage (VmHWM reset at each stage boundary through /proc/self/clear_refs; the child
runs with glibc's mmap threshold fixed at 256 KiB, so a freed tensor leaves the RSS at once
and the RSS follows the live tensors), less the RSS before the step (``extra``; the RSS
before the step holds the interpreter, the model and the batch). On a GPU:
max_memory_allocated per stage after reset_peak_memory_stats. The variants of one (model,
length) are interleaved over the repeats (A B C, C B A, ...) so that load drifts hit all of
them; medians are reported. Beside the wall time, each stage's process CPU time: with one
thread, the compute itself, much less stretched than the wall time on a shared machine.

Rows are appended to DIR/method_step.csv (one per stage and a ``step`` row per case and
variant), every repeat's own figures to DIR/cases.jsonl; DIR/runs.jsonl records each
invocation's command and its ``uptime`` load at start and end.

The parts: the model and the batch in bench/method_step_batch.py; one case (the stage
clock, the engine's stages, the step, the child process) in bench/method_step_child.py;
here the parent (each case in a fresh process, the rows, the command line).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

from .method_step_batch import CLAUSES
from .method_step_child import child

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("info_forward", "replay", "js", "advantages", "policy_forward", "loss_forward",
          "backward")  # fmt: skip
GDPO_STAGES = ("info_forward", "advantages", "policy_forward", "loss_forward", "backward")
VARIANTS = ("mrtpo", "gdpo", "mrtpo-half")
MODELS = ("tiny", "smollm2-135m-instruct")
COLUMNS = (
    "date", "commit", "device", "torch", "triton", "op", "provider", "model", "stage", "N",
    "tokens", "d", "V", "K", "responses", "pairs", "skipped", "dtype", "threads", "repeats",
    "ms_p20", "ms_p50", "ms_p80", "cpu_ms_p50", "peak_mem_mb", "extra_mem_mb", "status", "note",
    "load_avg",
)  # fmt: skip
MMAP_THRESHOLD = 256 * 1024
MIB = 1 << 20


# ----------------------------------------------------------------------------------- parent


def run_case(spec: dict, timeout: float) -> dict:
    """``child(spec)`` in a fresh process: its result, or a status and the reason."""
    env = dict(
        os.environ,
        MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD),
        OMP_NUM_THREADS=str(spec["threads"] or os.environ.get("OMP_NUM_THREADS", "")),
    )
    if not env["OMP_NUM_THREADS"]:
        del env["OMP_NUM_THREADS"]
    cmd = [sys.executable, "-m", "bench.method_step", "--child", json.dumps(spec)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return dict(status="timeout", note=f"case ran past {timeout:.0f} s")
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = " ".join((err or "").strip().splitlines()[-3:])[:300]
        return dict(status="error", note=f"rc={proc.returncode}: {tail}")
    res = json.loads(lines[-1][len("RESULT ") :])
    res["status"] = "ok"
    return res


def _context(device: str) -> dict:
    from .envinfo import row_context

    return row_context(device)


def rows_of(spec: dict, results: list[dict], ctx: dict, load: str) -> list[dict]:
    """CSV rows of one (model, length, variant): one per stage and a ``step`` row; medians
    over the repeats of the times, the peaks and the extra memory (each repeat's peak less
    its own start)."""
    base = dict(ctx, op="method_step", provider=spec["variant"], model=spec["model"],
                N=spec["length"], K=spec["K"], threads=spec["threads"], load_avg=load,
                repeats=len(results))  # fmt: skip
    ok = [r for r in results if r["status"] == "ok"]
    if not ok:
        why = results[0].get("note", "") if results else "not run"
        status = results[0]["status"] if results else "skipped"
        return [dict(base, stage=s, status=status, note=why) for s in ("step", *STAGES)]
    first = ok[0]
    base.update(tokens=first["tokens"], d=first["d"], V=first["V"], dtype=first["dtype"],
                responses=first["responses"], pairs=first["replayed"],
                skipped=first["skipped"])  # fmt: skip
    note = first["peak_method"] + (f"; pairs skipped by {first['skip']}" if first["skip"] else "")
    if spec.get("gradient_checkpointing"):
        note += "; gradient checkpointing (the policy forward's recompute is in backward)"
    if len(ok) < len(results):
        note += f"; {len(results) - len(ok)} repeat(s) failed"
    rows = []

    def add(stage, ms, cpu, peak):
        extra = [max(0, p - r["baseline"]) for p, r in zip(peak, ok)]  # each repeat's own
        rows.append(dict(
            base, stage=stage, ms_p20=_pct(ms, 20), ms_p50=statistics.median(ms),
            ms_p80=_pct(ms, 80), cpu_ms_p50="" if cuda else statistics.median(cpu),
            peak_mem_mb=statistics.median(peak) / MIB,
            extra_mem_mb=statistics.median(extra) / MIB, status="ok", note=note,
        ))  # fmt: skip

    cuda = spec["device"].startswith("cuda")
    step_peaks = [max(s["peak"] for s in r["stages"].values()) for r in ok]
    add("step", [r["step_ms"] for r in ok], [r["step_cpu_ms"] for r in ok], step_peaks)
    for s in STAGES:
        if all(s in r["stages"] for r in ok):
            have = [r["stages"][s] for r in ok]
            add(s, [h["ms"] for h in have], [h["cpu_ms"] for h in have], [h["peak"] for h in have])
    return rows


def _pct(xs: list[float], q: float) -> float:
    from .measure import percentile

    return percentile(xs, q)


def append_rows(path: Path, rows: list[dict]) -> None:
    from .results import append_rows as append_csv_rows

    append_csv_rows(str(path), rows, columns=COLUMNS, digits=5)


def uptime_load() -> str:
    a, b, c = os.getloadavg()
    return f"{a:.2f} {b:.2f} {c:.2f}"


def _csv_list(text: str, name: str, cast=str, choices=None) -> list:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise ValueError(f"--{name}: expected a comma-separated list, got {text!r}")
    try:
        out = [cast(x) for x in items]
    except ValueError:
        raise ValueError(f"--{name}: expected {cast.__name__} values, got {text!r}") from None
    if choices is not None:
        bad = [x for x in out if x not in choices]
        if bad:
            raise ValueError(f"--{name}: expected names from {','.join(choices)}, got {bad}")
    return out


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench.method_step",
                                 description=__doc__.split("\n\n")[0])  # fmt: skip
    ap.add_argument("--out", help="folder: method_step.csv (appended), runs.jsonl")
    ap.add_argument("--models", default="tiny,smollm2-135m-instruct",
                    help="comma-separated: tiny (built in code) and/or a built-in model name or "
                    "a local causal LM folder")  # fmt: skip
    ap.add_argument("--lengths", default="64,1024,4096,16384", help="response lengths, tokens")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"subset of {VARIANTS}")
    ap.add_argument("--K", type=int, default=4, help=f"rewards, 1..{len(CLAUSES)}")
    ap.add_argument("--prompts", type=int, default=1, help="prompts (groups) in the batch")
    ap.add_argument("--group", type=int, default=2, help="responses per prompt")
    ap.add_argument("--repeats", type=int, default=2, help="measured steps per case (median)")
    ap.add_argument("--warmup-length", type=int, default=16, help="tokens of the warm-up step")
    ap.add_argument("--device", default="cpu", help="cpu or cuda[:i]")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default="runs/cache", help="where built-in models are cached")
    ap.add_argument("--case-timeout", type=float, default=3600.0, help="seconds per case")
    ap.add_argument("--in-process", action="store_true",
                    help="run every case in this process (tests: no fresh process per case, so "
                    "the memory figures are not the method's alone)")  # fmt: skip
    ap.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="both arms' policy forward recomputes its activations in the backward "
        "(mrtpo train --gradient-checkpointing): long responses in less memory",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return args
    try:
        if not args.out:
            raise ValueError("--out: expected a folder for the results")
        args.models = _csv_list(args.models, "models")
        args.lengths = _csv_list(args.lengths, "lengths", int)
        args.variants = _csv_list(args.variants, "variants", choices=VARIANTS)
        if any(n < 1 for n in args.lengths):
            raise ValueError(f"--lengths: expected positive token counts, got {args.lengths}")
        if not 1 <= args.K <= len(CLAUSES):
            raise ValueError(f"--K: expected 1..{len(CLAUSES)}, got {args.K}")
        if "mrtpo-half" in args.variants and args.K < 2:
            raise ValueError("--K: mrtpo-half needs at least 2 rewards")
        for name, lo in (("prompts", 1), ("group", 2), ("repeats", 1), ("warmup_length", 1)):
            if getattr(args, name) < lo:
                raise ValueError(f"--{name.replace('_', '-')}: expected at least {lo}, got "
                                 f"{getattr(args, name)}")  # fmt: skip
        if args.threads < 0:
            raise ValueError(f"--threads: expected >= 0, got {args.threads}")
        if not (args.device == "cpu" or args.device.startswith("cuda")):
            raise ValueError(f"--device: expected cpu or cuda[:i], got {args.device!r}")
    except ValueError as err:
        ap.error(str(err))
    return args


def main(argv=None) -> list[dict]:
    args = parse(argv)
    if args.child:
        res = child(json.loads(args.child))
        print("RESULT " + json.dumps(res), flush=True)
        return []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    argl = sys.argv[1:] if argv is None else list(argv)
    command = "python -m bench.method_step " + " ".join(shlex.quote(a) for a in argl)
    load_start = uptime_load()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    print(f"[method_step] load at start: {load_start}", file=sys.stderr, flush=True)
    ctx = _context(args.device)
    all_rows = []
    for model in args.models:
        for length in args.lengths:
            specs = {
                v: dict(model=model, length=length, variant=v, K=args.K, prompts=args.prompts,
                        group=args.group, warmup_length=args.warmup_length, device=args.device,
                        threads=args.threads, seed=args.seed, cache_dir=args.cache_dir,
                        gradient_checkpointing=args.gradient_checkpointing)
                for v in args.variants
            }  # fmt: skip
            results: dict[str, list[dict]] = {v: [] for v in args.variants}
            load = uptime_load().split()[0]
            for rep in range(args.repeats):  # interleaved: A B C, C B A, ...
                order = args.variants if rep % 2 == 0 else args.variants[::-1]
                for v in order:
                    if args.in_process:
                        res = dict(child(specs[v]), status="ok")
                    else:
                        res = run_case(specs[v], args.case_timeout)
                    results[v].append(res)
                    ms = res.get("step_ms")
                    print(f"[method_step] {model} L={length} {v} repeat {rep + 1}: "
                          + (f"{ms:.0f} ms" if ms else f"{res['status']} {res.get('note', '')}"),
                          file=sys.stderr, flush=True)  # fmt: skip
            load = f"{load} / {uptime_load().split()[0]}"
            with open(out / "cases.jsonl", "a") as f:  # every repeat's own figures
                for v in args.variants:
                    for res in results[v]:
                        f.write(json.dumps(dict(specs[v], **res)) + "\n")
            new = []
            for v in args.variants:
                new += rows_of(specs[v], results[v], ctx, load)
            append_rows(out / "method_step.csv", new)
            all_rows += new
    record = dict(command=command, started=started, load_start=load_start,
                  ended=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  load_end=uptime_load(), device=ctx["device"], commit=ctx["commit"])  # fmt: skip
    with open(out / "runs.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    print(f"[method_step] load at end: {record['load_end']}; rows in {out / 'method_step.csv'}",
          file=sys.stderr, flush=True)  # fmt: skip
    return all_rows


if __name__ == "__main__":
    main()
