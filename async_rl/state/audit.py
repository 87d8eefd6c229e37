"""`async-rl audit RUN_DIR`: proves (or disproves) exactly-once training from a run's history.

Owns: reading `data.json` (the prompt ids a run expects per epoch), every `lineage*.jsonl`
line by line (a malformed line is an AuditError naming file and line: exit 2), `final.json`,
and the newest readable checkpoint's ledger shards, and checking the whole history:

- per epoch: every expected prompt id trained once (missing ids count once the epoch is
  complete), none twice, none outside the dataset;
- per process log: each stream ordinal once per generation, steps never going back (lines
  out of place, or a history that restarted from scratch);
- across logs: steps contiguous from 1 to the last;
- against the checkpoint (I1 at its cut): for every process, the ordinals of the lines it had
  written by then and the ordinals its ledger held are disjoint and together exactly
  0 .. next_ordinal-1; lines written after it (a live or killed run: a "pending cut", which a
  resume cuts) belong to later steps, and each to a group that ledger held or to one drawn
  after its cut;
- across process counts: a run resumed on another number of processes is a new generation
  (lines tagged `gen`, ordinals from 0 again); the checkpoint records each re-partition, and
  each process of each earlier generation is checked at the re-partition that ended it as
  above (its ledger then is what was dealt out), and every line belongs to a generation and
  process of that history.

Does not own: writing any of these (train, lineage) or their formats (checkpoint, ledger).
"""

from __future__ import annotations

import io
import json
from collections import Counter
from pathlib import Path

from async_rl.errors import UsageError
from async_rl.store import applog, runfiles, storage


class AuditError(UsageError):
    pass


_FIELDS = {"step": 1, "prompt_id": 0, "epoch": 0, "ordinal": 0}  # required int fields and their minimum


def _process_of(path: Path) -> int:
    return runfiles.process_of_log(path.name, "lineage")


def read_lineage(path: Path) -> list[tuple[int, int, dict]]:
    """(line number, byte offset after the line, row) for every line; AuditError on a bad one."""
    out, offset = [], 0
    with io.BytesIO(applog.read(path)) as f:
        for lineno, raw in enumerate(f, 1):
            offset += len(raw)
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                raise AuditError(f"{path}:{lineno}: not a JSON line ({e})") from None
            if not isinstance(row, dict):
                raise AuditError(f"{path}:{lineno}: not a JSON object")
            for k, lo in _FIELDS.items():
                v = row.get(k)
                if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                    raise AuditError(f"{path}:{lineno}: field {k!r} is {v!r}, expected an integer >= {lo}")
            out.append((lineno, offset, row))
    return out


def _manifest(run: Path) -> dict:
    manifest = run / runfiles.DATA
    if not manifest.is_file():
        raise AuditError(f"{manifest}: missing (is {run} a run directory?)")
    try:
        data = json.loads(manifest.read_text())
        data["prompt_ids"] = [int(i) for i in data["prompt_ids"]]
        data["num_epochs"] = int(data["num_epochs"])
    except (ValueError, KeyError, TypeError) as e:
        raise AuditError(f"{manifest}: malformed ({type(e).__name__}: {e})") from None
    return data


def _checkpoint(run: Path, notes: list[str]) -> dict | None:
    """{step, shards, generations} of the newest checkpoint whose ledger shards all verify (the
    one a resume would use)."""
    from async_rl.state.saved_run import read_ledgers
    got = read_ledgers(run, warn=lambda m: notes.append(m.removeprefix("warning: ")))
    if got is None:
        return None
    step, meta, shards = got
    return {"step": step, "shards": shards, "generations": meta.get("generations") or []}


def _check_file(path: Path, rows, problems: list[str]) -> None:
    """One process index's log: steps never go back; each ordinal once per generation."""
    seen: dict[tuple[int, int], int] = {}
    prev = None
    for lineno, _, r in rows:
        if prev is not None and r["step"] < prev:
            problems.append(f"{path}:{lineno}: step {r['step']} after step {prev} (a line out of place, or a "
                            "history that restarted from scratch)")
        prev = r["step"]
        key = (r.get("gen", 0), r["ordinal"])
        if key in seen:
            problems.append(f"{path}:{lineno}: ordinal {r['ordinal']} already trained at line {seen[key]}")
        seen.setdefault(key, lineno)


def _cuts(ckpt: dict) -> list[dict]:
    """Every (generation, process) whose history is pinned down: each process of each earlier
    generation at the re-partition that ended it, and each process of the newest checkpoint."""
    out = []
    for h, rec in enumerate(ckpt["generations"]):
        for p, sh in enumerate(rec["shards"]):
            out.append({"gen": h, "i": p, "next": int(sh["next_ordinal"]), "held": {int(o) for o in sh["held"]},
                        "bytes": int(sh["lineage_bytes"]), "step": int(rec["step"]), "closed": True})
    for q, snap in enumerate(ckpt["shards"]):
        held = {int(o) for o in snap.arrays["group_ints"][:, 0]} if len(snap.arrays["group_ints"]) else set()
        out.append({"gen": len(ckpt["generations"]), "i": q, "next": int(snap.header["next_ordinal"]), "held": held,
                    "bytes": int((snap.header.get("logs") or {}).get("lineage_bytes", -1)), "step": ckpt["step"],
                    "closed": False})
    return out


def _check_cut(c: dict, path: Path, rows, problems: list[str]) -> list[int]:
    """I1 at a cut: the ordinals one process of one generation logged by then and those its
    ledger held are disjoint and together exactly 0 .. next_ordinal-1; returns the steps of its
    lines after the newest checkpoint's cut (a live or killed run: a resume cuts them)."""
    s, want = c["step"], c["bytes"]
    where = f"the re-partition at step {s}" if c["closed"] else f"checkpoint step {s}"
    who = f"{path}" + (f" (generation {c['gen']})" if c["gen"] or c["closed"] else "")
    size = applog.size(path) if storage.is_remote(path) or storage.exists(path) else None
    if want >= 0 and size is not None and size < want:
        problems.append(f"{path}: {size} bytes, but {where} recorded {want}: "
                        "lines of trained groups are missing")
    mine = [(ln, end, r) for ln, end, r in rows if r.get("gen", 0) == c["gen"]]
    before = [r for _, end, r in mine if want < 0 or end <= want]
    after = [(ln, r) for ln, end, r in mine if want >= 0 and end > want]
    held, trained = c["held"], {r["ordinal"] for r in before}
    late = [r["step"] for r in before if r["step"] > s]
    if late:
        problems.append(f"{who}: lines of step {late[0]} before {where}'s cut")
    both = sorted(trained & held)
    if both:
        problems.append(f"{who}: ordinals {_ids(both)} trained and also held by the ledger of {where}")
    missing = sorted(set(range(c["next"])) - trained - held)
    if missing:
        problems.append(f"{who}: ordinals {_ids(missing)} were drawn by {where} but are neither in the log "
                        "nor in its ledger (lines missing)")
    for ln, r in after:
        if c["closed"]:
            problems.append(f"{path}:{ln}: step {r['step']} of generation {c['gen']} written after {where} ended it")
            break
        # after the cut: a group the ledger held, or one drawn after it (ordinal >= next)
        if r["step"] <= s or (r["ordinal"] not in held and r["ordinal"] < c["next"]):
            problems.append(f"{path}:{ln}: step {r['step']} ordinal {r['ordinal']} written after checkpoint step "
                            f"{s} but trained before its cut (not a group its ledger held)")
            break
    return [] if c["closed"] else [r["step"] for _, r in after]


def _check_history(ckpt: dict, files: dict, problems: list[str]) -> list[int]:
    """Every cut of the run's history (see `_cuts`), and lines no cut accounts for; returns the
    steps of the lines written after the newest checkpoint."""
    after, covered = [], set()
    for h, rec in enumerate(ckpt["generations"]):
        held = sum(len(sh["held"]) for sh in rec["shards"])
        if sum(rec["dealt"]) != held:
            problems.append(f"the re-partition at step {rec['step']} dealt {sum(rec['dealt'])} groups, but the "
                            f"ledgers it read held {held}")
    for c in _cuts(ckpt):
        path, rows = files.get(c["i"], (None, []))
        after += _check_cut(c, path or Path(runfiles.log_name("lineage", c["i"])), rows, problems)
        covered.add((c["gen"], c["i"]))
    newest, s = len(ckpt["generations"]), ckpt["step"]
    for i, (path, rows) in files.items():
        for ln, _, r in rows:
            g = r.get("gen", 0)
            if (g, i) in covered:
                continue
            if g > newest and r["step"] > s:  # an attempt on another process count killed before it saved
                after.append(r["step"])
                continue
            problems.append(f"{path}:{ln}: a line of generation {g}, which has no process {i} in the history "
                            f"of checkpoint step {s}")
            break
    return after


def audit(run_dir: str | Path) -> dict:
    run = storage.run_path(run_dir)
    data = _manifest(run)
    expected, num_epochs = set(data["prompt_ids"]), data["num_epochs"]
    problems: list[str] = []
    notes: list[str] = []
    ckpt = _checkpoint(run, notes)
    logs = sorted((p for p in storage.glob(run, runfiles.log_glob("lineage")) if _process_of(p) >= 0), key=_process_of)
    files = {_process_of(p): (p, read_lineage(p)) for p in logs}
    rows: list[dict] = [r for _, proc_rows in files.values() for _, _, r in proc_rows]
    for path, proc_rows in files.values():
        _check_file(path, proc_rows, problems)
    pending = _check_history(ckpt, files, problems) if ckpt is not None else []
    steps = {r["step"] for r in rows}
    gaps = sorted(set(range(1, max(steps, default=0) + 1)) - steps)
    if gaps:
        problems.append(f"steps with no lineage line: {_ids(gaps)}")
    final = _final(run)
    complete = set(final["complete_epochs"]) if final else set()
    if ckpt is not None and all(s.header.get("exhausted") and not len(s.arrays["group_ints"]) for s in ckpt["shards"]):
        complete |= set(range(num_epochs))  # the data ended and nothing is left untrained
    if final and rows and final.get("step") != max(steps):
        problems.append(f"final.json says step {final.get('step')}, the lineage ends at step {max(steps)}")
    epochs, ok = [], not problems
    for e in range(max(num_epochs, 1 + max((r["epoch"] for r in rows), default=-1))):
        counts = Counter(r["prompt_id"] for r in rows if r["epoch"] == e)
        missing = sorted(expected - counts.keys())
        dup = {pid: n for pid, n in sorted(counts.items()) if n > 1}
        unexpected = sorted(counts.keys() - expected)
        filtered = sum(1 for r in rows if r["epoch"] == e and r.get("filtered"))
        bad = bool(dup or unexpected or (e in complete and missing) or e >= num_epochs)
        ok &= not bad
        epochs.append({"epoch": e, "expected": len(expected), "trained_once": sum(1 for n in counts.values() if n == 1),
                       "missing": missing, "duplicated": dup, "unexpected": unexpected, "filtered": filtered,
                       "complete": e in complete, "ok": not bad})
    return {"run_dir": str(run), "ok": ok, "lines": len(rows), "last_step": max(steps, default=0),
            "finished": bool(final and final.get("reason") == "data_exhausted"), "epochs": epochs,
            "checkpoint_step": ckpt["step"] if ckpt else None, "lines_after_checkpoint": len(pending),
            "pending_cut_steps": [min(pending), max(pending)] if pending else None,
            "env_steps": _env_steps(run, rows), "problems": problems, "notes": notes}


def _env_steps(run: Path, rows: list[dict]) -> dict | None:
    """Multi-turn episodes: env steps recorded in consumed groups (their lineage lines), asked for
    (every process's env_requests log, never cut back), asked again (a step in flight at a kill,
    asked again after the resume with the same key) and asked but in no consumed episode (in
    flight, or in groups not consumed yet). None for a single-turn run."""
    keys: Counter = Counter()
    for p in storage.glob(run, runfiles.env_requests_glob()):
        for lineno, raw in enumerate(applog.read(p).splitlines(), 1):
            try:
                keys[json.loads(raw)["key"]] += 1
            except (ValueError, KeyError, TypeError, UnicodeDecodeError):
                raise AuditError(f"{p}:{lineno}: not an env request line") from None
    recorded = sum(int(r.get("env_steps", 0)) for r in rows)
    if not keys and not recorded:
        return None
    asked = sum(keys.values())
    return {"recorded": recorded, "requested": asked, "requested_again": asked - len(keys),
            "unused": max(0, len(keys) - recorded)}


def _final(run: Path) -> dict | None:
    p = run / runfiles.FINAL
    if not p.is_file():
        return None
    try:
        final = json.loads(p.read_text())
        final["complete_epochs"] = [int(e) for e in final.get("complete_epochs", [])]
        return final
    except (ValueError, TypeError, AttributeError) as e:
        raise AuditError(f"{p}: malformed ({type(e).__name__}: {e})") from None


def _ids(xs, limit=20) -> str:
    xs = list(xs)
    s = ", ".join(map(str, xs[:limit]))
    return s + (f", ... ({len(xs)} in all)" if len(xs) > limit else "")


def format_report(rep: dict) -> str:
    out = [f"audit {rep['run_dir']}: {rep['lines']} trained groups through step {rep['last_step']}"
           + (f"; checked against checkpoint step {rep['checkpoint_step']}" if rep["checkpoint_step"] is not None
              else "; no checkpoint to check against")]
    if rep["lines_after_checkpoint"]:
        lo, hi = rep["pending_cut_steps"]
        out.append(f"pending cut: {rep['lines_after_checkpoint']} lines of step{'s' if hi > lo else ''} "
                   f"{lo}{'-' + str(hi) if hi > lo else ''} were written after that checkpoint (a live or killed run); "
                   "a resume cuts them and trains those groups again")
    out += [f"note: {n}" for n in rep["notes"]]
    env = rep.get("env_steps")
    if env:
        out.append(f"env steps: {env['recorded']} recorded in consumed episodes; {env['requested']} requested, "
                   f"{env['requested_again']} of them again (in flight at a kill), {env['unused']} in no consumed "
                   "episode")
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
    out += [f"problem: {p}" for p in rep["problems"]]
    out.append(_verdict(rep))
    return "\n".join(out)


def _verdict(rep: dict) -> str:
    """What a PASS checked: the completed epochs in full, an epoch in progress only so far."""
    if not rep["ok"]:
        return "FAIL"
    done = [e["epoch"] for e in rep["epochs"] if e["complete"]]
    open_ = [f"{e['trained_once']} of {e['expected']} prompts of epoch {e['epoch']}" for e in rep["epochs"]
             if not e["complete"] and e["trained_once"]]
    so_far = f"{', '.join(open_)} trained once so far, none twice" if open_ else "nothing trained yet"
    if not done:
        return f"PASS: no epoch completed yet: {so_far}"
    whole = f"every prompt of epoch{'s' if len(done) > 1 else ''} {_ids(done)} trained exactly once"
    return f"PASS: {whole}" + (f"; {so_far}" if open_ else "")
