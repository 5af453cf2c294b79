"""The Triton row kernels themselves indexing past 2^31 elements, under the interpreter,
without touching that much memory.

One virtual allocation of 2^31 + a few rows (8.6 GB of fp32 address space, and 4.3 GB of
bf16 for the gradient) of which only the rows a kernel reads or writes are ever touched:
a (2, V) view with a row stride of 2^31 + 67 elements puts its second row past 2^31, so
the kernels form that row's address from an int64 offset (``_row_offset``); a 32-bit one
would wrap to a negative offset and read the wrong row or fault. The interpreter would
copy the whole storage back after each launch (touching every page), so this script runs
it with that copy skipped for CPU storages that are the same object (they already hold
the kernel's writes). Checked against float64: stats (log-probs, entropy, lse), grad_ into
a gradient view that also passes 2^31, policy_, and js_many with a stream stride past 2^31.

    python tests/triton_cases/offsets_cases.py      (tests/test_triton_rows.py runs it)
"""

from __future__ import annotations

import sys

import _harness
from _harness import CHECKS, FAILURES, close

_harness.use_interpreter()  # before triton is imported

import torch  # noqa: E402
import triton.runtime.interpreter as interp  # noqa: E402

from mrtpo_kernels import PolicyLossSettings  # noqa: E402
from mrtpo_kernels import reference as ref  # noqa: E402
from mrtpo_kernels.triton_kernels import rows  # noqa: E402

STRIDE = 2**31 + 67  # elements between the two rows: the second one starts past 2^31
V = 3001
II = -100

_restore = interp.GridExecutor._restore_args_dev


def _restore_without_self_copy(self, args_dev, args_hst, kwargs, kwargs_hst):
    """The interpreter's copy-back, skipped where host and device storage are one CPU
    storage (the copy would be a no-op that touches every page of the 8.6 GB view)."""

    def same(a, b):
        return (
            hasattr(a, "untyped_storage") and a.device.type == "cpu"
            and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        )  # fmt: skip

    keep = [not same(a, h) for a, h in zip(args_dev, args_hst)]
    args_dev = [a for a, k in zip(args_dev, keep) if k]
    args_hst = [h for h, k in zip(args_hst, keep) if k]
    _restore(self, args_dev, args_hst, kwargs, kwargs_hst)


interp.GridExecutor._restore_args_dev = _restore_without_self_copy


def _far_rows(dtype, rows=2):
    """A (rows, V) view with row stride STRIDE over a lazily allocated storage (only the
    pages of its rows are touched), or None where the address space is refused."""
    try:
        base = torch.empty(STRIDE * (rows - 1) + V, dtype=dtype)
    except (RuntimeError, MemoryError) as exc:
        print(f"cannot reserve {STRIDE * (rows - 1) + V} elements: {exc}")
        return None
    return base.as_strided((rows, V), (STRIDE, 1))


def group_stats_grad_policy():
    z = _far_rows(torch.float32)
    g16 = _far_rows(torch.bfloat16)
    if z is None or g16 is None:
        FAILURES.append("past 2^31: could not reserve the address space (no check ran)")
        return
    gen = torch.Generator().manual_seed(3)
    vals = torch.randn(2, V, generator=gen) * 4
    vals[1, 17] = 60.0  # the far row differs clearly from the near one
    z.copy_(vals)
    _harness.expect("far view", z.stride(0) > 2**31 and z[1].data_ptr() - z.data_ptr() > 2**33)
    lab = torch.tensor([5, 17])
    k = rows.TritonRowKernel
    logp, ent, lse = k.stats(z, lab, 1 / 0.8, II, True)
    z64 = vals.double().requires_grad_()
    rl, re = ref.logprobs_from_logits_ref(
        z64, lab, temperature=0.8, ignore_index=II, return_entropy=True
    )
    close("past 2^31 stats logp", logp, rl, atol=2e-5, rtol=2e-5)
    close("past 2^31 stats entropy", ent, re, atol=2e-5, rtol=2e-5)
    g = torch.tensor([0.7, -1.3])
    k.grad_(z, lab, lse, None, g, None, 1 / 0.8, II, out=g16)
    (want,) = torch.autograd.grad((rl * g.double()).sum(), z64)
    close("past 2^31 grad_ into a far 16-bit view", g16.float(), want, atol=1e-2, rtol=1e-2)
    _harness.expect("past 2^31: the logits are read, not written", torch.equal(z, vals))
    old, adv, tw = torch.tensor([-8.0, -2.0]), torch.tensor([1.0, -0.5]), torch.ones(2)
    cfg = PolicyLossSettings(temperature=0.8, ignore_index=II)
    loss, lp, _ = k.policy_(z, lab, old, adv, tw, None, cfg, True, out=g16)
    close("past 2^31 policy_ log-prob", lp, rl, atol=2e-5, rtol=2e-5)
    want_loss, _ = ref.policy_loss_ref(
        rl.detach(), old.double(), adv.double(), torch.ones(2, dtype=torch.bool),
        aggregation="token-mean",
    )  # fmt: skip
    close("past 2^31 policy_ loss", loss.sum() / 2, want_loss, atol=2e-5, rtol=2e-5)


def group_js_streams():
    base = _far_rows(torch.float32)
    if base is None:
        FAILURES.append("past 2^31: could not reserve the address space (no check ran)")
        return
    gen = torch.Generator().manual_seed(4)
    vals = torch.randn(2, V, generator=gen) * 2
    base.copy_(vals)
    zs = base.as_strided((2, 1, V), (STRIDE, V, 1))  # P, then one Q stream past 2^31
    d = rows.TritonRowKernel.js_many(zs, 1.0)
    want = ref.js_distance_ref(vals[:1].double(), vals[1:][None].double())
    close("past 2^31 js_many stream stride", d, want, atol=3e-5)


GROUPS = {k[len("group_") :]: f for k, f in globals().items() if k.startswith("group_")}


if __name__ == "__main__":
    code = _harness.run(GROUPS, sys.argv[1:])
    print(f"({CHECKS[0]} checks)")
    sys.exit(code)
