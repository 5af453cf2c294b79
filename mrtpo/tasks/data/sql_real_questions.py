"""The ``sql-real`` task's question templates: per database, questions composed over its rows
(mrtpo/tasks/data/sql_real_db.py), each with its gold query and ``uses``: the tables and columns the
question names (``{table: [column, ...]}``; an empty list: the table itself, e.g. what is
counted), which the ``sql_columns`` reward asks the answer to read.

``_QUESTIONS[db](rows)`` gives ``(question, gold, uses)`` triples, in a fixed order;
mrtpo/tasks/data/sql_real.py keeps those whose gold result is informative.
"""

from __future__ import annotations

from mrtpo.tasks.data.sql_real_db import (
    CITIES,
    COUNTRIES,
    DEPARTMENTS,
    GENRES,
    LOAN_YEARS,
    SUBJECTS,
)


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
