"""The documentation site's parts derived from the code (tools/docs_pages.py, tools/gen_docs.py):
every generated marker names a section, the settings and flag tables hold every variable and
flag, the metrics page defines every figure a run writes and compare prints, the results index
lists every record, and the site's link rewriting points out-of-docs links at real copies.
The strict build itself is `make docs` (.ci/run)."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import fields
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
sys.path.insert(0, str(ROOT / "tools"))

import docs_pages  # noqa: E402


def _nav_pages() -> list[str]:
    return re.findall(r":\s*([\w./-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M)


def test_every_nav_page_exists_and_every_marker_is_known():
    pages = _nav_pages()
    assert {"index.md", "api.md", "metrics.md", "trl.md", "verl.md", "openrlhf.md"} <= set(pages)
    for page in pages:
        assert (DOCS / page).is_file(), page
    for page in DOCS.rglob("*.md"):
        for name in docs_pages.MARKER.findall(page.read_text()):
            assert name in docs_pages.SECTIONS, (page, name)
    with pytest.raises(ValueError, match="name: unknown generated section"):
        docs_pages.section("nope")


def test_api_page_documents_every_public_op():
    import mrtpo_kernels as mk

    api = (DOCS / "api.md").read_text()
    for name in mk.OPS:
        assert f"::: mrtpo_kernels.{name}\n" in api, name


def test_trainer_variables_are_all_listed():
    read = set()
    for path in (ROOT / "mrtpo").rglob("*.py"):
        read |= set(re.findall(r"\b(MRTPO_[A-Z_]+)\b", path.read_text()))
    assert read == set(docs_pages.TRAINER_VARIABLES)
    page = docs_pages.fill((DOCS / "backends.md").read_text())
    for name in docs_pages.TRAINER_VARIABLES:
        assert f"| `{name}` |" in page


def test_flag_tables_hold_every_flag():
    from mrtpo.cli import build_parser

    page = docs_pages.fill((DOCS / "training.md").read_text())
    parser = build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    for command in ("train", "compare"):
        for action in subs[command]._actions:
            for flag in action.option_strings:
                if flag.startswith("--") and flag not in ("--help", "--quiet"):
                    assert f"| `{flag}` |" in page, (command, flag)
    assert "smollm2-135m-instruct: 2e-05" in page  # a built-in model's default is shown


def test_metrics_page_defines_every_figure():
    page = (DOCS / "metrics.md").read_text()
    row = json.loads((ROOT / "records" / "readme_real_model" / "metrics.jsonl")
                     .read_text().splitlines()[0])  # fmt: skip
    keys = {k.split("/")[0] + ("/<reward>" if "/" in k else "") for k in row}
    keys -= {"algo", "seed", "step"}
    keys |= {f"time.{k}" for k in row["time"]} - {"time"}
    for key in sorted(keys - {"time"}):
        assert f"`{key}`" in page, key
    # the columns and measures `mrtpo compare` prints (mrtpo/training/compare_report.py)
    for term in ("steps to target", "ratio to GDPO", "AUC", "AUC difference", "final all-pass",
                 "credit precision", "uniform share", "relevance precision", "top-token hit",
                 "rank AUC", "s/step", "rollout / replay / update", "start pass rates",
                 "held-out all-pass", "paired bootstrap", "sign-flip p-value",
                 "replay pairs / skipped"):  # fmt: skip
        assert term.lower() in page.lower(), term


def test_results_index_lists_every_record():
    index = docs_pages.results_index()
    for path in (ROOT / "records").rglob("*.md"):
        rel = path.relative_to(ROOT / "records").as_posix()
        if rel.startswith("scripts/"):
            continue
        assert f"(../records/{rel})" in index, rel


def test_cli_flag_rows_follow_the_config():
    from mrtpo.training.config import TrainConfig

    rows = docs_pages.cli_flags()
    for f in fields(TrainConfig):
        if f.name in ("tiny",):
            continue
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        assert f"| `{flag}` |" in rows, flag


def test_links_that_leave_docs_point_at_copies(tmp_path, monkeypatch):
    pytest.importorskip("mkdocs_gen_files")
    import importlib.util

    import mkdocs_gen_files

    written: dict[str, bytes | str] = {}

    class _Sink:
        def __init__(self, path, mode):
            self.path, self.mode = path, mode

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def write(self, data):
            written[self.path] = written.get(self.path, type(data)()) + data

    monkeypatch.setattr(mkdocs_gen_files, "open", lambda path, mode="r": _Sink(path, mode))
    monkeypatch.setattr(mkdocs_gen_files, "set_edit_path", lambda *a: None)
    spec = importlib.util.spec_from_file_location("gen_docs_test", ROOT / "tools" / "gen_docs.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)  # runs main(): every page of docs/ through the rewriter

    site = gen.Site()
    text = "see [cpu](../bench/results/cpu-2026-12-01-xeon.md#x) and [runs](../records/real/)\n"
    out = site.rewrite_links(text, "docs/benchmarks.md")
    assert "(repo/bench/results/cpu-2026-12-01-xeon.md#x)" in out
    assert "(repo/records/real/index.md)" in out
    assert "bench/results/cpu-2026-12-01-xeon.md" in site.done
    # code is left alone, and a missing target is left for the strict build to report
    code = "```\n[x](../nope.md)\n```\n[y](../missing.md)\n"
    assert site.rewrite_links(code, "docs/a.md") == code
    # the real build copied what the pages link outside docs/
    assert "repo/bench/results/gpu-2026-12-04-h200.md" in written
    assert "benchmarks.md" in written and "(../bench/" not in written["benchmarks.md"]


@pytest.mark.slow
def test_adding_a_task_page_runs(tmp_path, monkeypatch):
    """docs/tasks.md's code, run as written but for the step counts (1 step, 1 seed)."""
    text = (DOCS / "tasks.md").read_text()
    blocks = re.findall(r"```python\n(.*?)\n```", text, flags=re.DOTALL)
    assert len(blocks) == 3
    code = "\n".join(blocks)
    for old, new in (("warm_steps=200", "warm_steps=2"), ("steps=20,", "steps=1,"),
                     ("seeds=3, steps=50", "seeds=1, steps=2")):  # fmt: skip
        assert old in code, old
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, "docs/tasks.md", "exec"), scope)
    assert len(scope["result"].metrics) == 1
    assert set(scope["summary"]["runs"]) == {"gdpo", "mrtpo"}
    assert (tmp_path / "runs" / "cities-results" / "cities" / "compare.md").is_file()
    row = scope["result"].metrics[0]
    assert row["credit_precision"] is not None or row["pass/mentions_city"] in (0.0, 1.0)
