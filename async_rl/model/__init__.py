"""The policy network: the decoder-only transformer (Flax NNX), its attention and KV-cache layouts,
reading and writing Hugging Face checkpoints, the sharding rules that place parameters and activations
on a device mesh (and the one mesh builder), and the model's FLOPs and parameter counts."""
