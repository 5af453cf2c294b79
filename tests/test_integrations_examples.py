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
    # every pair replayed: the tiny model's rewards rarely vary within a group, and the
    # default skips the pairs whose advantage is 0
    logs = ex.main(["--steps", "2", "--out", str(tmp_path), "--replay-all"])
    assert [h["step"] for h in logs] == [1, 2]
    assert all(math.isfinite(h["loss"]) for h in logs)
    for h in logs:
        assert h["mrtpo/replay/skipped"] == 0 and h["mrtpo/replay/pairs"] > 0
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


@pytest.mark.slow
@pytest.mark.parametrize("task", [None, "constraints"], ids=["own-verifiers", "builtin-task"])
def test_trl_example_runs_under_torchrun_two_processes(tmp_path, task):
    """The launch docs/trl.md documents for several processes on the CPU: ``torchrun
    --nproc_per_node 2`` (gloo); the example's own verifiers and a built-in task's."""
    import os
    import subprocess
    import sys

    root = EXAMPLE.parents[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
           "2", str(EXAMPLE), "--steps", "2", "--max-completion", "12", "--out",
           str(tmp_path), "--replay-all"] + ([] if task is None else ["--task", task])  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    try:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"two-process example hung: {str(err.stdout)[-2000:]}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "processes: 2 (MULTI_CPU, backend gloo)" in lines, out.stdout[-2000:]
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [s.split(":")[0] for s in steps] == ["step 1", "step 2"]  # printed once (rank 0)
    assert all("relevance" in s and "nan" not in s for s in steps)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--warm-steps", "3"], "needs a built-in --model"),  # no model, no task
        (["--warm-steps", "3", "--task", "constraints"], "needs a built-in --model"),
        (["--warm-steps", "3", "--model", "smollm2-135m-instruct"], "and a --task"),
        (["--warm-steps", "-1"], "expected an int >= 0"),
        (["--warm-noise", "1.5"], "--warm-noise: expected a probability"),
    ],
)
def test_trl_example_refuses_a_warm_start_it_cannot_do(argv, says, capsys):
    """--warm-steps warm-starts a built-in model on a task's references; anything else is a
    usage error naming the flag, before any model is built."""
    with pytest.raises(SystemExit) as exc:
        _load().main(argv)
    assert exc.value.code == 2
    assert says in capsys.readouterr().err
