"""Which pages of a paged KV pool each sequence holds (host side, `docs/design.md`, "Paged KV").

Owns: a pool of `n_pages` fixed-size pages (page 0 is the null page: rows of a page table
that hold nothing point at it, so a kernel never reads outside the pool), the pages each
holder (a sequence, or a prompt kept for its group) maps in order, a reference count per
page, and the rules that keep sharing safe:
- `grow` gives a holder pages for more tokens, all or nothing (None: the pool is short, and
  the caller evicts or waits);
- `fork` maps a holder's first n tokens into another: full pages are shared (counted), the
  partial last page is copied to a page of its own (the copy is returned for the device), so
  a shared page is always full and never written again;
- `release` drops a holder; a page returns to the free list when no holder maps it.
Does not own: the arrays on the device (the engine writes K/V at the pages named here and
makes the copies `fork` returns), which sequence to evict (the caller's policy).
"""

from __future__ import annotations

from typing import Hashable

import numpy as np

NULL_PAGE = 0


class PagePool:
    def __init__(self, n_pages: int, page_size: int):
        if n_pages < 2 or page_size < 1:
            raise ValueError(f"a page pool needs 2+ pages (one is the null page) of 1+ tokens, got {n_pages} x {page_size}")
        self.n_pages, self.page_size = n_pages, page_size
        self.refs = np.zeros(n_pages, np.int32)
        self.refs[NULL_PAGE] = 1  # never handed out
        self._free = list(range(n_pages - 1, 0, -1))  # popped from the end: low pages first
        self._pages: dict[Hashable, list[int]] = {}
        self._tokens: dict[Hashable, int] = {}

    # ---- reading ------------------------------------------------------------------------------

    @property
    def free(self) -> int:
        """Pages no holder maps."""
        return len(self._free)

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def __contains__(self, h: Hashable) -> bool:
        return h in self._pages

    def holders(self) -> list[Hashable]:
        return list(self._pages)

    def tokens(self, h: Hashable) -> int:
        """Tokens `h` holds room for (0 for a holder the pool does not know)."""
        return self._tokens.get(h, 0)

    def pages(self, h: Hashable) -> list[int]:
        return list(self._pages.get(h, ()))

    def table(self, holders: list[Hashable | None], width: int) -> np.ndarray:
        """int32 [len(holders), width]: each holder's pages in order, the null page after them
        (and for None). A holder with more than `width` pages is an error."""
        out = np.full((len(holders), width), NULL_PAGE, np.int32)
        for i, h in enumerate(holders):
            if h is None:
                continue
            p = self._pages.get(h, ())
            if len(p) > width:
                raise ValueError(f"holder {h!r} maps {len(p)} pages, more than the table's {width}")
            out[i, :len(p)] = p
        return out

    # ---- changing -----------------------------------------------------------------------------

    def grow(self, h: Hashable, n_tokens: int) -> list[int] | None:
        """`h` holds room for `n_tokens` (never fewer than it has): the new pages, or None with
        nothing taken where the pool has too few free."""
        pages = self._pages.get(h, [])
        n = self.pages_for(max(n_tokens, self.tokens(h))) - len(pages)
        if n > len(self._free):
            return None
        new = [self._free.pop() for _ in range(n)]
        self.refs[new] += 1
        self._pages[h] = pages + new
        self._tokens[h] = max(n_tokens, self.tokens(h))
        return new

    def fork(self, src: Hashable, dst: Hashable, n_tokens: int) -> tuple[int, int] | None | bool:
        """New holder `dst` maps the first `n_tokens` of `src`: whole pages shared, a partial last
        page copied into a page of dst's own. Returns the copy (src page, dst page) the device
        must make, None where there is none, or False with nothing taken where the pool is out."""
        if dst in self._pages:
            raise ValueError(f"holder {dst!r} exists already")
        if n_tokens > self.tokens(src):
            raise ValueError(f"holder {src!r} holds {self.tokens(src)} tokens, not {n_tokens}")
        whole, part = divmod(n_tokens, self.page_size)
        if part and not self._free:
            return False
        shared = self._pages.get(src, [])[:whole]
        self.refs[shared] += 1
        copy = None
        if part:
            page = self._free.pop()
            self.refs[page] += 1
            copy = (self._pages[src][whole], page)
            shared = shared + [page]
        self._pages[dst], self._tokens[dst] = shared, n_tokens
        return copy

    def release(self, h: Hashable) -> None:
        """`h` maps nothing; pages no other holder maps are free again."""
        for p in reversed(self._pages.pop(h, [])):
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self._free.append(p)
        self._tokens.pop(h, None)

    def check(self) -> None:
        """AssertionError where the counts and the tables disagree (tests)."""
        counted = np.zeros_like(self.refs)
        counted[NULL_PAGE] = 1
        for h, pages in self._pages.items():
            assert len(pages) == self.pages_for(self._tokens[h]), (h, pages, self._tokens[h])
            np.add.at(counted, pages, 1)
        assert (counted == self.refs).all(), (counted, self.refs)
        assert sorted(self._free) == sorted(np.flatnonzero(self.refs == 0).tolist())
        assert len(set(self._free)) == len(self._free)
