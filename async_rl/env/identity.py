"""The identity of the code a run's episodes are made with, kept with the run.

Owns: what names the code of `rollout.env` and `rollout.reward` (the spec, a `version` the env
object or reward function may declare, and a digest of each user module's source file), the
comparison a resume makes with the identity the run recorded (`run.dir/env.json`,
`runfiles.ENV_IDENTITY`), and the one line that refuses a resume under changed code unless
`run.env_changed=accept`. Does not own: loading the env (`interface.load_env`) or writing the
file (`run.build.take`, with the run's other manifests).

A built-in env or reward is named by its spec alone (its code is the package's). A saved
episode continued under other env code would mix the old code's observations with the new's in
one sample, and the run would train on both without a word.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from typing import Any

from async_rl.config import ConfigError
from async_rl.store import runfiles, storage

FIELDS = ("rollout.env", "rollout.reward")


def _source_digest(module_name: str) -> str | None:
    """sha256 of the module's source file (None: a module without one, e.g. built into Python)."""
    try:
        path = inspect.getsourcefile(importlib.import_module(module_name))
    except (TypeError, ImportError):
        return None
    if path is None:
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def code_identity(spec: str, obj: Any) -> dict:
    """What names the code `spec` (a config value) stands for: `obj` is the loaded env object
    or reward function. `module:attr` specs add their modules' source digests."""
    out: dict[str, Any] = {"spec": spec}
    version = getattr(obj, "version", None)
    if version is not None:
        out["version"] = str(version)
    if ":" in spec:
        mods = [spec.partition(":")[0]]
        owner = getattr(obj, "__module__", None) or type(obj).__module__
        if owner not in mods and not owner.startswith("async_rl."):
            mods.append(owner)  # the factory's module may build a class kept in another
        out["sources"] = {m: _source_digest(m) for m in mods}
    return out


def identity(cfg, env, reward_fn) -> dict:
    """The run's code identity: `rollout.env`'s (when set) and `rollout.reward`'s."""
    from async_rl.data.rewards import reward_for_config
    out = {}
    if cfg.rollout.env:
        out["rollout.env"] = code_identity(cfg.rollout.env, env)
    name, _ = reward_for_config(cfg)
    out["rollout.reward"] = code_identity(name, reward_fn)
    return out


def _differences(saved: dict, now: dict) -> list[str]:
    out = []
    for field in FIELDS:
        a, b = saved.get(field), now.get(field)
        if a is None or b is None or a.get("spec") != b.get("spec"):
            continue  # a changed spec is the config's to judge (state.compat), not a code change
        if a.get("version") != b.get("version"):
            out.append(f"{field}={b['spec']}: version {a.get('version')!r} -> {b.get('version')!r}")
        for mod in sorted(set(a.get("sources", {})) | set(b.get("sources", {}))):
            x, y = a.get("sources", {}).get(mod), b.get("sources", {}).get(mod)
            if x != y:
                out.append(f"{field}={b['spec']}: source of module {mod} sha256 {str(x)[:12]} -> {str(y)[:12]}")
    return out


def check(run_dir, now: dict, env_changed: str, log) -> None:
    """Compares `now` with the identity `run_dir` recorded (none recorded: nothing to compare).
    A difference is refused with one ConfigError (exit 2, nothing written) unless
    `env_changed == "accept"`, which logs what changed."""
    p = run_dir / runfiles.ENV_IDENTITY
    if not storage.is_file(p):
        return
    try:
        saved = json.loads(storage.read_text(p))
        if not isinstance(saved, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise ConfigError(f"{p}: not the run's code identity ({' '.join(str(e).split())}); restore it, or delete "
                          "it to record the code this resume runs (nothing was changed)") from None
    diff = _differences(saved, now)
    if diff and env_changed != "accept":
        raise ConfigError(f"{run_dir}: the code this run's episodes were made with changed ({'; '.join(diff)}): "
                          "resuming would mix its old and new observations and rewards in one run; run the code "
                          "it had, or pass run.env_changed=accept to go on with the new code (nothing was changed)")
    if diff:
        log(f"run.env_changed=accept: going on with changed code ({'; '.join(diff)}); recorded in {p}")


def text(now: dict) -> str:
    return json.dumps(now, indent=1, sort_keys=True) + "\n"
