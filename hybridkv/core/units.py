"""Units: what a group allocates, refcounts and caches, carved out of pool pages.

A *unit* is the allocation granule of one group, in docs/design.md's words either a kernel block or
a page (`GroupPlan.unit_tokens` / `blocks_per_unit` say which; `hybridkv plan` shows them):

    block mode, attention group:  unit = one kernel block   (units_per_page = blocks_per_page)
    page mode, attention group:   unit = one whole page     (units_per_page = 1)
    state group (both modes):     unit = one whole page     (a running state or a snapshot)

So a unit id is a kernel-block id in block mode and a page id otherwise. The position of a unit
inside its page is its *offset* (0 .. units_per_page - 1); "slot" is kept for the KV slot of a
token (design.md section 2).

    page p of a block-mode group (units_per_page = 4):
        | unit 4p+0 | unit 4p+1 | unit 4p+2 | unit 4p+3 |
          in use      cached      free        in use

A unit is *in use* (refcount > 0), *cached* (refcount 0, content registered under a key, kept
until its page is reclaimed) or *free*. A page goes back to the pool when none of its units is
in use or cached, and is evictable when it holds cached units only; the pool reclaims evictable
pages least-recently-used first (whole pages).

A cached unit inside a page that live requests still use cannot leave with its page; it would
strand memory. Such *stranded* units are kept in their own LRU order, and the group that owns
them may reclaim one (drop its cached content, reuse its place in the page) when the pool has
no free page.

Cache events (`events.py`): with a log attached (`CacheManager.enable_events`), every key that
enters `unit_of` is reported as stored and every key that leaves it as removed; without one the
only cost is an `is not None` test where keys change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator

from hybridkv.core.events import REMOVED, STORED, EventLog
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
        # owned page with a free unit -> its free offsets (pop = lowest); full pages have no
        # entry (fewer long-lived lists for the garbage collector to walk)
        self.free_offsets: dict[int, list[int]] = {}
        self.partial: dict[int, None] = {}  # owned pages with a free unit, oldest first
        self.new_pages: list[int] = []  # pages taken from the pool since the last drain
        self.num_free_units = 0  # free units across owned pages
        self.stranded: OrderedDict[int, None] = OrderedDict()  # cached units in in-use pages
        self.stranded_in_page: dict[int, int] = {}  # page -> how many of its units are stranded
        self.log: EventLog | None = None  # cache events go here when enabled
        self.logs_snapshots = False  # its cached units are state snapshots
        self.tokens_of: dict[Hashable, int] = {}  # key -> prefix length (only with a log)
        pool.register(group_id, self)

    # -- allocation --------------------------------------------------------------------------

    def _new_page(self) -> int | None:
        page = self.pool.take(self.group_id)
        if page is None:
            return None
        u = self.units_per_page
        self.free_offsets[page] = list(range(u - 1, -1, -1))
        self.partial[page] = None
        self.page_used[page] = 0
        self.page_occupied[page] = 0
        self.num_free_units += u
        self.new_pages.append(page)
        return page

    def take(
        self, n: int, hint_page: int | None, page_budget: int | None = None, reclaim: bool = False
    ) -> list[int]:
        """Up to `n` new in-use units (fewer if the pool is dry): first free offsets of
        `hint_page` (keeps a request's units contiguous), then of other owned pages (oldest
        first), then new pages from the pool (at most `page_budget`; None: any), then, with
        `reclaim`, the offsets of least-recently-used stranded cached units."""
        out: list[int] = []
        pages = 0
        u = self.units_per_page
        page = hint_page if hint_page in self.partial else None
        while len(out) < n:
            if page is None or page not in self.partial:
                may_take = page_budget is None or pages < page_budget
                whole_pages = (n - len(out)) // u  # whole fresh pages still wanted
                if page_budget is not None:
                    whole_pages = min(whole_pages, page_budget - pages)
                if self.partial:
                    page = next(iter(self.partial))
                elif whole_pages > 0 and (whole := self._take_whole_pages(whole_pages)):
                    out.extend(whole)  # whole fresh pages in one step (long prefills)
                    pages += len(whole) // u
                    continue
                elif may_take and (page := self._new_page()) is not None:
                    pages += 1
                elif reclaim and self.stranded:
                    out.append(self._reclaim())
                    page = None
                    continue
                else:
                    break
            out.extend(self._take_from(page, n - len(out)))
        return out

    def _take_whole_pages(self, count: int) -> list[int]:
        """Up to `count` fresh pages from the pool with every unit in use at once."""
        u = self.units_per_page
        taken = self.pool.take_many(self.group_id, count)
        units = [unit for page in taken for unit in range(page * u, (page + 1) * u)]
        self.page_used.update(dict.fromkeys(taken, u))
        self.page_occupied.update(dict.fromkeys(taken, u))
        self.ref.update(dict.fromkeys(units, 1))
        self.new_pages.extend(taken)
        return units

    def alloc(
        self, hint_page: int | None = None, new_page: bool = True, reclaim: bool = False
    ) -> int | None:
        """One new in-use unit (see `take`), or None."""
        units = self.take(1, hint_page, None if new_page else 0, reclaim)
        return units[0] if units else None

    def _take_from(self, page: int, k: int) -> list[int]:
        offsets = self.free_offsets[page]
        base = page * self.units_per_page
        if k >= len(offsets) == self.units_per_page:  # a whole fresh page: offsets u-1 .. 0
            units = list(range(base, base + len(offsets)))
            offsets.clear()
        else:
            offsets.sort(reverse=True)  # lowest offsets first: consecutive kernel blocks
            k = min(k, len(offsets))
            taken = offsets[-k:]
            del offsets[-k:]
            units = [base + j for j in reversed(taken)]
        ref = self.ref
        for unit in units:
            ref[unit] = 1
        k = len(units)
        self.num_free_units -= k
        self.page_occupied[page] += k
        if not offsets:
            del self.partial[page]
            del self.free_offsets[page]
        self._use_page(page, k)
        return units

    def _reclaim(self) -> int:
        """Drop the oldest stranded cached unit and hand its place out as a new in-use unit."""
        unit, _ = self.stranded.popitem(last=False)
        self._uncount_stranded(unit)
        key = self.key_of.pop(unit)
        del self.unit_of[key]
        if self.log is not None:
            self._log_removed(key)
        self.ref[unit] = 1
        self.page_used[unit // self.units_per_page] += 1
        return unit

    def _strand(self, unit: int) -> None:
        if unit not in self.stranded:
            self.stranded[unit] = None
            page = unit // self.units_per_page
            self.stranded_in_page[page] = self.stranded_in_page.get(page, 0) + 1

    def _unstrand(self, unit: int) -> None:
        if self.stranded.pop(unit, 0) is None:
            self._uncount_stranded(unit)

    def _uncount_stranded(self, unit: int) -> None:
        page = unit // self.units_per_page
        left = self.stranded_in_page[page] - 1
        if left:
            self.stranded_in_page[page] = left
        else:
            del self.stranded_in_page[page]

    def _page_units(self, page: int) -> range:
        return range(page * self.units_per_page, (page + 1) * self.units_per_page)

    def _use_page(self, page: int, k: int = 1) -> None:
        before = self.page_used[page]
        self.page_used[page] = before + k
        if before == 0:
            self.pool.set_evictable(page, False)
            if self.page_occupied[page] > k:  # it holds cached units: they are stranded now
                for unit in self._page_units(page):
                    if self.ref.get(unit) == 0:
                        self._strand(unit)
                        self.stranded.move_to_end(unit, last=False)

    def incref(self, unit: int) -> None:
        count = self.ref[unit]
        self.ref[unit] = count + 1
        if count == 0:
            self._unstrand(unit)
            self._use_page(unit // self.units_per_page)

    def decref(self, unit: int) -> None:
        self.release((unit,))

    def release(self, units: Iterable[int]) -> None:
        """Drop one reference to each unit; units nobody uses become free or stay cached. Pages
        settle in the order they first appear (release a request's tail first)."""
        u = self.units_per_page
        ref, key_of, page_used = self.ref, self.key_of, self.page_used
        touched: dict[int, None] = {}
        cached: list[int] = []
        for unit in units:
            count = ref[unit] - 1
            if count:
                ref[unit] = count
                continue
            page = unit // u
            page_used[page] -= 1
            touched[page] = None
            if unit in key_of:
                ref[unit] = 0
                cached.append(unit)
            else:
                self._free_unit(unit)
        for unit in cached:
            if page_used[unit // u]:
                self._strand(unit)
        for page in touched:
            self._settle(page)

    def _free_unit(self, unit: int) -> None:
        page, j = divmod(unit, self.units_per_page)
        del self.ref[unit]
        self.page_occupied[page] -= 1
        self.free_offsets.setdefault(page, []).append(j)
        self.num_free_units += 1
        self.partial[page] = None

    def _settle(self, page: int) -> None:
        """Return an empty page to the pool, or mark a cached-only page evictable."""
        if self.page_occupied[page] == 0:
            self.num_free_units -= len(self.free_offsets.get(page, ()))
            for table in (self.page_used, self.page_occupied, self.free_offsets, self.partial):
                table.pop(page, None)
            self.pool.give_back(page)
        elif self.page_used[page] == 0:
            self.pool.set_evictable(page, True)
            if self.stranded_in_page.get(page):  # the page may leave whole: not stranded
                for unit in self._page_units(page):
                    self._unstrand(unit)

    # -- cache -------------------------------------------------------------------------------

    def lookup(self, key: Hashable) -> int | None:
        return self.unit_of.get(key)

    def set_key(self, unit: int, key: Hashable, tokens: int = 0) -> bool:
        """Register an in-use unit's content under `key` (the key of a prefix of `tokens`
        tokens); False if the key is already cached (the existing unit stays the cached one,
        this unit is freed when released)."""
        if key in self.unit_of or unit in self.key_of:
            return False
        self.key_of[unit] = key
        self.unit_of[key] = unit
        if self.log is not None:
            self._log_stored(key, tokens)
        return True

    def set_keys(
        self, units: list[int], keys: list[Hashable], tokens: list[int] | None = None
    ) -> None:
        """`set_key` for many units at once (dictionary updates in bulk when no key repeats);
        `tokens` (the prefix length of each key) is read only when events are logged."""
        # Units come here once each (when they first fill up), so only keys can repeat:
        # another request may have cached the same content first.
        new = dict(zip(keys, units, strict=True))
        lengths = tokens if tokens is not None else [0] * len(keys)
        if len(new) == len(units) and not (self.unit_of.keys() & new.keys()):
            self.unit_of.update(new)
            self.key_of.update(zip(units, keys, strict=True))
            if self.log is not None:
                for key, length in zip(keys, lengths, strict=True):
                    self._log_stored(key, length)
            return
        for unit, key, length in zip(units, keys, lengths, strict=True):
            self.set_key(unit, key, length)

    def _log_stored(self, key: Hashable, tokens: int) -> None:
        assert self.log is not None
        self.tokens_of[key] = tokens
        self.log.add(STORED, self.group_id, key, tokens, self.logs_snapshots)

    def _log_removed(self, key: Hashable) -> None:
        assert self.log is not None
        tokens = self.tokens_of.pop(key, 0)
        self.log.add(REMOVED, self.group_id, key, tokens, self.logs_snapshots)

    def cached_keys(self) -> Iterator[tuple[Hashable, int]]:
        """(key, prefix length or 0 if unknown) of everything cached (event resynchronisation)."""
        for key in self.unit_of:
            yield key, self.tokens_of.get(key, 0)

    def uncache(self, unit: int) -> None:
        """Forget a unit's key; a cached-only unit becomes free at once."""
        key = self.key_of.pop(unit, None)
        if key is None:
            return
        del self.unit_of[key]
        if self.log is not None:
            self._log_removed(key)
        self._unstrand(unit)
        if self.ref.get(unit) == 0:
            self._free_unit(unit)
            self._settle(unit // self.units_per_page)

    def on_evict(self, page: int) -> None:
        """The pool reclaims this cached-only page: drop everything it held."""
        ref, key_of, unit_of = self.ref, self.key_of, self.unit_of
        base = page * self.units_per_page
        for unit in range(base, base + self.units_per_page):
            count = ref.pop(unit, None)
            if count is not None:
                assert count == 0, f"evicting unit {unit} that is in use"
                key = key_of.pop(unit)
                del unit_of[key]
                if self.log is not None:
                    self._log_removed(key)
        self.num_free_units -= len(self.free_offsets.get(page, ()))
        for table in (self.page_used, self.page_occupied, self.free_offsets, self.partial):
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

    @property
    def num_stranded(self) -> int:
        return len(self.stranded)

    def count_free_units(self, n: int, hint_page: int | None) -> tuple[int, int]:
        """If `n` units were taken with no new page: (units found, evictable pages they would
        turn in-use). Follows `take`'s order: the hint page, then the oldest first."""
        found = touched = 0
        if hint_page in self.partial:
            found = len(self.free_offsets[hint_page])
            touched = self.page_used[hint_page] == 0
        if found < n and self.num_free_units > found:
            for page in self.partial:
                if page == hint_page:
                    continue
                found += len(self.free_offsets[page])
                touched += self.page_used[page] == 0
                if found >= n:
                    break
        return min(found, n), int(touched)

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
            assert free == set(self.free_offsets.get(page, ())), f"page {page}: free offsets differ"
            assert (page in self.partial) == bool(free), f"page {page}: partial flag wrong"
            assert self.pool.is_evictable(page) == (used == 0), f"page {page}: evictable flag"
        assert self.num_free_units == sum(len(v) for v in self.free_offsets.values())
        assert self.free_offsets.keys() == self.partial.keys(), "pages with free offsets differ"
        expect_stranded = {x for x, c in self.ref.items() if c == 0 and self.page_used[x // u] > 0}
        assert set(self.stranded) == expect_stranded, "stranded units differ"
        per_page: dict[int, int] = {}
        for x in self.stranded:
            per_page[x // u] = per_page.get(x // u, 0) + 1
        assert per_page == self.stranded_in_page, "stranded counts per page differ"
        for unit, count in self.ref.items():
            assert count > 0 or unit in self.key_of, f"unit {unit} neither used nor cached"
        assert len(self.key_of) == len(self.unit_of)
        for unit, key in self.key_of.items():
            assert self.unit_of[key] == unit and unit in self.ref, f"unit {unit}: key maps differ"
