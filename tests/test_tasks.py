"""The built-in tasks: gold references score 1 everywhere, splits, determinism, shapes."""

import re

import pytest

from mrtpo.data import instructions
from mrtpo.tasks import TASKS, load_task
from mrtpo.verifiers import Task
from mrtpo.verifiers.constraints import KINDS, describe

NAMES = [
    "constraints",
    "constraints-full",
    "constraints:title,no_commas,word_count",
    "sql",
    "tools",
]


@pytest.fixture(scope="module", params=NAMES)
def task(request):
    return load_task(request.param, seed=0)


def test_tasks_tuple():
    assert TASKS == ("constraints", "sql", "tools")


def test_task_shape(task):
    assert isinstance(task, Task)
    assert len(task.train) >= 100 and len(task.eval) >= 20
    assert len(set(task.reward_names)) == len(task.verifiers) >= 2
    train = {e.prompt for e in task.train}
    assert len(train) == len(task.train)
    assert train.isdisjoint(e.prompt for e in task.eval)
    assert len({e.id for e in task.train + task.eval}) == len(task.train) + len(task.eval)


def test_every_reference_scores_one_on_every_verifier(task):
    for ex in task.train + task.eval:
        assert ex.reference
        for v in task.verifiers:
            verdict = v(ex, ex.reference)
            assert verdict.score == 1.0, (task.name, v.name, ex.prompt, ex.reference, verdict)
            for s, e in verdict.spans:
                assert 0 <= s < e <= len(ex.prompt)


@pytest.mark.parametrize("name", NAMES)
def test_deterministic_for_a_seed(name):
    a, b, c = load_task(name, seed=3), load_task(name, seed=3), load_task(name, seed=4)

    def key(t):
        return [(e.id, e.prompt, e.reference) for e in t.train + t.eval]

    assert key(a) == key(b)
    assert key(a) != key(c)


def test_default_constraints_task_has_fixed_rewards():
    task = load_task("constraints")
    assert task.reward_names == list(instructions.DEFAULT_KINDS)
    for ex in task.train + task.eval:
        entries = ex.fields["constraints"]
        assert [c["kind"] for c in entries] == list(instructions.DEFAULT_KINDS)
        for v, entry in zip(task.verifiers, entries):
            ((s, e),) = v(ex, ex.reference).spans
            assert ex.prompt[s:e] == describe(entry["kind"], entry["params"])
            assert v.relevant_chars(ex, ex.reference), (v.name, ex.reference)
    params = [tuple(c["params"]["phrase" if "phrase" in c["params"] else "word"] for c in
                    ex.fields["constraints"]) for ex in task.train]  # fmt: skip
    assert len(set(params)) > 50  # parameters vary


def test_constraints_are_short_and_small_vocabulary():
    words = set()
    for name in ("constraints", "constraints-full"):
        task = load_task(name)
        for ex in task.train + task.eval:
            n = len(re.findall(r"\w+", ex.reference))
            assert n <= 45, ex.reference
            assert len(ex.prompt) < 400
            words.update(re.findall(r"[a-z]+", (ex.prompt + " " + ex.reference).lower()))
    assert len(words) < 400


def test_full_task_covers_every_kind_and_2_to_4_constraints():
    task = load_task("constraints-full")
    seen = set()
    for ex in task.train + task.eval:
        kinds = [c["kind"] for c in ex.fields["constraints"]]
        assert 2 <= len(kinds) <= 4
        seen.update(kinds)
    assert seen == set(KINDS)


def test_sql_and_tools_fields():
    sql = load_task("sql")
    ex = sql.train[0]
    s, e = ex.fields["question_span"]
    assert ex.prompt[s:e].endswith(("?", "."))
    for table, (s, e) in ex.fields["schema_spans"].items():
        assert ex.prompt[s:e].startswith(f"{table}(")
    tools = load_task("tools")
    ex = tools.train[0]
    assert ex.fields["gold"]["name"] in ex.fields["tools"]
    for name, (s, e) in ex.fields["signature_spans"].items():
        assert ex.prompt[s:e].startswith(f"{name}(")


@pytest.mark.parametrize(
    "name", ["nope", "constraints:", "constraints:nope", "constraints:lowercase,uppercase"]
)
def test_bad_names(name):
    with pytest.raises(ValueError):
        load_task(name)


def test_bad_seed():
    with pytest.raises(ValueError, match="seed"):
        load_task("tools", seed="1")
