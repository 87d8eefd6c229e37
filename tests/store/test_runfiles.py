"""No module but runfiles spells a run-directory name where it builds a path."""

import ast
from pathlib import Path

import pytest

from async_rl.store import runfiles

PACKAGE = Path(__file__).resolve().parents[2] / "async_rl"

# names that are unambiguous anywhere in code (a dot in them): a literal that is exactly one of
# them, or one of them with formatting (".lock.p{i}"), is a path; so is any "....jsonl"/".jrn"
FILE_NAMES = ("config.yaml", "data.json", "final.json", "reward.png", "wandb.json", ".lock", ".checkpointed",
              ".restarting", ".probe", "env.json")
LOG_ENDINGS = (".jsonl", ".jrn")
# plain words: only where they build a path (`x / "tb"`, a glob or Path argument)
FOLDER_NAMES = ("checkpoints", "journal", "tb", "previous", "damaged", "wandb", "lineage", "metrics",
                "drops", "rollouts", "env_errors")
PATH_CALLS = {"glob", "rglob", "Path", "joinpath", "with_name", "run_path", "open", "exists", "is_file", "is_dir",
              "read", "size", "cut", "remove", "write_atomic", "write_if_changed", "listdir", "mkdirs", "move"}


def _text(node) -> str | None:
    """A string literal's text; an f-string's with `{}` for each value."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _is_file_name(text: str) -> bool:
    if " " in text:
        return False  # prose in a message
    if text.endswith(LOG_ENDINGS):
        return True
    return any(text == name or (text.startswith(name) and text[len(name)] in ".{*-") for name in FILE_NAMES)


def _in_path_context(node, parents) -> bool:
    parent = parents.get(node)
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    if isinstance(parent, ast.Call) and node in parent.args:
        f = parent.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        return name in PATH_CALLS
    return False


def spelled_names(source: str, filename: str = "<src>") -> list[str]:
    """`file:line: literal` for each run-directory name `source` spells as a path."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)}
    inner = {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}
    out = []
    for node in ast.walk(tree):
        text = _text(node)
        if text is None or id(node) in docstrings or id(node) in inner:
            continue
        if _is_file_name(text) or (text in FOLDER_NAMES and _in_path_context(node, parents)):
            out.append(f"{filename}:{node.lineno}: {text!r}")
    return out


def test_no_module_spells_a_run_file_name():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "runfiles.py":
            found += spelled_names(path.read_text(), f"async_rl/{path.name}")
    assert not found, "run.dir names spelled outside async_rl/store/runfiles.py:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    'p = run_dir / "metrics.jsonl"',
    'p = run_dir / f"lineage.p{i}.jsonl"',
    'p = run_dir / f"drops{suffix}.jsonl"',
    'logs = storage.glob(run, "lineage*.jsonl")',
    'p = run_dir / "checkpoints"',
    'p = run_dir / "journal" / f"p{i}"',
    'writer = EventWriter(run_dir / "tb")',
    'STATE = "wandb.json"',
    'lock = run_dir / (".lock" if i == 0 else f".lock.p{i}")',
    'rundir.write_atomic(run / "final.json", text)',
    'x = Path(run_dir, "wandb")',
])
def test_the_check_finds_a_spelled_name(code):
    assert spelled_names(code), code


@pytest.mark.parametrize("code", [
    'log("metrics.jsonl has every metric")',  # prose
    'row = {"what": "journal", "reason": "stale"}',  # a record's field, not a path
    'LOGS = ("lineage", "drops", "rollouts")',
    'def f():\n    """Writes final.json."""',
    'key = f"{n}_bytes"',
])
def test_the_check_leaves_prose_and_fields(code):
    assert not spelled_names(code), code


def test_names_per_process(tmp_path):
    assert runfiles.lineage(tmp_path).name == "lineage.jsonl"
    assert runfiles.metrics(tmp_path, 3).name == "metrics.p3.jsonl"
    assert runfiles.lock(tmp_path, 0).name == ".lock" and runfiles.lock(tmp_path, 2).name == ".lock.p2"
    assert [runfiles.lock_process(runfiles.lock(tmp_path, i)) for i in (0, 1, 12)] == [0, 1, 12]
    for kind in runfiles.LOGS:
        for i in (0, 1, 7):
            assert runfiles.process_of_log(runfiles.log_name(kind, i)) == i
            assert runfiles.process_of_log(runfiles.log_name(kind, i), kind) == i
            assert tmp_path.joinpath(runfiles.log_name(kind, i)).match(runfiles.log_glob(kind))
    assert runfiles.process_of_log("lineage.p1.jsonl", "drops") == -1
    assert runfiles.process_of_log("notes.jsonl") == -1
    assert runfiles.journal_segment(runfiles.journal_dir(tmp_path, 1), 5) == tmp_path / "journal" / "p1" / "00000005.jrn"
