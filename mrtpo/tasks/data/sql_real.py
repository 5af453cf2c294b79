"""Text-to-SQL for a pretrained model (the ``sql-real`` task): three small databases the
project creates offline, questions composed from templates over them, and gold queries.

The databases (``library``, ``school``, ``company``; `SCHEMAS`) hold rows generated here
from fixed seeds (`DB_SEED`; they do not depend on the task seed). Each is built on first
use into the data cache folder (``$MRTPO_DATA_DIR``, else ``<tmp>/mrtpo-data-<uid>``) under a
name that carries a digest of its schema and rows, then made read-only (`db_path`), as the
``sql`` task's shop database is. Values that a question names are unique where the question
needs them to be (titles, names), and the columns a gold query orders by have no ties, so
every question has one answer.

Each question (`questions`) has a gold query and ``uses``: the tables and columns the
question names (``{table: [column, ...]}``; an empty list: the table itself, e.g. what is
counted), which the ``sql_columns`` reward asks the answer to read. A question whose gold
result is empty, all NULL or a single 0 is dropped (a wrong query returns those too often),
and so is any later question with the same text or the same gold query, so that splitting
the examples keeps the held-out ones disjoint from training by both (`make_examples`,
`split`).

The prompt (`prompt_for`): the output form (`FORM_INSTRUCTION`, the ``sql_form`` reward's
span), the database's tables one line each (``table(col, ...)``, the spans of
``sql_columns`` and, for the tables the gold reads, of ``sql_match``) and the question (also
``sql_match``'s). The reference (the warm start's data) is the gold query in a ```` ```sql````
block.

The databases (schemas, rows, files) are mrtpo/tasks/data/sql_real_db.py's and the question
templates mrtpo/tasks/data/sql_real_questions.py's; their public names are importable from here.
"""

from __future__ import annotations

import functools
import random

from mrtpo.tasks.data.sql_real_db import (
    ADJECTIVES,
    AUTHORS,
    CITIES,
    COUNTRIES,
    DATABASES,
    DB_SEED,
    DEPARTMENTS,
    EMPLOYEES,
    GENRES,
    LOAN_YEARS,
    MEMBERS,
    NOUNS,
    PROJECTS,
    SCHEMAS,
    STUDENTS,
    SUBJECTS,
    db_path,
    rows,
    schema_sql,
    table_columns,
)
from mrtpo.tasks.data.sql_real_questions import _QUESTIONS
from mrtpo.verifiers import Example
from mrtpo.verifiers.sql_sandbox import run_readonly

__all__ = [
    "ADJECTIVES",
    "AUTHORS",
    "CITIES",
    "COUNTRIES",
    "DATABASES",
    "DB_SEED",
    "DEPARTMENTS",
    "EMPLOYEES",
    "EVAL_FRACTION",
    "FORM_INSTRUCTION",
    "GENRES",
    "LOAN_YEARS",
    "MEMBERS",
    "NOUNS",
    "PROJECTS",
    "SCHEMAS",
    "STUDENTS",
    "SUBJECTS",
    "db_path",
    "make_examples",
    "normalize_query",
    "prompt_for",
    "questions",
    "reference_for",
    "rows",
    "schema_sql",
    "split",
    "table_columns",
]

EVAL_FRACTION = 0.2
FORM_INSTRUCTION = "Answer with one SQLite SELECT query in a ```sql code block and nothing else."


def _uninformative(result: list[tuple]) -> bool:
    """An empty result, only NULLs, or a single 0: wrong queries return these too often."""
    values = [v for row in result for v in row]
    return not values or all(v is None for v in values) or values == [0]


def questions(db: str, *, path: str | None = None) -> list[dict]:
    """The questions of database ``db`` that have an informative answer, in a fixed order:
    ``{"question", "gold", "uses", "tables"}`` (``tables``: those of ``uses``, in order)."""
    return [
        {"question": q, "gold": g, "uses": {t: list(c) for t, c in u}, "tables": [t for t, _ in u]}
        for q, g, u in _informative(db, path or db_path(db))
    ]


@functools.lru_cache(maxsize=16)
def _informative(db: str, path: str) -> tuple:
    """(question, gold, uses as pairs) of the questions whose gold result is informative,
    on the database file ``path`` (each gold query run once per process and file)."""
    out = []
    for question, gold, uses in _QUESTIONS[db](rows(db)):
        result = run_readonly(path, gold, timeout_s=5.0, max_rows=1000)
        if not _uninformative(result):
            out.append((question, gold, tuple((t, tuple(c)) for t, c in uses.items())))
    return tuple(out)


def prompt_for(db: str, question: str) -> tuple[str, dict]:
    """The prompt of ``question`` on ``db`` and its span fields: ``form_span`` (the output
    form's sentence), ``schema_spans`` (``{table: [start, end]}``, each table's line) and
    ``question_span``."""
    prompt = FORM_INSTRUCTION
    form_span = [0, len(prompt)]
    prompt += "\nTables:\n"
    schema_spans = {}
    for table, cols in table_columns(db).items():
        line = f"{table}({', '.join(cols)})"
        schema_spans[table] = [len(prompt), len(prompt) + len(line)]
        prompt += line + "\n"
    prompt += "Question: "
    question_span = [len(prompt), len(prompt) + len(question)]
    prompt += question
    return prompt, {
        "form_span": form_span,
        "schema_spans": schema_spans,
        "question_span": question_span,
    }


def reference_for(gold: str) -> str:
    """The gold response: the gold query in a ```sql block."""
    return f"```sql\n{gold}\n```"


def normalize_query(query: str) -> str:
    """A query's text compared for duplicates: whitespace collapsed, case folded, no final
    semicolon."""
    return " ".join(query.strip().rstrip(";").split()).lower()


def make_examples(*, id_prefix: str = "sql-real") -> list[Example]:
    """Every example of the task, in a fixed order: one per question of each database, a
    question whose text or gold query repeats an earlier one's left out."""
    examples: list[Example] = []
    seen_q: set[str] = set()
    seen_gold: set[str] = set()
    for db in DATABASES:
        path = db_path(db)
        for i, q in enumerate(questions(db, path=path)):
            key_q, key_gold = " ".join(q["question"].lower().split()), normalize_query(q["gold"])
            if key_q in seen_q or key_gold in seen_gold:
                continue
            seen_q.add(key_q)
            seen_gold.add(key_gold)
            prompt, spans = prompt_for(db, q["question"])
            examples.append(
                Example(
                    id=f"{id_prefix}-{db}-{i}",
                    prompt=prompt,
                    fields={
                        "db": db,
                        "db_path": path,
                        "question": q["question"],
                        "gold": q["gold"],
                        "gold_tables": list(q["tables"]),
                        "uses": {t: list(c) for t, c in q["uses"].items()},
                        "schema": table_columns(db),
                        **spans,
                    },
                    reference=reference_for(q["gold"]),
                )
            )
    return examples


def split(examples: list[Example], rng: random.Random) -> tuple[list[Example], list[Example]]:
    """Shuffle and split into (train, held-out): `EVAL_FRACTION` held out. The examples'
    question texts and gold queries are all distinct (`make_examples`), so the held-out
    ones share neither with training."""
    examples = list(examples)
    rng.shuffle(examples)
    n_eval = max(1, round(EVAL_FRACTION * len(examples)))
    return examples[n_eval:], examples[:n_eval]
