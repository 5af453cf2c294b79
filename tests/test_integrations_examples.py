"""examples/trl_grpo_mrtpo.py runs as written (tiny built-in model, 2 steps, CPU)."""

import importlib.util
import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo_mrtpo.py"


def _load():
    spec = importlib.util.spec_from_file_location("trl_grpo_mrtpo", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trl_example_runs_with_replayed_relevance(tmp_path):
    ex = _load()
    seen = []
    make = ex.make_relevance_fn

    def recording(tok, temperature):
        fn = make(tok, temperature)

        def wrapped(trainer, inputs, output):
            rel, info = fn(trainer, inputs, output)
            seen.append((rel.detach().clone(), info.clone(), output["completion_mask"].clone()))
            return rel, info

        return wrapped

    ex.make_relevance_fn = recording
    logs = ex.main(["--steps", "2", "--out", str(tmp_path)])
    assert [h["step"] for h in logs] == [1, 2]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert seen
    for rel, info, mask in seen:
        k, b, t = rel.shape
        assert (k, b, t) == (2, *mask.shape)
        assert (rel[:, mask == 0] == 0).all() and (rel[1] == 0).all()  # reward 1: no span
        assert info[:, 0].all() and not info[:, 1].any()
    assert any(bool((rel[0][mask.bool()] > 0).any()) for rel, _, mask in seen)
    assert torch.cat([m.sum(1) for _, _, m in seen]).max() > 0
