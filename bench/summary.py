"""The Markdown summary of a run: the results table, the ratios of ours to every other
provider measured in the same run, and the PASS/FAIL lines of the issue targets."""

from __future__ import annotations

from .providers import FLOOR, OURS
from .results import num
from .workloads import WORKLOADS

GB = 1e9
MIB = float(1 << 20)


def _shape_key(r: dict) -> tuple:
    return (r["op"], str(r["d"]), str(r["N"]), str(r["K"]), r["dtype"])


def _f(x, digits=3) -> str:
    if x is None:
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def _by_shape(rows: list[dict]) -> dict[tuple, dict[str, dict]]:
    """Rows grouped by shape, ordered by op, d, N, K; the latest row of a provider wins."""
    out: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        out.setdefault(_shape_key(r), {})[r["provider"]] = r

    def order(key):
        op, d, n, k, dtype = key
        rank = WORKLOADS.index(op) if op in WORKLOADS else len(WORKLOADS)
        return (rank, dtype, int(d or 0), int(n or 0), int(k or 0))

    return {key: out[key] for key in sorted(out, key=order)}


def ratio(a: dict | None, b: dict | None, key: str) -> float | None:
    """a[key] / b[key] when both rows carry the figure (memory may be an estimate)."""
    if a is None or b is None:
        return None
    ok = ("ok",) if key.startswith(("ms", "cpu_ms")) else ("ok", "estimated")
    if a.get("status") not in ok or b.get("status") not in ok:
        return None
    x, y = num(a, key), num(b, key)
    if x is None or y is None or y <= 0:
        return None
    return x / y


def _join_note(r: dict) -> str:
    """The note, with the CPU time per call and the 1-min load average (start/end of the
    timed calls) where measured."""
    extra = []
    cpu = num(r, "cpu_ms_p50")
    if cpu is not None and r.get("status") == "ok":
        extra.append(f"CPU time {_f(cpu)} ms")
    if r.get("load_avg"):
        extra.append(f"load {r['load_avg']}")
    if r.get("gemm_path"):
        extra.append(f"GEMMs {r['gemm_path']}")
    return "; ".join([p for p in (r.get("note", ""),) if p] + extra)


def results_table(rows: list[dict]) -> list[str]:
    lines = [
        "| op | d | N | K | provider | ms p50 (p20-p80) | predicted ms | TFLOP/s | peak MiB "
        "| extra MiB | time / pytorch | extra / pytorch | time / gemm-floor | status | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    shapes = _by_shape(rows)
    for _key, provs in shapes.items():
        base = provs.get("pytorch")
        floor = provs.get(FLOOR)
        for prov, r in provs.items():
            ms = num(r, "ms_p50")
            timing = (
                "-" if ms is None else (f"{_f(ms)} ({_f(num(r, 'ms_p20'))}-{_f(num(r, 'ms_p80'))})")
            )
            rate = num(r, "tflops")
            rate_s = (
                _f(rate)
                if rate is not None
                else (f"{_f(num(r, 'gb_per_s'))} GB/s" if num(r, "gb_per_s") else "-")
            )
            est = " (est.)" if r["status"] == "estimated" else ""
            t_ratio = ratio(r, base, "ms_p50") if prov != "pytorch" else None
            m_ratio = ratio(r, base, "extra_mem_mb") if prov != "pytorch" else None
            f_ratio = ratio(r, floor, "ms_p50") if prov != FLOOR else None
            lines.append(
                f"| {r['op']} | {r['d']} | {r['N']} | {r['K']} | {prov} | {timing} "
                f"| {_f(num(r, 'pred_ms'))} | {rate_s} "
                f"| {_f(num(r, 'peak_mem_mb'), 4)}{est} | {_f(num(r, 'extra_mem_mb'), 4)}{est} "
                f"| {_f(t_ratio)} | {_f(m_ratio)} | {_f(f_ratio)} | {r['status']} "
                f"| {_join_note(r)} |"
            )
    return lines


def ratio_table(rows: list[dict]) -> list[str]:
    """Ours / other, for time and extra memory, every pair measured in this run."""
    lines = [
        "| op | d | N | K | ours | other | time ours/other | extra memory ours/other |",
        "|---|---|---|---|---|---|---|---|",
    ]
    n = 0
    for (op, d, nn, k, _), provs in _by_shape(rows).items():
        for ours, r in provs.items():
            if ours not in OURS or r["status"] != "ok":
                continue
            for other, o in provs.items():
                if other == ours or o["status"] not in ("ok", "estimated"):
                    continue
                t, m = ratio(r, o, "ms_p50"), ratio(r, o, "extra_mem_mb")
                est = " (vs estimate)" if o["status"] == "estimated" else ""
                lines.append(
                    f"| {op} | {d} | {nn} | {k} | {ours} | {other} | {_f(t)} | {_f(m)}{est} |"
                )
                n += 1
    return lines if n else ["(no pair of measured rows)"]


def _find(rows, op, provider, n, k=None, d=None):
    """The latest row of (op, provider, N[, K][, d])."""
    for r in reversed(rows):
        if (
            r["op"] == op
            and r["provider"] == provider
            and int(r["N"]) == n
            and (k is None or int(r["K"]) == k)
            and (d is None or int(r["d"]) == d)
        ):
            return r
    return None


def cpu_targets(rows: list[dict], fused: str = "mrtpo-cpu") -> list[str]:
    """Issue 2's CPU targets at d = 896: PASS / FAIL / NOT MEASURED lines."""
    out = []
    specs = [
        ("linear_logprobs_fwd_bwd", 0, 1.3),
        ("linear_policy_loss_fwd_bwd", 0, 1.0),
        ("linear_js_distance", 1, 1.0),
        ("linear_js_distance", 4, 1.0),
    ]
    for op, k, tmax in specs:
        kk = k if op == "linear_js_distance" else None
        a = _find(rows, op, fused, 4096, kk, 896)
        b = _find(rows, op, "pytorch", 4096, kk, 896)
        name = op + (f" K={k}" if op == "linear_js_distance" else "")
        m = ratio(a, b, "extra_mem_mb")
        out.append(
            _verdict(
                f"N=4096 {name}: extra memory {fused} / pytorch <= 1/8",
                m,
                lambda x: x <= 0.125,
                f"{_f(m)}",
            )
        )
        t = ratio(a, b, "ms_p50")
        out.append(
            _verdict(
                f"N=4096 {name}: time {fused} / pytorch <= {tmax}",
                t,
                lambda x, tmax=tmax: x <= tmax,
                f"{_f(t)}x",
            )
        )
    for op, k, _ in specs:
        kk = k if op == "linear_js_distance" else None
        name = op + (f" K={k}" if op == "linear_js_distance" else "")
        r = _find(rows, op, fused, 16384, kk, 896)
        peak = num(r, "peak_mem_mb") if r is not None and r["status"] == "ok" else None
        gb = None if peak is None else peak * MIB / GB
        out.append(
            _verdict(
                f"N=16384 {name}: {fused} peak RSS <= 4 GB", gb, lambda x: x <= 4.0, f"{_f(gb)} GB"
            )
        )
        p = _find(rows, op, "pytorch", 16384, kk, 896)
        if p is not None and p["status"] in ("ok", "estimated"):
            pk = num(p, "peak_mem_mb") * MIB / GB
            how = "estimated, not run" if p["status"] == "estimated" else "measured"
            out.append(f"- INFO N=16384 {name}: pytorch peak {_f(pk)} GB ({how})")
    return out


def floor_table(rows: list[dict]) -> list[str]:
    """Each provider's time as a multiple of the op's GEMM floor, same run."""
    lines = [
        "| op | d | N | K | dtype | gemm-floor ms | provider: time / floor (CPU time / floor) |",
        "|---|---|---|---|---|---|---|",
    ]
    n = 0
    for (op, d, nn, k, dtype), provs in _by_shape(rows).items():
        floor = provs.get(FLOOR)
        fms = num(floor, "ms_p50") if floor is not None and floor["status"] == "ok" else None
        if fms is None:
            continue
        parts = []
        for prov, r in provs.items():
            t = ratio(r, floor, "ms_p50") if prov != FLOOR else None
            if t is None:
                continue
            c = ratio(r, floor, "cpu_ms_p50")
            parts.append(f"{prov} {_f(t)}x" + (f" (CPU time {_f(c)}x)" if c is not None else ""))
        lines.append(f"| {op} | {d} | {nn} | {k} | {dtype} | {_f(fms)} | {', '.join(parts)} |")
        n += 1
    return lines if n else ["(no gemm-floor row measured)"]


def cpu_peer_targets(rows: list[dict], fused: str = "mrtpo-cpu", n: int = 2048) -> list[str]:
    """Issue 12's CPU targets at N = 2048, d = 896: log-probs forward+backward no slower
    than Cut Cross-Entropy's CPU path at <= 1/3 of its extra memory; JS one-vs-4 within
    1.2x of its GEMM floor."""
    op = "linear_logprobs_fwd_bwd"
    a, c = _find(rows, op, fused, n, None, 896), _find(rows, op, "cce", n, None, 896)
    t, m = ratio(a, c, "ms_p50"), ratio(a, c, "extra_mem_mb")
    out = [
        _verdict(
            f"N={n} {op}: time {fused} / cce <= 1", t, lambda x: x <= 1.0, f"{_f(t)}x" + _cpu(a, c)
        ),
        _verdict(
            f"N={n} {op}: extra memory {fused} / cce <= 1/3", m, lambda x: x <= 1 / 3, f"{_f(m)}"
        ),
    ]
    js = "linear_js_distance"
    a, f = _find(rows, js, fused, n, 4, 896), _find(rows, js, FLOOR, n, 4, 896)
    t = ratio(a, f, "ms_p50")
    out.append(
        _verdict(
            f"N={n} {js} K=4: time {fused} / gemm-floor <= 1.2",
            t,
            lambda x: x <= 1.2,
            f"{_f(t)}x" + _cpu(a, f),
        )
    )
    return out


def _cpu(a, b) -> str:
    c = ratio(a, b, "cpu_ms_p50")
    return "" if c is None else f" (CPU time {_f(c)}x)"


# The H200 targets as issue 18 states them (bf16, V = 151936, d = 4096, N = 16384): TFLOP/s
# from the counted GEMM FLOPs, and extra device memory beyond the inputs, the outputs and
# the fp32 dW accumulator (4 V d bytes, 2374 MiB at this shape, for the ops with a dW).
GPU_TARGETS = (
    ("linear_policy_loss_fwd_bwd", None, 700.0, True),
    ("linear_logprobs_fwd_bwd", None, 550.0, True),
    ("linear_js_distance", 4, 650.0, False),
)


def gpu_targets(rows: list[dict]) -> list[str]:
    """Issue 18's H200 targets, best of ours at the target shape."""
    out = []
    for op, k, tflops, has_dw in GPU_TARGETS:
        cands = [
            r
            for r in (_find(rows, op, p, 16384, k, 4096) for p in OURS)
            if r is not None and r["status"] == "ok"
        ]
        best = max(cands, key=lambda r: num(r, "tflops") or 0.0, default=None)
        tf = num(best, "tflops") if best else None
        who = best["provider"] if best else "none measured"
        name = op + (f" K={k}" if k else "")
        out.append(
            _verdict(
                f"{name}: >= {tflops:.0f} TFLOP/s ({who})",
                tf,
                lambda x, t=tflops: x >= t,
                f"{_f(tf)} TFLOP/s",
            )
        )
        ex = num(best, "extra_mem_mb") if best else None
        dw_gb = 4 * 151936 * 4096 / GB if has_dw else 0.0
        gb = None if ex is None else ex * MIB / GB - dw_gb
        beyond = " beyond the fp32 dW" if has_dw else ""
        out.append(
            _verdict(
                f"{name}: extra device memory{beyond} <= 1 GB ({who})",
                gb,
                lambda x: x <= 1.0,
                f"{_f(gb)} GB",
            )
        )
    return out


def _verdict(what: str, value, ok, shown: str) -> str:
    if value is None:
        return f"- NOT MEASURED {what}"
    return f"- {'PASS' if ok(value) else 'FAIL'} {what}: {shown}"


def markdown(rows: list[dict], title: str, command: str, extra: list[str] = ()) -> str:
    if not rows:
        return f"# {title}\n\nNo rows.\n"
    r0 = rows[0]
    parts = [
        f"# {title}",
        "",
        f"- date {r0['date']}, commit {r0['commit']}",
        f"- device {r0['device']}; torch {r0['torch']}, triton {r0['triton']}",
        f"- reproduce: `{command}`",
        "- time: median (p20-p80) over the repeats after warm-up; TFLOP/s from the GEMM "
        "FLOPs (2NdV forward, 6NdV forward+backward, (1+K)2NdV JS one-vs-K); extra = peak "
        "less the inputs held before the call and less the returned tensors and gradients. "
        "Ratios below 1 favour the first provider.",
        *extra,
        "",
        "## Results",
        "",
        *results_table(rows),
        "",
        "## Ours against every other provider (same run)",
        "",
        *ratio_table(rows),
        "",
        "## Time against the GEMM floor (same run)",
        "",
        *floor_table(rows),
        "",
    ]
    devs = {r["device"] for r in rows}
    if any(r["dtype"] == "float32" and int(r["d"] or 0) == 896 for r in rows):
        parts += ["## Targets (issue 2, CPU)", "", *cpu_targets(rows), ""]
        parts += ["## Targets (issue 12, CPU)", "", *cpu_peer_targets(rows), ""]
    if any(r["dtype"] == "bfloat16" and int(r["d"] or 0) == 4096 for r in rows) and devs:
        parts += ["## Targets (issue 18, H200)", "", *gpu_targets(rows), ""]
    return "\n".join(parts)


def main(argv=None) -> int:
    """python -m bench.summary --csv PATH [--out MD]: the summary of every row of a CSV
    (e.g. one built by several ``python -m bench --csv PATH`` runs)."""
    import argparse

    from .results import read_rows

    ap = argparse.ArgumentParser(prog="python -m bench.summary", description=main.__doc__)
    ap.add_argument("--csv", required=True)
    ap.add_argument("--out", help="Markdown file (default: the CSV path with .md)")
    ap.add_argument("--title", default="Benchmark")
    ap.add_argument("--command", default="", help="the commands that produced the CSV")
    args = ap.parse_args(argv)
    rows = read_rows(args.csv)
    out = args.out or args.csv.rsplit(".", 1)[0] + ".md"
    with open(out, "w") as f:
        f.write(markdown(rows, args.title, args.command or f"(rows of {args.csv})"))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
