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
"""

from __future__ import annotations

import functools
import hashlib
import os
import random

from mrtpo.data.shop import build_readonly_db
from mrtpo.verifiers import Example
from mrtpo.verifiers.sql_sandbox import run_readonly

DB_SEED = 42_017  # database content is fixed: it does not depend on the task seed
EVAL_FRACTION = 0.2
FORM_INSTRUCTION = "Answer with one SQLite SELECT query in a ```sql code block and nothing else."

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


def _q(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


def _library(r: dict) -> list[tuple]:
    out = []

    def add(question, gold, uses):
        out.append((question, gold, uses))

    for c in COUNTRIES:
        add(
            f"How many authors are from {c}?",
            f"SELECT COUNT(*) FROM authors WHERE country = {_q(c)}",
            {"authors": ["country"]},
        )
        add(
            f"List the names of the authors from {c}.",
            f"SELECT name FROM authors WHERE country = {_q(c)}",
            {"authors": ["name", "country"]},
        )
    for g in GENRES:
        add(
            f"How many {g} books are there?",
            f"SELECT COUNT(*) FROM books WHERE genre = {_q(g)}",
            {"books": ["genre"]},
        )
        add(
            f"What is the average number of pages of the {g} books?",
            f"SELECT AVG(pages) FROM books WHERE genre = {_q(g)}",
            {"books": ["pages", "genre"]},
        )
        add(
            f"List the titles of the {g} books from the oldest to the newest.",
            f"SELECT title FROM books WHERE genre = {_q(g)} ORDER BY year",
            {"books": ["title", "genre", "year"]},
        )
        for y in LOAN_YEARS:
            add(
                f"How many times were {g} books borrowed in {y}?",
                "SELECT COUNT(*) FROM loans JOIN books ON loans.book_id = books.id "
                f"WHERE books.genre = {_q(g)} AND loans.year = {y}",
                {"loans": ["year"], "books": ["genre"]},
            )
    for _, a, _, _ in r["authors"]:
        add(
            f"How many books did {a} write?",
            "SELECT COUNT(*) FROM books JOIN authors ON books.author_id = authors.id "
            f"WHERE authors.name = {_q(a)}",
            {"books": [], "authors": ["name"]},
        )
        add(
            f"List the titles of the books written by {a}.",
            "SELECT books.title FROM books JOIN authors ON books.author_id = authors.id "
            f"WHERE authors.name = {_q(a)}",
            {"books": ["title"], "authors": ["name"]},
        )
        add(
            f"In which year was {a} born?",
            f"SELECT born FROM authors WHERE name = {_q(a)}",
            {"authors": ["born", "name"]},
        )
    for _, t, _, _, _, _ in r["books"]:
        add(
            f"Who wrote {t}?",
            "SELECT authors.name FROM authors JOIN books ON books.author_id = authors.id "
            f"WHERE books.title = {_q(t)}",
            {"authors": ["name"], "books": ["title"]},
        )
        add(
            f"In which year was {t} published?",
            f"SELECT year FROM books WHERE title = {_q(t)}",
            {"books": ["year", "title"]},
        )
        add(
            f"How many times was {t} borrowed?",
            "SELECT COUNT(*) FROM loans JOIN books ON loans.book_id = books.id "
            f"WHERE books.title = {_q(t)}",
            {"loans": [], "books": ["title"]},
        )
    for c in CITIES:
        add(
            f"How many library members live in {c}?",
            f"SELECT COUNT(*) FROM members WHERE city = {_q(c)}",
            {"members": ["city"]},
        )
        add(
            f"List the names of the library members who live in {c}.",
            f"SELECT name FROM members WHERE city = {_q(c)}",
            {"members": ["name", "city"]},
        )
    for _, m, _ in r["members"]:
        add(
            f"How many books did {m} borrow?",
            "SELECT COUNT(*) FROM loans JOIN members ON loans.member_id = members.id "
            f"WHERE members.name = {_q(m)}",
            {"loans": [], "members": ["name"]},
        )
    for y in LOAN_YEARS:
        add(
            f"How many loans were made in {y}?",
            f"SELECT COUNT(*) FROM loans WHERE year = {y}",
            {"loans": ["year"]},
        )
        add(
            f"What was the longest loan in {y}, in days?",
            f"SELECT MAX(days) FROM loans WHERE year = {y}",
            {"loans": ["days", "year"]},
        )
    for n in (200, 300, 400, 500):
        add(
            f"How many books have more than {n} pages?",
            f"SELECT COUNT(*) FROM books WHERE pages > {n}",
            {"books": ["pages"]},
        )
    for y in (1970, 1990, 2010):
        add(
            f"List the titles of the books published after {y}.",
            f"SELECT title FROM books WHERE year > {y}",
            {"books": ["title", "year"]},
        )
    return out


def _school(r: dict) -> list[tuple]:
    out = []

    def add(question, gold, uses):
        out.append((question, gold, uses))

    for c in CITIES:
        add(
            f"How many students live in {c}?",
            f"SELECT COUNT(*) FROM students WHERE city = {_q(c)}",
            {"students": ["city"]},
        )
        add(
            f"List the names of the students who live in {c}.",
            f"SELECT name FROM students WHERE city = {_q(c)}",
            {"students": ["name", "city"]},
        )
        for g in (9, 10, 11, 12):
            add(
                f"How many students in grade {g} live in {c}?",
                f"SELECT COUNT(*) FROM students WHERE grade = {g} AND city = {_q(c)}",
                {"students": ["grade", "city"]},
            )
    for g in (9, 10, 11, 12):
        add(
            f"List the names of the students in grade {g}.",
            f"SELECT name FROM students WHERE grade = {g}",
            {"students": ["name", "grade"]},
        )
    for s in SUBJECTS:
        add(
            f"How many {s} courses are there?",
            f"SELECT COUNT(*) FROM courses WHERE subject = {_q(s)}",
            {"courses": ["subject"]},
        )
        add(
            f"List the titles of the {s} courses.",
            f"SELECT title FROM courses WHERE subject = {_q(s)}",
            {"courses": ["title", "subject"]},
        )
        add(
            f"What is the total number of credits of the {s} courses?",
            f"SELECT SUM(credits) FROM courses WHERE subject = {_q(s)}",
            {"courses": ["credits", "subject"]},
        )
        add(
            f"What is the average score in the {s} courses?",
            "SELECT AVG(enrollments.score) FROM enrollments JOIN courses ON "
            f"enrollments.course_id = courses.id WHERE courses.subject = {_q(s)}",
            {"enrollments": ["score"], "courses": ["subject"]},
        )
    for _, t, _, _ in r["courses"]:
        add(
            f"How many credits is the {t} course worth?",
            f"SELECT credits FROM courses WHERE title = {_q(t)}",
            {"courses": ["credits", "title"]},
        )
        add(
            f"How many students take {t}?",
            "SELECT COUNT(*) FROM enrollments JOIN courses ON enrollments.course_id = courses.id "
            f"WHERE courses.title = {_q(t)}",
            {"enrollments": [], "courses": ["title"]},
        )
        add(
            f"What is the highest score in {t}?",
            "SELECT MAX(enrollments.score) FROM enrollments JOIN courses ON "
            f"enrollments.course_id = courses.id WHERE courses.title = {_q(t)}",
            {"enrollments": ["score"], "courses": ["title"]},
        )
        add(
            f"What is the average score in {t}?",
            "SELECT AVG(enrollments.score) FROM enrollments JOIN courses ON "
            f"enrollments.course_id = courses.id WHERE courses.title = {_q(t)}",
            {"enrollments": ["score"], "courses": ["title"]},
        )
    for _, n, _, _ in r["students"]:
        add(
            f"How many courses does {n} take?",
            "SELECT COUNT(*) FROM enrollments JOIN students ON "
            f"enrollments.student_id = students.id WHERE students.name = {_q(n)}",
            {"enrollments": [], "students": ["name"]},
        )
        add(
            f"What is the average score of {n}?",
            "SELECT AVG(enrollments.score) FROM enrollments JOIN students ON "
            f"enrollments.student_id = students.id WHERE students.name = {_q(n)}",
            {"enrollments": ["score"], "students": ["name"]},
        )
        add(
            f"In which grade is {n}?",
            f"SELECT grade FROM students WHERE name = {_q(n)}",
            {"students": ["grade", "name"]},
        )
    for s in (60, 80, 90):
        add(
            f"How many enrollments have a score above {s}?",
            f"SELECT COUNT(*) FROM enrollments WHERE score > {s}",
            {"enrollments": ["score"]},
        )
    return out


def _company(r: dict) -> list[tuple]:
    out = []

    def add(question, gold, uses):
        out.append((question, gold, uses))

    join = "FROM employees JOIN departments ON employees.department_id = departments.id"
    pjoin = "FROM projects JOIN departments ON projects.department_id = departments.id"
    for d in DEPARTMENTS:
        add(
            f"On which floor is the {d} department?",
            f"SELECT floor FROM departments WHERE name = {_q(d)}",
            {"departments": ["floor", "name"]},
        )
        add(
            f"How many employees work in the {d} department?",
            f"SELECT COUNT(*) {join} WHERE departments.name = {_q(d)}",
            {"employees": [], "departments": ["name"]},
        )
        add(
            f"List the employees of the {d} department.",
            f"SELECT employees.name {join} WHERE departments.name = {_q(d)}",
            {"employees": ["name"], "departments": ["name"]},
        )
        add(
            f"What is the average salary in the {d} department?",
            f"SELECT AVG(employees.salary) {join} WHERE departments.name = {_q(d)}",
            {"employees": ["salary"], "departments": ["name"]},
        )
        add(
            f"Who earns the most in the {d} department?",
            f"SELECT employees.name {join} WHERE departments.name = {_q(d)} "
            "ORDER BY employees.salary DESC LIMIT 1",
            {"employees": ["name", "salary"], "departments": ["name"]},
        )
        add(
            f"How many projects does the {d} department run?",
            f"SELECT COUNT(*) {pjoin} WHERE departments.name = {_q(d)}",
            {"projects": [], "departments": ["name"]},
        )
        add(
            f"What is the total budget of the {d} department's projects?",
            f"SELECT SUM(projects.budget) {pjoin} WHERE departments.name = {_q(d)}",
            {"projects": ["budget"], "departments": ["name"]},
        )
    for _, n, _, _, _ in r["employees"]:
        add(
            f"What is the salary of {n}?",
            f"SELECT salary FROM employees WHERE name = {_q(n)}",
            {"employees": ["salary", "name"]},
        )
        add(
            f"In which year was {n} hired?",
            f"SELECT hired FROM employees WHERE name = {_q(n)}",
            {"employees": ["hired", "name"]},
        )
        add(
            f"In which department does {n} work?",
            f"SELECT departments.name {join} WHERE employees.name = {_q(n)}",
            {"departments": ["name"], "employees": ["name"]},
        )
    for _, p, _, _ in r["projects"]:
        add(
            f"What is the budget of project {p}?",
            f"SELECT budget FROM projects WHERE title = {_q(p)}",
            {"projects": ["budget", "title"]},
        )
        add(
            f"Which department runs project {p}?",
            f"SELECT departments.name {pjoin} WHERE projects.title = {_q(p)}",
            {"departments": ["name"], "projects": ["title"]},
        )
    for y in (2015, 2018, 2020, 2022):
        add(
            f"How many employees were hired after {y}?",
            f"SELECT COUNT(*) FROM employees WHERE hired > {y}",
            {"employees": ["hired"]},
        )
    for s in (50000, 80000, 110000):
        add(
            f"List the employees who earn more than {s}.",
            f"SELECT name FROM employees WHERE salary > {s}",
            {"employees": ["name", "salary"]},
        )
    return out


_QUESTIONS = {"library": _library, "school": _school, "company": _company}


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
