"""Watching a run: metrics.jsonl and the console line, TensorBoard event files, the reward plot, and
the best-effort Weights & Biases mirror of metrics.jsonl."""
