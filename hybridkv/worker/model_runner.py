"""The model runner: turns a scheduler step into one `ForwardBatch`, runs the model, samples.

One step, in order:

    0. speculative decoding: restore the states of requests whose drafts were rejected in the
       step before from their scratch rows
    1. drop the rows of preempted requests; give new requests a row in every table
    2. zero pages newly handed to attention groups (they may hold a state's NaN bit patterns)
    3. append new kernel-block ids to each attention group's table row; record new
       running-state pages in each state group's page table
    4. copy prefix-hit snapshots into running-state pages        (before the forward);
       save the states of requests that carry drafts into their scratch rows
    5. MTP drafts (speculative decoding with the checkpoint's MTP layers): the MTP layers take
       each request's confirmed pairs from its previous chunk and draft the chunk's drafts
    6. build the immutable ForwardBatch, run the model, compute the logits of the sampling
       requests (a decode step of a captured size replays its native program instead:
       hybridkv.worker.graphs) and the prompt log-probs of chunks that ask for them
    7. copy running states into new snapshot pages               (after the forward)

Everything it needs comes in the step description (`SchedulerOutput`: plain ids and values);
it never calls back into the cache manager. Each group runs on the kernels its plan names: an
attention backend per attention group, the ops of its layer kind per state group. It returns
logits (`StepLogits`); the engine, which owns each request's sampling state, samples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hybridkv.core.managers import StateCopy
from hybridkv.core.scheduler import ScheduledChunk, SchedulerOutput, replace_drafts
from hybridkv.forward_batch import (
    DECODE_ROWS_MAX_QUERY,
    AttentionMetadata,
    ForwardBatch,
    StateMetadata,
)
from hybridkv.kv.plan import GroupPlan, MemoryPlan, state_ops_class
from hybridkv.layers.attention.base import AttentionImpl
from hybridkv.layers.attention.registry import get_backend
from hybridkv.layers.cache import AttentionCache, LayerCache, StateCache
from hybridkv.models.base import CausalLM
from hybridkv.ops import native
from hybridkv.ops.native.spans import provide_spans
from hybridkv.worker.block_table import BlockTable
from hybridkv.worker.buffers import CacheBuffers
from hybridkv.worker.graphs import DecodeGraphs, MtpGraphs
from hybridkv.worker.sampler import prompt_logprobs

PROMPT_LOGITS_ROWS = 256  # prompt log-probs: logits rows computed at once ([rows, vocab] fp32)


@dataclass(frozen=True)
class PromptLogprobs:
    """Log-probs of prompt tokens `start + 1 .. start + len(token_logprobs)` of one request."""

    start: int
    token_logprobs: list[float]
    top: list[dict[int, float]]


@dataclass(frozen=True)
class StepLogits:
    """What a step computed for sampling: `logits` row i belongs to `request_ids[i]`
    ([num_sampled, vocab] float32; None when no request samples, and on the ranks that do not
    sample). The captured-step path returns its static buffer: sample before the next step."""

    request_ids: tuple[str, ...] = ()
    logits: torch.Tensor | None = None
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
    # rows of `logits` per request (a request with d drafts has d + 1: its last known token's,
    # then each draft's); () when every request has one
    num_rows: tuple[int, ...] = ()
    # the drafts the MTP layers made, by request (they replace the chunk's placeholders)
    drafts: dict[str, tuple[int, ...]] = field(default_factory=dict)


def load_state_ops(group: GroupPlan) -> Any:
    """The ops implementation the plan chose for a state group (declared by its layer kind)."""
    return state_ops_class(group)()


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        plan: MemoryPlan,
        max_num_seqs: int,
        device: torch.device,
        driver: bool = True,
        max_capture_size: int = 0,
        num_scratch_rows: int = 0,
        num_scratch_positions: int = 0,
    ) -> None:
        """`driver`: this runner returns logits (rank 0 of a tensor-parallel group, or the only
        one); the other ranks run their shard of the forward and of the logits.
        `max_capture_size`: decode steps of up to this many requests are captured and replayed
        natively (`hybridkv.worker.graphs`; CPU, one process); 0: every step runs eagerly.
        `num_scratch_rows`: speculative decoding on a model with state groups: one saved state
        per request that carries drafts in a step (`scratch_bytes` of memory).
        `num_scratch_positions` > 0 (state ops that `keeps_positions`): each scratch row holds
        that many states instead, the state after each position of a verify chunk but its last
        (at most k), and a rejection commits the accepted one (`SchedulerOutput.commits`)."""
        self.model = model
        self.driver = driver
        self.plan = plan
        self.device = device
        self.buffers = CacheBuffers(plan, device)
        self.tables = {
            g.group_id: BlockTable(
                max_num_seqs,
                plan.max_kernel_blocks_per_seq(g),
                g.kernel_block_size,
                g.blocks_per_page,
                device,
            )
            for g in plan.attention_groups
        }
        # state group -> running-state page of each row (the state groups' "block table")
        self.state_pages = {
            g.group_id: torch.zeros(max_num_seqs, dtype=torch.int64) for g in plan.state_groups
        }
        self.attention_backends: dict[int, AttentionImpl] = {
            g.group_id: _load_attention_backend(g) for g in plan.attention_groups
        }
        self.state_ops = {g.group_id: load_state_ops(g) for g in plan.state_groups}
        # layer -> tensor name -> [num_scratch_rows, *state shape]: states saved before a
        # verify step (the running page cannot be rewound after the drafts ran through it); with
        # per-position states [num_scratch_rows, num_scratch_positions, *state shape], written
        # by the state ops during the verify step (the state after each position)
        self.keeps_positions = num_scratch_rows > 0 and num_scratch_positions > 0
        self.scratch_rows_count, self.scratch_positions = num_scratch_rows, num_scratch_positions
        depth = (num_scratch_positions,) if self.keeps_positions else ()
        self.scratch: dict[str, dict[str, torch.Tensor]] = {
            name: {
                key: torch.empty(
                    (num_scratch_rows, *depth, *t.shape[1:]), dtype=t.dtype, device=device
                )
                for key, t in self.buffers.views[name].items()  # type: ignore[union-attr]
            }
            for g in plan.state_groups
            for name in g.layer_names
        } if num_scratch_rows else {}  # fmt: skip
        model.bind_cache(self._layer_caches())
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        capturable = max_capture_size > 0 and device.type == "cpu" and native.library() is not None
        self.graphs = DecodeGraphs(self, max_capture_size) if capturable else None
        # MTP drafts: each request's final hidden states of its last chunk ([n, hidden], rows
        # for positions start .. start + n - 1), which its next step's MTP pairs take; uniform
        # passes captured where decode steps are
        self.mtp = MtpDrafter(self) if model.mtp is not None else None

    def _layer_caches(self) -> dict[str, LayerCache]:
        caches: dict[str, LayerCache] = {}
        for group in self.plan.groups:
            gid = group.group_id
            for name in group.layer_names:
                view = self.buffers.views[name]
                if isinstance(view, dict):  # a state group: one view per declared tensor
                    positions = self.scratch[name] if self.keeps_positions else {}
                    caches[name] = StateCache(gid, view, self.state_ops[gid], positions)
                else:  # [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]
                    caches[name] = AttentionCache(gid, view, self.attention_backends[gid])
        return caches

    # -- rows ----------------------------------------------------------------------------------

    def release(self, request_ids: Iterable[str], finished: bool = True) -> None:
        """Forget the rows of requests whose cache the scheduler freed (finished or preempted:
        `finished` is kept for the tensor-parallel protocol; a row holds no sampling state)."""
        for rid in request_ids:
            if self.mtp is not None:
                self.mtp.hidden.pop(rid, None)
            row = self.rows.pop(rid, None)
            if row is not None:
                for table in self.tables.values():
                    table.clear_row(row)
                self.free_rows.append(row)

    def _row_of(self, request_id: str) -> int:
        row = self.rows.get(request_id)
        if row is None:
            row = self.free_rows.pop()
            self.rows[request_id] = row
            for table in self.tables.values():
                table.clear_row(row)
        return row

    # -- cache edits ---------------------------------------------------------------------------

    def _apply_allocations(self, out: SchedulerOutput) -> None:
        for gid, pages in out.pages_to_zero.items():
            if gid in self.attention_backends:
                self.buffers.zero_pages(gid, pages, self.attention_backends[gid].zero_pages)
        for chunk in out.chunks:
            row = self._row_of(chunk.request_id)
            alloc = chunk.allocation
            for gid, blocks in alloc.new_blocks.items():
                self.tables[gid].append_blocks(row, blocks)
            for gid, page in alloc.state_pages.items():
                self.state_pages[gid][row] = page
        self._copy_states([op for c in out.chunks for op in c.allocation.copies_in])

    @property
    def scratch_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for v in self.scratch.values() for t in v.values())

    def _scratch_copies(self, pairs: Sequence[tuple[str, int]], save: bool) -> None:
        """(request id, scratch row): save the request's running states into the row, or
        restore them from it, in every state group. Requests without a row are skipped (one
        preempted or finished since its drafts ran)."""
        pairs = [(self.rows[rid], srow) for rid, srow in pairs if rid in self.rows]
        if not pairs or not self.scratch:
            return
        rows = torch.tensor([r for r, _ in pairs])
        srow_list = [s for _, s in pairs]
        # the scheduler hands out scratch rows 0, 1, 2, ... in a step: saves fill a prefix
        prefix = srow_list == list(range(len(srow_list)))
        srows = torch.tensor(srow_list, device=self.device)
        for pages, tensor, scratch in self._state_tensors(rows):
            if save and prefix:  # one gather into the rows, no temporary
                torch.index_select(tensor, 0, pages, out=scratch[: len(srow_list)])
            elif save:
                scratch.index_copy_(0, srows, tensor.index_select(0, pages))
            else:
                src = scratch[: len(srow_list)] if prefix else scratch[srows]
                tensor.index_copy_(0, pages, src)

    def _state_tensors(
        self, rows: torch.Tensor
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(running pages of `rows` in the group, state tensor [num_pages, ...], its scratch)
        for every state tensor of every state layer."""
        pages: dict[int, torch.Tensor] = {}
        for gid, tensor, scratch in self._state_views():
            if gid not in pages:
                pages[gid] = self.state_pages[gid][rows].to(self.device)
            yield pages[gid], tensor, scratch

    def _state_views(self) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """(state group, state tensor [num_pages, ...], its scratch) for every state tensor of
        every state layer."""
        for group in self.plan.state_groups:
            for name in group.layer_names:
                view = self.buffers.views[name]
                assert isinstance(view, dict)
                for key, tensor in view.items():
                    yield group.group_id, tensor, self.scratch[name][key]

    def _commit_positions(self, commits: Sequence[tuple[str, int, int]]) -> None:
        """(request id, scratch row, position): the request's drafts were rejected after the
        chunk position `position`; its running states become the ones the state ops kept
        there, in every state layer (one copy per state tensor, none per draft). Requests
        without a row (preempted or finished since) are skipped.

            scratch row r:  [ state after position 0 | 1 | ... | k - 1 ]   (the verify step's)
                                          |
                                          v  position a (the last accepted token's)
            running page:   state after the chunk's last token  <-  scratch[r, a]
        """
        commits = [(self.rows[rid], srow, pos) for rid, srow, pos in commits if rid in self.rows]
        if not commits or not self.keeps_positions:
            return
        if len(commits) == 1:  # (small batches) plain views: no index tensors, one copy each
            row, srow, pos = commits[0]
            pages = {gid: int(table[row]) for gid, table in self.state_pages.items()}
            for gid, tensor, scratch in self._state_views():
                tensor[pages[gid]].copy_(scratch[srow, pos])
            return
        rows = torch.tensor([r for r, _, _ in commits])
        srows = torch.tensor([s for _, s, _ in commits], device=self.device)
        positions = torch.tensor([p for _, _, p in commits], device=self.device)
        for pages, tensor, scratch in self._state_tensors(rows):
            tensor.index_copy_(0, pages, scratch[srows, positions])

    def scratch_rows(self, chunks: Sequence[ScheduledChunk]) -> np.ndarray | None:
        """[num_seqs] int64 scratch row of each chunk (-1: none) when the state ops keep
        per-position states and some chunk carries drafts; else None."""
        if not self.keeps_positions or not any(c.scratch_row >= 0 for c in chunks):
            return None
        depth, rows = self.scratch_positions, self.scratch_rows_count
        for c in chunks:  # (the kernels write positions 0 .. num_tokens - 2 of the row)
            if c.scratch_row >= rows or (c.scratch_row >= 0 and c.num_tokens - 1 > depth):
                raise ValueError(
                    f"request {c.request_id!r}: a chunk of {c.num_tokens} tokens in scratch row "
                    f"{c.scratch_row}; the scratch holds {rows} rows of {depth} positions"
                )
        return np.fromiter((c.scratch_row for c in chunks), np.int64, len(chunks))

    def _copy_states(self, ops: Sequence[StateCopy]) -> None:
        """Copy every state tensor of every layer of a group from one page to another."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for gid, src, dst in ops:
            srcs, dsts = by_group.setdefault(gid, ([], []))
            srcs.append(src)
            dsts.append(dst)
        for gid, (srcs, dsts) in by_group.items():
            src_t = torch.tensor(srcs, device=self.device)
            dst_t = torch.tensor(dsts, device=self.device)
            for name in self.plan.groups[gid].layer_names:
                view = self.buffers.views[name]
                assert isinstance(view, dict)
                for tensor in view.values():
                    tensor[dst_t] = tensor[src_t]

    # -- batch ---------------------------------------------------------------------------------

    def build_batch(self, chunks: Sequence[ScheduledChunk]) -> ForwardBatch:
        """The step's immutable description. The per-token index math runs in NumPy on the
        host (a decode step's arrays are a few elements: microseconds in NumPy, tens of them as
        tensor ops) and each array crosses to the device once."""
        dev = self.device
        starts = np.fromiter((c.start for c in chunks), np.int64, len(chunks))
        q_lens = np.fromiter((c.num_tokens for c in chunks), np.int64, len(chunks))
        rows = np.fromiter((self.rows[c.request_id] for c in chunks), np.int64, len(chunks))
        qsl = _offsets(chunks)
        num_tokens = int(qsl[-1])
        # position of every token: its request's start + its index inside the chunk
        seq_of_token = np.repeat(np.arange(len(chunks)), q_lens)
        positions = starts[seq_of_token] + np.arange(num_tokens) - qsl[:-1][seq_of_token]
        seq_lens_np = (starts + q_lens).astype(np.int32)
        max_q, token_rows = int(q_lens.max()), rows[seq_of_token]
        qsl_dev = _to(qsl.astype(np.int32), dev)
        seq_lens = _to(seq_lens_np, dev)
        # Short continuation chunks (drafts to verify, the tokens a rejection recomputes, small
        # prefill pieces) attend as decode rows: one row per token, its request's table row and
        # seq_len = its position + 1. Each row computes what the decode step of its position
        # would (the decode kernels, no per-chunk masks), after the chunk's K/V are written.
        #
        #   chunk of request r, tokens at positions p .. p + q - 1
        #   -> rows: (table[r], seq_len p + 1), ..., (table[r], seq_len p + q)
        as_rows = 1 < max_q <= DECODE_ROWS_MAX_QUERY and bool((starts > 0).all())
        att_rows = token_rows if as_rows else rows
        att_lens = (positions + 1).astype(np.int32) if as_rows else seq_lens_np
        att_qsl = _to(np.arange(num_tokens + 1, dtype=np.int32), dev) if as_rows else qsl_dev
        attention = {
            gid: AttentionMetadata(
                block_table=self._gather_rows(table, att_rows),
                slot_mapping=self._slots(table, token_rows, positions),
                query_start_loc=att_qsl,
                seq_lens=_to(att_lens, dev) if as_rows else seq_lens,
                max_query_len=1 if as_rows else max_q,
                max_seq_len=int(seq_lens_np.max()),
            )
            for gid, table in self.tables.items()
        }
        has = starts > 0
        has_initial_state = _to(has, dev)
        scratch_rows = self.scratch_rows(chunks)
        scratch_rows_t = None if scratch_rows is None else _to(scratch_rows, dev)
        state = {}
        for gid, pages in self.state_pages.items():
            step_pages = pages.numpy()[rows]
            meta = StateMetadata(
                state_pages=_to(step_pages, dev),
                has_initial_state=has_initial_state,
                query_start_loc=qsl_dev,
                max_query_len=max_q,
                scratch_rows=scratch_rows_t,
            )
            if dev.type == "cpu":  # the native state kernels' arrays, converted here once
                spans = (meta.state_pages, torch.from_numpy(has.view(np.uint8)),
                         torch.from_numpy(qsl[:-1]), torch.from_numpy(q_lens))  # fmt: skip
                bounds = (int(step_pages.min()), int(step_pages.max()), int(q_lens.min()), 0,
                          num_tokens)  # fmt: skip
                provide_spans(meta.state_pages, has_initial_state, qsl_dev, spans, bounds)
            state[gid] = meta
        ids = [t for c in chunks for t in c.token_ids]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=_to(positions, dev),
            query_start_loc=qsl_dev,
            seq_lens=seq_lens,
            max_query_len=max_q,
            logits_indices=_to(_logits_indices(chunks, qsl), dev),
            attention=attention,
            state=state,
        )

    def _gather_rows(self, table: BlockTable, rows: np.ndarray) -> torch.Tensor:
        """[num_seqs, max_blocks] int32: the table rows of this step's requests."""
        host = table.host_table()
        if host is not None:
            return torch.from_numpy(host[rows])
        return table.table.index_select(0, torch.from_numpy(rows).to(self.device))

    def _slots(self, table: BlockTable, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        if table.host_table() is not None:
            return torch.from_numpy(table.slot_mapping_host(rows, positions))
        return table.slot_mapping(torch.from_numpy(rows), torch.from_numpy(positions))

    # -- step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepLogits:
        """Run one scheduled step; returns the logits of every request that samples (on the
        driver) and the prompt log-probs of the chunks that ask for them."""
        self.release(out.preempted, finished=False)
        self._scratch_copies(out.restores, save=False)
        self._commit_positions(out.commits)
        if out.is_empty:
            return StepLogits()
        self._apply_allocations(out)
        if not self.keeps_positions:
            saves = [(c.request_id, c.scratch_row) for c in out.chunks if c.scratch_row >= 0]
            self._scratch_copies(saves, save=True)
        chunks, drafts = out.chunks, {}
        if self.mtp is not None:
            chunks, drafts = self.mtp.step(out.chunks)
        # a captured decode step replays (hybridkv.worker.graphs); any other step runs eagerly
        prompt: dict[str, PromptLogprobs] = {}
        logits = None
        if self.graphs is not None and not any(c.prompt_targets for c in chunks):
            logits = self.graphs.logits(chunks)
            if logits is not None and self.mtp is not None:
                assert self.graphs.hidden is not None  # (arena memory: the next replay's)
                self.mtp.keep(chunks, self.graphs.hidden.clone())
            if logits is not None and any(c.num_logits_rows < c.num_tokens for c in chunks):
                logits = logits[_logits_indices(chunks, _offsets(chunks))]
        if logits is None:
            logits = self._forward(chunks, prompt)
        self._copy_states([op for c in chunks for op in c.allocation.snapshots])
        if not self.driver:
            return StepLogits()
        ids = tuple(c.request_id for c in chunks if c.sampling is not None)
        rows = tuple(c.num_logits_rows for c in chunks if c.sampling is not None)
        drafted = any(c.num_drafts for c in chunks)
        return StepLogits(ids, logits, prompt, rows if drafted else (), drafts)

    def _forward(
        self, chunks: Sequence[ScheduledChunk], prompt: dict[str, PromptLogprobs]
    ) -> torch.Tensor | None:
        """The model on one step: the logits of its sampling requests ([num_sampled, vocab]
        float32), None when none samples; prompt log-probs go into `prompt`."""
        batch = self.build_batch(chunks)
        hidden = self.model(batch)  # [num_tokens, hidden]
        if self.mtp is not None:
            self.mtp.keep(chunks, hidden)
        start = 0
        for chunk in chunks:
            if chunk.prompt_targets:
                rows = hidden[start : start + len(chunk.prompt_targets)]
                prompt[chunk.request_id] = self._prompt_logprobs(chunk, rows)
            start += chunk.num_tokens
        if batch.logits_indices.shape[0] == 0:
            return None
        if batch.logits_indices.shape[0] != hidden.shape[0]:  # (else every token samples)
            hidden = hidden[batch.logits_indices]
        return self.model.compute_logits(hidden)

    def _prompt_logprobs(self, chunk: ScheduledChunk, hidden: torch.Tensor) -> PromptLogprobs:
        """hidden: [len(prompt_targets), hidden_size], the rows of the chunk's tokens that a
        prompt token follows. Logits are computed PROMPT_LOGITS_ROWS rows at a time (a whole
        chunk of a 150k vocabulary would be gigabytes); every rank runs the same slices (the
        tensor-parallel lm_head gathers)."""
        targets = torch.tensor(chunk.prompt_targets, dtype=torch.int64)
        chosen: list[float] = []
        top: list[dict[int, float]] = []
        for a in range(0, hidden.shape[0], PROMPT_LOGITS_ROWS):
            logits = self.model.compute_logits(hidden[a : a + PROMPT_LOGITS_ROWS])
            if self.driver:
                c, t = prompt_logprobs(logits.cpu(), targets[a : a + PROMPT_LOGITS_ROWS],
                                       chunk.prompt_top)  # fmt: skip
                chosen += c
                top += t
        return PromptLogprobs(chunk.start, chosen, top)


class MtpDrafter:
    """Drafts with the checkpoint's multi-token-prediction layers (the model's `mtp_forward`).

    A pair (p) is the target's final hidden state at position p and the token at p + 1; its
    MTP K/V go to the MTP layer's slot p (the MTP attention layer is a cache layer of the
    request's attention group: same block table), at RoPE position p + 1. A chunk's pairs wait
    for its request's next step (the token after the chunk's last confirmed position is known
    only after sampling), which runs them first, then drafts:

        previous chunk   positions s .. s + m - 1 confirmed, hidden rows kept  (keep)
        this chunk       known tokens .. x_P' | d drafts to make
        MTP pass 1       pairs s .. P' - 1 (next ids from the scheduler) -> K/V at slots
                         s .. P' - 1; logits of pair P' - 1 -> draft 1
        MTP pass j > 1   one pair per request: (output of the step before, draft j - 1) at
                         slot P' - 2 + j -> draft j          (slots inside this chunk's
                                                              allocation, rewritten later)

    Greedy drafts (argmax, a point mass for rejection sampling). Under tensor parallelism rank 0
    holds the full logits: the drafts reach every rank by one all-reduce per pass. Where the
    runner captures decode steps (CPU, one process), a uniform pass (every request drafting,
    each with the same number of pairs: the passes j > 1, pass 1 when uniform) runs as a
    captured program (`MtpGraphs`: the MTP forward, the draft logits and their argmax)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.model = runner.model
        self.hidden: dict[str, torch.Tensor] = {}
        head = getattr(self.model, "lm_head", None)
        self.tp = getattr(head, "tp", None)
        one_process = self.tp is None or self.tp.size == 1  # (the program has no all-reduce)
        decode = runner.graphs
        self.graphs = (
            MtpGraphs(runner, decode.max_size, decode.arena)
            if decode is not None and one_process
            else None
        )

    def keep(self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor) -> None:
        """hidden: [num_tokens, H] of the step; each chunk's rows wait for its next step."""
        qsl = _offsets(chunks)
        for i, chunk in enumerate(chunks):
            self.hidden[chunk.request_id] = hidden[qsl[i] : qsl[i + 1]]

    def step(
        self, chunks: Sequence[ScheduledChunk]
    ) -> tuple[tuple[ScheduledChunk, ...], dict[str, tuple[int, ...]]]:
        """Run every chunk's pending pairs, then the drafts; returns the chunks with their MTP
        drafts in place of the placeholders, and the drafts by request id."""
        pending = [c for c in chunks if c.mtp_next_ids and c.request_id in self.hidden]
        if not pending:
            return tuple(chunks), {}
        # pass 1: every pending pair; its outputs at the drafting chunks' last pairs (the
        # scheduler gives drafts only to a chunk whose pairs end at its last known token - 1)
        drafting = [c for c in pending if c.num_drafts]
        for c in drafting:
            assert c.mtp_start + len(c.mtp_next_ids) == c.start + c.num_known - 1, c
        first = [_pairs(c, c.mtp_start, c.mtp_next_ids, c.num_drafts > 0) for c in pending]
        rows = [self.hidden.pop(c.request_id)[: len(c.mtp_next_ids)] for c in pending]
        out, tokens = self._pass(first, torch.cat(rows))  # [num drafting, H], [num drafting]
        drafts: dict[str, list[int]] = {c.request_id: [] for c in drafting}
        for j in range(max((c.num_drafts for c in drafting), default=0)):
            for c, token in zip(drafting, tokens, strict=True):
                drafts[c.request_id].append(token)
            more = [i for i, c in enumerate(drafting) if c.num_drafts > j + 1]
            if not more:
                break
            drafting = [drafting[i] for i in more]
            # pass j + 2: (the output of pass j + 1, draft j + 1) at slot P' - 1 + j + 1
            step = [
                _pairs(c, c.start + c.num_known - 1 + j, (drafts[c.request_id][-1],), True)
                for c in drafting
            ]
            out, tokens = self._pass(step, out[more])  # (out[more]: a copy, out may be arena)
        return replace_drafts(chunks, drafts), {rid: tuple(d) for rid, d in drafts.items()}

    def _pass(
        self, chunks: list[ScheduledChunk], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]]:
        """One MTP pass over pairs laid out as chunks (token_ids: each pair's next token, start:
        its first pair's position); hidden: [num pairs, H] -> the outputs at the last pair of
        every sampling chunk [n, H] and their greedy drafts [n] (a captured pass's outputs are
        arena memory: read them before the next program runs)."""
        if self.graphs is not None:
            captured = self.graphs.draft(chunks, hidden)
            if captured is not None:
                return captured
        batch = self.runner.build_batch(chunks)
        # the K/V of pair p go to slot p; its RoPE position is its token's, p + 1 (as
        # transformers' MTP runs it: only relative positions reach the attention scores)
        batch = dataclasses.replace(batch, positions=batch.positions + 1)
        out = self.model.mtp_forward(batch.input_ids, hidden, batch)[batch.logits_indices]
        return out, self._argmax(out)

    def _argmax(self, out: torch.Tensor) -> list[int]:
        """Greedy drafts of MTP outputs [n, H], the same on every rank."""
        logits = self.model.mtp_logits(out)  # rank 0: [n, vocab]; other ranks: their part
        if self.tp is None or self.tp.size == 1:
            return logits.argmax(dim=-1).tolist()
        ids = logits.argmax(dim=-1) if self.runner.driver else torch.zeros(
            logits.shape[0], dtype=torch.int64, device=logits.device
        )  # fmt: skip
        return self.tp.all_reduce(ids.contiguous()).tolist()


def _pairs(
    chunk: ScheduledChunk, start: int, next_ids: tuple[int, ...], samples: bool
) -> ScheduledChunk:
    """A chunk of MTP pairs for build_batch: positions start .. start + len(next_ids) - 1
    (the MTP layers hold no state: no scratch row)."""
    return dataclasses.replace(
        chunk, token_ids=next_ids, start=start, num_drafts=0, prompt_targets=(),
        sampling=chunk.sampling if samples else None, scratch_row=-1,
    )  # fmt: skip


def _logits_indices(chunks: Sequence[ScheduledChunk], qsl: np.ndarray) -> np.ndarray:
    """The token rows whose logits the step computes: each sampling chunk's last token, or
    with d drafts its last d + 1 tokens (the last known token's and every draft's).

        chunk i tokens   [ known ... k_u | x_1 ... x_d ]      qsl[i] .. qsl[i + 1] - 1
        logits rows                  ^^^   ^^^^^^^^^^^       qsl[i + 1] - d - 1 .. qsl[i + 1] - 1
    """
    if not any(c.num_drafts for c in chunks):
        return (qsl[1:] - 1)[[i for i, c in enumerate(chunks) if c.samples]]
    parts = [
        np.arange(qsl[i + 1] - c.num_logits_rows, qsl[i + 1])
        for i, c in enumerate(chunks)
        if c.samples
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _offsets(chunks: Sequence[ScheduledChunk]) -> np.ndarray:
    """[num_chunks + 1]: where each chunk's tokens start in the step (query_start_loc)."""
    qsl = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum([c.num_tokens for c in chunks], out=qsl[1:])
    return qsl


def _load_attention_backend(group: GroupPlan) -> AttentionImpl:
    assert group.backend is not None
    return get_backend(group.backend).load()()


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on `device` (shared memory on the CPU)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    return t if device.type == "cpu" else t.to(device)
