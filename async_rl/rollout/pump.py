"""The pump: a background thread that keeps the backend busy and the ledger moving.

Owns: the run's side of the slot scheduler (a `scheduler.Source`: `fill` asks the allocator
which samples start in free slots, `record` appends every generated token with its behaviour
logprob and policy version to the ledger as each chunk arrives, `release` gives back leases a
backend lost), rewarding finished samples (on a thread of its own, so reward code never holds
up generation), env steps of multi-turn episodes, swapping in published weights, and pausing
for a deterministic checkpoint cut. Does not own: which sample goes where (`allocator`), the
chunk loop or the slot table (scheduler), the backend (`backends` chooses it), which groups
train when (sampler), the weights (learner publishes them), or saving (train/checkpoint).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import jax

from async_rl import faults, signals
from async_rl.buffer.ledger import Group, Ledger, Sample, State
from async_rl.data.rewards import as_real, refused
from async_rl.data.tokenizer import completion_text
from async_rl.env.interface import EnvError
from async_rl.errors import RunFailure
from async_rl.rollout.allocator import Allocator
from async_rl.rollout.interface import Rollout
from async_rl.rollout.scheduler import Fill, Piece, Scheduler, SlotStats


@dataclass
class PumpStats(SlotStats):  # busy_s and calls: the scheduler's
    idle_s: float = 0.0  # time with no slot in use and nothing allowed to start
    tokens: int = 0  # tokens generated (kept in the ledger)
    swaps: int = 0
    swap_s: float = 0.0  # time loading published weights into the rollout backend
    env_steps: int = 0  # env steps recorded (multi-turn episodes)
    env_submitted: int = 0  # env steps requested
    env_cut: int = 0  # observations cut to rollout.max_observation_chars/_tokens
    moved: int = 0  # samples whose slot the backend lost (a server went down), continued elsewhere
    evictions: int = 0  # samples a paged engine evicted or did not admit for want of KV pages (cumulative)
    prefix_cached: int = 0  # prompt tokens the backend took from its prefix cache (vLLM), not computed again


class Pump:
    def __init__(self, *, ledger: Ledger, sampler, rollout: Rollout, iterator, tokenizer, reward_fn,
                 max_new_tokens: int, params, version: int, partial: bool, deterministic: bool, log=print,
                 journal=None, reward_timeout_s: float = 60.0, episodes=None, env=None,
                 on_env_request=None, reward_max_abs: float = 1e6):
        self.ledger, self.sampler, self.rollout = ledger, sampler, rollout
        self.journal = journal  # rollout journal: records finished samples, supplies a killed run's
        self.iterator, self.tok, self.reward_fn = iterator, tokenizer, reward_fn
        self.N, self.partial, self.deterministic = max_new_tokens, partial, deterministic
        self.log = log
        # multi-turn episodes (rollout.env): the rules (`episode.Episodes`) and the env's runner;
        # an env step runs off this thread while the engine generates for other slots
        self.episodes, self.env = episodes, env
        self.on_env_request = on_env_request  # told each step's key before the step is asked for
        self._env_steps: dict[int, tuple] = {}  # runner seq -> (group, sample index, sample)
        self._resubmit = env is not None  # look for samples whose env step is not running (start-up)
        if deterministic and env is not None:
            raise ValueError("run.determinism: not with rollout.env (env steps finish in any order)")
        self._stops = frozenset(getattr(tokenizer, "stop_ids", (tokenizer.eos_id,)))
        if deterministic and not getattr(rollout, "bit_identical", False):
            raise ValueError("run.determinism: only the built-in engine (in-process or on servers) is deterministic")
        self.published: dict[int, object] = {version: params}
        # leaves of published versions not yet seen computed (flattened once, at publication:
        # the pump asks at every wake-up, and flattening the tree cost more than the check)
        self._in_flight: dict[int, list] = {}
        # which sample goes into which free slot (the ledger side); the versions it gates on
        self.alloc = Allocator(ledger=ledger, sampler=sampler, iterator=iterator, journal=journal,
                               max_new_tokens=max_new_tokens, episodes=episodes, deterministic=deterministic,
                               version=version)
        self.params = params
        self.stats = PumpStats()
        # the chunk loop; a slot holds (group, sample index) until that sample's last tokens are recorded
        self.scheduler = Scheduler(self.rollout, self, self._stops, lock=self.ledger.changed, stats=self.stats)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pump", daemon=True)
        # wakes the pump the moment published weights are computed (it would otherwise find
        # out at its next poll, a delay on the critical path of every synchronous step)
        self._computing: queue.SimpleQueue = queue.SimpleQueue()
        self._watcher = threading.Thread(target=self._watch_computed, name="pump-weights", daemon=True)
        # finished samples wait here for their rewards, in the order they finished: the pump
        # goes on to the next chunk meanwhile (a sample is done but not READY until rewarded,
        # a state a checkpoint cut may hold: a resumed run rewards it, `_reward_backlog`)
        self._to_reward: queue.SimpleQueue = queue.SimpleQueue()
        self._rewarder = threading.Thread(target=self._reward_loop, name="pump-rewards", daemon=True)
        # a reward call cannot be interrupted: a watchdog fails the run when one overruns, and
        # stop() leaves such a call behind on its daemon thread instead of waiting for it
        self.reward_timeout_s = reward_timeout_s
        self.reward_max_abs = reward_max_abs  # a reward beyond it fails the run before it is recorded
        self._in_reward: tuple[float, Group] | None = None  # (start, group) of the call running now
        self._watchdog = threading.Thread(target=self._watch_rewards, name="pump-reward-watchdog", daemon=True)
        self._stopped = threading.Event()

    # ---- control (learner thread) --------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._watcher.start()
        self._rewarder.start()
        self._watchdog.start()

    def stop(self) -> None:
        self._stop.set()
        self._computing.put(None)
        with self.ledger.changed:
            self.ledger.changed.notify_all()
        wait = faults.wait_s("pump_stop", 60.0)
        self._thread.join(timeout=wait)
        if self._thread.is_alive():
            self.log(f"warning: the pump thread did not stop within {wait:g} s (inside a compile or a device call); "
                     "the process exits without waiting for it")
            signals.left_running(self._thread.name)
        self._watcher.join(timeout=60)
        if self.env is not None:
            left = self.env.close(5.0)
            if left:
                self.log(f"stopping: left {len(left)} env steps running ({', '.join(left[:3])})")
                for name in left:
                    signals.left_running(name)
        self._to_reward.put(None)  # after the pump thread: it queues until it exits
        end = time.monotonic() + 60
        while self._rewarder.is_alive() and time.monotonic() < end and self.error is None:
            self._rewarder.join(timeout=0.1)
            busy = self._in_reward
            if busy is not None and time.monotonic() - busy[0] > min(5.0, self.reward_timeout_s):
                self.log(f"stopping: left the reward call on prompt_id={busy[1].prompt_id} running")
                break
        self._stopped.set()

    @property
    def version(self) -> int:
        """The weights the backend runs now."""
        return self.alloc.version

    @property
    def latest(self) -> int:
        """The newest published weights."""
        return self.alloc.latest

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def publish(self, version: int, params) -> None:
        leaves = jax.tree.leaves(params)  # flattened before taking the lock the pump waits on
        with self.ledger.changed:
            self.published[version] = params
            self._in_flight[version] = leaves
            self.alloc.latest = max(self.alloc.latest, version)
            self.ledger.changed.notify_all()
        self._computing.put(params)

    def wait_for_weights(self, version: int, timeout_s: float) -> None:
        """Blocks until the backend runs `version` (published) or newer: another view of the same
        engine then scores exactly those weights. Raises the pump's error, or after `timeout_s`."""
        end = time.monotonic() + timeout_s
        with self.ledger.changed:
            while self.version < version:
                if self.error is not None or not self.alive:
                    raise RuntimeError(f"the rollout stopped before loading the weights of step {version}"
                                       + (f": {self.error}" if self.error is not None else ""))
                if time.monotonic() > end:
                    raise TimeoutError(f"the rollout did not load the weights of step {version} in {timeout_s:.0f} s")
                self.ledger.changed.wait(0.05)

    def _watch_computed(self) -> None:
        while (params := self._computing.get()) is not None:
            try:
                jax.block_until_ready(params)
            except Exception:  # a failed step surfaces in the learner; this only wakes the pump
                pass
            with self.ledger.changed:
                self.ledger.changed.notify_all()

    def pause_for_cut(self, version: int, should_stop=lambda: False) -> None:
        """Deterministic mode: before saving after `version` steps, finish all work that needs
        older weights (a restored run has only `version`) and leave no half-finished sample."""
        with self.ledger.changed:
            self.alloc.cut_below = version
            self.ledger.changed.notify_all()
            while not self._cut_ready(version) and self.error is None and not should_stop():
                self.ledger.changed.wait(0.05)

    def resume(self) -> None:
        with self.ledger.changed:
            self.alloc.cut_below = None
            self.ledger.changed.notify_all()

    def _cut_ready(self, version: int) -> bool:
        if any(self.slots):
            return False
        req = self.sampler.required_version
        if any(req(g) < version and g.state != State.READY for g in self.ledger.groups.values()):
            return False
        return self.ledger.exhausted or self.alloc.required_for_next_draw() >= version

    def iterator_state(self) -> dict:
        return self.iterator.get_state()  # caller holds the ledger lock (the cut)

    # ---- the loop (pump thread) ------------------------------------------------------------

    def _run(self) -> None:
        """The slot scheduler's loop (`scheduler.Scheduler.run`) with the pump as its source,
        one chunk of `engine.steps_per_call` tokens per turn, until `stop`. Swaps and cuts
        need every slot free, and the scheduler frees a slot only when its sample's last
        tokens are recorded, so no chunk is half-recorded when weights change or a cut is taken."""
        try:
            self._reward_backlog()
            self.scheduler.run(self._stop.is_set)
        except BaseException as e:  # surfaced to the learner, which stops the run
            self.error = e
            with self.ledger.changed:
                self.ledger.changed.notify_all()

    @property
    def slots(self) -> list:
        """The scheduler's slot table: (group, sample index) or None per slot."""
        return self.scheduler.slots

    # ---- the scheduler's source (pump thread; fill and record under the lock) -------------

    def fill(self, free: list[int], busy: bool) -> Fill:
        """Between a collect and the next step: swap in published weights, take back journal
        records, then pick samples for the `free` slots. With nothing to start and no slot in
        use, waits a moment for a change (the scheduler asks again)."""
        self._maybe_swap()
        if self.env is not None:
            self._env_results()
        if self.journal is not None and self.journal.waits:
            self._journal_settles(self.journal.apply, self.latest)
        if self._resubmit:
            self._env_backlog()
        # without partial rollouts the slots drain before newer weights go in (publication waits)
        drain = not self.partial and not self.deterministic and self._newest_ready() > self.version
        picks = [] if drain else self.alloc.pick(free)
        if not picks and not busy:
            if self.journal is not None and self.journal.waits:
                self._journal_settles(self.journal.idle, self.latest, self.sampler.pps)
            t0 = time.perf_counter()
            self.ledger.changed.wait(0.05)
            self.stats.idle_s += time.perf_counter() - t0
            return Fill()
        return self.alloc.starts(picks)

    def release(self, occupants: list) -> None:
        """Under the lock: leases the backend lost; their samples start again elsewhere."""
        self.alloc.release(occupants)
        self.stats.moved += len(occupants)

    def record(self, pieces: list[Piece], version: int) -> None:
        """Appends a chunk's tokens, logprobs and versions to their samples (the lists were
        built outside the lock) and queues the samples that ended for their rewards."""
        finished: list[tuple[Group, Sample]] = []
        self.stats.prefix_cached = getattr(self.rollout, "cached_tokens", 0)
        self.stats.evictions = getattr(self.rollout, "evictions", 0)
        for p in pieces:
            g, si = p.occupant
            s = g.samples[si]
            if p.routes is not None:
                s.add_routes(len(g.prompt_tokens), p.head, p.routes)
            s.tokens += p.tokens
            s.logprobs += p.logprobs
            s.versions += p.versions
            self.stats.tokens += len(p.tokens)
            if p.ended:
                s.in_engine = False
                if self.env is None or len(s.tokens) >= self.N:
                    s.done = True
                    finished.append((g, s))
                else:  # an assistant turn ended: the env answers it, off this thread
                    self._submit_env(g, p.occupant[1], s)
        self.ledger.changed.notify_all()
        if finished:
            self._to_reward.put((finished, version))

    # ---- env steps of multi-turn episodes (pump thread, under the lock) ------------------

    def _submit_env(self, g: Group, si: int, s: Sample) -> None:
        s.awaiting, s.in_env = True, True
        key = self.episodes.key(g, si, s)
        if self.on_env_request is not None:
            self.on_env_request(key)
        h = self.env.submit(key, self.episodes.messages(g, s), s.env_state)
        self._env_steps[h.seq] = (g, si, s)
        self.stats.env_submitted += 1
        faults.point("env_submit", self.stats.env_submitted, self._progress)

    def _journal_settles(self, call, *args) -> None:
        """Runs a journal call that may settle waiting samples; one it leaves unfilled may be an
        episode waiting for an env step that is not running (looked for at the next turn)."""
        before = sum(map(len, self.journal.waits.values()))
        call(*args)
        if self.env is not None and sum(map(len, self.journal.waits.values())) < before:
            self._resubmit = True

    def _env_backlog(self) -> None:
        """Samples waiting for an env step that is not running: restored from a checkpoint taken
        while it ran (the step is asked again, with the same key), or whose journaled result
        turned out unusable."""
        self._resubmit = False
        waits = self.journal.waits if self.journal is not None else {}
        for g in list(self.ledger.groups.values()):
            for si, s in enumerate(g.samples):
                if s.awaiting and not s.in_env and not s.done and not (waits and self.journal.waiting(g.ordinal, si)):
                    self._submit_env(g, si, s)

    def _env_results(self) -> None:
        """Records the env steps finished since the last turn: each observation enters its
        sample's token stream (masked), or the episode ends and goes to its reward."""
        done = self.env.poll()
        if not done:
            return
        finished, records = [], []
        for h, res in done:
            g, si, s = self._env_steps.pop(h.seq)
            if isinstance(res, EnvError):
                raise res
            if self.ledger.groups.get(g.ordinal) is not g or g.samples[si] is not s:
                continue  # regenerated (staleness) or dropped while the step ran: not used
            s.in_env = False
            applied = self.episodes.apply(s, h.key, res)
            self.stats.env_steps += 1
            self.stats.env_cut += applied.cut > 0
            if applied.ended:
                s.done = True
                finished.append((g, s))
            elif self.journal is not None:
                records.append(self.journal.encode_progress(g, s))
        if records:  # with the step's result in the ledger: a checkpoint cut sees both or neither
            self.journal.append(records)
        if finished:
            self._to_reward.put((finished, self.version))
        self.ledger.changed.notify_all()

    def collected(self, calls: int) -> None:
        """Fault points (`faults`): a slowed chunk; a SIGKILL after the n-th, before it is recorded."""
        faults.delay("generate", self.rollout.steps_per_call)
        faults.point("generate", calls, self._progress)

    def _maybe_swap(self) -> None:
        if self.deterministic:
            if any(self.slots):
                return
            need = self.alloc.next_required_version()
            if need is None or need == self.version or need not in self.published:
                return
            if self.alloc.cut_below is not None and need >= self.alloc.cut_below:
                return
            self._swap(need)
            self._drop(lambda v: v < need)
        else:
            ready = self._newest_ready()
            if ready > self.version and (self.partial or not any(self.slots)):
                self._swap(ready)
            # a version goes once a newer one is computed, not when one is published: dropping
            # it at publication would leave the engine waiting for weights still in flight
            self._drop(lambda v: v < ready and v != self.version)

    def _drop(self, which) -> None:
        for v in [v for v in self.published if which(v)]:
            del self.published[v]
            self._in_flight.pop(v, None)

    def _newest_ready(self) -> int:
        """The newest published version whose weights are computed: swapping to one still in
        flight would stall the engine on the learner's step instead of overlapping with it."""
        for v in sorted(self.published, reverse=True):
            if v <= self.version:
                return self.version
            leaves = self._in_flight.get(v)
            if leaves is None or all(x.is_ready() for x in leaves):
                self._in_flight.pop(v, None)
                return v
        return self.version

    def _swap(self, version: int) -> None:
        self.params, self.alloc.version = self.published[version], version
        t0 = time.perf_counter()
        self.rollout.swap(self.params, version)
        self.stats.swap_s += time.perf_counter() - t0
        self.stats.swaps += 1

    def _reward_loop(self) -> None:
        """The reward thread: rewards each queued batch of finished samples, in order."""
        try:
            while (item := self._to_reward.get()) is not None:
                self._reward(*item)
        except BaseException as e:  # surfaced to the learner, which stops the run
            self.error = self.error or e
            with self.ledger.changed:
                self.ledger.changed.notify_all()

    def _watch_rewards(self) -> None:
        """Fails the run (self.error) when one reward call runs past reward_timeout_s."""
        while not self._stopped.wait(0.25):
            busy = self._in_reward
            if busy is None or self.error is not None or time.monotonic() - busy[0] <= self.reward_timeout_s:
                continue
            g = busy[1]
            self.error = RewardError(f"reward function did not return within rollout.reward_timeout_s="
                                     f"{self.reward_timeout_s:g} s on prompt_id={g.prompt_id} (ordinal {g.ordinal}, "
                                     f"prompt {g.prompt!r})")
            with self.ledger.changed:
                self.ledger.changed.notify_all()

    def _reward(self, finished: list[tuple[Group, Sample]], version: int | None = None) -> None:
        """Rewards outside the lock (user reward code may be slow), then marks READY groups."""
        scores = []
        for g, s in finished:
            if s.env_reward is not None:  # the env's final reward wins (checked where it entered)
                scores.append(s.env_reward)
                continue
            text = completion_text(self.tok, s.tokens) if self.episodes is None else self.episodes.final_reply(s)
            self._in_reward = (time.monotonic(), g)
            try:
                faults.fail("reward")
                raw = self.reward_fn(text, g.answer)
            except Exception as e:
                raise RewardError(f"reward function failed on prompt_id={g.prompt_id} sample "
                                  f"{_index(g, s)} (ordinal {g.ordinal}): {type(e).__name__}: {e}") from e
            finally:
                self._in_reward = None
            why = refused(raw, self.reward_max_abs)
            if why is not None:  # refused before anything records it: the last checkpoint resumes
                raise RewardError(" ".join(
                    f"reward function returned {why} for prompt_id={g.prompt_id} sample {_index(g, s)} (ordinal "
                    f"{g.ordinal}); nothing of it was recorded: fix the reward function, then run the same "
                    "command to resume".split()))
            scores.append(as_real(raw))
        journal, t0 = self.journal, time.perf_counter()
        records = [journal.encode(g, s, r) for (g, s), r in zip(finished, scores)] if journal is not None else ()
        t_encode = time.perf_counter() - t0
        with self.ledger.changed:
            for (g, s), r in zip(finished, scores):
                s.reward = r
                if g.state == State.READY:
                    self.sampler.on_ready(g, self.version if version is None else version)
            if records:
                t0 = time.perf_counter()
                journal.append(records)  # with the rewards: a checkpoint cut sees both or neither
                journal.write_s += t_encode + time.perf_counter() - t0
            self.ledger.changed.notify_all()

    def _progress(self) -> str:
        """For a fault point's message: tokens generated so far, and those the ledger holds in
        unfinished samples (in the engine or waiting for an env step): what a kill now loses
        unless a checkpoint kept it."""
        live = sum(len(s.tokens) for g in list(self.ledger.groups.values()) for s in list(g.samples) if not s.done)
        return f"generated_tokens={self.stats.tokens} in_flight_tokens={live}"

    def _reward_backlog(self) -> None:
        """Samples a killed run finished but did not reward yet (restored done, reward missing)."""
        with self.ledger.lock:
            todo = [(g, s) for g in self.ledger.groups.values() for s in g.samples if s.done and s.reward is None]
        if todo:
            self._reward(todo)


def _index(g: Group, s: Sample) -> int:
    return next(i for i, x in enumerate(g.samples) if x is s)


class RewardError(RunFailure):
    """A reward function that failed, overran or returned what cannot be a reward (exit 1:
    the run stops; what it saved resumes once the function is fixed)."""

