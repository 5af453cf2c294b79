"""The cost model's check on this CPU: rates measured at each plan's own shapes (every
distinct GEMM timed alone, every row-pass kind timed on its rows), the predicted time of
whole ops from those rates, and the measured time of the same ops through the public API.

    python -m bench.cost_model cpu-check    predicted vs measured on this CPU (< 1 min)

The model itself (plans, GEMM and row-pass times) is bench/cost_plans.py; the H200 figures,
the targets and the command line are bench/cost_model.py.
"""

from __future__ import annotations

import os
import statistics
import time

from .cost_plans import Device, plan_key, plans_for, predict_plans

CPU_BAND = (0.7, 1.4)  # measured / predicted on the CPU must fall in this band


def _median_time(fn, repeats: int) -> float:
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


CPU_SHAPE = dict(n=384, v=8000, d=256, k=2, chunk_rows=96)


def _cpu_inputs(n, v, d, k):
    import torch

    g = torch.Generator().manual_seed(0)
    h = torch.randn(n, d, generator=g)
    w = torch.randn(v, d, generator=g) * d**-0.5
    y = torch.randint(0, v, (n,), generator=g)
    hq = h[None] + 0.3 * torch.randn(k, n, d, generator=g)
    return h, w, y, hq


def _cpu_ops(backend, h, w, y, hq):
    """The three ops through the public API on ``backend`` (forward and backward)."""
    import mrtpo_kernels as mk

    n = h.shape[0]
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    g = h.new_ones(n)

    def logprobs():
        lp = mk.linear_logprobs(hh, ww, y, backend=backend)
        lp.backward(g)
        hh.grad = ww.grad = None

    def policy():
        loss, _ = mk.linear_policy_loss(hh, ww, y, -g, g, backend=backend)
        loss.backward()
        hh.grad = ww.grad = None

    def js():
        mk.linear_js_distance(h, hq, w, backend=backend)

    return {
        "linear_logprobs_fwd_bwd": logprobs,
        "linear_policy_loss_fwd_bwd": policy,
        "linear_js_distance": js,
    }


def measure_cpu_device(kern, plans, y, k: int, repeats: int = 3) -> Device:
    """CPU rates at the plans' own shapes: each distinct fp32 GEMM timed alone (torch.mm,
    or addmm_ where it accumulates), each row-pass kind timed on a chunk of its rows (the
    row kernel alone), converted to bytes/s with the plan's byte counts."""
    import torch

    import mrtpo_kernels as mk

    rates: dict = {}
    for p in plans:
        for g in p.gemms:
            if plan_key(g) in rates:
                continue
            # the driver's layouts: logits h W^T (W^T a transposed view), dh = G W, and
            # dW = G^T h (G^T a transposed view)
            a = torch.randn(g.k, g.m).t() if g.stage == "dw" else torch.randn(g.m, g.k)
            b = torch.randn(g.n, g.k).t() if g.stage in ("logits", "recompute") else None
            b = torch.randn(g.k, g.n) if b is None else b
            c = torch.zeros(g.m, g.n)
            if g.accumulate:
                t = _median_time(lambda a=a, b=b, c=c: c.addmm_(a, b), repeats)
            else:
                t = _median_time(lambda a=a, b=b, c=c: torch.mm(a, b, out=c), repeats)
            rates[plan_key(g)] = g.flops / t
    row_rates: dict = {}
    for p in plans:
        for r in p.row_passes:
            if r.stage in row_rates:
                continue
            rows = r.rows
            z = torch.randn(rows, r.cols) * 3
            lab = y[:rows] if rows <= y.shape[0] else y.repeat(-(-rows // y.shape[0]))[:rows]
            o = torch.ones(rows)
            # the in-place kernels get a fresh copy of the logits per call, made beforehand
            copies = [z.clone() for _ in range(repeats + 1)]
            if r.stage == "stats":
                fn = lambda z=z, lab=lab: kern.stats(z, lab, 1.0, -100, False)  # noqa: E731
            elif r.stage == "policy":
                fn = lambda c=copies, lab=lab, o=o: kern.policy_(  # noqa: E731
                    c.pop(), lab, -o, o, o, None, mk.PolicyLossSettings(), True
                )
            elif r.stage == "grad":
                fn = lambda c=copies, lab=lab, o=o: kern.grad_(  # noqa: E731
                    c.pop(), lab, o, None, o, None, 1.0, -100
                )
            elif r.stage == "copy kept":
                dst = torch.empty_like(z)
                fn = lambda z=z, dst=dst: dst.copy_(z)  # noqa: E731
            elif r.stage == "js" and kern.JS_MANY:
                zz = torch.randn(1 + k, rows // (1 + k), r.cols) * 3
                fn = lambda zz=zz: kern.js_many(zz, 1.0)  # noqa: E731
            elif r.stage == "js":
                zp, zq = z[: rows // 2], z[rows // 2 :]
                fn = lambda zp=zp, zq=zq: kern.js(zp, zq, 1.0, None)  # noqa: E731
            else:
                continue
            t = _median_time(fn, repeats)
            row_rates[r.stage] = r.bytes / t
    return Device("this CPU (measured)", 0.0, 0.0, 1.0, 0, 0.0, 1.0, rates, row_rates)


def cpu_check(repeats: int = 3, shape: dict | None = None) -> list[dict]:
    """Predicted (from rates measured at the plan's shapes) against measured time of the
    log-probs fwd+bwd, the policy loss fwd+bwd and JS one-vs-K, fp32 on the C++ row
    kernels (torch's where the extension is not built), at a small shape with chunks of
    ``chunk_rows`` rows (several gradient buffers)."""
    import mrtpo_kernels as mk
    from mrtpo_kernels import chunk_plan

    sh = dict(CPU_SHAPE, **(shape or {}))
    n, v, d, k, c = (sh[x] for x in ("n", "v", "d", "k", "chunk_rows"))
    backend = "cpu" if mk.backend_status()["cpu"] == "ok" else "torch"
    kern = chunk_plan.row_kernel(backend)
    keys = ("MRTPO_CHUNK_BYTES", "MRTPO_JS_SCRATCH_BYTES", "MRTPO_KEEP_LOGITS_BYTES")
    saved = {x: os.environ.get(x) for x in keys}
    os.environ["MRTPO_CHUNK_BYTES"] = str(4 * v * c)
    os.environ["MRTPO_JS_SCRATCH_BYTES"] = str(4 * v * (1 + k) * c // 2)
    os.environ["MRTPO_KEEP_LOGITS_BYTES"] = str(4 * v * c)
    try:
        h, w, y, hq = _cpu_inputs(n, v, d, k)
        ops = _cpu_ops(backend, h, w, y, hq)
        out = []
        for op, fn in ops.items():
            plans = plans_for(op, n, v, d, k, grad16=False, js_stacked=kern.JS_MANY)
            dev = measure_cpu_device(kern, plans, y, k, repeats)
            pred = predict_plans(op, plans, n, v, d, k, dev)
            meas = _median_time(fn, repeats)
            out.append(
                dict(
                    op=op, backend=backend, N=n, V=v, d=d, K=k, gemms=pred.gemms,
                    predicted_ms=pred.total_s * 1e3, gemm_ms=pred.gemm_s * 1e3,
                    row_ms=pred.row_s * 1e3, measured_ms=meas * 1e3,
                    ratio=meas / pred.total_s,
                    in_band=CPU_BAND[0] <= meas / pred.total_s <= CPU_BAND[1],
                    load=" ".join(f"{x:.2f}" for x in os.getloadavg()),
                )
            )  # fmt: skip
        return out
    finally:
        for x, val in saved.items():
            if val is None:
                os.environ.pop(x, None)
            else:
                os.environ[x] = val


__all__ = ["CPU_SHAPE", "cpu_check", "measure_cpu_device"]
