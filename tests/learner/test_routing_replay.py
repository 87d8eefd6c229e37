"""Routing replay (R3) on the host side: the engine's routes reach a sample in position order
(a continuation keeps its saved rows), the learner's batch puts each row at its token's column,
and the config refuses replay where no routes exist (docs/design.md, "Routing replay")."""
import numpy as np
import pytest
from helpers import cfg

from async_rl import config as C
from async_rl.buffer.ledger import Sample
from async_rl.learner.batch import Row, build_batch, widen
from async_rl.rollout.scheduler import Piece

L, K = 2, 2


def _rows(start: int, n: int) -> np.ndarray:
    """Distinct rows: row j holds (start + j) everywhere, so a shifted row is caught."""
    return np.broadcast_to((np.arange(start, start + n) % 251)[:, None, None], (n, L, K)).astype(np.uint8)


def _piece(tokens, routes, head=None) -> Piece:
    return Piece(0, None, list(tokens), [0.0] * len(tokens), [0] * len(tokens), False, routes, head)


def _add(s: Sample, prompt_len: int, p: Piece) -> None:
    s.add_routes(prompt_len, p.head, p.routes)  # what the pump does with a recorded piece


def test_a_sample_gets_its_prompt_head_then_one_row_per_token_and_a_continuation_keeps_its_saved_rows():
    s, p = Sample(), 5
    _add(s, p, _piece([7, 8], _rows(4, 2), head=_rows(0, 4)))  # prompt positions 0..3, then 4, 5
    s.tokens += [7, 8]
    _add(s, p, _piece([9], _rows(6, 1)))
    s.tokens += [9]
    np.testing.assert_array_equal(s.route_rows(), _rows(0, 7))
    # a continuation (after a kill) prefills prompt + 3 saved tokens: its head covers rows the
    # sample has; they stay what was recorded
    saved = s.route_rows().copy()
    _add(s, p, _piece([3], _rows(7, 1), head=np.full((7, L, K), 99, np.uint8)))
    s.tokens += [3]
    np.testing.assert_array_equal(s.route_rows()[:7], saved)
    assert s.n_routes == p - 1 + len(s.tokens)


def test_an_episodes_observation_rows_come_from_the_next_starts_head():
    s, p = Sample(tokens=[1, 2]), 3
    s.routes = [_rows(0, 4)]  # prompt 0..1, tokens' 2..3
    s.tokens += [50, 51]  # an env's observation: no routes yet
    _add(s, p, _piece([4], _rows(6, 1), head=_rows(0, 6)))
    s.tokens += [4]
    np.testing.assert_array_equal(s.route_rows(), _rows(0, 7))


def test_rows_that_would_not_line_up_are_dropped_not_shifted():
    s, p = Sample(tokens=[1, 2, 3]), 4  # tokens without routes (replay turned on mid-run), no head
    _add(s, p, _piece([4], _rows(6, 1)))
    assert s.route_rows() is None


def test_the_batch_puts_each_route_row_at_its_tokens_column_and_pads_with_minus_one():
    prompt, toks = np.array([5, 6, 7], np.int32), np.array([8, 9], np.int32)
    r = _rows(10, 4)  # positions 0..3 of 5 (the last token predicts nothing)
    rows = [Row(prompt, toks, np.zeros(2, np.float32), np.zeros(2, np.int32), 1.0, False, r),
            Row(prompt[:2], toks, np.zeros(2, np.float32), np.zeros(2, np.int32), 0.0)]
    b = build_batch(rows, n_rows=4, prompt_len=4, max_new=4, pad_id=0, routes=(L, K))
    assert b.routes_BxTxLxK.shape == (4, 8, L, K) and b.routes_BxTxLxK.dtype == np.int16
    np.testing.assert_array_equal(b.routes_BxTxLxK[0, 1:5], r)  # prompt from column 4 - 3
    assert (b.routes_BxTxLxK[0, [0, 5, 6, 7]] == -1).all() and (b.routes_BxTxLxK[1:] == -1).all()
    assert b.tokens_BxT[0, 1] == 5
    w = widen(b, 6, 5, 0)
    np.testing.assert_array_equal(w.routes_BxTxLxK[0, 3:7], r)
    assert w.routes_BxTxLxK.shape == (4, 11, L, K) and "routes_BxTxLxK" in w.device_dict()
    plain = build_batch(rows, n_rows=4, prompt_len=4, max_new=4, pad_id=0)
    assert plain.routes_BxTxLxK is None and "routes_BxTxLxK" not in plain.device_dict()


MOE = ["model.qk_norm=true", "model.n_experts=4", "model.n_experts_per_token=2", "model.d_ff_expert=32"]


def test_routing_replay_is_refused_on_a_dense_model_and_on_backends_that_return_no_routes(tmp_path):
    with pytest.raises(C.ConfigError) as e:
        cfg(tmp_path, "learner.routing_replay=true")
    assert "\n" not in str(e.value) and "learner.routing_replay" in str(e.value) and "dense" in str(e.value)
    with pytest.raises(C.ConfigError) as e:
        cfg(tmp_path, *MOE, "learner.routing_replay=true", "engine.backend=remote", "engine.servers=http://x:1")
    assert "engine.backend=remote" in str(e.value)
    assert cfg(tmp_path, *MOE, "learner.routing_replay=true").learner.routing_replay
