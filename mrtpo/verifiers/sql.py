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
"""

from __future__ import annotations

import logging
import math
import os
import re
import sys
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

from .base import Example, Span, Verdict, find_fence
from .sql_sandbox import (
    DEFAULT_MAX_BYTES,
    DEFAULT_MAX_ROWS,
    DEFAULT_TIMEOUT_S,
    TABLE_FUNCTIONS,
    QueryError,
    referenced_columns,
    run_readonly_sized,
)

logger = logging.getLogger(__name__)

# The outcome cache: at most this many entries holding at most this many bytes of rows.
CACHE_ENTRIES = 512
CACHE_MAX_BYTES = 64 * 1024 * 1024
MAX_RESPONSE_CHARS = 100_000  # longer responses are not parsed at all
_ORDER_BY = re.compile(r"\border\s+by\b", re.I)


def extract_query(response: str) -> str:
    """The SQL in a response: its first fenced code block, else the whole text, stripped."""
    fence = find_fence(response)
    text = fence.body if fence is not None else response
    return text.strip()


def _normalize_value(v):
    if isinstance(v, float):
        if math.isnan(v):
            return ("nan",)
        if v.is_integer() and abs(v) < 2**53:
            return int(v)
        return round(v, 6)
    if isinstance(v, bytes):
        return ("blob", v)
    return v


def _sort_key(row: tuple):
    # Rows may mix NULL, numbers and text: sort by (type rank, value) per column.
    return tuple(
        (0, 0) if v is None else (1, v) if isinstance(v, (int, float)) else (2, str(v)) for v in row
    )


def results_equal(got: list[tuple], gold: list[tuple], *, ordered: bool) -> bool:
    """Rows equal up to float rounding (6 decimals); as multisets unless ``ordered``."""
    a = [tuple(_normalize_value(v) for v in r) for r in got]
    b = [tuple(_normalize_value(v) for v in r) for r in gold]
    if ordered:
        return a == b
    try:
        return Counter(a) == Counter(b)
    except TypeError:
        return sorted(a, key=_sort_key) == sorted(b, key=_sort_key)


class _RunCache:
    """Small thread-safe LRU of query outcomes (rows or error), so that the three rewards
    of one response run its query once. Bounded by entries and by bytes: ``compute``
    returns ``(value, nbytes)``; least recently used entries go first, and a value larger
    than a quarter of the byte budget is returned without being kept. A transient failure
    (``error.transient``: a timeout, a database that cannot be read just now) is returned
    and never kept: it says how busy the machine was, not what the query does, and keeping
    a gold query's timeout would score every later answer to that example 0."""

    def __init__(self, size: int = CACHE_ENTRIES, max_bytes: int = CACHE_MAX_BYTES):
        self.size = size
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.lock = threading.Lock()
        self.data: OrderedDict[tuple, tuple] = OrderedDict()  # key -> (outcome, nbytes)

    def get(
        self, key: tuple, compute: Callable[[], tuple[Any, int]]
    ) -> tuple[Any, QueryError | None]:
        with self.lock:
            if key in self.data:
                self.data.move_to_end(key)
                return self.data[key][0]
        try:
            value, nbytes = compute()
            out: tuple = (value, None)
        except QueryError as e:
            # A fresh exception without traceback: the failed call's frames (and any rows
            # they held) must not live on in the cache.
            out = (None, type(e)(str(e)))
            if e.transient:
                return out
            nbytes = 0
        nbytes += 256 + sum(sys.getsizeof(k) for k in key if isinstance(k, str))
        if nbytes > self.max_bytes // 4:
            return out
        with self.lock:
            if key in self.data:
                self.nbytes -= self.data.pop(key)[1]
            self.data[key] = (out, nbytes)
            self.nbytes += nbytes
            while self.data and (len(self.data) > self.size or self.nbytes > self.max_bytes):
                self.nbytes -= self.data.popitem(last=False)[1][1]
        return out

    def clear(self) -> None:
        with self.lock:
            self.data.clear()
            self.nbytes = 0


_RUNS = _RunCache()
_REFS = _RunCache()


def _cached_run(
    db_path: str, query: str, timeout_s: float, max_rows: int, max_bytes: int = DEFAULT_MAX_BYTES
):
    try:
        mtime = os.stat(db_path).st_mtime_ns
    except OSError:
        mtime = None
    key = (db_path, mtime, query, timeout_s, max_rows, max_bytes)

    def compute():
        reads: list[tuple[str, str]] = []
        rows, nbytes = run_readonly_sized(
            db_path, query, timeout_s=timeout_s, max_rows=max_rows, reads=reads, max_bytes=max_bytes
        )
        refs = frozenset((t.lower(), c.lower()) for t, c in reads)
        return (rows, refs), nbytes + sum(sys.getsizeof(t) + 2 * 64 for t in refs)

    return _RUNS.get(key, compute)


def _tables_read(refs: Iterable[tuple[str, str]], tables: Iterable[str]) -> set[str]:
    """The tables among ``tables`` (any case) that the ``(table, column)`` reads touch."""
    wanted = {t.lower() for t in tables}
    return {t.lower() for t, _ in refs if t.lower() in wanted}


def _cached_refs(db_path: str, query: str, timeout_s: float):
    try:
        mtime = os.stat(db_path).st_mtime_ns
    except OSError:
        mtime = None
    key = (db_path, mtime, query, timeout_s)

    def compute():
        refs = referenced_columns(db_path, query, timeout_s=timeout_s)
        return refs, sys.getsizeof(refs) + sum(sys.getsizeof(t) + 2 * 64 for t in refs)

    return _REFS.get(key, compute)


def _spans(fields: dict, tables: Iterable[str], question: bool) -> tuple[Span, ...]:
    out: list[Span] = []
    schema_spans = fields.get("schema_spans") or {}
    for t in tables:
        if t in schema_spans:
            s, e = schema_spans[t]
            out.append((int(s), int(e)))
    if question and fields.get("question_span"):
        s, e = fields["question_span"]
        out.append((int(s), int(e)))
    return tuple(sorted(set(out)))


class _SQLVerifier:
    name = "sql"

    def __init__(
        self,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_rows: int = DEFAULT_MAX_ROWS,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ):
        self.timeout_s = float(timeout_s)
        self.max_rows = int(max_rows)
        self.max_bytes = int(max_bytes)
        if self.max_bytes <= 0:
            raise ValueError(f"max_bytes: expected a positive int, got {max_bytes!r}")

    def spans(self, example: Example) -> tuple[Span, ...]:
        raise NotImplementedError

    def _score(self, example: Example, query: str) -> tuple[float, str | None]:
        raise NotImplementedError

    def __call__(self, example: Example, response: str) -> Verdict:
        try:
            spans = self.spans(example)
        except Exception as e:  # malformed fields: still a verdict
            return Verdict(0.0, (), f"{self.name}: bad example fields: {e}")
        try:
            if not isinstance(response, str):
                return Verdict(0.0, spans, f"response is {type(response).__name__}, not str")
            if len(response) > MAX_RESPONSE_CHARS:
                return Verdict(0.0, spans, f"response longer than {MAX_RESPONSE_CHARS} chars")
            query = extract_query(response)
            if not query:
                return Verdict(0.0, spans, "empty query")
            score, reason = self._score(example, query)
        except Exception as e:  # never raise into the trainer
            logger.warning("%s: verifier error on %s: %r", self.name, example.id, e)
            return Verdict(0.0, spans, f"verifier error: {type(e).__name__}: {e}")
        if score == 0.0 and reason is not None:
            logger.info("%s: %s: %s", self.name, example.id, reason)
        return Verdict(score, spans, reason if score == 0.0 else None)

    def _run(self, example: Example, query: str):
        """``((rows, reads), None)`` or ``(None, error)``: ``reads`` are the lower-cased
        ``(table, column)`` pairs the query reads (``column`` is "" for a whole-table read)."""
        return _cached_run(
            str(example.fields["db_path"]), query, self.timeout_s, self.max_rows, self.max_bytes
        )


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


# --------------------------------------------------------------------------------------------
# The ``sql-real`` task's two further rewards (`sql_real_verifiers`): the output form and the
# tables and columns the question names. They read these further `Example.fields`:
# ``form_span`` (``[start, end]``, the prompt's sentence that asks for the form) and ``uses``
# (``{table: [column, ...]}``, what the question names; an empty list: the table itself).

_SELECT = re.compile(r"select\b", re.I)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def statement_count_error(body: str) -> str | None:
    """None when ``body`` is one SQL statement (a final ``;`` allowed), else why not. Quoted
    strings and identifiers (``'...'``, ``"..."``, `` `...` ``, ``[...]``) and comments
    (``-- ...``, ``/* ... */``) are skipped, so a ``;`` inside them does not count."""
    text = body.strip()
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if ch in "'\"`[":
            close = "]" if ch == "[" else ch
            j = text.find(close, i + 1)
            if j < 0:
                return "an unclosed quote"
            i = j + 1
            continue
        if text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
            continue
        if text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
            continue
        if ch == ";":
            return "more than one statement" if _has_code(text[i + 1 :]) else None
        i += 1
    return None


def _has_code(text: str) -> bool:
    """Whether ``text`` holds anything but spaces, ``;`` and comments."""
    i, n = 0, len(text)
    while i < n:
        if text.startswith("--", i):
            j = text.find("\n", i)
            i = n if j < 0 else j + 1
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            i = n if j < 0 else j + 2
        elif text[i].isspace() or text[i] == ";":
            i += 1
        else:
            return True
    return False


class OutputForm:
    """``sql_form``: 1 when the response is exactly one closed ```` ```sql```` block (nothing
    but spaces around it) holding one statement that starts with SELECT. It runs nothing:
    the form only. Span: the prompt's sentence that asks for the form (``form_span``)."""

    name = "sql_form"
    fields_needed = {"form_span": "span"}

    def spans(self, example: Example) -> tuple[Span, ...]:
        s, e = example.fields["form_span"]
        return ((int(s), int(e)),)

    def __call__(self, example: Example, response: str) -> Verdict:
        try:
            spans = self.spans(example)
        except Exception as e:  # malformed fields: still a verdict
            return Verdict(0.0, (), f"{self.name}: bad example fields: {e}")
        if not isinstance(response, str):
            return Verdict(0.0, spans, f"response is {type(response).__name__}, not str")
        if len(response) > MAX_RESPONSE_CHARS:
            return Verdict(0.0, spans, f"response longer than {MAX_RESPONSE_CHARS} chars")
        reason = self._why_not(response)
        return Verdict(float(reason is None), spans, reason)

    @staticmethod
    def _why_not(response: str) -> str | None:
        fence = find_fence(response)
        if fence is None:
            return "no ```sql code block"
        if fence.lang.lower() != "sql":
            return f"the code block is {fence.lang or 'unlabelled'!r}, not sql"
        if not fence.closed:
            return "the code block is not closed"
        if response[: fence.start].strip() or response[fence.end :].strip():
            return "text outside the code block"
        body = fence.body.strip()
        if not _SELECT.match(body):
            return "the query does not start with SELECT"
        return statement_count_error(body)

    def relevant_chars(self, example: Example, response: str) -> list[Span]:
        """The characters the form is made of: everything outside the block's body (the
        fences, any text around them) and the body's first word."""
        fence = find_fence(response)
        if fence is None:
            return [(0, len(response))] if response else []
        start = response.find(fence.body, fence.start + 3) if fence.body else -1
        if start < 0:
            return [(0, len(response))]
        end = start + len(fence.body)
        out = [(0, start), (end, len(response))]
        word = _IDENT.search(response, start, end)
        if word is not None:
            out.append(word.span())
        return [(s, e) for s, e in out if e > s]


class NamedColumns(_SQLVerifier):
    """``sql_columns``: 1 when the query compiles and reads every table and column the
    question names (``uses``). Spans: those tables' schema lines."""

    name = "sql_columns"
    fields_needed = {"db_path": "text", "uses": "mapping", "schema_spans": "mapping"}

    def spans(self, example: Example) -> tuple[Span, ...]:
        return _spans(example.fields, (example.fields.get("uses") or {}).keys(), question=False)

    def _score(self, example: Example, query: str) -> tuple[float, str | None]:
        refs, err = _cached_refs(str(example.fields["db_path"]), query, self.timeout_s)
        if err is not None:
            return 0.0, f"{type(err).__name__}: {err}"
        got = {(t.lower(), c.lower()) for t, c in refs}
        tables = {t for t, _ in got}
        for table, cols in (example.fields.get("uses") or {}).items():
            if table.lower() not in tables:
                return 0.0, f"reads nothing of the table {table!r}"
            for col in cols:
                if (table.lower(), col.lower()) not in got:
                    return 0.0, f"does not read {table}.{col}"
        return 1.0, None

    def relevant_chars(self, example: Example, response: str) -> list[Span]:
        """The identifiers of the response that name a table or column of ``uses``."""
        uses = example.fields.get("uses") or {}
        names = {t.lower() for t in uses} | {c.lower() for cs in uses.values() for c in cs}
        return [m.span() for m in _IDENT.finditer(response) if m.group().lower() in names]


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
