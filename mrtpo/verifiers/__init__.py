"""Verifiers of the three task families: text-to-SQL, multi-constraint instructions, tools."""

from .base import Example, Span, Task, Verdict, Verifier

__all__ = ["Example", "Span", "Task", "Verdict", "Verifier"]
