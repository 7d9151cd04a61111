"""The scheduler with the real cache manager and a fake model (tokens are counters)."""

from __future__ import annotations

from hybridkv.config import CacheConfig, SchedulerConfig
from hybridkv.core.coordinator import CacheManager
from hybridkv.core.request import Request
from hybridkv.core.scheduler import Scheduler
from hybridkv.kv.plan import make_plan
from hybridkv.kv.specs import AttentionSpec
from hybridkv.sampling_params import SamplingParams

from .helpers import ATTN, STATE, layers_of


def make(specs=None, num_pages=40, budget=64, max_num_seqs=8, **cache):
    cfg = CacheConfig(num_pages=num_pages, kernel_block_size=4, **cache)
    cm = CacheManager(make_plan(layers_of(specs or [STATE, ATTN]), cfg), cfg)
    return Scheduler(cm, SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget))


def drive(sched: Scheduler, max_steps: int = 10_000) -> list:
    """Run to completion with a fake model; returns every step's output."""
    steps = []
    while sched.has_unfinished and len(steps) < max_steps:
        out = sched.schedule()
        steps.append(out)
        sched.update(out, {c.request_id: 7 for c in out.chunks if c.samples})
        sched.cache.check_integrity()
    assert not sched.has_unfinished
    return steps


def req(rid: str, n: int, out: int = 5) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=out, ignore_eos=True))


def test_budget_decodes_first_and_chunks():
    sched = make(budget=10)
    a, b = req("a", 23), req("b", 4)
    sched.add_request(a)
    sched.add_request(b)
    steps = drive(sched)
    assert all(s.num_tokens <= 10 for s in steps)
    assert a.num_output_tokens == 5 and b.num_output_tokens == 5
    assert a.finish_reason == b.finish_reason == "length"
    assert sched.cache.usage()["in_use"] == 0


def test_prefill_chunks_end_at_snapshot_boundaries():
    sched = make(budget=64)
    a = req("a", 30)  # hit granularity 4: prompt-end snapshot after 28 tokens
    sched.add_request(a)
    first = sched.schedule()
    assert [c.num_tokens for c in first.chunks] == [28]
    assert first.chunks[0].allocation.snapshots  # the runner copies the state after 28
    sched.update(first, {})
    second = sched.schedule()
    assert second.chunks[0].start == 28 and second.chunks[0].num_tokens == 2


def test_preemption_by_recompute_and_resume():
    sched = make(num_pages=9, budget=64, enable_prefix_caching=False)
    reqs = [req(f"r{i}", 20, out=30) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    drive(sched)
    assert sched.num_preemptions > 0
    assert all(r.num_output_tokens == 30 and r.finish_reason == "length" for r in reqs)
    assert sched.cache.usage()["in_use"] == 0


def test_sliding_window_prefill_shrinks_to_fit_instead_of_failing():
    window = [AttentionSpec(1, 4, "float32", sliding_window=8)]
    sched = make(specs=window, num_pages=5, budget=200, page_tokens=16)
    a = req("a", 100)  # 100 tokens need 7 pages at once; 4 usable pages hold 64
    sched.add_request(a)
    steps = drive(sched)
    assert a.finish_reason == "length" and a.num_output_tokens == 5
    assert steps[0].chunks[0].num_tokens < 100


def test_request_that_fits_only_partly_is_rejected_once_alone():
    sched = make(num_pages=3, budget=64)  # state page + one 32-token attention page
    a = req("a", 60)
    sched.add_request(a)
    steps = drive(sched, max_steps=50)
    assert a.finish_reason == "abort" and len(steps) < 10
    assert sched.drain_rejected() == [a]
    assert sched.cache.usage()["in_use"] == 0


def test_abort_frees_pages():
    sched = make()
    a = req("a", 30, out=50)
    sched.add_request(a)
    sched.update(sched.schedule(), {})
    assert sched.cache.usage()["in_use"] > 0
    sched.abort(a)
    assert a.finish_reason == "abort" and sched.cache.usage()["in_use"] == 0
    sched.cache.check_integrity()
