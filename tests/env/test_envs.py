"""The env interface: loading rollout.env, step keys, checking step results, EnvRunner."""
import asyncio
import threading
import time

import pytest
from helpers import MODEL, wait_until

from async_rl import config as C
from async_rl.config import ConfigError
from async_rl.data.tool_tasks import LookupEnv
from async_rl.env.guards import StateLimits, state_limits, traceback_keeper
from async_rl.env.interface import EnvError, EnvRunner, StepKey, StepResult, load_env
from async_rl.store import runfiles

KEY = StepKey("run-abc", 17, 2, 3, 1)
REPLY = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]

ENV_MODULE = '''
class Good:
    max_turns = 3
    def step(self, key, messages, state):
        return {"observation": "ok", "done": False, "state": state}

class NoStep:
    max_turns = 3

class NoTurns:
    def step(self, key, messages, state):
        return {}

def good():
    return Good()

def no_step():
    return NoStep()

def no_turns():
    return NoTurns()

def broken():
    raise RuntimeError("cannot reach\\nthe service")

not_callable = 5
'''


@pytest.fixture
def env_module(tmp_path, monkeypatch):
    (tmp_path / "my_envs.py").write_text(ENV_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_envs"


def test_load_env_user_factory_and_builtins(env_module):
    assert load_env("") is None
    env = load_env(f"{env_module}:good")
    assert env.max_turns == 3 and env.step(KEY, REPLY, {"a": 1})["state"] == {"a": 1}
    cfg = C.load(None, [*MODEL, "data.seed=7", "rollout.env_max_turns=2"])
    lookup = load_env("lookup", cfg)
    assert isinstance(lookup, LookupEnv) and lookup.max_turns == 2 and lookup.seed == 7


@pytest.mark.parametrize("spec, needle", [
    ("nosuch_module_xyz:make", "cannot import module 'nosuch_module_xyz'"),
    ("{mod}:missing", "has no attribute 'missing'"),
    ("{mod}:not_callable", "'not_callable' in 'my_envs' is not callable"),
    ("{mod}:no_step", "has no callable step"),
    ("{mod}:no_turns", "needs max_turns"),
    ("{mod}:broken", "the factory raised RuntimeError: cannot reach the service"),
    ("{mod}", "want a built-in env"),
])
def test_load_env_errors_are_one_line_naming_the_spec(env_module, spec, needle):
    spec = spec.format(mod=env_module)
    with pytest.raises(ConfigError) as e:
        load_env(spec)
    msg = str(e.value)
    assert msg.startswith(f"rollout.env={spec!r}") and needle in msg and "\n" not in msg


def test_config_fields_and_mcp_needs_a_server():
    cfg = C.load(None, [*MODEL, "rollout.env=mcp", "rollout.mcp_server=http://127.0.0.1:9/mcp"])
    assert cfg.rollout.env == "mcp" and cfg.rollout.env_max_concurrent > 0 and cfg.rollout.env_timeout_s > 0
    with pytest.raises(ConfigError, match="rollout.mcp_server"):
        C.load(None, [*MODEL, "rollout.env=mcp"])


def test_step_key_string_is_stable_and_parses_back():
    assert str(KEY) == "run-abc/17/2/3/1"
    assert StepKey.parse(str(KEY)) == KEY
    odd = StepKey("gs://bucket/runs/a", 0, 0, 0, 0)  # a run id holding '/'
    assert StepKey.parse(str(odd)) == odd
    with pytest.raises(ValueError, match="not an env step key"):
        StepKey.parse("run/1/2/x/4")


def test_step_result_accepts_a_good_result_with_defaults():
    r = StepResult.check({"observation": "7", "done": False, "state": {"n": [1, 2], "s": "x"}}, KEY)
    assert r == StepResult("7", False, {"n": [1, 2], "s": "x"}, None, "tool")
    r = StepResult.check({"observation": None, "done": True, "state": {}, "reward": 1, "role": "user"}, KEY)
    assert r.reward == 1.0 and isinstance(r.reward, float) and r.role == "user"


@pytest.mark.parametrize("raw, needle", [
    ({"observation": "x", "done": False, "state": {"f": object()}}, "a state that is not JSON"),
    ({"observation": "x", "done": False, "state": {"f": float("nan")}}, "a state that is not JSON"),
    ({"observation": "x", "done": False, "state": {"t": (1, 2)}}, "does not survive a JSON round trip"),
    ({"observation": "x", "done": False, "state": {1: "a"}}, "does not survive a JSON round trip"),
    ({"observation": "x", "done": False, "state": [1]}, "state of type list"),
    ({"observation": "x", "done": False, "state": {}, "reward": float("inf")}, "reward=inf"),
    ({"observation": "x", "done": False, "state": {}, "reward": "1"}, "reward='1'"),
    ({"observation": "x", "done": False, "state": {}, "role": "system"}, "role='system'"),
    ({"observation": 5, "done": False, "state": {}}, "observation of type int"),
    ({"observation": None, "done": False, "state": {}}, "observation None while not done"),
    ({"observation": "x", "done": 1, "state": {}}, "done=1"),
    ({"observation": "x", "done": True}, "no state"),
    ({"observation": "x", "done": True, "state": {}, "obs": 1}, "unknown key(s) obs"),
    ("done", "a str, not a dict"),
])
def test_step_result_refuses_bad_results_in_one_line(raw, needle):
    with pytest.raises(EnvError) as e:
        StepResult.check(raw, KEY)
    msg = str(e.value)
    assert needle in msg and "prompt_id=17 sample=3 turn=1 (key run-abc/17/2/3/1)" in msg and "\n" not in msg


class Recording:
    """A plain env whose steps wait on an event; counts the steps running at once."""
    max_turns = 4

    def __init__(self, hold: float = 0.0, gate: threading.Event | None = None):
        self.hold, self.gate = hold, gate
        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.threads: set[str] = set()

    def step(self, key, messages, state):
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)
            self.threads.add(threading.current_thread().name)
        try:
            if self.gate is not None:
                self.gate.wait(10)
            time.sleep(self.hold)
            if messages[-1]["content"] == "raise":
                raise ValueError("tool broke\nbadly")
            if messages[-1]["content"] == "bad":
                return {"observation": "x", "done": False, "state": {"s": {1, 2}}}
            return {"observation": f"obs {key.turn}", "done": False, "state": {"n": state.get("n", 0) + 1}}
        finally:
            with self.lock:
                self.now -= 1


def drain(runner, n, timeout=20.0):
    got = []
    wait_until(lambda: got.extend(runner.poll()) or len(got) >= n, timeout, f"{n} env steps")
    return got


def key(i, turn=0):
    return StepKey("r", i, 0, 0, turn)


def test_plain_steps_run_off_the_caller_bounded_and_poll_never_waits():
    gate = threading.Event()
    env = Recording(gate=gate)
    runner = EnvRunner(env, max_concurrent=3, timeout_s=30)
    try:
        handles = [runner.submit(key(i), REPLY, {"n": i}) for i in range(8)]
        t0 = time.monotonic()
        assert runner.poll() == [] and time.monotonic() - t0 < 0.5  # the steps wait on the gate
        wait_until(lambda: env.now == 3, 10, "3 steps running")
        time.sleep(0.1)
        assert env.now == 3  # the bound holds while 5 more are queued
        gate.set()
        got = drain(runner, 8)
    finally:
        assert runner.close() == []
    assert env.peak == 3 and threading.current_thread().name not in env.threads
    assert sorted(h.seq for h, _ in got) == [h.seq for h in handles]
    for h, r in got:
        assert isinstance(r, StepResult) and r.state == {"n": h.key.prompt_id + 1} and r.observation == "obs 0"


def test_a_step_that_raises_or_returns_bad_state_is_an_env_error():
    runner = EnvRunner(Recording(), max_concurrent=2, timeout_s=30)
    try:
        runner.submit(key(5, turn=2), [{"role": "assistant", "content": "raise"}], {})
        runner.submit(key(6, turn=1), [{"role": "assistant", "content": "bad"}], {})
        got = {h.key.prompt_id: r for h, r in drain(runner, 2)}
    finally:
        runner.close()
    assert isinstance(got[5], EnvError) and isinstance(got[6], EnvError)
    assert str(got[5]) == "env step raised ValueError: tool broke badly on prompt_id=5 sample=0 turn=2 (key r/5/0/0/2)"
    assert "a state that is not JSON" in str(got[6]) and "prompt_id=6 sample=0 turn=1" in str(got[6])


def test_a_hung_step_times_out_and_close_is_bounded():
    stuck = threading.Event()  # never set: the step hangs
    runner = EnvRunner(Recording(gate=None, hold=0), max_concurrent=2, timeout_s=0.5)
    runner.env.step = lambda k, m, s: stuck.wait(60)
    t0 = time.monotonic()
    runner.submit(key(9, turn=3), REPLY, {})
    (h, err), = drain(runner, 1)
    assert isinstance(err, EnvError) and 0.4 < time.monotonic() - t0 < 5
    assert str(err) == "env step did not return within rollout.env_timeout_s=0.5 s on prompt_id=9 sample=0 turn=3 (key r/9/0/0/3)"
    t0 = time.monotonic()
    left = runner.close(timeout_s=0.5)
    assert left == ["env-0"] and time.monotonic() - t0 < 2
    stuck.set()


class AsyncEnv:
    max_turns = 2

    def __init__(self):
        self.now = self.peak = 0
        self.threads: set[str] = set()
        self.closed = False

    async def step(self, key, messages, state):
        self.threads.add(threading.current_thread().name)
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.2)
            if key.prompt_id == 99:
                await asyncio.sleep(60)
            if key.prompt_id == 98:
                raise TimeoutError("the service timed out")
            return {"observation": None, "done": True, "state": state, "reward": 0.5}
        finally:
            self.now -= 1

    async def aclose(self):
        self.closed = True


def test_coroutine_steps_share_one_loop_thread_bounded_with_timeouts():
    env = AsyncEnv()
    runner = EnvRunner(env, max_concurrent=4, timeout_s=1.5)
    assert runner.is_async
    try:
        t0 = time.monotonic()
        for i in range(8):
            runner.submit(key(i), REPLY, {"i": i})
        got = drain(runner, 8)
        # 8 steps of 0.2 s, 4 at once: about 0.4 s, not 1.6 s one after another
        assert time.monotonic() - t0 < 1.4
        assert all(isinstance(r, StepResult) and r.done and r.reward == 0.5 for _, r in got)
        assert sorted(r.state["i"] for _, r in got) == list(range(8))
        assert env.peak == 4 and env.threads == {"env-loop"}
        runner.submit(key(98), REPLY, {})  # raises TimeoutError itself: reported at once, as raised
        runner.submit(key(99), REPLY, {})  # runs past the bound: cancelled and reported
        got = {h.key.prompt_id: r for h, r in drain(runner, 2, timeout=10)}
        assert str(got[98]).startswith("env step raised TimeoutError: the service timed out on prompt_id=98")
        assert str(got[99]).startswith("env step did not return within rollout.env_timeout_s=1.5 s on prompt_id=99")
        wait_until(lambda: env.now == 0, 5, "the timed-out step cancelled")
    finally:
        assert runner.close() == []
    assert env.closed


def test_submit_copies_its_inputs_and_refuses_after_close():
    gate = threading.Event()
    runner = EnvRunner(Recording(gate=gate), max_concurrent=1, timeout_s=30)
    msgs, state = [dict(m) for m in REPLY], {"n": 1}
    runner.submit(key(1), msgs, state)
    msgs[-1]["content"] = "raise"
    state["n"] = 100
    gate.set()
    (_, r), = drain(runner, 1)
    assert isinstance(r, StepResult) and r.state == {"n": 2}
    runner.close()
    with pytest.raises(RuntimeError, match="after close"):
        runner.submit(key(2), REPLY, {})


def test_a_run_whose_env_cannot_be_made_is_refused_and_writes_nothing(tmp_path, capsys):
    """A `train` whose rollout.env cannot be made stops at once: exit 2, one line naming
    rollout.env, nothing written (the env is made before the run directory is touched)."""
    from async_rl.run.cli import main
    run_dir = tmp_path / "run"
    code = main(["train", "--config", "configs/tiny-tools.yaml", f"run.dir={run_dir}",
                 "rollout.env=no_such_module_here:make"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not run_dir.exists()
    assert err[-1].startswith("error: rollout.env='no_such_module_here:make'"), err[-3:]


def _nested(levels: int) -> dict:
    state: dict = {}
    for _ in range(levels - 1):
        state = {"a": state}
    return state


def test_a_deep_or_large_state_is_refused_in_one_line_with_its_limit():
    ok = StepResult.check({"observation": "x", "done": False, "state": _nested(32)}, KEY)
    assert ok.state == _nested(32)
    ring: dict = {"l": []}
    ring["l"].append(ring)  # holds itself: as deep as any limit, measured without recursion
    for state, needle in [(_nested(33), "more than 32 levels deep (limit rollout.env_state_max_depth=32"),
                          (_nested(1000), "more than 32 levels deep"), (ring, "more than 32 levels deep"),
                          ({"x": "y" * 1_000_000}, "a state of 1000009 bytes as JSON (limit rollout.env_state_max_bytes=")]:
        with pytest.raises(EnvError) as e:
            StepResult.check({"observation": "x", "done": False, "state": state}, KEY)
        msg = str(e.value)
        assert needle in msg and "prompt_id=17 sample=3 turn=1 (key run-abc/17/2/3/1)" in msg and "\n" not in msg
    tight = StateLimits(max_depth=2, max_bytes=20)
    with pytest.raises(EnvError, match="env_state_max_depth=2"):
        StepResult.check({"observation": "x", "done": False, "state": {"a": {"b": [1]}}}, KEY, tight)
    with pytest.raises(EnvError, match="a state of 22 bytes"):
        StepResult.check({"observation": "x", "done": False, "state": {"a": "x" * 13}}, KEY, tight)
    assert state_limits(C.RolloutConfig(env_state_max_depth=5, env_state_max_bytes=99)) == StateLimits(5, 99)


def test_a_step_whose_state_is_a_thousand_levels_deep_fails_promptly_not_by_timeout():
    """Nothing a step returns may kill the runner's thread: the caller hears of it at once."""
    env = Recording()
    env.step = lambda k, m, s: {"observation": "x", "done": False, "state": _nested(1000)}
    runner = EnvRunner(env, max_concurrent=1, timeout_s=60)
    try:
        t0 = time.monotonic()
        runner.submit(key(4, turn=1), REPLY, {})
        (h, err), = drain(runner, 1, timeout=10)
        assert time.monotonic() - t0 < 5
        assert isinstance(err, EnvError) and "more than 32 levels deep" in str(err)
        assert "prompt_id=4 sample=0 turn=1" in str(err)
        env.step = lambda k, m, s: {"observation": "x", "done": False, "state": Unequal()}
        runner.submit(key(5), REPLY, {})
        (h, err), = drain(runner, 1, timeout=10)
        assert "could not be checked (RuntimeError: comparing broke)" in str(err)
    finally:
        assert runner.close() == []


class Unequal(dict):
    def __eq__(self, other):
        raise RuntimeError("comparing broke")


def test_a_step_that_raises_keeps_its_traceback_in_a_file_the_line_names(tmp_path):
    runner = EnvRunner(Recording(), max_concurrent=1, timeout_s=30, keep_traceback=traceback_keeper(tmp_path))
    try:
        runner.submit(key(5, turn=2), [{"role": "assistant", "content": "raise"}], {})
        (h, err), = drain(runner, 1)
    finally:
        runner.close()
    path = runfiles.env_error(tmp_path, "r/5/0/0/2")
    assert path == tmp_path / "env_errors" / "r_5_0_0_2.txt"
    assert str(err) == ("env step raised ValueError: tool broke badly on prompt_id=5 sample=0 turn=2 "
                        f"(key r/5/0/0/2); traceback in {path}")
    text = path.read_text()
    assert text.startswith("env step r/5/0/0/2\nTraceback (most recent call last):")
    assert 'raise ValueError("tool broke\\nbadly")' in text and text.rstrip().endswith("ValueError: tool broke\nbadly")


def test_a_traceback_file_is_never_written_through_a_symlink(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    run = tmp_path / "run"
    run.mkdir()
    (run / runfiles.ENV_ERRORS).symlink_to(outside)
    runner = EnvRunner(Recording(), max_concurrent=1, timeout_s=30, keep_traceback=traceback_keeper(run))
    try:
        runner.submit(key(5, turn=2), [{"role": "assistant", "content": "raise"}], {})
        (h, err), = drain(runner, 1)
    finally:
        runner.close()
    assert list(outside.iterdir()) == []
    msg = str(err)
    assert msg.startswith("env step raised ValueError: tool broke badly on prompt_id=5")
    assert f"; traceback not kept (SymlinkRefused: {run / runfiles.ENV_ERRORS} (-> {outside}): is a symbolic " \
        "link inside run.dir" in msg and "\n" not in msg
