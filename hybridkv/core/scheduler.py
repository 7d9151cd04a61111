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

Speculative decoding (`SchedulerConfig.speculative_config`, docs/speculative-decoding.md): a
decode chunk may carry drafts after its known tokens; `update` receives the verified tokens
(accepted drafts + one from the target) and sets the computed count to what the target
confirmed. Attention needs no undo (rejected drafts' slots are rewritten before anything reads
them); a state layer has consumed the rejected drafts. Where the state ops keep the state after
every position (`keeps_positions`), the next step starts by committing the accepted position's
state from the request's scratch row; elsewhere each speculating request's state is saved into
its scratch row first and, after a rejection, restored at the start of the next step, and the
chunk's accepted tokens are recomputed with the next drafts:

    chunk     [ known u | drafts d ]          start = s (tokens computed before)
    verified  a drafts accepted + 1 token from the target
    computed  attention only, or a == d:  s + u + a
              state groups and a < d:     s + u + a  (per-position states: commit position
                                                      u - 1 + a of its scratch row)
                                          s  (otherwise: state restored from its scratch row)

The step description (`SchedulerOutput`) holds plain values only (ids, token ids, sampling
parameters, the allocation's page and kernel-block ids), so it could be sent to another process.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from hybridkv.config import SchedulerConfig
from hybridkv.core.coordinator import NO_HIT, CacheManager, PrefixHit, StepAllocation
from hybridkv.core.managers import INF
from hybridkv.core.request import Request, RequestStatus
from hybridkv.sampling_params import SamplingParams
from hybridkv.spec_decode.adaptive import Candidate, GoodputPolicy


@dataclass(frozen=True)
class ScheduledChunk:
    """One request's part of a step."""

    request_id: str
    token_ids: tuple[int, ...]  # the tokens this step computes for it
    start: int  # tokens computed before this step (= position of the first token)
    allocation: StepAllocation
    sampling: SamplingParams | None  # set when the step samples a token for it (its prompt and
    # output so far are all computed after this chunk)
    # prompt log-probs: the prompt token that follows each of the chunk's first tokens (the
    # chunk's token i predicts prompt_targets[i]), and how many top log-probs each wants
    prompt_targets: tuple[int, ...] = ()
    prompt_top: int = 0
    # speculative decoding: the last `num_drafts` of token_ids are drafts to verify (the
    # logits of the last known token and of every draft are computed); `scratch_row` >= 0:
    # the runner saves the request's states into that scratch row before the forward, or, where
    # the state ops keep per-position states, they write the state after each position there
    num_drafts: int = 0
    scratch_row: int = -1
    # MTP drafts (`Request.mtp_pending`): the MTP layers first take the pairs (the target's
    # hidden state at position p from the request's previous chunk, the token at p + 1) for
    # p = mtp_start .. mtp_start + len(mtp_next_ids) - 1; with drafts, the runner makes them
    # from the last pair on (the chunk's drafts are placeholders until then)
    mtp_start: int = -1
    mtp_next_ids: tuple[int, ...] = ()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_known(self) -> int:
        """Tokens of the request itself (the chunk without its drafts)."""
        return len(self.token_ids) - self.num_drafts

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)

    @property
    def num_logits_rows(self) -> int:
        """Logits rows the step computes for it: its last known token's and its drafts'."""
        return self.num_drafts + 1 if self.sampling is not None else 0

    @property
    def samples(self) -> bool:
        return self.sampling is not None


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted: tuple[str, ...]  # request ids; their cache is gone, the runner drops their rows
    pages_to_zero: dict[int, list[int]]  # group -> pages newly handed to it, zeroed before use
    # (request id, scratch row): states to restore before anything else (drafts rejected in
    # the step before; a request preempted or finished since is skipped)
    restores: tuple[tuple[str, int], ...] = ()
    # per-position states: (request id, scratch row, chunk position): the state kept after
    # that position becomes the request's running state, before anything else (the same rules)
    commits: tuple[tuple[str, int, int], ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def replace_drafts(
    chunks: Iterable[ScheduledChunk], drafts: Mapping[str, Sequence[int]]
) -> tuple[ScheduledChunk, ...]:
    """The chunks with the drafts made during the step (MTP) in place of their placeholders."""
    return tuple(
        replace(c, token_ids=c.token_ids[: c.num_known] + tuple(drafts[c.request_id]))
        if c.request_id in drafts else c
        for c in chunks
    )  # fmt: skip


def with_drafts(out: SchedulerOutput, drafts: Mapping[str, Sequence[int]]) -> SchedulerOutput:
    return replace(out, chunks=replace_drafts(out.chunks, drafts))


# (request, the most drafts it may get) -> its drafts (the engine's proposer), or None for a
# request that may not carry any (its sampling reads more than the logits)
Drafter = Callable[[Request, int], Sequence[int] | None]


class Scheduler:
    def __init__(
        self,
        cache: CacheManager,
        config: SchedulerConfig,
        drafter: Drafter | None = None,
        num_scratch_rows: int = 0,
        mtp: bool = False,
        keeps_positions: bool = False,
        capturable: Callable[[int, int], bool] | None = None,
    ) -> None:
        """`drafter`: speculative decoding's proposer (None: off). `num_scratch_rows`: how many
        requests of a step may carry drafts when the model has state groups (the runner's
        scratch rows); ignored without state groups. `mtp`: the runner's MTP layers draft
        (every chunk tells them its request's confirmed pairs: `ScheduledChunk.mtp_next_ids`).
        `keeps_positions`: the state ops keep every position's state (the runner's scratch rows
        hold them): a rejection commits the accepted position instead of rewinding.
        `capturable(n, q)`: whether a step of n chunks of q tokens each would run as a captured
        program (the runner's `DecodeGraphs.may_capture`); requests without drafts get filler
        drafts to make a step that shape only then (None: always)."""
        self.cache = cache
        self.config = config
        self.drafter = drafter
        self.num_scratch_rows = num_scratch_rows
        self.mtp = mtp
        self.capturable = capturable
        # a rejection rewinds the request (state restored, accepted tokens recomputed)
        self.rewinds = cache.has_state and not keeps_positions
        spec = config.speculative_config
        # `adaptive_k`: the step's drafts per chunk chosen for tokens per second
        self.adaptive: GoodputPolicy | None = None
        if drafter is not None and spec is not None and spec.adaptive_k:
            assert spec.num_speculative_tokens is not None
            self.adaptive = GoodputPolicy(spec.num_speculative_tokens, rewinds=self.rewinds)
        self._real_drafts: dict[str, int] = {}  # request id -> drafts offered (no fillers)
        self._first_drafts: dict[str, int] = {}  # adaptive_k: first drafts cut from the step
        self._restores: list[tuple[str, int]] = []
        self._commits: list[tuple[str, int, int]] = []
        self._scratch_used = 0
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.rejected: list[Request] = []  # finished by the scheduler itself (do not fit)
        self.num_preemptions = 0
        self._by_id: dict[str, Request] = {}  # every unfinished request

    # -- requests ------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self._by_id:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self._by_id[request.request_id] = request
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
        self._scratch_used = 0
        budget = self._schedule_running(budget, chunks, preempted)
        if not preempted:
            self._schedule_waiting(budget, chunks)
        preempted_ids = tuple(r.request_id for r in preempted)
        restores, self._restores = tuple(self._restores), []
        commits, self._commits = tuple(self._commits), []
        return SchedulerOutput(
            tuple(chunks), preempted_ids, self.cache.drain_new_pages(), restores, commits
        )

    def _chunk(
        self,
        req: Request,
        start: int,
        n: int,
        alloc: StepAllocation,
        drafts: Sequence[int] = (),
        scratch_row: int = -1,
    ) -> ScheduledChunk:
        samples = start + n == req.num_tokens
        tokens = tuple(req.all_token_ids[start : start + n]) + tuple(drafts)
        params = req.sampling_params
        targets: tuple[int, ...] = ()
        if params.prompt_logprobs is not None and start + 1 < req.num_prompt_tokens:
            end = min(start + n + 1, req.num_prompt_tokens)
            targets = tuple(req.all_token_ids[start + 1 : end])
        mtp_start, mtp_next = req.mtp_pending or (-1, ())
        req.mtp_pending = None  # the runner's MTP layers take them in this step
        return ScheduledChunk(
            req.request_id,
            tokens,
            start,
            alloc,
            params if samples else None,
            targets,
            params.prompt_logprobs or 0,
            len(drafts),
            scratch_row,
            mtp_start,
            mtp_next,
        )

    def request(self, request_id: str) -> Request:
        """The live request of a chunk (the scheduler's own; the step carries ids only)."""
        return self._by_id[request_id]

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
        proposed = self._propose(budget) if self.drafter is not None else {}
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = self._chunk_size(req, req.num_computed_tokens, budget, None)
            if n <= 0:
                continue
            drafts = proposed.get(req.request_id, ())
            if req.num_computed_tokens + n != req.num_tokens or (
                self.cache.has_state and self._scratch_used >= self.num_scratch_rows
            ):
                drafts = ()  # a chunk cut short by the budget, or no scratch row left
            drafts = drafts[: max(0, budget - n)]
            fitted = None
            if drafts:  # optional: without room for them the request decodes plainly
                alloc = self.cache.allocate(req, n + len(drafts))
                fitted = None if alloc is None else (alloc, n)
                drafts = drafts if fitted is not None else ()
            if fitted is None:
                fitted = self._allocate_or_preempt(req, n, preempted)
            if fitted is None:
                continue
            alloc, n = fitted
            row = -1
            if drafts and self.cache.has_state:
                row, self._scratch_used = self._scratch_used, self._scratch_used + 1
            chunks.append(self._chunk(req, req.num_computed_tokens, n, alloc, drafts, row))
            budget -= n + len(drafts)
        return budget

    def _propose(self, budget: int) -> dict[str, tuple[int, ...]]:
        """Drafts for the running requests past their prompt, within `_draft_cap`. One shape
        per step: when any request has drafts, the others that may carry some get filler drafts
        (their last token repeated) up to their cap, so that every decode chunk has k + 1
        tokens and the step is captured and replayed (hybridkv.worker.graphs); a rejected
        filler costs a row of a step that runs anyway. Only where that shape runs captured
        (`_pads`): in an eager step (more rows than the native kernels take, tensor
        parallelism, GPUs) fillers would only add rows. Without any match nobody drafts: the
        step stays a plain decode."""
        assert self.drafter is not None
        self._real_drafts, self._first_drafts = {}, {}
        if self._adaptive_skips():
            return {}  # the policy said no for this batch lately: not even the caps are formed
        caps: dict[str, tuple[Request, int]] = {}
        drafts: dict[str, tuple[int, ...]] = {}
        for req in self.running:
            if req.status is not RequestStatus.RUNNING:
                continue
            cap = self._draft_cap(req, req.num_tokens - req.num_computed_tokens, budget)
            if cap > 0:
                caps[req.request_id] = (req, cap)
        if self.adaptive is not None and caps and not self.adaptive.worth_proposing(
            [Candidate(rid, r.num_tokens - r.num_computed_tokens, 0, cap)
             for rid, (r, cap) in caps.items()]
        ):  # fmt: skip
            return {}  # not even drafts for every row would beat a plain step
        for rid, (req, cap) in list(caps.items()):
            proposed = self.drafter(req, cap)
            if proposed is None:
                del caps[rid]  # may not carry drafts
                continue
            drafts[rid] = tuple(proposed)[:cap]
        self._real_drafts = {rid: len(d) for rid, d in drafts.items()}
        if self.adaptive is not None and any(drafts.values()):
            self._adapt(caps, drafts)
        if any(drafts.values()) and self._pads(caps):
            for rid, (req, cap) in caps.items():
                d = drafts[rid]
                last = d[-1] if d else req.all_token_ids[-1]
                drafts[rid] = d + (last,) * (cap - len(d))
        return drafts

    def _adaptive_skips(self) -> bool:
        """`adaptive_k`: the policy's recent answer for a batch of this many running requests
        is that drafts do not pay (`GoodputPolicy.skips`; a step's draft caps, a pass over
        every request, are then not formed)."""
        if self.adaptive is None:
            return False
        running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if not running:
            return False
        low = max(r.num_tokens - r.num_computed_tokens for r in running)
        return self.adaptive.skips(len(running), low)

    def _pads(self, caps: dict[str, tuple[Request, int]]) -> bool:
        """Whether filler drafts up to every cap make a step of one shape that runs captured:
        every running request in it with the same known + cap tokens, a shape `capturable`
        accepts. Else they would only add rows to an eager step."""
        if self.capturable is None:
            return True
        running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        if len(caps) != len(running):
            return False
        shapes = {r.num_tokens - r.num_computed_tokens + cap for r, cap in caps.values()}
        return len(shapes) == 1 and self.capturable(len(caps), shapes.pop())

    def _adapt(
        self, caps: dict[str, tuple[Request, int]], drafts: dict[str, tuple[int, ...]]
    ) -> None:
        """`adaptive_k`: cut every cap (and the drafts) to the step's chosen tokens per chunk
        (`GoodputPolicy.choose`); the fillers then pad to the cut caps."""
        assert self.adaptive is not None
        known = {rid: req.num_tokens - req.num_computed_tokens for rid, (req, _) in caps.items()}
        candidates = [
            Candidate(rid, known[rid], len(drafts[rid]), cap) for rid, (_, cap) in caps.items()
        ]
        tokens_each = self.adaptive.choose(candidates)
        for rid, (req, cap) in caps.items():
            cut = max(0, min(cap, tokens_each - known[rid]))
            if drafts[rid] and not cut and known[rid] == 1:
                self._first_drafts[rid] = drafts[rid][0]  # judged by the token it samples
            caps[rid] = (req, cut)
            drafts[rid] = drafts[rid][:cut]
            self._real_drafts[rid] = len(drafts[rid])

    def observe_step(self, output: SchedulerOutput, seconds: float) -> None:
        """`adaptive_k`: the engine's wall time of a step. Measured only for steps of one
        shape (every chunk a decode row or a verify chunk of the same length)."""
        if self.adaptive is None or not output.chunks:
            return
        if output.restores:
            self.adaptive.observe_rewind_step(len(output.chunks), seconds)
            return
        tokens_each = len(output.chunks[0].token_ids)
        for c in output.chunks:
            if c.sampling is None or len(c.token_ids) != tokens_each:
                return
            if tokens_each > 1 and not c.num_drafts:
                return  # a prefill chunk (or a rewound request's recomputation alone)
        self.adaptive.observe_step(len(output.chunks), tokens_each, seconds)

    def proposed_drafts(self, chunk: ScheduledChunk) -> int:
        """How many of a verify chunk's drafts the proposer made (the rest are fillers: its
        last token repeated to give the step one shape); metrics count these."""
        return min(chunk.num_drafts, self._real_drafts.get(chunk.request_id, chunk.num_drafts))

    def _draft_cap(self, req: Request, n: int, budget: int) -> int:
        """The most drafts a running request whose chunk of `n` tokens ends its known tokens
        (it samples) past its prompt may carry: the config's (k, disable_by_batch_size),
        max_tokens and max_model_len (a verify chunk never writes a position the request cannot
        reach), the step's token budget, and the next state snapshot (a snapshot must never
        hold a draft's state: the chunk ends before it)."""
        start = req.num_computed_tokens
        if start < req.num_prompt_tokens or n < 1:
            return 0
        spec = self.config.speculative_config
        cap = min(
            spec.max_drafts(len(self.running), req.num_tokens),
            req.sampling_params.max_tokens - req.num_output_tokens - 1,
            budget - n,
            # chunks of k + 1 tokens, also after a rejection recomputes some (steps of one
            # shape are captured and replayed: hybridkv.worker.graphs)
            spec.num_speculative_tokens + 1 - n,
        )
        if self.config.max_model_len is not None:
            cap = min(cap, self.config.max_model_len - req.num_tokens - 1)
        if self.cache.has_state:
            if self.num_scratch_rows < 1:
                return 0
            snapshot = self.cache.next_snapshot_at(req)
            if snapshot != INF:
                cap = min(cap, int(snapshot) - (start + n) - 1)
        return max(cap, 0)

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
        req.mtp_pending = None
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _schedule_waiting(self, budget: int, chunks: list[ScheduledChunk]) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            # a request that wants its prompt's log-probs computes its whole prompt
            wants_logits = req.sampling_params.prompt_logprobs is not None
            hit = NO_HIT if wants_logits else self.cache.lookup(req)
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
            chunks.append(self._chunk(req, hit.num_tokens, n, alloc))
            budget -= n

    # -- update --------------------------------------------------------------------------------

    def update(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[Request]:
        """Record a finished step. `sampled` maps request id -> its new token for every chunk
        that `samples` (a chunk with drafts: its verified tokens, accepted drafts then the
        target's). Returns the requests that finished in this step."""
        finished = []
        for chunk in output.chunks:
            req = self._by_id.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if chunk.num_drafts:
                tokens = sampled[req.request_id]
                assert not isinstance(tokens, int)
                if self._verified(req, chunk, tokens):
                    finished.append(req)
                continue
            req.num_computed_tokens = chunk.end
            self.cache.commit(req, chunk.end)
            if chunk.samples:
                token = sampled[req.request_id]
                req.all_token_ids.append(token if isinstance(token, int) else token[0])
                first = self._first_drafts.get(req.request_id)
                if first is not None and self.adaptive is not None:
                    self.adaptive.observe_plain(req.request_id, req.all_token_ids[-1] == first)
                if self._stop_if_done(req):
                    finished.append(req)
                    continue
            self._keep_mtp_pairs(req, chunk.start, chunk.num_tokens)
        if self.cache.config.debug_checks:
            self.cache.check_integrity()
        return finished

    def _verified(self, req: Request, chunk: ScheduledChunk, tokens: Sequence[int]) -> bool:
        """A chunk with drafts: append its verified tokens one by one (a stop among them ends
        the request there), then commit what the target confirmed (module docstring).
        Returns whether the request finished."""
        num_accepted = len(tokens) - 1
        if self.adaptive is not None:
            real = self.proposed_drafts(chunk)
            self.adaptive.observe_verify(req.request_id, real, num_accepted)
        rejected = self.cache.has_state and num_accepted < chunk.num_drafts
        rewind = rejected and self.rewinds
        computed = chunk.start if rewind else chunk.start + chunk.num_known + num_accepted
        for token in tokens:
            req.all_token_ids.append(token)
            if self._stop_reason(req) is not None:
                # what the step computed up to the stop enters the prefix cache, as a plain
                # decode step commits its chunk before its token ends the request
                done = min(computed, req.num_tokens - 1)
                if done > req.num_computed_tokens:
                    req.num_computed_tokens = done
                    self.cache.commit(req, done)
                return self._stop_if_done(req)
        req.num_computed_tokens = computed
        self.cache.commit(req, computed)
        if rewind:
            self._restores.append((req.request_id, chunk.scratch_row))
        elif rejected:  # the state after the last accepted token, kept by the state ops
            position = chunk.num_known - 1 + num_accepted
            self._commits.append((req.request_id, chunk.scratch_row, position))
        self._keep_mtp_pairs(req, chunk.start, chunk.num_known + num_accepted)
        return False

    def _keep_mtp_pairs(self, req: Request, start: int, num_confirmed: int) -> None:
        """The chunk's positions start .. start + num_confirmed - 1 hold confirmed tokens whose
        next token is known: the MTP layers take those pairs in the request's next step."""
        if self.mtp:
            next_ids = tuple(req.all_token_ids[start + 1 : start + num_confirmed + 1])
            req.mtp_pending = (start, next_ids) if len(next_ids) == num_confirmed else None

    def _stop_if_done(self, req: Request) -> bool:
        reason = self._stop_reason(req)
        if reason is None:
            return False
        self.running.remove(req)
        self._finish(req, reason)
        return True

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
        """A request that cannot fit even into an empty pool (the engine rejects those at
        add_request; this is the safety net)."""
        self._finish(req, "abort")
        req.error = "the request does not fit into the cache"
        self.rejected.append(req)

    def _finish(self, req: Request, reason: str) -> None:
        self._by_id.pop(req.request_id, None)
        if self.adaptive is not None:
            self.adaptive.forget(req.request_id)
        self.cache.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
