"""Run benchmark cells in this process and print one ``BENCH_ROW <json>`` line per cell.

    python -m bench.cell '<json list of cell specs>'

The driver (``python -m bench``) starts one such process per cell on the CPU (so that the
peak RSS is the cell's own) or per provider on a GPU (peak memory reset per cell).
A spec: op, provider, n, d, v, k, dtype, device, repeats, warmup, warmup_n, seed, responses,
force (run even if the memory estimate says it will not fit).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import traceback

import torch

from . import cost_model, envinfo, formulas, providers  # noqa: E402
from .measure import measure  # noqa: E402
from .workloads import make_inputs  # noqa: E402

ROW_PREFIX = "BENCH_ROW "
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MB = float(1 << 20)


def base_row(spec: dict) -> dict:
    row = envinfo.row_context(spec["device"])
    row.update(
        op=spec["op"],
        provider=spec["provider"],
        N=spec["n"],
        d=spec["d"],
        V=spec["v"],
        K=spec["k"],
        responses=spec.get("responses", 0),
        dtype=spec["dtype"],
        repeats=spec["repeats"],
        status="",
        note=providers.note(spec["provider"], spec["op"]),
    )
    row.update(_model_columns(spec))
    return row


_DRIVER_BACKENDS = ("cpu", "torch", "triton")


def _model_columns(spec: dict) -> dict:
    """The cost model's prediction (bench/cost_model.py: the H200 model for CUDA rows, none
    on the CPU, whose rates ``python -m bench.cost_model cpu-check`` measures) and, for the
    chunk driver's providers, the GEMM path the driver takes (16-bit GEMMs with fp32 output
    or the fp32 fallback), so a slow path shows in every row."""
    out = {"pred_ms": None, "gemm_path": ""}
    prov, op = spec["provider"], spec["op"]
    if prov in providers.OURS or prov == providers.FLOOR:
        try:
            out["pred_ms"] = cost_model.predicted_ms(
                op, spec["n"], spec["d"], spec["v"], spec["k"],
                torch.device(spec["device"]).type, spec["dtype"],
            )  # fmt: skip
        except ValueError:
            pass
    backend = providers.backend_of(prov) if prov in providers.OURS else None
    if prov == providers.FLOOR:
        backend = "triton" if spec["device"].startswith("cuda") else "cpu"
    if backend in _DRIVER_BACKENDS and providers.availability(f"mrtpo-{backend}") is None:
        from mrtpo_kernels import chunk_plan

        out["gemm_path"] = chunk_plan.gemm_path(backend, spec["device"], DTYPES[spec["dtype"]])
    return out


def _join(*parts: str) -> str:
    return "; ".join(p for p in parts if p)


def _prepared(spec: dict, n: int, device: torch.device):
    responses = spec.get("responses", 0)
    if responses and n != spec["n"]:
        responses = max(1, responses * n // spec["n"])
    x = make_inputs(
        spec["op"],
        n,
        spec["d"],
        spec["v"],
        spec["k"],
        DTYPES[spec["dtype"]],
        device,
        seed=spec.get("seed", 0),
        responses=responses,
    )
    return x, providers.prepare(spec["provider"], spec["op"], x, device)


def run_cell(spec: dict) -> dict:
    """Measure one cell; never raises: failures become the row's status and note."""
    row = base_row(spec)
    op, prov, n, d, v, k = (spec[key] for key in ("op", "provider", "n", "d", "v", "k"))
    device = torch.device(spec["device"])
    reason = providers.availability(prov)
    if reason is not None:
        row.update(status="unavailable", note=_join(reason, row["note"]))
        return row
    fits, need = formulas.fits(
        prov, op, n, d, v, k, spec["dtype"], envinfo.mem_available_bytes(spec["device"])
    )
    if not fits and not spec.get("force"):
        extra = formulas.estimate_extra_bytes(prov, op, n, d, v, k, spec["dtype"])
        avail = envinfo.mem_available_bytes(spec["device"]) / 2**30
        row.update(
            status="estimated",
            peak_mem_mb=need / MB,
            extra_mem_mb=extra / MB,
            note=_join(
                f"not run: estimated need {need / 2**30:.1f} GiB, available {avail:.1f} GiB",
                row["note"],
            ),
        )
        return row
    x = None
    try:
        warmup_fn, small = None, None
        wn = spec.get("warmup_n", 0)
        if wn and wn < n:
            small, warmup_fn = _prepared(spec, wn, device)
        x, fn = _prepared(spec, n, device)
        if warmup_fn is not None:  # warm up on the small shape before the timed calls
            warmup_fn()
            small.clear_grads()
            warmup_fn = small = None
            gc.collect()
        load0 = os.getloadavg()[0]
        res = measure(
            fn,
            device,
            spec["repeats"],
            warmup=0 if wn and wn < n else spec.get("warmup", 1),
            after_call=x.clear_grads,
        )
    except providers.Unsupported as exc:
        row.update(status="unsupported", note=_join(str(exc), row["note"]))
        return row
    except (torch.OutOfMemoryError, MemoryError) as exc:
        row.update(status="oom", note=_join(f"out of memory: {str(exc)[:160]}", row["note"]))
        return row
    except Exception as exc:  # a failing peer or kernel must not stop the run
        tb = traceback.format_exc(limit=2).strip().splitlines()[-1]
        row.update(
            status="error",
            note=_join(f"{type(exc).__name__}: {str(exc)[:200]}" if str(exc) else tb, row["note"]),
        )
        return row
    finally:
        del x
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    secs = res["ms_p50"] / 1e3
    fl = formulas.flops(op, n, d, v, k)
    row.update(
        status="ok",
        ms_p20=res["ms_p20"],
        ms_p50=res["ms_p50"],
        ms_p80=res["ms_p80"],
        tflops=fl / secs / 1e12 if fl else None,
        gb_per_s=formulas.advantage_bytes(n, k) / secs / 1e9 if op == "advantages" else None,
        peak_mem_mb=res["peak_bytes"] / MB,
        extra_mem_mb=res["extra_bytes"] / MB,
        cpu_ms_p50=res["cpu_ms_p50"],
        load_avg=f"{load0:.2f}/{os.getloadavg()[0]:.2f}",
    )
    if res["peak_method"] != "VmHWM reset" and device.type == "cpu":
        row["note"] = _join(f"peak by {res['peak_method']}", row["note"])
    return row


def main(argv=None) -> int:
    # a backend that would fall back is an error in a benchmark, not a slower row
    os.environ.setdefault("MRTPO_STRICT_BACKEND", "1")
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m bench.cell '<json list of cell specs>'", file=sys.stderr)
        return 2
    specs = json.loads(argv[0])
    if isinstance(specs, dict):
        specs = [specs]
    for spec in specs:
        row = run_cell(spec)
        print(ROW_PREFIX + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
