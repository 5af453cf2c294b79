"""python -m bench: run ops x providers x shapes, append rows to a CSV, write a Markdown
summary. Each cell runs in its own process on the CPU (peak RSS per cell), per provider on a
GPU (peak memory reset per cell), or in this process (``--isolate none``)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

from . import envinfo
from .results import append_rows
from .shapes import PRESETS, cells
from .summary import markdown

ROOT = envinfo.ROOT


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    ap.add_argument("--preset", choices=sorted(PRESETS), help="default: gpu on CUDA, else cpu")
    ap.add_argument("--ops", nargs="+", help="subset of the preset's ops")
    ap.add_argument("--providers", nargs="+", help="subset of the preset's providers")
    ap.add_argument("--N", nargs="+", type=int, dest="ns", help="token counts")
    ap.add_argument("--d", nargs="+", type=int, dest="ds", help="hidden sizes")
    ap.add_argument("--K", nargs="+", type=int, dest="ks", help="JS Q streams (default: preset)")
    ap.add_argument("--out", help="output folder (default bench/results/<preset>-<date>)")
    ap.add_argument("--csv", help="CSV to append to (default <out>/results.csv)")
    ap.add_argument("--md", help="Markdown summary (default: the CSV path with .md)")
    ap.add_argument("--repeats", type=int, help="timed calls per cell (default: preset, by N)")
    ap.add_argument("--isolate", choices=("cell", "provider", "none"), help="process per ...")
    ap.add_argument("--cell-timeout", type=float, help="seconds per cell before it is killed")
    ap.add_argument("--force", action="store_true", help="run cells whose estimate won't fit")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dry-run", action="store_true", help="list the cells and exit")
    return ap


def _groups(specs: list[dict], isolate: str) -> list[list[dict]]:
    if isolate == "cell":
        return [[s] for s in specs]
    if isolate == "provider":
        by: dict[str, list[dict]] = {}
        for s in specs:
            by.setdefault(s["provider"], []).append(s)
        return list(by.values())
    return [specs]


def _failed_rows(group: list[dict], status: str, why: str) -> list[dict]:
    from .cell import base_row  # imports torch: only when needed

    rows = []
    for spec in group:
        r = base_row(spec)
        r.update(status=status, note=why)
        rows.append(r)
    return rows


def run_group(group: list[dict], timeout: float) -> list[dict]:
    """Run the cells of ``group`` in a child process and collect their rows."""
    from .cell import ROW_PREFIX

    env = dict(os.environ)
    env["MRTPO_STRICT_BACKEND"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "bench.cell", json.dumps(group)]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout * len(group)
        )
        out, err, rc = proc.stdout, proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err, rc = f"timed out after {timeout * len(group):.0f} s", None
    rows = [
        json.loads(line[len(ROW_PREFIX) :])
        for line in out.splitlines()
        if line.startswith(ROW_PREFIX)
    ]
    if len(rows) < len(group):
        status = "timeout" if rc is None else "error"
        tail = " ".join((err or "").strip().splitlines()[-2:])[:300]
        why = f"cell process ended (rc={rc}) before this cell: {tail}"
        rows += _failed_rows(group[len(rows) :], status, why)
    return rows


def _progress(row: dict) -> None:
    ms = row.get("ms_p50")
    what = f"{ms:10.1f} ms" if isinstance(ms, float) else f"{row['status']:>13}"
    mem = row.get("extra_mem_mb")
    mem_s = f" extra {mem:9.1f} MiB" if isinstance(mem, float) else ""
    print(
        f"[bench] {row['op']:<28} {row['provider']:<17} N={row['N']:<6} d={row['d']:<5} "
        f"K={row['K']} {what}{mem_s}",
        file=sys.stderr,
        flush=True,
    )


def portable_arg(arg: str, cwd: str | None = None, out: str | None = None) -> str:
    """``arg`` as the record's reproduce line shows it: a path under the device's output
    folder ($OUT) as ``$OUT/...``, one under the current directory relative to it, anything
    else as given (a record names no machine's absolute path)."""
    cwd = os.getcwd() if cwd is None else cwd
    out = os.environ.get("OUT") if out is None else out
    prefix, _, value = arg.rpartition("=") if arg.startswith("--") and "=" in arg else ("", "", arg)
    if not os.path.isabs(value):
        return arg
    norm = os.path.normpath(value)
    for base, shown in ((out, "$OUT"), (cwd, ".")):
        if base and os.path.isabs(base):
            rel = os.path.relpath(norm, os.path.normpath(base))
            if rel == "." or not rel.startswith(".."):
                value = shown if rel == "." else f"{shown}/{rel}" if shown == "$OUT" else rel
                break
    return f"{prefix}={value}" if prefix else value


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.preset is None:
        try:
            import torch

            args.preset = "gpu" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.preset = "cpu"
    preset = PRESETS[args.preset]
    try:
        specs = cells(
            preset, args.ops, args.providers, args.ns, args.ds, args.repeats, args.seed, args.ks
        )
    except ValueError as exc:
        print(f"python -m bench: {exc}", file=sys.stderr)
        return 2
    isolate = args.isolate or preset.isolate
    timeout = args.cell_timeout or preset.cell_timeout_s
    for s in specs:
        s["force"] = args.force
    if args.dry_run:
        print(
            f"preset {preset.name}: {len(specs)} cells on {preset.device} ({preset.dtype}), "
            f"isolate={isolate}"
        )
        for s in specs:
            print(
                f"  {s['op']:<28} {s['provider']:<17} N={s['n']:<8} d={s['d']:<5} V={s['v']:<7} "
                f"K={s['k']} responses={s['responses']} repeats={s['repeats']}"
            )
        return 0
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out_dir = args.out or os.path.join(ROOT, "bench", "results", f"{preset.name}-{stamp}")
    if args.csv is None or args.out is not None:
        os.makedirs(out_dir, exist_ok=True)
    csv_path = args.csv or os.path.join(out_dir, "results.csv")
    md_path = args.md or os.path.splitext(csv_path)[0] + ".md"
    rows: list[dict] = []
    given = sys.argv[1:] if argv is None else argv
    args_s = " ".join(shlex.quote(portable_arg(a)) for a in given)
    command = f"python -m bench {args_s}".strip()
    for group in _groups(specs, isolate):
        if isolate == "none":
            from .cell import run_cell

            new = []
            for spec in group:
                new.append(run_cell(spec))
                _progress(new[-1])
        else:
            new = run_group(group, timeout)
            for r in new:
                _progress(r)
        append_rows(csv_path, new)
        rows += new
        # rewritten after every group, so that a run cut short still leaves its summary
        with open(md_path, "w") as f:
            f.write(markdown(rows, f"Benchmark: preset {preset.name}", command))
    print(f"[bench] {len(rows)} rows appended to {csv_path}; summary {md_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
