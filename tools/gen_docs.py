"""Run by mkdocs-gen-files at each build of the site (mkdocs.yml): two jobs.

1. Generated pages: each page with a ``<!-- generated: NAME -->`` marker gets the section
   ``tools/docs_pages.section(NAME)`` after it (the op and settings tables, the CLI flags,
   the results index), computed from the code of this checkout.
2. Lists written GitHub's way, right under a paragraph line, get the blank line before them
   that Python-Markdown needs to see a list (`loosen_lists`); the pages themselves keep
   their text.
3. Links that leave docs/ (``../bench/results/...md``, a source file) or name a folder
   (``runs/``): the pages keep the links that work on a plain checkout; in the site each such
   link points to a copy of its target under ``repo/`` (a folder: a generated listing of its
   files), so that ``mkdocs build --strict`` resolves every link. Copied Markdown pages are
   rewritten the same way. A link whose target does not exist is left alone, and the strict
   build reports it.
"""

from __future__ import annotations

import os
import posixpath
import re
import sys
from pathlib import Path

import mkdocs_gen_files

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT))

import docs_pages  # noqa: E402

DOCS = ROOT / "docs"
LINK = re.compile(r"(!?\[[^\]\n]*\]\()([^)\s]+)(\))")
FENCE = re.compile(r"^\s*(```|~~~)")


def virtual(real: str) -> str:
    """The site path of a file of the checkout (a path relative to its root)."""
    return real[len("docs/") :] if real.startswith("docs/") else "repo/" + real


def _outside(real: str) -> bool:
    return not real.startswith("docs/")


LIST_ITEM = re.compile(r"^(\s*)([-*+]|\d+\.)\s+\S")


def loosen_lists(text: str) -> str:
    """A blank line before each list that starts right under a paragraph line (outside code
    fences), as Python-Markdown needs; GitHub renders both the same."""
    out: list[str] = []
    fenced = False
    prev = ""
    for line in text.splitlines(keepends=True):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced and LIST_ITEM.match(line) and not LIST_ITEM.match(prev):
            if prev.strip() and not prev.startswith((" ", "\t", "|", "#", ">")):
                out.append("\n")
        out.append(line)
        prev = line
    return "".join(out)


class Site:
    def __init__(self) -> None:
        self.done: set[str] = set()
        self.queue: list[str] = []

    def want(self, real: str) -> None:
        if real not in self.done:
            self.done.add(real)
            self.queue.append(real)

    def rewrite_links(self, text: str, real_page: str) -> str:
        """``text`` of the page at ``real_page`` with its out-of-docs and folder links
        pointed at their copies (queued here)."""
        here = posixpath.dirname(real_page)
        out, fenced = [], False
        for line in text.splitlines(keepends=True):
            if FENCE.match(line):
                fenced = not fenced
            if fenced or "](" not in line:
                out.append(line)
                continue
            out.append(LINK.sub(lambda m: self._link(m, here, real_page), line))
        return "".join(out)

    def _link(self, m: re.Match, here: str, real_page: str) -> str:
        target = m.group(2)
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            return m.group(0)
        path, sep, anchor = target.partition("#")
        if not path:
            return m.group(0)
        real = posixpath.normpath(posixpath.join(here, path))
        if real.startswith("../") or real == "..":
            return m.group(0)  # outside the checkout: the strict build reports it
        full = ROOT / real
        if full.is_dir():
            self.want(real + "/")
            real_target = real + "/index.md"
        elif full.is_file():
            if not _outside(real):
                return m.group(0)  # a page or file of docs/: mkdocs resolves it itself
            self.want(real)
            real_target = real
        else:
            return m.group(0)
        new = posixpath.relpath(virtual(real_target), posixpath.dirname(virtual(real_page)))
        return m.group(1) + new + sep + anchor + m.group(3)

    def emit(self, real: str) -> None:
        """Write the copy (or the folder listing) of ``real`` into the site."""
        if real.endswith("/"):
            folder = ROOT / real
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
            lines = [f"# `{real}`", "", f"The files of `{real}` in this checkout.", ""]
            for name in names:
                link = name + "index.md" if name.endswith("/") else name
                lines.append(f"- [`{name}`]({link})")
                child = real + name
                if name.endswith("/"):
                    self.want(child)
                elif _outside(child):
                    self.want(child)
            with mkdocs_gen_files.open(virtual(real + "index.md"), "w") as fh:
                fh.write("\n".join(lines) + "\n")
            return
        src = ROOT / real
        if real.endswith(".md"):
            text = loosen_lists(self.rewrite_links(src.read_text(), real))
            with mkdocs_gen_files.open(virtual(real), "w") as fh:
                fh.write(text)
        else:
            with mkdocs_gen_files.open(virtual(real), "wb") as fh:
                fh.write(src.read_bytes())


def main() -> None:
    site = Site()
    for page in sorted(DOCS.rglob("*.md")):
        real = page.relative_to(ROOT).as_posix()
        text = page.read_text()
        new = loosen_lists(site.rewrite_links(docs_pages.fill(text), real))
        if new != text:
            with mkdocs_gen_files.open(virtual(real), "w") as fh:
                fh.write(new)
            mkdocs_gen_files.set_edit_path(virtual(real), os.path.relpath(page, DOCS))
    while site.queue:
        site.emit(site.queue.pop())


main()
