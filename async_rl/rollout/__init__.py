"""Generation: the rollout interface every backend implements, the built-in JAX engine (prefill,
chunked decode, its batched API with JetStream-style single-row wrappers), the one slot scheduler that
drives continuous batching, the pump that runs generation ahead of training, and the vLLM backend."""
