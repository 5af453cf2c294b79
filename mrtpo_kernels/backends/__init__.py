"""Backends: the low-level implementations behind the public ops.

A backend is a module that defines the entry points of the ops it serves (the names come
from the op table, mrtpo_kernels/_optable.py) and declares them in ``SERVES``: public op
name -> ``Serves(devices, dtypes)``, the device types and input dtypes its kernels take.
The dispatcher (mrtpo_kernels/_dispatch.py) reads the declarations and owns every
fallback: a backend never hands an input to another backend itself. Optional module
functions ``available()`` and ``unavailable_reason()`` say whether it can run here.

Entry points take already validated, flattened, contiguous inputs. Returned per-token
quantities are float32 (float64 for float64 inputs); gradients of the hidden states come
back in the hidden states' dtype, gradients of weight and bias in float32 (the caller
casts).

``linear_logprobs_fwd(hidden (N,d), weight (V,d), bias (V,)|None, labels (N,) int64,
    temperature, ignore_index, with_entropy) -> (logp (N,), entropy (N,) or (0,), lse (N,),
    saved)``
    lse is the log-normalizer of logits / temperature, saved for the backward; ``saved`` a
    flat tensor of what else the backward needs from the forward (kept logits, per-row
    norms; empty if nothing), of ``saved_numel`` elements (mrtpo_kernels/_dispatch.py).
``linear_logprobs_bwd(hidden, weight, bias, labels, lse, entropy (N,) or (0,),
    grad_logp (N,), grad_entropy (N,) or (0,), temperature, ignore_index, saved=None)
    -> (grad_hidden (N,d), grad_weight (V,d) fp32, grad_bias (V,) fp32 or (0,))``
    saved: the forward's, or None (then the backward recomputes what it needs).
``linear_js(hidden_p (N,d), hidden_q (K,N,d), weight, bias, temperature) -> (K,N)``
``logits_logprobs_fwd(logits (N,V), labels, temperature, ignore_index, with_entropy)``
    -> as linear_logprobs_fwd
``logits_logprobs_bwd(logits, labels, lse, entropy, grad_logp, grad_entropy, temperature,
    ignore_index, saved=None) -> grad_logits (N,V) in logits' dtype``
``logits_js(logits_p (N,V), logits_q (K,N,V), temperature) -> (K,N)``
``linear_policy_loss(hidden, weight, bias, labels, old_logp (N,), advantages (N,),
    token_weight (N,), ref_logp (N,) or (0,), temperature, clip_low, clip_high, beta,
    ignore_index, need_grad, clip_ratio_c=inf, kl_iw=False) -> (loss (), logp (N,),
    clipped (N,), grad_hidden (N,d) or (0,), grad_weight (V,d) fp32 or (0,), grad_bias (V,)
    fp32 or (0,))``
    loss = sum_t token_weight[t] * L_t and its gradient, computed in the same pass;
    clip_ratio_c: the dual clip (inf: none), kl_iw: the KL term times the ratio.
``reallocate_packed(per_reward (n,K), lam (K,), has_info (n,K) bool, relevance (K,N),
    cu_seqlens (n+1,) int64, mean (), std (), alpha, gamma, eps_batch, delta, clip_min,
    clip_max) -> (token (N,), allocation (K,N))``
    clip_min/clip_max of 0/inf mean no clip.

Adding a backend: write the module, declare ``SERVES``, add it to ``BACKENDS`` and
``_MODULES`` below and to the dispatcher's preference order. A backend built on the
token-chunked drivers binds their functions to its chunk kernel (see cpu_backend) and
declares ``{op: Serves(...) for op in _chunked.OPS}``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

import torch

BACKENDS = ("torch", "cpu", "triton", "cuda")

_MODULES = {
    "torch": "mrtpo_kernels.backends.torch_backend",
    "cpu": "mrtpo_kernels.backends.cpu_backend",
    "triton": "mrtpo_kernels.backends.triton_backend",
    "cuda": "mrtpo_kernels.backends.cuda_backend",
}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # kernels that compute in fp32
ANY_DEVICE = "*"


@dataclass(frozen=True)
class Serves:
    """What a backend's kernels for one op take: device types (``ANY_DEVICE``: all) and
    input dtypes (for the advantage op: the dtype of the relevance)."""

    devices: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES

    def covers(self, device_type: str, dtype: torch.dtype) -> bool:
        on_device = ANY_DEVICE in self.devices or device_type in self.devices
        return on_device and dtype in self.dtypes


_loaded: dict[str, object] = {}
_errors: dict[str, str] = {}


def load(name: str):
    """Import backend ``name``; return the module, or None (reason in ``load_error``)."""
    if name in _loaded:
        return _loaded[name]
    if name in _errors:
        return None
    try:
        mod = importlib.import_module(_MODULES[name])
        if hasattr(mod, "available") and not mod.available():
            raise ImportError(getattr(mod, "unavailable_reason", lambda: "not available")())
    except Exception as exc:  # ImportError, missing extension, no GPU
        _errors[name] = f"{type(exc).__name__}: {exc}"
        return None
    _loaded[name] = mod
    return mod


def load_error(name: str) -> str | None:
    return _errors.get(name)
