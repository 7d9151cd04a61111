import pytest
import torch

from hybridkv.config import CacheConfig
from hybridkv.kv.plan import make_plan
from hybridkv.kv.specs import AttentionSpec, CacheLayer, MLASpec, kda_state, mamba2_state
from hybridkv.worker.buffers import CacheBuffers


def tiny_layers():
    m2 = mamba2_state(2, 4, 8, 1, 4, "bfloat16", "float32")
    attn = AttentionSpec(2, 4, "float32")
    kda = kda_state(2, 4, 3, "float16", "float32")
    return [
        CacheLayer("layers.0.mamba", 0, m2),
        CacheLayer("layers.1.attention", 1, attn),
        CacheLayer("layers.2.mamba", 2, m2),
        CacheLayer("layers.3.attention", 3, AttentionSpec(2, 4, "float32", sliding_window=8)),
        CacheLayer("layers.4.kda", 4, kda),
        CacheLayer("layers.5.mla", 5, MLASpec(12, 4, "float32")),
        CacheLayer("layers.6.mamba", 6, m2),
    ]


@pytest.fixture
def buffers():
    plan = make_plan(tiny_layers(), CacheConfig(num_pages=9, kernel_block_size=4))
    return CacheBuffers(plan)


def test_views_shapes(buffers):
    plan = buffers.plan
    g_attn = next(g for g in plan.groups if g.kind == "attention")
    v = buffers.views["layers.1.attention"]
    assert tuple(v.shape) == (plan.num_pages * g_attn.blocks_per_page, 2, 4, 2, 4)
    assert tuple(buffers.views["layers.5.mla"].shape)[1:] == (4, 16)
    s = buffers.views["layers.0.mamba"]
    assert tuple(s["ssm"].shape) == (plan.num_pages, 2, 4, 8)
    assert tuple(s["conv"].shape) == (plan.num_pages, 2 * 4 + 2 * 8, 3)
    assert s["ssm"].dtype == torch.float32 and s["conv"].dtype == torch.bfloat16


def _page_bytes_of_view(buffers, name, page, blocks_per_page):
    """Write zeros through a layer's view of one page into buffers full of 0xAB; return the byte
    offsets the write touched (every byte of a written 0.0 is zero)."""
    view = buffers.views[name]
    for buf in buffers.buffers:
        buf.fill_(0xAB)
    if isinstance(view, dict):
        for t in view.values():
            t[page] = 0
    else:
        view[page * blocks_per_page : (page + 1) * blocks_per_page] = 0
    touched = []
    for i, buf in enumerate(buffers.buffers):
        idx = torch.nonzero(buf == 0).flatten().tolist()
        touched += [(i, j) for j in idx]
    return touched


def test_each_page_is_one_contiguous_byte_range(buffers):
    plan = buffers.plan
    for g in plan.groups:
        for slot, name in enumerate(g.layer_names):
            for page in (1, 4, plan.num_pages - 1):
                touched = _page_bytes_of_view(buffers, name, page, g.blocks_per_page)
                assert {b for b, _ in touched} == {slot}
                offsets = [o for _, o in touched]
                lo, hi = page * plan.page_bytes, (page + 1) * plan.page_bytes
                assert min(offsets) >= lo and max(offsets) < hi
                if not g.is_state:  # attention fills its whole page, no gap
                    assert len(offsets) == plan.page_bytes
                else:  # state bytes packed from the page start, padding at the end
                    assert max(offsets) - lo < g.spec.state_bytes
                    assert len(offsets) == g.spec.state_bytes


def test_distinct_values_round_trip_and_groups_never_overlap(buffers):
    plan = buffers.plan
    # give each group its own pages, write a value per (layer, page) through every view
    pages_of_group = {g.group_id: [1 + g.group_id] for g in plan.groups}
    value = {}
    for g in plan.groups:
        for name in g.layer_names:
            view = buffers.views[name]
            for p in pages_of_group[g.group_id]:
                v = float(len(value) + 1)
                value[(name, p)] = v
                if isinstance(view, dict):
                    for t in view.values():
                        t[p] = v
                else:
                    r = g.blocks_per_page
                    view[p * r : (p + 1) * r] = v
    for (name, p), v in value.items():
        g = plan.groups[buffers.group_of_layer[name]]
        view = buffers.views[name]
        if isinstance(view, dict):
            assert all(bool((t[p].float() == v).all()) for t in view.values()), name
        else:
            r = g.blocks_per_page
            assert bool((view[p * r : (p + 1) * r] == v).all()), name


def test_zero_pages_only_touches_those_pages(buffers):
    plan = buffers.plan
    g = next(g for g in plan.groups if g.kind == "attention")
    for buf in buffers.buffers:
        buf.fill_(0xFF)  # NaN bit patterns, as a page that held a state might contain
    view = buffers.views[g.layer_names[0]]
    assert torch.isnan(view).all()
    buffers.zero_pages(g.group_id, [2, 5])
    r = g.blocks_per_page
    assert bool((view[2 * r : 3 * r] == 0).all()) and bool((view[5 * r : 6 * r] == 0).all())
    assert torch.isnan(view[3 * r : 4 * r]).all()


def test_zero_pages_goes_through_the_given_function(buffers):
    """The runner passes its attention backend's zero_pages (Triton's on GPUs)."""
    plan = buffers.plan
    g = next(g for g in plan.groups if g.kind == "attention")
    calls = []

    def zero(buffer_2d, page_ids):
        calls.append((buffer_2d.data_ptr(), tuple(buffer_2d.shape), buffer_2d.dtype,
                      page_ids.tolist()))  # fmt: skip

    buffers.zero_pages(g.group_id, [3])
    buffers.zero_pages(g.group_id, [], zero)  # nothing to zero: no call
    buffers.zero_pages(g.group_id, [1, 4], zero)
    expected = [
        (buf.data_ptr(), (plan.num_pages, plan.page_bytes), torch.uint8, [1, 4])
        for buf in buffers.buffers[: len(g.layer_names)]
    ]
    assert calls == expected


def test_fp8_kv_view():
    layers = [CacheLayer("layers.0.attention", 0, AttentionSpec(1, 8, "fp8_e4m3"))]
    plan = make_plan(layers, CacheConfig(num_pages=4, page_tokens=16, kernel_block_size=8))
    view = CacheBuffers(plan).views["layers.0.attention"]
    assert view.dtype == torch.float8_e4m3fn and tuple(view.shape) == (8, 2, 8, 1, 8)


def test_a_new_pool_is_zero_and_costs_memory_only_where_touched():
    """The CPU pool is an anonymous mapping: every byte reads 0 and writes stick, and resident
    memory grows by the pages written, not by the pool's size (torch.zeros committed it all)."""
    from pathlib import Path

    from hybridkv.worker.buffers import zeroed_bytes
    from tests.memory import rss_bytes

    if not Path("/proc/self/status").is_file():
        pytest.skip("reads /proc")
    size = 256 * 2**20
    before = rss_bytes()
    pool = zeroed_bytes(size, torch.device("cpu"))
    pool[: 2**20] = 7  # one MiB written
    pool[-1] = 9
    grown = rss_bytes() - before
    assert grown < 32 * 2**20, f"the pool made {grown} bytes resident"
    assert pool.dtype == torch.uint8 and pool.numel() == size
    assert int(pool[2**20 : 4 * 2**20].count_nonzero()) == 0
    assert int(pool[:8].sum()) == 56 and int(pool[-1]) == 9
    assert zeroed_bytes(0, torch.device("cpu")).numel() == 0
