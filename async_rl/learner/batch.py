"""Host batches for the learner: per-row rollouts laid out in the engine's columns.

Owns: the `Row` record the learner takes (plain arrays: no ledger types), the fixed-shape
`Batch` of one learner step, and length buckets (a batch is only as wide as its longest
prompt and completion, rounded up to a bucket). Does not own: where rows come from
(train, sampler, ledger), or anything on devices (learner).

Layout: a batch with prompt width Pb <= P and completion width Nb <= N puts a prompt of
length L in columns [Pb - L, Pb) and the completion from column Pb, exactly the engine's
layout shifted left by `col_offset = P - Pb` columns. RoPE positions count from the first
valid column, so they do not change; the model adds `col_offset` where it indexes by
absolute column (the learned position table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np


class Row(NamedTuple):
    """One trained sample: its group's prompt and its own completion."""
    prompt_tokens: np.ndarray  # int32 [L]
    tokens: np.ndarray  # int32 [n] completion tokens (EOS included when drawn)
    logprobs: np.ndarray  # float32 [n] behaviour logprobs from the engine
    versions: np.ndarray  # int32 [n] policy version that produced each token (-1: an env's observation)
    reward: float
    truncated: bool = False  # stopped at rollout.max_new_tokens without a stop token
    routes: np.ndarray | None = None  # routing replay: uint [m, n_layers, k], experts at positions 0.. of prompt + tokens


@dataclass
class Batch:
    """One learner step on the host: B rows (groups x samples, group-major), T = Pb + Nb columns."""
    tokens_BxT: np.ndarray  # int32 prompt (left-padded to Pb) + completion
    positions_BxT: np.ndarray  # int32 RoPE positions (column - first valid column)
    valid_BxT: np.ndarray  # bool real tokens
    completion_BxN: np.ndarray  # int32 completion tokens (pad past the end)
    behav_logp_BxN: np.ndarray  # float32 engine logprobs of the completion tokens
    mask_BxN: np.ndarray  # bool tokens that count in the loss
    versions_BxN: np.ndarray  # int32 policy version that produced each token (-1 = none)
    rewards_B: np.ndarray  # float32
    row_valid_B: np.ndarray  # bool rows of real groups (a short last step is padded)
    truncated_B: np.ndarray  # bool completions cut at the length cap (no stop token)
    # routing replay: int16 [B, T, n_layers, k] the engine's experts per column (-1: the learner routes)
    routes_BxTxLxK: np.ndarray | None = None

    @property
    def widths(self) -> tuple[int, int]:
        """(prompt width Pb, completion width Nb)."""
        n = self.completion_BxN.shape[1]
        return self.tokens_BxT.shape[1] - n, n

    def device_dict(self) -> dict[str, np.ndarray]:
        return {k: v for k, v in self.__dict__.items() if k != "versions_BxN" and v is not None}


def bucket(n: int, smallest: int, cap: int) -> int:
    """`smallest * 2^k` >= n, at most `cap`; `smallest` = 0 means always `cap`."""
    if not smallest:
        return cap
    w = smallest
    while w < n:
        w *= 2
    return min(w, cap)


def bucket_widths(smallest: int, cap: int) -> list[int]:
    """Every width `bucket` can return: the compiled shapes are at most these squared."""
    return sorted({bucket(n, smallest, cap) for n in range(cap + 1)})


def build_batch(rows: Sequence[Row], *, n_rows: int, prompt_len: int, max_new: int, pad_id: int,
                bucket_min: int = 0, routes: tuple[int, int] | None = None) -> Batch:
    """Lays `rows` (group-major) out in `n_rows` rows; the rest are padding (row_valid False).

    Widths: the longest prompt and completion, each rounded up by `bucket` (`bucket_min` 0:
    always `prompt_len` + `max_new`, the engine's column layout). `routes`: (n_layers, k) of
    an MoE policy under routing replay: the rows' recorded experts go in `routes_BxTxLxK`."""
    if len(rows) > n_rows:
        raise ValueError(f"build_batch: {len(rows)} rows do not fit a batch of {n_rows}")
    P = bucket(max((len(r.prompt_tokens) for r in rows), default=0), bucket_min, prompt_len)
    N = bucket(max((len(r.tokens) for r in rows), default=0), bucket_min, max_new)
    B, T = n_rows, P + N
    tokens = np.full((B, T), pad_id, np.int32)
    valid = np.zeros((B, T), bool)
    positions = np.zeros((B, T), np.int32)
    comp = np.full((B, N), pad_id, np.int32)
    behav = np.zeros((B, N), np.float32)
    mask = np.zeros((B, N), bool)
    versions = np.full((B, N), -1, np.int32)
    rewards = np.zeros((B,), np.float32)
    row_valid = np.zeros((B,), bool)
    truncated = np.zeros((B,), bool)
    for r, row in enumerate(rows):
        L, n = len(row.prompt_tokens), len(row.tokens)
        tokens[r, P - L:P] = row.prompt_tokens
        tokens[r, P:P + n] = row.tokens
        valid[r, P - L:P + n] = True
        positions[r, P - L:] = np.arange(T - (P - L))
        comp[r, :n] = row.tokens
        behav[r, :n] = row.logprobs
        mask[r, :n] = np.asarray(row.versions) >= 0  # an env's observation tokens are not trained
        versions[r, :n] = row.versions
        rewards[r] = row.reward
        row_valid[r] = True
        truncated[r] = row.truncated
    batch = Batch(tokens, positions, valid, comp, behav, mask, versions, rewards, row_valid, truncated)
    if routes is not None:
        batch.routes_BxTxLxK = np.full((B, T) + tuple(routes), -1, np.int16)
        for r, row in enumerate(rows):
            if row.routes is not None and len(row.routes):
                start = P - len(row.prompt_tokens)
                batch.routes_BxTxLxK[r, start:start + len(row.routes)] = row.routes
    return batch


def widen(batch: Batch, prompt_width: int, new_width: int, pad_id: int) -> Batch:
    """The same rows in a wider layout (processes agree on one shape per step)."""
    P0, N0 = batch.widths
    dp, dn = prompt_width - P0, new_width - N0
    if dp == 0 and dn == 0:
        return batch
    assert dp >= 0 and dn >= 0, (batch.widths, prompt_width, new_width)
    cols = lambda x, value, left, right: np.pad(x, ((0, 0), (left, right)), constant_values=value)
    positions = cols(batch.positions_BxT, 0, dp, dn)
    # columns appended on the right continue each row's positions
    if dn:
        positions[:, -dn:] = positions[:, -dn - 1:-dn] + np.arange(1, dn + 1)
    routes = batch.routes_BxTxLxK
    if routes is not None:
        routes = np.pad(routes, ((0, 0), (dp, dn), (0, 0), (0, 0)), constant_values=-1)
    return Batch(cols(batch.tokens_BxT, pad_id, dp, dn), positions, cols(batch.valid_BxT, False, dp, dn),
                 cols(batch.completion_BxN, pad_id, 0, dn), cols(batch.behav_logp_BxN, 0.0, 0, dn),
                 cols(batch.mask_BxN, False, 0, dn), cols(batch.versions_BxN, -1, 0, dn), batch.rewards_B,
                 batch.row_valid_B, batch.truncated_B, routes)
