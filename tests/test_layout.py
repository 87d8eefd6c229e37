"""The package's shape: wings in data-flow order, imports pointing down it, no cycles, small modules."""
import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "async_rl"
# data-flow order: a wing imports only wings before it (and the top-level cross-cutting modules)
WINGS = ("store", "data", "env", "model", "buffer", "rollout", "learner", "state", "obs", "plan", "run")
TOP = {"__init__", "__main__", "config", "config_groups", "errors", "signals", "faults", "usercode"}


def _modules():
    return {".".join(p.relative_to(PKG).with_suffix("").parts): p for p in PKG.rglob("*.py")}


def _imports(path: Path, module: str, *, top_level_only: bool):
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    pkg_parts = module.split(".")[:-1] if not path.name == "__init__.py" else module.split(".")
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[:len(pkg_parts) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "async_rl":
                name = node.module[len("async_rl."):] if node.module != "async_rl" else ""
            else:
                continue
            yield from ((name + "." + a.name).strip(".") for a in node.names)
            yield name
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("async_rl."):
                    yield a.name[len("async_rl."):]


def _resolve(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def test_wings_and_top_level():
    wings = [p.name for p in PKG.iterdir() if (p / "__init__.py").exists()]
    assert set(wings) <= set(WINGS) and len(wings) >= 6, wings
    top = {p.stem for p in PKG.glob("*.py")}
    assert top <= TOP and len(top) <= 8, top - TOP
    for w in wings:
        doc = ast.get_docstring(ast.parse((PKG / w / "__init__.py").read_text()))
        assert doc and len(doc.split()) >= 15, f"async_rl/{w}/__init__.py needs a paragraph saying what it owns"


def test_no_module_over_700_lines():
    big = {m: n for m, p in _modules().items() if (n := len(p.read_text().splitlines())) > 700}
    assert not big, big


def test_no_function_over_80_lines():
    long = [f"{m}.{n.name}: {n.end_lineno - n.lineno + 1} lines" for m, p in _modules().items()
            for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > 80]
    assert not long, long


def test_imports_point_down_the_wings():
    mods = _modules()
    bad = []
    for m, p in mods.items():
        w = m.split(".")[0]
        for dep in _imports(p, m, top_level_only=False):
            target = _resolve(dep, mods)
            if target is None:
                continue
            tw = target.split(".")[0]
            if tw in TOP or tw == w or target == "__init__":
                continue
            if w in TOP and m not in ("__main__",):
                bad.append(f"top-level {m} imports {target}")
            elif w in WINGS and WINGS.index(tw) > WINGS.index(w):
                bad.append(f"{m} ({w}) imports {target} ({tw}), a later wing")
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of `graph` with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out = []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            part = stack[stack.index(m):]
            del stack[stack.index(m):]
            if len(part) > 1:
                out.append(sorted(part))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at the top of the file or deferred inside a
    function (a deferred import is still a dependency, only a later one)."""
    mods = _modules()
    return {m: {t for d in _imports(p, m, top_level_only=False)
                if (t := _resolve(d, mods)) and t != m and not t.endswith("__init__")}
            for m, p in mods.items()}


def test_no_import_cycle():
    cycles = _cycles(import_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_a_deferred_import_cycle_is_caught():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
