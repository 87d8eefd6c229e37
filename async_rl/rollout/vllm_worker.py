"""A stock `vllm serve` as a fleet server: the worker extension a trainer drives it through.

Named when the server starts (`docs/fleet.md`):
`VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --logprobs-mode processed_logprobs
--worker-extension-cls async_rl.rollout.vllm_worker.FleetWorker`. vLLM mixes this class into
each worker, and the trainer calls its methods through vLLM's `POST /collective_rpc` (a dev
mode endpoint; its arguments arrive as strings). Owns: what the worker tells a trainer about
what it serves (`async_rl_info`, LoRA settings included) and loading a published weights
file in place (`async_rl_load`; a LoRA run's adapters go through vLLM's own
`/v1/load_lora_adapter`). Does not own: when weights are loaded or which requests run (`fleet`,
`remote`), the file format (`weights`), HF tensor names (`hf`).
"""

from __future__ import annotations


class FleetWorker:
    """Methods vLLM adds to its worker (`self` is the worker: `model_runner`, `model_config`)."""

    def async_rl_info(self, n_tokens: str = "0") -> dict:
        """What the trainer checks before giving this server work (`weights.hf_fingerprint` of
        the checkpoint it serves, its logprobs mode, room); makes the sampler return logprobs
        before top-k/top-p and never sample ids at or past `n_tokens` (rows HF checkpoints pad
        the vocabulary with), as the built-in engine and the learner define them."""
        from vllm import envs

        from async_rl.rollout import weights
        from async_rl.rollout.vllm_backend import untruncated_logprobs

        mc, lc = self.model_config, self.vllm_config.lora_config
        untruncated_logprobs(self.model_runner.sampler, n_tokens=int(n_tokens))
        return {"fingerprint": weights.hf_fingerprint(mc.model), "logprobs_mode": str(mc.logprobs_mode),
                "capacity": int(self.vllm_config.scheduler_config.max_num_seqs), "vocab": int(mc.get_vocab_size()),
                "max_model_len": int(mc.max_model_len),
                # LoRA runs: adapters loaded by name through /v1/load_lora_adapter (None: --enable-lora is off)
                "lora": None if lc is None else {"max_lora_rank": int(lc.max_lora_rank), "max_loras": int(lc.max_loras),
                                                 "runtime_updates": bool(envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING)}}

    def async_rl_load(self, uri: str) -> dict:  # noqa: D401
        """Loads a full weights file (`weights.save`, local or object storage) in place; the
        trainer resets the prefix cache after, with none of its requests running (a prompt
        cached under old weights is not reused)."""
        import torch

        from async_rl.rollout import weights

        leaves = weights.load_leaves(uri)
        tie = bool(getattr(self.model_config.hf_config, "tie_word_embeddings", False))
        named = weights.hf_named(leaves, tie_embeddings=tie)
        self.model_runner.reload_weights(weights_iterator=((n, torch.from_numpy(x)) for n, x in named),
                                         is_checkpoint_format=True)
        return {"leaves": len(leaves)}
