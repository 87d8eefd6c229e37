"""`rollout.env=bad_env:make`: an env that misbehaves at one step, as ASYNC_RL_TEST_BAD says
(`raise`, `hang`, `state` or `deep`, at prompt id ASYNC_RL_TEST_BAD_PROMPT's turn 0), and behaves
otherwise (the `recall` env's answers). Its `version` is ASYNC_RL_TEST_ENV_VERSION (default 1)."""
import os
import time

from async_rl.data.tool_tasks import lookup_value


class BadEnv:
    max_turns = 2
    version = os.environ.get("ASYNC_RL_TEST_ENV_VERSION", "1")

    def step(self, key, messages, state):
        bad = os.environ.get("ASYNC_RL_TEST_BAD", "")
        if bad and key.turn == 0 and key.prompt_id == int(os.environ.get("ASYNC_RL_TEST_BAD_PROMPT", "5")):
            if bad == "raise":
                raise ConnectionError("the tool's server refused the connection")
            if bad == "hang":
                time.sleep(3600)
            if bad == "state":
                return {"observation": "1=", "done": False, "state": {"at": {1, 2}}}
            if bad == "deep":  # nested a thousand levels: past any limit, and past Python's recursion
                state = {}
                for _ in range(1000):
                    state = {"a": state}
                return {"observation": "1=", "done": False, "state": state}
        if key.turn > 0:
            return {"observation": None, "done": True, "state": state}
        return {"observation": f"{lookup_value(0, messages[0]['content'].rstrip('='))}=", "done": False,
                "state": {"calls": 1}}


def make():
    return BadEnv()
