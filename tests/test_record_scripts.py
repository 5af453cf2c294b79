"""The record scripts of records/scripts/ find the checkout from where they sit, and the
engines record's tables are what its script computes from its committed JSON."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "records" / "scripts"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"record_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, attr", [("engine_runs", "ROOT"), ("trl_conformance", "REPO")])
def test_record_scripts_resolve_the_checkout_root(name, attr):
    assert getattr(_load(name), attr) == ROOT


def test_engines_record_holds_the_tables_its_script_computes():
    table = _load("engine_runs").table(ROOT / "records" / "engines_smollm2")
    record = (ROOT / "records" / "engines_smollm2" / "RESULTS.md").read_text()
    assert "| fsdp2 | FSDP | fsdp2 |" in table and "| zero3 | DEEPSPEED | zero3 |" in table
    assert table in record


def test_engines_table_needs_the_ddp_reference(tmp_path):
    with pytest.raises(SystemExit, match="ddp.json is missing"):
        _load("engine_runs").table(tmp_path)
