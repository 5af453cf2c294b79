"""Triton row kernels: the chunk-kernel contract of mrtpo_kernels/backends/_chunked.py on
the GPU (the same contract the C++ kernels of csrc/cpu and the PyTorch kernels of
backends/torch_backend.py implement), so one chunk driver serves every device.

The driver makes each token chunk's fp32 logits z [C, V] with one cuBLAS GEMM into a reused
buffer; these kernels then make one program per row that streams the row once for its
statistics and, where a gradient is asked for, a second time to write dL/dlogits in place.

Per row (z the raw logits, tau the temperature, M the raw row max; README "Numerics"):
    x_v = (z_v / 2 - M / 2) (2 / tau)       (halving is exact: finite z never overflows)
    log s = log sum_v exp(x_v),  lse = M / tau + log s,  logp = x_y - log s
    H = log s - (sum_v e^x_v x_v) / s
  computed online in one pass (M, s and t = sum e^x x rescaled when M grows). A row with a
  NaN or +inf, or nothing but -inf, is undefined: NaN log-prob, entropy, lse and gradient.
  Ignored rows (label = ignore_index): logp = H = 0 and a zero gradient. A label outside
  [0, V) (value checks off) gives a NaN log-prob and a zero gradient.
Gradient (written over the row, or into ``out``, a 16-bit view of the same storage):
    dz_v = (g ([v == y] - p_v) - e p_v (log p_v + H)) / tau,  p_v = exp(x_v - log s)
  g and e the upstream gradients of logp and H. For the policy loss g is the per-token
  derivative of the surrogate, known as soon as the row's log s is:
    ratio = exp(logp - old),  r_c = clamp(ratio, 1 - clip_low, 1 + clip_high)
    L = -min(ratio A, r_c A) + beta (exp(ref - logp) - (ref - logp) - 1)
    g = w (-A ratio [not clipped] + beta (1 - exp(ref - logp))),  clipped = [ratio A > r_c A]
  (strictly, as the reference: a tie or a NaN is not clipped, and passes the gradient,
  NaN for a NaN), and the options of the contract: the dual clip caps the surrogate at
  -A clip_ratio_c for A < 0 (g's surrogate part 0 where it binds); kl_iw multiplies the k3
  term by the ratio.
Gradient output: in place over z (each element written by the thread that read it, in
the same step), or into ``out``, which must not overlap z (the driver passes rows of a
separate 16-bit buffer): a 16-bit view of z's own storage would have threads write bytes
that another warp still has to read, with no barrier between them (``_check_out`` refuses
it).

Row offsets are int64 (``_row_offset``): C x V passes 2^31 at V = 151936 beyond 14134 rows.
JS one-vs-many (``js_many``) runs on the stacked (1 + K) C rows of one GEMM: a per-row
pass for (M, log s), then split sums of the terms of js_terms.py over the vocabulary, with
log p = x - log s formed from each row's own raw max (no z / tau, no rounded lse).

The kernels by concern: row_stats.py (statistics, and the split-row form), row_grads.py
(the log-prob gradient and the policy loss), row_js.py (JS one-vs-many, with the terms of
js_terms.py), row_cols.py (the low-memory column mode); what they share: row_math.py.
``TritonRowKernel`` below binds their launchers as the contract's methods.
"""

from __future__ import annotations

import torch

from .row_cols import grad_cols_, policy_terms
from .row_grads import grad_, policy_
from .row_js import js_many
from .row_math import row_block
from .row_stats import stats, stats_split

__all__ = ["TritonRowKernel", "row_block"]


class TritonRowKernel:
    """The row-kernel contract (``RowKernel`` in backends/contract.py, matched by structure:
    this layer imports nothing from the backends) in Triton row kernels, with every
    optional ability: grad_ and policy_ take ``out=`` (rows of the driver's separate 16-bit
    gradient buffer), js_many, the low-memory column kernels grad_cols_ and policy_terms
    (row_cols.py), and ``norm=`` (each row's raw max and log s) in stats and grad_cols_."""

    GRAD_OUT = True
    JS_MANY = True
    GRAD_COLS = True
    NORM = True

    stats = staticmethod(stats)
    stats_split = staticmethod(stats_split)
    grad_ = staticmethod(grad_)
    policy_ = staticmethod(policy_)
    js_many = staticmethod(js_many)
    grad_cols_ = staticmethod(grad_cols_)
    policy_terms = staticmethod(policy_terms)

    @classmethod
    def js(cls, zp, zq, inv_t, lse_p):
        """One Q stream at a time (the per-stream form of the contract; lse_p unused)."""
        return cls.js_many(torch.stack((zp, zq)), inv_t)[0], lse_p
