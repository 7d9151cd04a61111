"""Random admit / grow / snapshot / finish / preempt / evict sequences in both allocation modes.

Besides the integrity check after every step, a shadow model records which tokens each attention
unit and each state page holds, so every prefix hit is checked to deliver exactly the content it
claims (the unit of block i holds tokens [i*t, (i+1)*t) of this very prompt; a copied state is
the state after exactly the hit's tokens).
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hybridkv.config import CacheConfig
from hybridkv.core.coordinator import CacheManager, SimpleRequest
from hybridkv.core.managers import NULL_UNIT, FullAttentionManager, StateManager
from hybridkv.kv.plan import make_plan
from hybridkv.kv.specs import AttentionSpec, mamba2_state

from .helpers import layers_of

STATE = mamba2_state(2, 4, 8, 1, 4, "float32", "float32")
STATE_B = mamba2_state(1, 4, 8, 1, 4, "float32", "float32")
ATTN = AttentionSpec(1, 4, "float32")
ATTN_B = AttentionSpec(2, 2, "float32")
SLIDING = AttentionSpec(1, 4, "float32", sliding_window=6)

SPEC_SETS = {
    "basic": [STATE, ATTN],
    "2attn+3state": [ATTN, ATTN_B, STATE, STATE_B, STATE],
    "sliding": [ATTN, SLIDING, STATE, STATE_B],
    "dense": [ATTN],
}
KERNEL_BLOCKS = {32: [2, 4, 8, 16], 48: [3, 4, 6, 12, 16]}


class CacheMachine(RuleBasedStateMachine):
    @initialize(
        specs=st.sampled_from(sorted(SPEC_SETS)),
        mode=st.sampled_from(["block", "page"]),
        page_tokens=st.sampled_from([32, 48]),
        data=st.data(),
    )
    def setup(self, specs, mode, page_tokens, data):
        kbs = data.draw(st.sampled_from(KERNEL_BLOCKS[page_tokens]))
        cfg = CacheConfig(
            num_pages=data.draw(st.integers(6, 24)),
            page_tokens=page_tokens,
            kernel_block_size=kbs,
            allocation=mode,
            snapshot_interval_blocks=data.draw(st.sampled_from([None, 2])),
        )
        self.cm = CacheManager(make_plan(layers_of(SPEC_SETS[specs]), cfg), cfg)
        self.reqs: dict[str, SimpleRequest] = {}
        self.target: dict[str, int] = {}  # prompt tokens to compute before decoding
        self.hit: dict[str, object] = {}
        self.unit_shadow: dict[tuple[int, int], list] = {}
        self.state_shadow: dict[tuple[int, int], tuple] = {}
        self.next_id = 0

    # -- shadow model --------------------------------------------------------------------------

    def _units(self, rid: str, gid: int) -> list[int]:
        return self.cm._reqs[rid].groups[gid].units

    def _check_hit(self, req: SimpleRequest, length: int) -> None:
        for gid, m in enumerate(self.cm.groups):
            if isinstance(m, FullAttentionManager):
                t = m.unit_tokens
                for i, unit in enumerate(self._units(req.request_id, gid)[: length // t]):
                    if unit != NULL_UNIT:
                        want = req.all_token_ids[i * t : (i + 1) * t]
                        assert self.unit_shadow[(gid, unit)] == want, "hit unit content"

    def _apply(self, req: SimpleRequest, alloc, before: int, after: int) -> None:
        rid = req.request_id
        for gid, m in enumerate(self.cm.groups):
            if isinstance(m, FullAttentionManager):
                t = m.unit_tokens
                new_units = set(m.units.ref) - {u for (g, u) in self.unit_shadow if g == gid}
                for unit in new_units:
                    self.unit_shadow[(gid, unit)] = [None] * t
                units = self._units(rid, gid)
                for pos in range(before, after):
                    unit = units[pos // t]
                    if unit != NULL_UNIT:
                        shadow = self.unit_shadow.setdefault((gid, unit), [None] * t)
                        shadow[pos % t] = req.all_token_ids[pos]
        for gid, src, _dst in alloc.copies_in:
            assert self.state_shadow[(gid, src)] == tuple(req.all_token_ids[:before])
        for gid, m in enumerate(self.cm.groups):
            if isinstance(m, StateManager):
                (page,) = self.cm.table_row(req, gid)
                self.state_shadow[(gid, page)] = tuple(req.all_token_ids[:after])
        for gid, _src, dst in alloc.snapshots:
            self.state_shadow[(gid, dst)] = tuple(req.all_token_ids[:after])

    def _forget_freed_units(self) -> None:
        for gid, m in enumerate(self.cm.groups):
            if isinstance(m, FullAttentionManager):
                live = set(m.units.ref)
                for key in [k for k in self.unit_shadow if k[0] == gid and k[1] not in live]:
                    del self.unit_shadow[key]

    # -- rules ---------------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from([(), tuple(range(20)), tuple(range(40)), tuple(range(7))]),
        tail=st.lists(st.integers(0, 3), min_size=1, max_size=30),
    )
    def admit(self, prefix, tail):
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = SimpleRequest(rid, list(prefix) + tail, len(prefix) + len(tail))
        hit = self.cm.lookup(req)
        n = self._chunk(req, hit.num_tokens, hit)
        alloc = self.cm.allocate(req, n, hit)
        if alloc is None:
            assert not self.cm.is_admitted(req)
            return
        self._check_hit(req, hit.num_tokens)
        self._step_done(req, alloc, hit.num_tokens, hit.num_tokens + n)
        self.reqs[rid] = req
        self.target[rid] = len(req.all_token_ids)

    def _chunk(self, req, done, hit=None, limit=13):
        n = min(limit, len(req.all_token_ids) - done)
        boundary = self.cm.next_boundary(req, hit)
        if boundary is not None and done + n > boundary:
            n = boundary - done
        return max(n, 1)

    def _step_done(self, req, alloc, before, after):
        self._apply(req, alloc, before, after)
        self.cm.commit(req, after)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def grow(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        done = self.cm.num_computed(req)
        if done >= len(req.all_token_ids):
            req.all_token_ids.append(data.draw(st.integers(0, 3)))  # a sampled token
        n = self._chunk(req, done)
        alloc = self.cm.allocate(req, n)
        if alloc is None:
            self.preempt_one(rid)
            return
        self._step_done(req, alloc, done, done + n)

    def preempt_one(self, rid):
        self.cm.free(self.reqs.pop(rid))
        self._forget_freed_units()

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        self.preempt_one(data.draw(st.sampled_from(sorted(self.reqs))))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def preempt_and_resume(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        req = self.reqs[rid]
        self.preempt_one(rid)
        resumed = SimpleRequest(rid + "x", list(req.all_token_ids), req.num_prompt_tokens)
        hit = self.cm.lookup(resumed)
        n = self._chunk(resumed, hit.num_tokens, hit)
        alloc = self.cm.allocate(resumed, n, hit)
        if alloc is not None:
            self._check_hit(resumed, hit.num_tokens)
            self._step_done(resumed, alloc, hit.num_tokens, hit.num_tokens + n)
            self.reqs[resumed.request_id] = resumed

    @rule(size=st.integers(40, 200))
    def evict(self, size):
        """A large request that forces cached pages out, then leaves."""
        req = SimpleRequest(f"big{self.next_id}", [9] * size, size)
        self.next_id += 1
        alloc = self.cm.allocate(req, size)
        if alloc is not None:
            self.cm.free(req)
        self._forget_freed_units()

    @invariant()
    def integrity(self):
        if hasattr(self, "cm"):
            self.cm.check_integrity()

    def teardown(self):
        if hasattr(self, "cm"):
            for rid in list(self.reqs):
                self.preempt_one(rid)
            self.cm.check_integrity()
            assert self.cm.usage()["in_use"] == 0  # every page is free or cached


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(
    max_examples=int(os.environ.get("HYBRIDKV_STATEFUL_EXAMPLES", 150)),
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
