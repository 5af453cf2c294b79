"""The built-in JSON Schema subset validator agrees with jsonschema (where installed) on
the tool definitions, the shared fence finder keeps ``` inside JSON strings, and the
verifiers and the test suite import without jsonschema."""

import json
import os
import random
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mrtpo.tasks.builtin import load_task
from mrtpo.tasks.data import tool_defs
from mrtpo.verifiers.base import find_fence
from mrtpo.verifiers.tools import parse_call, validate_subset

ROOT = Path(__file__).resolve().parents[1]

_STRINGS = ["", "a", "Paris", "EUR", "eur", "US", "USDX", "07:30", "7:30", "29:99", "x" * 61,
            "celsius", "high", "fr", "de", "\u00e9t\u00e9", "12", "\U0001f600" * 3]  # fmt: skip
_NUMBERS = [0, 1, -1, 7, 23, 24, 59, 60, 180, 181, 0.0, 7.0, 7.5, -0.5, 1e9, 10, 11, 20, 21]


def _value(rng):
    r = rng.random()
    if r < 0.4:
        return rng.choice(_STRINGS)
    if r < 0.8:
        return rng.choice(_NUMBERS)
    return rng.choice([True, False, None, [], {}, [1], {"a": 1}])


def _arguments(rng, params, gold):
    """A gold call's arguments, often with one value replaced, removed or added."""
    args = dict(gold)
    r = rng.random()
    if r < 0.5:
        args[rng.choice(list(params["properties"]))] = _value(rng)
    elif r < 0.6 and args:
        del args[rng.choice(list(args))]
    elif r < 0.7:
        args[rng.choice(["extra", "x"])] = _value(rng)
    return args


def test_subset_validator_agrees_with_jsonschema():
    jsonschema = pytest.importorskip("jsonschema")
    rng = random.Random(3)
    golds = [ex.fields["gold"] for ex in load_task("tools", seed=0).train]
    seen = {True: 0, False: 0}
    for _ in range(3000):
        gold = rng.choice(golds)
        params = tool_defs.TOOLS[gold["name"]]["parameters"]
        args = _arguments(rng, params, gold["arguments"])
        want = jsonschema.Draft202012Validator(params).is_valid(args)
        got = validate_subset(params, args)
        assert (got is None) == want, (gold, args, got)
        seen[want] += 1
    assert min(seen.values()) > 200, seen  # both outcomes exercised


def test_subset_validator_refuses_unknown_keywords_and_names_the_path():
    with pytest.raises(ValueError, match="oneOf"):
        validate_subset({"type": "object", "oneOf": []}, {})
    with pytest.raises(ValueError, match="properties/a"):
        validate_subset({"properties": {"a": {"format": "date"}}}, {})
    s = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0}}}
    assert validate_subset(s, {"a": 3}) is None
    assert validate_subset(s, {"a": True}).startswith("a:")  # a bool is not an integer
    assert validate_subset(s, {"a": -1}).startswith("a:")


def test_fence_does_not_stop_at_backticks_inside_a_json_string():
    call = {"name": "create_note", "arguments": {"text": "use ``` to fence code"}}
    resp = "Here:\n```json\n" + json.dumps(call) + "\n```\nDone."
    assert parse_call(resp) == ("create_note", call["arguments"])
    assert parse_call("```json " + json.dumps(call) + "```") == ("create_note", call["arguments"])
    f = find_fence('```json\n{"a": "```"}\n```')
    assert f.lang == "json" and f.body == '{"a": "```"}\n' and f.closed


def test_fence_finder_is_linear():
    import time

    t0 = time.perf_counter()
    for text in ("`" * 200_000, "```\n" + "``` x" * 50_000, "```" + "\n" * 100_000):
        find_fence(text)
    assert time.perf_counter() - t0 < 1.0


_BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = {"jsonschema", "trl", "liger_kernel", "cut_cross_entropy"}
    class Refuse(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
            return None
    sys.meta_path.insert(0, Refuse())
    """
)


def _run_blocked(code, timeout=120):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(
        [sys.executable, "-c", _BLOCKER + textwrap.dedent(code)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_tasks_and_tool_rewards_work_without_jsonschema():
    out = _run_blocked(
        """
        try:
            import jsonschema
            raise SystemExit("the blocker did not block jsonschema")
        except ModuleNotFoundError:
            pass
        import mrtpo.tasks.builtin
        from mrtpo.tasks.builtin import load_task
        from mrtpo.verifiers.tools import tool_verifiers
        task = load_task("tools", seed=0)
        for ex in task.train[:30]:
            assert [v(ex, ex.reference).score for v in tool_verifiers()] == [1.0] * 4
        ex = next(e for e in task.train if e.fields["gold"]["name"] == "set_alarm")
        bad = '{"name": "set_alarm", "arguments": {"hour": 24, "minute": 0}}'
        v = tool_verifiers()[2](ex, bad)
        assert v.score == 0.0 and "hour" in v.reason, v
        print("ok")
        """
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# The test modules that import the task code, and those with GPU tests (bench/gpu_check.sh
# runs `pytest -m gpu` on an image without jsonschema or trl): every module with a gpu mark
# and every module the script names, found from the files so a new one cannot be missed.
_TASK_MODULES = [
    "tests/test_tasks.py",
    "tests/test_verifiers_tools.py",
    "tests/test_verifiers_sql.py",
    "tests/test_verifiers_constraints.py",
]


# a gpu mark as a decorator, a module mark, a helper that applies it (pytest.mark.gpu(fn)),
# or a helper imported from a module that defines one (@gpu_test)
_GPU_MARK = re.compile(
    r"^\s*(@pytest\.mark\.gpu\b|@gpu_test\b|pytestmark\s*=.*\bgpu\b|.*pytest\.mark\.gpu\()", re.M
)


def _gpu_marked_modules() -> set[str]:
    return {
        str(path.relative_to(ROOT))
        for path in (ROOT / "tests").rglob("test_*.py")
        if path != Path(__file__).resolve() and _GPU_MARK.search(path.read_text())
    }


def _gpu_check_modules() -> set[str]:
    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    line = next(x for x in script.splitlines() if x.startswith("GPU_TESTS="))
    return set(line.split("=", 1)[1].strip().strip('"').split())


def test_gpu_check_runs_every_module_with_gpu_tests():
    marked = _gpu_marked_modules()
    assert {"tests/test_cuda_build.py", "tests/test_logprobs.py"} <= marked
    assert marked <= _gpu_check_modules(), marked - _gpu_check_modules()


def test_test_modules_collect_without_jsonschema_or_trl():
    names = set(_TASK_MODULES) | _gpu_marked_modules() | _gpu_check_modules()
    files = sorted(f for f in names if (ROOT / f).exists())
    assert len(files) >= 8, files
    out = _run_blocked(
        f"""
        import pytest
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "",
                          *{files!r}])
        raise SystemExit(int(rc))
        """,
        timeout=300,
    )
    tail = (out.stdout + out.stderr)[-3000:]
    assert out.returncode == 0 and "collected" in out.stdout, tail
