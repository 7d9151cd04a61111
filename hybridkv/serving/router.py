"""Cache-aware routing of requests across data-parallel replicas of one model.

Each replica is a whole engine with its own cache. A router, possibly in another process,
keeps a `PrefixIndex`: per replica and group, the prefix keys that replica's cache holds, fed
by the cache events the replica drains (`CacheManager.enable_events` / `drain_events`).

    replica "a": Engine ── cache.drain_events() ──┐
    replica "b": Engine ── cache.drain_events() ──┤  [CacheEvent, ...]  (plain values, pickled)
                                                  v
    request ── prompt token ids ──> Router ── PrefixIndex.apply(replica, events)
                                      │         per replica, per group: {prefix key}
                                      │   hit_tokens(replica, prompt): the longest L with
                                      │     every full-attention group: keys of units 0..L
                                      │     every sliding group: keys of units in the window at L
                                      │     every state group: the key of a snapshot at exactly L
                                      └──> choose(prompt, loads) -> "a" (longest hit, unless
                                           "a" is overloaded; ties -> least loaded)

The index computes a prompt's keys with the engine's own chained hash (`core/hashing.py`,
the same in every process) at the plan's hash block size, and applies the rules of
`CacheManager.lookup`: a hit is a multiple of the plan's `hit_tokens` and leaves at least one
prompt token to compute. What it reports is what the replica would serve if nothing changes
before the request arrives (an eviction in flight makes it optimistic, never wrong in output).

Policies:

- `round_robin`: replicas in turn, loads and prefixes ignored;
- `least_loaded`: fewest running + waiting requests, then most free pages;
- `prefix_aware`: the longest hit among the replicas that are not overloaded; a replica is
  overloaded when its queue (running + waiting) exceeds the least loaded replica's by more than
  `max_queue_excess` (default 8: a few requests' wait is worth a long prefix's prefill) or when
  its free pages are under `min_free_fraction` of its pages (default 0.05: a hit there would
  evict or preempt). No hit anywhere, or ties: least loaded.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hybridkv.core.events import CLEARED, REMOVED, STORED, CacheEvent
from hybridkv.core.hashing import PrefixKeys

if TYPE_CHECKING:
    from hybridkv.kv.plan import MemoryPlan

__all__ = [
    "POLICIES",
    "CacheEvent",
    "GroupRule",
    "IndexSpec",
    "PrefixIndex",
    "ReplicaLoad",
    "Router",
    "load_of",
]

FULL, SLIDING, STATE = "full", "sliding", "state"
POLICIES = ("round_robin", "least_loaded", "prefix_aware")


# ---------------------------------------------------------------------------------------------
# What the index needs of the plan
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GroupRule:
    """How one group decides whether it serves a hit of L tokens."""

    group_id: int
    role: str  # FULL (units 0..L), SLIDING (units inside the window at L), STATE (snapshot at L)
    unit_tokens: int = 0  # tokens per cached unit (attention groups)
    window: int | None = None  # sliding window (SLIDING)


@dataclass(frozen=True)
class IndexSpec:
    """The plan facts a `PrefixIndex` applies (picklable; equal for every replica of a model)."""

    hash_block_tokens: int
    hit_tokens: int
    groups: tuple[GroupRule, ...]

    @classmethod
    def from_plan(cls, plan: MemoryPlan) -> IndexSpec:
        from hybridkv.core.managers import MANAGERS

        rules = []
        for g in plan.groups:
            manager = MANAGERS[g.kind]
            if not manager.caches_tokens:
                rules.append(GroupRule(g.group_id, STATE))
            else:
                role = FULL if manager.prefix_closed else SLIDING
                rules.append(GroupRule(g.group_id, role, g.unit_tokens or 0, g.window))
        return cls(plan.hash_block_tokens, plan.hit_tokens, tuple(rules))


@dataclass(frozen=True)
class ReplicaLoad:
    """What a replica reports about its load. `free_pages`: pages a new request can take
    (free plus cached-only ones, which are evictable); `total_pages` 0 means unknown."""

    num_running: int = 0
    num_waiting: int = 0
    free_pages: int = 0
    total_pages: int = 0

    @property
    def queue(self) -> int:
        return self.num_running + self.num_waiting


def load_of(engine: Any) -> ReplicaLoad:
    """The load of an in-process `Engine` (its scheduler's queues and its cache's pages)."""
    usage = engine.cache.usage()
    sched = engine.scheduler
    return ReplicaLoad(
        len(sched.running), len(sched.waiting), usage["free"] + usage["cached"], usage["total"]
    )


# ---------------------------------------------------------------------------------------------
# The index
# ---------------------------------------------------------------------------------------------


class PrefixIndex:
    """Per replica, the prefix keys each group of its cache holds (fed by cache events)."""

    def __init__(self, spec: IndexSpec) -> None:
        self.spec = spec
        self._slot = {rule.group_id: i for i, rule in enumerate(spec.groups)}
        self._keys: dict[str, list[set[int]]] = {}

    @property
    def replicas(self) -> list[str]:
        return list(self._keys)

    def apply(self, replica: str, events: Iterable[CacheEvent]) -> None:
        """Fold a replica's drained events in, oldest first."""
        sets = self._keys.setdefault(replica, [set() for _ in self.spec.groups])
        slot = self._slot
        for e in events:
            if e.kind == STORED:
                sets[slot[e.group_id]].add(e.key)
            elif e.kind == REMOVED:
                sets[slot[e.group_id]].discard(e.key)
            elif e.kind == CLEARED:
                for keys in sets:
                    keys.clear()

    def forget(self, replica: str) -> None:
        """Drop everything known about a replica (it died or left)."""
        self._keys.pop(replica, None)

    def num_keys(self, replica: str) -> int:
        return sum(len(keys) for keys in self._keys.get(replica, ()))

    def prefix_keys(
        self, prompt_token_ids: Sequence[int], extra_keys: Sequence[Hashable] = ()
    ) -> PrefixKeys:
        """The prompt's keys, computed lazily (share them between replicas: `hit_tokens`)."""
        return PrefixKeys(prompt_token_ids, self.spec.hash_block_tokens, tuple(extra_keys), [])

    def hit_tokens(
        self,
        replica: str,
        prompt_token_ids: Sequence[int],
        extra_keys: Sequence[Hashable] = (),
        key_at: PrefixKeys | None = None,
    ) -> int:
        """Prompt tokens `replica` would serve from its cache (CacheManager.lookup's rules)."""
        sets = self._keys.get(replica)
        gran = self.spec.hit_tokens
        limit = (len(prompt_token_ids) - 1) // gran * gran
        if sets is None or limit <= 0:
            return 0
        if key_at is None:
            key_at = self.prefix_keys(prompt_token_ids, extra_keys)
        rules = self.spec.groups
        for rule, keys in zip(rules, sets, strict=True):
            if rule.role == FULL:  # serving L implies serving less: one scan each
                limit = _cached_run(keys, key_at, rule.unit_tokens, limit) // gran * gran
        others = [(r, k) for r, k in zip(rules, sets, strict=True) if r.role != FULL]
        for length in range(limit, 0, -gran):
            if all(_serves(rule, keys, key_at, length) for rule, keys in others):
                return length
        return 0

    def hits(
        self,
        prompt_token_ids: Sequence[int],
        replicas: Iterable[str],
        extra_keys: Sequence[Hashable] = (),
    ) -> dict[str, int]:
        """`hit_tokens` of every replica, hashing the prompt once."""
        key_at = self.prefix_keys(prompt_token_ids, extra_keys)
        return {r: self.hit_tokens(r, prompt_token_ids, key_at=key_at) for r in replicas}


def _cached_run(keys: set[int], key_at: PrefixKeys, unit_tokens: int, limit: int) -> int:
    """Tokens of the longest run of cached units from position 0, at most `limit`."""
    n = 0
    for key in key_at.unit_keys(unit_tokens, 0, limit // unit_tokens):
        if key not in keys:
            break
        n += 1
    return n * unit_tokens


def _serves(rule: GroupRule, keys: set[int], key_at: PrefixKeys, length: int) -> bool:
    if rule.role == STATE:
        return key_at(length) in keys
    t = rule.unit_tokens  # SLIDING: the units a query at `length` still sees
    first = max(0, length - (rule.window or 0) + 1) // t if rule.window else 0
    n = length // t
    unit_keys = key_at.unit_keys(t, first, n)
    return len(unit_keys) == n - first and all(k in keys for k in unit_keys)


# ---------------------------------------------------------------------------------------------
# The router
# ---------------------------------------------------------------------------------------------


class Router:
    """Picks a replica per request. `index` (or `spec`, to build one) is needed by
    "prefix_aware"; feed it with `apply(replica, events)`."""

    def __init__(
        self,
        policy: str,
        replicas: Sequence[str],
        *,
        index: PrefixIndex | None = None,
        spec: IndexSpec | None = None,
        max_queue_excess: int = 8,
        min_free_fraction: float = 0.05,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown routing policy {policy!r}; valid: {', '.join(POLICIES)}")
        if index is None and spec is not None:
            index = PrefixIndex(spec)
        if policy == "prefix_aware" and index is None:
            raise ValueError("policy 'prefix_aware' needs index=PrefixIndex(...) or spec=")
        if not replicas:
            raise ValueError("a router needs at least one replica")
        self.policy = policy
        self.replicas = list(replicas)
        self.index = index
        self.max_queue_excess = max_queue_excess
        self.min_free_fraction = min_free_fraction
        self._turn = itertools.count()

    # -- membership --------------------------------------------------------------------------

    def add_replica(self, replica: str) -> None:
        if replica not in self.replicas:
            self.replicas.append(replica)

    def remove_replica(self, replica: str) -> None:
        """A replica died or left: no request goes there and its index entry is dropped."""
        if replica in self.replicas:
            self.replicas.remove(replica)
        if self.index is not None:
            self.index.forget(replica)

    def apply(self, replica: str, events: Iterable[CacheEvent]) -> None:
        if self.index is not None:
            self.index.apply(replica, events)

    # -- choice ------------------------------------------------------------------------------

    def choose(
        self,
        prompt_token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        extra_keys: Sequence[Hashable] = (),
    ) -> str:
        """The replica for a request (a replica missing from `loads` counts as idle)."""
        if not self.replicas:
            raise RuntimeError("no replica to route to")
        if self.policy == "round_robin":
            return self.replicas[next(self._turn) % len(self.replicas)]
        if self.policy == "least_loaded":
            return self._least_loaded(self.replicas, loads)
        return self._prefix_aware(prompt_token_ids, loads, extra_keys)

    def _least_loaded(self, candidates: Sequence[str], loads: Mapping[str, ReplicaLoad]) -> str:
        """Fewest running + waiting, then most free pages; remaining ties rotate."""
        turn = next(self._turn)
        n = len(candidates)

        def key(item: tuple[int, str]) -> tuple[int, int, int]:
            i, r = item
            load = loads.get(r, IDLE)
            return load.queue, -load.free_pages, (i - turn) % n

        return min(enumerate(candidates), key=key)[1]

    def overloaded(self, replica: str, loads: Mapping[str, ReplicaLoad], least_queue: int) -> bool:
        load = loads.get(replica, IDLE)
        if load.queue > least_queue + self.max_queue_excess:
            return True
        return load.total_pages > 0 and load.free_pages < self.min_free_fraction * load.total_pages

    def _prefix_aware(
        self,
        prompt_token_ids: Sequence[int],
        loads: Mapping[str, ReplicaLoad],
        extra_keys: Sequence[Hashable],
    ) -> str:
        assert self.index is not None
        least = min(loads.get(r, IDLE).queue for r in self.replicas)
        ok = [r for r in self.replicas if not self.overloaded(r, loads, least)]
        candidates = ok or self.replicas
        hits = self.index.hits(prompt_token_ids, candidates, extra_keys)
        best = max(hits.values())
        holders = [r for r in candidates if hits[r] == best]
        return self._least_loaded(holders, loads)


IDLE = ReplicaLoad()
