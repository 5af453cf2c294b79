"""The chunk driver's plans and their predicted time on a device: the model's formulas (GEMM
and row-pass times, the previous "v2" plan rebuilt for comparison, a whole op's prediction),
without any device's figures. ``bench/cost_model.py`` states them (its docstring gives the
formulas), adds the H200 figures, the targets and the command line; ``bench/cost_model_cpu.py``
measures this CPU's rates. Both import this module, which imports neither.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from . import formulas

V2_KEEP_BYTES = 352 << 20  # the previous plan's MRTPO_KEEP_LOGITS_BYTES default


@dataclass(frozen=True)
class Device:
    """What the model needs of a device. ``gemm_rates``: measured FLOP/s per GEMM
    (m, n, k, accumulate) shape, used instead of ``gemm_flops`` where present;
    ``row_rates``: measured bytes/s per row-pass stage; ``op_gemm_flops``: a measured
    FLOP/s for every GEMM of one op's plan (the op's GEMM floor, where the formula misses
    it); ``row_call_s``: seconds per row-kernel call beyond its bytes (the chunk's small
    kernels, launches and the gaps between kernels)."""

    name: str
    gemm_flops: float
    bandwidth: float
    row_efficiency: float = 0.85
    sms: int = 0
    peak_flops: float = 0.0
    overlap: float = 1.0
    gemm_rates: dict = field(default_factory=dict)
    row_rates: dict = field(default_factory=dict)
    op_gemm_flops: dict = field(default_factory=dict)
    row_call_s: float = 0.0


def wave_efficiency(m: int, n: int, sms: int, tile: int = 128) -> float:
    if sms <= 0:
        return 1.0
    tiles = math.ceil(m / tile) * math.ceil(n / tile)
    return tiles / (math.ceil(tiles / sms) * sms)


def plan_key(g) -> tuple:
    return (g.m, g.n, g.k, g.accumulate)


def gemm_time(g, dev: Device, op: str | None = None) -> float:
    """Seconds of GEMM ``g`` (of the plan of ``op``, where given) on ``dev``."""
    if op in dev.op_gemm_flops:
        return g.flops / dev.op_gemm_flops[op]
    if plan_key(g) in dev.gemm_rates:
        return g.flops / dev.gemm_rates[plan_key(g)]
    rate = dev.gemm_flops * wave_efficiency(g.m, g.n, dev.sms)
    out = g.m * g.n * g.out_bytes * (2 if g.accumulate else 1)
    roof = max(g.flops / rate, g.bytes / dev.bandwidth)
    serial = max(g.flops / rate, (g.bytes - out) / dev.bandwidth) + out / dev.bandwidth
    return dev.overlap * roof + (1.0 - dev.overlap) * serial


def row_time(p, dev: Device) -> float:
    rate = dev.row_rates.get(p.stage) or dev.bandwidth * dev.row_efficiency
    return p.bytes / rate


# --------------------------------------------------------------------------- plans


def _chunk_plan_module():
    from mrtpo_kernels import chunk_plan

    return chunk_plan


def v2_plan(op: str, n: int, v: int, d: int, *, backward: bool = True, k: int = 4):
    """The previous driver's plan (16-bit GEMMs): chunks of MRTPO_CHUNK_BYTES rows with a
    tail, dh and dW per chunk, dW accumulated into a zeroed fp32 buffer; the log-probs
    forward kept its last 352 MiB of rows (then the default) and made the other spans that
    large, the kept block doubling as the backward's buffer; JS chunks of
    MRTPO_JS_SCRATCH_BYTES with a tail."""
    st = _chunk_plan_module()
    c = st.chunk_rows(v)
    gemms, passes = [], []
    G, P = st.Gemm, st.RowPass

    def chunks(m, cap, start=0):
        return [(s, min(start + m, s + cap)) for s in range(start, start + m, cap)]

    if op == "linear_js_distance":
        cj = st.js_chunk_rows(v, k)
        for s, e in chunks(n, cj):
            gemms.append(G("logits", (1 + k) * (e - s), v, d, False, 2, 4))
            passes.append(P("js", (1 + k) * (e - s), v, 8))
        return st.ChunkPlan(op, cj, 0, False, tuple(gemms), tuple(passes), 0, True,
                            (1 + k) * min(cj, n) * 4 * v)  # fmt: skip
    zero = [P("zero dW", v, d, 0, 4)] if backward else []
    if op == "linear_policy_loss":
        passes += zero
        for s, e in chunks(n, c):
            r = e - s
            gemms.append(G("logits", r, v, d, False, 2, 4))
            passes.append(P("policy", r, v, 8, 2))
            gemms += [G("dh", r, d, v, False, 2, 2), G("dw", v, d, r, True, 2, 4)]
        return st.ChunkPlan(op, c, 0, False, tuple(gemms), tuple(passes), c, True, c * 4 * v)
    kept = min(n, V2_KEEP_BYTES // (4 * v))
    m = n - kept
    cap = max(c, kept)
    parts = -(-m // cap) if m > 0 else 0
    step = -(-m // parts) if parts else 1
    spans = chunks(m, step) if m > 0 else []
    for s, e in spans + ([(n - kept, n)] if kept else []):
        gemms.append(G("logits", e - s, v, d, False, 2, 4))
        passes += [P("stats", b - a, v, 4) for a, b in chunks(e - s, c)]
    if backward:
        passes += zero
        for s, e in ([(n - kept, n)] if kept else []) + spans:
            if s < n - kept:
                gemms.append(G("recompute", e - s, v, d, False, 2, 4))
            passes += [P("grad", b - a, v, 8, 2) for a, b in chunks(e - s, c)]
            gemms += [G("dh", e - s, d, v, False, 2, 2), G("dw", v, d, e - s, True, 2, 4)]
    big = max([kept] + [e - s for s, e in spans])
    return st.ChunkPlan(op, c, kept, False, tuple(gemms), tuple(passes), big, True, big * 4 * v)


PLAN_OPS = {
    "linear_logprobs_fwd": ("linear_logprobs", False),
    "linear_logprobs_entropy": ("linear_logprobs", False),
    "linear_logprobs_fwd_bwd": ("linear_logprobs", True),
    "linear_policy_loss_fwd_bwd": ("linear_policy_loss", True),
    "linear_js_distance": ("linear_js_distance", False),
}


def plans_for(bench_op, n, v, d, k=4, *, version="v3", grad16=True, js_stacked=True) -> list:
    """The plans one benchmark op runs (the credit-assignment step: JS, then the policy
    loss; its advantage stage is not modelled)."""
    kw = dict(version=version, grad16=grad16, js_stacked=js_stacked)
    if bench_op == "credit_assignment_step":
        return plans_for("linear_js_distance", n, v, d, k, **kw) + plans_for(
            "linear_policy_loss_fwd_bwd", n, v, d, k, **kw
        )
    if bench_op not in PLAN_OPS:
        raise ValueError(f"bench_op: no plan for {bench_op!r}")
    op, backward = PLAN_OPS[bench_op]
    if version == "v2":
        return [v2_plan(op, n, v, d, backward=backward, k=k)]
    return [
        _chunk_plan_module().chunk_plan(
            op, n, v, d, backward=backward, k=k, grad16=grad16, js_stacked=js_stacked
        )
    ]


@dataclass(frozen=True)
class Prediction:
    op: str
    gemm_s: float
    row_s: float
    flops: float  # the op's counted FLOPs (bench/formulas.py), not the plan's
    buffer_bytes: int
    gemms: int

    @property
    def total_s(self) -> float:
        return self.gemm_s + self.row_s

    @property
    def tflops(self) -> float:
        return self.flops / self.total_s / 1e12 if self.total_s else 0.0


def predict_plans(bench_op, plans, n, v, d, k, dev: Device) -> Prediction:
    gemm_s = sum(gemm_time(g, dev, p.op) for p in plans for g in p.gemms)
    row_s = sum(row_time(r, dev) + dev.row_call_s for p in plans for r in p.row_passes)
    fl = formulas.flops(bench_op, n, d, v, k)
    mem = max(p.buffer_bytes for p in plans)
    return Prediction(bench_op, gemm_s, row_s, fl, mem, sum(p.count() for p in plans))
