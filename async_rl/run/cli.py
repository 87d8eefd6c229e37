"""Command line: `async-rl train|audit|eval|export|plan|serve`. Parses, prints the resolved config, calls in.

Owns: argument parsing, help that lists every config group and field, and the mapping
from error kinds to exit codes (2: usage, config, bad data or checkpoint input; 1: a
failure during the run). Does not own: anything the commands do.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from async_rl import config as C
from async_rl import faults, signals
from async_rl.errors import RunFailure, UsageError


def _groups_help() -> str:
    lines = ["config groups (override any field as group.field=value):"]
    for g, fields in C.field_docs().items():
        lines.append(f"  {g}: " + ", ".join(k for k, _, _ in fields))
    return "\n".join(lines)


def _fields_help() -> str:
    lines = ["config fields (group.field=value overrides, applied after --config):"]
    for g, fields in C.field_docs().items():
        lines.append(f"\n  {g}")
        for k, default, comment in fields:
            lines.append(f"    {g + '.' + k:<30} {default:<12} {comment}")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="async-rl", description="Asynchronous RL post-training for LM policies on "
                                "JAX, with every prompt trained exactly once per epoch across restarts.",
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_groups_help())
    sub = p.add_subparsers(dest="cmd", metavar="{train,audit,eval,export,plan,serve}")
    t = sub.add_parser("train", help="train (or resume) a run", formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=_fields_help())
    t.add_argument("--config", help="YAML preset (e.g. configs/tiny.yaml)")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("overrides", nargs="*", help="group.field=value")
    a = sub.add_parser("audit", help="check the lineage log: every prompt trained exactly once per epoch")
    a.add_argument("run_dir")
    a.add_argument("--json", action="store_true", help="machine-readable report")
    v = sub.add_parser("eval", help="score a saved step on held-out prompts (reads the run, writes nothing)")
    v.add_argument("run_dir")
    v.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument("--trust-code", action="store_true", help="run the env, reward or MCP server command the run's "
                   "config.yaml names (module:factory, module:function, a command); without it eval refuses them "
                   "unless named again as overrides")
    v.add_argument("overrides", nargs="*", help="group.field=value applied to the run's config (e.g. eval.*)")
    e = sub.add_parser("export", help="write a trained policy as a Hugging Face-format directory")
    e.add_argument("run_dir")
    e.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    e.add_argument("--out", required=True, help="output directory")
    pl = sub.add_parser("plan", help="compile the learner step ahead of time for a TPU or GPU topology (any host): "
                        "memory per chip, XLA cost model, estimated step time and MFU bound")
    pl.add_argument("--config", help="YAML preset (e.g. configs/plan/llama3-8b.yaml)")
    pl.add_argument("--topology", required=True, help="v5e:2x4, v5p:4x4x2, v6e:4x4, ... (needs the [tpu] extra); "
                    "h100:8, h200:8, a100-80g:8, b200:8, h100:4x8 (nodes x GPUs; needs the [gpu-plan] extra); "
                    "cpu:N for N forced host devices with nominal figures")
    pl.add_argument("--json", action="store_true", help="one JSON object on stdout")
    pl.add_argument("--hbm-gib", type=float, default=None, help="usable HBM per chip instead of the chip's")
    pl.add_argument("--no-cost", action="store_true", help="memory only: skip the two cost-model compiles")
    pl.add_argument("--no-engine", action="store_true", help="the learner step only: skip the engine's compiles")
    pl.add_argument("overrides", nargs="*", help="group.field=value")
    sv = sub.add_parser("serve", help="a generation server over HTTP that trainers publish weights to and sample "
                        "from (docs/fleet.md; needs the [fleet] extra)")
    sv.add_argument("--config", help="YAML preset: the trainer's, so that model, tokenizer and sampling match")
    sv.add_argument("--port", type=int, required=True, help="port to listen on; 0 picks a free one (printed)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    sv.add_argument("overrides", nargs="*", help="group.field=value")
    return p


def _err(msg: str, code: int) -> int:
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return code


def _stopped(e) -> int:
    """A storage failure during `train` (exit 1): nothing committed is lost."""
    return _err(f"{e}; the run was stopped, the last committed checkpoint step is intact: {e.hint} and run the "
                "same command to resume", 1)


def _probe(path: str) -> None:
    """A read-only command on an object store: a store that cannot be used is named at once."""
    from async_rl.store import remote_io, rundir, storage
    if storage.is_remote(path):
        remote_io.configure(remote_io.DEFAULT_TIMEOUT_S)
        rundir.probe_store(path)


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _keep_off_libtpu(cmd: str | None) -> None:
    """libtpu (the `[tpu]` extra) takes a host-wide lockfile when it loads, which would make
    `plan` fail while any other command runs: off a TPU host only `plan` loads it, and `plan`
    loads it without the lock (it compiles, it runs nothing on a chip)."""
    import glob
    import importlib.util
    if importlib.util.find_spec("libtpu") is None:
        return
    if cmd == "plan":
        os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        return
    if "JAX_PLATFORMS" in os.environ or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return  # the user's choice, or a TPU host
    gpu = os.path.exists("/dev/nvidiactl") and any(
        importlib.util.find_spec(p) for p in ("jax_cuda12_plugin", "jax_cuda13_plugin"))
    os.environ["JAX_PLATFORMS"] = "cuda,cpu" if gpu else "cpu"


def main(argv: list[str] | None = None) -> int:
    # before anything heavy is imported: a SIGTERM during imports or start-up is kept, not fatal
    signals.register_exit_hook()
    handlers = signals.install()
    env = dict(os.environ)  # a command sets variables for its libraries (JAX_PLATFORMS, tensorstore's)
    code = 1
    try:
        code = _main(argv)
    finally:
        if argv is not None:  # called in-process: the caller's environment as it was
            for k in set(os.environ) - env.keys():
                del os.environ[k]
            os.environ.update({k: v for k, v in env.items() if os.environ.get(k) != v})
        # run as the program (arguments from sys.argv), the process exits next: a signal from
        # here on finds the command ended and its work saved, and exits with its code
        signals.release(handlers, exiting=code if argv is None else None)
        faults.delay("exit")
    if argv is None:
        signals.exit_if_left_running(code)
    return code


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # overrides may come after options too (`eval RUN --json eval.num_records=64`)
    if extra and hasattr(args, "overrides") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = list(args.overrides) + extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


def _main(argv: list[str] | None) -> int:
    args = _parse(argv)
    if args.cmd is None:
        _parser().print_help()
        return 2
    _keep_off_libtpu(args.cmd)
    if args.cmd == "plan":
        return _plan(args)
    if args.cmd == "train":
        return _train(args)
    if args.cmd == "serve":
        return _serve(args)
    from async_rl.store.remote_io import StorageError
    read = {"audit": _audit, "eval": _eval, "export": _export}[args.cmd]
    try:  # the read-only commands: bad input and an unusable store are exit 2
        _probe(args.run_dir)
        return read(args)
    except UsageError as e:
        return _err(str(e), 2)
    except StorageError as e:
        return _err(f"{e}; {e.hint}", 2)


def _audit(args) -> int:
    from async_rl.state.audit import audit, format_report
    try:
        rep = audit(args.run_dir)
    except OSError as e:
        return _err(str(e), 2)
    print(json.dumps(rep, indent=1) if args.json else format_report(rep))
    return 0 if rep["ok"] else 1


def _eval(args) -> int:
    from async_rl.run.evaluate import eval_run
    try:
        step, scores, what = eval_run(args.run_dir, args.step, args.overrides, warn=_warn,
                                      trust_code=args.trust_code)
    except (FileNotFoundError, ValueError) as e:
        return _err(str(e), 2)
    if args.json:
        print(json.dumps({"step": step, **scores}))
    else:
        print(f"eval {args.run_dir} step {step}: {what}")
        print("  " + "  ".join(f"{k.split('/', 1)[1]}={v:.4f}" for k, v in scores.items()))
    return 0


def _export(args) -> int:
    from async_rl.run.export import export
    try:
        out, step = export(args.run_dir, args.out, step=args.step, warn=_warn)
    except (FileNotFoundError, ValueError) as e:
        return _err(str(e), 2)
    print(f"exported step {step} to {out}")
    return 0


def _train(args) -> int:
    """Resolve and print the config, then train; each way a run can stop is one line."""
    from async_rl.model import hf
    try:
        cfg = hf.resolve(C.load(args.config, args.overrides))  # model.hf_path fills in the architecture
    except UsageError as e:
        return _err(str(e), 2)
    print("# resolved config\n" + C.to_yaml(cfg), flush=True)
    if args.print_config:
        return 0
    from async_rl.rollout import backends
    backends.prepare(cfg)  # before JAX takes a device
    from async_rl.model.sharding import init_distributed
    from async_rl.run.train import train
    init_distributed()
    try:
        return train(cfg).exit_code
    except Exception as e:
        return _train_failed(cfg, e)


def _serve(args) -> int:
    """Resolve and print the config, build the engine, serve until SIGTERM/SIGINT (exit 0)."""
    import importlib.util
    if any(importlib.util.find_spec(m) is None for m in ("starlette", "uvicorn")):
        return _err("async-rl serve needs its HTTP server: pip install 'async_rl[fleet]'", 2)
    from async_rl.model import hf
    try:
        cfg = hf.resolve(C.load(args.config, args.overrides))
    except UsageError as e:
        return _err(str(e), 2)
    print("# resolved config\n" + C.to_yaml(cfg), flush=True)
    if cfg.engine.backend == "vllm":
        return _err("engine.backend=vllm: async-rl serve runs the built-in engine (for vLLM, serve with vLLM itself)", 2)
    from async_rl.rollout.server import serve
    from async_rl.run.build import compilation_cache, serving_parts
    try:
        with compilation_cache(cfg.run.compilation_cache, cfg.run.compilation_cache_max_gb):
            tok, engine, abstract = serving_parts(cfg)
            if signals.requested():
                print("stopped before serving", flush=True)
                return 0
            return serve(cfg, tok, engine, abstract, host=args.host, port=args.port, log=_warn)
    except UsageError as e:
        return _err(str(e), 2)


def _train_failed(cfg, e: Exception) -> int:
    """The exit code (and line) of an exception that ended `train`; one that is no known kind is raised."""
    from async_rl.store import remote_io
    from async_rl.store.remote_io import StorageError
    from async_rl.store.rundir import storage_error
    if isinstance(e, StorageError):
        return _stopped(e)
    if isinstance(e, (UsageError, RunFailure)):
        return _err(str(e), e.exit_code)
    if isinstance(e, PermissionError):
        return _err(f"{e.filename or cfg.run.dir}: permission denied ({e.strerror}); the run was stopped", 2)
    if isinstance(e, MemoryError):
        return _err(f"out of host memory (the run was stopped; {_kept(cfg)}); use a smaller model or fewer "
                    "engine.max_concurrent_decodes", 1)
    if isinstance(e, OSError):  # a write no writer named (a library's): still one line where it is the disk's fault
        err = storage_error(e.filename or cfg.run.dir, e)
        if not isinstance(err, StorageError):
            raise e
        return _stopped(err)
    why = remote_io.cause(e)  # a library's storage call that no writer named
    if why:
        return _stopped(StorageError(cfg.run.dir, why, "storage"))
    if "RESOURCE_EXHAUSTED" not in str(e):
        raise e
    return _err(f"out of device memory ({str(e).splitlines()[0][:300]}); the run was stopped, {_kept(cfg)}", 1)


def _kept(cfg) -> str:
    """What a run stopped by a failure keeps: its last committed checkpoint, named."""
    from async_rl.state.layout import last_committed
    from async_rl.store.runfiles import CHECKPOINTS
    from async_rl.store.storage import run_path
    try:
        return f"{cfg.run.dir}: {last_committed(run_path(cfg.run.dir) / CHECKPOINTS)}"
    except OSError:
        return f"{cfg.run.dir} keeps its last committed checkpoint"


def _plan(args) -> int:
    """Exit 0: the step fits; 1: it does not (the knobs to try are printed); 2: bad input."""
    import re
    # Compiling needs no accelerator; forced host devices must be asked for before jax starts.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    m = re.fullmatch(r"cpu:(\d+)", args.topology)
    if m and "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={m.group(1)}").strip()
    from async_rl.model import hf
    from async_rl.plan.compile import format_report, plan
    try:
        cfg = hf.resolve(C.load(args.config, args.overrides))
        rep = plan(cfg, args.topology, config_name=args.config or "", hbm_gib=args.hbm_gib, cost=not args.no_cost,
                   engine=not args.no_engine)
    except UsageError as e:
        return _err(str(e), 2)
    print(json.dumps(rep.as_json(), indent=1) if args.json else format_report(rep), flush=True)
    return 0 if rep.fits else 1


if __name__ == "__main__":
    sys.exit(main())
