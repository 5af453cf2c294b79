"""Tracked scripts and records name no one machine's absolute paths.

The house standard: scripts and records take paths as arguments or relative to the checkout,
never one machine's absolute paths. This test reads every file ``git ls-files`` lists and fails
naming each file and line that holds such a path.

Files read: all tracked files except
- ``*.jsonl`` and ``*.log``: raw output (metrics streams, logs captured on a device), which
  says where it ran and is not an instruction to anyone;
- committed run folders, ``records/**/runs/**``: copies of run output (config.json,
  metrics, logs);
- binary files (a NUL byte in the first 8 KiB, or not UTF-8), symlinks, submodules and
  tracked files missing from the working tree;
- this file, whose rule and examples must spell out the paths it looks for.

The rule: a machine path is ``/work/``, ``/root/``, ``/home/`` or ``/Users/`` anywhere, and
``/tmp/`` in a script (``.sh``, ``.bash``, ``.py``, or a file whose first line starts with
``#!``), where the slash begins a path: the character before it is none of a letter, a digit,
``_ . ~ $ } /``. So a URL (``https://github.com/org/work/x``), a path below a variable
(``$HOME/work``, ``${XDG_CACHE_HOME}/x``), a home-relative cache (``~/.cache/huggingface``)
and a relative path (``runs/home/x``) are not flagged. ``/tmp/`` in prose and records is
allowed (every machine has it, and a record quotes the command that was run, such as a
``--cache-dir`` in /tmp); a script that reads or writes a fixed /tmp path is flagged: it
should take the folder as an argument, use ``mktemp`` or a folder in the checkout.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SELF = os.path.relpath(os.path.abspath(__file__), ROOT).replace(os.sep, "/")

_START = r"(?<![A-Za-z0-9_.~$}/])"
MACHINE = re.compile(_START + r"/(?:work|root|home|Users)/")
MACHINE_IN_SCRIPT = re.compile(_START + r"/(?:work|root|home|Users|tmp)/")
SKIP_GLOBS = ("*.jsonl", "*.log", "records/*/runs/*")
SCRIPT_SUFFIXES = (".sh", ".bash", ".py")


def skipped(path: str) -> bool:
    """Output and committed run folders (fnmatch's ``*`` also crosses ``/``)."""
    return path == SELF or any(fnmatch.fnmatch(path, g) for g in SKIP_GLOBS)


def read_text(full: str) -> str | None:
    """The file's text, or None for a binary file (a NUL byte, or not UTF-8)."""
    with open(full, "rb") as f:
        data = f.read()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def is_script(path: str, text: str) -> bool:
    return path.endswith(SCRIPT_SUFFIXES) or text.startswith("#!")


def machine_paths(path: str, text: str) -> list[str]:
    """``path:line: text`` for each line holding a machine-absolute path."""
    rule = MACHINE_IN_SCRIPT if is_script(path, text) else MACHINE
    return [
        f"{path}:{n}: {line.strip()[:160]}"
        for n, line in enumerate(text.splitlines(), 1)
        if rule.search(line)
    ]


def tracked_files() -> list[str]:
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    if not os.path.exists(os.path.join(ROOT, ".git")):
        pytest.skip("not a git checkout (no .git)")
    out = subprocess.run(
        ["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    return [p for p in out.decode("utf-8", "surrogateescape").split("\0") if p]


def test_rule_examples():
    """The rule on lines it must flag and lines it must leave alone."""
    flagged = [
        ("run.sh", "W=${W:-/work/wt26}"),
        ("run.sh", "cd /root/out && ls"),
        ("run.sh", "out=/tmp/site"),
        ("notes.md", "a git worktree at /work/wt25"),
        ("notes.md", "reproduce: `python -m bench --out /root/out/bench`"),
        ("notes.md", "cp /Users/someone/x ."),
        ("notes.md", "/home/user/.cache"),
        ("tool", "#!/bin/sh\nexport PYTHONPATH=/tmp/site\n"),
    ]
    left_alone = [
        ("notes.md", "https://github.com/org/work/blob/main/x.py"),
        ("notes.md", "see https://example.com/home/ for details"),
        ("notes.md", "models are cached in ~/.cache/huggingface/hub"),
        ("notes.md", "or $HOME/work/x, ${XDG_CACHE_HOME}/home/y"),
        ("notes.md", "python -m bench --out /tmp/gpu"),
        ("run.sh", "mkdir -p runs/work/x build/home/y"),
        ("run.sh", 'W=$(cd "${1:-$(dirname "$0")/../../..}" && pwd)'),
        ("run.py", "tmp = tempfile.mkdtemp()  # under $TMPDIR/tmp/"),
    ]
    for path, text in flagged:
        assert machine_paths(path, text), (path, text)
    for path, text in left_alone:
        assert not machine_paths(path, text), (path, text)
    assert skipped("records/real_k4/runs/gdpo-seed0/config.json")
    assert skipped("bench/results/gpu-2026-12-04-h200/check/cpu_build.log")
    assert not skipped("records/real_k4/command.sh")


def test_tracked_files_name_no_machine_paths():
    found, read = [], 0
    for path in tracked_files():
        full = os.path.join(ROOT, path)
        if skipped(path) or os.path.islink(full) or not os.path.isfile(full):
            continue
        text = read_text(full)
        if text is None:
            continue
        read += 1
        found += machine_paths(path, text)
    assert read > 0, "no tracked text file was read"
    assert not found, (
        "machine-absolute paths in tracked files (take them as arguments or relative to "
        "the checkout; see this test's docstring):\n" + "\n".join(found)
    )


def test_bench_reproduce_line_names_no_machine_path():
    """bench's record writes its command line with paths under $OUT or the current
    directory made portable (a device run passes --out "$OUT/bench", an absolute path)."""
    from bench.__main__ import portable_arg

    assert portable_arg("/root/out/bench", cwd="/srv/co", out="/root/out") == "$OUT/bench"
    assert portable_arg("/root/out", cwd="/srv/co", out="/root/out") == "$OUT"
    assert portable_arg("--out=/root/out/b", cwd="/srv/co", out="/root/out") == "--out=$OUT/b"
    assert portable_arg("/srv/co/bench/x.csv", cwd="/srv/co", out="") == "bench/x.csv"
    assert portable_arg("/root/outer/x", cwd="/srv/co", out="/root/out") == "/root/outer/x"
    assert portable_arg("bench/x.csv", cwd="/srv/co", out="/root/out") == "bench/x.csv"
    assert portable_arg("--preset", cwd="/srv/co", out="/root/out") == "--preset"
