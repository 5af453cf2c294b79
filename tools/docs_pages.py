"""The parts of the documentation derived from the code: the README's "API at a glance" table
(from the op catalog, ``mrtpo_kernels.OPS``), the op and settings tables of the backends page,
the ``mrtpo train`` / ``mrtpo compare`` flag tables (from the fields of ``TrainConfig`` and
``CompareConfig``), docs/trl.md's tables of ``MRTPOConfig``'s fields and of the logged
metrics (from ``mrtpo.integrations.trl_grpo``'s option descriptions and metric names) and
the index of the claim records under records/.

The site's build (tools/gen_docs.py, run by mkdocs-gen-files) fills each page's
``<!-- generated: NAME -->`` marker with ``section(NAME)``. The README's table sits between
``<!-- api -->`` and ``<!-- /api -->``:

    python tools/docs_pages.py readme           # rewrite the README's table from the catalog
    python tools/docs_pages.py readme --check   # exit 1 if it differs (tests/test_docs.py)
    python tools/docs_pages.py show NAME        # print one generated section
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import MISSING, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere in the checkout
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(r"<!-- generated: ([a-z-]+) -->")
API_START, API_END = "<!-- api -->", "<!-- /api -->"
BACKENDS = ("torch", "cpu", "triton", "cuda")

# MRTPO_* variables read by the trainer (mrtpo/), beside the kernels' (mrtpo_kernels.settings)
TRAINER_VARIABLES = {
    "MRTPO_CACHE": (
        "(unset)",
        "the per-user cache folder of converted and warm-started models "
        "(`mrtpo.model.builtin.user_cache_dir`); unset: `$XDG_CACHE_HOME/mrtpo`, else "
        "`~/.cache/mrtpo`; `--cache-dir` overrides it for one run",
    ),
    "MRTPO_DATA_DIR": (
        "(unset)",
        "the trainer's data cache folder (the text-to-SQL shop database, `mrtpo/tasks/data`); "
        "unset: `<tmp>/mrtpo-data-<uid>`",
    ),
    "MRTPO_TEST_KILL_AT": (
        "(unset)",
        "tests only: `POINT[:STEP]` kills the trainer with SIGKILL at that point of a "
        "checkpoint save (tests/test_checkpoint.py)",
    ),
}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _summary(fn) -> str:
    """The first sentence of a function's docstring, on one line."""
    first = " ".join((fn.__doc__ or "").strip().split("\n\n")[0].split())
    m = re.match(r"(.+?[.:;])(\s|$)", first)
    return (m.group(1) if m else first).rstrip(".:;")


def api_table() -> str:
    """The README's "API at a glance": each public op, what it does (its docstring's first
    sentence), the backends that serve it and its float64 reference."""
    import mrtpo_kernels as mk

    lines = [
        "| op | what it computes | backends | float64 reference |",
        "|---|---|---|---|",
    ]
    for op in mk.OPS.values():
        backends = ", ".join(b for b in BACKENDS if b in op.kernels)
        lines.append(
            f"| [`{op.name}`](docs/api.md#mrtpo_kernels.{op.name}) | "
            f"{_cell(_summary(getattr(mk, op.name)))} | {backends} | "
            f"`reference.{op.reference}` |"
        )
    return "\n".join(lines)


def settings_table() -> str:
    """Every variable of ``mrtpo_kernels.settings.SETTINGS``: name, default, meaning."""
    from mrtpo_kernels import settings

    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for s in settings.SETTINGS.values():
        default = s.default if s.default else "(unset)"
        lines.append(f"| `{s.name}` | {_cell(default)} | {_cell(s.meaning)} |")
    return "\n".join(lines)


def trainer_settings_table() -> str:
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, (default, meaning) in TRAINER_VARIABLES.items():
        lines.append(f"| `{name}` | {default} | {_cell(meaning)} |")
    return "\n".join(lines)


def op_table() -> str:
    from mrtpo_kernels import _catalog

    return _catalog.markdown()


def _flag_rows(default, *, skip=(), prefix_note=None) -> list[str]:
    from mrtpo.training.cli_args import flag_of
    from mrtpo.training.config import TrainConfig, model_default_note, value_kind

    rows = []
    for f in fields(default):
        md = f.metadata
        if f.name in skip or md.get("cli") is False:
            continue
        value = getattr(default, f.name)
        if hasattr(value, "__dataclass_fields__"):
            keep = md.get("nested")
            inner = [g.name for g in fields(value) if keep is not None and g.name not in keep]
            rows += _flag_rows(value, skip=inner)
            continue
        help_text = md["help"]
        if "(default" in help_text or (f.default is MISSING and f.default_factory is not MISSING):
            shown = "see meaning" if "(default" in help_text else ""
        elif value_kind(f) == "bool":
            shown = "off"
        elif value is None:
            shown = "-"
        else:
            shown = ",".join(value) if value_kind(f) == "algos" else str(value)
            if isinstance(default, TrainConfig):
                shown += model_default_note(f.name)
        accepts = ""
        if md.get("choices"):
            accepts = ", ".join(md["choices"])
        elif md.get("lo") is not None or md.get("hi") is not None:
            lo, hi = md.get("lo"), md.get("hi")
            left = "(" if md.get("open_lo") else "["
            accepts = f"{left}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
        group = md.get("group") or ""
        rows.append(
            f"| `{flag_of(f)}` | {_cell(shown)} | {_cell(accepts)} | {group} | {_cell(help_text)} |"
        )
    return rows


def cli_flags() -> str:
    """The ``mrtpo train`` flags and the flags ``mrtpo compare`` adds, from the fields'
    metadata (the same metadata builds the parser and checks a config built in code)."""
    from mrtpo.training.config import COMPARE_FIXED, CompareConfig, TrainConfig

    head = [
        "| flag | default | accepts | group | meaning |",
        "|---|---|---|---|---|",
    ]
    train = head + _flag_rows(TrainConfig())
    compare = head + _flag_rows(CompareConfig(), skip=("train",))
    return (
        "### `mrtpo train`\n\n"
        + "\n".join(train)
        + "\n\n### `mrtpo compare`\n\n"
        + "Its own flags below; every `mrtpo train` flag but "
        + ", ".join(f"`{n}`" for n in COMPARE_FIXED)
        + " applies to each of its runs.\n\n"
        + "\n".join(compare)
    )


def _shown(value) -> str:
    return f'"{value}"' if isinstance(value, str) else str(value)


def _accepts(desc: dict) -> str:
    """What a described option accepts: its choices, its range, a positive integer, a bool."""
    kind = desc.get("kind") or type(desc["default"]).__name__
    if desc.get("choices"):
        return ", ".join(_shown(c) for c in desc["choices"])
    if kind == "bool":
        return "True, False"
    if kind == "int":
        return f"an integer >= {desc['lo']}" + (" or None" if desc["default"] is None else "")
    lo, hi = desc.get("lo"), desc.get("hi")
    left = "(" if desc.get("open_lo") else "["
    right = "inf)" if hi is None else f"{hi:g}]"  # a number is finite
    return f"{left}{'-inf' if lo is None else f'{lo:g}'}, {right}"


def trl_config() -> str:
    """MRTPOConfig's MRTPO fields, from their descriptions (``trl_grpo.config.OPTIONS``: the
    ones ``mrtpo train`` shares are ``mrtpo.training.method_options``'s, so the help is its
    help)."""
    from mrtpo.integrations.trl_grpo.config import OPTIONS, MRTPOConfig
    from mrtpo.training.method_options import METHOD_OPTIONS

    declared = {f.name: f for f in fields(MRTPOConfig)}
    lines = [
        "| field | default | accepts | meaning | `mrtpo train` flag |",
        "|---|---|---|---|---|",
    ]
    for name, desc in OPTIONS.items():
        short = name.removeprefix("mrtpo_")
        flag = f"`--{short.replace('_', '-')}`" if short in METHOD_OPTIONS else "-"
        default = _shown(declared[name].default)
        lines.append(
            f"| `{name}` | {_cell(default)} | {_cell(_accepts(desc))} | {_cell(desc['help'])} "
            f"| {flag} |"
        )
    return "\n".join(lines)


def _metric_rows(table: dict) -> list[str]:
    rows = ["| metric | definition |", "|---|---|"]
    for names, meaning in table.items():
        shown = ", ".join(f"`{n.replace('{reward}', '<reward>')}`" for n in names)
        rows.append(f"| {shown} | {_cell(meaning)} |")
    return rows


def trl_metrics() -> str:
    """What ``MRTPOGRPOTrainer`` logs (``trl_grpo.metrics``): MRTPO's metrics, TRL's as the
    trainer logs them, and the columns it adds to TRL's completions table."""
    from mrtpo.integrations.trl_grpo import metrics

    columns = ["| column | definition |", "|---|---|"] + [
        f"| `{name}` | {_cell(meaning)} |" for name, meaning in metrics.COMPLETION_COLUMNS.items()
    ]
    return "\n".join(
        ["**MRTPO's**", ""]
        + _metric_rows(metrics.OWN_METRICS)
        + ["", "**TRL's, as MRTPOGRPOTrainer logs them**", ""]
        + _metric_rows(metrics.TRL_METRICS)
        + ["", "**Columns of the completions table** (`log_completions=True`)", ""]
        + columns
    )


def _title(path: Path) -> str:
    for line in path.read_text().splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return path.stem


def _first_sentence(path: Path) -> str:
    """The first sentence of the first paragraph after the title."""
    para: list[str] = []
    for line in path.read_text().splitlines()[1:]:
        if not line.strip():
            if para:
                break
            continue
        if line.startswith(("#", "|", "```", "!", "<")):
            if para:
                break
            continue
        para.append(line.strip())
    text = " ".join(para)
    m = re.match(r"(.+?[.!?])(\s|$)", text)
    text = m.group(1) if m else text
    return text if len(text) <= 300 else text[:297] + "..."


def results_index(results: Path | None = None) -> str:
    """Every record under records/: the claim records (the folder's own Markdown
    files), then each measured table (``compare.md``, ``summary*.md``) by folder."""
    results = ROOT / "records" if results is None else results
    records = sorted(p for p in results.glob("*.md"))
    lines = ["### Claim records", "", "| record | what |", "|---|---|"]
    for p in records:
        lines.append(f"| [{_cell(_title(p))}](../records/{p.name}) | {_cell(_first_sentence(p))} |")
    tables = sorted(
        p for p in results.glob("*/**/*.md") if "scripts" not in p.relative_to(results).parts
    )
    lines += [
        "",
        "### Measured tables",
        "",
        "Each written by `mrtpo compare` (or a summary script) into its folder, beside its "
        "plot and, where kept, its runs.",
        "",
        "| table | title | first line |",
        "|---|---|---|",
    ]
    for p in tables:
        rel = p.relative_to(results).as_posix()
        lines.append(
            f"| [`{rel}`](../records/{rel}) | {_cell(_title(p))} | {_cell(_first_sentence(p))} |"
        )
    return "\n".join(lines)


SECTIONS = {
    "api": api_table,
    "ops": op_table,
    "settings": settings_table,
    "trainer-settings": trainer_settings_table,
    "cli-flags": cli_flags,
    "trl-config": trl_config,
    "trl-metrics": trl_metrics,
    "results-index": results_index,
}


def section(name: str) -> str:
    if name not in SECTIONS:
        raise ValueError(f"name: unknown generated section {name!r}; known: {sorted(SECTIONS)}")
    return SECTIONS[name]()


def fill(text: str) -> str:
    """A page's text with each ``<!-- generated: NAME -->`` marker followed by its section."""
    return MARKER.sub(lambda m: m.group(0) + "\n\n" + section(m.group(1)) + "\n", text)


def readme_with_api(readme: str) -> str:
    """The README text with the table between its api markers regenerated."""
    start, end = readme.find(API_START), readme.find(API_END)
    if start < 0 or end < start:
        raise ValueError(f"readme: expected the markers {API_START} ... {API_END}")
    return readme[: start + len(API_START)] + "\n" + api_table() + "\n" + readme[end:]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("readme", help="regenerate the README's API table")
    r.add_argument("--check", action="store_true", help="exit 1 if the README differs")
    r.add_argument("--readme", default=str(ROOT / "README.md"), help="the README file")
    s = sub.add_parser("show", help="print one generated section")
    s.add_argument("name", choices=sorted(SECTIONS))
    args = ap.parse_args(argv)
    if args.what == "show":
        print(section(args.name))
        return 0
    path = Path(args.readme)
    old = path.read_text()
    new = readme_with_api(old)
    if args.check:
        if new != old:
            print(f"{path}: the API table differs from the op catalog; run "
                  "`python tools/docs_pages.py readme`", file=sys.stderr)  # fmt: skip
            return 1
        return 0
    if new != old:
        path.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
