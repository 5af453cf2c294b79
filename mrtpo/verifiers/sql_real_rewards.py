"""The ``sql-real`` task's two further rewards (`sql_real_verifiers` in
mrtpo/verifiers/sql.py): the output form (``sql_form``, `OutputForm`) and the tables and
columns the question names (``sql_columns``, `NamedColumns`).

They read these further `Example.fields`: ``form_span`` (``[start, end]``, the prompt's
sentence that asks for the form) and ``uses`` (``{table: [column, ...]}``, what the question
names; an empty list: the table itself).
"""

from __future__ import annotations

import re

from .base import Example, Span, Verdict, find_fence
from .sql_common import MAX_RESPONSE_CHARS, _cached_refs, _spans, _SQLVerifier

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
