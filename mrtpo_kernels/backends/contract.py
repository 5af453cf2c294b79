"""The backend contract as ``typing.Protocol`` classes.

- ``Backend``: what the dispatcher (mrtpo_kernels/_dispatch.py) reads from a backend module.
- One Protocol per public op with the entry points its custom op calls (``ENTRY_POINTS``:
  public op -> Protocol; the op table, mrtpo_kernels/_catalog.py, lists the same names). A
  backend defines the entry points of every op it declares in ``SERVES``.
- ``RowKernel``: what the chunk driver (backends/_chunked.py) calls on a backend's row
  kernel, with its optional abilities declared as flags (defaults here, False).

Conventions of every entry point: inputs are already validated, flattened and contiguous;
returned per-token quantities are float32 (float64 for float64 inputs); gradients of the
hidden states come back in the hidden states' dtype, those of weight and bias in float32
(the caller casts). The linear ops' logit transform (``logit_scale``, ``softcap``;
_types.LogitCap) reaches an entry point only where it is active, as keywords (softcap 0:
none); the identity calls every entry point exactly as before the transform existed.
tests/test_dispatch.py checks every backend that loads against these classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from torch import Tensor

from .._types import PolicyLossSettings
from . import Serves


@runtime_checkable
class Backend(Protocol):
    """A backend module. ``SERVES``: public op -> ``Serves(devices, dtypes)``, the device
    types and input dtypes its kernels take (the dispatcher owns every fallback: a backend
    never hands an input to another one). ``ROW_KERNEL``: the row kernel its chunk-driven
    entry points are bound to (None without one)."""

    SERVES: Mapping[str, Serves]
    ROW_KERNEL: RowKernel | None

    def available(self) -> bool:
        """Whether the backend can run here (its extension is built, its device present)."""
        ...

    def unavailable_reason(self) -> str:
        """Why it cannot ("" when it can)."""
        ...

    def saved_numel(self, op: str, n: int, v: int, weight_numel: int) -> int:
        """Elements of the ``saved`` output of its log-probs forward for public op ``op``
        ("linear_logprobs" or "logprobs_from_logits") on n tokens, vocabulary v: the ops'
        fakes read it, so it must equal what the forward returns."""
        ...


class LinearLogprobsEntryPoints(Protocol):
    def linear_logprobs_fwd(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        temperature: float,
        ignore_index: int,
        with_entropy: bool,
        logit_scale: float = 1.0,
        softcap: float = 0.0,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """hidden (N, d), weight (V, d), bias (V,) | None, labels (N,) int64 ->
        (logp (N,), entropy (N,) or (0,), lse (N,), saved): lse the log-normalizer of
        logits / temperature, kept for the backward; ``saved`` a flat tensor of what else
        the backward needs (kept logits, per-row norms; empty if nothing), of
        ``Backend.saved_numel`` elements."""
        ...

    def linear_logprobs_bwd(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        lse: Tensor,
        entropy: Tensor,
        grad_logp: Tensor,
        grad_entropy: Tensor,
        temperature: float,
        ignore_index: int,
        saved: Tensor | None = None,
        logit_scale: float = 1.0,
        softcap: float = 0.0,
        own_entropy: bool = True,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """entropy and grad_entropy (N,) or (0,) -> (grad_hidden (N, d), grad_weight (V, d)
        fp32, grad_bias (V,) fp32 or (0,)). saved: the forward's, or None (then the
        backward recomputes what it needs); it may be overwritten. own_entropy: entropy is
        the rows' own (the forward's output), so each row of dL/dz sums to zero (the
        low-memory backward relies on it: _chunk_backward._Centred); False where it is not
        (the vocabulary-parallel shard gets the global entropy shifted to the shard)."""
        ...


class LogprobsFromLogitsEntryPoints(Protocol):
    def logprobs_from_logits_fwd(
        self,
        logits: Tensor,
        labels: Tensor,
        temperature: float,
        ignore_index: int,
        with_entropy: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """logits (N, V) -> as ``linear_logprobs_fwd``."""
        ...

    def logprobs_from_logits_bwd(
        self,
        logits: Tensor,
        labels: Tensor,
        lse: Tensor,
        entropy: Tensor,
        grad_logp: Tensor,
        grad_entropy: Tensor,
        temperature: float,
        ignore_index: int,
        saved: Tensor | None = None,
    ) -> Tensor:
        """-> grad_logits (N, V) in the logits' dtype."""
        ...


class LinearJSDistanceEntryPoints(Protocol):
    def linear_js_distance(
        self,
        hidden_p: Tensor,
        hidden_q: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        temperature: float,
        logit_scale: float = 1.0,
        softcap: float = 0.0,
    ) -> Tensor:
        """hidden_p (N, d), hidden_q (K, N, d) -> distances (K, N)."""
        ...


class JSDistanceEntryPoints(Protocol):
    def js_distance(self, logits_p: Tensor, logits_q: Tensor, temperature: float) -> Tensor:
        """logits_p (N, V), logits_q (K, N, V) -> distances (K, N)."""
        ...


class LinearPolicyLossEntryPoints(Protocol):
    def linear_policy_loss(
        self,
        hidden: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        labels: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        token_weight: Tensor,
        ref_logp: Tensor,
        cfg: PolicyLossSettings,
        need_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """old_logp, advantages, token_weight (N,), ref_logp (N,) or (0,) -> (loss (),
        logp (N,), clipped (N,), grad_hidden (N, d) or (0,), grad_weight (V, d) fp32 or
        (0,), grad_bias (V,) fp32 or (0,)): loss = sum_t token_weight[t] L_t and its
        gradient, computed in the same pass (only with need_grad). ``cfg``: the scalar
        settings, one value built by the custom op (temperature, clip range, beta,
        ignore_index, the dual clip clip_ratio_c, inf for none, kl_importance_weight, the
        logit transform's logit_scale and softcap)."""
        ...


class TokenAdvantagesEntryPoints(Protocol):
    def mrtpo_token_advantages(
        self,
        per_reward: Tensor,
        lam: Tensor,
        has_info: Tensor,
        relevance: Tensor,
        cu_seqlens: Tensor,
        sequence: Tensor,
        divisor: Tensor,
        alpha: float,
        gamma: float,
        delta: float,
        clip_min: float,
        clip_max: float,
    ) -> tuple[Tensor, Tensor]:
        """per_reward (n, K), lam (K,), has_info (n, K) bool, relevance (K, N), cu_seqlens
        (n + 1,) int64, sequence (n,) (GDPO's sequence advantages), divisor () (the
        redistribution's D, in per_reward's units) -> (token (N,), allocation (K, N)), both
        final: token[t] = sequence[i] + sum_k c_k (w_k[t] - 1) / divisor over the rewards
        with c_k = lam_k A_k[i] != 0 (a weight of exactly 1 or c_k = 0 adds exactly 0, so
        alpha = 0 gives GDPO bit for bit), sequence[i] where divisor is not > 0; clip_min /
        clip_max of 0 / inf mean no clip."""
        ...


# public op -> its entry points (gdpo_advantages and specific_relevance have none: the
# public functions compute them in PyTorch ops)
ENTRY_POINTS: Mapping[str, type] = {
    "linear_logprobs": LinearLogprobsEntryPoints,
    "logprobs_from_logits": LogprobsFromLogitsEntryPoints,
    "linear_js_distance": LinearJSDistanceEntryPoints,
    "js_distance": JSDistanceEntryPoints,
    "linear_policy_loss": LinearPolicyLossEntryPoints,
    "mrtpo_token_advantages": TokenAdvantagesEntryPoints,
}


def entry_point_names(protocol: type) -> tuple[str, ...]:
    """The entry points a Protocol above declares, in definition order."""
    return tuple(n for n, f in vars(protocol).items() if callable(f) and not n.startswith("_"))


@runtime_checkable
class RowKernel(Protocol):
    """What the chunk driver calls, on row slices of a contiguous fp32 chunk z of logits
    (before the temperature; inv_t = 1 / temperature). With a logit transform (LogitCap)
    the driver has already transformed z (z = softcap tanh(scale r / softcap) of the raw
    logits r); the gradient methods then get ``logit_scale`` and ``softcap`` (grad_,
    grad_cols_: keywords; policy_: in cfg) and return dL/dr = dL/dz scale (1 - (z /
    softcap)^2) (scale without a cap), the slope formed from the z they read.

    The optional abilities are flags, False here; a kernel that has one sets it and
    defines its methods (the driver reads the flags, never probes for methods):

    GRAD_OUT: grad_ and policy_ take ``out=``, rows of a separate 16-bit gradient buffer
        (never z's own storage), so that with 16-bit inputs the two gradient GEMMs run on
        16-bit operands and the logits GEMM writes fp32 from 16-bit operands (torch.mm's
        out_dtype, checked on the device at run time; without it the driver upcasts).
    JS_MANY: ``js_many``, JS one-vs-many on the stacked rows of one GEMM (1 GEMM of
        (1 + K) C rows per token chunk instead of 1 + K).
    GRAD_COLS: ``grad_cols_`` and ``policy_terms``, the low-memory mode
        (settings.low_memory): the backward walks vocabulary chunks of all N rows, each dW
        row block finished in one chunk (no fp32 dW accumulator), one GEMM more.
    NORM: stats and grad_cols_ take ``norm=``: stats writes each row's raw max M and log s
        into the column slice [:, a:b] of one (2, N) fp32 buffer, and grad_cols_ forms
        log p = (z/2 - M/2)(2/tau) - log s from it instead of z / tau - lse from the
        rounded fp32 lse (ulp(lse) / 2 off in every log p: 5e-4 at |z / tau| ~ 1e4, NaN
        past float max). The low-memory drivers use it; the log-probs forward returns it
        in its ``saved`` output for the backward.
    """

    GRAD_OUT: bool = False
    JS_MANY: bool = False
    GRAD_COLS: bool = False
    NORM: bool = False

    def stats(
        self, z: Tensor, labels: Tensor, inv_t: float, ignore_index: int, with_ent: bool
    ) -> tuple[Tensor, Tensor | None, Tensor]:
        """-> (logp, entropy or None, lse) per row."""
        ...

    def grad_(
        self,
        z: Tensor,
        labels: Tensor,
        lse: Tensor,
        ent: Tensor | None,
        g_logp: Tensor,
        g_ent: Tensor | None,
        inv_t: float,
        ignore_index: int,
        logit_scale: float = 1.0,
        softcap: float = 0.0,
    ) -> None:
        """dL/dz for upstream g_logp (and g_ent), written over z (or into ``out=``); dL/dr
        with an active logit transform."""
        ...

    def js(
        self, zp: Tensor, zq: Tensor, inv_t: float, lse_p: object | None
    ) -> tuple[Tensor, object]:
        """-> (JS distance per row, P's row statistics: opaque to the driver, passed back
        for the next Q stream of the same rows; None on the first)."""
        ...

    def policy_(
        self,
        z: Tensor,
        labels: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        token_weight: Tensor,
        ref_logp: Tensor | None,
        cfg: PolicyLossSettings,
        need_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """-> (per-token loss, logp, clipped); with need_grad, dL/dz for the token weights
        written over z (or into ``out=``). ``cfg``: the scalar settings (the temperature
        among them: the kernel forms 1 / cfg.temperature itself)."""
        ...

    def js_many(self, z: Tensor, inv_t: float) -> Tensor:
        """JS_MANY: z (1 + K, C, V), P's rows first -> (K, C) distances."""
        raise NotImplementedError(f"{type(self).__name__} does not declare JS_MANY")

    def grad_cols_(
        self,
        z: Tensor,
        labels: Tensor,
        lse: Tensor,
        ent: Tensor | None,
        g_logp: Tensor,
        g_ent: Tensor | None,
        inv_t: float,
        ignore_index: int,
        v_lo: int,
        vocab: int,
        out: Tensor | None = None,
        logit_scale: float = 1.0,
        softcap: float = 0.0,
    ) -> None:
        """GRAD_COLS: dL/dz for the vocabulary columns [v_lo, v_lo + z.shape[1]) of all
        rows (of a vocabulary of ``vocab``), over z or into ``out``."""
        raise NotImplementedError(f"{type(self).__name__} does not declare GRAD_COLS")

    def policy_terms(
        self,
        logp: Tensor,
        labels: Tensor,
        old_logp: Tensor,
        advantages: Tensor,
        token_weight: Tensor,
        ref_logp: Tensor | None,
        vocab: int,
        cfg: PolicyLossSettings,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """GRAD_COLS: the token terms from log-probs -> (per-token loss, clipped, g), g
        the upstream gradient of each row's log-prob for grad_cols_."""
        raise NotImplementedError(f"{type(self).__name__} does not declare GRAD_COLS")
