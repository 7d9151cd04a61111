"""The one shared page pool (design.md section 5).

Every group takes its pages from here, so state pages and attention pages share one budget.
A page is, at any time, exactly one of:

    null      page 0, reserved: block-table entries for skipped positions point at it
    free      on the free list, owned by no group
    owned     by one group; "evictable" when it holds only cached content (no live reference)

When the free list is empty, `take` reclaims the least-recently-used evictable page: the owning
group drops the cached content that lived in it, then the page changes hands. Nothing is ever
taken from a page that a running request still references.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

NULL_PAGE = 0


class PageOwner(Protocol):
    """A group that owns pages: it is told when one of its evictable pages is reclaimed."""

    def on_evict(self, page: int) -> None: ...


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(
                f"a page pool needs at least 2 pages (one is the null page), got {num_pages}"
            )
        self.num_pages = num_pages
        self.owner: list[int | None] = [None] * num_pages  # group id of each page
        self.owner[NULL_PAGE] = -1
        self._free: deque[int] = deque(range(1, num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self._groups: dict[int, PageOwner] = {}
        self.num_evictions = 0

    def register(self, group_id: int, owner: PageOwner) -> None:
        self._groups[group_id] = owner

    # -- counts ------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Pages `take` can hand out right now (free or reclaimable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    # -- moves -------------------------------------------------------------------------------

    def take(self, group_id: int) -> int | None:
        """A page for `group_id`: a free one, else the LRU evictable one, else None."""
        if self._free:
            page = self._free.popleft()
        elif self._evictable:
            page, _ = self._evictable.popitem(last=False)
            previous = self.owner[page]
            assert previous is not None and previous >= 0
            self._groups[previous].on_evict(page)
            self.num_evictions += 1
        else:
            return None
        self.owner[page] = group_id
        return page

    def take_many(self, group_id: int, count: int) -> list[int]:
        """Up to `count` pages for `group_id`, each chosen as `take` would (one call for the
        whole pages of a long prefill chunk)."""
        pages: list[int] = []
        while len(pages) < count and (page := self.take(group_id)) is not None:
            pages.append(page)
        return pages

    def give_back(self, page: int) -> None:
        """A page whose owner holds nothing in it any more returns to the free list."""
        assert page != NULL_PAGE and self.owner[page] is not None
        self._evictable.pop(page, None)
        self.owner[page] = None
        self._free.append(page)

    def set_evictable(self, page: int, evictable: bool) -> None:
        """Mark a page as holding only cached content (most recently used end) or not."""
        if evictable:
            self._evictable[page] = None
            self._evictable.move_to_end(page)
        else:
            self._evictable.pop(page, None)

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    # -- integrity ---------------------------------------------------------------------------

    def check(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        assert NULL_PAGE not in free and NULL_PAGE not in self._evictable, "null page handed out"
        for page in range(1, self.num_pages):
            owner = self.owner[page]
            if page in free:
                assert owner is None, f"free page {page} has owner {owner}"
            else:
                assert owner is not None and owner >= 0, f"page {page} is neither free nor owned"
        for page in self._evictable:
            assert self.owner[page] is not None, f"evictable page {page} has no owner"
