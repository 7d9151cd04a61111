"""The scheduler with speculative drafts (a fake model: the target's token at position p of
request r is a function of (r, p); drafts come from a scripted drafter): the caps on drafts,
one shape per step, the rewind of state models after a rejection, and snapshots that land on
confirmed positions only."""

from __future__ import annotations

import random

from hybridkv.config import CacheConfig, SchedulerConfig
from hybridkv.core.coordinator import CacheManager
from hybridkv.core.request import Request
from hybridkv.core.scheduler import Scheduler
from hybridkv.kv.plan import make_plan
from hybridkv.sampling_params import SamplingParams
from hybridkv.spec_decode.verify import greedy_tokens

from .helpers import ATTN, STATE, layers_of

K = 3


def target(rid: str, position: int) -> int:
    return (sum(map(ord, rid)) % 7 + position * 5) % 50


def make(specs, drafter, budget=64, max_model_len=None, scratch_rows=8, caching=True):
    cfg = CacheConfig(num_pages=60, kernel_block_size=4, enable_prefix_caching=caching)
    cm = CacheManager(make_plan(layers_of(specs), cfg), cfg)
    spec = {"method": "ngram", "num_speculative_tokens": K}
    sched_cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                max_model_len=max_model_len, speculative_config=spec)  # fmt: skip
    return Scheduler(cm, sched_cfg, drafter, scratch_rows)


def verify(sched: Scheduler, chunk) -> list[int]:
    req = sched.request(chunk.request_id)
    n = req.num_tokens
    drafts = chunk.token_ids[chunk.num_known :]
    return greedy_tokens([target(req.request_id, n + i) for i in range(len(drafts) + 1)], drafts)


def drive(sched: Scheduler, check=None) -> list:
    steps = []
    while sched.has_unfinished:
        out = sched.schedule()
        steps.append(out)
        if check is not None:
            check(sched, out)
        new = {}
        for c in out.chunks:
            if c.samples:
                req = sched.request(c.request_id)
                new[c.request_id] = (verify(sched, c) if c.num_drafts
                                     else target(c.request_id, req.num_tokens))  # fmt: skip
        sched.update(out, new)
        sched.cache.check_integrity()
    return steps


def oracle(p_right: float, seed: int = 0):
    rng = random.Random(seed)

    def draft(req: Request, k: int) -> list[int]:
        n = req.num_tokens
        return [target(req.request_id, n + i) if rng.random() < p_right else 99 for i in range(k)]

    return draft


def req(rid: str, n: int, out: int = 20) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=out, ignore_eos=True))


def outputs(specs, drafter, **kw) -> tuple[dict[str, list[int]], list]:
    sched = make(specs, drafter, **kw)
    reqs = [req("a", 9), req("b", 17, 13), req("c", 30, 25)]
    for r in reqs:
        sched.add_request(r)
    steps = drive(sched)
    return {r.request_id: r.output_token_ids for r in reqs}, steps


def test_same_outputs_with_drafts_and_every_cap_respected():
    for specs in ([STATE, ATTN], [ATTN], [STATE]):
        plain, _ = outputs(specs, lambda r, k: [])
        got, steps = outputs(specs, oracle(0.7))
        assert got == plain
        drafted = [c for s in steps for c in s.chunks if c.num_drafts]
        assert drafted, specs
        for s in steps:
            assert s.num_tokens <= 64
            for c in s.chunks:
                assert c.num_tokens <= K + 1 or not c.num_drafts
        if STATE in specs:
            assert any(s.restores for s in steps)  # rejections rewound state models
        else:
            assert not any(s.restores for s in steps)


def test_drafts_never_pass_max_tokens_or_max_model_len():
    def check(sched, out):
        for c in out.chunks:
            r = sched.request(c.request_id)
            if c.num_drafts:  # the verify chunk cannot yield more than max_tokens
                assert r.num_output_tokens + c.num_drafts + 1 <= r.sampling_params.max_tokens
                assert c.end + 1 <= 48

    sched = make([STATE, ATTN], oracle(1.0), max_model_len=48)
    for r in (req("a", 9, 39), req("b", 30, 40)):
        sched.add_request(r)
    drive(sched, check)
    assert sched.cache.usage()["in_use"] == 0


def test_chunks_with_drafts_end_before_the_next_snapshot():
    seen = []

    def check(sched, out):
        for c in out.chunks:
            if c.num_drafts:
                r = sched.request(c.request_id)
                assert c.end < sched.cache.next_snapshot_at(r)
                assert not c.allocation.snapshots
            if c.allocation.snapshots:
                seen.append(c.end)

    sched = make([STATE, ATTN], oracle(0.6))
    sched.add_request(req("a", 9, 60))
    drive(sched, check)
    assert seen  # tail snapshots were still taken (by chunks without drafts)


def test_one_shape_per_step_and_scratch_rows():
    """Requests without a match get filler drafts when another has some; with two scratch rows
    only two requests of a state model carry drafts in a step."""

    def half(req, k):
        return (
            [target(req.request_id, req.num_tokens + i) for i in range(k)]
            if req.request_id == "a"
            else []
        )

    sched = make([ATTN], half)
    for r in (req("a", 9), req("b", 9)):
        sched.add_request(r)
    steps = drive(sched)
    decode = [s for s in steps if all(c.start >= 9 for c in s.chunks) and len(s.chunks) == 2]
    assert decode and any(all(c.num_drafts for c in s.chunks) for s in decode)

    sched = make([STATE, ATTN], oracle(0.5), scratch_rows=2)
    for r in (req("a", 9), req("b", 9), req("c", 9)):
        sched.add_request(r)
    for s in drive(sched):
        rows = [c.scratch_row for c in s.chunks if c.num_drafts]
        assert len(rows) <= 2 and rows == list(range(len(rows)))


def test_no_drafter_output_means_plain_steps():
    _, steps = outputs([STATE, ATTN], lambda r, k: [])
    assert not any(c.num_drafts for s in steps for c in s.chunks)
    _, steps = outputs([STATE, ATTN], lambda r, k: None)  # may not carry drafts
    assert not any(c.num_drafts for s in steps for c in s.chunks)
