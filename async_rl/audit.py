"""`async-rl audit RUN_DIR`: proves (or disproves) exactly-once training from the lineage log.

Owns: reading `data.json` (the prompt ids a run expects per epoch), every
`lineage*.jsonl` (one line per consumed group, across all restarts; the log follows the
checkpoint, so it is the model's history), and `final.json` (which epochs a cleanly
ended run completed); and reporting per epoch: expected, trained once, missing,
duplicated. Does not own: writing any of these (train, metrics).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

from .metrics import read_jsonl


class AuditError(ValueError):
    pass


def audit(run_dir: str | Path) -> dict:
    run = Path(run_dir)
    manifest = run / "data.json"
    if not manifest.exists():
        raise AuditError(f"{manifest}: missing (is {run} a run directory?)")
    data = json.loads(manifest.read_text())
    expected = set(int(i) for i in data["prompt_ids"])
    num_epochs = int(data["num_epochs"])
    rows: list[dict] = []
    for path in sorted(run.glob("lineage*.jsonl")):
        try:
            rows.extend(read_jsonl(path))
        except json.JSONDecodeError as e:
            raise AuditError(f"{path}: not valid JSON lines ({e})") from None
    final_path = run / "final.json"
    final = json.loads(final_path.read_text()) if final_path.exists() else None
    complete = set(final["complete_epochs"]) if final else set()
    epochs = []
    ok = True
    for e in range(max(num_epochs, 1 + max((r["epoch"] for r in rows), default=-1))):
        counts = Counter(int(r["prompt_id"]) for r in rows if r["epoch"] == e)
        missing = sorted(expected - counts.keys())
        dup = {pid: n for pid, n in sorted(counts.items()) if n > 1}
        unexpected = sorted(counts.keys() - expected)
        filtered = sum(1 for r in rows if r["epoch"] == e and r.get("filtered"))
        is_complete = e in complete
        bad = bool(dup or unexpected or (is_complete and missing) or e >= num_epochs)
        ok &= not bad
        epochs.append({"epoch": e, "expected": len(expected), "trained_once": sum(1 for n in counts.values() if n == 1),
                       "missing": missing, "duplicated": dup, "unexpected": unexpected, "filtered": filtered,
                       "complete": is_complete, "ok": not bad})
    steps = [r["step"] for r in rows]
    return {"run_dir": str(run), "ok": ok, "lines": len(rows), "last_step": max(steps, default=0),
            "finished": bool(final and final.get("reason") == "data_exhausted"), "epochs": epochs}


def _ids(xs, limit=20) -> str:
    xs = list(xs)
    s = ", ".join(map(str, xs[:limit]))
    return s + (f", ... ({len(xs)} in all)" if len(xs) > limit else "")


def format_report(rep: dict) -> str:
    out = [f"audit {rep['run_dir']}: {rep['lines']} trained groups through step {rep['last_step']}"]
    out.append(f"{'epoch':>5} {'expected':>9} {'once':>9} {'missing':>9} {'duplicated':>11} {'status':>12}")
    for e in rep["epochs"]:
        status = "ok" if e["ok"] else "FAIL"
        if e["ok"] and not e["complete"]:
            status = "in progress" if e["missing"] else "ok"
        out.append(f"{e['epoch']:>5} {e['expected']:>9} {e['trained_once']:>9} {len(e['missing']):>9} "
                   f"{len(e['duplicated']):>11} {status:>12}")
        if e["duplicated"]:
            out.append(f"      duplicated ids (count): {_ids(f'{k}({v})' for k, v in e['duplicated'].items())}")
        if e["missing"] and (e["complete"] or not e["ok"]):
            out.append(f"      missing ids: {_ids(e['missing'])}")
        if e["unexpected"]:
            out.append(f"      ids not in the dataset: {_ids(e['unexpected'])}")
    out.append("PASS: every prompt of every completed epoch trained exactly once" if rep["ok"] else "FAIL")
    return "\n".join(out)
