"""The SQLite sandbox that every query of the SQL verifiers, gold or generated, runs in.

`run_readonly` opens the database read-only (``file:...?mode=ro``), sets ``PRAGMA
query_only``, sets SQLite's own limits (`SQLITE_LIMITS`: string/blob length, SQL length,
result columns, expression depth, compound selects, function arguments, program size, ...),
installs an authorizer that allows only reading (SELECT, column reads, recursive CTEs,
read-only table-valued functions such as ``json_each``, and every function but a deny-list)
and a progress handler that interrupts the query past a deadline. It streams the rows and
stops at ``max_rows`` rows or ``max_bytes`` bytes (the Python size of the fetched rows), so
a query of wide blobs never grows the process past that budget. It returns the rows or
raises a `QueryError` subclass that says why:

- `QueryRefused`: not a single read-only query (DROP/INSERT/UPDATE/DELETE, ATTACH/DETACH,
  PRAGMA, VACUUM, load_extension, several statements, ...).
- `QueryTimeout`: still running after ``timeout_s`` seconds.
- `QueryTooManyRows`: more than ``max_rows`` rows.
- `QueryTooLarge`: the rows take more than ``max_bytes`` bytes.
- `QueryUnavailable`: the database could not be read just now (cannot open, locked, I/O
  error, out of memory).
- `QueryError` itself: anything else SQLite rejects (syntax, unknown table or column,
  values too large).

`QueryTimeout` and `QueryUnavailable` are *transient* (``error.transient`` is True): they
depend on the machine's state at the time (load, a paused process, locks), not on the query,
so whoever remembers outcomes must not remember them.

The verifiers built on it (and their outcome cache) are in `mrtpo.verifiers.sql`.
"""

from __future__ import annotations

import math
import os
import pathlib
import sqlite3
import sys
import time
from collections.abc import Iterable
from typing import Any

DEFAULT_TIMEOUT_S = 1.0
DEFAULT_MAX_ROWS = 10_000
# The Python size of the rows one query may fetch: at most this much memory per query.
DEFAULT_MAX_BYTES = 8 * 1024 * 1024
MAX_QUERY_CHARS = 20_000
# SQLITE_LIMIT_LENGTH: the largest string or blob a query may read or build. Small, because
# some functions (instr, replace) cost O(len^2) inside one VM step, where the progress
# handler cannot stop them: at 10 KB a step costs at most a few milliseconds.
MAX_VALUE_BYTES = 10_000
PROGRESS_STEPS = 100  # VM instructions between two deadline checks
MAX_COLUMNS = 100  # result columns (and table columns, GROUP BY terms): one row <= ~1 MB
# SQLite's per-connection limits (sqlite3.SQLITE_LIMIT_<name>), set on every connection.
SQLITE_LIMITS = {
    "LENGTH": MAX_VALUE_BYTES,
    "SQL_LENGTH": MAX_QUERY_CHARS * 4,
    "COLUMN": MAX_COLUMNS,
    "EXPR_DEPTH": 200,
    "COMPOUND_SELECT": 50,
    "VDBE_OP": 100_000,
    "FUNCTION_ARG": 64,
    "ATTACHED": 0,
    "LIKE_PATTERN_LENGTH": 1000,
    "VARIABLE_NUMBER": 32,
    "TRIGGER_DEPTH": 1,
    "WORKER_THREADS": 0,
}
# Table-valued functions that only read: their rows are not tables of the schema.
TABLE_FUNCTIONS = frozenset({"json_each", "json_tree", "generate_series"})

# Functions a query may not call: extension loading and file access (where compiled in),
# and printf/format, whose "%.*c" loops over its width argument, unbounded by the length
# limit, inside a single VM step (tens of seconds for a width of 1e9).
DENIED_FUNCTIONS = frozenset(
    {"load_extension", "fts3_tokenizer", "readfile", "writefile", "edit", "printf", "format"}
)

_SQLITE_SELECT = sqlite3.SQLITE_SELECT
_SQLITE_READ = sqlite3.SQLITE_READ
_SQLITE_FUNCTION = getattr(sqlite3, "SQLITE_FUNCTION", 31)
_SQLITE_RECURSIVE = getattr(sqlite3, "SQLITE_RECURSIVE", 33)
_SQLITE_UPDATE = sqlite3.SQLITE_UPDATE
# The first use of a table-valued function (an eponymous virtual table) on a connection
# makes SQLite declare its table, which asks the authorizer for an UPDATE of these columns
# of the schema table. A statement can never itself update the schema table (SQLite refuses
# it before asking the authorizer unless writable_schema is on, and PRAGMA is denied), so
# this request is always that internal step, and the schema read that follows it is too.
_SCHEMA_TABLES = frozenset({"sqlite_master", "sqlite_temp_master", "sqlite_schema"})
_SCHEMA_STEP_COLUMNS = frozenset({"type", "name", "tbl_name", "rootpage", "sql"})
_ACTION_NAMES = {
    getattr(sqlite3, n): n[len("SQLITE_") :]
    for n in (
        "SQLITE_INSERT SQLITE_UPDATE SQLITE_DELETE SQLITE_ATTACH SQLITE_DETACH SQLITE_PRAGMA "
        "SQLITE_TRANSACTION SQLITE_CREATE_TABLE SQLITE_CREATE_TEMP_TABLE SQLITE_CREATE_VIEW "
        "SQLITE_CREATE_TEMP_VIEW SQLITE_CREATE_INDEX SQLITE_CREATE_TEMP_INDEX "
        "SQLITE_CREATE_TRIGGER SQLITE_CREATE_TEMP_TRIGGER SQLITE_DROP_TABLE SQLITE_DROP_TEMP_TABLE "
        "SQLITE_DROP_VIEW SQLITE_DROP_TEMP_VIEW SQLITE_DROP_INDEX SQLITE_DROP_TEMP_INDEX "
        "SQLITE_DROP_TRIGGER SQLITE_DROP_TEMP_TRIGGER SQLITE_ALTER_TABLE SQLITE_REINDEX "
        "SQLITE_ANALYZE SQLITE_CREATE_VTABLE SQLITE_DROP_VTABLE SQLITE_SAVEPOINT"
    ).split()
    if hasattr(sqlite3, n)
}
_WRITE_ERRORS = ("may not be modified", "readonly database", "read-only")
# SQLite's primary result codes of a database that cannot be read just now: SQLITE_BUSY,
# SQLITE_LOCKED, SQLITE_NOMEM, SQLITE_IOERR, SQLITE_FULL, SQLITE_CANTOPEN, SQLITE_PROTOCOL.
_UNAVAILABLE_CODES = frozenset({5, 6, 7, 10, 13, 14, 15})


class QueryError(Exception):
    """The query failed: SQLite rejected it (syntax, unknown name, value too large, ...)."""

    # True for outcomes of the machine's state rather than of the query (never cached).
    transient = False


class QueryRefused(QueryError):
    """The query tried something other than reading (write, ATTACH, PRAGMA, extension, ...)."""


class QueryTimeout(QueryError):
    """The query ran past its time limit and was interrupted."""

    transient = True


class QueryUnavailable(QueryError):
    """The database could not be read just now: cannot open, locked, I/O error, no memory."""

    transient = True


class QueryTooManyRows(QueryError):
    """The query returned more rows than the cap."""


class QueryTooLarge(QueryError):
    """The query's rows took more bytes than the budget (the fetch stopped there)."""


def _ro_uri(db_path: str | os.PathLike) -> str:
    path = pathlib.Path(db_path).resolve()
    if not path.is_file():
        raise QueryError(f"db_path: no database file at {str(path)!r}")
    return path.as_uri() + "?mode=ro"


def _connect(db_path: str | os.PathLike) -> sqlite3.Connection:
    try:
        conn = sqlite3.connect(_ro_uri(db_path), uri=True, isolation_level=None)
    except sqlite3.Error as e:
        raise QueryUnavailable(f"cannot open {db_path!r} read-only: {e}") from e
    try:
        # Set before the authorizer exists: from then on PRAGMA is denied.
        conn.execute("PRAGMA query_only = ON")
        conn.execute("PRAGMA trusted_schema = OFF")
    except sqlite3.Error as e:
        conn.close()
        raise QueryUnavailable(f"cannot open {db_path!r} read-only: {e}") from e
    if hasattr(conn, "setlimit"):
        for name, value in SQLITE_LIMITS.items():
            category = getattr(sqlite3, "SQLITE_LIMIT_" + name, None)
            if category is not None:
                conn.setlimit(category, value)
    if hasattr(conn, "enable_load_extension"):
        conn.enable_load_extension(False)
    return conn


class _Sandbox:
    """Authorizer and progress handler for one query; remembers why it refused or stopped."""

    def __init__(self, timeout_s: float):
        self.deadline = time.monotonic() + timeout_s
        self.timed_out = False
        self.refused: str | None = None
        self.reads: list[tuple[str, str]] = []  # (table, column) as SQLite resolves them
        self._schema_step = False

    def authorize(self, action, arg1, arg2, dbname, source):
        if action == _SQLITE_READ:
            if (
                self._schema_step
                and (arg1 or "").lower() in _SCHEMA_TABLES
                and (arg2 or "").lower() == "rowid"
            ):
                self._schema_step = False  # SQLite's own read, not the query's
                return sqlite3.SQLITE_OK
            self._schema_step = False
            if (arg1 or "").lower().startswith("pragma_"):  # pragma_table_info(...) etc.
                self.refused = self.refused or f"PRAGMA function {arg1} is not allowed"
                return sqlite3.SQLITE_DENY
            self.reads.append((arg1 or "", arg2 or ""))
            return sqlite3.SQLITE_OK
        if (
            action == _SQLITE_UPDATE
            and (arg1 or "").lower() in _SCHEMA_TABLES
            and (arg2 or "").lower() in _SCHEMA_STEP_COLUMNS
            and source is None
        ):
            self._schema_step = True  # declaring a table-valued function (see above)
            return sqlite3.SQLITE_OK
        self._schema_step = False
        if action in (_SQLITE_SELECT, _SQLITE_RECURSIVE):
            return sqlite3.SQLITE_OK
        if action == _SQLITE_FUNCTION:
            if (arg2 or "").lower() in DENIED_FUNCTIONS:
                self.refused = self.refused or f"function {arg2}() is not allowed"
                return sqlite3.SQLITE_DENY
            return sqlite3.SQLITE_OK
        name = _ACTION_NAMES.get(action, f"action {action}")
        self.refused = self.refused or f"{name} is not allowed (read-only sandbox)"
        return sqlite3.SQLITE_DENY

    def progress(self) -> int:
        if time.monotonic() > self.deadline:
            self.timed_out = True
            return 1  # non-zero interrupts the statement
        return 0


def _first_keyword(query: str) -> str:
    """The first word of ``query`` after whitespace, comments and opening parentheses."""
    i, n = 0, len(query)
    while i < n:
        ch = query[i]
        if ch.isspace() or ch == "(":
            i += 1
        elif query.startswith("--", i):
            j = query.find("\n", i)
            i = n if j < 0 else j + 1
        elif query.startswith("/*", i):
            j = query.find("*/", i + 2)
            i = n if j < 0 else j + 2
        else:
            break
    j = i
    while j < n and query[j].isascii() and query[j].isalpha():
        j += 1
    return query[i:j].upper()


def _check_query_text(query: Any) -> str:
    if not isinstance(query, str):
        raise QueryRefused(f"query: expected a string, got {type(query).__name__}")
    if len(query) > MAX_QUERY_CHARS:
        raise QueryRefused(f"query: {len(query)} characters, more than {MAX_QUERY_CHARS}")
    if "\x00" in query:
        raise QueryRefused("query: contains a NUL character")
    word = _first_keyword(query)
    if not word:
        raise QueryRefused("query: empty or not a statement")
    if word not in ("SELECT", "WITH", "VALUES"):
        raise QueryRefused(f"query: only SELECT, WITH or VALUES queries are allowed, got {word}")
    return query


def run_readonly(
    db_path: str | os.PathLike,
    query: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
    compile_only: bool = False,
    reads: list[tuple[str, str]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> list[tuple]:
    """Run one read-only query against the SQLite file ``db_path`` and return its rows.

    Every query of the SQL verifiers, gold or generated, goes through here.

    Args:
        db_path: path of an existing SQLite database; opened read-only.
        query: a single SELECT / WITH / VALUES statement (one trailing ``;`` allowed).
        timeout_s: wall-clock limit; the query is interrupted past it.
        max_rows: at most this many rows are returned.
        compile_only: only compile the query (under ``EXPLAIN``, so nothing runs) and
            return ``[]``; the same checks and refusals apply.
        reads: if given, receives the ``(table, column)`` pairs the query reads, as SQLite
            resolves them (``column`` is ``""`` for a whole-table read such as COUNT(*)).
        max_bytes: the rows may take at most this many bytes (their Python size, see
            `rows_bytes`); rows are fetched one at a time and the fetch stops past it.

    Raises:
        QueryRefused: the query is not a single read-only statement.
        QueryTimeout: it ran longer than ``timeout_s``.
        QueryTooManyRows: it returned more than ``max_rows`` rows.
        QueryTooLarge: its rows took more than ``max_bytes`` bytes.
        QueryError: any other failure (syntax, unknown table or column, missing file).
        ValueError: ``timeout_s``, ``max_rows`` or ``max_bytes`` is out of range.
    """
    rows, _ = run_readonly_sized(
        db_path,
        query,
        timeout_s=timeout_s,
        max_rows=max_rows,
        compile_only=compile_only,
        reads=reads,
        max_bytes=max_bytes,
    )
    return rows


def _value_bytes(v: Any) -> int:
    return 0 if v is None else sys.getsizeof(v)  # None is a shared singleton


def rows_bytes(rows: Iterable[tuple]) -> int:
    """The memory a list of fetched rows holds: each tuple, its values and a list slot."""
    return sum(sys.getsizeof(r) + 8 + sum(map(_value_bytes, r)) for r in rows)


def run_readonly_sized(
    db_path: str | os.PathLike,
    query: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_rows: int = DEFAULT_MAX_ROWS,
    compile_only: bool = False,
    reads: list[tuple[str, str]] | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
) -> tuple[list[tuple], int]:
    """`run_readonly`, also returning the rows' size in bytes (see `rows_bytes`)."""
    if not (isinstance(timeout_s, (int, float)) and timeout_s > 0 and math.isfinite(timeout_s)):
        raise ValueError(f"timeout_s: expected a positive finite number, got {timeout_s!r}")
    if not (isinstance(max_rows, int) and max_rows >= 0):
        raise ValueError(f"max_rows: expected a non-negative int, got {max_rows!r}")
    if not (isinstance(max_bytes, int) and not isinstance(max_bytes, bool) and max_bytes > 0):
        raise ValueError(f"max_bytes: expected a positive int, got {max_bytes!r}")
    query = _check_query_text(query)
    conn = _connect(db_path)
    box = _Sandbox(timeout_s)
    try:
        conn.set_authorizer(box.authorize)
        conn.set_progress_handler(box.progress, PROGRESS_STEPS)
        try:
            cur = conn.execute(("EXPLAIN " + query) if compile_only else query)
            rows: list[tuple] = []
            nbytes = 0
            if not compile_only:
                for row in cur:  # one row at a time: memory stops at the budget
                    nbytes += sys.getsizeof(row) + 8 + sum(map(_value_bytes, row))
                    if nbytes > max_bytes:
                        n = len(rows)
                        rows.clear()
                        raise QueryTooLarge(
                            f"result larger than {max_bytes} bytes (over budget) after {n} rows"
                        )
                    rows.append(row)
                    if len(rows) > max_rows:
                        break
        except sqlite3.ProgrammingError as e:  # several statements, among others
            raise QueryRefused(f"{e}") from e
        except sqlite3.DatabaseError as e:
            if box.refused is not None:
                raise QueryRefused(box.refused) from e
            if box.timed_out:
                raise QueryTimeout(f"interrupted after {timeout_s:g} s") from e
            if any(m in str(e) for m in _WRITE_ERRORS):  # SQLite refused a write itself
                raise QueryRefused(f"{e} (read-only sandbox)") from e
            if (getattr(e, "sqlite_errorcode", 0) or 0) & 0xFF in _UNAVAILABLE_CODES:
                raise QueryUnavailable(f"{type(e).__name__}: {e}") from e
            raise QueryError(f"{type(e).__name__}: {e}") from e
        except MemoryError as e:
            raise QueryUnavailable(f"{type(e).__name__}: {e}") from e
        except (OverflowError, ValueError) as e:
            raise QueryError(f"{type(e).__name__}: {e}") from e
        if len(rows) > max_rows:
            raise QueryTooManyRows(f"more than {max_rows} rows")
        if reads is not None:
            reads.extend(box.reads)
        return rows, nbytes
    finally:
        conn.close()


def referenced_columns(
    db_path: str | os.PathLike, query: str, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> set[tuple[str, str]]:
    """The (table, column) pairs ``query`` reads, found by compiling it without running it
    (`run_readonly` with ``compile_only=True``); raises the same errors."""
    reads: list[tuple[str, str]] = []
    run_readonly(db_path, query, timeout_s=timeout_s, compile_only=True, reads=reads)
    return set(reads)
