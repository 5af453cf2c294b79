"""The built-in text-to-SQL data: a small shop database and questions with gold queries.

The database (schema in ``shop.sql``, rows generated here from a fixed seed) is built on
first use into a cache folder (``$MRTPO_DATA_DIR``, else ``<tmp>/mrtpo-data-<uid>``) under a
name that carries a digest of its content, then made read-only. The questions are
composed from templates over the database's values; every gold query is checked to run
and to return at least one row when the task is built.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import random
import sqlite3
import tempfile

SCHEMA_SQL = pathlib.Path(__file__).with_name("shop.sql")
DB_SEED = 20260  # the database content is fixed: it does not depend on the task seed

CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Lisbon"]
FIRST_NAMES = [
    "Ada",
    "Ben",
    "Cleo",
    "Dan",
    "Eva",
    "Finn",
    "Gia",
    "Hugo",
    "Ines",
    "Jon",
    "Kai",
    "Lea",
    "Max",
    "Nia",
    "Otto",
    "Pia",
    "Quin",
    "Rosa",
    "Sam",
    "Tess",
    "Uma",
    "Vic",
    "Wes",
    "Xena",
    "Yara",
    "Zed",
    "Alma",
    "Boris",
    "Cara",
    "Dino",
    "Elsa",
    "Fred",
    "Gus",
    "Hana",
    "Ivo",
    "Jade",
    "Kurt",
    "Lina",
    "Milo",
    "Nora",
]
PRODUCTS = {
    "tools": ["hammer", "saw", "drill", "wrench", "ladder"],
    "garden": ["rake", "hose", "shovel", "planter", "mower"],
    "kitchen": ["kettle", "toaster", "blender", "pan", "knife"],
    "office": ["stapler", "lamp", "chair", "desk", "printer"],
}
YEARS = [2021, 2022, 2023, 2024]
STAFF = [
    "Anton",
    "Bea",
    "Carl",
    "Dora",
    "Emil",
    "Flora",
    "Gert",
    "Hilde",
    "Igor",
    "Jana",
    "Karl",
    "Lotte",
    "Mats",
    "Nele",
    "Olaf",
    "Petra",
    "Rudi",
    "Selma",
    "Till",
    "Ute",
]

TABLE_COLUMNS = {
    "customers": ["id", "name", "city", "age"],
    "products": ["id", "name", "category", "price"],
    "orders": ["id", "customer_id", "product_id", "quantity", "year"],
    "employees": ["id", "name", "city", "salary"],
}


def _rows() -> dict[str, list[tuple]]:
    rng = random.Random(DB_SEED)
    customers = [
        (i + 1, n, rng.choice(CITIES), rng.randint(18, 70)) for i, n in enumerate(FIRST_NAMES)
    ]
    # Distinct prices so that ordering by price has no ties.
    names = [(c, p) for c, ps in PRODUCTS.items() for p in ps]
    prices = rng.sample(range(5, 400), len(names))
    products = [(i + 1, p, c, float(prices[i]) + 0.5 * (i % 2)) for i, (c, p) in enumerate(names)]
    orders = [
        (
            i + 1,
            rng.randint(1, len(customers)),
            rng.randint(1, len(products)),
            rng.randint(1, 9),
            rng.choice(YEARS),
        )
        for i in range(160)
    ]
    employees = [
        (i + 1, n, rng.choice(CITIES), 1000 * rng.randint(25, 90)) for i, n in enumerate(STAFF)
    ]
    return {"customers": customers, "products": products, "orders": orders, "employees": employees}


def _digest() -> str:
    h = hashlib.sha256(SCHEMA_SQL.read_bytes())
    h.update(repr(sorted(_rows().items())).encode())
    return h.hexdigest()[:16]


def db_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the built-in shop database, building it first if it is not there yet."""
    return build_readonly_db("shop", _digest(), SCHEMA_SQL.read_text(), _rows(), cache_dir)


def build_readonly_db(
    name: str,
    digest: str,
    schema_sql: str,
    rows: dict[str, list[tuple]],
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """Path of the SQLite database ``name-digest.sqlite`` under ``cache_dir`` (else
    ``$MRTPO_DATA_DIR``, else a per-user temporary folder), built first from ``schema_sql`` and
    ``rows`` (table -> row tuples) when it is not there: written to a temporary file, made
    read-only, then renamed into place (atomic: concurrent builders write the same content).
    One builder for every built-in database (the shop's and sql-real's)."""
    uid = os.getuid() if hasattr(os, "getuid") else 0
    default = pathlib.Path(tempfile.gettempdir()) / f"mrtpo-data-{uid}"
    root = pathlib.Path(cache_dir or os.environ.get("MRTPO_DATA_DIR") or default)
    root.mkdir(parents=True, exist_ok=True)
    path = root / f"{name}-{digest}.sqlite"
    if path.is_file():
        return str(path)
    fd, tmp = tempfile.mkstemp(prefix=f"{name}-", suffix=".tmp", dir=root)
    os.close(fd)
    try:
        conn = sqlite3.connect(tmp)
        try:
            conn.executescript(schema_sql)
            for table, table_rows in rows.items():
                marks = ",".join("?" * len(table_rows[0]))
                conn.executemany(f"INSERT INTO {table} VALUES ({marks})", table_rows)
            conn.commit()
        finally:
            conn.close()
        os.chmod(tmp, 0o444)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return str(path)


def questions() -> list[dict]:
    """Every built-in question: ``{"question", "gold", "tables"}``, in a fixed order."""
    rows = _rows()
    out: list[dict] = []

    def add(question: str, gold: str, *tables: str) -> None:
        out.append({"question": question, "gold": gold, "tables": list(tables)})

    for c in CITIES:
        add(
            f"How many customers live in {c}?",
            f"SELECT COUNT(*) FROM customers WHERE city = '{c}'",
            "customers",
        )
        add(
            f"List the names of the customers who live in {c}.",
            f"SELECT name FROM customers WHERE city = '{c}'",
            "customers",
        )
        add(
            f"What is the average age of the customers in {c}?",
            f"SELECT AVG(age) FROM customers WHERE city = '{c}'",
            "customers",
        )
        add(
            f"How many employees work in {c}?",
            f"SELECT COUNT(*) FROM employees WHERE city = '{c}'",
            "employees",
        )
        add(
            f"What is the highest salary of the employees in {c}?",
            f"SELECT MAX(salary) FROM employees WHERE city = '{c}'",
            "employees",
        )
        add(
            f"List the employees who work in {c}.",
            f"SELECT name FROM employees WHERE city = '{c}'",
            "employees",
        )
        for y in YEARS:
            add(
                f"Which customers from {c} placed an order in {y}?",
                "SELECT DISTINCT customers.name FROM customers JOIN orders ON "
                f"orders.customer_id = customers.id WHERE customers.city = '{c}' "
                f"AND orders.year = {y}",
                "customers",
                "orders",
            )
    for cat in PRODUCTS:
        add(
            f"How many products are in the {cat} category?",
            f"SELECT COUNT(*) FROM products WHERE category = '{cat}'",
            "products",
        )
        add(
            f"List the {cat} products from the cheapest to the most expensive.",
            f"SELECT name FROM products WHERE category = '{cat}' ORDER BY price",
            "products",
        )
        add(
            f"What is the cheapest price in the {cat} category?",
            f"SELECT MIN(price) FROM products WHERE category = '{cat}'",
            "products",
        )
        for y in YEARS:
            add(
                f"How many {cat} items were ordered in {y}?",
                "SELECT SUM(orders.quantity) FROM orders JOIN products ON "
                f"orders.product_id = products.id WHERE products.category = '{cat}' "
                f"AND orders.year = {y}",
                "orders",
                "products",
            )
    for _, p, _, _ in rows["products"]:
        add(
            f"What is the price of the {p}?",
            f"SELECT price FROM products WHERE name = '{p}'",
            "products",
        )
        add(
            f"How many times was the {p} ordered?",
            "SELECT COUNT(*) FROM orders JOIN products ON orders.product_id = products.id "
            f"WHERE products.name = '{p}'",
            "orders",
            "products",
        )
    for _, n, _, _ in rows["customers"]:
        add(
            f"How many orders did {n} place?",
            "SELECT COUNT(*) FROM orders JOIN customers ON orders.customer_id = customers.id "
            f"WHERE customers.name = '{n}'",
            "orders",
            "customers",
        )
        add(
            f"In which city does {n} live?",
            f"SELECT city FROM customers WHERE name = '{n}'",
            "customers",
        )
    for y in YEARS:
        add(
            f"How many orders were placed in {y}?",
            f"SELECT COUNT(*) FROM orders WHERE year = {y}",
            "orders",
        )
    for price in (20, 50, 100, 150, 200, 250, 300):
        add(
            f"List the products that cost more than {price} dollars.",
            f"SELECT name FROM products WHERE price > {price}",
            "products",
        )
    for age in (20, 30, 40, 50, 60):
        add(
            f"How many customers are older than {age}?",
            f"SELECT COUNT(*) FROM customers WHERE age > {age}",
            "customers",
        )
    for s in (30000, 45000, 60000, 75000):
        add(
            f"List the employees who earn more than {s}.",
            f"SELECT name FROM employees WHERE salary > {s}",
            "employees",
        )
    return out
