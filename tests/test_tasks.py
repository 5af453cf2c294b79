"""The built-in tasks: gold references score 1 everywhere, splits, determinism, shapes."""

import importlib.util
import json
import random
import re

import pytest

from mrtpo.tasks.builtin import FULL_CONSTRAINTS, TASKS, WARM_STEPS, default_warm_steps, load_task
from mrtpo.tasks.data import instructions
from mrtpo.training.config import TASKS as CONFIG_TASKS
from mrtpo.training.config import TinyConfig
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


def test_full_task_covers_every_kind_with_one_reward_per_constraint():
    task = load_task("constraints-full")
    assert [v.name for v in task.verifiers] == [
        f"constraint_{i + 1}" for i in range(FULL_CONSTRAINTS)
    ]
    seen, orders = set(), set()
    for ex in task.train + task.eval:
        kinds = [c["kind"] for c in ex.fields["constraints"]]
        assert len(kinds) == FULL_CONSTRAINTS  # every slot is live: no absent slot scores 1
        seen.update(kinds)
        orders.add(tuple(kinds))
    assert seen == set(KINDS)
    assert len(orders) > 100


def test_make_examples_draws_the_asked_number_of_kinds():
    rng = random.Random(0)
    exs = instructions.make_examples(rng, 30, kinds=None, n_kinds=(2, 4))
    assert {len(ex.fields["constraints"]) for ex in exs} == {2, 3, 4}
    with pytest.raises(ValueError, match="n_kinds"):
        instructions.make_examples(rng, 1, kinds=None, n_kinds=(3, 2))


def test_warm_steps_default_per_task():
    for name in ("constraints", "constraints-full", "sql", "tools"):
        assert default_warm_steps(name) == WARM_STEPS[name] > 0
    assert default_warm_steps("constraints:keyword_include") == WARM_STEPS["constraints"]
    assert TinyConfig().for_task("sql").warm_steps == WARM_STEPS["sql"]
    assert TinyConfig(warm_steps=7).for_task("sql").warm_steps == 7
    # the cache key follows the resolved steps: a task default and the same explicit value agree
    assert TinyConfig().for_task("tools").key() == TinyConfig(warm_steps=WARM_STEPS["tools"]).key()
    with pytest.raises(ValueError, match="warm_steps"):
        TinyConfig().key()
    with pytest.raises(ValueError, match="task"):
        default_warm_steps("nope")


@pytest.mark.parametrize("name", ["constraints", "constraints-full"])
def test_noisy_reference_fails_exactly_the_drawn_constraints(name):
    from mrtpo.verifiers.constraints import CONSTRAINTS

    t = load_task(name, seed=0)
    rng = random.Random(3)
    failed = {k: [0, 0] for k in instructions.NOISY_KINDS}
    stuck = [0, 0]
    for ex in t.train:
        entries = ex.fields["constraints"]
        assert instructions.noisy_reference(rng, ex, 0.0) == ex.reference
        text = instructions.noisy_reference(rng, ex, 0.5)
        for e in entries:
            ok = CONSTRAINTS[e["kind"]].check(text, e["params"]) is None
            if e["kind"] in failed:
                failed[e["kind"]][0] += not ok
                failed[e["kind"]][1] += 1
            else:
                assert ok, (e["kind"], text)  # kinds that cannot be swapped stay satisfied
        if any(e["kind"] in failed for e in entries):
            always = instructions.noisy_reference(rng, ex, 1.0)
            for e in entries:
                ok = CONSTRAINTS[e["kind"]].check(always, e["params"]) is None
                if e["kind"] in failed:
                    stuck[0] += ok  # no wrong value kept the other verdicts: left right
                    stuck[1] += 1
                else:
                    assert ok, (e["kind"], always)
    assert stuck[0] <= 0.05 * stuck[1], stuck
    for kind, (bad, n) in failed.items():
        if n >= 30:  # each swappable constraint fails about half the time
            assert 0.3 < bad / n < 0.7, (kind, bad, n)
    with pytest.raises(ValueError, match="p_wrong"):
        instructions.noisy_reference(rng, t.train[0], 1.5)


def test_warm_noise_is_part_of_the_model_key_and_checked():
    from mrtpo.training.config import TrainConfig

    base = TinyConfig(warm_steps=5)
    assert TinyConfig(warm_steps=5, warm_noise=0.5).key() != base.key()
    with pytest.raises(ValueError, match="tiny.warm_noise"):
        TrainConfig(tiny=TinyConfig(warm_noise=1.5)).validate()


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


# --------------------------------------------------------------------------------------------
# Held-out prompts are held out: no held-out request, and no held-out gold answer, is trained on


def _request(ex) -> str:
    """What an example asks in words: the request or question its spans name, else the whole
    prompt (the constraint tasks: the constraints are the request)."""
    for key in ("request_span", "question_span"):
        if key in ex.fields:
            s, e = ex.fields[key]
            return ex.prompt[s:e]
    return ex.prompt


def _gold(ex) -> str:
    gold = ex.fields.get("gold", ex.reference)
    return gold if isinstance(gold, str) else json.dumps(gold, sort_keys=True)


def _needs(name) -> list[str]:
    from mrtpo.tasks.data import bfcl, ifbench

    return {
        "tools-bfcl": [bfcl.PACKAGE],
        "ifbench-real": [ifbench.PACKAGE, ifbench.CHECKERS, "nltk"],
    }.get(name, [])


# Held-out examples whose gold answer a training example also has, from another request: data,
# not the split. constraints-full composes references from a few sentences per topic, and one
# can satisfy two different prompts' constraints; BFCL has two cases whose call is
# math.factorial(5) (simple_python_1 and _97). Pinned, so that any other repeat fails.
KNOWN_SHARED_GOLD = {
    ("constraints-full", 0): {
        "constraints-full-212", "constraints-full-248", "constraints-full-283",
    },
    ("constraints-full", 1): {
        "constraints-full-177", "constraints-full-213", "constraints-full-276",
        "constraints-full-32", "constraints-full-351", "constraints-full-71",
    },
    ("constraints-full", 2): {
        "constraints-full-134", "constraints-full-18", "constraints-full-208",
        "constraints-full-225", "constraints-full-259", "constraints-full-61",
    },
    ("tools-bfcl", 0): {"tools-bfcl-simple_python_97"},
}  # fmt: skip


@pytest.mark.parametrize(
    "name", [*CONFIG_TASKS, "constraints:title,no_commas,word_count", "constraints-real:title"]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_heldout_requests_and_gold_answers_are_not_trained_on(name, seed):
    """Every built-in task: no held-out request occurs in training, and no held-out request is
    held out twice; no held-out gold answer is trained on either (but the pinned repeats
    above) in the named tasks. The tools task split by prompt held out 27-38 of 80 requests
    (with their call) that it also trained on, the same request shown beside other distractor
    tools (issue 41). A ``constraints:KIND,...`` list of the user's choosing may have few
    distinct answers (title, no_commas, word_count: prompts that differ in the word bound
    only share a reference): its requests are checked, not its references."""
    missing = [p for p in _needs(name) if importlib.util.find_spec(p) is None]
    if missing:
        pytest.skip(f"{missing[0]} (the [real] extra) is not installed")
    task = load_task(name, seed=seed)
    trained = {_request(ex) for ex in task.train}
    again = [ex.id for ex in task.eval if _request(ex) in trained]
    assert not again, f"{name} seed {seed}: held-out requests trained on: {again[:5]}"
    held = [_request(ex) for ex in task.eval]
    assert len(set(held)) == len(held), f"{name} seed {seed}: a held-out request repeats"
    if name not in CONFIG_TASKS:
        return
    golds = {_gold(ex) for ex in task.train}
    shared = {ex.id for ex in task.eval if _gold(ex) in golds}
    assert shared == KNOWN_SHARED_GOLD.get((name, seed), set()), (name, seed, sorted(shared))


def test_tools_split_keeps_whole_gold_calls_on_one_side():
    from mrtpo.tasks.builtin import EVAL_FRACTION, N_TOOL_EXAMPLES

    task = load_task("tools", seed=0)
    calls = lambda exs: {_gold(ex) for ex in exs}  # noqa: E731
    assert calls(task.train).isdisjoint(calls(task.eval))
    assert len(task.eval) == round(EVAL_FRACTION * N_TOOL_EXAMPLES)
    assert len(calls(task.eval)) == len(task.eval)  # one prompt per held-out call
    assert len(task.train) >= 200
    # both sides still cover every tool
    tools = lambda exs: {ex.fields["gold"]["name"] for ex in exs}  # noqa: E731
    assert tools(task.train) == tools(task.eval)
