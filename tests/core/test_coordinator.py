import pytest

from hybridkv.config import CacheConfig
from hybridkv.core.coordinator import CacheManager
from hybridkv.kv.presets import load_preset
from hybridkv.models.registry import plan_for_config

from .helpers import ATTN, STATE, decode, manager, prefill, request


def snapshot(cm):
    return (cm.usage(), [dict(m.units.ref) for m in cm.groups], cm.pool.num_evictions)


def test_exhaustion_returns_none_and_frees_nothing():
    cm = manager(num_pages=8)  # 7 usable pages
    a = request("a", range(60))
    prefill(cm, a)
    before = snapshot(cm)
    big = request("big", range(1000, 1200))
    assert cm.allocate(big, 200, cm.lookup(big)) is None
    assert snapshot(cm) == before
    assert cm.allocate(a, 1000) is None  # growing a running request fails the same way
    assert snapshot(cm) == before
    cm.check_integrity()


def test_admission_is_atomic_across_groups():
    cm = manager(specs=[STATE, ATTN, STATE, STATE], num_pages=6, enable_prefix_caching=False)
    r1 = request("r1", range(8))
    prefill(cm, r1)  # 3 state pages + 1 attention page
    r2 = request("r2", range(100, 108))
    assert cm.allocate(r2, 8) is None  # needs 3 state pages, only 1 left
    assert cm.usage()["in_use"] == 4
    cm.check_integrity()


def test_free_releases_everything_and_cache_survives():
    cm = manager()
    a = request("a", range(50))
    prefill(cm, a)
    decode(cm, a, 5)
    cm.free(a)
    u = cm.usage()
    assert u["in_use"] == 0 and u["free"] + u["cached"] == u["total"]
    cm.check_integrity()


def test_no_caching_means_no_hits_and_nothing_cached():
    cm = manager(enable_prefix_caching=False)
    a = request("a", range(50))
    prefill(cm, a)
    cm.free(a)
    assert cm.usage()["cached"] == 0
    assert cm.lookup(request("b", range(60))).num_tokens == 0


def test_hit_is_never_longer_than_every_group_serves():
    cm = manager()
    prefill(cm, request("a", range(40)))  # attention: 40 tokens, state: snapshot at 40
    b = request("b", range(41))
    hit = cm.lookup(b)
    assert hit.num_tokens == 40
    # drop the attention units of block 5 only: the hit must shrink to 20
    attn = next(m for m in cm.groups if m.group.kind == "attention")
    key = cm._lookup_hashes["b"][5]
    unit = attn.units.lookup(key)
    attn.units.uncache(unit)
    assert cm.lookup(b).num_tokens <= 20
    cm.check_integrity()


def test_extra_keys_separate_caches():
    cm = manager()
    a = request("a", range(30))
    prefill(cm, a)
    b = request("b", range(31))
    b.extra_keys = ("adapter-1",)
    assert cm.lookup(b).num_tokens == 0
    assert cm.lookup(request("c", range(31))).num_tokens == 28


def test_stats_count_admissions():
    cm = manager()
    prefill(cm, request("a", range(30)))
    prefill(cm, request("b", range(33)))
    assert cm.stats.queries == 2 and cm.stats.hits == 1
    assert cm.stats.hit_tokens == 28 and cm.stats.query_tokens == 63


@pytest.mark.parametrize("mode", ["block", "page"])
def test_granite_480_token_shared_prefix(mode):
    """The reference never hits a 480-token prefix with 528-token pages; block mode does."""
    cfg = CacheConfig(
        platform="cuda", attention_backend="flashinfer", num_pages=300, allocation=mode
    )
    cm = CacheManager(plan_for_config(load_preset("ibm-granite/granite-4.0-h-small"), cfg), cfg)
    system = list(range(480))
    hits = []
    for i in range(3):
        r = request(f"c{i}", system + [10_000 + 100 * i + j for j in range(40)])
        hits.append(prefill(cm, r, chunk=256))
        decode(cm, r, 20)
        cm.free(r)
        cm.check_integrity()
    if mode == "block":
        assert hits == [0, 0, 480]  # the 2nd request's branch point makes the 3rd hit
    else:
        assert hits == [0, 0, 0]
