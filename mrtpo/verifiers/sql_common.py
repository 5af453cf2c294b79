"""What every text-to-SQL reward shares (mrtpo/verifiers/sql.py and
mrtpo/verifiers/sql_real_rewards.py): the query read from the response (`extract_query`),
results compared (`results_equal`), the outcome cache and the verifier base class.

Every query goes through the read-only sandbox of `mrtpo.verifiers.sql_sandbox`. Outcomes
are cached so that the rewards of one response run its query once; the cache is bounded by
entries (`CACHE_ENTRIES`) and by the bytes of the rows it holds (`CACHE_MAX_BYTES`).
Transient failures (a timeout, a database that cannot be read just now) are never cached.
Refusals and errors are logged (logger ``mrtpo.verifiers.sql``, the rewards' module).
"""

from __future__ import annotations

import logging
import math
import os
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
    QueryError,
    referenced_columns,
    run_readonly_sized,
)

# the rewards' logger, named after the module that holds them (mrtpo.verifiers.sql)
logger = logging.getLogger("mrtpo.verifiers.sql")

# The outcome cache: at most this many entries holding at most this many bytes of rows.
CACHE_ENTRIES = 512
CACHE_MAX_BYTES = 64 * 1024 * 1024
MAX_RESPONSE_CHARS = 100_000  # longer responses are not parsed at all


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
