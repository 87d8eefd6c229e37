"""`runfiles` is the run directory's one map: no other module spells a run.dir file or folder name
where it builds a path."""
import ast
from pathlib import Path

from async_rl.store import runfiles

PKG = Path(runfiles.__file__).resolve().parents[0]
while (PKG.parent / "__init__.py").exists():  # the package root, wherever runfiles lies in it
    PKG = PKG.parent
FILES = set(runfiles.MANIFESTS) | {runfiles.log(k) for k in runfiles.LOGS} | {runfiles.LOCK}
DIRS = set(runfiles.HISTORY_DIRS) | {runfiles.PREVIOUS}
PREFIXES = tuple(f"{k}." for k in runfiles.LOGS) + tuple(f"{k}*" for k in runfiles.LOGS) + (runfiles.LOCK + ".",)


def _docstrings(tree) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                out.add(id(first.value))
    return out


def _path_parts(tree):
    """String pieces used to build a path: the right side of `/`, arguments of Path(...) and of
    glob calls, and the literal pieces of f-strings in those places."""
    for node in ast.walk(tree):
        args = []
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            args = [node.right]
        elif isinstance(node, ast.Call):
            name = getattr(node.func, "attr", getattr(node.func, "id", ""))
            if name in ("Path", "glob", "joinpath", "run_path", "open_log", "is_log", "rglob"):
                args = list(node.args)
        for a in args:
            if isinstance(a, ast.Constant) and isinstance(a.value, str):
                yield a, a.value
            elif isinstance(a, ast.JoinedStr):
                yield a, "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in a.values)


def spelled(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    docs, bad = _docstrings(tree), []
    for node in ast.walk(tree):  # a file name anywhere (e.g. a constant), outside docstrings
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            v = node.value
            if v in FILES or v.startswith(PREFIXES):
                bad.append(f"{path.name}:{node.lineno}: {v!r}")
    for node, v in _path_parts(tree):  # a folder name where a path is built
        head = v.split("/")[0]
        if head in DIRS or head in FILES or head.startswith(tuple(runfiles.LOGS)):
            bad.append(f"{path.name}:{node.lineno}: {v!r}")
    return sorted(set(bad))


def test_no_run_dir_name_is_spelled_outside_the_map():
    modules = [p for p in sorted(PKG.rglob("*.py")) if p.name != "runfiles.py"]
    assert len(modules) > 40, PKG
    bad = [b for p in modules for b in spelled(p)]
    assert not bad, "spell these through async_rl.store.runfiles:\n" + "\n".join(bad)


def test_the_check_sees_a_spelled_name(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('def f(run_dir, i):\n    return run_dir / "metrics.jsonl", run_dir / f"lineage.p{i}.jsonl", '
                 'run_dir / "checkpoints"\n')
    assert len(spelled(f)) >= 3


def test_names():
    assert runfiles.log("lineage") == "lineage.jsonl" and runfiles.log("metrics", 2) == "metrics.p2.jsonl"
    assert runfiles.lock(0) == ".lock" and runfiles.lock(3) == ".lock.p3"
    assert runfiles.process_of("drops.p4.jsonl", "drops") == 4 and runfiles.process_of("drops.jsonl", "drops") == 0
    assert runfiles.process_of("lineage.p1.jsonl", "drops") == -1
