"""The vLLM backend's LoRA adapter folder lives in run.dir, without vLLM: a fake engine and a
fake `vllm.lora.request` stand in, as the folder's life is this project's, not vLLM's."""

import os
import signal
import subprocess
import sys
from pathlib import Path

# a session whose vLLM backend loaded two versions' adapters, then killed with SIGKILL
_SESSION = """
import os, signal, sys, types
import numpy as np, jax
from flax import nnx
from async_rl.config import ModelConfig
from async_rl.model import lora
from async_rl.model.transformer import Transformer
from async_rl.rollout import vllm_lora

class LoRARequest:
    def __init__(self, lora_name, lora_int_id, lora_path):
        self.lora_name, self.lora_int_id, self.lora_path = lora_name, lora_int_id, lora_path

class Engine:
    def add_lora(self, req): return True
    def remove_lora(self, i): return True

mod = types.ModuleType("vllm.lora.request"); mod.LoRARequest = LoRARequest
sys.modules.update({"vllm": types.ModuleType("vllm"), "vllm.lora": types.ModuleType("vllm.lora"),
                    "vllm.lora.request": mod})
mcfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, n_kv_heads=2, d_ff=64)
spec = lora.LoraSpec(4, 8.0, lora.PROJECTIONS)
abstract = nnx.eval_shape(lambda: Transformer(mcfg, 16, rngs=nnx.Rngs(0), lora=spec))
ad = jax.tree.map(lambda a: np.ones(a.shape, np.float32), nnx.filter_state(nnx.split(abstract, nnx.Param)[1], nnx.LoRAParam))
a = vllm_lora.Adapters(Engine(), rank=4, alpha=8.0, root=vllm_lora.folder(sys.argv[1], 0))
a.load(ad, 1)
a.load(ad, 2)
print(a.root, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_sessions_lora_adapters_stay_in_run_dir_and_the_next_start_clears_them(tmp_path):
    """After a SIGKILL the adapter directories vLLM loaded are in run.dir/.vllm_lora, not in the
    system's temporary folder; the next backend start empties that folder and a clean close
    removes it. A run.dir on an object store keeps a temporary folder (vLLM reads local ones)."""
    from async_rl.rollout import vllm_lora
    run, system_tmp = tmp_path / "run", tmp_path / "system_tmp"
    run.mkdir()
    system_tmp.mkdir()
    r = subprocess.run([sys.executable, "-c", _SESSION, str(run)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TMPDIR": str(system_tmp)})
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    root = Path(r.stdout.strip())
    assert root == run / ".vllm_lora"
    assert [p.name for p in root.iterdir()] == ["v2-2"]  # version 1's went when 2 replaced it
    assert (root / "v2-2" / "adapter_model.safetensors").is_file()
    assert not any(system_tmp.iterdir())
    a = vllm_lora.Adapters(object(), rank=4, alpha=8.0, root=vllm_lora.folder(str(run), 0))
    assert a.root == root and not any(root.iterdir())  # the killed session's adapters are gone
    a.close()
    assert not root.exists()
    assert vllm_lora.folder(str(run), 3) == run / ".vllm_lora.p3"
    assert vllm_lora.folder("gs://bucket/run", 0) is None
