"""What survives a kill: the checkpoint layout and its Orbax patch, the writer that commits model,
optimizer, data iterator, ledger and buffer as one atomic step, the verified reader, resharding to a
new process count, the lineage/drops/rollouts history that follows the checkpoint, and the audit that
proves every prompt trained exactly once."""
