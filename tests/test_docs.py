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


# Heads of dotted names the docs quote that are not the package's: libraries and their objects,
# and data named like code (parameter paths, Hugging Face's and PEFT's tensor names)
FOREIGN = {"jax", "jnp", "lax", "nnx", "np", "numpy", "ocp", "orbax", "os", "sys", "etils", "epath", "fsspec", "typing",
           "wandb", "mesh_utils", "grain", "optax", "vllm", "torch", "transformers", "peft", "threading", "signal", "gc",
           "layers", "lm_head", "base_model"}
FILE_SUFFIXES = {"json", "jsonl", "yaml", "toml", "bin", "safetensors", "txt", "lock", "md", "py", "png", "sh"}
PKG = ROOT / "async_rl"


def _defined(body: list[ast.stmt]) -> dict[str, ast.AST | None]:
    """The names a module or class body binds (definitions, assignments, imports), with the
    class or function node where there is one."""
    out: dict[str, ast.AST | None] = {}
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[n.name] = n
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out |= {x.id: None for t in targets for x in ast.walk(t) if isinstance(x, ast.Name)}
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            out |= {(a.asname or a.name).split(".")[0]: None for a in n.names}
        elif isinstance(n, (ast.If, ast.Try, ast.With)):
            out |= _defined(n.body + getattr(n, "orelse", []) + getattr(n, "finalbody", []))
    return out


def _members(cls: ast.ClassDef) -> set[str]:
    """A class's attributes: its body's names and every `self.x = ...` of its methods."""
    return set(_defined(cls.body)) | {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                                      and isinstance(n.ctx, ast.Store) and getattr(n.value, "id", "") == "self"}


def _code_name_problem(parts: list[str], files: list[Path], tree) -> str:
    """Why `module.attr[.member]` (parts after the module) is in none of the module's `files`, or ""."""
    why = ""
    for f in files:
        scope = _defined(tree(f).body)
        if parts and parts[0] not in scope:
            why = f"no {parts[0]} in {f.relative_to(ROOT)}"
        elif len(parts) > 1 and isinstance(scope[parts[0]], ast.ClassDef) and parts[1] not in _members(scope[parts[0]]):
            why = f"no {parts[1]} in class {parts[0]} of {f.relative_to(ROOT)}"
        else:
            return ""
    return why


def stale_code_names(lines) -> list[str]:
    """Each quoted name of the package's code among (where, line) pairs that is not in it:
    `module`, `module.func`, `module.Class.method` (`pump.Pump._pick`), `wing.module.func`,
    `Class.member`, `wing/module.py` (and the tests' helpers: `helpers.FAST`); the attribute is looked up in the module's syntax tree
    (a class's members include what its methods assign to `self`). Config keys, file names
    and the names of libraries are not code names."""
    mods: dict[str, list[Path]] = {}
    for p in [*sorted(PKG.rglob("*.py")), *sorted((ROOT / "tests").glob("*.py"))]:  # and the tests' helpers
        mods.setdefault(p.stem, []).append(p)
    wings = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    groups = {f.name: {g.name.rstrip("_") for g in dataclasses.fields(getattr(C, f.type))}
              for f in dataclasses.fields(C.Config)}
    trees: dict[Path, ast.Module] = {}

    def tree(f: Path) -> ast.Module:
        return trees[f] if f in trees else trees.setdefault(f, ast.parse(f.read_text()))

    bad = []
    for where, line in lines:
        for path in re.findall(rf"(?<![\w/.-])((?:{'|'.join(sorted(wings))})/\w+\.py)", line):
            if not (PKG / path).is_file():
                bad.append(f"{where}: {path} (no async_rl/{path})")
        for tok in re.findall(r"`([A-Za-z_][\w.]*\.[A-Za-z_]\w*)(?:\([^`]*\))?`", line):
            parts = tok.split(".")
            head = parts[0]
            if head in FOREIGN or parts[-1] in FILE_SUFFIXES or parts[1] in groups.get(head, ()):
                continue
            if head in wings and head not in mods:
                files = [f for f in mods.get(parts[1], []) if f.parent.name == head]
                why = f"no module {parts[1]} in async_rl/{head}/" if not files else \
                    _code_name_problem(parts[2:], files, tree)
            elif head in mods:
                why = _code_name_problem(parts[1:], mods[head], tree)
            elif head[0].isupper() or head.startswith("_"):  # Class.member: a class of that name anywhere
                classes = [n for f in PKG.rglob("*.py") for n in tree(f).body
                           if isinstance(n, ast.ClassDef) and n.name == head]
                why = f"no class {head} in async_rl/" if not classes else "" if any(
                    parts[1] in _members(c) for c in classes) else f"no {parts[1]} in class {head}"
            else:
                why = f"no module {head} in async_rl/"
            if why:
                bad.append(f"{where}: {tok} ({why})")
    return bad


# Quoted bare words that name no code of the package yet are not stale: other projects' names
# and names the code makes at run time
NOT_CODE = {"qwix", "tokenizers", "apply_chat_template", "_meta", "drops_bytes"}


def _known_words() -> set[str]:
    """Every name the package, its tests and benches use (modules, definitions, attributes,
    arguments, words of string constants other than docstrings)."""
    words = {p.name for p in PKG.iterdir()} | NOT_CODE | FOREIGN
    for p in [*PKG.rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").rglob("*.py")]:
        words.add(p.stem)
        tree = ast.parse(p.read_text())
        docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(
            n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(n) is not None}
        for n in ast.walk(tree):
            words.update(v for a in ("id", "attr", "name", "arg") if isinstance(v := getattr(n, a, None), str))
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings:
                words.update(re.findall(r"[A-Za-z_]\w*", n.value))
    return words


def test_quoted_bare_names_are_known():
    """A quoted bare name (`lease`, `tool_calls`) is one the code uses: a module that was
    renamed or removed (`envs`, `tbwriter`) is caught even without a dotted attribute."""
    words = _known_words()
    bad = [f"{where}: {w}" for where, line in _lines() for w in re.findall(r"`([a-z_][a-z0-9_]*)`", line)
           if w not in words]
    assert not bad, bad


def test_design_names_every_module_in_brief():
    """design.md's "In brief" table lists each wing with exactly its modules."""
    text = (ROOT / "docs" / "design.md").read_text()
    brief = text[text.index("## In brief"):text.index("## Data flow")]
    rows = {}
    for line in brief.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`"):
            rows[cells[0].strip("`")] = set(re.findall(r"`(\w+)`", cells[1]))
    have = {"top": {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}}
    have |= {w.name: {p.stem for p in w.glob("*.py")} - {"__init__"}
             for w in PKG.iterdir() if (w / "__init__.py").exists()}
    assert rows == have, {w: (rows.get(w), have.get(w)) for w in set(rows) | set(have) if rows.get(w) != have.get(w)}


def test_quoted_code_names_exist():
    """Every module, function, class and method the docs name (design.md names each mechanism
    by `module.Class.func`) is in the package: a moved or renamed one leaves no dead name."""
    bad = stale_code_names(_lines())
    assert not bad, "\n".join(bad)


def test_a_stale_code_name_is_caught():
    lines = list(enumerate([
        "ok: `pump.Pump._maybe_swap`, `sampler._Sampler.eligible`, `rollout.pump.Pump`, `Ledger.add`, `runfiles`",
        "ok: `rollout.partial`, `final.json`, `jax.jit`, `store/lease.py`, `dataset.build_dataset(cfg)`",
        "moved: `step_items.LedgerHandler`; renamed: `pump.Pump._choose`; gone: `pump.fill`",
        "wing: `rollout.BuiltinRollout`; class: `Pump.drain`, `Lease.check`; path: `store/ckpt_layout.py`"]))
    bad = [b.split(" (")[0] for b in stale_code_names(lines)]
    assert bad == ["2: step_items.LedgerHandler", "2: pump.Pump._choose", "2: pump.fill", "3: store/ckpt_layout.py",
                   "3: rollout.BuiltinRollout", "3: Pump.drain", "3: Lease.check"], bad


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
