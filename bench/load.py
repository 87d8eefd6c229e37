"""HF checkpoint loading: time and peak host memory vs. the bytes on disk, Qwen2.5-0.5B shapes.

Owns: writing a random bf16 checkpoint with Qwen2.5-0.5B's shapes (sharded into about 4
files with an index) to a temporary directory, measuring each loader in a fresh process,
and the printed table. Does not own: any loading logic (`async_rl.model.hf`).

Peak host memory is the process's resident set (RSS, sampled every millisecond by a
thread) above its level just before loading. On the CPU backend the loaded parameters
themselves live in host memory, so the table also gives the peak minus the bytes of the
resident parameters: the loader's own transient memory, which is the whole of its host
footprint on an accelerator. The target is transient < 1.5x the largest single file.
The reference row reads every file with `safetensors.numpy.load_file` and then places the
tensors, as a loader without slicing would.

    python bench/load.py                 # writes ~1 GB to a temp dir, three loads
    python bench/load.py --dir /tmp/q05  # keep (or reuse) the checkpoint there
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

QWEN25_05B = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": 151936,
              "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
              "num_key_value_heads": 2, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "tie_word_embeddings": True, "max_position_embeddings": 32768, "torch_dtype": "bfloat16"}
GB = 1e9


def write_checkpoint(path: Path, shard_bytes: int) -> None:
    """Random bf16 weights, one tensor generated at a time, written by `hf.save_hf`."""
    import ml_dtypes
    import numpy as np

    from async_rl.model import hf

    mcfg = hf.model_config_from_hf(_config_dir(path), _base())
    rng = np.random.default_rng(0)
    d, f, hd = mcfg.d_model, mcfg.d_ff, mcfg.resolved_head_dim

    def rand(*shape):
        return (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    layer = lambda: {"attn_norm": {"scale": rand(d)}, "mlp_norm": {"scale": rand(d)},
                     "attn": {"q": {"kernel": rand(d, mcfg.n_heads * hd), "bias": rand(mcfg.n_heads * hd)},
                              "k": {"kernel": rand(d, mcfg.n_kv_heads * hd), "bias": rand(mcfg.n_kv_heads * hd)},
                              "v": {"kernel": rand(d, mcfg.n_kv_heads * hd), "bias": rand(mcfg.n_kv_heads * hd)},
                              "o": {"kernel": rand(mcfg.n_heads * hd, d)}},
                     "mlp": {"gate": {"kernel": rand(d, f)}, "up": {"kernel": rand(d, f)},
                             "down": {"kernel": rand(f, d)}}}
    params = {"embed": {"embedding": rand(mcfg.vocab_size, d)}, "final_norm": {"scale": rand(d)},
              "layers": {i: layer() for i in range(mcfg.n_layers)}}
    hf.save_hf(params, mcfg, mcfg.vocab_size, path, max_shard_bytes=shard_bytes)


def _base():
    from async_rl.config import ModelConfig
    return ModelConfig(param_dtype="bfloat16", dtype="bfloat16")


def _config_dir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(QWEN25_05B))
    return path


class PeakRSS:
    """Highest RSS seen by a 1 ms sampling thread between start() and stop()."""

    def __init__(self):
        import psutil
        self.proc, self.peak, self._run = psutil.Process(), 0, False

    def rss(self) -> int:
        return self.proc.memory_info().rss

    def start(self) -> int:
        self.base = self.peak = self.rss()
        self._run = True
        self._t = threading.Thread(target=self._loop, daemon=True)
        self._t.start()
        return self.base

    def _loop(self):
        while self._run:
            self.peak = max(self.peak, self.rss())
            time.sleep(0.001)

    def stop(self) -> int:
        self._run = False
        self._t.join()
        self.peak = max(self.peak, self.rss())
        return self.peak


def measure(path: str, mode: str, param_dtype: str) -> dict:
    """One load in this process (run in a child, so every load starts from a clean heap)."""
    import jax
    import numpy as np
    from flax import nnx

    from async_rl.config import ModelConfig
    from async_rl.model import hf, sharding
    from async_rl.model.transformer import Transformer

    mcfg = hf.model_config_from_hf(path, ModelConfig(param_dtype=param_dtype, dtype=param_dtype))
    _, aparams = nnx.split(nnx.eval_shape(lambda: Transformer(mcfg, mcfg.vocab_size, rngs=nnx.Rngs(0))), nnx.Param)
    mesh = sharding.build_mesh(jax.local_devices(), (jax.local_device_count(), 1, 1, 1), sharding.AXES)
    shardings = sharding.param_shardings(aparams, mesh)
    jax.block_until_ready(jax.device_put(np.zeros(4), jax.local_devices()[0]))  # backend up before the baseline
    mem = PeakRSS()
    base = mem.start()
    t0 = time.perf_counter()
    if mode == "hf.load_params":
        params = hf.load_params(path, aparams, shardings)
    else:
        params = _naive(path, aparams, shardings)
    jax.block_until_ready(params)
    secs = time.perf_counter() - t0
    peak = mem.stop()
    resident = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in jax.tree.leaves(params))
    on_host = resident if jax.default_backend() == "cpu" else 0
    return {"secs": secs, "peak": peak - base, "params": on_host, "backend": jax.default_backend()}


def _naive(path, aparams, shardings):
    import jax
    import numpy as np
    import safetensors.numpy as stn

    from async_rl.model import hf

    tensors = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        tensors.update(stn.load_file(str(f)))
    named, treedef = hf._flat(aparams)
    out = []
    for (ours, var), (_, sh) in zip(named, hf._flat(shardings)[0]):
        parts = [tensors[name].T if transposed else tensors[name]
                 for name, _, _, transposed in hf.hf_tensors(ours, tuple(var.shape))]
        x = parts[0] if len(parts) == 1 and parts[0].shape == tuple(var.shape) else np.stack(parts)
        out.append(var.replace(jax.device_put(x.astype(var.dtype), sh.get_value())))
    return jax.tree_util.tree_unflatten(treedef, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="", help="checkpoint directory (written if it has no config.json); "
                                              "default: a temporary directory, removed at the end")
    ap.add_argument("--shards", type=int, default=4, help="about how many files to split the checkpoint into")
    ap.add_argument("--child", nargs=3, metavar=("PATH", "MODE", "DTYPE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(*args.child)))
        return
    tmp = None if args.dir else tempfile.TemporaryDirectory(prefix="bench_load_")
    path = Path(args.dir or tmp.name)
    if not (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").is_file():
        total = 494_032_768 * 2  # Qwen2.5-0.5B parameters, bf16
        t0 = time.perf_counter()
        write_checkpoint(_config_dir(path), total // args.shards + 1)
        print(f"wrote a random Qwen2.5-0.5B-shaped bf16 checkpoint to {path} in {time.perf_counter() - t0:.1f}s")
    files = sorted(path.glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    print(f"{len(files)} files, {sum(sizes) / GB:.3f} GB on disk: "
          + ", ".join(f"{f.name} {s / GB:.3f} GB" for f, s in zip(files, sizes)))
    largest = max(sizes)
    print(f"\n{'loader':<22} {'params':<9} {'load s':>7} {'GB/s':>6} {'peak RSS':>9} {'params':>8} "
          f"{'transient':>10} {'/ largest':>10}")
    for mode, dt in (("hf.load_params", "bfloat16"), ("hf.load_params", "float32"), ("safetensors+put", "bfloat16")):
        out = subprocess.run([sys.executable, __file__, "--child", str(path), mode, dt], capture_output=True,
                             text=True, env=dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "")))
        if out.returncode:
            sys.exit(f"{mode} {dt} failed:\n{out.stderr[-3000:]}")
        r = json.loads(out.stdout.strip().splitlines()[-1])
        transient = r["peak"] - r["params"]
        print(f"{mode:<22} {dt:<9} {r['secs']:>7.2f} {sum(sizes) / GB / r['secs']:>6.2f} {r['peak'] / GB:>8.3f}G "
              f"{r['params'] / GB:>7.3f}G {transient / GB:>9.3f}G {transient / largest:>9.2f}x")
    print(f"\nbackend {r['backend']}; peak RSS above the pre-load level; 'params' = loaded parameters resident in "
          "host memory (CPU backend only); transient = peak - params; target: transient < 1.50x the largest file")
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
