"""The benchmark workloads: names, synthetic inputs, and what a call returns.

Workloads (the ``op`` column of the results, ``python -m bench --ops``):
    linear_logprobs_fwd          log-probs, forward only (no grad)
    linear_logprobs_entropy      log-probs and entropy, forward only
    linear_logprobs_fwd_bwd      log-probs forward, then backward with a random upstream
                                 gradient to hidden and weight
    linear_policy_loss_fwd_bwd   clipped-surrogate loss (token-mean) forward + backward
    linear_js_distance           JS distance one-vs-K (K = the shape's K), no grad
    advantages                   GDPO + MRTPO token advantages, packed (K, N) relevance
    credit_assignment_step       per batch: JS one-vs-K relevance, token advantages, then the
                                 policy loss forward + backward with those advantages
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

WORKLOADS = (
    "linear_logprobs_fwd",
    "linear_logprobs_entropy",
    "linear_logprobs_fwd_bwd",
    "linear_policy_loss_fwd_bwd",
    "linear_js_distance",
    "advantages",
    "credit_assignment_step",
)
GRAD_WORKLOADS = ("linear_logprobs_fwd_bwd", "linear_policy_loss_fwd_bwd", "credit_assignment_step")
K_WORKLOADS = ("linear_js_distance", "advantages", "credit_assignment_step")
GROUP_SIZE = 8  # responses per prompt group in the synthetic advantage inputs


def check_workload(op: str) -> str:
    if op not in WORKLOADS:
        raise ValueError(f"op: expected one of {', '.join(WORKLOADS)}; got {op!r}")
    return op


@dataclass
class Inputs:
    """Synthetic inputs of one cell; tensors that get gradients are in ``grad_leaves``."""

    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_leaves: tuple[str, ...] = ()

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def clear_grads(self) -> None:
        for name in self.grad_leaves:
            self.tensors[name].grad = None

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def make_inputs(
    op: str,
    n: int,
    d: int,
    v: int,
    k: int,
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int = 0,
    responses: int = 0,
) -> Inputs:
    """Inputs for ``op`` at N = n tokens. Logits come out with a standard deviation near 1
    (weight scaled by 1/sqrt(d)); the Q streams are the P stream plus small noise, so the
    JS distances are small, as between a prompt with and without a constraint; the old
    log-probs sit near the current ones, so ratios are near 1 and some get clipped."""
    check_workload(op)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    # the large tensors are drawn on the device itself (no gigabytes through the host)
    dgen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=dgen, device=device) * scale).to(dtype)

    t: dict[str, torch.Tensor] = {}
    leaves: tuple[str, ...] = ()
    if op == "advantages" or op == "credit_assignment_step":
        n_resp = responses or max(1, n // 1024)
        if n % n_resp:
            raise ValueError(f"responses: N = {n} is not a multiple of {n_resp} responses")
        seqlen = n // n_resp
        t["rewards"] = torch.rand(n_resp, k, generator=gen).round().to(device)
        t["group_ids"] = (torch.arange(n_resp) // GROUP_SIZE).to(device)
        t["has_info"] = (torch.rand(n_resp, k, generator=gen) < 0.75).to(device)
        t["cu_seqlens"] = (torch.arange(n_resp + 1) * seqlen).to(device)
        if op == "advantages":
            t["relevance"] = torch.rand(k, n, generator=gen).to(device)
            return Inputs(t)
    if op != "advantages":
        t["hidden"] = randn(n, d)
        t["weight"] = randn(v, d, scale=d**-0.5)
        t["labels"] = torch.randint(0, v, (n,), generator=gen).to(device)
    if op == "linear_logprobs_fwd_bwd":
        t["grad_logp"] = torch.randn(n, generator=gen).to(device)
    if op in ("linear_policy_loss_fwd_bwd", "credit_assignment_step"):
        # log p is near -log V for these logits; the rollout's log-probs differ slightly
        base = -torch.log(torch.tensor(float(v)))
        t["old_logprobs"] = (base + 0.3 * torch.randn(n, generator=gen)).to(device)
        t["advantages"] = torch.randn(n, generator=gen).to(device)
    if op in ("linear_js_distance", "credit_assignment_step"):
        noise = torch.randn(k, n, d, generator=dgen, device=device) * 0.3
        t["hidden_q"] = (t["hidden"].float().unsqueeze(0) + noise).to(dtype)
    if op in GRAD_WORKLOADS:
        t["hidden"].requires_grad_(True)
        t["weight"].requires_grad_(True)
        leaves = ("hidden", "weight")
    return Inputs(t, leaves)


def output_bytes(outputs) -> int:
    """Bytes of the returned tensors (and gradients) of one call."""
    total = 0
    for o in outputs:
        if isinstance(o, torch.Tensor):
            total += o.numel() * o.element_size()
    return total
