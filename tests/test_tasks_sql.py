"""The ``sql-real`` task: its databases are built offline and deterministically, every gold
query runs and its reference passes all three rewards, each reward's spans point at the
prompt text it checks, the rewards fail apart on answers wrong in one way, and the
held-out questions share neither their text nor their gold query with training."""

from __future__ import annotations

import os
import sqlite3

import pytest

from mrtpo.tasks.builtin import WARM_STEPS, default_warm_steps, load_task
from mrtpo.tasks.data import sql_real
from mrtpo.training.config import check_task
from mrtpo.verifiers import Example
from mrtpo.verifiers.base import check_fields
from mrtpo.verifiers.sql import (
    ExecutionMatch,
    NamedColumns,
    OutputForm,
    sql_real_verifiers,
    statement_count_error,
)
from mrtpo.verifiers.sql_sandbox import run_readonly


@pytest.fixture(scope="module")
def task():
    return load_task("sql-real", seed=0)


def _dump(path: str) -> list:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def test_databases_are_built_offline_and_deterministically(tmp_path):
    for db in sql_real.DATABASES:
        assert sql_real.rows(db) == sql_real.rows(db)
        a = sql_real.db_path(db, tmp_path / "a")
        b = sql_real.db_path(db, tmp_path / "b")
        assert os.path.basename(a) == os.path.basename(b)  # the name carries the digest
        assert _dump(a) == _dump(b)
        assert sql_real.db_path(db, tmp_path / "a") == a  # built once, then reused
        assert not os.access(a, os.W_OK) or os.geteuid() == 0  # made read-only
        tables = {t for (t,) in run_readonly(a, "SELECT name FROM sqlite_master", max_rows=99)}
        assert tables == set(sql_real.SCHEMAS[db])
        for table, rows in sql_real.rows(db).items():
            assert run_readonly(a, f"SELECT COUNT(*) FROM {table}") == [(len(rows),)]
    with pytest.raises(ValueError, match="db"):
        sql_real.db_path("nope", tmp_path)


def test_values_a_question_names_are_unique():
    lib, school, company = (sql_real.rows(db) for db in sql_real.DATABASES)
    for rows, col in ((lib["authors"], 1), (lib["books"], 1), (lib["members"], 1),
                      (lib["books"], 4), (school["students"], 1), (school["courses"], 1),
                      (company["employees"], 1), (company["employees"], 3),
                      (company["projects"], 1), (company["departments"], 1)):  # fmt: skip
        values = [r[col] for r in rows]
        assert len(set(values)) == len(values)


def test_task_shape_and_registration(task):
    assert check_task("sql-real") is None
    assert default_warm_steps("sql-real") == WARM_STEPS["sql-real"]
    assert [v.name for v in task.verifiers] == ["sql_match", "sql_columns", "sql_form"]
    assert len(task.train) >= 400 and len(task.eval) >= 100
    assert {e.fields["db"] for e in task.eval} == set(sql_real.DATABASES)
    assert {e.fields["db"] for e in task.eval[:32]} == set(sql_real.DATABASES)
    ids = [e.id for e in task.train + task.eval]
    assert len(set(ids)) == len(ids)
    for v in task.verifiers:  # every field a reward reads is there, in its form
        assert v.fields_needed
        for ex in task.train + task.eval:
            check_fields(v, ex.fields)


def test_deterministic_for_a_seed():
    def key(t):
        return [(e.id, e.prompt, e.reference) for e in t.train + t.eval]

    a, b, c = (load_task("sql-real", seed=s) for s in (3, 3, 4))
    assert key(a) == key(b)
    assert key(a) != key(c)
    assert sorted(key(a)) == sorted(key(c))  # the same examples, split another way


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5])
def test_held_out_questions_and_gold_queries_are_disjoint_from_training(seed):
    t = load_task("sql-real", seed=seed)

    def questions(exs):
        return [" ".join(e.fields["question"].lower().split()) for e in exs]

    def golds(exs):
        return [sql_real.normalize_query(e.fields["gold"]) for e in exs]

    for key in (questions, golds, lambda exs: [e.prompt for e in exs]):
        train, held = key(t.train), key(t.eval)
        assert len(set(train)) == len(train) and len(set(held)) == len(held)
        assert set(train).isdisjoint(held)


def test_every_gold_query_runs_and_its_reference_passes_every_reward(task):
    for ex in task.train + task.eval:
        rows = run_readonly(ex.fields["db_path"], ex.fields["gold"], max_rows=1000)
        assert not sql_real._uninformative(rows), ex.fields["question"]
        assert ex.reference == f"```sql\n{ex.fields['gold']}\n```"
        for v in task.verifiers:
            verdict = v(ex, ex.reference)
            assert verdict.score == 1.0, (v.name, ex.prompt, verdict)


def test_spans_point_at_the_prompt_text_each_reward_checks(task):
    match, columns, form = task.verifiers
    for ex in task.train[:60] + task.eval:
        p, f = ex.prompt, ex.fields
        s, e = f["form_span"]
        assert p[s:e] == sql_real.FORM_INSTRUCTION
        s, e = f["question_span"]
        assert p[s:e] == f["question"] and p[:s].endswith("Question: ")
        lines = {}
        for table, (s, e) in f["schema_spans"].items():
            cols = ", ".join(sql_real.table_columns(f["db"])[table])
            assert p[s:e] == f"{table}({cols})"
            lines[table] = (s, e)
        assert set(lines) == set(sql_real.SCHEMAS[f["db"]])
        ref = ex.reference
        assert form(ex, ref).spans == (tuple(f["form_span"]),)
        assert set(columns(ex, ref).spans) == {lines[t] for t in f["uses"]}
        want = {lines[t] for t in f["gold_tables"]} | {tuple(f["question_span"])}
        assert set(match(ex, ref).spans) == want
        # every column the question names is one the gold query reads, and shown
        for table, cols in f["uses"].items():
            assert set(cols) <= set(f["schema"][table])


def _example(task, question):
    return next(e for e in task.train + task.eval if e.fields["question"] == question)


def _scores(ex, response):
    return {v.name: v(ex, response).score for v in sql_real_verifiers()}


def test_rewards_fail_apart(task):
    ex = _example(task, "How many books did Lena Fischer write?")
    gold = ex.fields["gold"]
    assert _scores(ex, f"```sql\n{gold}\n```") == {"sql_match": 1, "sql_columns": 1, "sql_form": 1}
    # the right query, wrong form: no block, text around it, another language, no closing
    for bad in (gold, f"Here it is:\n```sql\n{gold}\n```", f"```sql\n{gold}\n```\nDone.",
                f"```\n{gold}\n```", f"```sql\n{gold}\n"):  # fmt: skip
        assert _scores(ex, bad) == {"sql_match": 1, "sql_columns": 1, "sql_form": 0}, bad
    # the named columns read, a wrong value: only the result differs
    db = ex.fields["db_path"]
    wrong = next(
        w
        for w in (gold.replace("Lena Fischer", a) for a in sql_real.AUTHORS[1:])
        if run_readonly(db, w) != run_readonly(db, gold)
    )
    assert _scores(ex, f"```sql\n{wrong}\n```") == {"sql_match": 0, "sql_columns": 1, "sql_form": 1}
    # the right count without reading the author's name (author_id = 1 is Lena Fischer)
    shortcut = "SELECT COUNT(*) FROM books WHERE author_id = 1"
    assert run_readonly(db, shortcut) == run_readonly(db, gold)
    got = _scores(ex, f"```sql\n{shortcut}\n```")
    assert got == {"sql_match": 1, "sql_columns": 0, "sql_form": 1}
    assert "authors" in NamedColumns()(ex, shortcut).reason
    # a query that does not compile fails both that run it, not the form
    assert _scores(ex, "```sql\nSELECT nope FROM books\n```") == {
        "sql_match": 0, "sql_columns": 0, "sql_form": 1
    }  # fmt: skip
    assert _scores(ex, "no idea") == {"sql_match": 0, "sql_columns": 0, "sql_form": 0}


def test_named_columns_needs_every_column_the_question_names(task):
    ex = _example(task, "List the titles of the mystery books from the oldest to the newest.")
    v = NamedColumns()
    assert v(ex, "SELECT title FROM books WHERE genre = 'mystery' ORDER BY year").score == 1
    out = v(ex, "SELECT title FROM books WHERE genre = 'mystery'")
    assert out.score == 0 and "books.year" in out.reason
    # ordered gold: the order is part of the result
    assert ExecutionMatch()(ex, "SELECT title FROM books WHERE genre = 'mystery'").score == 0


@pytest.mark.parametrize(
    "body, ok",
    [
        ("SELECT 1", True),
        ("select name from t;", True),
        ("SELECT 1;  -- done", True),
        ("SELECT 'a;b' FROM t", True),
        ('SELECT "x;y" FROM t /* ; */', True),
        ("SELECT 1; SELECT 2", False),
        ("SELECT 1;; DROP TABLE t", False),
        ("SELECT 'unclosed", False),
    ],
)
def test_statement_count(body, ok):
    assert (statement_count_error(body) is None) is ok


def test_output_form_rules_and_relevant_chars(task):
    ex = task.train[0]
    form = OutputForm()
    for response, ok in (
        ("```sql\nSELECT 1\n```", True),
        ("  ```SQL\nselect 1;\n```\n", True),
        ("```sql SELECT 1```", True),
        ("```sql\nWITH x AS (SELECT 1) SELECT * FROM x\n```", False),
        ("```sql\nSELECT 1; SELECT 2\n```", False),
        ("```sql\n\n```", False),
        ("", False),
    ):
        assert form(ex, response).score == float(ok), response
    text = "```sql\nSELECT name FROM t\n```"
    chars = form.relevant_chars(ex, text)
    assert (0, 7) in chars and (text.index("SELECT"), text.index("SELECT") + 6) in chars
    assert all(text[s:e] != "name" for s, e in chars)
    assert form.relevant_chars(ex, "plain") == [(0, 5)]
    bad = Example("x", "p", {})
    assert form(bad, "```sql\nSELECT 1\n```").score == 0.0  # no form_span: a verdict, no raise


def test_named_columns_relevant_chars(task):
    ex = _example(task, "How many books did Lena Fischer write?")
    text = ex.reference
    names = {text[s:e] for s, e in NamedColumns().relevant_chars(ex, text)}
    assert names == {"books", "authors", "name"}
