"""Units: what a group allocates, refcounts and caches, carved out of pool pages.

A *unit* is the allocation granule of one group:

    block mode, attention group:  unit = one kernel block   (units_per_page = blocks_per_page)
    page mode, attention group:   unit = one whole page     (units_per_page = 1)
    state group (both modes):     unit = one whole page     (a running state or a snapshot)

    page p of a block-mode group (units_per_page = 4):
        | unit 4p+0 | unit 4p+1 | unit 4p+2 | unit 4p+3 |
          in use      cached      free        in use

A unit is *in use* (refcount > 0), *cached* (refcount 0, content registered under a key, kept
until its page is reclaimed) or *free*. A page goes back to the pool when none of its units is
in use or cached, and is evictable when it holds cached units only; the pool reclaims evictable
pages least-recently-used first (whole pages, never single units).
"""

from __future__ import annotations

from collections.abc import Hashable

from hybridkv.core.page_pool import PagePool


class UnitAllocator:
    def __init__(self, pool: PagePool, group_id: int, units_per_page: int) -> None:
        self.pool = pool
        self.group_id = group_id
        self.units_per_page = units_per_page
        self.ref: dict[int, int] = {}  # occupied unit -> refcount (0 = cached only)
        self.key_of: dict[int, Hashable] = {}
        self.unit_of: dict[Hashable, int] = {}
        self.page_used: dict[int, int] = {}  # owned page -> units with refcount > 0
        self.page_occupied: dict[int, int] = {}  # owned page -> units in use or cached
        self.free_slots: dict[int, list[int]] = {}  # owned page -> free offsets (pop = lowest)
        self.partial: dict[int, None] = {}  # owned pages with a free slot, oldest first
        self.new_pages: list[int] = []  # pages taken from the pool since the last drain
        self.num_free_slots = 0  # free units across owned pages
        pool.register(group_id, self)

    # -- allocation --------------------------------------------------------------------------

    def _new_page(self) -> int | None:
        page = self.pool.take(self.group_id)
        if page is None:
            return None
        u = self.units_per_page
        self.free_slots[page] = list(range(u - 1, -1, -1))
        self.partial[page] = None
        self.page_used[page] = 0
        self.page_occupied[page] = 0
        self.num_free_slots += u
        self.new_pages.append(page)
        return page

    def alloc(self, hint_page: int | None = None, new_page: bool = True) -> int | None:
        """A new in-use unit, preferably in `hint_page` (keeps a request's units contiguous),
        else in any owned page with room, else (if `new_page`) in a page from the pool."""
        if hint_page is not None and hint_page in self.partial:
            page = hint_page
        elif self.partial:
            page = next(iter(self.partial))
        elif new_page:
            page = self._new_page()
            if page is None:
                return None
        else:
            return None
        slots = self.free_slots[page]
        self.num_free_slots -= 1
        j = slots.pop()
        if not slots:
            del self.partial[page]
        unit = page * self.units_per_page + j
        self.ref[unit] = 1
        self.page_occupied[page] += 1
        self._use_page(page)
        return unit

    def _use_page(self, page: int) -> None:
        self.page_used[page] += 1
        if self.page_used[page] == 1:
            self.pool.set_evictable(page, False)

    def incref(self, unit: int) -> None:
        count = self.ref[unit]
        self.ref[unit] = count + 1
        if count == 0:
            self._use_page(unit // self.units_per_page)

    def decref(self, unit: int) -> None:
        count = self.ref[unit] - 1
        self.ref[unit] = count
        if count > 0:
            return
        page = unit // self.units_per_page
        self.page_used[page] -= 1
        if unit not in self.key_of:
            self._free_unit(unit)
        self._settle(page)

    def _free_unit(self, unit: int) -> None:
        page, j = divmod(unit, self.units_per_page)
        del self.ref[unit]
        self.page_occupied[page] -= 1
        slots = self.free_slots[page]
        slots.append(j)
        slots.sort(reverse=True)
        self.num_free_slots += 1
        self.partial[page] = None

    def _settle(self, page: int) -> None:
        """Return an empty page to the pool, or mark a cached-only page evictable."""
        if self.page_occupied[page] == 0:
            self.num_free_slots -= len(self.free_slots[page])
            for table in (self.page_used, self.page_occupied, self.free_slots, self.partial):
                table.pop(page, None)
            self.pool.give_back(page)
        elif self.page_used[page] == 0:
            self.pool.set_evictable(page, True)

    # -- cache -------------------------------------------------------------------------------

    def lookup(self, key: Hashable) -> int | None:
        return self.unit_of.get(key)

    def set_key(self, unit: int, key: Hashable) -> bool:
        """Register an in-use unit's content under `key`; False if the key is already cached
        (the existing unit stays the cached one, this unit is freed when released)."""
        if key in self.unit_of or unit in self.key_of:
            return False
        self.key_of[unit] = key
        self.unit_of[key] = unit
        return True

    def uncache(self, unit: int) -> None:
        """Forget a unit's key; a cached-only unit becomes free at once."""
        key = self.key_of.pop(unit, None)
        if key is None:
            return
        del self.unit_of[key]
        if self.ref.get(unit) == 0:
            self._free_unit(unit)
            self._settle(unit // self.units_per_page)

    def on_evict(self, page: int) -> None:
        """The pool reclaims this cached-only page: drop everything it held."""
        base = page * self.units_per_page
        for unit in range(base, base + self.units_per_page):
            if unit in self.ref:
                assert self.ref[unit] == 0, f"evicting unit {unit} that is in use"
                del self.ref[unit]
                del self.unit_of[self.key_of.pop(unit)]
        self.num_free_slots -= len(self.free_slots.get(page, ()))
        for table in (self.page_used, self.page_occupied, self.free_slots, self.partial):
            table.pop(page, None)

    def drain_new_pages(self) -> list[int]:
        pages, self.new_pages = self.new_pages, []
        return pages

    # -- counts ------------------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        return len(self.page_occupied)

    @property
    def num_cached_units(self) -> int:
        return len(self.key_of)

    def plan_slots(self, n: int, hint_page: int | None) -> tuple[int, int]:
        """If `n` units were taken with `new_page=False`: (units found, evictable pages they
        would turn in-use). Follows `alloc`'s order: the hint page, then oldest first."""
        order = list(self.partial)
        if hint_page in self.partial:
            order.remove(hint_page)
            order.insert(0, hint_page)
        found = touched = 0
        for page in order:
            if found >= n:
                break
            found += len(self.free_slots[page])
            touched += self.page_used[page] == 0
        return min(found, n), touched

    def pages_in_use(self) -> int:
        return sum(1 for used in self.page_used.values() if used > 0)

    # -- integrity ---------------------------------------------------------------------------

    def check(self) -> None:
        u = self.units_per_page
        owned = {p for p, g in enumerate(self.pool.owner) if g == self.group_id}
        assert owned == set(self.page_occupied), f"group {self.group_id}: page ownership differs"
        for page in owned:
            units = [page * u + j for j in range(u)]
            used = sum(1 for x in units if self.ref.get(x, 0) > 0)
            occupied = sum(1 for x in units if x in self.ref)
            assert used == self.page_used[page], f"page {page}: used count {used}"
            assert occupied == self.page_occupied[page] > 0, f"page {page}: occupied {occupied}"
            free = {j for j in range(u) if page * u + j not in self.ref}
            assert free == set(self.free_slots[page]), f"page {page}: free slots differ"
            assert (page in self.partial) == bool(free), f"page {page}: partial flag wrong"
            assert self.pool.is_evictable(page) == (used == 0), f"page {page}: evictable flag"
        assert self.num_free_slots == sum(len(v) for v in self.free_slots.values())
        for unit, count in self.ref.items():
            assert count > 0 or unit in self.key_of, f"unit {unit} neither used nor cached"
        assert len(self.key_of) == len(self.unit_of)
        for unit, key in self.key_of.items():
            assert self.unit_of[key] == unit and unit in self.ref, f"unit {unit}: key maps differ"
