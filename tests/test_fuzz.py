"""Fuzz tests across the public ops (hypothesis; shared machinery in tests/fuzzing.py).

Each op's own fuzz bodies and tests (``FUZZ``, ``test_fuzz``, ``test_fuzz_long``) are in its
test module, tests/test_<op>.py; here: that every public op is fuzzed, and the cases with
the value checks off (MRTPO_SKIP_VALUE_CHECKS=1), where a kernel could read out of bounds,
which run in a subprocess: a crash (a signal, a non-zero exit) fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import test_advantages
import test_js
import test_logprobs
import test_policy_loss

import mrtpo_kernels as mk

ROOT = Path(__file__).resolve().parents[1]
# the op test modules; FUZZ: the fuzz bodies of their ops
OP_MODULES = [test_logprobs, test_js, test_policy_loss, test_advantages]


def test_every_public_op_is_fuzzed():
    """Every public op has fuzz bodies, once, in its test module."""
    per_op = [set(m.FUZZ) for m in OP_MODULES]
    assert set().union(*per_op) == set(mk.OPS)
    assert sum(map(len, per_op)) == len(mk.OPS)


# --------------------------------------------------------------------------- checks off

_CHECKS_OFF_SCRIPT = textwrap.dedent(
    """
    import math, sys
    import torch
    from hypothesis import HealthCheck, given, settings, strategies as st
    import mrtpo_kernels as mk
    from mrtpo_kernels import reference as R

    assert not mk._validation.value_checks_enabled()
    EXAMPLES = int(sys.argv[1])
    BAD_LABELS = [-1, -101, 10**12, -(10**12), 2**62]

    def labels_ok(err):
        assert str(err).startswith("labels"), str(err)

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def run(data):
        draw = data.draw
        dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16]))
        n, v, d = draw(st.integers(1, 7)), draw(st.integers(1, 11)), draw(st.integers(1, 5))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
        z = torch.randn(n, v, generator=gen).to(dtype)
        h = torch.randn(n, d, generator=gen).to(dtype)
        w = torch.randn(v, d, generator=gen).to(dtype)
        y = torch.randint(0, v, (n,), generator=gen)
        bad = draw(st.sampled_from(BAD_LABELS + [v]))
        y[draw(st.integers(0, n - 1))] = bad
        op = draw(st.sampled_from(["logits", "linear", "policy", "cu", "adv", "rel"]))
        backends = mk.available_backends("linear_logprobs", "cpu", dtype)
        for backend in backends if op in ("logits", "linear", "policy") else ():
            try:
                if op == "logits":
                    zz = z.clone().requires_grad_()
                    mk.logprobs_from_logits(zz, y, backend=backend).sum().backward()
                elif op == "linear":
                    hh = h.clone().requires_grad_()
                    mk.linear_logprobs(hh, w, y, backend=backend).sum().backward()
                else:
                    hh = h.clone().requires_grad_()
                    loss, _ = mk.linear_policy_loss(hh, w, y, torch.zeros(n), torch.ones(n),
                                                    backend=backend)
                    loss.backward()
            except ValueError as e:  # the CPU contract: raised after the pass
                labels_ok(e)
            else:
                raise AssertionError(f"{op}/{backend}: out-of-range label {bad} accepted")
        y_ok = torch.randint(0, v, (n,), generator=gen)
        if op == "cu":  # bad boundaries: on CPU a ValueError naming cu_seqlens, never a crash
            cu = torch.tensor(draw(st.sampled_from(
                [[1, n], [0, n + 5], [0, n + 1, n], [0, -(10**6), n], [0, 10**6, n]])))
            try:
                mk.linear_policy_loss(h, w, y_ok, torch.zeros(n), torch.ones(n),
                                      aggregation="seq-mean-token-mean", cu_seqlens=cu)
            except ValueError as e:
                assert str(e).startswith("cu_seqlens"), str(e)
            else:
                raise AssertionError(f"bad cu_seqlens {cu.tolist()} accepted")
        if op in ("adv", "rel"):
            k = 2
            rewards = torch.rand(n, k, generator=gen).to(dtype)
            rel = torch.rand(k, 3 * n, generator=gen)
            cu = torch.arange(0, 3 * n + 1, 3)
            if op == "adv":
                cu = cu.clone()
                cu[draw(st.integers(0, n))] += draw(st.sampled_from([-5, 1, 10**6, -(10**6)]))
                cu_ok = int(cu[0]) == 0 and int(cu[-1]) == 3 * n and bool((cu.diff() >= 0).all())
            else:
                rel[0, 0] = draw(st.sampled_from([math.nan, math.inf, -1.0]))
            try:
                out = mk.mrtpo_token_advantages(rewards, torch.arange(n) // 2, rel,
                                                has_info=torch.ones(n, k, dtype=torch.bool),
                                                cu_seqlens=cu)
                out.token.sum().item()
            except ValueError as e:
                assert op == "rel" or (not cu_ok and str(e).startswith("cu_seqlens")), str(e)
            else:
                assert op == "rel" or cu_ok, f"bad cu_seqlens {cu.tolist()} accepted"

    run()
    # memory intact: a correct call still matches the reference
    z = torch.randn(5, 9)
    y = torch.tensor([0, 8, -100, 3, 4])
    got = mk.logprobs_from_logits(z, y, temperature=0.7)
    ref = R.logprobs_from_logits_ref(z.double(), y, temperature=0.7)
    assert torch.allclose(got.double(), ref, atol=1e-5), (got, ref)
    print("done")
    """
)


def _checks_off(examples: int, tmp_path: Path):
    script = tmp_path / "checks_off.py"
    script.write_text(_CHECKS_OFF_SCRIPT)
    env = dict(os.environ, MRTPO_SKIP_VALUE_CHECKS="1", OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script), str(examples)],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    # a crash (a signal: negative return code) or any failure fails the test
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("done"), proc.stdout


def test_fuzz_value_checks_off_in_subprocess(tmp_path):
    _checks_off(60, tmp_path)


# Regression (root cause of the invalid free / segfault with the checks off): the segment
# code behind cu_seqlens (torch.repeat_interleave with output_size in the policy loss's
# sequence rules and in the packed reallocation) trusts the boundaries; [0, 3, 6, 10**6+9,
# 12, ...] (the right total, a negative step) wrote past its output. Eager CPU calls now
# check the boundaries even with the checks off; torch.compile traces (and GPU tensors)
# get sync-free clamped boundaries.
_BAD_CU_SCRIPT = textwrap.dedent(
    """
    import torch
    import mrtpo_kernels as mk

    n, k = 7, 2
    rewards, rel = torch.rand(n, k), torch.rand(k, 3 * n)
    h, w = torch.randn(3 * n, 4, requires_grad=True), torch.randn(9, 4)
    y = torch.randint(0, 9, (3 * n,))

    def adv(cu):
        return mk.mrtpo_token_advantages(rewards, torch.arange(n) // 2, rel, cu_seqlens=cu,
                                         has_info=torch.ones(n, k, dtype=torch.bool)).token

    def loss(cu):
        return mk.linear_policy_loss(h, w, y, torch.zeros(3 * n), torch.ones(3 * n),
                                     aggregation="seq-mean-token-mean", cu_seqlens=cu)[0]

    BAD = [[0, 3, 6, 10**6 + 9, 12, 15, 18, 21], [0, 3, 6, -(10**6), 12, 15, 18, 21],
           [5, 3, 6, 9, 12, 15, 18, 2**40]]
    for fn in (adv, loss):  # eager: named ValueError, as with the checks on
        for bad in BAD:
            try:
                fn(torch.tensor(bad))
            except ValueError as e:
                assert str(e).startswith("cu_seqlens"), str(e)
            else:
                raise AssertionError(f"{fn.__name__}: {bad} accepted")
    for fn in (adv, loss):  # traced: no value check, clamped boundaries, finite results
        compiled = torch.compile(fn, backend="eager")
        for bad in BAD:
            out = compiled(torch.tensor(bad))
            assert bool(out.isfinite().all()), (fn.__name__, bad, out)
            if fn is loss:
                out.backward()
                assert bool(h.grad.isfinite().all())
    print("done")
    """
)


def test_bad_cu_seqlens_with_checks_off_never_corrupt_memory(tmp_path):
    script = tmp_path / "bad_cu.py"
    script.write_text(_BAD_CU_SCRIPT)
    env = dict(os.environ, MRTPO_SKIP_VALUE_CHECKS="1", OMP_NUM_THREADS="2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert proc.stdout.strip().endswith("done"), proc.stdout


@pytest.mark.slow
def test_fuzz_value_checks_off_in_subprocess_long(tmp_path):
    _checks_off(600, tmp_path)
