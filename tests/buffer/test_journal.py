"""The rollout journal: its file format (checksums, a torn tail, a corrupt record), which
journaled samples a later session may use (the sampler's bounds, deterministic mode, a
restored partial sample, another process layout), compaction, and end to end: after a
SIGKILL, journaled samples are trained as journaled and not generated again."""
import json
import struct
import zlib

import numpy as np
import pytest
from helpers import read_ledger, run_cli

from async_rl import config as C
from async_rl.buffer import journal_format as jf
from async_rl.buffer.journal import open_journal, segment_files
from async_rl.buffer.journal_format import read_segment
from async_rl.buffer.ledger import Group, Ledger, Sample
from async_rl.buffer.sampler import make_sampler
from async_rl.state.audit import audit

PPS = 2  # groups per step in these tests: ordinal o is stamped o // 2 + 1


class Session:
    """One process's journal over a fresh ledger, as session.Session wires it."""

    def __init__(self, tmp, *overrides, step=0, layout=(0, 1), ledger=None, generation=0):
        self.cfg = C.load("configs/tiny.yaml", [f"run.dir={tmp}", "rollout.samples_per_prompt=2",
                                                f"rollout.prompts_per_step={PPS}", *overrides])
        self.ledger = ledger or Ledger(self.cfg.rollout.samples_per_prompt)
        self.sampler = make_sampler(self.cfg, self.ledger, groups_per_step=PPS)
        self.logs, self.drops = [], []
        self.j = open_journal(self.cfg, tmp, step=step, process_index=layout[0], process_count=layout[1],
                              stop_ids=(2,), log=self.logs.append, drop=self.drops.extend, generation=generation)
        self.restore_line = self.j.restore(self.ledger, self.sampler, step)

    def draw(self, prompt_id, ordinal=None, latest=0):
        if ordinal is not None:
            self.ledger.next_ordinal = ordinal
        rec = {"prompt_id": prompt_id, "epoch": 0, "prompt": str(prompt_id), "answer": "",
               "prompt_tokens": np.array([5, prompt_id % 7 + 3], np.int32)}
        with self.ledger.lock:
            g = self.ledger.add(rec, self.sampler.stamp(self.ledger.next_ordinal))
            self.j.claim(g, latest)
        return g

    def finish(self, g, si, n=4, version=0, reward=0.5):
        s = g.samples[si]
        for k in range(n):
            s.tokens.append(10 + k)
            s.logprobs.append(-0.25 * k)
            s.versions.append(version)
        s.done = True
        with self.ledger.lock:
            s.reward = reward
            self.j.append([self.j.encode(g, s, reward)])
        self.j.flush()


def _files(tmp, p=0):
    return segment_files(tmp / "journal" / f"p{p}")


def test_a_later_session_fills_drawn_groups_from_the_journal(tmp_path):
    a = Session(tmp_path)
    g = a.draw(3, ordinal=2)  # stamped 2: lookahead 1 allows versions 0 and 1
    a.finish(g, 0, version=0)
    a.finish(g, 1, version=1)
    a.j.close()
    b = Session(tmp_path)
    assert "2 finished samples" in b.restore_line
    g2 = b.draw(3, ordinal=2, latest=0)  # sample 1 names version 1, not published yet: it waits
    assert g2.samples[0].done and g2.samples[0].reward == 0.5 and g2.samples[0].tokens == [10, 11, 12, 13]
    assert not g2.samples[1].done and b.j.waiting(g2.ordinal, 1)
    with b.ledger.lock:
        b.j.apply(1)
    assert g2.samples[1].done and g2.samples[1].versions == [1] * 4 and g2.state.name == "READY"
    assert b.j.metrics(1.0)["rollout/journal_tokens"] == 8 and not b.drops
    b.j.close()


def test_samples_outside_the_samplers_bound_are_not_used_and_logged(tmp_path):
    a = Session(tmp_path, "sampler.max_lookahead=1")
    g = a.draw(1, ordinal=4)  # stamped 3: versions 1..2 allowed
    a.finish(g, 0, version=3)
    a.finish(g, 1, version=2)
    a.j.close()
    b = Session(tmp_path, "sampler.max_lookahead=1", step=3)
    g2 = b.draw(1, ordinal=4, latest=3)
    assert not g2.samples[0].done and g2.samples[1].done
    assert [(d["reason"], d["sample"]) for d in b.drops] == [("stale", 0)]
    b.j.close()
    c = Session(tmp_path, "sampler.name=fifo", "sampler.max_staleness=1", step=4)
    g3 = c.draw(1, ordinal=4, latest=4)  # fifo: latest - oldest version <= 1
    assert g3.samples[0].done and not g3.samples[1].done
    c.j.close()


def test_samples_of_diverged_weights_are_never_used(tmp_path):
    a = Session(tmp_path)
    g = a.draw(3, ordinal=2)
    a.finish(g, 0, reward=float("nan"))
    g.samples[1].logprobs.extend([float("nan")] * 4)  # what NaN weights give the engine
    g.samples[1].tokens.extend([10] * 4)
    g.samples[1].versions.extend([0] * 4)
    with a.ledger.lock:
        a.j.append([a.j.encode(g, g.samples[1], 0.5)])
    a.j.flush()
    a.j.close()
    b = Session(tmp_path)
    g2 = b.draw(3, ordinal=2, latest=1)
    assert not g2.samples[0].done and not g2.samples[1].done
    assert sorted((d["reason"], d["sample"]) for d in b.drops) == [("non_finite", 0), ("non_finite", 1)]
    b.j.close()


def test_under_fifo_a_waiting_sample_is_generated_when_the_pump_would_idle(tmp_path):
    fifo = ("sampler.name=fifo", "sampler.max_staleness=2")
    a = Session(tmp_path, *fifo)
    g = a.draw(1, ordinal=8)
    a.finish(g, 0, version=3)
    a.j.close()
    b = Session(tmp_path, *fifo, step=2)
    g2 = b.draw(1, ordinal=8, latest=2)
    assert b.j.waiting(g2.ordinal, 0)
    with b.ledger.lock:
        b.j.idle(2, PPS)  # nothing READY: the learner cannot publish version 3 without this group
    assert not b.j.waits and [d["reason"] for d in b.drops] == ["ahead"]
    b.j.close()
    c = Session(tmp_path, step=2)  # in_order waits: the group's own step comes after version 3
    g3 = c.draw(1, ordinal=8, latest=2)
    with c.ledger.lock:
        c.j.idle(2, PPS)
    assert c.j.waiting(g3.ordinal, 0) and not c.drops
    c.j.close()


def test_deterministic_mode_uses_only_the_exact_version_and_ordinal(tmp_path):
    det = ("run.determinism=true", "sampler.max_lookahead=1")
    a = Session(tmp_path, *det)
    g = a.draw(1, ordinal=4)  # stamped 3: deterministic mode generates it with version 1 exactly
    a.finish(g, 0, version=1)
    a.finish(g, 1, version=2)
    h = a.draw(2, ordinal=6)
    a.finish(h, 0, version=2)
    a.j.close()
    b = Session(tmp_path, *det, step=2)
    g2 = b.draw(1, ordinal=4, latest=2)
    assert g2.samples[0].done and not g2.samples[1].done
    h2 = b.draw(2, ordinal=7, latest=2)  # another ordinal: other sampling keys
    assert not h2.samples[0].done
    assert sorted((d["reason"], d["prompt_id"], d["sample"]) for d in b.drops) == [("mismatch", 1, 1),
                                                                                    ("mismatch", 2, 0)]
    b.j.close()


def test_a_restored_partial_sample_is_continued_only_by_a_matching_record(tmp_path):
    a = Session(tmp_path)
    g = a.draw(1)
    a.finish(g, 0)
    a.finish(g, 1)
    a.j.close()
    restored = Ledger(2)  # as a checkpoint holds it: two samples cut after two tokens
    rec = {"prompt_id": 1, "epoch": 0, "prompt": "1", "answer": "", "prompt_tokens": np.array([5, 4], np.int32)}
    r = restored.add(rec, 1)
    for s, second in zip(r.samples, (11, 99)):
        s.tokens, s.logprobs, s.versions = [10, second], [0.0, -0.25], [0, 0]
    b = Session(tmp_path, ledger=restored)
    assert r.samples[0].done and r.samples[0].tokens == [10, 11, 12, 13]
    assert not r.samples[1].done and r.samples[1].tokens == [10, 99]
    assert [d["reason"] for d in b.drops] == ["mismatch"]
    assert b.j.metrics(1.0)["rollout/journal_tokens"] == 2  # the two beyond the checkpoint's
    b.j.close()


def test_another_process_layout_finds_samples_by_prompt_not_ordinal(tmp_path):
    a = Session(tmp_path, layout=(1, 2))
    g = a.draw(7, ordinal=3)
    a.finish(g, 0)
    a.j.close()
    b = Session(tmp_path, layout=(0, 1))  # one process now: reads p1's files, ordinals differ
    g2 = b.draw(7, ordinal=0)
    assert g2.samples[0].done
    b.j.close()
    same = Session(tmp_path, layout=(0, 2))  # p1's own files, same layout: p0 leaves them to p1
    assert not same.draw(7, ordinal=1).samples[0].done and not same.drops
    same.j.close()
    later = Session(tmp_path, layout=(0, 2), generation=2)  # two processes again, groups dealt anew
    assert later.draw(7, ordinal=1).samples[0].done
    later.j.close()
    c = Session(tmp_path, "rollout.max_new_tokens=6")  # other sampling settings: not used
    g3 = c.draw(7, ordinal=0)
    assert not g3.samples[0].done
    assert any(d["reason"] == "mismatch" and "max_new_tokens" in d["why"] for d in c.drops)
    c.j.close()


def test_a_torn_tail_is_cut_and_a_corrupt_record_skipped(tmp_path):
    a = Session(tmp_path)
    groups = [a.draw(p) for p in range(3)]
    for g in groups:
        a.finish(g, 0)
    a.j.close()
    [path] = _files(tmp_path)
    good = path.read_bytes()
    offsets = [int(e.where.split(":")[1]) for e in read_segment(path).entries]
    data = bytearray(good)
    data[offsets[1] + 20] ^= 0xFF  # a bit flip inside the second record
    path.write_bytes(bytes(data) + good[offsets[2]:offsets[2] + 17])  # and half a record at the end
    b = Session(tmp_path)
    assert path.stat().st_size == len(good)  # the torn tail is cut, nothing else
    assert [d["reason"] for d in b.drops] == ["corrupt", "corrupt"] and b.drops[1]["cut"]
    assert any("torn tail of 17 bytes" in m for m in b.logs) and any("corrupt bytes" in m for m in b.logs)
    got = [b.draw(p) for p in range(3)]
    assert [g.samples[0].done for g in got] == [True, False, True]
    b.j.close()


def test_compaction_deletes_what_a_committed_checkpoint_made_obsolete(tmp_path):
    a = Session(tmp_path, "sampler.max_lookahead=1")
    g = a.draw(1)
    a.finish(g, 0, version=0)
    with a.ledger.lock:
        a.j.rotate(4)  # the cut of checkpoint 4: the first segment holds only what it has
    g = a.draw(2, ordinal=8)
    a.finish(g, 0, version=4)
    first, second = _files(tmp_path)
    assert a.j.compact(3) == 0 and first.exists()  # an older checkpoint does not cover it
    assert a.j.compact(4) == 1 and not first.exists() and second.exists()
    a.j.close()
    b = Session(tmp_path, "sampler.max_lookahead=1", step=4)
    # the killed session's segment holds a sample made by version 4: a resume from checkpoint 5
    # could still use it (lookahead 1), one from checkpoint 6 no longer can
    assert b.j.compact(5) == 0 and second.exists()
    assert b.j.compact(6) == 1 and not second.exists()
    b.j.close()


# ---- routing replay's routes ----------------------------------------------------------------


def _group(rows=None, turns=False):
    g = Group(ordinal=3, prompt_id=7, epoch=1, prompt="p", answer="a", prompt_tokens=np.array([5, 6, 7], np.int32),
              samples=[Sample(), Sample()], regenerations=2)
    s = g.samples[1]
    s.tokens, s.logprobs, s.versions, s.done = [10, 11, 12, 13], [-0.25, -0.5, -1.0, -2.0], [0, 1, 1, 2], True
    if turns:
        s.turns, s.env_state = [{"key": "k0", "observation": "o", "role": "tool", "at": 2, "n": 1}], {"x": 1}
    if rows is not None:
        s.routes = [rows[:2], rows[2:]]
    return g, s


def _old_layout(kind, g, s, reward, crc, tail=b""):
    """A sample record as the journal wrote it before routes existed."""
    payload = (struct.pack("<BqqqiiIId", kind, g.epoch, g.prompt_id, g.ordinal, 1, g.regenerations, crc,
                           len(s.tokens), reward) + np.asarray(s.tokens, "<i4").tobytes()
               + np.asarray(s.logprobs, "<f4").tobytes() + np.asarray(s.versions, "<i4").tobytes() + tail)
    return b"\xa5JR1" + struct.pack("<II", len(payload), zlib.crc32(payload)) + payload


def test_a_record_without_routes_keeps_the_layout_it_always_had():
    g, s = _group()
    assert jf.encode_sample(g, 1, s, 0.5, 99) == _old_layout(jf.KIND_SAMPLE, g, s, 0.5, 99)
    g, s = _group(turns=True)
    ep = json.dumps(s.episode, sort_keys=True, separators=(",", ":")).encode()
    for reward in (0.5, None):
        tail = struct.pack("<?I", reward is not None, len(ep)) + ep
        old = _old_layout(jf.KIND_EPISODE, g, s, float("nan") if reward is None else reward, 99, tail)
        assert jf.encode_episode(g, 1, s, reward, 99) == old
        e = jf._decode_sample(old[12:], (0, 0, 1), "x:0")
        assert e.routes is None and e.episode == s.episode and e.done == (reward is not None)
    assert jf._decode_sample(_old_layout(jf.KIND_SAMPLE, g, s, 0.5, 99)[12:], (0, 0, 1), "x:0").routes is None


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
@pytest.mark.parametrize("turns", [False, True])
def test_routes_round_trip_through_a_record_and_a_broken_block_is_refused(dtype, turns):
    rows = np.random.default_rng(0).integers(0, 256, (7, 3, 2)).astype(dtype)  # one row past the 3 + 4 - 1 positions
    g, s = _group(rows, turns)
    rec = jf.encode_episode(g, 1, s, 0.5, 99) if turns else jf.encode_sample(g, 1, s, 0.5, 99)
    p = rec[12:]
    e = jf._decode_sample(p, (0, 0, 1), "x:0")
    assert e.routes.dtype == dtype and e.routes.shape == (6, 3, 2) and e.tokens.tolist() == s.tokens
    np.testing.assert_array_equal(e.routes, rows[:6])
    assert e.episode == (s.episode if turns else None)
    block = len(p) - rows[:6].nbytes - 9  # rows u32, layers u16, k u16, bytes per id u8
    assert struct.unpack_from("<IHHB", p, block) == (6, 3, 2, np.dtype(dtype).itemsize)
    for bad in (p[:-1], p + b"\0", p[:block] + struct.pack("<IHHB", 6, 3, 2, 4) + p[block + 9:],
                p[:block] + struct.pack("<IHHB", 0, 3, 2, 1), p[:block + 4]):
        assert jf._decode_sample(bad, (0, 0, 1), "x:0") is None


def test_the_signature_names_routing_replay_only_when_it_is_on():
    on = C.load("configs/tiny-moe.yaml", ["learner.routing_replay=true"])
    off = C.load("configs/tiny-moe.yaml", ["learner.routing_replay=false"])
    assert jf.signature(on, "r", (2,)) == jf.signature(off, "r", (2,)) | {"learner.routing_replay": True}
    assert "learner.routing_replay" not in jf.signature(off, "r", (2,))


def test_a_restored_sample_keeps_its_routes_and_takes_the_rest_from_the_record(tmp_path):
    rng = np.random.default_rng(3)
    full = [rng.integers(0, 8, (2 + 4 - 1, 2, 2)).astype(np.uint8) for _ in range(2)]
    a = Session(tmp_path)
    g = a.draw(1)  # a prompt of 2 tokens: 2 + 4 tokens - 1 = 5 rows
    for si in (0, 1):
        g.samples[si].routes = [full[si][:3], full[si][3:]]
        a.finish(g, si)
    a.j.close()
    restored = Ledger(2)  # as a checkpoint holds it: two samples cut after two tokens
    rec = {"prompt_id": 1, "epoch": 0, "prompt": "1", "answer": "", "prompt_tokens": np.array([5, 4], np.int32)}
    r = restored.add(rec, 1)
    kept = full[0][:2].copy()
    other = full[1][:3].copy()
    other[2, 1, 0] ^= 1  # the engine routed this position otherwise: not this record's sample
    for s, rows in zip(r.samples, (kept, other)):
        s.tokens, s.logprobs, s.versions, s.routes = [10, 11], [0.0, -0.25], [0, 0], [rows]
    b = Session(tmp_path, ledger=restored)
    s0, s1 = r.samples
    assert s0.done and s0.tokens == [10, 11, 12, 13] and s0.routes[0] is kept and len(s0.routes) == 2
    np.testing.assert_array_equal(s0.route_rows(), full[0])
    assert not s1.done and s1.tokens == [10, 11] and len(s1.routes) == 1
    assert [(d["reason"], d["sample"]) for d in b.drops] == [("mismatch", 1)] and "routes" in b.drops[0]["why"]
    b.j.close()


# ---- end to end ---------------------------------------------------------------------------

E2E = ["data.num_records=32", f"rollout.prompts_per_step={PPS}", "checkpoint.every_steps=4", "checkpoint.async=false",
       "log.rollouts=true"]


def _rows(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_journaled_samples_are_trained_as_journaled_and_not_generated_again(tmp_path, xla_cache):
    r = run_cli(tmp_path, *E2E, cache=xla_cache, kill_at="step:7")
    assert r.returncode == -9, r.stderr[-2000:]
    ledger = read_ledger(tmp_path, 4)
    trained_before = {(x["epoch"], x["prompt_id"]) for x in _rows(tmp_path / "lineage.jsonl") if x["step"] <= 4}
    journaled, kept = {}, {}  # the samples finished after the cut; the tokens the checkpoint has of them
    for path in _files(tmp_path):
        for e in read_segment(path).entries:
            key = (e.epoch, e.prompt_id)
            held = next((g for g in ledger.groups.values() if (g.epoch, g.prompt_id) == key), None)
            if key not in trained_before and not (held and held.samples[e.sample].done):
                journaled[(*key, e.sample)] = e.tokens.tolist()
                kept[(*key, e.sample)] = len(held.samples[e.sample].tokens) if held else 0
    assert len(journaled) >= 8  # steps 5-7 and what ran ahead of them
    with open(_files(tmp_path)[-1], "ab") as f:
        f.write(b"\xa5JR1\x40\x00")  # a write the kill tore
    r = run_cli(tmp_path, *E2E, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed step 4" in r.stderr and "cut a torn tail of 6 bytes" in r.stderr
    after = [x for x in _rows(tmp_path / "rollouts.jsonl") if x["step"] > 4]
    trained = {(x["epoch"], x["prompt_id"], j): s["tokens"] for x in after for j, s in enumerate(x["samples"])}
    assert all(trained[k] == v for k, v in journaled.items())  # trained exactly as journaled
    last = _rows(tmp_path / "metrics.jsonl")[-1]
    assert last["rollout/journal_samples"] == len(journaled) and last["rollout/journal_unused"] == 0
    restored = sum(len(s.tokens) for g in ledger.groups.values() for s in g.samples)
    supplied = sum(len(v) - kept[k] for k, v in journaled.items())  # a partial sample continues from the checkpoint
    assert last["rollout/journal_tokens"] == supplied
    # the engine generated only what neither the checkpoint nor the journal held
    assert last["rollout/generated_tokens"] == sum(len(v) for v in trained.values()) - restored - supplied
    assert [d["reason"] for d in _rows(tmp_path / "drops.jsonl")] == ["corrupt"]
    assert audit(tmp_path)["ok"]
    assert len(_files(tmp_path)) == 1  # compacted: only the last, empty segment is left


def test_deterministic_resume_from_the_journal_is_bit_identical(tmp_path, xla_cache):
    det = [*E2E[:-1], "run.determinism=true", "sampler.max_lookahead=2"]
    r = run_cli(tmp_path / "clean", *det, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-2000:]
    # the cut of step 4 waits until the groups of steps 5 and 6 are READY (deterministic mode):
    # the journal's part is the groups of step 7 on, made by versions 4 and 5
    r = run_cli(tmp_path / "killed", *det, cache=xla_cache, kill_at="step:7")
    assert r.returncode == -9, r.stderr[-2000:]
    r = run_cli(tmp_path / "killed", *det, cache=xla_cache)
    assert r.returncode == 0 and "resumed step 4" in r.stderr, r.stderr[-3000:]
    last = _rows(tmp_path / "killed" / "metrics.jsonl")[-1]
    assert last["rollout/journal_samples"] >= 8 and last["rollout/journal_unused"] == 0  # step 7's at least
    clean, killed = (json.loads((tmp_path / d / "final.json").read_text()) for d in ("clean", "killed"))
    assert killed["fingerprint"] == clean["fingerprint"] and killed["step"] == clean["step"] == 16


@pytest.mark.soak
@pytest.mark.parametrize("name", ["fifo", "windowed"])
def test_staleness_samplers_resume_from_the_journal(tmp_path, xla_cache, name):
    ov = [*E2E[:-1], f"sampler.name={name}", "sampler.max_staleness=1", "rollout.partial=true"]
    r = run_cli(tmp_path, *ov, cache=xla_cache, kill_at="step:7")
    assert r.returncode == -9, r.stderr[-2000:]
    r = run_cli(tmp_path, *ov, cache=xla_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _rows(tmp_path / "metrics.jsonl")[-1]["rollout/journal_samples"] > 0
    assert audit(tmp_path)["ok"]
    rows = _rows(tmp_path / "lineage.jsonl")
    assert sorted(x["prompt_id"] for x in rows) == list(range(32))
    assert all((x["step"] - 1) - min(x["versions"]) <= 1 for x in rows)
