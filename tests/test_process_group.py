"""Vocabulary-parallel heads (process_group=): 2 gloo processes on CPU, each holding half
of the vocabulary, against the single-process result of the whole head, forward and
backward, for linear_logprobs (with entropy), linear_policy_loss (options included) and
linear_js_distance.

The two ranks run in one torch.multiprocessing spawn (every case in it, to pay the start
once) and save what they computed; the test process compares.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import mrtpo_kernels as mk
from mrtpo_kernels import reference as R

WORLD = 2
V, D, B, T = 38, 6, 3, 5
BACKENDS = [b for b in ("cpu", "torch") if mk.backend_status().get(b) == "ok"]

POLICY_OPTIONS = [
    dict(aggregation="token-mean"),
    dict(aggregation="seq-mean-token-mean", beta=0.1, clip_ratio_c=2.0),
    dict(aggregation="seq-mean-token-sum-norm", beta=0.1, kl_importance_weight=True),
]


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    h = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64) / D**0.5 * 3
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    lab = torch.randint(0, V, (B, T), generator=g)
    lab[0, -2:] = -100
    lab[1, 0] = V - 1  # the last row of the last shard
    lab[2, 0] = 0
    logp = R.linear_logprobs_ref(h.reshape(-1, D), w, lab.reshape(-1), bias=bias).reshape(B, T)
    old = logp - 1.5 * torch.rand(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    hq = h + 0.5 * torch.randn(2, B, T, D, generator=g, dtype=torch.float64)
    cast = (lambda t: t.to(dtype)) if dtype != torch.float64 else (lambda t: t)
    return dict(h=cast(h), w=cast(w), bias=cast(bias), lab=lab, old=old.float(),
                adv=adv.float(), ref=ref.float(), hq=cast(hq))  # fmt: skip


def _run_all(x, backend, rank=None, group=None):
    """Every op's outputs and gradients; with a group, on this rank's shard of the head."""
    w, bias = x["w"], x["bias"]
    if group is not None:
        v_loc = V // WORLD
        w, bias = w[rank * v_loc : (rank + 1) * v_loc], bias[rank * v_loc : (rank + 1) * v_loc]
    out = {}

    def leaves():
        return tuple(t.detach().clone().requires_grad_() for t in (x["h"], w, bias))

    hh, ww, bb = leaves()
    logp, ent = mk.linear_logprobs(hh, ww, x["lab"], bias=bb, temperature=0.8,
                                   return_entropy=True, process_group=group,
                                   backend=backend)  # fmt: skip
    (logp * torch.linspace(-1, 2, T)).sum().add((ent * torch.linspace(2, 0.5, T)).sum()).backward()
    out["logprobs"] = (logp.detach(), ent.detach(), hh.grad, ww.grad, bb.grad)
    for i, opts in enumerate(POLICY_OPTIONS):
        hh, ww, bb = leaves()
        loss, metrics = mk.linear_policy_loss(
            hh, ww, x["lab"], x["old"], x["adv"], bias=bb, temperature=0.8, clip_low=0.2,
            clip_high=0.28, ref_logprobs=x["ref"], process_group=group, backend=backend,
            **opts,
        )  # fmt: skip
        (3.0 * loss).backward()
        out[f"policy{i}"] = (loss.detach(), hh.grad, ww.grad, bb.grad, metrics)
    with torch.no_grad():
        out["js"] = mk.linear_js_distance(x["h"], x["hq"], w, bias=bias, temperature=0.8,
                                          process_group=group, backend=backend)  # fmt: skip
    return out


def _worker(rank, port, path, dtype):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x = _inputs(dtype)
        res = {be: _run_all(x, be, rank, dist.group.WORLD) for be in BACKENDS}
        torch.save(res, f"{path}.{rank}")
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=[torch.float64, torch.float32], ids=["f64", "f32"])
def sharded(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("pg") / "out")
    mp.spawn(_worker, args=(_free_port(), path, request.param), nprocs=WORLD, join=True)
    return request.param, [torch.load(f"{path}.{r}", weights_only=False) for r in range(WORLD)]


def _err(a, b):
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_equals_single_process(sharded, backend):
    """float64: equal to the single process to 1e-10. float32: within the error budget
    (README "Numerics"): the max error against the float64 result of the same inputs is at
    most 2x the single-process float32 error, plus atol."""
    dtype, ranks = sharded
    x = _inputs(dtype)
    plain = _run_all(x, backend)
    if dtype == torch.float64:
        truth = plain
    else:
        x64 = {k: v.double() if v.is_floating_point() else v for k, v in x.items()}
        truth = _run_all(x64, backend)

    def close(got, want, single, what):
        if dtype == torch.float64:
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12,
                                       msg=lambda m: f"{what}: {m}")  # fmt: skip
        else:
            err, budget = _err(got, want), 2 * _err(single, want) + 1e-6
            assert err <= budget, f"{what}: error {err:.3e} over budget {budget:.3e}"

    v_loc = V // WORLD

    def check_grads(name, got, want, single):
        for r in range(WORLD):
            sl = slice(r * v_loc, (r + 1) * v_loc)
            close(got[r][0], want[0], single[0], f"{name} grad hidden rank {r}")
            close(got[r][1], want[1][sl], single[1][sl], f"{name} grad weight shard {r}")
            close(got[r][2], want[2][sl], single[2][sl], f"{name} grad bias shard {r}")

    res = [ranks[r][backend] for r in range(WORLD)]
    want, single = truth["logprobs"], plain["logprobs"]
    for r in range(WORLD):
        assert res[r]["logprobs"][0].dtype == plain["logprobs"][0].dtype
        close(res[r]["logprobs"][0], want[0], single[0], f"logp rank {r}")
        close(res[r]["logprobs"][1], want[1], single[1], f"entropy rank {r}")
    assert float(want[2].abs().max()) > 0
    check_grads("logprobs", [x["logprobs"][2:] for x in res], want[2:], single[2:])
    for i in range(len(POLICY_OPTIONS)):
        want, single = truth[f"policy{i}"], plain[f"policy{i}"]
        for r in range(WORLD):
            got = res[r][f"policy{i}"]
            close(got[0], want[0], single[0], f"policy{i} loss rank {r}")
            assert set(got[4]) == set(want[4])
            for k in want[4]:
                close(got[4][k], want[4][k], single[4][k], f"policy{i} metric {k} rank {r}")
        grads = [x[f"policy{i}"][1:4] for x in res]
        check_grads(f"policy{i}", grads, want[1:4], single[1:4])
    for r in range(WORLD):
        close(res[r]["js"], truth["js"], plain["js"], f"js rank {r}")
    assert float(truth["js"].min()) > 0


def test_vocab_parallel_needs_an_initialized_group():
    x = _inputs(torch.float64)
    with pytest.raises(ValueError, match="process_group"):
        mk.linear_logprobs(x["h"], x["w"], x["lab"], process_group=object())
