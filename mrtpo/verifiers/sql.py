"""Text-to-SQL verifiers: run the generated query in the read-only SQLite sandbox.

Every query, gold or generated, goes through the sandbox of `mrtpo.verifiers.sql_sandbox`
(`run_readonly`: read-only connection, authorizer, SQLite limits, deadline, row and byte
budgets; it raises a `QueryError` subclass that says why a query failed).

Three rewards per example (`sql_verifiers()`), reading these `Example.fields`:

- ``db_path``: the SQLite file; ``gold``: the gold query;
- ``schema``: ``{table: [columns]}`` as shown in the prompt;
- ``schema_spans``: ``{table: [start, end]}``, the prompt line of each table;
- ``gold_tables``: the tables the gold query reads; ``question_span``: ``[start, end]``.

- ``sql_match``: 1 when the result equals the gold result (order-insensitive unless the
  gold query has ORDER BY) and the query reads one of the tables the gold query reads
  (and a column of them when the gold reads columns); spans: the gold tables' schema
  lines and the question.
- ``sql_runs``: 1 when the query runs to completion in the sandbox and reads a table of
  the schema; spans: the gold tables' schema lines.
- ``sql_schema``: 1 when the query compiles, reads at least one table shown in the prompt
  and only tables and columns shown there; spans: every schema line.

Which tables and columns a query reads is what SQLite's authorizer reports while it
compiles the query (`run_readonly`'s ``reads``), so a constant query (``SELECT 47``,
``SELECT 1``) reads nothing and earns none of the three.

The query is the first fenced code block of the response if there is one, else the whole
response. Refusals and errors (an over-budget result included) are logged (logger
``mrtpo.verifiers.sql``) and become score 0 with the reason. Outcomes are cached so that
the three rewards of one response run its query once; the cache is bounded by entries
(`CACHE_ENTRIES`) and by the bytes of the rows it holds (`CACHE_MAX_BYTES`). Transient
failures (a timeout, a database that cannot be read just now) are never cached.

The ``sql-real`` task's rewards (`sql_real_verifiers`) add the output form and the named
tables and columns (mrtpo/verifiers/sql_real_rewards.py). The query extraction, the result
comparison, the outcome cache and the verifiers' base class are
mrtpo/verifiers/sql_common.py's; the public names of both are importable from here.
"""

from __future__ import annotations

import re

from .base import Example, Span
from .sql_common import (
    CACHE_ENTRIES,
    CACHE_MAX_BYTES,
    MAX_RESPONSE_CHARS,
    _cached_refs,
    _cached_run,
    _spans,
    _SQLVerifier,
    _tables_read,
    extract_query,
    results_equal,
)
from .sql_real_rewards import NamedColumns, OutputForm, statement_count_error
from .sql_sandbox import DEFAULT_MAX_BYTES, DEFAULT_MAX_ROWS, DEFAULT_TIMEOUT_S, TABLE_FUNCTIONS

__all__ = [
    "CACHE_ENTRIES",
    "CACHE_MAX_BYTES",
    "MAX_RESPONSE_CHARS",
    "ExecutionMatch",
    "NamedColumns",
    "OutputForm",
    "QueryRuns",
    "SchemaOnly",
    "extract_query",
    "results_equal",
    "sql_real_verifiers",
    "sql_verifiers",
    "statement_count_error",
]


_ORDER_BY = re.compile(r"\border\s+by\b", re.I)


class ExecutionMatch(_SQLVerifier):
    """Score 1 when the query's result equals the gold query's."""

    name = "sql_match"
    fields_needed = {
        "db_path": "text",
        "gold": "text",
        "gold_tables": "list",
        "schema_spans": "mapping",
        "question_span": "span",
    }

    def spans(self, example: Example) -> tuple[Span, ...]:
        return _spans(example.fields, example.fields.get("gold_tables", ()), question=True)

    def _score(self, example: Example, query: str) -> tuple[float, str | None]:
        gold = example.fields["gold"]
        gold_out, gold_err = _cached_run(
            str(example.fields["db_path"]),
            gold,
            max(self.timeout_s, 5.0),
            self.max_rows,
            self.max_bytes,
        )
        if gold_err is not None:
            raise RuntimeError(f"gold query failed: {type(gold_err).__name__}: {gold_err}")
        gold_rows, gold_refs = gold_out
        out, err = self._run(example, query)
        if err is not None:
            return 0.0, f"{type(err).__name__}: {err}"
        rows, refs = out
        # The answer must read the data the gold reads: one of its tables, and a column of
        # them when the gold reads columns. A constant (SELECT 47) that happens to equal
        # the gold result, or one computed beside a table it never looks into, earns nothing.
        gold_tables = {t for t, _ in gold_refs if t not in TABLE_FUNCTIONS}
        if gold_tables and not _tables_read(refs, gold_tables):
            return 0.0, f"reads none of the tables {sorted(gold_tables)} the question is about"
        gold_columns = any(c for t, c in gold_refs if t in gold_tables)
        if gold_columns and not any(c for t, c in refs if t in gold_tables):
            return 0.0, f"reads no column of the tables {sorted(gold_tables)}"
        ordered = bool(_ORDER_BY.search(gold))
        if results_equal(rows, gold_rows, ordered=ordered):
            return 1.0, None
        return 0.0, f"result differs from the gold result ({len(rows)} vs {len(gold_rows)} rows)"


class QueryRuns(_SQLVerifier):
    """Score 1 when the query runs to completion in the sandbox and reads a schema table."""

    name = "sql_runs"
    fields_needed = {
        "db_path": "text",
        "schema": "mapping",
        "gold_tables": "list",
        "schema_spans": "mapping",
    }

    def spans(self, example: Example) -> tuple[Span, ...]:
        return _spans(example.fields, example.fields.get("gold_tables", ()), question=False)

    def _score(self, example: Example, query: str) -> tuple[float, str | None]:
        out, err = self._run(example, query)
        if err is not None:
            return 0.0, f"{type(err).__name__}: {err}"
        if not _tables_read(out[1], (example.fields.get("schema") or {}).keys()):
            return 0.0, "reads no table of the schema"
        return 1.0, None


class SchemaOnly(_SQLVerifier):
    """Score 1 when the query compiles and reads only tables and columns shown in the prompt."""

    name = "sql_schema"
    fields_needed = {"db_path": "text", "schema": "mapping", "schema_spans": "mapping"}

    def spans(self, example: Example) -> tuple[Span, ...]:
        return _spans(example.fields, (example.fields.get("schema") or {}).keys(), question=False)

    def _score(self, example: Example, query: str) -> tuple[float, str | None]:
        schema = {
            t.lower(): {c.lower() for c in cols}
            for t, cols in (example.fields.get("schema") or {}).items()
        }
        refs, err = _cached_refs(str(example.fields["db_path"]), query, self.timeout_s)
        if err is not None:
            return 0.0, f"{type(err).__name__}: {err}"
        for table, column in sorted(refs):
            cols = schema.get(table.lower())
            if cols is None and table.lower() in TABLE_FUNCTIONS:
                continue  # json_each(...) and the like: rows of a function, not a table
            if cols is None:
                return 0.0, f"reads table {table!r}, which is not in the schema"
            # "" is a whole-table read (COUNT(*)); rowid aliases are part of every table.
            if column and column.lower() not in cols and column.lower() not in ("rowid",):
                return 0.0, f"reads column {table}.{column}, which is not in the schema"
        if not _tables_read(refs, schema):  # SELECT 1 reads nothing shown in the prompt
            return 0.0, "reads no table of the schema"
        return 1.0, None


def sql_verifiers(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[_SQLVerifier]:
    """The three SQL rewards, in order: execution match, the query runs, schema only."""
    kw = dict(timeout_s=timeout_s, max_rows=max_rows, max_bytes=max_bytes)
    return [ExecutionMatch(**kw), QueryRuns(**kw), SchemaOnly(**kw)]


def sql_real_verifiers(
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list:
    """The ``sql-real`` task's three rewards, in order: execution match (`ExecutionMatch`),
    the named tables and columns (`NamedColumns`), the output form (`OutputForm`)."""
    kw = dict(timeout_s=timeout_s, max_rows=max_rows, max_bytes=max_bytes)
    return [ExecutionMatch(**kw), NamedColumns(**kw), OutputForm()]
