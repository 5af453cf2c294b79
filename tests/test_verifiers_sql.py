"""The SQL sandbox (`run_readonly`) against hostile queries, and the three SQL rewards."""

import dataclasses
import hashlib
import logging
import sqlite3
import time

import pytest

from mrtpo.tasks.builtin import load_task
from mrtpo.tasks.data import shop
from mrtpo.verifiers.sql import (
    ExecutionMatch,
    QueryRuns,
    SchemaOnly,
    results_equal,
    sql_verifiers,
)
from mrtpo.verifiers.sql_sandbox import (
    QueryError,
    QueryRefused,
    QueryTimeout,
    QueryTooManyRows,
    referenced_columns,
    run_readonly,
)


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return shop.db_path(tmp_path_factory.mktemp("sqldata"))


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def sql_example(db):
    task = load_task("sql", seed=0)
    ex = next(e for e in task.train if e.fields["gold"].startswith("SELECT COUNT(*) FROM orders"))
    return dataclasses.replace(ex, fields={**ex.fields, "db_path": db})


def test_runs_a_plain_query_like_sqlite(db):
    got = run_readonly(
        db, "SELECT name, age FROM customers WHERE age > 40", timeout_s=1.0, max_rows=100
    )
    conn = sqlite3.connect(db)
    want = conn.execute("SELECT name, age FROM customers WHERE age > 40").fetchall()
    conn.close()
    assert got == want and len(got) > 0


@pytest.mark.parametrize(
    "query, error",
    [
        ("DROP TABLE customers", QueryRefused),
        ("INSERT INTO customers VALUES (99, 'x', 'y', 1)", QueryRefused),
        ("UPDATE customers SET age = 1", QueryRefused),
        ("DELETE FROM orders", QueryRefused),
        ("PRAGMA writable_schema = ON", QueryRefused),
        ("SELECT load_extension('libevil')", QueryRefused),
        ("SELECT 1; DROP TABLE customers", QueryRefused),
        ("SELECT 1; INSERT INTO customers VALUES (99, 'x', 'y', 1)", QueryRefused),
        ("WITH t AS (SELECT 1) INSERT INTO customers SELECT 100, 'a', 'b', 2", QueryRefused),
        ("WITH t AS (SELECT 1) DELETE FROM orders", QueryRefused),
        ("SELECT * FROM pragma_table_info('customers')", QueryRefused),
        ("CREATE TEMP TABLE t (x)", QueryRefused),
        ("BEGIN", QueryRefused),
        ("   -- comment\n  /* c */ DROP TABLE orders", QueryRefused),
        ("", QueryRefused),
        ("SELECT nosuchcolumn FROM customers", QueryError),
        ("SELECT zeroblob(100000000)", QueryError),
        ("SELECT length(hex(randomblob(6000)))", QueryError),  # over the value-size cap
        ("SELECT printf('%.*c', 1000000000, 'x')", QueryRefused),  # one endless VM step
    ],
)
def test_hostile_queries_are_refused_and_leave_the_db_unchanged(db, query, error):
    before = _sha(db)
    with pytest.raises(error):
        run_readonly(db, query, timeout_s=1.0, max_rows=100)
    assert _sha(db) == before
    assert run_readonly(db, "SELECT COUNT(*) FROM customers", timeout_s=1.0, max_rows=1) == [
        (len(shop.FIRST_NAMES),)
    ]


@pytest.mark.parametrize(
    "query",
    ["ATTACH DATABASE '{path}' AS evil", "VACUUM INTO '{path}'", "SELECT 1; ATTACH '{path}' AS e"],
)
def test_cannot_attach_or_write_another_file(db, tmp_path, query):
    target = tmp_path / "evil.db"
    before = _sha(db)
    with pytest.raises(QueryRefused):
        run_readonly(db, query.format(path=target), timeout_s=1.0, max_rows=10)
    assert not target.exists()
    assert _sha(db) == before


def test_recursive_cte_that_never_ends_times_out(db):
    q = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT COUNT(*) FROM r"
    t0 = time.monotonic()
    with pytest.raises(QueryTimeout):
        run_readonly(db, q, timeout_s=0.2, max_rows=10)
    assert time.monotonic() - t0 < 3.0


def test_huge_cross_join_hits_row_cap_or_timeout(db):
    q = "SELECT * FROM orders a, orders b, orders c, orders d"
    with pytest.raises(QueryTooManyRows):
        run_readonly(db, q, timeout_s=2.0, max_rows=1000)
    count = "SELECT COUNT(*) FROM orders a, orders b, orders c, orders d"
    t0 = time.monotonic()
    with pytest.raises(QueryTimeout):
        run_readonly(db, count, timeout_s=0.2, max_rows=10)
    assert time.monotonic() - t0 < 3.0


def test_bad_limits_and_missing_file(db, tmp_path):
    with pytest.raises(ValueError, match="timeout_s"):
        run_readonly(db, "SELECT 1", timeout_s=0, max_rows=1)
    with pytest.raises(ValueError, match="max_rows"):
        run_readonly(db, "SELECT 1", timeout_s=1.0, max_rows=-1)
    with pytest.raises(QueryError, match="db_path"):
        run_readonly(tmp_path / "missing.sqlite", "SELECT 1", timeout_s=1.0, max_rows=1)
    assert not (tmp_path / "missing.sqlite").exists()


def test_referenced_columns_compiles_without_running(db):
    q = "WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r) SELECT name FROM customers"
    t0 = time.monotonic()
    refs = referenced_columns(db, q, timeout_s=0.5)
    assert time.monotonic() - t0 < 0.4  # compiled only: the endless CTE never ran
    assert refs == {("customers", "name")}
    with pytest.raises(QueryRefused):
        referenced_columns(db, "SELECT load_extension('x')")
    reads = []
    q = "SELECT c.name, o.year FROM customers c JOIN orders o ON o.customer_id = c.id"
    assert run_readonly(db, q, timeout_s=1.0, compile_only=True, reads=reads) == []
    assert {("customers", "name"), ("orders", "year"), ("orders", "customer_id")} <= set(reads)


def test_not_a_database_file_is_a_query_error(tmp_path):
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"\x00not a database" * 100)
    before = _sha(junk)
    with pytest.raises(QueryError):
        run_readonly(junk, "SELECT 1 FROM t", timeout_s=1.0, max_rows=1)
    assert _sha(junk) == before


def test_results_equal_order_and_floats():
    assert results_equal([(1,), (2,)], [(2,), (1,)], ordered=False)
    assert not results_equal([(1,), (2,)], [(2,), (1,)], ordered=True)
    assert not results_equal([(1,), (1,)], [(1,)], ordered=False)  # multisets
    assert results_equal([(0.1 + 0.2,)], [(0.3,)], ordered=True)
    assert results_equal([(3.0,)], [(3,)], ordered=True)
    assert results_equal([(None, "a"), (1, "b")], [(1, "b"), (None, "a")], ordered=False)


def test_gold_scores_one_with_spans_on_schema_and_question(sql_example):
    ex = sql_example
    verdicts = [v(ex, ex.reference) for v in sql_verifiers()]
    assert [v.score for v in verdicts] == [1.0, 1.0, 1.0]
    match, runs, schema = verdicts
    texts = [ex.prompt[s:e] for s, e in match.spans]
    assert any(t.startswith("orders(id, customer_id") for t in texts)
    assert any(t.startswith("How many") and t.endswith("?") for t in texts)
    assert [ex.prompt[s:e] for s, e in runs.spans] == [t for t in texts if t.startswith("orders(")]
    schema_texts = {ex.prompt[s:e].split("(")[0] for s, e in schema.spans}
    assert schema_texts == set(shop.TABLE_COLUMNS)


def test_wrong_result_runs_but_does_not_match(sql_example, caplog):
    ex = sql_example
    with caplog.at_level(logging.INFO, logger="mrtpo.verifiers.sql"):
        v = ExecutionMatch()(ex, "SELECT COUNT(*) FROM orders WHERE year = 1900")
    assert v.score == 0.0 and "differs" in v.reason
    assert QueryRuns()(ex, "SELECT COUNT(*) FROM orders WHERE year = 1900").score == 1.0
    assert any("differs" in r.getMessage() for r in caplog.records)


def test_hostile_response_scores_zero_and_logs_reason(sql_example, caplog):
    before = _sha(sql_example.fields["db_path"])
    with caplog.at_level(logging.INFO, logger="mrtpo.verifiers.sql"):
        verdicts = [v(sql_example, "DROP TABLE orders") for v in sql_verifiers()]
    assert all(v.score == 0.0 and "QueryRefused" in v.reason for v in verdicts)
    assert any("QueryRefused" in r.getMessage() for r in caplog.records)
    assert _sha(sql_example.fields["db_path"]) == before


def test_order_insensitive_unless_gold_orders(db):
    base = {"db_path": db, "schema": shop.TABLE_COLUMNS, "gold_tables": ["products"]}
    unordered = dict(base, gold="SELECT name FROM products WHERE category = 'tools'")
    ex = load_task("sql").train[0]
    ex = dataclasses.replace(ex, fields=unordered)
    assert (
        ExecutionMatch()(
            ex, "SELECT name FROM products WHERE category = 'tools' ORDER BY name DESC"
        ).score
        == 1.0
    )
    ordered = dict(base, gold="SELECT name FROM products WHERE category = 'tools' ORDER BY price")
    ex = dataclasses.replace(ex, fields=ordered)
    assert (
        ExecutionMatch()(
            ex, "SELECT name FROM products WHERE category = 'tools' ORDER BY price"
        ).score
        == 1.0
    )
    assert (
        ExecutionMatch()(
            ex, "SELECT name FROM products WHERE category = 'tools' ORDER BY price DESC"
        ).score
        == 0.0
    )


def test_schema_only_reward(sql_example):
    ex = sql_example
    v = SchemaOnly()
    assert v(ex, "SELECT name FROM sqlite_master").score == 0.0
    # It runs, but reads no table of the schema: sql_runs pays only a query of the schema.
    assert QueryRuns()(ex, "SELECT name FROM sqlite_master").score == 0.0
    both = "SELECT c.name FROM customers c, sqlite_master m"
    assert QueryRuns()(ex, both).score == 1.0 and v(ex, both).score == 0.0
    bad_col = v(ex, "SELECT colour FROM products")
    assert bad_col.score == 0.0 and "colour" in bad_col.reason
    # A column hidden from the prompt's schema is not allowed even though the DB has it.
    hidden = {**ex.fields["schema"], "customers": ["id", "name", "city"]}
    ex2 = dataclasses.replace(ex, fields={**ex.fields, "schema": hidden})
    r = v(ex2, "SELECT age FROM customers")
    assert r.score == 0.0 and "customers.age" in r.reason
    assert v(ex2, "SELECT name FROM customers c JOIN orders o ON o.customer_id = c.id").score == 1.0
    assert v(ex2, "SELECT COUNT(*) FROM customers").score == 1.0


@pytest.mark.parametrize(
    "response",
    [
        "",
        "   ",
        "\x00\x01\xff" * 10,
        "```sql\n```",
        "x" * 1_000_000,
        "SELECT" * 50_000,
        "```" * 33_000,
        None,
    ],
)
def test_junk_responses_always_give_a_verdict(sql_example, response):
    for v in sql_verifiers():
        out = v(sql_example, response)
        assert out.score == 0.0 and out.reason


def test_fenced_query_is_extracted(sql_example):
    resp = f"Here it is:\n```sql\n{sql_example.reference};\n```\nDone."
    assert [v(sql_example, resp).score for v in sql_verifiers()] == [1.0, 1.0, 1.0]


def test_bad_example_fields_give_a_verdict(sql_example):
    ex = dataclasses.replace(
        sql_example, fields={"db_path": "/nonexistent/x.sqlite", "gold": "SELECT 1"}
    )
    for v in sql_verifiers():
        out = v(ex, "SELECT 1")
        assert out.score == 0.0 and out.reason


def test_built_in_schema_matches_the_database(db):
    conn = sqlite3.connect(db)
    try:
        for table, cols in shop.TABLE_COLUMNS.items():
            got = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
            assert got == cols
    finally:
        conn.close()


# --- Rewards a careful judge would not pay (issue 19) -----------------------------------


def _scalar_examples(db, n=6):
    """Examples whose gold result is one number, with the db path filled in."""
    out = []
    for ex in load_task("sql", seed=0).train:
        rows = run_readonly(db, ex.fields["gold"])
        if len(rows) == 1 and len(rows[0]) == 1 and isinstance(rows[0][0], (int, float)):
            out.append((dataclasses.replace(ex, fields={**ex.fields, "db_path": db}), rows[0][0]))
        if len(out) == n:
            break
    return out


def test_a_constant_query_earns_nothing_even_when_it_equals_the_gold_result(db):
    examples = _scalar_examples(db)
    assert len(examples) >= 3
    for ex, value in examples:
        for query in (f"SELECT {value!r}", f"```sql\nSELECT {value!r};\n```", "SELECT 1"):
            verdicts = {v.name: v(ex, query) for v in sql_verifiers()}
            assert all(v.score == 0.0 for v in verdicts.values()), (query, verdicts)
            assert (
                "table" in verdicts["sql_match"].reason or "differs" in verdicts["sql_match"].reason
            )
            assert "table" in verdicts["sql_runs"].reason
            assert "table" in verdicts["sql_schema"].reason
        # Beside a table it never looks into: still a constant, no match.
        table = sorted(ex.fields["gold_tables"])[0]
        beside = ExecutionMatch()(ex, f"SELECT {value!r} FROM {table} LIMIT 1")
        assert beside.score == 0.0 and "column" in beside.reason, beside
        # The gold itself, and the same query written otherwise, still earn everything.
        assert [v(ex, ex.reference).score for v in sql_verifiers()] == [1.0, 1.0, 1.0]


def test_a_gold_query_timeout_is_not_cached(sql_example, monkeypatch):
    from mrtpo.verifiers import sql_common, sql_sandbox

    sql_common._RUNS.clear()
    clock = iter(range(0, 10**9, 1000))  # every reading of the clock is 1000 s later
    monkeypatch.setattr(sql_sandbox.time, "monotonic", lambda: float(next(clock)))
    busy = ExecutionMatch()(sql_example, sql_example.reference)
    assert busy.score == 0.0 and "gold query failed" in busy.reason
    monkeypatch.undo()  # the machine is idle again
    again = ExecutionMatch()(sql_example, sql_example.reference)
    assert again.score == 1.0, again
    assert not any(isinstance(out[1], QueryTimeout) for out, _ in sql_common._RUNS.data.values())


def test_outcome_cache_never_keeps_transient_failures():
    from mrtpo.verifiers.sql_common import _RunCache
    from mrtpo.verifiers.sql_sandbox import QueryUnavailable

    cache = _RunCache(size=10, max_bytes=1_000_000)
    calls = []

    def flaky(error):
        def compute():
            calls.append(error)
            raise error("just now")

        return compute

    for error in (QueryTimeout, QueryUnavailable):
        assert error.transient
        cache.get(("k", error.__name__), flaky(error))
        cache.get(("k", error.__name__), flaky(error))
    assert calls == [QueryTimeout, QueryTimeout, QueryUnavailable, QueryUnavailable]
    assert not cache.data
    # A deterministic failure is kept (the three rewards of one response run it once).
    cache.get(("k", "refused"), flaky(QueryRefused))
    cache.get(("k", "refused"), flaky(QueryRefused))
    assert calls.count(QueryRefused) == 1 and not QueryRefused.transient
