"""The figures of a GPU check as Markdown: one table per part of bench/gpu_micro.py, each
measurement beside the cost model's prediction.

    python -m bench.figures figures.jsonl

Reads the JSON lines bench/gpu_micro.py appends (a torn last line, from a killed process,
is skipped) and prints the tables; bench/gpu_check.sh puts them in its summary after every
step.
"""

from __future__ import annotations

import argparse
import json
import sys

_COLUMNS = {
    "cublas": (
        "name",
        "m",
        "n",
        "k",
        "k_rows",
        "out",
        "ms",
        "pred_ms",
        "tflops",
        "ms_per_row",
        "error",
    ),  # fmt: skip
    "rows": (
        "name",
        "rows",
        "calls",
        "ms",
        "pred_ms",
        "gb_per_s",
        "lone_ms",
        "back_to_back_ms",
        "tb_per_s",
        "lone_tb_per_s",
        "error",
    ),  # fmt: skip
    "rows-sweep": ("name", "rows", "block", "warps", "ms", "gb_per_s", "error"),
    "ops": (
        "name",
        "variant",  # records before issue 35 (the fused variant, since deleted)
        "grad_buffer_mib",
        "chunk_mib",
        "row_block",
        "keep_logits",  # records before issue 35 (MRTPO_POLICY_KEEP_LOGITS, since deleted)
        "low_memory",
        "overlap_rows",
        "gemm_path",
        "ms",
        "pred_ms",
        "tflops",
        "target_tflops",
        "extra_mem_mb",
        "error",
    ),  # fmt: skip
    "correctness": (
        "name",
        "gemm_path",
        "ok",
        "logp_max_err",
        "entropy_max_err",
        "dh_rel_err",
        "dw_rel_err",
        "policy_dh_rel_err",
        "policy_dw_rel_err",
        "error",
    ),  # fmt: skip
}


# bench/gpu_window.py's parts (cublas and rows above serve both)
_COLUMNS.update(
    {
        "state": (
            "name",
            "gpu_name",
            "clocks_sm",
            "clocks_max_sm",
            "clocks_mem",
            "power_draw",
            "power_limit",
            "temperature_gpu",
            "clocks_throttle_reasons_active",
            "pstate",
            "skipped",
            "error",
        ),  # fmt: skip
        "timeline": (
            "name",
            "config",
            "source",
            "wall_ms",
            "span_ms",
            "busy_ms",
            "idle_ms",
            "gaps",
            "gemm_ms",
            "row_ms",
            "small_ms",
            "small_count",
            "concurrent_ms",
            "kernels",
            "largest_gaps",
            "error",
        ),  # fmt: skip
        "ab": (
            "name",
            "config",
            "rounds",
            "ms",
            "spread_ms",
            "vs_default",
            "pred_ms",
            "tflops",
            "extra_mem_mb",
            "error",
        ),  # fmt: skip
        "peers": (
            "name",
            "dtype",
            "options",
            "ms",
            "extra_mem_mb",
            "vs_ours",
            "logp_max_err",
            "dh_rel_err",
            "dw_rel_err",
            "skipped",
            "error",
        ),  # fmt: skip
        "decision": ("name", "outcome", "measured", "rule"),
    }
)


def read(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut short by a killed process
    except FileNotFoundError:
        pass
    return out


def _cell(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x).replace("|", "/")


def markdown(records: list[dict]) -> str:
    parts: dict[str, list[dict]] = {}
    for r in records:
        parts.setdefault(r.get("part", "?"), []).append(r)
    lines = []
    for part, rows in parts.items():
        cols = [c for c in _COLUMNS.get(part, ("name", "error")) if any(c in r for r in rows)]
        if not cols:
            continue
        lines += [f"**{part}**", "", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
        lines.append("")
    return "\n".join(lines) if lines else "(no figures yet)"


def best_row_block(records: list[dict]) -> str | None:
    """ "COLUMNS,WARPS" of the rows-sweep configuration whose stats, grad and policy kernels
    take the least time together (only configurations with all three timed), or None."""
    total: dict[tuple[int, int], dict[str, float]] = {}
    for r in records:
        if r.get("part") == "rows-sweep" and "ms" in r:
            total.setdefault((r["block"], r["warps"]), {})[r["name"]] = r["ms"]
    full = {k: sum(v.values()) for k, v in total.items() if len(v) == 3}
    if not full:
        return None
    block, warps = min(full, key=full.get)
    return f"{block},{warps}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.figures", description=__doc__)
    ap.add_argument("path")
    ap.add_argument(
        "--best-row-block",
        action="store_true",
        help="print the rows-sweep's fastest COLUMNS,WARPS (for MRTPO_ROW_BLOCK) and exit; "
        "status 1 where the file holds no complete sweep row",
    )
    args = ap.parse_args(argv)
    if args.best_row_block:
        best = best_row_block(read(args.path))
        if best is None:
            return 1
        print(best)
        return 0
    print(markdown(read(args.path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
