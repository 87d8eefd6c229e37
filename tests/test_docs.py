"""The README is a front page and the docs say what exists: links, make targets, files,
cited tests, config keys and subcommands they quote are checked against the tree."""
import ast
import dataclasses
import re
from pathlib import Path

from async_rl import config as C
from async_rl.run import cli

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _lines():
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            yield f"{page.relative_to(ROOT)}:{n}", line


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 15_000, f"README.md is {len(text.encode())} bytes (at most 15,000)"
    docs = set(re.findall(r"\]\((docs/[\w.-]+\.md)", text))
    assert len(docs) >= 6, docs


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        prose = re.sub(r"(?s)```.*?```", "", page.read_text())  # links live outside code blocks
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if target.startswith(("http:", "https:", "mailto:", "#")):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            if not path.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target}")
    assert not bad, bad


def test_quoted_make_targets_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"(?m)^([\w-]+):", makefile))
    quoted = {t for page in PAGES for t in re.findall(r"`make ([\w-]+)", page.read_text())}
    assert quoted - targets == set(), quoted - targets


def test_quoted_files_exist():
    pattern = r"(?<![\w/.-])((?:bench|configs|launch|tests|async_rl)/[\w/.-]+\.(?:py|yaml|sh|txt))"
    missing = sorted({f"{where}: {p}" for where, line in _lines() for p in re.findall(pattern, line)
                      if not (ROOT / p).exists()})
    assert not missing, missing


def _test_names(file: str) -> set[str]:
    tree = ast.parse((ROOT / "tests" / file).read_text())
    return {n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")}


def test_cited_tests_exist():
    """`test_x.py::test_name`, and a following `::test_other` on the same line (same file),
    must name a test function of that file: a renamed or moved test leaves no dead citation."""
    cite = re.compile(r"(test_\w+\.py)(?:::(\w+))?|`::(\w+)")
    names: dict[str, set[str]] = {}
    missing = []
    for where, line in _lines():
        file = None
        for m in cite.finditer(line):
            file = m.group(1) or file
            name = m.group(2) or m.group(3)
            if file is None or not name or not (ROOT / "tests" / file).exists():
                continue  # a file of its own is test_quoted_files_exist's
            if name not in names.setdefault(file, _test_names(file)):
                missing.append(f"{where}: {file}::{name}")
    assert not missing, missing


def test_quoted_overrides_are_config_fields():
    """Every `group.field=` the docs quote names a field of that config group."""
    fields = {f.name: {g.name.rstrip("_") for g in dataclasses.fields(getattr(C, f.type))}
              for f in dataclasses.fields(C.Config)}
    override = re.compile(r"(?<![\w./-])(" + "|".join(fields) + r")\.(\w+)=")
    bad = [f"{where}: {m.group(0)}" for where, line in _lines() for m in override.finditer(line)
           if m.group(2) not in fields[m.group(1)]]
    assert not bad, bad


def test_quoted_subcommands_exist():
    commands = set(re.findall(r'add_parser\("(\w+)"', Path(cli.__file__).read_text()))
    quoted = {c for _, line in _lines() for c in re.findall(r"async-rl (\w+)", line)}
    assert quoted <= commands, quoted - commands
