"""The "cpu" backend: the chunked drivers with the C++ chunk kernels of mrtpo_kernels._C.

Each chunk's logits come from one BLAS GEMM (fp32); one C++ pass over them (OpenMP over
rows, vectorized exp/log) does the reductions or writes dL/dlogits in place, so no further
[chunk x V] temporaries exist. Serves CPU tensors of every float dtype (float64 runs the
double instantiation of the same kernels). The advantage op is not here: auto dispatch
runs it on the "torch" backend, whose vectorized version is already bandwidth-bound on
the CPU.
"""

from __future__ import annotations

import functools

from . import FLOAT_DTYPES, Serves, _chunked, _saved_state
from .contract import RowKernel

try:
    from .. import _C  # noqa: F401
except ImportError as exc:  # not built: the dispatcher reports the reason
    _C = None
    _IMPORT_ERROR = str(exc)


def available() -> bool:
    return _C is not None


def unavailable_reason() -> str:
    return f"the C++ extension mrtpo_kernels._C is not built ({_IMPORT_ERROR}); run `make build`"


class _CppChunkKernel(RowKernel):
    """The row-kernel contract (contract.RowKernel) over mrtpo_kernels._C; JS_MANY."""

    JS_MANY = True

    @staticmethod
    def stats(z, labels, inv_t, ignore_index, with_ent):
        logp, ent, lse = _C.stats(z, labels.contiguous(), inv_t, ignore_index, with_ent)
        return logp, (ent if with_ent else None), lse

    @staticmethod
    def grad_(z, labels, lse, ent, g_logp, g_ent, inv_t, ignore_index, **cap):
        """``cap``: logit_scale and softcap of an active logit transform (the kernel
        multiplies dL/dz by dz/dr in its write pass, row_kernels.h); none for the identity."""
        dt = z.dtype
        _C.grad_(
            z,
            labels.contiguous(),
            lse.to(dt).contiguous(),
            None if ent is None else ent.to(dt).contiguous(),
            g_logp.to(dt).contiguous(),
            None if g_ent is None else g_ent.to(dt).contiguous(),
            inv_t,
            ignore_index,
            **cap,
        )

    @staticmethod
    def js(zp, zq, inv_t, lse_p):
        return _C.js(zp, zq, inv_t, lse_p)

    @staticmethod
    def js_many(z, inv_t):
        # the driver's stacked path: one GEMM of the 1 + K streams' rows per token chunk
        return _C.js_many(z, inv_t)

    @staticmethod
    def policy_(z, labels, old_logp, advantages, token_weight, ref_logp, cfg, need_grad):
        dt = z.dtype
        cap = cfg.logit_cap
        ckw = {"logit_scale": cap.scale, "softcap": cap.softcap} if cap.active else {}
        return _C.policy_(
            z,
            labels.contiguous(),
            old_logp.to(dt).contiguous(),
            advantages.to(dt).contiguous(),
            token_weight.to(dt).contiguous(),
            None if ref_logp is None else ref_logp.to(dt).contiguous(),
            1.0 / cfg.temperature,
            cfg.clip_low,
            cfg.clip_high,
            cfg.beta,
            cfg.ignore_index,
            need_grad,
            cfg.clip_ratio_c,
            cfg.kl_importance_weight,
            **ckw,
        )


SERVES = {op: Serves(("cpu",), FLOAT_DTYPES) for op in _chunked.CHUNK_DRIVEN_OPS}
ROW_KERNEL = None

if _C is not None:
    _K = _CppChunkKernel()
    ROW_KERNEL = _K  # public: mrtpo_kernels.chunk_plan.row_kernel("cpu")
    saved_numel = functools.partial(_saved_state.saved_numel, _K)
    linear_logprobs_fwd = functools.partial(_chunked.linear_logprobs_fwd, _K)
    linear_logprobs_bwd = functools.partial(_chunked.linear_logprobs_bwd, _K)
    linear_js_distance = functools.partial(_chunked.linear_js_distance, _K)
    logprobs_from_logits_fwd = functools.partial(_chunked.logprobs_from_logits_fwd, _K)
    logprobs_from_logits_bwd = functools.partial(_chunked.logprobs_from_logits_bwd, _K)
    js_distance = functools.partial(_chunked.js_distance, _K)
    linear_policy_loss = functools.partial(_chunked.linear_policy_loss, _K)
