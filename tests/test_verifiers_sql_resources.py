"""The SQL sandbox's resource bounds (bytes per result, bytes in the outcome cache, SQLite's
own limits) and its table-valued functions: json_each reads, everything else still refused."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from mrtpo.tasks.builtin import load_task
from mrtpo.tasks.data import shop
from mrtpo.verifiers.sql import CACHE_MAX_BYTES, sql_verifiers
from mrtpo.verifiers.sql_common import _RunCache
from mrtpo.verifiers.sql_sandbox import (
    DEFAULT_MAX_BYTES,
    QueryError,
    QueryRefused,
    QueryTooLarge,
    referenced_columns,
    rows_bytes,
    run_readonly,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return shop.db_path(tmp_path_factory.mktemp("sqlres"))


@pytest.fixture(scope="module")
def example(db):
    task = load_task("sql", seed=0)
    ex = next(e for e in task.train if e.fields["gold"].startswith("SELECT COUNT(*) FROM orders"))
    return dataclasses.replace(ex, fields={**ex.fields, "db_path": db})


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _wide(cols, rows, size=9000, tag=0):
    blobs = ", ".join(f"zeroblob({size}) AS b{i}" for i in range(cols))
    return (
        f"WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < {rows}) "
        f"SELECT n, {tag} AS tag, {blobs} FROM r"
    )


def test_json_each_and_json_tree_are_read_only_and_allowed(db):
    assert run_readonly(db, "SELECT value FROM json_each('[3, 1, 2]') ORDER BY value") == [
        (1,),
        (2,),
        (3,),
    ]
    got = run_readonly(db, "SELECT key, value FROM json_tree('{\"a\": 1}') WHERE key = 'a'")
    assert got == [("a", 1)]
    q = "SELECT c.name FROM customers c JOIN json_each('[1, 2]') j ON j.value = c.id ORDER BY c.id"
    assert [r[0] for r in run_readonly(db, q)] == [
        r[0] for r in run_readonly(db, "SELECT name FROM customers WHERE id IN (1, 2) ORDER BY id")
    ]
    refs = referenced_columns(db, q)
    assert ("customers", "name") in refs and ("customers", "id") in refs
    assert not any(t.lower() in ("sqlite_master", "sqlite_schema") for t, _ in refs)


def test_a_correct_query_using_json_each_scores_one(example):
    gold = example.fields["gold"]
    years = sorted(
        {r[0] for r in run_readonly(example.fields["db_path"], "SELECT year FROM orders")}
    )
    # The same filter written with json_each over every year: the same result as the gold.
    response = gold.replace(
        "FROM orders",
        f"FROM orders WHERE year IN (SELECT value FROM json_each('{json.dumps(years)}'))",
        1,
    )
    if " WHERE " in gold:
        response = response.replace(" WHERE ", " AND ", 2).replace(" AND ", " WHERE ", 1)
    verdicts = [v(example, response) for v in sql_verifiers()]
    assert [v.score for v in verdicts] == [1.0, 1.0, 1.0], (response, verdicts)


HOSTILE = [
    "WITH a AS (SELECT 1) UPDATE sqlite_master SET type='x', name='y', tbl_name='z', sql='s'",
    "WITH j AS (SELECT value FROM json_each('[1]')) DELETE FROM orders",
    "WITH j AS (SELECT value FROM json_each('[1]')) INSERT INTO customers SELECT 900, 'a', 'b', 1",
    "WITH j AS (SELECT value FROM json_each('[1]')) UPDATE customers SET age = 1",
    "SELECT value FROM json_each('[1]'); DROP TABLE orders",
    "SELECT load_extension('x') FROM json_each('[1]')",
    "SELECT * FROM json_each('[1]'), pragma_table_info('orders')",
    "SELECT * FROM pragma_table_info('orders'), json_each('[1]')",
    "SELECT * FROM json_each('[1]') WHERE (SELECT count(*) FROM pragma_database_list) > 0",
    "PRAGMA writable_schema = ON",
    "ATTACH DATABASE ':memory:' AS other",
    "SELECT printf('%.*c', 1000000000, 'x') FROM json_each('[1]')",
]  # fmt: skip


@pytest.mark.parametrize("query", HOSTILE)
def test_hostile_queries_with_table_functions_are_still_refused(db, query):
    before = _sha(db)
    with pytest.raises(QueryRefused):
        run_readonly(db, query)
    with pytest.raises(QueryRefused):
        referenced_columns(db, query)
    assert _sha(db) == before


@pytest.mark.parametrize(
    "query, match",
    [
        ("SELECT " + ", ".join(str(i) for i in range(150)), "columns"),
        ("SELECT max(" + ", ".join(str(i) for i in range(100)) + ")", "arguments"),
        ("SELECT " + " + ".join(["1"] * 300), "depth"),
        (" UNION ALL ".join(["SELECT 1"] * 80), "compound"),
    ],
)
def test_sqlite_limits_are_set(db, query, match):
    with pytest.raises(QueryError, match=match):
        run_readonly(db, query)


def test_wide_result_stops_at_the_byte_budget(db, example):
    with pytest.raises(QueryTooLarge, match="over budget"):
        run_readonly(db, _wide(cols=50, rows=5000), max_bytes=2_000_000)
    rows = run_readonly(db, _wide(cols=5, rows=10), max_bytes=2_000_000)
    assert len(rows) == 10 and rows_bytes(rows) <= 2_000_000
    with pytest.raises(ValueError, match="max_bytes"):
        run_readonly(db, "SELECT 1", max_bytes=0)
    # Scored as a failure, with the reason.
    for v in sql_verifiers(max_bytes=1_000_000):
        out = v(example, _wide(cols=50, rows=5000))
        if v.name != "sql_schema":  # the schema reward only compiles the query
            assert out.score == 0.0 and "QueryTooLarge" in out.reason and "budget" in out.reason


def test_outcome_cache_is_bounded_by_bytes():
    cache = _RunCache(size=1000, max_bytes=1_000_000)
    for i in range(100):
        cache.get(("k", i), lambda: ([b"x" * 50_000], 50_100))
        assert cache.nbytes <= cache.max_bytes
    assert 0 < len(cache.data) < 25
    # Too large to keep: returned, not cached.
    out = cache.get(("big",), lambda: ([b"y"], 900_000))
    assert out == ([b"y"], None) and ("big",) not in cache.data

    # Errors are kept without their traceback.
    def fail():
        raise QueryTooLarge("too big")

    _, err = cache.get(("err",), fail)
    assert isinstance(err, QueryTooLarge) and err.__traceback__ is None


_MEMORY_SCRIPT = """
import resource, sys, dataclasses
from mrtpo.tasks.data import shop
from mrtpo.tasks.builtin import load_task
from mrtpo.verifiers.sql import QueryRuns
from mrtpo.verifiers.sql_sandbox import run_readonly, QueryTooLarge
db = shop.db_path(sys.argv[1])
ex = load_task("sql", seed=0).train[0]
ex = dataclasses.replace(ex, fields={**ex.fields, "db_path": db})

def wide(cols, rows, tag):
    blobs = ", ".join(f"zeroblob(9000) AS b{i}" for i in range(cols))
    # The one-row join reads a schema table, which sql_runs asks of every query.
    return ("WITH RECURSIVE r(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM r WHERE n < "
            f"{rows}) SELECT n, {tag} AS tag, {blobs} FROM r, "
            "(SELECT id FROM customers WHERE id = 1)")

def rss_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

run_readonly(db, wide(2, 2, -1))  # warm up
base = rss_mb()
# Wide: 60 blobs of 9 kB a row, 1000 rows = 540 MB unbounded.
for tag in range(5):
    try:
        run_readonly(db, wide(60, 1000, tag))
        raise SystemExit("a 540 MB result was returned")
    except QueryTooLarge:
        pass
wide_growth = rss_mb() - base
# Repeated: 60 different queries of ~6 MB each through the (caching) verifier = 360 MB.
runs = QueryRuns()
for tag in range(60):
    v = runs(ex, wide(60, 11, tag))
    assert v.score == 1.0, v
repeat_growth = rss_mb() - base
print(f"{wide_growth:.1f} {repeat_growth:.1f}")
"""


def test_memory_stays_bounded_for_wide_and_repeated_queries(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_MEMORY_SCRIPT), str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    wide_mb, repeat_mb = map(float, out.stdout.split())
    budget_mb = DEFAULT_MAX_BYTES / 2**20
    cache_mb = CACHE_MAX_BYTES / 2**20
    assert wide_mb < 2 * budget_mb + 16, (wide_mb, repeat_mb)
    assert repeat_mb < cache_mb + 2 * budget_mb + 32, (wide_mb, repeat_mb)
