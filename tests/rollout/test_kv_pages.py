"""The paged KV pool's bookkeeping (`rollout.kv_pages`): counts and tables agree after any
sequence of grows, forks and releases, a page is never mapped writable by two holders, and
every page comes back."""
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from async_rl.rollout.kv_pages import NULL_PAGE, PagePool


def test_a_group_shares_its_prompt_pages_and_copies_only_the_partial_one():
    pool = PagePool(n_pages=16, page_size=4)
    assert pool.grow("prompt", 10) == [1, 2, 3]  # 10 tokens: 2 full pages and a partial one
    copies = [pool.fork("prompt", ("s", i), 10) for i in range(4)]
    assert copies == [(3, 4), (3, 5), (3, 6), (3, 7)]  # the partial page copied, per sample
    assert pool.pages(("s", 2)) == [1, 2, 6]
    assert pool.refs[1] == pool.refs[2] == 5 and pool.refs[3] == 1
    pool.release("prompt")
    assert pool.free == 15 - 2 - 4  # the prompt's partial page is free again, its full ones shared
    new = pool.grow(("s", 0), 13)  # a sample's next page is its own
    assert len(new) == 1 and pool.refs[new[0]] == 1 and new[0] not in (1, 2)
    pool.check()
    for i in range(4):
        pool.release(("s", i))
    assert pool.free == 15 and pool.holders() == []
    pool.check()


def test_a_prompt_of_whole_pages_is_shared_without_a_copy():
    pool = PagePool(n_pages=8, page_size=4)
    pool.grow("p", 8)
    assert pool.fork("p", "a", 8) is None and pool.pages("a") == [1, 2]
    assert pool.grow("a", 9) == [3]


def test_a_short_pool_takes_nothing_and_says_so():
    pool = PagePool(n_pages=4, page_size=2)  # 3 usable pages
    assert pool.grow("a", 5) == [1, 2, 3]
    assert pool.grow("b", 1) is None and pool.tokens("b") == 0
    assert pool.grow("a", 7) is None and pool.tokens("a") == 5
    assert pool.fork("a", "c", 5) is False and "c" not in pool.holders()
    assert pool.fork("a", "c", 4) is None  # whole pages only: nothing to take
    pool.check()


def test_the_table_pads_with_the_null_page_and_refuses_a_row_too_long():
    pool = PagePool(n_pages=8, page_size=2)
    pool.grow("a", 3)
    t = pool.table(["a", None, "missing"], width=3)
    assert t.dtype == np.int32 and t.tolist() == [[1, 2, NULL_PAGE], [NULL_PAGE] * 3, [NULL_PAGE] * 3]
    with pytest.raises(ValueError, match="more than the table"):
        pool.table(["a"], width=1)


class Pool(RuleBasedStateMachine):
    """Random grows, forks and releases; after each, the pool's counts are its tables', no page
    a holder writes next (its last, partial one) is mapped by another, and free + mapped = all."""

    def __init__(self):
        super().__init__()
        self.pool = PagePool(n_pages=12, page_size=3)
        self.n = 0

    @rule(tokens=st.integers(1, 20))
    def new(self, tokens):
        self.n += 1
        before = self.pool.free
        got = self.pool.grow(self.n, tokens)
        assert (got is None) == (self.pool.pages_for(tokens) > before)

    @precondition(lambda self: self.pool.holders())
    @rule(data=st.data(), more=st.integers(0, 8))
    def grow(self, data, more):
        h = data.draw(st.sampled_from(self.pool.holders()))
        self.pool.grow(h, self.pool.tokens(h) + more)

    @precondition(lambda self: self.pool.holders())
    @rule(data=st.data())
    def fork(self, data):
        h = data.draw(st.sampled_from(self.pool.holders()))
        n = data.draw(st.integers(0, self.pool.tokens(h)))
        self.n += 1
        copy = self.pool.fork(h, self.n, n)
        if copy:
            assert copy[0] == self.pool.pages(h)[n // self.pool.page_size]

    @precondition(lambda self: self.pool.holders())
    @rule(data=st.data())
    def release(self, data):
        self.pool.release(data.draw(st.sampled_from(self.pool.holders())))

    @invariant()
    def consistent(self):
        self.pool.check()
        for h in self.pool.holders():
            t, pages = self.pool.tokens(h), self.pool.pages(h)
            if t % self.pool.page_size:  # the page its next token goes to is its own
                assert self.pool.refs[pages[-1]] == 1, (h, pages)

    def teardown(self):
        for h in self.pool.holders():
            self.pool.release(h)
        assert self.pool.free == self.pool.n_pages - 1


TestPoolStateMachine = Pool.TestCase
TestPoolStateMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
