"""The ``sql-real`` task's three databases (``library``, ``school``, ``company``): their
schemas (`SCHEMAS`), the rows generated here from fixed seeds (`DB_SEED`; they do not depend
on the task seed) and the read-only SQLite file of each (`db_path`).

Each database is built on first use into the data cache folder (``$MRTPO_DATA_DIR``, else
``<tmp>/mrtpo-data-<uid>``) under a name that carries a digest of its schema and rows, then
made read-only, as the ``sql`` task's shop database is. Values that a question names are
unique where the question needs them to be (titles, names), and the columns a gold query
orders by have no ties, so every question has one answer. The questions over these rows are
mrtpo/tasks/data/sql_real_questions.py's; the task is mrtpo/tasks/data/sql_real.py.
"""

from __future__ import annotations

import hashlib
import os
import random

from mrtpo.tasks.data.shop import build_readonly_db

DB_SEED = 42_017  # database content is fixed: it does not depend on the task seed

# table -> [(column, SQL type)], per database; the prompt shows the column names in order
SCHEMAS: dict[str, dict[str, list[tuple[str, str]]]] = {
    "library": {
        "authors": [("id", "INTEGER"), ("name", "TEXT"), ("country", "TEXT"), ("born", "INTEGER")],
        "books": [
            ("id", "INTEGER"),
            ("title", "TEXT"),
            ("author_id", "INTEGER"),
            ("genre", "TEXT"),
            ("year", "INTEGER"),
            ("pages", "INTEGER"),
        ],
        "members": [("id", "INTEGER"), ("name", "TEXT"), ("city", "TEXT")],
        "loans": [
            ("id", "INTEGER"),
            ("book_id", "INTEGER"),
            ("member_id", "INTEGER"),
            ("year", "INTEGER"),
            ("days", "INTEGER"),
        ],
    },
    "school": {
        "students": [("id", "INTEGER"), ("name", "TEXT"), ("city", "TEXT"), ("grade", "INTEGER")],
        "courses": [
            ("id", "INTEGER"),
            ("title", "TEXT"),
            ("subject", "TEXT"),
            ("credits", "INTEGER"),
        ],
        "enrollments": [
            ("id", "INTEGER"),
            ("student_id", "INTEGER"),
            ("course_id", "INTEGER"),
            ("score", "INTEGER"),
        ],
    },
    "company": {
        "departments": [("id", "INTEGER"), ("name", "TEXT"), ("floor", "INTEGER")],
        "employees": [
            ("id", "INTEGER"),
            ("name", "TEXT"),
            ("department_id", "INTEGER"),
            ("salary", "INTEGER"),
            ("hired", "INTEGER"),
        ],
        "projects": [
            ("id", "INTEGER"),
            ("title", "TEXT"),
            ("department_id", "INTEGER"),
            ("budget", "INTEGER"),
        ],
    },
}
DATABASES = tuple(SCHEMAS)

COUNTRIES = ["France", "Japan", "Brazil", "Canada", "Egypt", "India", "Norway", "Chile"]
GENRES = ["mystery", "poetry", "history", "science", "fantasy", "travel"]
CITIES = ["Oslo", "Lyon", "Porto", "Turin", "Ghent", "Graz"]
AUTHORS = [
    "Lena Fischer",
    "Omar Haddad",
    "Mei Tanaka",
    "Paulo Lima",
    "Claire Dubois",
    "Ravi Menon",
    "Ingrid Berg",
    "Diego Rojas",
    "Sara Nilsen",
    "Kenji Mori",
    "Amara Okafor",
    "Louis Martin",
    "Ana Souza",
    "Priya Nair",
    "Henrik Dahl",
    "Lucia Vega",
    "Yuki Sato",
    "Farah Nasser",
    "Marc Leroy",
    "Nadia Ali",
]
ADJECTIVES = ["Silent", "Hidden", "Golden", "Broken", "Distant", "Last", "Winter", "Iron"]
NOUNS = ["River", "Garden", "Tower", "Letter", "Island", "Road", "Mirror", "Harbor"]
MEMBERS = [
    "Alice",
    "Bruno",
    "Chloe",
    "David",
    "Elena",
    "Felix",
    "Greta",
    "Hassan",
    "Irene",
    "Jonas",
    "Karin",
    "Leo",
    "Marta",
    "Nils",
    "Olga",
    "Pedro",
    "Rita",
    "Stefan",
    "Tara",
    "Victor",
]
STUDENTS = [
    "Aiden",
    "Bella",
    "Caleb",
    "Daisy",
    "Ethan",
    "Fiona",
    "Gavin",
    "Hazel",
    "Isaac",
    "Julia",
    "Kevin",
    "Laura",
    "Mason",
    "Nina",
    "Oscar",
    "Paula",
    "Quentin",
    "Ruby",
    "Simon",
    "Tina",
    "Umar",
    "Vera",
    "Wyatt",
    "Xenia",
    "Yusuf",
    "Zoe",
    "Adam",
    "Beth",
    "Colin",
    "Dana",
]
SUBJECTS = {
    "math": ["Algebra", "Geometry", "Statistics", "Calculus"],
    "science": ["Biology", "Chemistry", "Physics", "Astronomy"],
    "language": ["French", "Spanish", "German", "Latin"],
    "arts": ["Drawing", "Music", "Theater", "Pottery"],
}
DEPARTMENTS = ["Sales", "Legal", "Research", "Support", "Finance", "Design"]
EMPLOYEES = [
    "Abel Cruz",
    "Bianca Ruiz",
    "Carlos Mendes",
    "Dalia Haas",
    "Emre Kaya",
    "Flavia Costa",
    "Gustav Lind",
    "Helga Sorensen",
    "Ilya Petrov",
    "Jasmin Weber",
    "Kofi Mensah",
    "Lotta Aalto",
    "Mateo Silva",
    "Noor Rahman",
    "Oskar Holm",
    "Petra Novak",
    "Rafael Soto",
    "Sanne Visser",
    "Tomas Varga",
    "Una Byrne",
    "Viktor Ek",
    "Wanda Kowal",
    "Xavier Roux",
    "Yara Haddad",
]
PROJECTS = [
    "Apollo",
    "Beacon",
    "Cobalt",
    "Delta",
    "Echo",
    "Falcon",
    "Granite",
    "Horizon",
    "Indigo",
    "Juniper",
    "Keystone",
    "Lumen",
    "Meridian",
    "Nimbus",
    "Orion",
    "Polaris",
]
LOAN_YEARS = [2021, 2022, 2023, 2024]


def _rows_library(rng: random.Random) -> dict[str, list[tuple]]:
    authors = [
        (i + 1, n, rng.choice(COUNTRIES), rng.randint(1930, 1995)) for i, n in enumerate(AUTHORS)
    ]
    titles = [f"The {a} {n}" for a in ADJECTIVES for n in NOUNS]
    titles = rng.sample(titles, 40)
    years = rng.sample(range(1950, 2024), len(titles))  # distinct: ordering by year has no ties
    books = []
    for i, t in enumerate(titles):
        author = i + 1 if i < len(authors) else rng.randint(1, len(authors))  # each has one
        books.append((i + 1, t, author, rng.choice(GENRES), years[i], rng.randint(90, 620)))
    members = [(i + 1, n, rng.choice(CITIES)) for i, n in enumerate(MEMBERS)]
    loans = [
        (
            i + 1,
            rng.randint(1, len(books)),
            rng.randint(1, len(members)),
            rng.choice(LOAN_YEARS),
            rng.randint(1, 30),
        )
        for i in range(180)
    ]
    return {"authors": authors, "books": books, "members": members, "loans": loans}


def _rows_school(rng: random.Random) -> dict[str, list[tuple]]:
    students = [(i + 1, n, rng.choice(CITIES), rng.randint(9, 12)) for i, n in enumerate(STUDENTS)]
    courses = []
    for subject, titles in SUBJECTS.items():
        for t in titles:
            courses.append((len(courses) + 1, t, subject, rng.choice([2, 3, 4, 5])))
    pairs = rng.sample(
        [(s[0], c[0]) for s in students for c in courses], 150
    )  # a student takes a course at most once
    enrollments = [(i + 1, s, c, rng.randint(40, 100)) for i, (s, c) in enumerate(sorted(pairs))]
    return {"students": students, "courses": courses, "enrollments": enrollments}


def _rows_company(rng: random.Random) -> dict[str, list[tuple]]:
    departments = [(i + 1, n, rng.randint(1, 9)) for i, n in enumerate(DEPARTMENTS)]
    salaries = rng.sample(range(30, 150), len(EMPLOYEES))  # distinct: ordering has no ties
    employees = []
    for i, n in enumerate(EMPLOYEES):
        dept = i + 1 if i < len(departments) else rng.randint(1, len(departments))
        employees.append((i + 1, n, dept, 1000 * salaries[i], rng.randint(2012, 2024)))
    budgets = rng.sample(range(20, 500), len(PROJECTS))
    projects = [
        (i + 1, n, rng.randint(1, len(departments)), 1000 * budgets[i])
        for i, n in enumerate(PROJECTS)
    ]
    return {"departments": departments, "employees": employees, "projects": projects}


_ROWS = {"library": _rows_library, "school": _rows_school, "company": _rows_company}


def rows(db: str) -> dict[str, list[tuple]]:
    """Every row of database ``db``, table by table (the same on every call)."""
    if db not in SCHEMAS:
        raise ValueError(f"db: expected one of {DATABASES}, got {db!r}")
    return _ROWS[db](random.Random(f"{DB_SEED}-{db}"))


def schema_sql(db: str) -> str:
    """The CREATE TABLE statements of database ``db``."""
    out = []
    for table, cols in SCHEMAS[db].items():
        body = ",\n".join(
            f"    {c} {t}" + (" PRIMARY KEY" if c == "id" else " NOT NULL") for c, t in cols
        )
        out.append(f"CREATE TABLE {table} (\n{body}\n);")
    return "\n".join(out) + "\n"


def table_columns(db: str) -> dict[str, list[str]]:
    """``{table: [column, ...]}`` of database ``db``, as the prompt shows them."""
    return {t: [c for c, _ in cols] for t, cols in SCHEMAS[db].items()}


def _digest(db: str) -> str:
    h = hashlib.sha256(schema_sql(db).encode())
    h.update(repr(sorted(rows(db).items())).encode())
    return h.hexdigest()[:16]


def db_path(db: str, cache_dir: str | os.PathLike | None = None) -> str:
    """Path of database ``db``, building it first if it is not there yet."""
    if db not in SCHEMAS:
        raise ValueError(f"db: expected one of {DATABASES}, got {db!r}")
    return build_readonly_db(db, _digest(db), schema_sql(db), rows(db), cache_dir)
