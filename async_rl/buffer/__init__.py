"""What waits between generation and training: the ledger of prompt groups (pending, in flight, ready,
trained), the samplers that decide which ready group trains next and how stale it may be, and the
rollout journal that keeps finished samples across a SIGKILL."""
