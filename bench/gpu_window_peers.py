"""The GPU window's ``peers`` part (bench/gpu_window.py): log-probs fwd+bwd, ours against
Liger-Kernel and Cut Cross-Entropy (each at its precision-matched setting and at its
default), time, extra memory and the errors against float64; the peers' pinned wheels
(bench/peer_wheels.sh fetches them), and what the dry run needs to run their kernels under
the Triton interpreter.
"""

from __future__ import annotations

import os

from .gpu_micro import op_inputs
from .gpu_window_common import _decide, _elapsed_ms, _extra_mb, _median_ms

# The peers' pinned versions (bench/peer_wheels.sh fetches exactly these into .whl/).
PEER_WHEELS = {"liger-kernel": "0.8.5", "cut-cross-entropy": "25.1.1"}

# What each peer setting computes in which precision, against ours, on the one op both
# peers have: log-probs fwd+bwd (-cross-entropy of a linear head). Neither peer has a policy
# loss or a JS op, so the window compares this op only. Ours: logits in fp32 (16-bit GEMM,
# fp32 out), softmax in fp32, the logits' gradient rounded to 16 bits for the dh / dW GEMMs,
# dW accumulated in fp32 across chunks, dh in fp32 within its GEMM.
PEER_PRECISION = {
    "liger_fp32_accum": "Liger accum_dtype=torch.float32, the precision-matched setting on "
    "dW (accumulated in fp32 across chunks, as ours); its logits chunk is the input dtype's "
    "GEMM output (16-bit) in both settings, so its softmax reads 16-bit logits where ours "
    "reads fp32: the one gap no Liger 0.8.5 setting closes",
    "liger_default": "Liger default (accum_dtype None): dW accumulated in the weight's "
    "16-bit dtype across chunks, 16-bit logits",
    "cce_exact": "Cut Cross-Entropy, the precision-matched setting on the forward "
    "(impl cce_exact where the version has it, else filter_eps=None): fp32 logits and "
    "softmax in-kernel, no gradient filtering; 25.1.1 rounds the logits' gradient to 16 "
    "bits (as ours) and accumulates dh and dW in 16 bits across blocks (ours: fp32)",
    "cce_default": "Cut Cross-Entropy default (filter_eps='high'): gradient blocks under "
    "the threshold skipped, so its gradient is approximate by design",
}


def cce_exact_options(linear_cross_entropy) -> dict:
    """Cut Cross-Entropy's exact gradient: ``impl="cce_exact"`` where its version has it
    (no gradient filtering, fp32 accumulation), else (25.1.1, the pinned wheel)
    ``filter_eps=None``: the default "cce" kernel without its gradient filtering."""
    try:
        from cut_cross_entropy.cce_utils import CCEPresets

        if "cce_exact" in CCEPresets.names:
            return {"impl": "cce_exact"}
    except ImportError:
        pass
    return {"impl": "cce", "filter_eps": None}


def interpreter_libdevice() -> list[str]:
    """Under TRITON_INTERPRET=1 only (the dry run): give the libdevice functions a peer's
    kernels call an implementation the interpreter can run. Triton 3.9's interpreter has none:
    ``triton.language.extra.libdevice``'s functions are placeholders that the compiler binds
    to a backend's library (their Python bodies return None), and the backend's own versions
    lower to ``extern_elementwise``, which the interpreter refuses. Cut Cross-Entropy's
    log-sum-exp merge calls ``libdevice.log1p`` (and its softcap ``libdevice.tanh``), so the
    interpreter added None to a tensor ("'NoneType' object has no attribute 'dtype'": the
    error of the earlier dry runs). Here log1p(x) = log(1 + x) and tanh by exp: the same
    values to fp32 rounding at the dry run's sizes; never used on a GPU. Returns the names
    bound."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return []
    import triton.language as tl
    from triton.language.extra import libdevice

    def log1p(x):
        return tl.log(1.0 + x)

    def tanh(x):
        e = tl.exp(-2.0 * tl.abs(x))
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    bound = []
    for name, fn in (("log1p", log1p), ("tanh", tanh)):
        if getattr(libdevice, name, None) is not None:
            setattr(libdevice, name, fn)
            bound.append(name)
    return bound


def peer_inputs(torch, args):
    """(h, w, labels, upstream): the log-prob op's inputs, in bf16 on a GPU; fp16 in the dry
    run, because the interpreter keeps bf16 as raw uint16 and does no bf16 arithmetic (only
    casts to and from fp32): a kernel that multiplies bf16 operands before casting (Cut
    Cross-Entropy's dot products do) computes on the bits, while fp16 is numpy's float16.
    A tenth of the labels are the ignore index (-100), as in a padded batch."""
    dtype = torch.float16 if args.device == "cpu" else torch.bfloat16
    h, w, lab, g = op_inputs(torch, args)
    h = h.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    lab = lab.clone()
    lab[::10] = -100
    up = torch.randn(args.n, device=args.device, generator=g)
    up[lab == -100] = 0.0
    return h, w, lab, up


def peer_calls(torch, h, w, lab, emit) -> dict:
    """{name: call}: each call returns the log-probs (N,) of ``h @ w.T`` at ``lab`` (0 at the
    ignore index) from ours or a peer, differentiable; a peer whose wheel is absent is left
    out with a ``skipped`` record."""
    import mrtpo_kernels as mk

    calls = {"ours": lambda: mk.linear_logprobs(h, w, lab, backend="triton")}
    try:
        from liger_kernel.transformers import functional as lf

        def liger(**kw):
            def run():
                out = lf.liger_fused_linear_cross_entropy(h, w, lab, reduction="none", **kw)
                return -(out[0] if isinstance(out, tuple) else out)

            return run

        calls["liger_fp32_accum"] = liger(accum_dtype=torch.float32)
        calls["liger_default"] = liger()
    except ImportError as exc:
        emit({"part": "peers", "name": "liger", "skipped": f"Liger-Kernel absent ({exc})"})
    try:
        from cut_cross_entropy import linear_cross_entropy

        def cce(**kw):
            return lambda: -linear_cross_entropy(h, w, lab, reduction="none", **kw)

        calls["cce_exact"] = cce(**cce_exact_options(linear_cross_entropy))
        calls["cce_default"] = cce()
    except ImportError as exc:
        emit({"part": "peers", "name": "cce", "skipped": f"Cut Cross-Entropy absent ({exc})"})
    return calls


def peer_errors(torch, call, h, w, lab, up, ref) -> dict:
    """One call's log-probs and gradients (of sum up * log p) against the float64 reference
    ``ref`` = (log p, dh, dW): the largest log-prob error and the gradients' relative norm
    errors, the measures bench/gpu_micro.py's correctness part gives ours."""
    lp = call()
    gh, gw = torch.autograd.grad((lp.float() * up).sum(), (h, w))
    rl, rh, rw = ref
    valid = lab != -100
    return {
        "logp_max_err": (lp.double() - rl)[valid].abs().max().item(),
        "dh_rel_err": ((gh.double() - rh).norm() / rh.norm()).item(),
        "dw_rel_err": ((gw.double() - rw).norm() / rw.norm()).item(),
    }


# Peers whose call path the dry run runs once (the float64 check) without timing it.
DRY_RUN_UNTIMED = {
    "cce_default": "its filtered backward takes about 3 minutes a call under the interpreter "
    "(n = 40, V = 3000)",
}

# Gradient bar of the check: the 16-bit rounding of the logits' gradient and of dh / dW
# (ours rounds too) gives relative errors of a few 1e-3; a broken call path gives O(1).
PEER_GRAD_REL_TOL = 2e-2


def part_peers(torch, args, emit):
    from mrtpo_kernels import reference as ref

    bound = interpreter_libdevice()
    if bound:
        emit({"part": "peers", "name": "interpreter", "options": f"libdevice {bound} bound to "
              "tl math (dry run only)"})  # fmt: skip
    if args.device == "cpu":
        # Cut Cross-Entropy's default sorts its logit averages in a torch.compile'd function
        # (fullgraph), which on the CPU builds C++ for minutes: run it eagerly (the same
        # argsort) in the dry run
        torch.compiler.set_stance("force_eager")
    h, w, lab, up = peer_inputs(torch, args)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    rl = ref.linear_logprobs_ref(h64, w64, lab)
    rh, rw = torch.autograd.grad((rl * up.double()).sum(), (h64, w64))
    reference = (rl.detach(), rh, rw)
    cpu = args.device == "cpu"
    got, grad_ok = {}, {}
    for name, call in peer_calls(torch, h, w, lab, emit).items():
        rec = {"part": "peers", "name": name, "dtype": str(h.dtype).replace("torch.", ""),
               "options": PEER_PRECISION.get(name)}  # fmt: skip

        def step(call=call):
            lp = call()
            lp.backward(up.to(lp.dtype))
            h.grad = w.grad = None

        try:
            rec.update(peer_errors(torch, call, h, w, lab, up, reference))  # also the warm-up
            rec["grad_ok"] = grad_ok[name] = (
                max(rec["dh_rel_err"], rec["dw_rel_err"]) < PEER_GRAD_REL_TOL
            )
            if cpu and name in DRY_RUN_UNTIMED:  # its call path ran once, checked above
                emit({**rec, "skipped": f"not timed in the dry run: {DRY_RUN_UNTIMED[name]}"})
                continue
            mem = 0.0 if cpu else _extra_mb(torch, step)
            # the interpreter: one timing, the checked call above its warm-up
            ms = _elapsed_ms(torch, step) if cpu else _median_ms(torch, step, 3)
        except Exception as exc:  # a peer's API may differ: say so, keep going
            emit({**rec, "error": f"{type(exc).__name__}: {exc}"[:300]})
            continue
        got[name] = (ms, mem)
        vs = ms / got["ours"][0] if "ours" in got else None
        emit({**rec, "ms": ms, "extra_mem_mb": mem, "vs_ours": vs})
    if "ours" not in got:
        return
    verdict = []
    for peer in ("liger_fp32_accum", "cce_exact"):
        if peer not in got:
            verdict.append(f"{peer}: not measured")
            continue
        faster = got["ours"][0] < got[peer][0]
        leaner = got["ours"][1] <= got[peer][1]
        verdict.append(f"{peer}: {'met' if faster and leaner else 'missed'} "
                       f"(time {got['ours'][0] / got[peer][0]:.3f}x, memory "
                       f"{got['ours'][1]:.0f} vs {got[peer][1]:.0f} MB)")  # fmt: skip
    bad = [k for k, ok in grad_ok.items() if not ok]
    verdict.append(f"gradients vs float64 within {PEER_GRAD_REL_TOL:g}: "
                   + (f"not for {', '.join(bad)}" if bad else "all"))  # fmt: skip
    _decide(
        emit,
        "peers",
        {k: [round(a, 3), round(b, 1)] for k, (a, b) in got.items()},
        "; ".join(verdict),
    )
