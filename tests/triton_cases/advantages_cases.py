"""Triton token-advantage kernel (mrtpo_kernels/triton_kernels/advantages.py) on CPU tensors under
the Triton interpreter, checked through the public API (backend="triton") against the
float64 reference of mrtpo_kernels.reference.

Runs as its own process (TRITON_INTERPRET=1 must be set before triton is imported; the
shared harness, tests/triton_cases/_harness.py, sets it):

    python tests/triton_cases/advantages_cases.py [group ...]       (default: every group)

tests/test_triton_advantages.py runs one process per group. Exit status 0 when every check
passed, 1 (with the failures listed) otherwise. Error rule (README.md, "Numerics"): our
error against float64 is at most 2x that of the "torch" backend in the same dtype, plus a
small atol.
"""

from __future__ import annotations

import sys

import _harness
from _harness import close, compile_check, expect, opcheck

_harness.use_interpreter()  # before triton is imported

import torch  # noqa: E402

import mrtpo_kernels as mk  # noqa: E402
from mrtpo_kernels.reference import mrtpo_token_advantages_ref  # noqa: E402

# --------------------------------------------------------------------------- reallocation


def _packed_batch(lengths, k, seed, has_frac=0.7):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    n = lengths.numel()
    cu = torch.zeros(n + 1, dtype=torch.long)
    cu[1:] = torch.cumsum(lengths, 0)
    rewards = torch.randn(n, k, generator=g)
    group_ids = torch.arange(n) // 4
    rel = torch.rand(k, int(cu[-1]), generator=g)
    has_info = torch.rand(n, k, generator=g) < has_frac
    return rewards, group_ids, rel, has_info, cu


def _realloc_case(lengths, k, *, seed=0, dtype=torch.float32, tag="", edit=None, **kw):
    rewards, gid, rel, has_info, cu = _packed_batch(lengths, k, seed)
    if edit is not None:
        edit(rewards, rel, has_info, cu)
    rewards, rel = rewards.to(dtype), rel.to(dtype)
    n = len(lengths)
    name = f"reallocate n={n} k={k} {dtype} {kw}{tag}"
    args = (rewards, gid, rel)
    ours = mk.mrtpo_token_advantages(*args, has_info=has_info, cu_seqlens=cu, backend="triton",
                                     **kw)  # fmt: skip
    plain = mk.mrtpo_token_advantages(*args, has_info=has_info, cu_seqlens=cu, backend="torch",
                                      **kw)  # fmt: skip
    spans = [rel[:, cu[i] : cu[i + 1]].double() for i in range(n)]
    ref_tok, ref_g = mrtpo_token_advantages_ref(rewards.double(), gid, spans, has_info=has_info,
                                                **kw)  # fmt: skip
    atol = 1e-12 if dtype == torch.float64 else 2e-6
    close(name + " token", ours.token, torch.cat(ref_tok), plain.token, atol=atol, rtol=0)
    close(name + " allocation", ours.allocation, plain.allocation, plain.allocation,
          atol=atol * 4, rtol=0)  # fmt: skip
    # Mass: each reward's weights average 1 over a response; sum_t A = T_i x GDPO advantage.
    lengths_t = (cu[1:] - cu[:-1]).double()
    seg = torch.repeat_interleave(torch.arange(n), cu[1:] - cu[:-1])
    w_sum = torch.zeros(k, n, dtype=torch.float64).index_add_(1, seg, ours.allocation.double())
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    expect(name + " weights mean 1", bool(((w_sum / lengths_t - 1).abs() <= tol).all()),
          f"max dev {(w_sum / lengths_t - 1).abs().max():.3e}")  # fmt: skip
    a_sum = torch.zeros(n, dtype=torch.float64).index_add_(0, seg, ours.token.double())
    mass = lengths_t * ref_g.sequence.double()
    dev = (a_sum - mass).abs().max().item()
    expect(name + " mass", dev <= tol * (1 + mass.abs().max().item()), f"max dev {dev:.3e}")
    return ours, ref_g, cu


def group_packed():
    lengths = [5, 1, 17, 40, 3, 9, 2500, 7, 33, 1, 64, 12]
    _realloc_case(lengths, 3)
    _realloc_case(lengths, 3, alpha=0.3, gamma=2.0, seed=1)
    _realloc_case(lengths, 3, alpha=0.7, gamma=0.5, clip=(0.2, 3.0), seed=2)
    _realloc_case(lengths, 3, clip=(0.0, 2.0), seed=3, dtype=torch.float64)
    _realloc_case(lengths, 5, gamma=1.5, batch_norm="token", seed=4, weights=None)
    _realloc_case([4, 9, 1, 30, 6, 2, 8, 8], 1, seed=5, weights=torch.tensor([0.5]))

    def zero_spans(rewards, rel, has_info, cu):
        has_info[:, 1] = False  # a reward whose verifier reads no span: plain GDPO broadcast
        rel[0, cu[2] : cu[3]] = 0.0  # mean d below delta: uniform weights
        rel[2, cu[5] : cu[6]] = 1e-9  # a span of tiny relevance (mean d below delta)
        rewards[:4, 0] = 1.0  # zero variance in group 0 for reward 0: moves nothing

    _realloc_case(lengths, 3, seed=6, edit=zero_spans, alpha=0.8, tag=" edge cases")
    # relevance is a distance: a negative value is a ValueError naming it (both backends)
    rewards, gid, rel, has_info, cu = _packed_batch(lengths, 3, 6)
    rel[2, cu[5]] = -1e-3
    for backend in ("triton", "torch"):
        try:
            mk.mrtpo_token_advantages(rewards, gid, rel, has_info=has_info, cu_seqlens=cu,
                                      backend=backend)  # fmt: skip
            raised = ""
        except ValueError as exc:
            raised = str(exc)
        expect(f"reallocate negative relevance raises ({backend})", "relevance" in raised,
              raised or "no error")  # fmt: skip
    # alpha = 0: every token gets the GDPO sequence advantage of its response.
    ours, g, cu = _realloc_case(lengths, 3, seed=7, alpha=0.0)
    seq = torch.repeat_interleave(g.sequence, cu[1:] - cu[:-1]).double()
    dev = (ours.token.double() - seq).abs().max().item()
    expect("reallocate alpha=0 is GDPO", dev <= 1e-5, f"max dev {dev:.3e}")
    # padded layout (K, n, T) with a response mask
    rewards, gid, rel, has_info, _ = _packed_batch([1] * 6, 2, 8)
    rel_p = torch.rand(2, 6, 11, generator=torch.Generator().manual_seed(10))
    mask = torch.zeros(6, 11, dtype=torch.bool)
    for i, t in enumerate([11, 3, 7, 1, 10, 5]):
        mask[i, :t] = True
    kw = dict(has_info=has_info, response_mask=mask, alpha=0.9)
    ours = mk.mrtpo_token_advantages(rewards, gid, rel_p, backend="triton", **kw)
    plain = mk.mrtpo_token_advantages(rewards, gid, rel_p, backend="torch", **kw)
    spans = [rel_p[:, i, mask[i]].double() for i in range(6)]
    ref_tok, _ = mrtpo_token_advantages_ref(rewards.double(), gid, spans, has_info=has_info,
                                            alpha=0.9)  # fmt: skip
    close("reallocate padded", ours.token[mask], torch.cat(ref_tok), plain.token[mask],
          atol=2e-6, rtol=0)  # fmt: skip
    expect("reallocate padded zeros", bool((ours.token[~mask] == 0).all()), "nonzero padding")


def group_opcheck():
    g = torch.Generator().manual_seed(9)
    rel = torch.rand(2, 12, generator=g)
    cu = torch.tensor([0, 3, 4, 12])
    per = torch.randn(3, 2, generator=g)
    has = torch.tensor([[True, False], [True, True], [False, True]])
    mean, std = torch.tensor(0.1), torch.tensor(1.3)
    args = (per, torch.ones(2), has, rel, cu, mean, std, 0.7, 1.5, 1e-6, 1e-8, 0.1, 4.0, "triton")
    opcheck("mrtpo_token_advantages", torch.ops.mrtpo.mrtpo_token_advantages.default, args)


def group_compile():
    """torch.compile(fullgraph=True) of a caller traces the op without a graph break."""
    g = torch.Generator().manual_seed(11)
    rewards = torch.randn(4, 2, generator=g)
    rel = torch.rand(2, 10, generator=g)
    cu = torch.tensor([0, 3, 4, 9, 10])
    has = torch.tensor([[True, False], [True, True], [False, True], [True, True]])

    def realloc(rewards, rel):
        return mk.mrtpo_token_advantages(
            rewards, torch.tensor([0, 0, 1, 1]), rel, has_info=has, cu_seqlens=cu,
            alpha=0.5, backend="triton",
        ).token  # fmt: skip

    compile_check("advantages", realloc, (rewards, rel))


GROUPS = {k[len("group_") :]: f for k, f in sorted(globals().items()) if k.startswith("group_")}


if __name__ == "__main__":
    sys.exit(_harness.run(GROUPS, sys.argv[1:]))
