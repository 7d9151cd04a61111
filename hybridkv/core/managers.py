"""Group managers, one per layer kind (kind -> manager map at the bottom).

Managers take a `GroupPlan` (built from specs), never a model config. Each keeps, per request,
what the request holds in its group, and works in *units* (see `units.py`): kernel blocks of
an attention group in block mode, whole pages in page mode and for state groups.

Prefix keys: `key_at(L)` returns the chained hash of the request's first L tokens (L a multiple
of the hash block size), or None if those tokens are not known yet. An attention unit covering
tokens [i*t, (i+1)*t) is cached under key_at((i+1)*t); a state snapshot taken after exactly L
tokens under key_at(L).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from hybridkv.core.hashing import PrefixKeys
from hybridkv.core.page_pool import NULL_PAGE, PagePool
from hybridkv.core.units import UnitAllocator
from hybridkv.kv.plan import GroupPlan

KeyAt = PrefixKeys
NULL_UNIT = NULL_PAGE  # unit 0 lies in the null page in both modes


# ---------------------------------------------------------------------------------------------
# Attention (full, sliding window, MLA)
# ---------------------------------------------------------------------------------------------


@dataclass
class AttentionReq:
    """What one request holds in one attention group."""

    units: list[int] = field(default_factory=list)  # NULL_UNIT where dropped / never held
    registered: int = 0  # leading units already offered to the prefix cache
    first_live: int = 0  # sliding window: units before this one were dropped
    new_units: list[int] = field(default_factory=list)  # allocated in the current call (undo)
    new_entries: list[int] = field(default_factory=list)  # kernel-block ids for the table


class FullAttentionManager:
    """Full attention: a request holds every unit of its context."""

    def __init__(self, group: GroupPlan, pool: PagePool, allocation: str) -> None:
        assert group.page_tokens is not None and group.kernel_block_size is not None
        self.group = group
        r = group.blocks_per_page
        if allocation == "page":
            self.unit_tokens, units_per_page, self.blocks_per_unit = group.page_tokens, 1, r
        else:
            self.unit_tokens, units_per_page, self.blocks_per_unit = group.kernel_block_size, r, 1
        self.units = UnitAllocator(pool, group.group_id, units_per_page)

    def new_request(self) -> AttentionReq:
        return AttentionReq()

    def kernel_blocks(self, unit: int) -> range:
        """Kernel-block ids of a unit: p -> p*r .. p*r+r-1 in page mode, itself in block mode."""
        return range(unit * self.blocks_per_unit, (unit + 1) * self.blocks_per_unit)

    def table_row(self, ar: AttentionReq) -> list[int]:
        return [kb for unit in ar.units for kb in self.kernel_blocks(unit)]

    # -- prefix hits -----------------------------------------------------------------------

    def cached_prefix_tokens(self, key_at: KeyAt, limit: int) -> int:
        """Tokens of the longest run of cached units from position 0, at most `limit`."""
        t, n = self.unit_tokens, 0
        unit_of = self.units.unit_of
        for key in key_at.unit_keys(t, 0, limit // t):
            if key not in unit_of:
                break
            n += 1
        return n * t

    def can_serve(self, length: int, key_at: KeyAt) -> bool:
        return self.cached_prefix_tokens(key_at, length) == length

    def take_hit(self, ar: AttentionReq, length: int, key_at: KeyAt) -> None:
        n = length // self.unit_tokens
        self._take_cached(ar, key_at.unit_keys(self.unit_tokens, 0, n))
        ar.registered = n

    def _take_cached(self, ar: AttentionReq, keys: list[int]) -> None:
        for key in keys:
            unit = self.units.lookup(key)
            assert unit is not None, "a prefix hit vanished before it was taken"
            self.units.incref(unit)
            ar.units.append(unit)
            ar.new_entries.extend(self.kernel_blocks(unit))

    # -- per step ----------------------------------------------------------------------------

    def capacity(self, ar: AttentionReq) -> int:
        return len(ar.units) * self.unit_tokens

    def units_needed(self, ar: AttentionReq, total: int) -> int:
        return max(0, -(-total // self.unit_tokens) - len(ar.units))

    def pages_needed(self, ar: AttentionReq, total: int) -> tuple[int, int, int]:
        """(new pages needed, new pages needed if stranded cached units are reclaimed, evictable
        pages whose free slots phase 1 would use)."""
        need = self.units_needed(ar, total)
        if need == 0:
            return 0, 0, 0
        found, touched = self.units.plan_slots(need, self._hint_page(ar))
        per_page = self.units.units_per_page
        short = need - found
        reclaimed = max(0, short - self.units.num_stranded)
        return -(-short // per_page), -(-reclaimed // per_page), touched

    def fill_from_slots(self, ar: AttentionReq, num_computed: int, total: int) -> None:
        """Phase 1 of an allocation: use free units of pages the group already owns."""
        self._take_units(ar, total, page_budget=0, reclaim=False)

    def allocate(
        self, ar: AttentionReq, num_computed: int, total: int, page_budget: int | None = None
    ) -> bool:
        """Phase 3: hold units for the first `total` tokens, taking at most `page_budget` new
        pages (None: any) and reclaiming stranded cached units beyond. False if impossible."""
        return self._take_units(ar, total, page_budget, reclaim=True)

    def _take_units(
        self, ar: AttentionReq, total: int, page_budget: int | None, reclaim: bool
    ) -> bool:
        need = self.units_needed(ar, total)
        if need == 0:
            return True
        units = self.units.take(need, self._hint_page(ar), page_budget, reclaim)
        ar.units.extend(units)
        ar.new_units.extend(units)
        if self.blocks_per_unit == 1:
            ar.new_entries.extend(units)
        else:
            for unit in units:
                ar.new_entries.extend(self.kernel_blocks(unit))
        return len(units) == need

    def _hint_page(self, ar: AttentionReq) -> int | None:
        last = ar.units[-1] if ar.units else NULL_UNIT
        return None if last == NULL_UNIT else last // self.units.units_per_page

    def next_commit(self, ar: AttentionReq) -> int:
        """Computed-token count at which the next unit becomes full."""
        return (ar.registered + 1) * self.unit_tokens

    def commit(self, ar: AttentionReq, num_computed: int, key_at: KeyAt, caching: bool) -> None:
        """Offer every unit that is now full to the prefix cache."""
        full = min(num_computed // self.unit_tokens, len(ar.units))
        if caching and full > ar.registered:
            keys = key_at.unit_keys(self.unit_tokens, ar.registered, full)
            units = ar.units[ar.registered : ar.registered + len(keys)]
            if NULL_UNIT in units:  # sliding windows may hold dropped units
                keys = [k for x, k in zip(units, keys, strict=True) if x != NULL_UNIT]
                units = [x for x in units if x != NULL_UNIT]
            self.units.set_keys(units, keys)
        ar.registered = max(ar.registered, full)

    def end_step(self, ar: AttentionReq) -> None:
        ar.new_units.clear()
        ar.new_entries = []

    def undo(self, ar: AttentionReq) -> None:
        """Release what the current call allocated (allocation is all or nothing)."""
        if ar.new_units:
            del ar.units[len(ar.units) - len(ar.new_units) :]
            self.units.release(reversed(ar.new_units))
        self.end_step(ar)

    def free(self, ar: AttentionReq) -> None:
        """Release every unit, last first: tail pages become evictable before head pages."""
        self.units.release(u for u in reversed(ar.units) if u != NULL_UNIT)
        ar.units.clear()
        self.end_step(ar)

    def references(self, ar: AttentionReq) -> list[int]:
        return [u for u in ar.units if u != NULL_UNIT]


class SlidingWindowManager(FullAttentionManager):
    """Sliding window: units that leave the window are dropped (cached ones stay cached).

    A query at position p reads keys in (p - W, p]. Before a step whose first query sits at
    position c, every unit that ends at or before c - W + 1 is dropped. Block-table entries of
    dropped units are left as they were: kernels mask keys outside the window with `where`.
    """

    @property
    def window(self) -> int:
        assert self.group.window is not None
        return self.group.window

    def _first_needed_unit(self, first_query_pos: int) -> int:
        return max(0, first_query_pos - self.window + 1) // self.unit_tokens

    def can_serve(self, length: int, key_at: KeyAt) -> bool:
        t = self.unit_tokens
        first, n = self._first_needed_unit(length), length // t
        keys = key_at.unit_keys(t, first, n)
        return len(keys) == n - first and all(k in self.units.unit_of for k in keys)

    def cached_prefix_tokens(self, key_at: KeyAt, limit: int) -> int:
        """The longest servable length <= limit (the window needs only its own units)."""
        t = self.unit_tokens
        length = limit // t * t
        while length > 0 and not self.can_serve(length, key_at):
            length -= t
        return length

    def take_hit(self, ar: AttentionReq, length: int, key_at: KeyAt) -> None:
        n = length // self.unit_tokens
        first = min(self._first_needed_unit(length), n)
        for _ in range(first):
            ar.units.append(NULL_UNIT)
            ar.new_entries.extend(self.kernel_blocks(NULL_UNIT))
        self._take_cached(ar, key_at.unit_keys(self.unit_tokens, first, n))
        ar.first_live = first
        ar.registered = length // self.unit_tokens

    def fill_from_slots(self, ar: AttentionReq, num_computed: int, total: int) -> None:
        """Drop the units that left the window first: their slots may serve this request."""
        first = min(self._first_needed_unit(num_computed), len(ar.units))
        for i in range(ar.first_live, first):
            if ar.units[i] != NULL_UNIT:
                self.units.decref(ar.units[i])
                ar.units[i] = NULL_UNIT
        ar.first_live = max(ar.first_live, first)
        super().fill_from_slots(ar, num_computed, total)

    def next_drop(self, ar: AttentionReq) -> int:
        """First-query position at which the oldest live unit leaves the window."""
        return (ar.first_live + 1) * self.unit_tokens + self.window - 1


# ---------------------------------------------------------------------------------------------
# State (Mamba1, Mamba2, gated delta net, short conv, KDA)
# ---------------------------------------------------------------------------------------------


@dataclass
class StateReq:
    """What one request holds in one state group."""

    running: int | None = None  # page of the running state
    copy_from: int | None = None  # snapshot page to copy into the running page (pinned)
    copy_scheduled: bool = False  # the copy-in is part of a step; unpin at its commit
    tail: tuple[int, Hashable] | None = None  # the rolling end-of-request snapshot (page, key)
    pending: list[tuple[int, int, bool]] = field(default_factory=list)  # (page, length, is_tail)
    new_pages: list[int] = field(default_factory=list)  # allocated in the current call (undo)
    copy_in: tuple[int, int] | None = None  # (src, dst) to run before this step's forward
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) after forward


class StateManager:
    """A running-state page per request plus snapshot pages (states after exactly L tokens)."""

    def __init__(self, group: GroupPlan, pool: PagePool, allocation: str) -> None:
        self.group = group
        self.units = UnitAllocator(pool, group.group_id, 1)

    def new_request(self) -> StateReq:
        return StateReq()

    def can_serve(self, length: int, key_at: KeyAt) -> bool:
        if length == 0:
            return True
        key = key_at(length)
        return key is not None and self.units.lookup(key) is not None

    def take_hit(self, sr: StateReq, length: int, key_at: KeyAt) -> None:
        if length == 0:
            return
        page = self.units.lookup(key_at(length))
        assert page is not None, "a state snapshot vanished before it was taken"
        self.units.incref(page)  # pinned until the copy into the running page has run
        sr.copy_from = page

    def pages_needed(self, sr: StateReq, snapshot_at: int | None) -> tuple[int, int, int]:
        pages = int(sr.running is None) + int(snapshot_at is not None)
        return pages, pages, 0

    def allocate(self, sr: StateReq, snapshot_at: int | None, is_tail: bool) -> bool:
        if sr.running is None:
            page = self.units.alloc()
            if page is None:
                return False
            sr.running = page
            sr.new_pages.append(page)
            if sr.copy_from is not None:
                sr.copy_in = (sr.copy_from, page)
                sr.copy_scheduled = True
        if snapshot_at is not None:
            page = self.units.alloc()
            if page is None:
                return False
            sr.new_pages.append(page)
            sr.pending.append((page, snapshot_at, is_tail))
            sr.snapshots.append((sr.running, page))
        return True

    def commit(self, sr: StateReq, key_at: KeyAt) -> None:
        """After the forward: snapshots taken become cached; copy-in sources are unpinned."""
        for page, length, is_tail in sr.pending:
            key = key_at(length)
            if key is not None and self.units.set_key(page, key) and is_tail:
                self._drop_tail(sr)
                sr.tail = (page, key)
            self.units.decref(page)
        sr.pending.clear()
        if sr.copy_scheduled and sr.copy_from is not None:
            self.units.decref(sr.copy_from)
            sr.copy_from = None
            sr.copy_scheduled = False

    def _drop_tail(self, sr: StateReq) -> None:
        """The previous rolling snapshot is superseded: free it (if still the one we made)."""
        if sr.tail is not None:
            page, key = sr.tail
            if self.units.key_of.get(page) == key:
                self.units.uncache(page)
        sr.tail = None

    def end_step(self, sr: StateReq) -> None:
        sr.new_pages.clear()
        sr.copy_in = None
        sr.snapshots.clear()

    def undo(self, sr: StateReq) -> None:
        for page in reversed(sr.new_pages):
            self.units.decref(page)
            if page == sr.running:
                sr.running = None
                sr.copy_scheduled = False
            sr.pending = [p for p in sr.pending if p[0] != page]
        self.end_step(sr)

    def free(self, sr: StateReq) -> None:
        for page, _, _ in sr.pending:
            self.units.decref(page)
        sr.pending.clear()
        if sr.copy_from is not None:
            self.units.decref(sr.copy_from)
            sr.copy_from = None
            sr.copy_scheduled = False
        if sr.running is not None:
            self.units.decref(sr.running)
            sr.running = None
        self.end_step(sr)

    def references(self, sr: StateReq) -> list[int]:
        refs = [p for p, _, _ in sr.pending]
        if sr.running is not None:
            refs.append(sr.running)
        if sr.copy_from is not None:
            refs.append(sr.copy_from)
        return refs


GroupManager = FullAttentionManager | SlidingWindowManager | StateManager

# Layer kind -> manager. Adding a layer kind = one spec, one manager, one entry here.
MANAGERS: dict[str, type[FullAttentionManager] | type[StateManager]] = {
    "attention": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "mla": FullAttentionManager,  # attention with its own bytes per token (its page_tokens)
    "mamba1": StateManager,
    "mamba2": StateManager,
    "gated_delta_net": StateManager,
    "short_conv": StateManager,
    "kda": StateManager,
}
