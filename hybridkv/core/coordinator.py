"""The cache manager: one page pool, one manager per group, hybrid prefix caching.

Per request and step the scheduler calls, in this order:

    hit = cm.lookup(req)                     # at admission: longest prefix every group serves
    alloc = cm.allocate(req, n, hit)         # hold cache for n more tokens; None if the pool is dry
    ... the runner copies alloc.copies_in, runs the forward, copies alloc.snapshots ...
    cm.commit(req, num_computed_tokens)      # full units and new snapshots enter the cache
    cm.free(req)                             # finished or preempted

Allocation is all or nothing across groups; freeing runs groups in reverse order.

Hybrid prefix hits (design.md section 5): a hit of L tokens needs every full-attention group to
hold all units of the first L tokens, every sliding group those inside its window, and every
state group a snapshot taken after exactly L tokens. Hit lengths are multiples of `hit_tokens`
(the least common multiple of the attention groups' unit sizes: kernel_block_size in block mode,
page_tokens in page mode).

Snapshot policy (CacheConfig fields; boundaries are multiples of hit_tokens):

- `snapshot_prompt_end`: the last boundary inside the prompt, so a longer prompt sharing it
  (the next turn of a conversation, a shared system prompt) hits;
- `snapshot_request_end`: a rolling tail: every `snapshot_tail_interval_tokens` (rounded up to
  hit blocks) after its prompt, and at the last boundary `max_tokens` lets it reach, a request
  snapshots its state and drops its previous tail, so the state near the end of a finished
  request stays cached for the follow-up that extends it (the next turn of a conversation);
- `snapshot_branch_point`: when a new prompt's attention hit is longer than its state hit, the
  attention hit length, so the next prompt with that prefix hits in full;
- `snapshot_interval_blocks`: also every N boundaries inside the prompt;
- `max_snapshots_per_request` caps the prompt-time snapshots (the tail is at most one more).

Cache events (`events.py`, for a router that sends requests to the replica holding their
prefix): off by default; after `enable_events()`, `drain_events()` returns what entered and
left the prefix cache since the last drain.

The scheduler ends prefill chunks at `next_boundary(req)` so that the running state is exactly
at a boundary when its snapshot is copied. Every snapshot page is cached (evictable) as soon as
its copy has run: snapshots never lower the number of requests the pool can hold.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from hybridkv.config import CacheConfig
from hybridkv.core.events import CLEAR, STORED, CacheEvent, EventLog
from hybridkv.core.hashing import PrefixKeys
from hybridkv.core.managers import (
    EMPTY_ALLOCATION,
    INF,
    GroupManager,
    StateCopy,
    StepAllocation,
    StepNeed,
    StepOps,
    manager_for,
)
from hybridkv.core.page_pool import PagePool
from hybridkv.kv.plan import MemoryPlan

__all__ = [
    "EMPTY_ALLOCATION",
    "CacheManager",
    "CacheRequest",
    "PrefixHit",
    "SimpleRequest",
    "StateCopy",
    "StepAllocation",
]


class CacheRequest(Protocol):
    """What the cache manager reads from a request."""

    request_id: str
    all_token_ids: Sequence[int]  # prompt followed by the tokens generated so far
    num_prompt_tokens: int
    extra_keys: tuple[Hashable, ...]  # enter the prefix hash (adapter id, cache salt, ...)
    max_computed_tokens: int | None  # the most tokens it can ever compute (None: unknown)


@dataclass
class SimpleRequest:
    """A minimal `CacheRequest` (tests and benchmarks)."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    extra_keys: tuple[Hashable, ...] = ()
    max_computed_tokens: int | None = None


@dataclass(frozen=True)
class PrefixHit:
    num_tokens: int  # tokens every group can serve
    attention_tokens: int  # tokens the attention groups alone could serve


NO_HIT = PrefixHit(0, 0)


@dataclass
class _ReqState:
    request: CacheRequest
    groups: list[Any]  # what the request holds in each group (the manager's own type)
    hashes: list[int]
    num_computed: int = 0
    boundaries: list[int] = field(default_factory=list)  # prompt-time snapshot lengths, sorted
    has_pending: bool = False  # snapshot / copy-in ops waiting for commit
    cap: float = 0  # tokens every attention group can hold
    next_snap: float = INF  # total at which the next snapshot is due
    next_drop: float = INF  # first-query position at which a sliding group drops a unit
    next_commit: float = INF  # computed tokens at which a unit becomes full


@dataclass
class CacheStats:
    queries: int = 0  # admissions that looked up the prefix cache
    hits: int = 0  # admissions with a hit
    query_tokens: int = 0
    hit_tokens: int = 0
    snapshots_taken: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


class CacheManager:
    def __init__(self, plan: MemoryPlan, cache: CacheConfig) -> None:
        self.plan = plan
        self.config = cache
        self.caching = cache.enable_prefix_caching
        self.pool = PagePool(plan.num_pages)
        self.groups: list[GroupManager[Any]] = [manager_for(g, self.pool) for g in plan.groups]
        self.hash_block_tokens = plan.hash_block_tokens
        self.hit_tokens = plan.hit_tokens
        ids = range(len(self.groups))
        # Which groups do what, from the managers' declared traits (GroupManager's docstring).
        self._token_ids = [i for i in ids if self.groups[i].caches_tokens]
        self._state_ids = [i for i in ids if not self.groups[i].caches_tokens]
        self._closed = [m for m in self.groups if m.prefix_closed]
        self._open_token = [m for m in self.groups if m.caches_tokens and not m.prefix_closed]
        self._open = [m for m in self.groups if not m.prefix_closed]
        self._alloc_order = sorted(ids, key=lambda i: not self.groups[i].allocates_first)
        self.has_state = bool(self._state_ids)
        self._reqs: dict[str, _ReqState] = {}
        self._lookup_hashes: dict[str, list[int]] = {}
        self.stats = CacheStats()
        interval = cache.snapshot_tail_interval_tokens
        self.tail_interval = -(-interval // self.hit_tokens) * self.hit_tokens
        self._events: EventLog | None = None

    # -- cache events ------------------------------------------------------------------------

    def enable_events(self, max_pending: int = 1_000_000) -> None:
        """Record cache events from now on (`events.py`). The first drain starts with CLEARED
        and the content already cached; past `max_pending` undrained events the log drops them
        and the next drain resynchronises the same way (memory stays bounded)."""
        if self._events is not None:
            self._events.max_pending = max_pending
            return
        log = EventLog(max_pending)
        log.overflowed = True  # the first drain describes the whole cache
        for m in self.groups:
            m.units.log = log
            m.units.logs_snapshots = not m.caches_tokens
        self._events = log

    def drain_events(self) -> list[CacheEvent]:
        """The cache events since the last drain, oldest first ([] when not enabled)."""
        log = self._events
        if log is None:
            return []
        if not log.overflowed:
            return log.drain()
        log.drain()
        log.overflowed = False
        out = [CLEAR]
        for m in self.groups:
            snap = not m.caches_tokens
            out.extend(
                CacheEvent(STORED, m.group_id, key, n, snap) for key, n in m.units.cached_keys()
            )
        return out

    # -- prefix keys -------------------------------------------------------------------------

    def _keys(self, req: CacheRequest, hashes: list[int]) -> PrefixKeys:
        return PrefixKeys(req.all_token_ids, self.hash_block_tokens, req.extra_keys, hashes)

    # -- lookup ------------------------------------------------------------------------------

    def lookup(self, req: CacheRequest) -> PrefixHit:
        """The longest prefix every group can serve (no side effects on the cache)."""
        if not self.caching or req.request_id in self._reqs:
            return NO_HIT
        key_at = self._keys(req, self._lookup_hashes.setdefault(req.request_id, []))

        gran = self.hit_tokens
        limit = (len(req.all_token_ids) - 1) // gran * gran  # one token must be computed
        for m in self._closed:  # serving L implies serving less: one check each
            limit = m.longest_hit(key_at, limit, gran)
        attention = self._common_hit(limit, self._open_token, key_at)
        length = self._common_hit(attention, self._open, key_at)
        if not self._token_ids:  # no attention groups: no attention hit can outrun the states
            attention = length
        return PrefixHit(length, attention)

    def _common_hit(self, length: int, groups: list[GroupManager[Any]], key_at) -> int:
        """The longest hit <= `length` that every group of `groups` serves: each group's own
        longest hit, repeated until no group lowers it (each lowers it or keeps it)."""
        while True:
            start = length
            for m in groups:
                length = m.longest_hit(key_at, length, self.hit_tokens)
            if length == start:
                return length

    # -- admission ---------------------------------------------------------------------------

    def _admit(self, req: CacheRequest, hit: PrefixHit) -> _ReqState:
        hashes = self._lookup_hashes.pop(req.request_id, [])
        rs = _ReqState(req, [m.new_request() for m in self.groups], hashes)
        key_at = self._keys(req, rs.hashes)

        for m, gr in zip(self.groups, rs.groups, strict=True):
            m.take_hit(gr, hit.num_tokens, key_at)
        rs.num_computed = hit.num_tokens
        rs.boundaries = self._prompt_boundaries(req, hit) if self.has_state else []
        self._update_events(rs, rs.num_computed)
        return rs

    def _prompt_boundaries(self, req: CacheRequest, hit: PrefixHit) -> list[int]:
        if not self.caching:
            return []
        cfg, gran = self.config, self.hit_tokens
        prompt_end = len(req.all_token_ids) // gran * gran
        wanted: list[int] = []
        if cfg.snapshot_prompt_end:
            wanted.append(prompt_end)
        if cfg.snapshot_branch_point and hit.attention_tokens > hit.num_tokens:
            wanted.append(hit.attention_tokens)
        if cfg.snapshot_interval_blocks:
            step = cfg.snapshot_interval_blocks * gran
            wanted.extend(range(prompt_end - step, hit.num_tokens, -step))
        chosen: list[int] = []
        for length in wanted:  # in priority order, up to the cap
            if length > hit.num_tokens and length not in chosen:
                chosen.append(length)
        return sorted(chosen[: cfg.max_snapshots_per_request])

    def next_boundary(self, req: CacheRequest, hit: PrefixHit | None = None) -> int | None:
        """The next prompt-time snapshot length; a prefill chunk must not run past it. For a
        request not admitted yet, pass the hit its admission will use."""
        rs = self._reqs.get(req.request_id)
        if rs is None:
            hit = hit or NO_HIT
            boundaries = self._prompt_boundaries(req, hit) if self.has_state else []
            start = hit.num_tokens
        else:
            boundaries, start = rs.boundaries, rs.num_computed
        return next((b for b in boundaries if b > start), None)

    def next_snapshot_at(self, req: CacheRequest) -> float:
        """The token count at which the request's next state snapshot is due (inf: none). A
        chunk carrying drafts must end before it: a snapshot must never hold a draft's state."""
        rs = self._reqs.get(req.request_id)
        return INF if rs is None else rs.next_snap

    # -- allocation --------------------------------------------------------------------------

    def allocate(
        self, req: CacheRequest, num_new_tokens: int, hit: PrefixHit | None = None
    ) -> StepAllocation | None:
        """Hold cache for `num_new_tokens` more tokens in every group, or None (nothing held
        changes) when the pool cannot serve it; the caller then preempts or waits."""
        rs = self._reqs.get(req.request_id)
        new = rs is None
        if rs is None:
            rs = self._admit(req, hit or NO_HIT)
        total = rs.num_computed + num_new_tokens
        fast = total <= rs.cap and total < rs.next_snap and rs.num_computed < rs.next_drop
        if fast and not new:
            return EMPTY_ALLOCATION  # fast path: nothing to do in any group
        need = self._need(rs, total)
        active = self._allocate_groups(rs, need)
        if active is None and need.snapshot_at is not None:
            # A snapshot is an optimisation: without room for it, the step runs without one.
            need = StepNeed(rs.num_computed, total)
            active = self._allocate_groups(rs, need)
        if active is None:
            if new:
                self._release(rs)
                self._lookup_hashes[req.request_id] = rs.hashes
            return None
        if new:
            self._reqs[req.request_id] = rs
            self._count_admission(req, rs.num_computed)
        return self._finish_allocation(rs, need, active)

    def _allocate_groups(self, rs: _ReqState, need: StepNeed) -> list[int] | None:
        """All or nothing; returns the groups that took part, or None. The pages needed are
        counted first, so a request the pool cannot serve changes nothing (not even cached
        content an eviction would have dropped). Then:

            phase 1  every group fills free units of pages it already owns
            phase 2  groups that allocate first (fixed-size state pages) take their pages
            phase 3  the others take new pages, within a per-group budget when the pool is
                     short, reclaiming their own stranded cached units beyond it

        Phase 1 runs before any page changes hands, so no eviction takes a page whose free
        units were counted; the budgets make phase 3 unable to starve another group."""
        groups, reqs = self.groups, rs.groups
        active = [i for i in self._alloc_order if groups[i].involved(reqs[i], need)]
        needs = [groups[i].pages_needed(reqs[i], need) for i in active]
        available = self.pool.num_available - sum(n.evictable_used for n in needs)
        budgets: list[int | None]
        if sum(n.pages for n in needs) <= available:
            budgets = [None] * len(active)
        elif sum(n.pages_if_reclaimed for n in needs) <= available:
            budgets = [n.pages_if_reclaimed for n in needs]
        else:
            return None
        for i in active:
            groups[i].fill_free_units(reqs[i], need)
        ok = all(
            groups[i].allocate(reqs[i], need, budget)
            for i, budget in zip(active, budgets, strict=True)
        )
        if not ok:  # cannot happen after the count above; kept as a safety net
            for i in active:
                groups[i].undo(reqs[i])
            return None
        return active

    def _need(self, rs: _ReqState, total: int) -> StepNeed:
        """What this step asks: `total` tokens held, and a state snapshot if one is due."""
        if not self.caching or not self.has_state or total < rs.next_snap:
            return StepNeed(rs.num_computed, total)
        for b in rs.boundaries:
            if b == total:
                return StepNeed(rs.num_computed, total, total, False)
        if self.config.snapshot_request_end and total == self._next_tail(rs, total - 1):
            return StepNeed(rs.num_computed, total, total, True)
        return StepNeed(rs.num_computed, total)

    def _next_tail(self, rs: _ReqState, after: int) -> float:
        """The first rolling-tail boundary past `after` tokens: on the interval grid past the
        prompt, or the last boundary the request can reach (known from its max_tokens)."""
        gran, req = self.hit_tokens, rs.request
        start = max(after, req.num_prompt_tokens)
        grid = (start // self.tail_interval + 1) * self.tail_interval
        limit = getattr(req, "max_computed_tokens", None)
        if limit is None:
            return grid
        final = limit // gran * gran
        if final > start:
            return min(grid, final)
        return INF if grid > limit else grid

    def _finish_allocation(
        self, rs: _ReqState, need: StepNeed, active: list[int]
    ) -> StepAllocation:
        ops = StepOps()
        for i in active:
            self.groups[i].end_step(rs.groups[i], ops)
        if ops.snapshots:
            self.stats.snapshots_taken += 1
        if rs.boundaries:
            rs.boundaries = [b for b in rs.boundaries if b > need.total]
        rs.has_pending = rs.has_pending or bool(ops.copies_in or ops.snapshots)
        self._update_events(rs, need.total)
        return ops.freeze()

    def _update_events(self, rs: _ReqState, total: int) -> None:
        cap: float = INF
        drop: float = INF
        commit: float = INF
        for i in self._token_ids:
            events = self.groups[i].events(rs.groups[i])
            cap = min(cap, events.capacity)
            commit = min(commit, events.next_commit)
            drop = min(drop, events.next_drop)
        rs.cap, rs.next_drop = cap, drop
        rs.next_commit = commit if self.caching else INF
        rs.next_snap = INF
        if self.caching and self.has_state:
            if rs.boundaries:
                rs.next_snap = rs.boundaries[0]
            elif self.config.snapshot_request_end:
                rs.next_snap = self._next_tail(rs, total)

    def _count_admission(self, req: CacheRequest, hit_tokens: int) -> None:
        if not self.caching:
            return
        self.stats.queries += 1
        self.stats.query_tokens += len(req.all_token_ids)
        self.stats.hit_tokens += hit_tokens
        self.stats.hits += hit_tokens > 0

    # -- after the step ----------------------------------------------------------------------

    def commit(self, req: CacheRequest, num_computed_tokens: int) -> None:
        """The step ran: `num_computed_tokens` are in the cache; full units and snapshots taken
        become available to other requests."""
        rs = self._reqs[req.request_id]
        rs.num_computed = num_computed_tokens
        if num_computed_tokens < rs.next_commit and not rs.has_pending:
            return

        key_at = self._keys(rs.request, rs.hashes)
        groups, reqs = self.groups, rs.groups
        if num_computed_tokens >= rs.next_commit:  # a unit became full in a token group
            commit: float = INF
            for i in self._token_ids:
                groups[i].commit(reqs[i], num_computed_tokens, key_at, self.caching)
                commit = min(commit, groups[i].events(reqs[i]).next_commit)
            rs.next_commit = commit if self.caching else INF
        if rs.has_pending:  # snapshots and copy-ins of the state groups
            for i in self._state_ids:
                groups[i].commit(reqs[i], num_computed_tokens, key_at, self.caching)
            rs.has_pending = False

    def free(self, req: CacheRequest) -> None:
        """Release everything a request holds (finished or preempted); cached content stays."""
        self._lookup_hashes.pop(req.request_id, None)
        rs = self._reqs.pop(req.request_id, None)
        if rs is not None:
            self._release(rs)

    def _release(self, rs: _ReqState) -> None:
        for m, gr in reversed(list(zip(self.groups, rs.groups, strict=True))):
            m.free(gr)

    # -- queries (tests, metrics) ----------------------------------------------------------------

    def is_admitted(self, req: CacheRequest) -> bool:
        return req.request_id in self._reqs

    def num_computed(self, req: CacheRequest) -> int:
        return self._reqs[req.request_id].num_computed

    def table_row(self, req: CacheRequest, group_id: int) -> list[int]:
        """The request's row in a group: kernel-block ids, or its running-state page."""
        return self.groups[group_id].table_row(self._reqs[req.request_id].groups[group_id])

    def drain_new_pages(self) -> dict[int, list[int]]:
        """Pages newly handed to each group since the last call that must be zeroed."""
        out = {}
        for m in self.groups:
            pages = m.drain_new_pages()
            if pages:
                out[m.group_id] = pages
        return out

    # -- accounting --------------------------------------------------------------------------

    def usage(self) -> dict[str, int]:
        """Pages free, cached only (evictable) and in use, plus snapshot pages held."""
        cached = self.pool.num_evictable
        free = self.pool.num_free
        return {
            "total": self.pool.num_usable,
            "free": free,
            "cached": cached,
            "in_use": self.pool.num_usable - free - cached,
            "snapshot_pages": sum(m.num_snapshot_pages for m in self.groups),
        }

    def group_usage(self) -> list[dict[str, int | str]]:
        rows: list[dict[str, int | str]] = []
        for m in self.groups:
            owned = m.units.num_pages
            in_use = m.units.pages_in_use()
            rows.append(
                {
                    "group": m.group_id,
                    "kind": m.group.kind,
                    "in_use": in_use,
                    "cached": owned - in_use,
                }
            )
        return rows

    def check_integrity(self) -> None:
        """Every page free, cached or in use exactly once; refcounts equal the references held
        by requests; no page owned by two groups. Raises AssertionError on a violation."""
        self.pool.check()
        for m in self.groups:
            m.units.check()
        for gid, m in enumerate(self.groups):
            refs = (u for rs in self._reqs.values() for u in m.references(rs.groups[gid]))
            expected = Counter(refs)
            held = {u: c for u, c in m.units.ref.items() if c > 0}
            assert held == dict(expected), f"group {gid}: refcounts differ from references"
        usage = self.usage()
        assert usage["free"] + usage["cached"] + usage["in_use"] == usage["total"]
        assert usage["in_use"] >= 0
