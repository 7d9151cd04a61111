import pytest

from hybridkv.core.page_pool import NULL_PAGE, PagePool
from hybridkv.core.units import UnitAllocator


def test_take_free_then_lru_evictable():
    pool = PagePool(4)
    a = UnitAllocator(pool, 0, 1)
    units = [a.alloc() for _ in range(3)]
    assert sorted(units) == [1, 2, 3] and NULL_PAGE not in units
    assert a.alloc() is None
    for u, key in zip(units, "xyz", strict=True):
        a.set_key(u, key)
    a.decref(units[1])  # y becomes evictable first
    a.decref(units[0])
    assert pool.num_evictable == 2 and pool.num_free == 0
    new = a.alloc()
    assert new == units[1] and a.lookup("y") is None and a.lookup("x") == units[0]
    pool.check()
    a.check()


def test_page_returns_to_pool_when_empty_and_slab_prefers_hint():
    pool = PagePool(5)
    a = UnitAllocator(pool, 3, 4)
    first = a.alloc()
    page = first // 4
    second = a.alloc(hint_page=page)
    assert second == first + 1
    other = UnitAllocator(pool, 4, 4)
    o = other.alloc()
    assert o // 4 != page
    a.decref(first)
    a.decref(second)
    assert pool.owner[page] is None and pool.num_free == 3
    a.check()
    other.check()
    pool.check()


def test_cached_unit_keeps_page_and_hit_makes_it_in_use():
    pool = PagePool(3)
    a = UnitAllocator(pool, 0, 2)
    u = a.alloc()
    assert a.set_key(u, "k")
    assert not a.set_key(a.alloc(hint_page=u // 2), "k")  # duplicate key refused
    a.decref(u)
    a.decref(u + 1)  # uncached unit frees; page keeps the cached one
    assert pool.is_evictable(u // 2)
    a.incref(a.lookup("k"))
    assert not pool.is_evictable(u // 2)
    a.check()


def test_uncache_frees_cached_only_unit():
    pool = PagePool(3)
    a = UnitAllocator(pool, 0, 1)
    u = a.alloc()
    a.set_key(u, "k")
    a.decref(u)
    a.uncache(u)
    assert a.lookup("k") is None and pool.num_free == 2
    a.check()


def test_pool_needs_a_usable_page():
    with pytest.raises(ValueError, match="at least 2 pages"):
        PagePool(1)
