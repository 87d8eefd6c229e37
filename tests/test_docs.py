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


SEGMENT = r"\w+(?:\[[^\]\s`]+\])?"
CITATION = re.compile(rf"(?<![\w/.-])((?:tests/)?(?:\w+/)*test_\w+\.py)((?:::{SEGMENT})*)"  # file::[Class::]test[id]
                      rf"|(?<![\w.\]])((?:::{SEGMENT})+)")  # `::test`: the last file cited on the line


def _test_file(cited: str) -> tuple[Path | None, str]:
    """The file a citation names: `tests/wing/test_x.py` as written, a bare `test_x.py` by its one
    match under tests/."""
    if "/" in cited:
        path = ROOT / cited
        return (path, "") if path.is_file() else (None, "no such file")
    found = sorted((ROOT / "tests").rglob(cited))
    if len(found) != 1:
        return None, "no such file under tests/" if not found else f"{len(found)} files of that name under tests/"
    return found[0], ""


def _param_strings(tree: ast.Module, func: ast.FunctionDef) -> set[str] | None:
    """Every constant a test's `parametrize` marks hold (the pieces pytest joins with `-` into an
    id), following names bound at module level; None if a mark builds its values some other way."""
    assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Name)}
    found: set[str] = set()
    for dec in func.decorator_list:
        if "parametrize" not in ast.unparse(dec):
            continue
        nodes = [dec]
        for node in ast.walk(dec):
            if isinstance(node, ast.Name) and node.id in assigned:
                nodes.append(assigned[node.id])
            elif isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.IfExp)):
                return None
        found |= {str(c.value) for n in nodes for c in ast.walk(n) if isinstance(c, ast.Constant)}
    return found


def _id_is_made_of(ident: str, pieces: set[str]) -> bool:
    """Whether `ident` is pieces joined by `-`, as pytest writes a parametrized id."""
    ends = {0}
    for i in range(1, len(ident) + 1):
        if any(ident[j:i] in pieces and (i == len(ident) or ident[i] == "-") for j in ends):
            ends.add(i + 1)
    return len(ident) + 1 in ends


def _cited_name_problem(path: Path, parts: list[str]) -> str:
    """Why `Class::test[id]` (or `test[id]`) is not in the test file at `path`, or ""."""
    tree = ast.parse(path.read_text())
    scope: list[ast.stmt] = tree.body
    for n, part in enumerate(parts):
        name, _, ident = part.partition("[")
        node = next((s for s in scope if isinstance(s, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                     and s.name == name), None)
        if node is None:
            return f"no {name} in it"
        if isinstance(node, ast.ClassDef):
            if n == len(parts) - 1:
                return "" if name.startswith("Test") else f"{name} is not a test class"
            scope = node.body
            continue
        if n != len(parts) - 1 or not name.startswith("test"):
            return f"{name} is not a test"
        if ident:
            pieces = _param_strings(tree, node)
            if pieces is not None and not _id_is_made_of(ident.rstrip("]"), pieces):
                return f"{name} has no parameter id [{ident}"
    return ""


def stale_citations(lines) -> list[str]:
    """Each test citation among (where, line) pairs that names a missing file, class, test or
    parameter id: `tests/wing/test_x.py::test_a`, `test_x.py::Class::test_b[id]`, and a following
    `::test_c` on the same line continuing the file cited before it."""
    bad = []
    for where, line in lines:
        path = None
        for m in CITATION.finditer(line):
            if m.group(1):
                path, why = _test_file(m.group(1))
                if path is None:
                    bad.append(f"{where}: {m.group(1)} ({why})")
                    continue
                parts = m.group(2)
            elif path is None:
                bad.append(f"{where}: {m.group(3)} (no test file cited before it on the line)")
                continue
            else:
                parts = m.group(3)
            if parts and (why := _cited_name_problem(path, parts[2:].split("::"))):
                bad.append(f"{where}: {path.relative_to(ROOT)}{parts} ({why})")
    return bad


def test_cited_tests_exist():
    """Every test the README and docs cite exists: file, class, test and parameter id, so a
    renamed or moved test leaves no dead citation; a test quoted by name alone exists somewhere
    under tests/ (better cited with its file, which this checks)."""
    bad = stale_citations(_lines())
    assert not bad, "\n".join(bad)
    tests = {n.name for p in (ROOT / "tests").rglob("test_*.py") for n in ast.walk(ast.parse(p.read_text()))
             if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}
    named = [f"{where}: {name}" for where, line in _lines()
             for name in re.findall(r"(?<![\w:./-])`(test_\w+)(?:\[[^\]`]+\])?`", line) if name not in tests]
    assert not named, named


def test_a_stale_citation_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("ok: `tests/test_docs.py::test_cited_tests_exist`, `::test_readme_is_a_front_page`\n"
                    "renamed: `tests/test_docs.py::test_cited_tests_exist`, `::test_no_such_thing`\n"
                    "bare: `test_crash.py::test_no_such_crash`; moved: `tests/test_crash.py::test_x`\n"
                    "id: `test_objstore_faults.py::test_store_stops_answering_mid_run[frozen]`\n"
                    "id ok: `test_objstore_faults.py::test_store_stops_answering_mid_run[paused-sigterm]`\n"
                    "class: `test_docs.py::TestNothing::test_a`\n"
                    "orphan: `::test_cited_tests_exist`\n")
    lines = [(f"page.md:{n}", line) for n, line in enumerate(page.read_text().splitlines(), 1)]
    bad = stale_citations(lines)
    assert [b.split(" (")[0] for b in bad] == [
        "page.md:2: tests/test_docs.py::test_no_such_thing",
        "page.md:3: tests/run/test_crash.py::test_no_such_crash",
        "page.md:3: tests/test_crash.py",
        "page.md:4: tests/store/test_objstore_faults.py::test_store_stops_answering_mid_run[frozen]",
        "page.md:6: tests/test_docs.py::TestNothing::test_a",
        "page.md:7: ::test_cited_tests_exist"], bad


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
