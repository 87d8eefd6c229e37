"""The published weights file (`rollout.weights`): bit-exact round trips, bfloat16 included, a
file checked leaf by leaf against the engine's tree, and the fingerprint's first differing field."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from async_rl import config as C
from async_rl.data.tokenizer import CharTokenizer
from async_rl.rollout import weights


class Small(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(3, 4, rngs=nnx.Rngs(0), param_dtype=jnp.bfloat16)
        self.b = nnx.Linear(4, 2, rngs=nnx.Rngs(1), param_dtype=jnp.float32)


def _leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_a_round_trip_is_bit_exact_with_bfloat16_leaves(tmp_path):
    params = nnx.state(Small(), nnx.Param)
    weights.save(tmp_path / "w.npz", params, 7)
    like = jax.eval_shape(lambda: params)
    back = weights.load(tmp_path / "w.npz", like)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for got, want in zip(_leaves(back), _leaves(params), strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert got.tobytes() == want.tobytes()
    assert {x.dtype.name for x in _leaves(back)} == {"bfloat16", "float32"}
    with np.load(tmp_path / "w.npz") as f:
        assert int(f["__version__"]) == 7 and "a/kernel/value" in f.files
        assert f["a/kernel/value"].dtype == np.uint16  # bfloat16 kept as raw bits


def test_a_file_that_differs_from_the_engine_tree_names_the_first_leaf(tmp_path):
    params = nnx.state(Small(), nnx.Param)
    weights.save(tmp_path / "w.npz", params, 1)
    other = nnx.state(Small(), nnx.Param)
    other["b"]["kernel"] = other["b"]["kernel"].replace(jnp.zeros((5, 2), jnp.float32))
    with pytest.raises(ValueError, match=r"leaf b/kernel/value is float32\[4, 2\] in the file, the engine's is "
                                         r"float32\[5, 2\]"):
        weights.load(tmp_path / "w.npz", other)
    cast = jax.tree.map(lambda x: x.astype(jnp.float32), params)
    with pytest.raises(ValueError, match=r"leaf a/bias/value is bfloat16\[4\] in the file, the engine's is float32"):
        weights.load(tmp_path / "w.npz", cast)
    fewer = nnx.state(Small(), nnx.Param)
    del fewer["b"]
    with pytest.raises(ValueError, match="leaf b/bias/value in the file is not in the engine's tree"):
        weights.load(tmp_path / "w.npz", fewer)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a weights file"):
        weights.load(tmp_path / "junk.npz", params)


def test_a_base_written_once_and_files_of_some_leaves_load_as_the_whole_tree(tmp_path):
    """LoRA's publication: the frozen leaves once, each version's changing leaves alone."""
    params = nnx.state(Small(), nnx.Param)
    changing = lambda key: key.startswith("b/")  # noqa: E731
    weights.save(tmp_path / "base.npz", params, 0, only=lambda k: not changing(k))
    weights.save(tmp_path / "v1.npz", params, 1, only=changing)
    with np.load(tmp_path / "v1.npz") as f:
        assert sorted(k for k in f.files if not k.startswith("__")) == ["b/bias/value", "b/kernel/value"]
    like = jax.eval_shape(lambda: params)
    back = weights.load(tmp_path / "v1.npz", like, base=weights.load_leaves(tmp_path / "base.npz"))
    for got, want in zip(_leaves(back), _leaves(params), strict=True):
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes()
    with pytest.raises(ValueError, match="leaf a/bias/value missing from the file"):
        weights.load(tmp_path / "v1.npz", like)  # without its base
    assert weights.is_adapter("layers/attn/q/lora_a/value") and not weights.is_adapter("layers/attn/q/kernel/value")


def test_the_fingerprint_is_flat_and_a_mismatch_names_the_first_field():
    cfg = C.load("configs/tiny.yaml", [])
    tok = CharTokenizer()
    fp = weights.fingerprint(cfg, tok)
    assert all(isinstance(v, (str, int, float)) for v in fp.values()) and "model.hf_path" not in fp
    assert fp["vocab_size"] == 19 and fp["model.d_model"] == 64 and fp["run.seed"] == 0
    assert fp == weights.fingerprint(cfg, CharTokenizer())  # deterministic
    assert weights.mismatch(fp, fp) is None
    lora = weights.fingerprint(C.replace(cfg, learner={"lora_rank": 4}, model={"d_model": 32}), tok)
    assert weights.mismatch(fp, lora) == "lora.alpha: (absent) vs 16.0"
    assert weights.mismatch(fp, {**fp, "model.d_model": 32}) == "model.d_model: 64 vs 32"
    assert weights.fingerprint(cfg, CharTokenizer(alphabet="0123456789"))["tokenizer"] != fp["tokenizer"]
