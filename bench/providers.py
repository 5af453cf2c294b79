"""Providers: who computes an op in a cell. Each turns (op, inputs) into a zero-argument
callable that runs the op once and returns the tensors it produced (outputs, gradients).

Ours: ``mrtpo-<backend>`` for backend in cpu / torch / triton / cuda, through the public API
with ``backend=`` (the cell sets MRTPO_STRICT_BACKEND=1, so a backend that would fall back
to another one raises instead of filling the table with a slower path).
Baselines: ``pytorch`` (full logits), ``pytorch-compiled`` (token chunks, per-chunk body
under torch.compile). ``gemm-floor``: the op's LM-head GEMMs alone, as our chunk driver runs
them (bench/gemm_floor.py), the physical limit shown beside every op. Peers, where
installed: ``liger`` (Liger-Kernel), ``cce`` (Cut Cross-Entropy: its Triton kernel on CUDA,
its ``impl="torch_compile"`` path on the CPU), ``verl`` (verl's fused linear cross-entropy).

A provider that cannot run a cell says why (``Unsupported``); the table keeps the row.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings

import torch

from . import torch_impls
from .workloads import Inputs

# mrtpo-cpu-keep-all: the cpu backend with MRTPO_KEEP_LOGITS_BYTES raised to every logit
# row (4 N V bytes) for the call: the log-probs backward's three-GEMM plan at a peer's memory
KEEP_ALL = "mrtpo-cpu-keep-all"
OURS = ("mrtpo-cpu", "mrtpo-torch", "mrtpo-triton", "mrtpo-cuda", KEEP_ALL)
BASELINES = ("pytorch", "pytorch-compiled")
FLOOR = "gemm-floor"
PEERS = ("liger", "cce", "verl")
PROVIDERS = OURS + BASELINES + (FLOOR,) + PEERS

# What a peer computes that differs from the op, for the note column.
_NOTES = {
    ("liger", "linear_logprobs_fwd"): "cross-entropy = -logp; gradients also computed in the "
    "forward when inputs require grad",
    ("liger", "linear_logprobs_fwd_bwd"): "cross-entropy = -logp, reduction none; gradient in "
    "the forward, upstream gradient of ones (per-token upstream gradient not supported)",
    ("liger", "linear_js_distance"): "generalized JSD (beta = 0.5) reduced to one scalar, "
    "teacher = P, one call per Q stream; not the per-token distance",
    ("cce", "linear_logprobs_fwd"): "cross-entropy = -logp, reduction none; CUDA: impl cce, "
    "CPU: impl torch_compile (full [N, V] logits under torch.compile)",
    ("cce", "linear_logprobs_fwd_bwd"): "cross-entropy = -logp, reduction none, backward with "
    "upstream -g (same dh, dW as ours with g); CUDA: impl cce, gradient filtering on "
    "(filter_eps auto: small softmax entries skipped); CPU: impl torch_compile (full [N, V] "
    "logits under torch.compile, exact gradient)",
    (KEEP_ALL, "linear_logprobs_fwd_bwd"): "MRTPO_KEEP_LOGITS_BYTES = 4 N V for the call: "
    "every logit row kept for the backward (3 GEMMs, no recompute)",
    ("gemm-floor", "linear_logprobs_fwd_bwd"): "GEMMs only: forward 1, backward 3 per chunk "
    "(2 for the rows whose logits the forward kept)",
    ("gemm-floor", "linear_policy_loss_fwd_bwd"): "GEMMs only: 3 per chunk",
    ("gemm-floor", "linear_js_distance"): "GEMMs only: 1 of the stacked (1 + K) C rows per "
    "chunk, plus the stacking copy",
    ("gemm-floor", "credit_assignment_step"): "GEMMs only: JS one-vs-K, then the policy "
    "loss's 3 per chunk (no advantage stage)",
    ("verl", "linear_logprobs_fwd"): "log-probs and entropy always computed together",
    ("verl", "linear_logprobs_entropy"): "",
    ("verl", "linear_logprobs_fwd_bwd"): "log-probs and entropy always computed together",
    ("pytorch", "credit_assignment_step"): "advantage stage by mrtpo_kernels (auto backend): "
    "no plain equivalent",
    ("pytorch-compiled", "credit_assignment_step"): "advantage stage by mrtpo_kernels (auto "
    "backend)",
}


class Unsupported(Exception):
    """The provider cannot run this cell; the message is the reason shown in the table."""


def note(provider: str, op: str) -> str:
    return _NOTES.get((provider, op), "")


def _is_ours(provider: str) -> bool:
    return provider in OURS


def availability(provider: str) -> str | None:
    """None if ``provider`` can be used on this machine, else why not."""
    if provider not in PROVIDERS:
        raise ValueError(f"provider: expected one of {', '.join(PROVIDERS)}; got {provider!r}")
    if _is_ours(provider):
        import mrtpo_kernels as mk

        name = _backend_of(provider)
        status = mk.backend_status()[name]
        return None if status == "ok" else f"backend {name!r} not available: {status}"
    module = {"liger": "liger_kernel", "cce": "cut_cross_entropy", "verl": "verl"}.get(provider)
    if module is not None and importlib.util.find_spec(module) is None:
        return f"not installed (python package {module!r}; pip install '.[bench]')"
    return None


def backend_of(provider: str) -> str:
    """The mrtpo_kernels backend one of our providers runs."""
    return "cpu" if provider == KEEP_ALL else provider.split("-", 1)[1]


_backend_of = backend_of


def _keep_all(op: str, x: Inputs):
    """Ours on the cpu backend with every logit row kept for the backward (the setting is
    raised for the call and restored after)."""
    import os

    if op != "linear_logprobs_fwd_bwd":
        raise Unsupported("only the log-probs forward + backward keeps logits")
    fn = _ours("cpu", op, x)
    full = str(4 * x["hidden"].shape[0] * x["weight"].shape[0])

    def run():
        saved = os.environ.get("MRTPO_KEEP_LOGITS_BYTES")
        os.environ["MRTPO_KEEP_LOGITS_BYTES"] = full
        try:
            return fn()
        finally:
            if saved is None:
                os.environ.pop("MRTPO_KEEP_LOGITS_BYTES", None)
            else:
                os.environ["MRTPO_KEEP_LOGITS_BYTES"] = saved

    return run


def _need_cuda(provider: str, device: torch.device) -> None:
    if device.type != "cuda":
        raise Unsupported(f"{provider} runs on CUDA only")


# --------------------------------------------------------------------------- ours


def _ours(backend: str, op: str, x: Inputs):
    import mrtpo_kernels as mk

    first = x.tensors.get("hidden", x.tensors.get("relevance"))
    dev, dtype = first.device, first.dtype
    # the public ops this benchmark op runs with backend=, from the op table
    for name in [o.name for o in mk.OPS.values() if op in o.bench_workloads and o.entry_points]:
        if backend not in mk.available_backends(name, dev, dtype):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    got = mk.resolve_backend(name, dev, dtype, backend)
                    why = f"it would run on {got!r}"
                except (RuntimeError, ValueError) as exc:
                    why = str(exc)
            raise Unsupported(f"backend {backend!r} does not serve {name} on {dev} {dtype} ({why})")
    be = backend
    if op == "linear_logprobs_fwd":
        return lambda: [mk.linear_logprobs(x["hidden"], x["weight"], x["labels"], backend=be)]
    if op == "linear_logprobs_entropy":
        return lambda: list(
            mk.linear_logprobs(
                x["hidden"], x["weight"], x["labels"], return_entropy=True, backend=be
            )
        )
    if op == "linear_logprobs_fwd_bwd":

        def run():
            x.clear_grads()
            logp = mk.linear_logprobs(x["hidden"], x["weight"], x["labels"], backend=be)
            logp.backward(x["grad_logp"])
            return [logp, x["hidden"].grad, x["weight"].grad]

        return run
    if op == "linear_policy_loss_fwd_bwd":

        def run():
            x.clear_grads()
            loss, _ = mk.linear_policy_loss(
                x["hidden"],
                x["weight"],
                x["labels"],
                x["old_logprobs"],
                x["advantages"],
                backend=be,
            )
            loss.backward()
            return [loss, x["hidden"].grad, x["weight"].grad]

        return run
    if op == "linear_js_distance":
        return lambda: [mk.linear_js_distance(x["hidden"], x["hidden_q"], x["weight"], backend=be)]
    if op == "advantages":
        return lambda: [_advantages(x, backend=be)]
    if op == "credit_assignment_step":
        js = lambda: mk.linear_js_distance(
            x["hidden"].detach(), x["hidden_q"], x["weight"].detach(), backend=be
        )
        loss = lambda adv: mk.linear_policy_loss(
            x["hidden"], x["weight"], x["labels"], x["old_logprobs"], adv, backend=be
        )[0]
        return _step(x, js, loss)
    raise AssertionError(op)


def _advantages(x: Inputs, backend=None) -> torch.Tensor:
    import mrtpo_kernels as mk

    return mk.mrtpo_token_advantages(
        x["rewards"],
        x["group_ids"],
        x["relevance"],
        has_info=x["has_info"],
        cu_seqlens=x["cu_seqlens"],
        backend=backend,
    ).token


def _step(x: Inputs, js, loss):
    """The credit-assignment step: relevance, token advantages (auto backend), policy loss."""
    import mrtpo_kernels as mk

    def run():
        x.clear_grads()
        with torch.no_grad():
            rel = js()
        adv = mk.mrtpo_token_advantages(
            x["rewards"], x["group_ids"], rel, has_info=x["has_info"], cu_seqlens=x["cu_seqlens"]
        ).token
        lval = loss(adv)
        lval.backward()
        return [rel, adv, lval, x["hidden"].grad, x["weight"].grad]

    return run


# --------------------------------------------------------------------------- baselines


def _baseline(impl, op: str, x: Inputs):
    """impl: the plain functions (module torch_impls) or a ChunkedTorch instance."""
    if impl is torch_impls:
        logprobs, js_fn, policy = (
            torch_impls.plain_logprobs,
            torch_impls.plain_js_distance,
            torch_impls.plain_policy_loss,
        )
    else:
        logprobs, js_fn, policy = impl.logprobs, impl.js_distance, impl.policy_loss
    if op == "advantages":
        raise Unsupported(
            "no baseline: the advantage stage has no equivalent outside "
            "mrtpo_kernels (see mrtpo-torch)"
        )
    if op == "linear_logprobs_fwd":

        def run():
            with torch.no_grad():
                return [logprobs(x["hidden"], x["weight"], x["labels"])]

        return run
    if op == "linear_logprobs_entropy":

        def run():
            with torch.no_grad():
                return list(logprobs(x["hidden"], x["weight"], x["labels"], return_entropy=True))

        return run
    if op == "linear_logprobs_fwd_bwd":

        def run():
            x.clear_grads()
            logp = logprobs(x["hidden"], x["weight"], x["labels"])
            logp.backward(x["grad_logp"])
            return [logp, x["hidden"].grad, x["weight"].grad]

        return run
    if op == "linear_policy_loss_fwd_bwd":

        def run():
            x.clear_grads()
            loss = policy(x["hidden"], x["weight"], x["labels"], x["old_logprobs"], x["advantages"])
            loss.backward()
            return [loss, x["hidden"].grad, x["weight"].grad]

        return run
    if op == "linear_js_distance":

        def run():
            with torch.no_grad():
                return [js_fn(x["hidden"], x["hidden_q"], x["weight"])]

        return run
    if op == "credit_assignment_step":
        js = lambda: js_fn(x["hidden"].detach(), x["hidden_q"], x["weight"].detach())
        loss = lambda adv: policy(x["hidden"], x["weight"], x["labels"], x["old_logprobs"], adv)
        return _step(x, js, loss)
    raise AssertionError(op)


_CHUNKED: dict[str, object] = {}


def chunked_impl(device: torch.device):
    """One ChunkedTorch per device (its compiled bodies are cached across cells)."""
    key = device.type
    if key not in _CHUNKED:
        budget = (1 << 30) if device.type == "cuda" else (256 << 20)
        _CHUNKED[key] = torch_impls.ChunkedTorch(compile=True, budget_bytes=budget)
    return _CHUNKED[key]


# --------------------------------------------------------------------------- peers


def _liger(op: str, x: Inputs, device: torch.device):
    _need_cuda("liger", device)
    from liger_kernel.transformers import functional as lf

    def ce():
        out = lf.liger_fused_linear_cross_entropy(
            x["hidden"], x["weight"], x["labels"], reduction="none"
        )
        return out[0] if isinstance(out, tuple) else out

    if op == "linear_logprobs_fwd":

        def run():
            with torch.no_grad():
                return [ce()]

        return run
    if op == "linear_logprobs_fwd_bwd":

        def run():
            x.clear_grads()
            loss = ce()
            loss.sum().backward()
            return [loss, x["hidden"].grad, x["weight"].grad]

        return run
    if op == "linear_js_distance":

        def run():
            outs = []
            with torch.no_grad():
                for q in x["hidden_q"]:
                    outs.append(lf.liger_fused_linear_jsd(q, x["weight"], x["hidden"], x["weight"]))
            return outs

        return run
    raise Unsupported("no equivalent op in Liger-Kernel")


def _cce(op: str, x: Inputs, device: torch.device):
    """Cut Cross-Entropy's loss -log p(label) per token: its Triton kernel on CUDA, its
    torch.compile path (what a CPU user would pick) elsewhere. The backward gets -g as its
    upstream gradient, so dh and dW are those of sum g log p, the quantity ours computes."""
    from cut_cross_entropy import linear_cross_entropy

    impl = "cce" if device.type == "cuda" else "torch_compile"
    if op not in ("linear_logprobs_fwd", "linear_logprobs_fwd_bwd"):
        raise Unsupported("no equivalent op in Cut Cross-Entropy")
    ce = lambda: linear_cross_entropy(
        x["hidden"], x["weight"], x["labels"], reduction="none", impl=impl
    )
    neg_g = -x["grad_logp"] if op == "linear_logprobs_fwd_bwd" else None
    if op == "linear_logprobs_fwd":

        def run():
            with torch.no_grad():
                return [ce()]

        return run
    if op == "linear_logprobs_fwd_bwd":

        def run():
            x.clear_grads()
            loss = ce()
            loss.backward(neg_g)
            return [loss, x["hidden"].grad, x["weight"].grad]

        return run
    raise AssertionError(op)


def _verl(op: str, x: Inputs, device: torch.device):
    _need_cuda("verl", device)
    mod = importlib.import_module("verl.utils.kernel.linear_cross_entropy")
    lce = mod.linear_cross_entropy
    call = lambda: lce(x["hidden"], x["weight"], x["labels"], 1.0, "none")
    if op in ("linear_logprobs_fwd", "linear_logprobs_entropy"):

        def run():
            with torch.no_grad():
                return list(call())

        return run
    if op == "linear_logprobs_fwd_bwd":

        def run():
            x.clear_grads()
            logp, ent = call()
            logp.backward(x["grad_logp"])
            return [logp, ent, x["hidden"].grad, x["weight"].grad]

        return run
    raise Unsupported("no equivalent op in verl")


def prepare(provider: str, op: str, x: Inputs, device: torch.device):
    """A callable that runs ``op`` once with ``provider`` and returns what it produced."""
    reason = availability(provider)
    if reason is not None:
        raise Unsupported(reason)
    if provider == KEEP_ALL:
        return _keep_all(op, x)
    if _is_ours(provider):
        return _ours(_backend_of(provider), op, x)
    if provider == "pytorch":
        return _baseline(torch_impls, op, x)
    if provider == "pytorch-compiled":
        return _baseline(chunked_impl(device), op, x)
    if provider == FLOOR:
        from . import gemm_floor

        try:
            return gemm_floor.prepare(op, x)
        except gemm_floor.Unsupported as exc:
            raise Unsupported(str(exc)) from None
    if provider == "liger":
        return _liger(op, x, device)
    if provider == "cce":
        return _cce(op, x, device)
    if provider == "verl":
        return _verl(op, x, device)
    raise AssertionError(provider)
