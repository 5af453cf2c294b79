"""The ``gemm-floor`` provider: the LM-head GEMMs an op needs, with no row work.

Each op runs the GEMMs of our chunk driver (its plan: mrtpo_kernels.chunk_plan) at its
chunk sizes, into one reused buffer, and nothing else: no max, no exp, no gradient of the
logits (the backward GEMMs read whatever the buffer holds). Its time is the physical
limit of the op on this device at this shape, so every table shows the op's time beside
it (bench/summary.py: the ratio of each provider to the floor).

The GEMMs are those of ``chunk_plan.chunk_plan`` for the shape, run in its order (so the floor
cannot drift from the driver: tests/test_bench_floor.py counts both):
    log-probs forward (with or without entropy)   1 logits GEMM per span
    log-probs forward + backward                  + per gradient buffer: the recompute
                                                  (none for the rows the forward kept), dh,
                                                  dW (written by the first buffer's GEMM)
    policy loss forward + backward                per gradient buffer: logits, dh, dW
    JS one-vs-K                                   1 GEMM of the stacked (1 + K) C rows
    credit-assignment step                        JS one-vs-K, then the policy loss
On a device with 16-bit GEMMs with fp32 output (``chunk_plan.gemm_path``) the plan is the
16-bit one (gradient buffers of MRTPO_GRAD_BUFFER_BYTES), else the fp32 one.
"""

from __future__ import annotations

import torch

from .workloads import Inputs

_LOW = (torch.bfloat16, torch.float16)


class Unsupported(Exception):
    pass


class _Gemms:
    """The head's GEMMs as the driver runs them: fp32 operands (the weight upcast once
    when it is not fp32), or on a device whose torch.mm has out_dtype, 16-bit operands
    with fp32 logits, a 16-bit gradient buffer and an fp32 dW."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor):
        from mrtpo_kernels import chunk_plan

        self.dtype = hidden.dtype
        self.low = hidden.dtype in _LOW and chunk_plan.f32_out_supported(
            hidden.device, hidden.dtype
        )
        self.w = weight.detach() if self.low else weight.detach().float()

    def logits(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        h = h.detach()
        if self.low:
            return torch.mm(h, self.w.t(), out_dtype=torch.float32, out=out)
        return torch.mm(h.float(), self.w.t(), out=out)


def run_plan(plan, hidden: torch.Tensor, weight: torch.Tensor, head: _Gemms, stacked=None):
    """Every GEMM of ``plan`` (chunk_plan.ChunkPlan) in order, on reused buffers: logits (and
    recomputes) into an fp32 block, dh from and dW from the gradient buffer (the 16-bit
    one in 16-bit mode, else the fp32 block itself). ``stacked``: the operand of the JS
    GEMMs ((1 + K) C rows). Returns (dh, dw) (empty without a backward)."""
    v, d = weight.shape
    dev = hidden.device
    h = hidden.detach()
    z_rows = max([g.m for g in plan.gemms if g.stage in ("logits", "recompute")], default=0)
    g_rows = max([g.m for g in plan.gemms if g.stage == "dh"], default=0)
    z = torch.empty((max(z_rows, 0 if head.low else g_rows), v), dtype=torch.float32, device=dev)
    g = torch.zeros((g_rows, v), dtype=head.dtype, device=dev) if head.low else z
    backward = g_rows > 0
    dh = torch.empty((g_rows, d), dtype=hidden.dtype, device=dev) if backward else None
    dw = torch.empty((v, d), dtype=torch.float32, device=dev) if backward else None
    src = h if stacked is None else stacked
    for gm in plan.gemms:
        if gm.stage in ("logits", "recompute"):
            head.logits(src[: gm.m], z[: gm.m])
        elif gm.stage == "dh":
            gg = g[: gm.m, :v]
            if dh.dtype == gg.dtype:
                torch.mm(gg, head.w, out=dh[: gm.m])
            else:
                dh[: gm.m].copy_(gg @ head.w)
        else:  # dw
            gg, hh = g[: gm.k, :v], h[: gm.k]
            if head.low:
                if gm.accumulate:
                    torch.addmm(dw, gg.t(), hh, out_dtype=torch.float32, out=dw)
                else:
                    torch.mm(gg.t(), hh, out_dtype=torch.float32, out=dw)
            elif gm.accumulate:
                dw.addmm_(gg.t(), hh.float())
            else:
                torch.mm(gg.t(), hh.float(), out=dw)
    return dh, dw


def _plan(op, hidden, weight, head, backward=True, k=1):
    from mrtpo_kernels import chunk_plan

    n, d = hidden.shape
    return chunk_plan.chunk_plan(op, n, weight.shape[0], d, backward=backward, k=k, grad16=head.low)


def logprobs_forward(hidden, weight) -> torch.Tensor:
    head = _Gemms(hidden, weight)
    run_plan(_plan("linear_logprobs", hidden, weight, head, backward=False), hidden, weight, head)
    return hidden.new_zeros(1)  # something the call produced, as the op's log-probs


def logprobs_forward_backward(hidden, weight):
    head = _Gemms(hidden, weight)
    dh, dw = run_plan(_plan("linear_logprobs", hidden, weight, head), hidden, weight, head)
    return [dh, dw.to(weight.dtype)]


def policy_forward_backward(hidden, weight):
    head = _Gemms(hidden, weight)
    dh, dw = run_plan(_plan("linear_policy_loss", hidden, weight, head), hidden, weight, head)
    return [dh, dw.to(weight.dtype)]


def js_gemms(hidden_p, hidden_q, weight) -> torch.Tensor:
    """Per chunk of C tokens: the (1 + K) streams stacked into one (1 + K) C x d operand
    (a copy, as the driver makes), one GEMM into a (1 + K) C x V fp32 scratch."""
    from mrtpo_kernels import chunk_plan

    k, n = hidden_q.shape[0], hidden_p.shape[0]
    head = _Gemms(hidden_p, weight)
    plan = chunk_plan.chunk_plan("linear_js_distance", n, weight.shape[0], hidden_p.shape[1], k=k,
                             grad16=head.low)  # fmt: skip
    c = min(n, plan.rows_per_chunk)
    stacked = torch.cat([hidden_p[:c][None], hidden_q[:, :c]]).reshape(-1, hidden_p.shape[1])
    run_plan(plan, hidden_p, weight, head, stacked=stacked)
    return hidden_p.new_zeros(k)  # K numbers, as the op's (K, N) distances would be


def prepare(op: str, x: Inputs):
    if op in ("linear_logprobs_fwd", "linear_logprobs_entropy"):

        def run():
            with torch.no_grad():
                return [logprobs_forward(x["hidden"], x["weight"])]

        return run
    if op == "linear_logprobs_fwd_bwd":

        def run():
            with torch.no_grad():
                return logprobs_forward_backward(x["hidden"], x["weight"])

        return run
    if op == "linear_policy_loss_fwd_bwd":

        def run():
            with torch.no_grad():
                return policy_forward_backward(x["hidden"], x["weight"])

        return run
    if op == "linear_js_distance":

        def run():
            with torch.no_grad():
                return [js_gemms(x["hidden"], x["hidden_q"], x["weight"])]

        return run
    if op == "credit_assignment_step":

        def run():
            with torch.no_grad():
                rel = js_gemms(x["hidden"], x["hidden_q"], x["weight"])
                return [rel, *policy_forward_backward(x["hidden"], x["weight"])]

        return run
    raise Unsupported("no GEMM in this op (memory-bound: see its GB/s)")
