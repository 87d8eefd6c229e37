"""Decode attention over a paged pool (`model.paged_attention`) equals plain masked attention
over each sequence's keys laid out contiguously, with group prompts shared between sequences
(`rollout.kv_pages`), for the XLA path and for JAX's TPU and GPU paged attention kernels run
in interpret mode."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from async_rl.model import paged_attention as pa
from async_rl.model.attention import masked
from async_rl.rollout.kv_pages import PagePool

S, H, G, D, PAGE = 4, 4, 2, 128, 8  # the TPU kernel's head dim: a multiple of 128


def _pool(lens, seed=0, shared_prompt=11):
    """A pool holding `len(lens)` sequences: the first two fork one prompt of `shared_prompt`
    tokens (its pages shared), the rest their own; each sequence's keys and values written
    where its pages say. Returns (kv, table, keys/values per sequence)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: np.asarray(jnp.asarray(rng.normal(size=shape), jnp.bfloat16), np.float32)  # noqa: E731
    pool = PagePool(n_pages=64, page_size=PAGE)
    kv = (jnp.zeros((G, 64, PAGE, D), jnp.float32),) * 2
    prompt_k, prompt_v = normal(2, shared_prompt, G, D)
    pool.grow("prompt", shared_prompt)
    kv = pa.write_rows(*kv, prompt_k, prompt_v, jnp.asarray(pool.pages("prompt")))
    seqs = []
    for s, n in enumerate(lens):
        k, v = normal(2, n, G, D)
        if s < 2:  # a group's sample: the prompt's pages, then its own tokens
            copy = pool.fork("prompt", s, shared_prompt)
            if copy:
                kv = tuple(x.at[:, copy[1]].set(x[:, copy[0]]) for x in kv)
            k[:shared_prompt], v[:shared_prompt] = prompt_k, prompt_v
            start = shared_prompt
        else:
            start = 0
        pool.grow(s, n)
        kv = pa.write_rows(*kv, k[start:], v[start:], jnp.asarray(pool.pages(s)), start)
        seqs.append((k, v))
    pool.release("prompt")
    pool.check()
    width = max(pool.pages_for(n) for n in lens)
    return kv, jnp.asarray(pool.table(list(range(len(lens))), width)), seqs


def _reference(q, seqs, window=0):
    """Each sequence's query against its keys, contiguous: model.attention's masked path."""
    out = []
    for s, (k, v) in enumerate(seqs):
        n = k.shape[0]
        j = np.arange(n)
        mask = (j >= n - window) if window else np.ones(n, bool)
        out.append(masked(q[s][None, None], jnp.asarray(k)[None], jnp.asarray(v)[None], jnp.asarray(mask)[None, None]))
    return jnp.concatenate(out).reshape(len(seqs), H, D)


@pytest.mark.parametrize("window", [0, 5])
def test_xla_decode_over_shared_pages_is_plain_attention(window):
    lens = [19, 11, 30, 1]
    kv, table, seqs = _pool(lens)
    q = jax.random.normal(jax.random.PRNGKey(1), (S, H, D), jnp.float32)
    got = pa.decode(q, *kv, jnp.asarray(lens), table, window=window)
    np.testing.assert_allclose(got, _reference(q, seqs, window), atol=2e-6, rtol=1e-5)
    # a wider table (a bigger bucket) reads null pages past each length: the same answer
    wide = jnp.pad(table, ((0, 0), (0, 3)))
    np.testing.assert_allclose(pa.decode(q, *kv, jnp.asarray(lens), wide, window=window), got, atol=1e-6)


def test_a_decode_step_writes_each_sequence_at_its_page_and_offset():
    lens = [19, 11, 30, 1]
    kv, table, seqs = _pool(lens)
    rng = np.random.default_rng(3)
    k_new, v_new = rng.normal(size=(2, S, G, D)).astype(np.float32)
    pos = jnp.asarray([n - 1 for n in lens])  # overwrite each sequence's newest token
    kv = pa.write(*kv, k_new, v_new, table, pos)
    for s, (k, v) in enumerate(seqs):
        k[-1], v[-1] = k_new[s], v_new[s]
    q = jax.random.normal(jax.random.PRNGKey(2), (S, H, D), jnp.float32)
    np.testing.assert_allclose(pa.decode(q, *kv, jnp.asarray(lens), table), _reference(q, seqs), atol=2e-6, rtol=1e-5)


def test_the_tpu_kernel_in_interpret_mode_matches_the_xla_path():
    from jax.experimental.pallas import tpu as pltpu

    lens = [19, 11, 30, 1]
    kv, table, _ = _pool(lens)
    q = jax.random.normal(jax.random.PRNGKey(1), (S, H, D), jnp.float32)
    want = pa.decode(q, *kv, jnp.asarray(lens), table)
    with pltpu.force_tpu_interpret_mode():
        got = pa.decode(q, *kv, jnp.asarray(lens), table, impl="pallas", pages_per_block=2)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def test_the_gpu_kernel_in_interpret_mode_matches_the_xla_path():
    lens = [19, 11, 30, 1]
    kv, table, _ = _pool(lens)
    q = jax.random.normal(jax.random.PRNGKey(2), (S, H, D), jnp.float32)
    want = pa.decode(q, *kv, jnp.asarray(lens), table)
    got = pa.decode(q, *kv, jnp.asarray(lens), table, impl="pallas_gpu", interpret=True)
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
