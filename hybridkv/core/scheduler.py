"""Continuous batching with chunked prefill, prefix-cache admission and preemption by recompute.

One step:

    schedule()   phase 1  running requests, oldest first: a decode token or the next prefill
                          chunk; when the pool is dry, preempt the newest running request
                          (recompute later) until the allocation fits
                 phase 2  waiting requests, oldest first: prefix-cache lookup, first chunk
    (runner)     runs the step, samples a token for every request whose known tokens are all
                 computed after its chunk
    update()     commit computed tokens to the cache, append sampled tokens, finish requests

Prefill chunks never run past a state-snapshot boundary (the cache manager's `next_boundary`),
so the running state is exactly at the boundary when the runner copies it into a snapshot.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

from hybridkv.config import SchedulerConfig
from hybridkv.core.coordinator import CacheManager, PrefixHit, StepAllocation
from hybridkv.core.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # tokens computed before this step (= position of the first token)
    num_tokens: int
    allocation: StepAllocation
    samples: bool  # after this chunk every known token is computed: the step samples one

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[Request, ...]  # their cache is gone; the runner drops their rows
    new_attention_pages: dict[int, list[int]]  # group -> pages to zero before the step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, cache: CacheManager, config: SchedulerConfig) -> None:
        self.cache = cache
        self.config = config
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rejected: list[Request] = []  # finished by the scheduler itself (do not fit)
        self.num_preemptions = 0

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def abort(self, request: Request, reason: str = "abort") -> None:
        """Stop a request now; its pages return to the pool (cached content stays cached)."""
        if request.is_finished:
            return
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self._finish(request, reason)

    def drain_rejected(self) -> list[Request]:
        out, self.rejected = self.rejected, []
        return out

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- schedule ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        budget = self._schedule_running(budget, chunks, preempted)
        if not preempted:
            self._schedule_waiting(budget, chunks)
        return SchedulerOutput(tuple(chunks), tuple(preempted), self.cache.drain_new_pages())

    def _chunk_size(self, req: Request, start: int, budget: int, hit: PrefixHit | None) -> int:
        n = min(req.num_tokens - start, budget)
        if n <= 1:  # one token never crosses a boundary (boundaries lie past `start`)
            return n
        boundary = self.cache.next_boundary(req, hit)
        if boundary is not None and start + n > boundary:
            n = boundary - start
        return n

    def _schedule_running(
        self, budget: int, chunks: list[ScheduledChunk], preempted: list[Request]
    ) -> int:
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk_size(req, req.num_computed_tokens, budget, None)
            if n <= 0:
                continue
            fitted = self._allocate_or_preempt(req, n, preempted)
            if fitted is None:
                continue
            alloc, n = fitted
            start = req.num_computed_tokens
            chunks.append(ScheduledChunk(req, start, n, alloc, start + n == req.num_tokens))
            budget -= n
        return budget

    def _allocate_or_preempt(
        self, req: Request, n: int, preempted: list[Request]
    ) -> tuple[StepAllocation, int] | None:
        """Allocate for a running request: a prefill chunk shrinks to what fits, then the
        newest running requests (not scheduled in this step yet) are preempted until it fits.
        Returns (allocation, tokens) or None if `req` itself went."""
        while True:
            fitted = self._allocate_shrinking(req, n)
            if fitted is not None:
                return fitted
            if self.running == [req]:  # alone and still short: it can never finish here
                self.running.remove(req)
                self._reject(req)
                return None
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return None

    def _allocate_shrinking(
        self, req: Request, n: int, hit: PrefixHit | None = None
    ) -> tuple[StepAllocation, int] | None:
        """Try `n` tokens, then halves of it: a smaller prefill chunk needs fewer pages at once
        (a sliding-window group holds a whole chunk until the window moves past it)."""
        while n >= 1:
            alloc = self.cache.allocate(req, n, hit)
            if alloc is not None:
                return alloc, n
            n //= 2
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.cache.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            hit = self.cache.lookup(req)
            n = self._chunk_size(req, hit.num_tokens, budget, hit)
            # With others running, a request that does not fit waits for memory; alone, it takes
            # the largest chunk that fits rather than being refused.
            if self.running:
                alloc = self.cache.allocate(req, n, hit)
                fitted = None if alloc is None else (alloc, n)
            else:
                fitted = self._allocate_shrinking(req, n, hit)
            if fitted is None:
                if not self.running and not chunks:
                    self.waiting.popleft()  # cannot fit even into an empty pool
                    self._reject(req)
                    continue
                break
            alloc, n = fitted
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = hit.num_tokens
            req.num_cached_tokens = hit.num_tokens
            self.running.append(req)
            start = hit.num_tokens
            chunks.append(ScheduledChunk(req, start, n, alloc, start + n == req.num_tokens))
            budget -= n

    # -- update --------------------------------------------------------------------------------

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Record a finished step. `sampled` maps request id -> token for every chunk that
        `samples`. Returns the requests that finished in this step."""
        finished = []
        for chunk in output.chunks:
            req = chunk.request
            if req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            req.num_computed_tokens = chunk.end
            self.cache.commit(req, chunk.end)
            if not chunk.samples:
                continue
            req.all_token_ids.append(sampled[req.request_id])
            reason = self._stop_reason(req)
            if reason is not None:
                self.running.remove(req)
                self._finish(req, reason)
                finished.append(req)
        if self.cache.config.debug_checks:
            self.cache.check_integrity()
        return finished

    def _stop_reason(self, req: Request) -> str | None:
        params = req.sampling_params
        token = req.all_token_ids[-1]
        n_out = req.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token in req.eos_token_ids:
                req.stop_reason = token
                return "stop"
            if token in params.stop_token_ids:
                req.stop_reason = token
                return "stop"
        if n_out >= params.max_tokens:
            return "length"
        max_len = self.config.max_model_len
        if max_len is not None and req.num_tokens >= max_len:
            return "length"
        return None

    def finish_requests(self, requests: Iterable[Request], reason: str) -> None:
        """Finish running requests outside `update` (e.g. a stop string matched)."""
        for req in requests:
            if req in self.running:
                self.running.remove(req)
            self._finish(req, reason)

    def _reject(self, req: Request) -> None:
        self._finish(req, "abort")
        req.stop_reason = "the request does not fit into the cache"
        self.rejected.append(req)

    def _finish(self, req: Request, reason: str) -> None:
        self.cache.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
