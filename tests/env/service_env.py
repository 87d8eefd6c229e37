"""`rollout.env=service_env:make`: an env whose steps call the keyed service (its own process;
`ASYNC_RL_TEST_SERVICE` is its URL). Two tool turns per episode, then the answer; the env checks
that the state it is given is exactly what its previous step returned, and fails the step
(so the run) otherwise."""
import json
import os
import urllib.request


class ServiceEnv:
    max_turns = 3

    def __init__(self):
        self.url = os.environ["ASYNC_RL_TEST_SERVICE"] + "/step"

    def step(self, key, messages, state):
        want = {"calls": key.turn, "seen": [f"{key.prompt_id}/{t}" for t in range(key.turn)]} if key.turn else {}
        if state != want:
            raise ValueError(f"given state {state}, the previous step returned {want}")
        if key.turn >= 2:
            return {"observation": None, "done": True, "state": state}
        req = urllib.request.Request(self.url, data=json.dumps({"key": str(key), "prompt": messages[0]["content"]})
                                     .encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            obs = json.loads(r.read())["observation"]
        return {"observation": obs, "done": False,
                "state": {"calls": key.turn + 1, "seen": [*want.get("seen", []), f"{key.prompt_id}/{key.turn}"]}}


def make():
    return ServiceEnv()
