"""Result rows: the CSV columns, appending rows, reading them back."""

from __future__ import annotations

import csv
import os

COLUMNS = (
    "date",
    "commit",
    "device",
    "torch",
    "triton",
    "op",
    "provider",
    "N",
    "d",
    "V",
    "K",
    "responses",
    "dtype",
    "repeats",
    "ms_p20",
    "ms_p50",
    "ms_p80",
    "tflops",
    "gb_per_s",
    "peak_mem_mb",
    "extra_mem_mb",
    "status",
    "note",
    "cpu_ms_p50",
    "load_avg",
    "pred_ms",
    "gemm_path",
)

# status values: ok (measured), estimated (would not fit: memory columns hold the estimate),
# unavailable (provider not installed / backend not built), unsupported (provider has no
# such op or device), oom, error, timeout
STATUSES = ("ok", "estimated", "unavailable", "unsupported", "oom", "error", "timeout")


def append_rows(path: str, rows: list[dict], columns: tuple = COLUMNS, digits: int = 4) -> None:
    """Append rows to the CSV at ``path``, writing the header if the file is new.

    ``columns`` names the CSV columns (the bench table's by default); floats are written with
    ``digits`` significant digits below ``10**digits`` and with one decimal at or above it.
    """
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            w.writeheader()
        for r in rows:
            w.writerow({c: _fmt(r.get(c, ""), digits) for c in columns})


def _fmt(x, digits: int = 4):
    if isinstance(x, float):
        return f"{x:.{digits}g}" if abs(x) < 10**digits else f"{x:.1f}"
    return "" if x is None else x


def read_rows(path: str) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def num(row: dict, key: str) -> float | None:
    """A numeric field of a row read back from CSV (None when empty)."""
    v = row.get(key, "")
    if v in ("", None):
        return None
    try:
        return float(v)
    except ValueError:
        return None
