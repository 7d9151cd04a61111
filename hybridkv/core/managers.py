"""Group managers, one per layer kind (kind -> manager map at the bottom).

Every manager implements `GroupManager`: the same methods with the same signatures and typed
results, so the coordinator (`coordinator.CacheManager`) drives every group alike. Managers take
a `GroupPlan` (built from specs), never a model config. Each keeps, per request, what the request
holds in its group, and works in *units* (see `units.py`): kernel blocks of an attention group in
block mode, whole pages in page mode and for state groups.

Adding a manager family (chunked local attention, a state kind that caches every block): one
subclass here and its entry in `MANAGERS`.

Prefix keys: `key_at(L)` returns the chained hash of the request's first L tokens (L a multiple
of the hash block size), or None if those tokens are not known yet. An attention unit covering
tokens [i*t, (i+1)*t) is cached under key_at((i+1)*t); a state snapshot taken after exactly L
tokens under key_at(L).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, Generic, NamedTuple, TypeVar

from hybridkv.core.hashing import PrefixKeys
from hybridkv.core.page_pool import NULL_PAGE, PagePool
from hybridkv.core.units import UnitAllocator
from hybridkv.kv.plan import pages_to_kernel_blocks

if TYPE_CHECKING:
    from hybridkv.kv.plan import GroupPlan

KeyAt = PrefixKeys
NULL_UNIT = NULL_PAGE  # unit 0 lies in the null page in both modes
INF = math.inf


# ---------------------------------------------------------------------------------------------
# What managers exchange with the coordinator (typed, no bare tuples)
# ---------------------------------------------------------------------------------------------


class StepNeed(NamedTuple):
    """What one allocation asks of every group of one request (a NamedTuple: one is built per
    allocation that is not on the fast path, and a frozen dataclass costs about 4x more)."""

    num_computed: int  # tokens in the cache before this step
    total: int  # tokens the cache must hold after it
    snapshot_at: int | None = None  # a state snapshot is due after exactly this many tokens
    is_tail: bool = False  # that snapshot replaces the request's rolling end-of-request one


class PagesNeeded(NamedTuple):
    """New pool pages an allocation would take from the pool."""

    pages: int  # taking new pages only
    pages_if_reclaimed: int  # if the group first reclaims its own stranded cached units
    evictable_used: int  # evictable pages whose free units phase 1 would put in use


NO_PAGES = PagesNeeded(0, 0, 0)


class GroupEvents(NamedTuple):
    """When a request next needs this group (the coordinator's fast path skips every step
    before the first event of any group)."""

    capacity: float  # tokens the group holds for it: growing past this needs an allocation
    next_commit: float  # computed tokens at which a unit becomes full (to offer to the cache)
    next_drop: float  # first-query position at which a unit leaves a sliding window


NO_EVENTS = GroupEvents(INF, INF, INF)


class StateCopy(NamedTuple):
    """Copy every state tensor of every layer of `group_id` from page `src` to page `dst`."""

    group_id: int
    src: int
    dst: int


class StepAllocation(NamedTuple):
    """What the runner needs from one allocation of one request: plain ids, nothing live
    (read-only: the runner never changes it).

    - `new_blocks`: attention group -> kernel-block ids to append to the request's table row;
    - `state_pages`: state group -> the request's running-state page, when it got a new one
      (at admission, or again after a preemption); the runner keeps it per row;
    - `copies_in`: prefix-hit snapshots to copy into running pages before the forward;
    - `snapshots`: running states to copy into snapshot pages after the forward.
    """

    new_blocks: Mapping[int, list[int]]
    state_pages: Mapping[int, int]
    copies_in: tuple[StateCopy, ...] = ()
    snapshots: tuple[StateCopy, ...] = ()


EMPTY_ALLOCATION = StepAllocation(MappingProxyType({}), MappingProxyType({}))


class StepOps:
    """Collects the groups' contributions to one `StepAllocation` (`GroupManager.end_step`)."""

    __slots__ = ("new_blocks", "state_pages", "copies_in", "snapshots")

    def __init__(self) -> None:
        self.new_blocks: dict[int, list[int]] = {}
        self.state_pages: dict[int, int] = {}
        self.copies_in: list[StateCopy] = []
        self.snapshots: list[StateCopy] = []

    def freeze(self) -> StepAllocation:
        return StepAllocation(
            self.new_blocks, self.state_pages, tuple(self.copies_in), tuple(self.snapshots)
        )


# ---------------------------------------------------------------------------------------------
# The protocol
# ---------------------------------------------------------------------------------------------

R = TypeVar("R")


class GroupManager(ABC, Generic[R]):
    """What every group manager implements. `R` is what one request holds in the group.

    Class traits the coordinator reads:

    - `caches_tokens`: the group keeps per-token cache (attention of any kind). Such groups set
      the "attention hit" (a snapshot is taken where it outruns the state hit), have token events
      and take part in every allocation; the others keep a fixed-size state per request and
      take part only when they act (`involved`).
    - `prefix_closed`: serving a prefix of L tokens implies serving every shorter one (full
      attention), so a hit search checks the group once instead of at every candidate length.
    - `allocates_first`: takes its pages before the groups that budget theirs (phase 2 of
      `CacheManager._allocate_groups`): fixed-size pages are placed before growing ones.
    """

    caches_tokens: ClassVar[bool] = True
    prefix_closed: ClassVar[bool] = False
    allocates_first: ClassVar[bool] = False

    def __init__(self, group: GroupPlan, pool: PagePool) -> None:
        self.group = group
        self.group_id = group.group_id
        self.units = UnitAllocator(pool, group.group_id, group.units_per_page)

    # -- per request ---------------------------------------------------------------------------

    @abstractmethod
    def new_request(self) -> R: ...

    # -- prefix hits ---------------------------------------------------------------------------

    @abstractmethod
    def can_serve(self, length: int, key_at: KeyAt) -> bool:
        """Whether the group holds what a hit of exactly `length` tokens needs."""

    def longest_hit(self, key_at: KeyAt, limit: int, gran: int) -> int:
        """The longest multiple of `gran`, at most `limit`, that the group can serve."""
        length = limit // gran * gran
        while length > 0 and not self.can_serve(length, key_at):
            length -= gran
        return length

    @abstractmethod
    def take_hit(self, gr: R, length: int, key_at: KeyAt) -> None:
        """Hold the cached content of a hit of `length` tokens for a newly admitted request."""

    # -- per step ------------------------------------------------------------------------------

    def events(self, gr: R) -> GroupEvents:
        return NO_EVENTS

    def involved(self, gr: R, need: StepNeed) -> bool:
        """Whether this step needs anything of the group (else the coordinator skips it)."""
        return True

    @abstractmethod
    def pages_needed(self, gr: R, need: StepNeed) -> PagesNeeded: ...

    def fill_free_units(self, gr: R, need: StepNeed) -> None:
        """Phase 1 of an allocation: use free units of pages the group already owns."""

    @abstractmethod
    def allocate(self, gr: R, need: StepNeed, page_budget: int | None) -> bool:
        """Hold what `need` asks, taking at most `page_budget` new pages (None: any); False if
        impossible (the coordinator then undoes every group)."""

    @abstractmethod
    def end_step(self, gr: R, ops: StepOps) -> None:
        """Report what the runner must do for this allocation into `ops`; forget undo data."""

    @abstractmethod
    def undo(self, gr: R) -> None:
        """Release what the current allocation took (allocation is all or nothing)."""

    @abstractmethod
    def commit(self, gr: R, num_computed: int, key_at: KeyAt, caching: bool) -> None:
        """The step ran: offer finished content (full units, snapshots) to the prefix cache."""

    @abstractmethod
    def free(self, gr: R) -> None:
        """Release everything the request holds (cached content stays cached)."""

    # -- queries -------------------------------------------------------------------------------

    @abstractmethod
    def references(self, gr: R) -> list[int]:
        """Every unit reference the request holds (the integrity check counts them)."""

    @abstractmethod
    def table_row(self, gr: R) -> list[int]:
        """The request's row: kernel-block ids (attention) or its running-state page."""

    def drain_new_pages(self) -> list[int]:
        """Pages newly handed to the group since the last call that must be zeroed before use
        (a page that held a state may hold NaN bit patterns an attention kernel must not read)."""
        return self.units.drain_new_pages()

    @property
    def num_snapshot_pages(self) -> int:
        return 0


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


class FullAttentionManager(GroupManager[AttentionReq]):
    """Full attention: a request holds every unit of its context."""

    prefix_closed = True

    def __init__(self, group: GroupPlan, pool: PagePool) -> None:
        assert group.unit_tokens is not None, "an attention group needs a kernel block size"
        super().__init__(group, pool)
        self.unit_tokens = group.unit_tokens
        self.blocks_per_unit = group.blocks_per_unit

    def new_request(self) -> AttentionReq:
        return AttentionReq()

    def table_row(self, gr: AttentionReq) -> list[int]:
        return pages_to_kernel_blocks(gr.units, self.blocks_per_unit)

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

    def longest_hit(self, key_at: KeyAt, limit: int, gran: int) -> int:
        return self.cached_prefix_tokens(key_at, limit) // gran * gran

    def take_hit(self, gr: AttentionReq, length: int, key_at: KeyAt) -> None:
        n = length // self.unit_tokens
        self._take_cached(gr, key_at.unit_keys(self.unit_tokens, 0, n))
        gr.registered = n

    def _take_cached(self, gr: AttentionReq, keys: list[int]) -> None:
        units = []
        for key in keys:
            unit = self.units.lookup(key)
            assert unit is not None, "a prefix hit vanished before it was taken"
            self.units.incref(unit)
            units.append(unit)
        gr.units.extend(units)
        gr.new_entries.extend(pages_to_kernel_blocks(units, self.blocks_per_unit))

    # -- per step ----------------------------------------------------------------------------

    def events(self, gr: AttentionReq) -> GroupEvents:
        capacity = len(gr.units) * self.unit_tokens
        return GroupEvents(capacity, (gr.registered + 1) * self.unit_tokens, INF)

    def _units_needed(self, gr: AttentionReq, total: int) -> int:
        return max(0, -(-total // self.unit_tokens) - len(gr.units))

    def pages_needed(self, gr: AttentionReq, need: StepNeed) -> PagesNeeded:
        missing = self._units_needed(gr, need.total)
        if missing == 0:
            return NO_PAGES
        found, touched = self.units.count_free_units(missing, self._hint_page(gr))
        per_page = self.units.units_per_page
        short = missing - found
        reclaimed = max(0, short - self.units.num_stranded)
        return PagesNeeded(-(-short // per_page), -(-reclaimed // per_page), touched)

    def fill_free_units(self, gr: AttentionReq, need: StepNeed) -> None:
        self._take_units(gr, need.total, page_budget=0, reclaim=False)

    def allocate(self, gr: AttentionReq, need: StepNeed, page_budget: int | None) -> bool:
        """Hold units for the first `need.total` tokens, taking at most `page_budget` new pages
        and reclaiming stranded cached units beyond."""
        return self._take_units(gr, need.total, page_budget, reclaim=True)

    def _take_units(
        self, gr: AttentionReq, total: int, page_budget: int | None, reclaim: bool
    ) -> bool:
        missing = self._units_needed(gr, total)
        if missing == 0:
            return True
        units = self.units.take(missing, self._hint_page(gr), page_budget, reclaim)
        gr.units.extend(units)
        gr.new_units.extend(units)
        gr.new_entries.extend(pages_to_kernel_blocks(units, self.blocks_per_unit))
        return len(units) == missing

    def _hint_page(self, gr: AttentionReq) -> int | None:
        last = gr.units[-1] if gr.units else NULL_UNIT
        return None if last == NULL_UNIT else last // self.units.units_per_page

    def end_step(self, gr: AttentionReq, ops: StepOps) -> None:
        if gr.new_entries:
            ops.new_blocks[self.group_id] = gr.new_entries
            gr.new_entries = []
        gr.new_units.clear()

    def commit(self, gr: AttentionReq, num_computed: int, key_at: KeyAt, caching: bool) -> None:
        """Offer every unit that is now full to the prefix cache."""
        full = min(num_computed // self.unit_tokens, len(gr.units))
        if caching and full > gr.registered:
            keys = key_at.unit_keys(self.unit_tokens, gr.registered, full)
            units = gr.units[gr.registered : gr.registered + len(keys)]
            tokens = None
            if self.units.log is not None:  # cache events carry each unit's prefix length
                t = self.unit_tokens
                tokens = [(gr.registered + i + 1) * t for i in range(len(keys))]
            if NULL_UNIT in units:  # sliding windows may hold dropped units
                live = [i for i, x in enumerate(units) if x != NULL_UNIT]
                keys, units = [keys[i] for i in live], [units[i] for i in live]
                tokens = None if tokens is None else [tokens[i] for i in live]
            self.units.set_keys(units, keys, tokens)
        gr.registered = max(gr.registered, full)

    def undo(self, gr: AttentionReq) -> None:
        if gr.new_units:
            del gr.units[len(gr.units) - len(gr.new_units) :]
            self.units.release(reversed(gr.new_units))
        gr.new_units.clear()
        gr.new_entries = []

    def free(self, gr: AttentionReq) -> None:
        """Release every unit, last first: tail pages become evictable before head pages."""
        self.units.release(u for u in reversed(gr.units) if u != NULL_UNIT)
        gr.units.clear()
        gr.new_units.clear()
        gr.new_entries = []

    def references(self, gr: AttentionReq) -> list[int]:
        return [u for u in gr.units if u != NULL_UNIT]


class SlidingWindowManager(FullAttentionManager):
    """Sliding window: units that leave the window are dropped (cached ones stay cached).

    A query at position p reads keys in (p - W, p]. Before a step whose first query sits at
    position c, every unit that ends at or before c - W + 1 is dropped. Block-table entries of
    dropped units are left as they were: kernels mask keys outside the window with `where`.
    """

    prefix_closed = False

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

    def longest_hit(self, key_at: KeyAt, limit: int, gran: int) -> int:
        return GroupManager.longest_hit(self, key_at, limit, gran)

    def take_hit(self, gr: AttentionReq, length: int, key_at: KeyAt) -> None:
        n = length // self.unit_tokens
        first = min(self._first_needed_unit(length), n)
        gr.units.extend([NULL_UNIT] * first)
        gr.new_entries.extend(pages_to_kernel_blocks([NULL_UNIT] * first, self.blocks_per_unit))
        self._take_cached(gr, key_at.unit_keys(self.unit_tokens, first, n))
        gr.first_live = first
        gr.registered = n

    def events(self, gr: AttentionReq) -> GroupEvents:
        capacity, commit, _ = super().events(gr)
        # the first-query position at which the oldest live unit leaves the window
        drop = (gr.first_live + 1) * self.unit_tokens + self.window - 1
        return GroupEvents(capacity, commit, drop)

    def fill_free_units(self, gr: AttentionReq, need: StepNeed) -> None:
        """Drop the units that left the window first: their places may serve this request."""
        first = min(self._first_needed_unit(need.num_computed), len(gr.units))
        for i in range(gr.first_live, first):
            if gr.units[i] != NULL_UNIT:
                self.units.decref(gr.units[i])
                gr.units[i] = NULL_UNIT
        gr.first_live = max(gr.first_live, first)
        super().fill_free_units(gr, need)


# ---------------------------------------------------------------------------------------------
# State (Mamba1, Mamba2, gated delta net, short conv, KDA)
# ---------------------------------------------------------------------------------------------


@dataclass
class StateReq:
    """What one request holds in one state group."""

    running: int | None = None  # page of the running state
    new_running: bool = False  # the running page was taken in the current call
    copy_from: int | None = None  # snapshot page to copy into the running page (pinned)
    copy_scheduled: bool = False  # the copy-in is part of a step; unpin at its commit
    tail: tuple[int, Hashable] | None = None  # the rolling end-of-request snapshot (page, key)
    pending: list[tuple[int, int, bool]] = field(default_factory=list)  # (page, length, is_tail)
    new_pages: list[int] = field(default_factory=list)  # allocated in the current call (undo)
    copy_in: StateCopy | None = None  # to run before this step's forward
    snapshots: list[StateCopy] = field(default_factory=list)  # to run after the forward


class StateManager(GroupManager[StateReq]):
    """A running-state page per request plus snapshot pages (states after exactly L tokens)."""

    caches_tokens = False
    allocates_first = True

    def new_request(self) -> StateReq:
        return StateReq()

    def table_row(self, gr: StateReq) -> list[int]:
        return [] if gr.running is None else [gr.running]

    @property
    def num_snapshot_pages(self) -> int:
        return self.units.num_cached_units

    # -- prefix hits -------------------------------------------------------------------------

    def can_serve(self, length: int, key_at: KeyAt) -> bool:
        if length == 0:
            return True
        key = key_at(length)
        return key is not None and self.units.lookup(key) is not None

    def take_hit(self, gr: StateReq, length: int, key_at: KeyAt) -> None:
        if length == 0:
            return
        page = self.units.lookup(key_at(length))
        assert page is not None, "a state snapshot vanished before it was taken"
        self.units.incref(page)  # pinned until the copy into the running page has run
        gr.copy_from = page

    # -- per step ----------------------------------------------------------------------------

    def involved(self, gr: StateReq, need: StepNeed) -> bool:
        """A state group acts at admission (running page) and at snapshot boundaries only."""
        return gr.running is None or need.snapshot_at is not None

    def pages_needed(self, gr: StateReq, need: StepNeed) -> PagesNeeded:
        pages = int(gr.running is None) + int(need.snapshot_at is not None)
        return PagesNeeded(pages, pages, 0)

    def allocate(self, gr: StateReq, need: StepNeed, page_budget: int | None) -> bool:
        if gr.running is None:
            page = self.units.alloc()
            if page is None:
                return False
            gr.running, gr.new_running = page, True
            gr.new_pages.append(page)
            if gr.copy_from is not None:
                gr.copy_in = StateCopy(self.group_id, gr.copy_from, page)
                gr.copy_scheduled = True
        if need.snapshot_at is not None:
            page = self.units.alloc()
            if page is None:
                return False
            gr.new_pages.append(page)
            gr.pending.append((page, need.snapshot_at, need.is_tail))
            gr.snapshots.append(StateCopy(self.group_id, gr.running, page))
        return True

    def end_step(self, gr: StateReq, ops: StepOps) -> None:
        if gr.new_running and gr.running is not None:
            ops.state_pages[self.group_id] = gr.running
        if gr.copy_in is not None:
            ops.copies_in.append(gr.copy_in)
        ops.snapshots.extend(gr.snapshots)
        self._forget_step(gr)

    def _forget_step(self, gr: StateReq) -> None:
        gr.new_pages.clear()
        gr.new_running = False
        gr.copy_in = None
        gr.snapshots.clear()

    def commit(self, gr: StateReq, num_computed: int, key_at: KeyAt, caching: bool) -> None:
        """Snapshots taken become cached; copy-in sources are unpinned."""
        for page, length, is_tail in gr.pending:
            key = key_at(length)
            if key is not None and self.units.set_key(page, key, length) and is_tail:
                self._drop_tail(gr)
                gr.tail = (page, key)
            self.units.decref(page)
        gr.pending.clear()
        if gr.copy_scheduled and gr.copy_from is not None:
            self.units.decref(gr.copy_from)
            gr.copy_from = None
            gr.copy_scheduled = False

    def _drop_tail(self, gr: StateReq) -> None:
        """The previous rolling snapshot is superseded: free it (if still the one we made)."""
        if gr.tail is not None:
            page, key = gr.tail
            if self.units.key_of.get(page) == key:
                self.units.uncache(page)
        gr.tail = None

    def undo(self, gr: StateReq) -> None:
        for page in reversed(gr.new_pages):
            self.units.decref(page)
            if page == gr.running:
                gr.running = None
                gr.copy_scheduled = False
            gr.pending = [p for p in gr.pending if p[0] != page]
        self._forget_step(gr)

    def free(self, gr: StateReq) -> None:
        for page, _, _ in gr.pending:
            self.units.decref(page)
        gr.pending.clear()
        if gr.copy_from is not None:
            self.units.decref(gr.copy_from)
            gr.copy_from = None
            gr.copy_scheduled = False
        if gr.running is not None:
            self.units.decref(gr.running)
            gr.running = None
        self._forget_step(gr)

    def references(self, gr: StateReq) -> list[int]:
        refs = [p for p, _, _ in gr.pending]
        if gr.running is not None:
            refs.append(gr.running)
        if gr.copy_from is not None:
            refs.append(gr.copy_from)
        return refs

    def drain_new_pages(self) -> list[int]:
        """State pages need no zeroing: a request without a state ignores its page's bytes."""
        self.units.drain_new_pages()
        return []


# Layer kind -> manager. Adding a layer kind = one spec, one manager (or an existing one), one
# entry here.
MANAGERS: dict[str, type[GroupManager]] = {
    "attention": FullAttentionManager,
    "sliding_window": SlidingWindowManager,
    "mla": FullAttentionManager,  # attention with its own bytes per token (its page_tokens)
    "mamba1": StateManager,
    "mamba2": StateManager,
    "gated_delta_net": StateManager,
    "short_conv": StateManager,
    "kda": StateManager,
}


def manager_for(group: GroupPlan, pool: PagePool) -> GroupManager:
    """The manager of a planned group, or a one-line error naming the kinds that have one."""
    cls = MANAGERS.get(group.kind)
    if cls is None:
        raise ValueError(
            f"no cache manager for layer kind {group.kind!r}; known: {', '.join(MANAGERS)}"
        )
    return cls(group, pool)
