"""The rollout journal: every finished sample on disk, so a SIGKILL wastes no finished generation.

Owns: appending each finished, rewarded sample (epoch, prompt_id, sample index, stream
ordinal, tokens, behaviour logprobs, per-token versions, reward, and routes under routing
replay) to this process's segment files under `run.dir/journal/p<i>/`, checksummed per
record, written at once and fsynced in batches by a background thread; reading them back
on start-up (a torn tail is cut, a corrupt record skipped, each with a warning and a
`drops.jsonl` line); supplying a journaled sample to a group the ledger holds again after
a restore, when it passes the checks below, instead of the engine generating it; rotating
segments at each checkpoint cut and deleting those a committed checkpoint made obsolete.
Does not own: what is trained (the ledger, the sampler and the lineage decide; a
journaled sample only replaces generation of a sample the ledger already asks for), the
rules a sample's versions must satisfy (`sampler.fits`, `sampler.required_version`), the
pump's loop, or the bytes of a record (`journal_format`).

A journaled sample is used for sample j of a group only if: the group's (epoch, prompt_id)
and j match, its prompt tokens match (crc32), it was written under the same sampling
settings (segment header), its first tokens (and routes) are the restored partial
sample's, the stream ordinal matches when the process layout (and data partition
generation) is unchanged, and its versions fit the sampler's bound for the group
(deterministic mode: exactly the version the engine would use, same ordinal). It is
applied once every version it names is published, so no ledger token ever names weights
the run does not have. See docs/design.md, "Rollout journal".
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from async_rl import signals
from async_rl.buffer.journal_format import (
    FORMAT,
    Entry,
    Segment,
    encode_episode,
    encode_header,
    encode_sample,
    layout_of,
    prompt_crc,
    read_segment,
    signature,
)
from async_rl.buffer.ledger import Group, Sample, State
from async_rl.store import applog, remote_io, runfiles, storage
from async_rl.store.applog import AppendLog
from async_rl.store.rundir import LockLostError


@dataclass
class Usage:
    groups: set = field(default_factory=set)  # (epoch, prompt_id) that received journaled samples
    samples: int = 0
    tokens: int = 0  # tokens supplied (beyond a restored partial sample's)
    env_steps: int = 0  # env steps of multi-turn episodes supplied (never requested again)
    unused: Counter = field(default_factory=Counter)  # reason -> samples not used


def segment_files(directory) -> list:
    """The segments in one process's journal folder, oldest first (each a log: `applog`)."""
    names = [n for n in storage.listdir(directory) if runfiles.JOURNAL_SEGMENT.fullmatch(n)]
    return [directory / n for n in sorted(names, key=lambda n: int(n[:-4]))]


class Journal:
    """This process's journal: writes this session's finished samples, replays earlier ones.

    Thread use: `claim`, `apply`, `idle`, `append`, `rotate` run under the ledger lock (pump
    thread, or the main thread at start-up and at the cut); `flush` on the journal's writer
    thread, fdatasync on its sync thread. `_lock` orders the buffer and the open segment."""

    def __init__(self, run_dir, *, process_index: int, process_count: int, sig: dict, step: int,
                 fsync_every_s: float, bound: int, deterministic: bool, log, drop, generation: int = 0):
        self.root = run_dir / runfiles.JOURNAL
        self.dir = runfiles.journal_dir(run_dir, process_index)
        self.layout = (generation, process_index, process_count)
        self.sig, self.every, self.bound = sig, fsync_every_s, bound
        self.deterministic, self.log, self.drop = deterministic, log, drop
        self.index: dict[tuple[int, int], list[Entry]] = {}
        self.waits: dict[int, dict[int, tuple[Group, Entry]]] = {}  # ordinal -> sample -> (group, entry)
        self.usage = Usage()
        self.sampler = self.ledger = None
        self.latest = step
        self.write_s = 0.0  # time the pump's reward thread spent encoding and queueing records
        self.sync_s = 0.0  # time the sync thread spent in fdatasync
        self._lock = threading.Lock()  # the buffer and which segment is open
        self._sync_lock = threading.Lock()  # fdatasync, and closing file descriptors
        self._buf: list[bytes] = []
        self._old: dict = {}  # files of earlier sessions -> newest v_min they hold
        self._closed: dict[AppendLog, int | None] = {}  # segments of this session closed -> the cut that closed them
        self._failed = False
        self._sync_failing = False  # the last sync failed (one warning per outage)
        storage.mkdirs(self.dir)
        self._load()
        files = segment_files(self.dir)
        self._seq = int(files[-1].stem) if files else 0
        self._seg = self._open(step)
        # writes happen on a thread of their own: a write releases the GIL, and the pump would
        # then wait for it back (measured: ~0.5 ms per write at a 1 ms switch interval)
        self._stop, self._wake = threading.Event(), threading.Event()
        self._threads = [threading.Thread(target=self._write_loop, name="journal-write", daemon=True)]
        if self.every > 0:
            self._threads.append(threading.Thread(target=self._sync_loop, name="journal-sync", daemon=True))
        for t in self._threads:
            t.start()

    # ---- reading back (start-up) ---------------------------------------------------------

    def _load(self) -> None:
        _, pi, pc = self.layout
        for d in storage.glob(self.root, runfiles.JOURNAL_PROCESS_GLOB):
            m = runfiles.JOURNAL_PROCESS.fullmatch(d.name)
            j = int(m.group(1)) if m else -1
            owner = j == pi or (pi == 0 and j >= pc)  # process 0 looks after directories no process owns
            for path in segment_files(d):
                seg = read_segment(path)
                # another process's files only matter when another layout wrote them (its groups
                # may have been dealt to this process since)
                layout = layout_of(seg.header)
                if j != pi and (seg.header is None or (layout[0], layout[2]) == (self.layout[0], pc)):
                    continue
                self._take(seg, owner)

    def _take(self, seg: Segment, owner: bool) -> None:
        rel = f"{seg.path.parent.name}/{seg.path.name}"
        if owner:
            self._old[seg.path] = seg.max_vmin
            for off, n in seg.corrupt:
                self.log(f"warning: journal {rel}: {n} corrupt bytes at offset {off} skipped")
                self.drop([{"step": self.latest, "reason": "corrupt", "what": "journal", "file": rel,
                            "offset": off, "bytes": n}])
            if seg.torn is not None:
                off, n = seg.torn
                applog.cut(seg.path, off)
                self.log(f"warning: journal {rel}: cut a torn tail of {n} bytes at offset {off} (a write the "
                         "crash interrupted)")
                self.drop([{"step": self.latest, "reason": "corrupt", "what": "journal", "file": rel,
                            "offset": off, "bytes": n, "cut": True}])
        if not seg.entries:
            return
        why = self._mismatch(seg.header)
        if why:
            if owner:
                self.log(f"warning: journal {rel}: {len(seg.entries)} samples not used ({why})")
                self.drop([{"step": self.latest, "reason": "mismatch", "what": "journal", "file": rel,
                            "samples": len(seg.entries), "why": why}])
            return
        for e in seg.entries:
            # too old for any group a run at this step still has (the same rule as `compact`)
            if self.latest - e.vmin <= self.bound:
                self.index.setdefault((e.epoch, e.prompt_id), []).append(e)

    def _mismatch(self, header: dict | None) -> str:
        if header is None or header.get("format") != FORMAT:
            return "no readable header"
        saved = header.get("signature", {})
        diff = [f"{k}: {saved.get(k)!r} -> {v!r}" for k, v in self.sig.items() if saved.get(k) != v]
        return "generated under other settings: " + "; ".join(diff) if diff else ""

    def available(self) -> tuple[int, int, int]:
        """(groups, samples, tokens) the journal holds for groups not yet claimed."""
        es = [e for v in self.index.values() for e in v]
        return len(self.index), len(es), sum(len(e.tokens) for e in es)

    # ---- replay (under the ledger lock) ---------------------------------------------------

    def attach(self, ledger, sampler) -> None:
        self.ledger, self.sampler = ledger, sampler

    def claim(self, g: Group, latest: int) -> None:
        """`g` entered the ledger (drawn, or restored): its unfinished samples that the journal
        holds are filled now, or once the weights they name are published."""
        cands = self.index.pop((g.epoch, g.prompt_id), None)
        if not cands:
            return
        self.latest = max(self.latest, latest)
        by_sample: dict[int, list[Entry]] = {}
        for e in cands:
            by_sample.setdefault(e.sample, []).append(e)
        for si, es in sorted(by_sample.items()):
            if si >= len(g.samples):
                self._unused(g, si, es[0], "mismatch", f"sample {si} of a group of {len(g.samples)}")
            elif not g.samples[si].done:  # a done sample is in the checkpoint already
                self._choose(g, si, es, latest)

    def _choose(self, g: Group, si: int, es: list[Entry], latest: int) -> None:
        first_failure, waiting = None, None
        # the furthest first (finished, then most env steps), then the freshest
        for e in sorted(es, key=lambda e: (not e.done, -e.turns, -e.vmin)):
            why = self._check(g, g.samples[si], e, latest)
            if why is None:
                self._fill(g, si, e)
                return
            if why == "wait":
                waiting = waiting or e
                if e.episode is not None:  # taking a nearer record now would ask its later env steps again
                    break
            elif why != "superseded":
                first_failure = first_failure or (e, *why)
        if waiting is not None:
            self.waits.setdefault(g.ordinal, {})[si] = (g, waiting)
        elif first_failure is not None:
            self._unused(g, si, *first_failure)

    def _check(self, g: Group, s: Sample, e: Entry, latest: int):
        """None (use it), "wait" (its weights are not published yet), "superseded" (an episode's
        progress the restored sample has already) or (reason, why)."""
        if e.prompt_crc != prompt_crc(g.prompt_tokens):
            return "mismatch", "prompt tokens differ"
        if not (np.isfinite(e.logprobs).all() and (np.isfinite(e.reward) or not e.done)):
            # made by weights that had diverged (a session stopped on a non-finite loss)
            return "non_finite", "non-finite behaviour logprobs or reward"
        same = e.layout == self.layout
        if (same or self.deterministic) and e.ordinal != g.ordinal:
            return "mismatch", f"stream ordinal {e.ordinal}, the group has {g.ordinal}"
        k = len(s.tokens)
        if not e.done and e.turns <= len(s.turns) and len(e.tokens) <= k:
            return "superseded"  # an env step's progress the checkpoint already has
        further = len(e.tokens) > k or e.turns > len(s.turns) or (e.done and not s.done)
        if not further or (k and not (e.tokens[:k].tolist() == s.tokens and e.versions[:k].tolist() == s.versions
                                      and np.array_equal(e.logprobs[:k], np.asarray(s.logprobs, np.float32)))):
            return "mismatch", f"does not continue the checkpoint's {k} tokens of this sample"
        if s.turns and [t["key"] for t in (e.episode or {}).get("turns", [])[:len(s.turns)]] != \
                [t["key"] for t in s.turns]:
            return "mismatch", "does not continue the checkpoint's env steps of this sample"
        why = _routes_mismatch(g, s, e)
        if why:
            return "mismatch", why
        if self.deterministic:
            req = self.sampler.required_version(g)
            if e.vmin != req or e.vmax != req:
                return "mismatch", f"made by versions {e.vmin}..{e.vmax}; deterministic mode makes it with {req}"
        elif not self.sampler.fits(g, e.vmin, e.vmax, latest):
            return "stale", f"made by versions {e.vmin}..{e.vmax}, outside the sampler's bound now"
        return "wait" if e.vmax > latest else None

    def apply(self, latest: int) -> None:
        """Fills the waiting samples whose weights are now published (checked again: a
        staleness bound may have passed meanwhile)."""
        self.latest = max(self.latest, latest)
        for o in list(self.waits):
            per = self.waits[o]
            for si in [si for si, (_, e) in per.items() if e.vmax <= latest]:
                g, e = per.pop(si)
                why = self._check(g, g.samples[si], e, latest)
                if why is None:
                    self._fill(g, si, e)
                elif why not in ("wait", "superseded"):
                    self._unused(g, si, e, *why)
            if not per:
                del self.waits[o]

    def idle(self, latest: int, groups_per_step: int) -> None:
        """The pump has nothing to do. Under fifo/windowed the learner may need the waiting
        groups to train the very step that would publish their weights: generate them instead.
        (in_order cannot wait on itself: a group stamped t names versions <= t - 1.)"""
        if not self.waits or self.sampler.name == "in_order":
            return
        if sum(g.state == State.READY for g in self.ledger.groups.values()) >= groups_per_step:
            return
        for per in self.waits.values():
            for si, (g, e) in per.items():
                self._unused(g, si, e, "ahead", f"made by version {e.vmax}, newer than the run's {latest}, "
                             "and the learner needs the group first")
        self.waits.clear()

    def waiting(self, ordinal: int, si: int) -> bool:
        per = self.waits.get(ordinal)
        return per is not None and si in per

    def _fill(self, g: Group, si: int, e: Entry) -> None:
        s = g.samples[si]
        k = len(s.tokens)  # in place: a checkpoint capture may hold this sample's lists
        s.tokens.extend(e.tokens[k:].tolist())
        s.logprobs.extend(e.logprobs[k:].tolist())
        s.versions.extend(e.versions[k:].tolist())
        m = s.n_routes
        if e.routes is not None and len(e.routes) > m:  # appended too: the sample's rows so far are the record's
            s.routes.append(e.routes[m:].copy())
        if e.episode is not None:
            self.usage.env_steps += e.turns - len(s.turns)
            s.set_episode(e.episode)
        s.done, s.reward = e.done, float(e.reward) if e.done else None
        self.usage.groups.add((g.epoch, g.prompt_id))
        self.usage.samples += e.done
        self.usage.tokens += len(e.tokens) - k
        if g.state == State.READY:
            self.sampler.on_ready(g, self.latest)
        self.ledger.changed.notify_all()

    def _unused(self, g: Group, si: int, e: Entry, reason: str, why: str) -> None:
        self.usage.unused[reason] += 1
        self.drop([{"step": self.latest, "prompt_id": g.prompt_id, "epoch": g.epoch, "ordinal": g.ordinal,
                    "sample": si, "reason": reason, "what": "journal", "tokens": int(len(e.tokens)),
                    "versions": sorted({int(v) for v in e.versions}), "why": why, "record": e.where}])

    # ---- writing --------------------------------------------------------------------------

    def _open(self, step: int):
        self._seq += 1
        path = runfiles.journal_segment(self.dir, self._seq)
        gen, pi, pc = self.layout
        try:
            seg = AppendLog(path, new=True)
            seg.write(encode_header({"format": FORMAT, "generation": gen, "process": pi, "processes": pc,
                                            "step": step, "time": time.time(), "signature": self.sig}))
        except OSError as e:
            self._fail(e)
            return None
        return seg

    def encode(self, g: Group, s: Sample, reward: float) -> bytes:
        si = next(i for i, x in enumerate(g.samples) if x is s)
        if s.episode is not None:
            return encode_episode(g, si, s, reward, prompt_crc(g.prompt_tokens))
        return encode_sample(g, si, s, reward, prompt_crc(g.prompt_tokens))

    def encode_progress(self, g: Group, s: Sample) -> bytes:
        """A multi-turn episode after an env step was recorded (its result is never asked again)."""
        si = next(i for i, x in enumerate(g.samples) if x is s)
        return encode_episode(g, si, s, None, prompt_crc(g.prompt_tokens))

    def append(self, records: list[bytes]) -> None:
        """Queues records of samples whose rewards were just set (under the ledger lock, so a
        checkpoint cut puts each record on the side of the cut its sample is on); the writer
        thread writes them within the pump's next engine call."""
        with self._lock:
            self._buf.extend(records)
        self._wake.set()

    def _write_loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return  # close() writes what is left
            self.flush()

    def flush(self) -> None:
        """Writes the queued records (the OS then holds them: they survive a SIGKILL)."""
        with self._lock:
            self._write_buffer()
            seg = self._seg
        if self.every == 0 and seg is not None and seg.dirty:
            with self._sync_lock:
                self._sync(seg)

    def _write_buffer(self) -> None:
        if self._buf and self._seg is not None:
            data = b"".join(self._buf)
            self._buf.clear()
            try:
                self._seg.write(data)
            except OSError as e:
                self._fail(e)

    def _fail(self, e: OSError) -> None:
        if not self._failed:
            self._failed = True
            self.log(f"warning: journal write failed in {self.dir} ({e}); the journal is off for the rest of "
                     "this run (training goes on; a kill now loses the generation since the last checkpoint)")
        self._buf.clear()
        if getattr(self, "_seg", None) is not None:
            self._closed[self._seg] = None
        self._seg = None

    def rotate(self, step: int) -> None:
        """At the checkpoint cut of `step` (under the ledger lock): later records go to a new
        segment; this one holds only samples the checkpoint has, obsolete once it commits."""
        with self._lock:
            if self._seg is None:
                return
            self._write_buffer()
            if self._seg is None:
                return
            self._closed[self._seg] = step
            self._seg = self._open(step)

    def _sync_loop(self) -> None:
        while not self._stop.wait(self.every):
            self._sync_all()

    def _sync_all(self) -> None:
        with self._sync_lock:
            with self._lock:
                segs = [s for s in (*self._closed, self._seg) if s is not None and s.open]
            for s in segs:
                self._sync(s)
            with self._lock:
                for s in self._closed:
                    if s.open and not s.dirty:
                        s.close()

    def _sync(self, seg) -> None:
        """Makes one segment's records durable: fdatasync, or the upload of a part on an object
        store (hold `_sync_lock`: segments close only under it)."""
        if not seg.dirty or not seg.open:
            return
        t0 = time.perf_counter()
        seg.dirty = False  # a write landing during the sync marks it again
        try:
            seg.sync()
            if self._sync_failing:
                self.log(f"journal: syncs of {self.dir} work again")
            self._sync_failing = False
        except Exception as e:  # noqa: BLE001 - a lost sync costs regeneration only, never correctness
            seg.dirty = True
            # once per failure, and none where the run stops on it anyway: a store that does not
            # answer (the step loop names it within run.storage_timeout_s) or a lost lease
            quiet = isinstance(e, (remote_io.StorageError, LockLostError)) or signals.requested()
            if not (self._sync_failing or quiet):
                self.log(f"warning: journal sync of {seg.path} failed ({e}); retried at each sync, records are kept "
                         "in memory meanwhile")
            self._sync_failing = True
        self.sync_s += time.perf_counter() - t0

    def compact(self, committed: int) -> int:
        """Checkpoint `committed` (taken by this session) is on disk: deletes the segments it
        made obsolete. Returns the number of files deleted."""
        with self._sync_lock, self._lock:
            gone = [s for s, at in self._closed.items() if at is not None and at <= committed]
            for s in gone:
                del self._closed[s]
                s.close()
        # an earlier session's sample with oldest version v can fit no group a resume from
        # `committed` still has once committed - v > bound (lookahead or staleness)
        old = [p for p, v in self._old.items() if committed - v > self.bound]
        for p in old:
            del self._old[p]
        paths = [s.path for s in gone] + old
        for p in paths:
            applog.delete(p)
        return len(paths)

    def close(self) -> None:
        """Stops the threads and syncs what is left; nothing more where the run has abandoned
        its store (the records lost cost regeneration only)."""
        self._stop.set()
        self._wake.set()
        deadline = time.monotonic() + 30
        for t in self._threads:  # a sync in flight ends within its storage call's bound
            t.join(timeout=max(0.1, deadline - time.monotonic()))
        if remote_io.abandoned():
            return
        with self._sync_lock:
            with self._lock:
                self._write_buffer()
                segs = [s for s in (*self._closed, self._seg) if s is not None and s.open]
            for s in segs:
                self._sync(s)
                s.close()

    # ---- reporting ------------------------------------------------------------------------

    def metrics(self, busy_s: float) -> dict:
        u = self.usage
        return {"rollout/journal_groups": len(u.groups), "rollout/journal_samples": u.samples,
                "rollout/journal_tokens": u.tokens, "rollout/journal_unused": sum(u.unused.values()),
                "rollout/journal_env_steps": u.env_steps,
                "perf/journal_write_frac": self.write_s / busy_s if busy_s > 0 else 0.0,
                "perf/journal_sync_s": self.sync_s}

    def summary(self) -> str:
        u = self.usage
        unused = ", ".join(f"{k} {v}" for k, v in sorted(u.unused.items()))
        steps = f", {u.env_steps} env steps" if u.env_steps else ""
        return (f"journal: supplied {len(u.groups)} groups ({u.samples} samples, {u.tokens} tokens{steps}) instead "
                f"of generating them again" + (f"; {sum(u.unused.values())} samples not used ({unused}; see "
                                            "drops.jsonl)" if u.unused else ""))

    def restore(self, ledger, sampler, step: int) -> str | None:
        """Attaches to this session's ledger and sampler and claims the restored groups' unfinished
        samples; returns the line that says what the journal supplies (None when it holds nothing)."""
        self.attach(ledger, sampler)
        _, held, held_tokens = self.available()
        if not held:
            return None
        progress = sum(not e.done for v in self.index.values() for e in v)  # multi-turn episodes' env steps
        held -= progress
        with ledger.lock:
            for g in list(ledger.groups.values()):
                self.claim(g, step)
        u = self.usage
        waiting = sum(len(v) for v in self.waits.values())
        _, rest, _ = self.available()
        kept = f" and {progress} episodes' env steps" if progress else ""
        steps = f" and {u.env_steps} env steps" if u.env_steps else ""
        return (f"journal: {held} finished samples ({held_tokens} tokens){kept} from earlier sessions; {u.samples} "
                f"samples ({u.tokens} tokens){steps} of restored groups taken from it"
                + (f", {waiting} waiting for the weights that made them" if waiting else "")
                + f", up to {rest} more as the stream reaches their groups")


def _routes_mismatch(g: Group, s: Sample, e: Entry) -> str:
    """Why a record's routes cannot continue the sample's ("" if they can): more rows than its
    positions, or rows that differ from the ones the sample has (a record without routes
    leaves them as they are)."""
    if e.routes is None:
        return ""
    if len(e.routes) > len(g.prompt_tokens) + len(e.tokens) - 1:
        return f"{len(e.routes)} route rows for {len(g.prompt_tokens) + len(e.tokens) - 1} positions"
    if not s.routes:
        return ""
    mine = s.route_rows()
    n = min(len(mine), len(e.routes))
    if mine.shape[1:] != e.routes.shape[1:] or not np.array_equal(mine[:n], e.routes[:n]):
        return f"does not continue the checkpoint's routes of this sample (shape {mine.shape} vs {e.routes.shape})"
    return ""


def open_journal(cfg, run_dir, *, step: int, process_index: int, process_count: int, stop_ids, log,
                 drop, generation: int = 0) -> Journal | None:
    """This session's journal (None with journal.enabled=false); reads what earlier sessions wrote."""
    if not cfg.journal.enabled:
        return None
    from async_rl.data.rewards import reward_for_config
    s = cfg.sampler
    bound = s.max_lookahead if s.name == "in_order" else s.max_staleness
    return Journal(run_dir, process_index=process_index, process_count=process_count,
                   sig=signature(cfg, reward_for_config(cfg)[0], stop_ids), step=step,
                   fsync_every_s=cfg.journal.fsync_every_s, bound=bound, deterministic=cfg.run.determinism,
                   log=log, drop=drop, generation=generation)
