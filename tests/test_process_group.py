"""Vocabulary-parallel heads (process_group=): 2 gloo processes on CPU, each holding half
of the vocabulary, against the single-process result of the whole head, forward and
backward, for linear_logprobs (with entropy), linear_policy_loss (options included) and
linear_js_distance, with and without the head's logit transform (logit_scale, softcap).

The two ranks run in one torch.multiprocessing spawn (every case in it, to pay the start
once) and save what they computed; the test process compares.
"""

from __future__ import annotations

import math
import os
import socket
import tempfile

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
# the head's logit transform: "" plain, "_cap" a scale and a softcap that bends the logits
# (|scale r| reaches ~3 softcap on these inputs), "_scale" a scale alone
TRANSFORMS = {"": {}, "_cap": dict(logit_scale=0.7, softcap=2.5), "_scale": dict(logit_scale=-1.3)}


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

    for suffix, cap in TRANSFORMS.items():
        hh, ww, bb = leaves()
        logp, ent = mk.linear_logprobs(hh, ww, x["lab"], bias=bb, temperature=0.8,
                                       return_entropy=True, process_group=group,
                                       backend=backend, **cap)  # fmt: skip
        (logp * torch.linspace(-1, 2, T)).sum().add(
            (ent * torch.linspace(2, 0.5, T)).sum()
        ).backward()
        out["logprobs" + suffix] = (logp.detach(), ent.detach(), hh.grad, ww.grad, bb.grad)
        # the plain head runs every policy option, a transformed one the second
        for i, opts in enumerate(POLICY_OPTIONS):
            if suffix and i != 1:
                continue
            hh, ww, bb = leaves()
            loss, metrics = mk.linear_policy_loss(
                hh, ww, x["lab"], x["old"], x["adv"], bias=bb, temperature=0.8, clip_low=0.2,
                clip_high=0.28, ref_logprobs=x["ref"], process_group=group, backend=backend,
                **opts, **cap,
            )  # fmt: skip
            (3.0 * loss).backward()
            out[f"policy{i}{suffix}"] = (loss.detach(), hh.grad, ww.grad, bb.grad, metrics)
        with torch.no_grad():
            out["js" + suffix] = mk.linear_js_distance(
                x["h"], x["hq"], w, bias=bias, temperature=0.8, process_group=group,
                backend=backend, **cap,
            )  # fmt: skip
    return out


EXTREME = ("past_range", "shard_all_ninf", "nan_bias", "inf_row", "nan_row")


def _extreme_inputs(case, dtype):
    """Inputs outside the ordinary range (README "Numerics"), in the dtype asked.
    past_range: |z / T| beyond float32 at T = 0.01 (float32: the shard's log-normalizer
    overflows, the log-probs are 0 / -inf and finite in between); shard_all_ninf: the second
    shard's logits all -inf (a -inf bias), so that shard has no mass; nan_bias: a NaN
    logit in every row; inf_row / nan_row: one token's hidden state holds +inf / NaN."""
    g = torch.Generator().manual_seed(5)
    h = torch.randn(B * T, D, generator=g, dtype=torch.float64)
    w = torch.randn(V, D, generator=g, dtype=torch.float64)
    bias = torch.randn(V, generator=g, dtype=torch.float64)
    lab = torch.randint(0, V, (B * T,), generator=g)
    lab[1] = -100
    temp = 0.8
    if case == "past_range":
        h, temp = h * 1e36, 0.01
    elif case == "shard_all_ninf":
        bias[V // WORLD :] = -math.inf
        lab = torch.where(lab == -100, lab, lab % (V // WORLD))
    elif case == "nan_bias":
        bias[V - 3] = math.nan
    elif case == "inf_row":
        h[4, 2] = math.inf
    else:
        h[4, 2] = math.nan
    hq = h * torch.linspace(0.9, 1.1, D, dtype=torch.float64)
    return dict(h=h.to(dtype), w=w.to(dtype), bias=bias.to(dtype), lab=lab, hq=hq.to(dtype),
                temp=temp)  # fmt: skip


def _run_extreme(x, backend, rank=None, group=None, world=WORLD):
    """Log-probs, entropy, their gradients, the policy loss (with a KL term) and JS."""
    w, bias = x["w"], x["bias"]
    if group is not None:
        v_loc = V // world
        w, bias = w[rank * v_loc : (rank + 1) * v_loc], bias[rank * v_loc : (rank + 1) * v_loc]
    hh, ww, bb = (t.detach().clone().requires_grad_() for t in (x["h"], w, bias))
    kw = dict(bias=bb, temperature=x["temp"], process_group=group, backend=backend)
    logp, ent = mk.linear_logprobs(hh, ww, x["lab"], return_entropy=True, **kw)
    valid = x["lab"] != -100
    torch.where(valid & logp.isfinite(), logp, 0.0).sum().add(ent.nan_to_num().sum()).backward()
    out = dict(logp=logp.detach(), ent=ent.detach(), gh=hh.grad, gw=ww.grad, gb=bb.grad)
    n = logp.shape[0]
    old = logp.detach().double().nan_to_num(0.0).clamp(min=-1e30).float() - 0.1
    loss, metrics = mk.linear_policy_loss(
        hh.detach(), ww.detach(), x["lab"], old, torch.linspace(-1, 1, n),
        ref_logprobs=old + 0.05, beta=0.1, **kw | dict(bias=bb.detach()),
    )  # fmt: skip
    out.update(loss=loss.detach(), kl=metrics["kl"], ratio=metrics["mean_ratio"])
    with torch.no_grad():
        out["js"] = mk.linear_js_distance(x["h"], x["hq"], w, bias=bias, temperature=x["temp"],
                                          process_group=group, backend=backend)  # fmt: skip
    return out


def _worker(rank, port, path, dtype):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        x = _inputs(dtype)
        res = {be: _run_all(x, be, rank, dist.group.WORLD) for be in BACKENDS}
        for case in EXTREME:
            xe = _extreme_inputs(case, dtype)
            for be in BACKENDS:
                res[be][case] = _run_extreme(xe, be, rank, dist.group.WORLD)
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
    most 2x the single-process float32 error, plus atol: 1e-6 and two float32 units in the
    last place of the largest value compared (the combine's own roundings: the shard's mass
    w_r = exp(lse_r - lse) scales every term of the gradient, an error of a few ulps of the
    largest entry, with or without a logit transform; the single-process error of one
    tensor can be under one ulp, e.g. 1.3e-6 on weight gradients of magnitude 9)."""
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
            ulp = torch.finfo(torch.float32).eps * float(want.abs().max()) if want.numel() else 0
            err, budget = _err(got, want), 2 * _err(single, want) + 1e-6 + 2 * ulp
            assert err <= budget, f"{what}: error {err:.3e} over budget {budget:.3e}"

    v_loc = V // WORLD

    def check_grads(name, got, want, single):
        for r in range(WORLD):
            sl = slice(r * v_loc, (r + 1) * v_loc)
            close(got[r][0], want[0], single[0], f"{name} grad hidden rank {r}")
            close(got[r][1], want[1][sl], single[1][sl], f"{name} grad weight shard {r}")
            close(got[r][2], want[2][sl], single[2][sl], f"{name} grad bias shard {r}")

    res = [ranks[r][backend] for r in range(WORLD)]
    for suffix in TRANSFORMS:
        lp = "logprobs" + suffix
        want, single = truth[lp], plain[lp]
        for r in range(WORLD):
            assert res[r][lp][0].dtype == plain[lp][0].dtype
            close(res[r][lp][0], want[0], single[0], f"{lp} logp rank {r}")
            close(res[r][lp][1], want[1], single[1], f"{lp} entropy rank {r}")
        assert float(want[2].abs().max()) > 0
        check_grads(lp, [x[lp][2:] for x in res], want[2:], single[2:])
        if suffix:  # the transform is active: not the plain head's numbers
            assert float((want[0] - truth["logprobs"][0]).abs().max()) > 1e-2
        for i in range(len(POLICY_OPTIONS)):
            name = f"policy{i}{suffix}"
            if name not in truth:
                continue
            want, single = truth[name], plain[name]
            for r in range(WORLD):
                got = res[r][name]
                close(got[0], want[0], single[0], f"{name} loss rank {r}")
                assert set(got[4]) == set(want[4])
                for k in want[4]:
                    close(got[4][k], want[4][k], single[4][k], f"{name} metric {k} rank {r}")
            grads = [x[name][1:4] for x in res]
            check_grads(name, grads, want[1:4], single[1:4])
        for r in range(WORLD):
            close(res[r]["js" + suffix], truth["js" + suffix], plain["js" + suffix],
                  f"js{suffix} rank {r}")  # fmt: skip
        assert float(truth["js" + suffix].min()) > 0


def test_vocab_parallel_needs_an_initialized_group():
    x = _inputs(torch.float64)
    with pytest.raises(ValueError, match="process_group"):
        mk.linear_logprobs(x["h"], x["w"], x["lab"], process_group=object())


def _same_numbers(got, want, rtol, atol, what):
    """NaN exactly where want has NaN, infinities equal, the rest close (atol relative to
    the largest finite |want|: gradients at |h| ~ 1e36 are of that size)."""
    got, want = got.double(), want.double()
    assert torch.equal(got.isnan(), want.isnan()), f"{what}: NaN at {got}, want {want}"
    fin = want.isfinite()
    assert torch.equal(got[~fin & ~want.isnan()], want[~fin & ~want.isnan()]), what
    scale = float(want[fin].abs().max()) if bool(fin.any()) else 0.0
    torch.testing.assert_close(got[fin], want[fin], rtol=rtol, atol=atol * max(1.0, scale),
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", EXTREME)
def test_vocab_parallel_follows_the_plain_rules_on_extreme_inputs(sharded, backend, case):
    """Non-finite logits and log-normalizers past the float range, over 2 ranks: NaN where
    the plain call has NaN (never a JS of 0), 0 / -inf log-probs where it has them, a shard
    whose logits are all -inf has no mass; values and gradients equal the plain call's."""
    dtype, ranks = sharded
    plain = _run_extreme(_extreme_inputs(case, dtype), backend)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-5)
    v_loc = V // WORLD
    for r in range(WORLD):
        got = ranks[r][backend][case]
        for k in ("logp", "ent", "gh", "loss", "kl", "ratio", "js"):
            _same_numbers(got[k], plain[k], what=f"{case} {k} rank {r}", **tol)
        sl = slice(r * v_loc, (r + 1) * v_loc)
        _same_numbers(got["gw"], plain["gw"][sl], what=f"{case} grad weight rank {r}", **tol)
        _same_numbers(got["gb"], plain["gb"][sl], what=f"{case} grad bias rank {r}", **tol)


@pytest.fixture
def world_of_one():
    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp}/store")
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
def test_vocab_parallel_world_of_one_equals_plain_call(world_of_one, backend):
    """A group of one rank is the plain call: NaN / +inf rows give JS NaN (not 0), and
    past float32's range the log-probs are the plain call's 0 / -inf (not NaN)."""
    for case in EXTREME:
        if case == "shard_all_ninf":
            continue  # one shard holds the whole vocabulary: every row undefined, both ways
        x = _extreme_inputs(case, torch.float32)
        got, want = _run_extreme(x, backend, 0, world_of_one, 1), _run_extreme(x, backend)
        for k in ("logp", "ent", "gh", "gw", "gb", "loss", "kl", "ratio", "js"):
            _same_numbers(got[k], want[k], rtol=1e-5, atol=1e-6, what=f"{case} {k}")
    x = _extreme_inputs("past_range", torch.float32)
    assert bool((x["h"].abs() @ x["w"].abs().t() / x["temp"] > torch.finfo().max).any())
