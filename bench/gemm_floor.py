"""The ``gemm-floor`` provider: the LM-head GEMMs an op needs, with no row work.

Each op runs the GEMMs of our chunk driver (its plan: mrtpo_kernels.stages) at its
chunk sizes, into one reused buffer, and nothing else: no max, no exp, no gradient of the
logits (the backward GEMMs read whatever the buffer holds). Its time is the physical
limit of the op on this device at this shape, so every table shows the op's time beside
it (bench/summary.py: the ratio of each provider to the floor).

GEMMs per token chunk (N d V multiply-adds each):
    log-probs forward (with or without entropy)   1
    log-probs forward + backward                  1 + 3 (recompute, dH, dW) per span of
                                                  the rows the forward did not keep, 1 + 2
                                                  for the block it kept
                                                  (MRTPO_KEEP_LOGITS_BYTES; spans and block
                                                  as stages.logprobs_spans)
    policy loss forward + backward                3 (logits, dH, dW)
    JS one-vs-K                                   1 GEMM of the stacked (1 + K) C rows
    credit-assignment step                        JS one-vs-K, then the policy loss
"""

from __future__ import annotations

import torch

from .ops import Inputs

_LOW = (torch.bfloat16, torch.float16)


class Unsupported(Exception):
    pass


def chunk_rows(v: int, streams: int = 1) -> int:
    """The chunk driver's rows per chunk (its own function, so the two cannot drift)."""
    from mrtpo_kernels import stages

    return stages.chunk_rows(v, streams)


def kept_rows(n: int, v: int) -> int:
    """Rows whose logits the log-probs forward keeps for the backward (0 where the driver
    has no such setting)."""
    from mrtpo_kernels import stages

    fn = getattr(stages, "kept_rows", None)
    return 0 if fn is None else int(fn(n, v))


def js_chunk_rows(v: int, k: int) -> int:
    """Tokens per chunk of the stacked JS GEMM: (1 + K) fp32 rows of V per token in the
    JS scratch budget (MRTPO_JS_SCRATCH_BYTES)."""
    from mrtpo_kernels import stages

    return stages.js_chunk_rows(v, k)


class _Gemms:
    """The head's GEMMs as the driver runs them: fp32 operands (the weight upcast once
    when it is not fp32), or on a device whose torch.mm has out_dtype, 16-bit operands
    with fp32 logits and an fp32 dW accumulator."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor):
        self.dtype = hidden.dtype
        self.low = hidden.dtype in _LOW and _f32_out(hidden.device, hidden.dtype)
        self.w = weight.detach() if self.low else weight.detach().float()

    def logits(self, h: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        h = h.detach()
        if self.low:
            return torch.mm(h, self.w.t(), out_dtype=torch.float32, out=out)
        return torch.mm(h.float(), self.w.t(), out=out)

    def grad_view(self, z: torch.Tensor) -> torch.Tensor:
        return z.view(self.dtype)[:, : z.shape[1]] if self.low else z

    def backward(self, g: torch.Tensor, h: torch.Tensor, dh: torch.Tensor, dw: torch.Tensor):
        h = h.detach()
        if self.low:
            torch.mm(g, self.w, out=dh)
            torch.addmm(dw, g.t(), h, out_dtype=torch.float32, out=dw)
        else:
            if dh.dtype == torch.float32:
                torch.mm(g, self.w, out=dh)
            else:
                dh.copy_(g @ self.w)
            dw.addmm_(g.t(), h.float())


def _f32_out(device: torch.device, dtype: torch.dtype) -> bool:
    from mrtpo_kernels import stages

    fn = getattr(stages, "f32_out_supported", None)
    return bool(fn(device, dtype)) if fn is not None else False


def _spans(n: int, v: int, k: int) -> list[tuple[int, int]]:
    """The driver's GEMM spans of the rows it does not keep (chunks where it has no plan)."""
    from mrtpo_kernels import stages

    fn = getattr(stages, "logprobs_spans", None)
    if fn is not None:
        return fn(n, v, k)
    c = chunk_rows(v)
    return [(s, min(n - k, s + c)) for s in range(0, n - k, c)]


def _forward(head, hidden, v):
    """The log-probs forward's GEMMs: the spans of the rows it does not keep through the
    block, then one GEMM of the kept rows (the driver keeps them in no-grad calls too)."""
    n = hidden.shape[0]
    k = min(n, kept_rows(n, v))
    spans = _spans(n, v, k)
    rows = max([k] + [e - s for s, e in spans])
    region = torch.empty((rows, v), dtype=torch.float32, device=hidden.device)
    for s, e in spans:
        head.logits(hidden[s:e], region[: e - s])
    if k:
        head.logits(hidden[n - k :], region[:k])
    return region, k, spans


def logprobs_forward(hidden, weight) -> torch.Tensor:
    region, _, _ = _forward(_Gemms(hidden, weight), hidden, weight.shape[0])
    return region[0, :1].clone()  # something the call produced, as the op's log-probs


def logprobs_forward_backward(hidden, weight):
    """The forward GEMMs, then the backward's: kept rows without their recompute."""
    n, v = hidden.shape[0], weight.shape[0]
    head = _Gemms(hidden, weight)
    region, k, spans = _forward(head, hidden, v)
    dh = torch.empty_like(hidden)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if k:
        z = region[:k]
        head.backward(head.grad_view(z), hidden[n - k :], dh[n - k :], dw)
    for s, e in spans:
        z = head.logits(hidden[s:e], region[: e - s])
        head.backward(head.grad_view(z), hidden[s:e], dh[s:e], dw)
    return [dh, dw.to(weight.dtype)]


def policy_forward_backward(hidden, weight):
    """Per chunk: logits, dH, dW (the policy gradient is known in the forward)."""
    n, v = hidden.shape[0], weight.shape[0]
    head = _Gemms(hidden, weight)
    c = chunk_rows(v)
    buf = torch.empty((min(c, n), v), dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for s in range(0, n, c):
        e = min(n, s + c)
        z = head.logits(hidden[s:e], buf[: e - s])
        head.backward(head.grad_view(z), hidden[s:e], dh[s:e], dw)
    return [dh, dw.to(weight.dtype)]


def js_gemms(hidden_p, hidden_q, weight) -> torch.Tensor:
    """Per chunk of C tokens: the (1 + K) streams stacked into one (1 + K) C x d operand
    (a copy), one GEMM into a (1 + K) C x V fp32 scratch."""
    k, n = hidden_q.shape[0], hidden_p.shape[0]
    d, v = hidden_p.shape[1], weight.shape[0]
    head = _Gemms(hidden_p, weight)
    streams = 1 + k
    c = min(n, js_chunk_rows(v, k))
    a_buf = hidden_p.new_empty(streams * c * d)
    z_buf = torch.empty(streams * c * v, dtype=torch.float32, device=hidden_p.device)
    for s in range(0, n, c):
        e = min(n, s + c)
        rows = e - s
        a = a_buf[: streams * rows * d].view(streams, rows, d)
        a[0].copy_(hidden_p[s:e])
        a[1:].copy_(hidden_q[:, s:e])
        head.logits(a.view(streams * rows, d), z_buf[: streams * rows * v].view(-1, v))
    return z_buf[:k].clone()  # K numbers, as the op's (K, N) distances would be


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
