"""Cache events replayed into a `PrefixIndex` predict `CacheManager.lookup` exactly."""

from __future__ import annotations

import pickle
import random

import pytest

from hybridkv.core.events import CLEARED, REMOVED, STORED
from hybridkv.kv.specs import AttentionSpec
from hybridkv.serving.router import IndexSpec, PrefixIndex

from .helpers import ATTN, STATE, decode, manager, prefill, request

SLIDING = AttentionSpec(1, 4, "float32", sliding_window=6)
LAYOUTS = {
    "hybrid": [STATE, ATTN, STATE],
    "sliding": [STATE, ATTN, SLIDING],
    "attention_only": [ATTN, SLIDING],
}
PAGES = {"hybrid": 14, "sliding": 14, "attention_only": 24}  # small enough to evict


def check_prompts(cm, index, prompts, salt=()) -> int:
    """Asserts the index's hit equals lookup's for every prompt; returns how many hit."""
    index.apply("r", cm.drain_events())
    hits = 0
    for i, prompt in enumerate(prompts):
        probe = request(f"probe{i}", prompt)
        probe.extra_keys = salt
        expected = cm.lookup(probe).num_tokens
        cm.free(probe)  # forgets the lookup's hashes
        assert index.hit_tokens("r", prompt, salt) == expected, (i, len(prompt))
        hits += expected > 0
    return hits


@pytest.mark.parametrize("allocation", ["block", "page"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_index_follows_lookup_through_evictions(layout, allocation):
    rng = random.Random(7)
    cm = manager(LAYOUTS[layout], num_pages=PAGES[layout], allocation=allocation)
    cm.enable_events(max_pending=50)  # small: overflows and resynchronises on the way
    index = PrefixIndex(IndexSpec.from_plan(cm.plan))
    histories = [[rng.randrange(100) for _ in range(rng.randint(5, 30))] for _ in range(3)]
    hits = 0
    for step in range(24):
        c = rng.randrange(len(histories))
        prompt = histories[c] + [rng.randrange(100) for _ in range(rng.randint(1, 12))]
        partial = prompt[: rng.randint(1, len(prompt))] + [999, 998, 997, 996, 995]
        hits += check_prompts(cm, index, [prompt, partial, prompt[:-3], histories[(c + 1) % 3]])
        req = request(f"r{step}", prompt)
        prefill(cm, req)
        decode(cm, req, rng.randint(1, 9), next_token=rng.randrange(100))
        histories[c] = list(req.all_token_ids) if len(req.all_token_ids) < 120 else partial
        cm.free(req)
        cm.check_integrity()
    assert cm.pool.num_evictions > 0 and hits > 10
    check_prompts(cm, index, histories)


def test_events_carry_keys_lengths_and_kinds():
    cm = manager([STATE, ATTN], num_pages=4)  # 3 usable pages of 32 tokens
    assert cm.drain_events() == []  # off until enabled
    cm.enable_events()
    assert [e.kind for e in cm.drain_events()] == [CLEARED]
    tokens = list(range(20))
    req = request("a", tokens)
    prefill(cm, req)
    cm.free(req)
    events = cm.drain_events()
    assert events and all(e.kind == STORED for e in events)
    attention = sorted(e.num_tokens for e in events if not e.snapshot)
    assert attention == [4, 8, 12, 16, 20]
    assert all(e.group_id == 1 for e in events if not e.snapshot)
    snapshots = [e for e in events if e.snapshot]
    assert [e.group_id for e in snapshots] == [0] and snapshots[0].num_tokens == 20
    assert pickle.loads(pickle.dumps(events)) == events
    other = request("b", [50 + t for t in range(24)])  # needs the pages: evicts
    prefill(cm, other)
    assert any(e.kind == REMOVED for e in cm.drain_events())


def test_salted_prompts_hit_only_with_their_salt():
    cm = manager(num_pages=30)
    cm.enable_events()
    index = PrefixIndex(IndexSpec.from_plan(cm.plan))
    req = request("a", list(range(30)))
    req.extra_keys = ("tenant-1",)
    prefill(cm, req)
    cm.free(req)
    index.apply("r", cm.drain_events())
    prompt = list(range(30)) + [1]
    assert index.hit_tokens("r", prompt) == 0
    assert index.hit_tokens("r", prompt, ("tenant-1",)) > 0
    check_prompts(cm, index, [prompt], ("tenant-1",))
