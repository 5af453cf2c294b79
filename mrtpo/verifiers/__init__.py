"""Verifiers of the three task families: text-to-SQL, multi-constraint instructions, tools."""

from .base import Example, Span, Task, Verdict, Verifier
from .constraints import KINDS as CONSTRAINT_KINDS
from .constraints import ConstraintVerifier
from .sql import sql_verifiers
from .sql_sandbox import (
    QueryError,
    QueryRefused,
    QueryTimeout,
    QueryTooLarge,
    QueryTooManyRows,
    QueryUnavailable,
    run_readonly,
)
from .tools import parse_call, tool_verifiers

__all__ = [
    "CONSTRAINT_KINDS",
    "ConstraintVerifier",
    "Example",
    "QueryError",
    "QueryRefused",
    "QueryTimeout",
    "QueryTooLarge",
    "QueryTooManyRows",
    "QueryUnavailable",
    "Span",
    "Task",
    "Verdict",
    "Verifier",
    "parse_call",
    "run_readonly",
    "sql_verifiers",
    "tool_verifiers",
]
