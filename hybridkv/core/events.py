"""Cache events: what enters and leaves one engine's prefix cache, for a router elsewhere.

Off unless `CacheManager.enable_events()` was called: every `UnitAllocator` then appends to one
shared `EventLog`, which `CacheManager.drain_events()` empties. An event is plain values
(picklable, no live objects):

    stored    a unit (attention: kernel block in block mode, page in page mode) or a state
              snapshot became hit-able: its key entered the group's prefix cache
    removed   it left the cache (its page was evicted, a stranded unit was reclaimed, a
              rolling snapshot was superseded)
    cleared   forget everything known about this replica's cache: the events that follow
              describe all of its cached content (sent after `enable_events` and after the
              log overflowed, so a router never works from a partial picture)

`key` is the chained prefix hash (`hashing.py`) of the prefix the unit or snapshot ends;
`num_tokens` the length of that prefix (0 for content cached before events were enabled: its
length is not recorded). Sliding-window groups report every unit they cache, like full
attention; which of them a hit of L tokens needs (those inside the window at L) is the reader's
rule, the same one `CacheManager.lookup` applies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class CacheEvent:
    kind: str  # STORED, REMOVED or CLEARED
    group_id: int = -1  # -1 for CLEARED
    key: int = 0  # the prefix key the unit or snapshot is cached under
    num_tokens: int = 0  # tokens of the prefix it ends (0: unknown)
    snapshot: bool = False  # a state snapshot (else an attention unit)


CLEAR = CacheEvent(CLEARED)


class EventLog:
    """Events appended by the groups' allocators, bounded: past `max_pending` undrained events
    it drops them all and remembers that it overflowed (the next drain resynchronises)."""

    __slots__ = ("events", "max_pending", "overflowed")

    def __init__(self, max_pending: int) -> None:
        self.events: list[CacheEvent] = []
        self.max_pending = max_pending
        self.overflowed = False

    def add(self, kind: str, group_id: int, key: Any, tokens: int, snapshot: bool) -> None:
        if self.overflowed:
            return
        if len(self.events) >= self.max_pending:
            self.events = []
            self.overflowed = True
            return
        self.events.append(CacheEvent(kind, group_id, key, tokens, snapshot))

    def drain(self) -> list[CacheEvent]:
        out, self.events = self.events, []
        return out
