"""examples/trl_grpo_mrtpo.py runs as written (tiny built-in model, 2 steps, CPU)."""

import importlib.util
import math
from pathlib import Path

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "trl_grpo_mrtpo.py"


def _load():
    spec = importlib.util.spec_from_file_location("trl_grpo_mrtpo", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trl_example_runs_with_replayed_relevance(tmp_path, capsys):
    """No hand-written replay: the trainer replays the span function's and the span-returning
    reward's spans; the span-less reward stays uniform."""
    ex = _load()
    seen = []
    show = ex.show_top_tokens

    def recording(trainer, tok, **kw):
        seen.append(trainer.last_replay)
        return show(trainer, tok, **kw)

    ex.show_top_tokens = recording
    logs = ex.main(["--steps", "2", "--out", str(tmp_path)])
    assert [h["step"] for h in logs] == [1, 2]
    assert all(math.isfinite(h["loss"]) for h in logs)
    for h in logs:
        assert h["mrtpo/replay_seconds"] > 0
        assert h["mrtpo/relevance/says_word"] > 0 and h["mrtpo/relevance/ends_with"] > 0
        assert "mrtpo/relevance/short" not in h
    (last,) = seen
    rep = last["replay"]
    mask = rep.response_mask
    k, b, t = rep.relevance.shape
    assert (k, b, t) == (3, *mask.shape)
    assert (rep.relevance[:, ~mask] == 0).all() and (rep.relevance[2] == 0).all()
    assert rep.has_info[:, :2].all() and not rep.has_info[:, 2].any()
    assert bool((rep.relevance[:2][:, mask] > 0).any())
    out = capsys.readouterr().out
    assert "says_word: names ['" in out and "short: no span (uniform)" in out
