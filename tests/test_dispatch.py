"""Backend dispatch: auto choice, explicit choice, fallback with one warning, strict mode."""

from __future__ import annotations

import warnings

import pytest
import torch

import mrtpo_kernels as mk
from mrtpo_kernels import _dispatch, backends


def test_auto_on_cpu_prefers_the_extension():
    expected = "cpu" if backends.load("cpu") is not None else "torch"
    assert _dispatch.resolve("linear_logprobs_fwd", torch.device("cpu")) == expected


def test_env_override(monkeypatch):
    monkeypatch.setenv("MRTPO_BACKEND", "torch")
    assert _dispatch.resolve("linear_js", torch.device("cpu")) == "torch"
    monkeypatch.setenv("MRTPO_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="backend"):
        _dispatch.resolve("linear_js", torch.device("cpu"))


def test_missing_op_falls_back_with_one_warning(monkeypatch):
    monkeypatch.delenv("MRTPO_STRICT_BACKEND", raising=False)
    cpu = backends.load("cpu")
    if cpu is None:
        pytest.skip("the C++ extension is not built")
    monkeypatch.delattr(cpu, "logits_js")  # a backend without one op
    _dispatch._warned.discard(("cpu", "logits_js"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        a = _dispatch.resolve("logits_js", torch.device("cpu"), "cpu")
        b = _dispatch.resolve("logits_js", torch.device("cpu"), "cpu")
    assert a == b == "torch"
    assert sum("cannot run logits_js" in str(w.message) for w in caught) == 1
    monkeypatch.setenv("MRTPO_STRICT_BACKEND", "1")
    with pytest.raises(RuntimeError, match="MRTPO_STRICT_BACKEND"):
        _dispatch.resolve("logits_js", torch.device("cpu"), "cpu")


def test_backends_agree():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(9, 8, generator=g), torch.randn(300, 8, generator=g)
    y = torch.randint(0, 300, (9,), generator=g)
    outs = {}
    for name in ("cpu", "torch"):
        if backends.load(name) is not None:
            outs[name] = mk.linear_logprobs(h, w, y, return_entropy=True, backend=name)
    ref = outs["torch"]
    for name, out in outs.items():
        assert torch.allclose(out[0], ref[0], atol=1e-5), name
        assert torch.allclose(out[1], ref[1], atol=1e-5), name


def test_compile_fullgraph_traces_the_public_api():
    # The ops are torch.library custom ops with fake kernels and the backend choice is a
    # trace-time constant: dynamo traces a caller of the public API without graph breaks
    # (eager backend: no C++ compiler needed for this check).
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(6, 4, generator=g), torch.randn(50, 4, generator=g)
    y = torch.randint(0, 50, (6,), generator=g)

    def step(h, w):
        lp, ent = mk.linear_logprobs(h, w, y, return_entropy=True)
        d = mk.linear_js_distance(h, (h + 0.1)[None], w)
        loss, _ = mk.linear_policy_loss(h, w, y, lp.detach(), torch.ones(6))
        return lp.sum() + ent.sum() + d.sum() + loss

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    assert torch.allclose(compiled(h, w), step(h, w))


def test_missing_extension_warns_once_then_runs_on_torch(monkeypatch):
    monkeypatch.delenv("MRTPO_STRICT_BACKEND", raising=False)
    monkeypatch.setitem(backends._errors, "cpu", "ImportError: pretend the build failed")
    monkeypatch.delitem(backends._loaded, "cpu", raising=False)
    _dispatch._warned.discard(("cpu", "any op"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = {
            _dispatch.resolve(op, torch.device("cpu"))
            for op in ("linear_js", "linear_logprobs_fwd")
        }
    assert names == {"torch"}
    assert sum("pretend the build failed" in str(w.message) for w in caught) == 1
