"""Per-manager behaviour, driven through the coordinator with tiny specs."""

import pytest

from hybridkv.core import managers
from hybridkv.core.managers import NULL_UNIT, FullAttentionManager, StateManager
from hybridkv.kv.plan import pages_to_kernel_blocks
from hybridkv.kv.specs import AttentionSpec, StateSpec, StateTensor

from .helpers import ATTN, decode, manager, prefill, request

SLIDING = AttentionSpec(1, 4, "float32", sliding_window=8)


def attn_group(cm):
    return next(i for i, m in enumerate(cm.groups) if isinstance(m, FullAttentionManager))


def test_page_mode_rows_are_expanded_pages():
    cm = manager(allocation="page")  # page 32 tokens, kernel block 4 -> 8 blocks per page
    req = request("a", range(70))
    prefill(cm, req)
    g = attn_group(cm)
    row = cm.table_row(req, g)
    pages = row[::8]
    assert len(row) == 24 and row == pages_to_kernel_blocks([p // 8 for p in pages], 8)
    cm.check_integrity()


def test_block_mode_holds_only_needed_kernel_blocks_contiguously():
    cm = manager()
    req = request("a", range(10))
    prefill(cm, req)
    row = cm.table_row(req, attn_group(cm))
    assert len(row) == 3  # ceil(10 / 4)
    assert row == list(range(row[0], row[0] + 3))  # one page, consecutive kernel blocks
    cm.check_integrity()


def test_short_requests_share_one_page_in_block_mode():
    cm = manager(specs=[ATTN], num_pages=10, page_tokens=32)
    reqs = [request(f"r{i}", [i] * 5) for i in range(4)]
    for r in reqs:
        prefill(cm, r)
    pages = {b // 8 for r in reqs for b in cm.table_row(r, 0)}
    assert len(pages) == 1  # 4 requests x 2 kernel blocks in one 8-block page
    page_mode = manager(specs=[ATTN], num_pages=10, page_tokens=32, allocation="page")
    for r in [request(f"r{i}", [i] * 5) for i in range(4)]:
        prefill(page_mode, r)
    assert page_mode.usage()["in_use"] == 4


def test_sliding_window_drops_blocks_that_leave_the_window():
    cm = manager(specs=[SLIDING], num_pages=10, enable_prefix_caching=False)
    req = request("a", range(8))
    prefill(cm, req)
    m, gr = cm.groups[0], cm._reqs["a"].groups[0]
    assert len(m.references(gr)) == 2
    decode(cm, req, 20)  # 28 computed; queries at >= 27 read keys >= 20: units 5, 6, 7
    live = m.references(gr)
    assert 2 <= len(live) <= 3 and gr.units[:4] == [NULL_UNIT] * 4
    cm.check_integrity()
    cm.free(req)
    assert cm.usage()["in_use"] == 0


def test_sliding_hit_needs_only_window_blocks():
    cm = manager(specs=[SLIDING], num_pages=10)
    a = request("a", range(30))
    prefill(cm, a)
    cm.free(a)
    b = request("b", list(range(30)) + [99, 98])
    hit = cm.lookup(b)
    assert hit.num_tokens == 28
    # the oldest blocks can be gone: evict everything outside the last window
    prefill(cm, b)
    gr = cm._reqs["b"].groups[0]
    assert gr.units[0] == NULL_UNIT
    cm.check_integrity()


def _cached_units_by_position(cm, rid: str, group: int) -> list[int]:
    """The units a request holds in `group`, in token order (NULL_UNIT where dropped)."""
    return list(cm._reqs[rid].groups[group].units)


@pytest.mark.parametrize("allocation", ["block", "page"])
def test_sliding_hit_survives_eviction_of_everything_outside_the_window(allocation):
    # window 8, kernel block 4: a hit of 28 tokens has its first query at 28, which reads keys
    # 21..28; only the units of tokens 20..23 and 24..27 (units 5 and 6) must still be cached
    cm = manager(specs=[SLIDING], num_pages=10, allocation=allocation, page_tokens=4)
    a = request("a", range(30))
    prefill(cm, a)
    units = _cached_units_by_position(cm, "a", 0)
    cm.free(a)
    m = cm.groups[0]
    for unit in units[:5]:  # tokens 0..19: outside the window of any query at >= 28
        if unit != NULL_UNIT:
            m.units.uncache(unit)
    b = request("b", list(range(30)) + [99, 98])
    assert cm.lookup(b).num_tokens == 28
    assert prefill(cm, b) == 28
    row = _cached_units_by_position(cm, "b", 0)
    assert row[:5] == [NULL_UNIT] * 5 and row[5:7] == units[5:7]
    cm.check_integrity()
    cm.free(b)
    # an in-window unit gone: no length whose window is fully cached remains
    m.units.uncache(units[5])
    assert cm.lookup(request("c", list(range(30)) + [1])).num_tokens == 0
    cm.check_integrity()


def test_sliding_and_full_attention_hit_keeps_full_context_and_window_only():
    # gpt-oss shape: a sliding layer and a full layer; the full group needs every unit of the
    # hit, the sliding group only those of the window
    full = AttentionSpec(1, 4, "float32")
    cm = manager(specs=[SLIDING, full], num_pages=40, page_tokens=4)
    sliding_g = next(i for i, m in enumerate(cm.groups) if m.group.window is not None)
    a = request("a", range(41))
    prefill(cm, a)
    sliding_units = _cached_units_by_position(cm, "a", sliding_g)
    cm.free(a)
    for unit in sliding_units[:7]:  # tokens 0..27; a hit of 40 reads keys 33..40
        if unit != NULL_UNIT:
            cm.groups[sliding_g].units.uncache(unit)
    b = request("b", list(range(41)) + [5, 6])
    assert prefill(cm, b) == 40
    full_row = _cached_units_by_position(cm, "b", 1 - sliding_g)
    assert len(full_row) >= 10 and NULL_UNIT not in full_row[:10]
    cm.check_integrity()


def test_state_running_page_snapshot_at_prompt_end_and_exact_length_only():
    cm = manager()
    a = request("a", range(30))  # hit granularity 4: prompt-end snapshot at 28
    prefill(cm, a)
    cm.free(a)
    st = [m for m in cm.groups if isinstance(m, StateManager)]
    assert all(m.units.num_cached_units == 1 for m in st)
    # a prompt sharing 26 tokens: attention serves 24, no snapshot at 24 -> no hit
    b = request("b", list(range(26)) + [500] * 10)
    hit = cm.lookup(b)
    assert (hit.num_tokens, hit.attention_tokens) == (0, 24)
    # sharing all 30: the snapshot at exactly 28 serves
    c = request("c", list(range(30)) + [1, 2, 3])
    assert cm.lookup(c).num_tokens == 28
    cm.check_integrity()


def test_branch_point_snapshot_makes_the_next_request_hit():
    cm = manager()
    prefill(cm, request("a", list(range(24)) + [100] * 9))
    b = request("b", list(range(24)) + [200] * 9)
    assert prefill(cm, b) == 0  # attention has 24 tokens, state has none: branch at 24
    c = request("c", list(range(24)) + [300] * 9)
    assert cm.lookup(c).num_tokens == 24
    cm.check_integrity()


def test_rolling_tail_snapshot_keeps_one_per_request():
    cm = manager(snapshot_tail_interval_tokens=8)
    a = request("a", range(10))
    prefill(cm, a)
    decode(cm, a, 23)  # passes tail boundaries 16, 24, 32
    st = next(m for m in cm.groups if isinstance(m, StateManager))
    assert st.units.num_cached_units == 2  # prompt end (8) + the latest tail (32)
    cm.free(a)
    follow = request("f", list(a.all_token_ids) + [5, 6, 7])
    assert cm.lookup(follow).num_tokens == 32
    cm.check_integrity()


def test_copy_in_source_is_pinned_until_commit():
    cm = manager()
    prefill(cm, request("a", range(20)))
    b = request("b", list(range(20)) + [1])
    hit = cm.lookup(b)
    alloc = cm.allocate(b, 21 - hit.num_tokens, hit)
    assert alloc.copies_in and all(src != dst for _, src, dst in alloc.copies_in)
    st_gid, src, _ = alloc.copies_in[0]
    assert cm.groups[st_gid].units.ref[src] == 1
    cm.commit(b, 21)
    assert cm.groups[st_gid].units.ref[src] == 0
    cm.check_integrity()


def test_tail_snapshot_at_the_last_boundary_max_tokens_allows():
    cm = manager()  # tail interval 64 tokens: only the final boundary (32) is reached
    a = request("a", range(10))
    a.max_computed_tokens = 10 + 23 - 1
    prefill(cm, a)
    decode(cm, a, 23)
    cm.free(a)
    assert cm.lookup(request("f", list(a.all_token_ids) + [5])).num_tokens == 32
    b = request("b", range(100, 110))  # no max_tokens known and no grid point reached: no tail
    prefill(cm, b)
    decode(cm, b, 23)
    cm.free(b)
    assert cm.lookup(request("g", list(b.all_token_ids) + [5])).num_tokens == 8


def test_a_new_state_kind_is_one_map_entry(monkeypatch):
    """A layer kind the core has never seen runs once MANAGERS maps it to a manager: the
    coordinator drives it through the GroupManager protocol like any other group."""

    toy = StateSpec("toy_state", (StateTensor("h", (2, 4), "float32"),))
    with pytest.raises(ValueError, match="no cache manager for layer kind 'toy_state'; known: "):
        manager([toy, ATTN, toy])
    monkeypatch.setitem(managers.MANAGERS, "toy_state", managers.StateManager)
    cm = manager([toy, ATTN, toy])
    a = request("a", range(40))
    prefill(cm, a)
    decode(cm, a, 5)
    cm.free(a)
    b = request("b", list(range(40)) + [1, 2])
    assert prefill(cm, b) == 40  # the snapshot of both toy groups and the attention blocks
    cm.check_integrity()


def test_step_allocation_carries_running_pages_and_copies_as_plain_ids():
    """What the runner needs comes inside the allocation: no call back into the manager."""
    cm = manager()
    a = request("a", range(24))
    hit = cm.lookup(a)
    alloc = cm.allocate(a, 24, hit)
    state_gids = [i for i, m in enumerate(cm.groups) if not m.caches_tokens]
    assert sorted(alloc.state_pages) == state_gids
    assert all(cm.table_row(a, g) == [alloc.state_pages[g]] for g in state_gids)
    assert all(isinstance(v, int) for v in alloc.state_pages.values())
    cm.commit(a, 24)
    again = cm.allocate(a, 1)
    assert again.state_pages == {} and again.copies_in == ()  # only at admission
