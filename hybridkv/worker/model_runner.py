"""The model runner: turns a scheduler step into one `ForwardBatch`, runs the model, samples.

One step, in order:

    1. drop the rows of preempted requests; give new requests a block-table row
    2. zero pages newly handed to attention groups (they may hold a state's NaN bit patterns)
    3. append new kernel-block ids to each attention group's table row
    4. copy prefix-hit snapshots into running-state pages        (before the forward)
    5. build the immutable ForwardBatch, run the model, compute logits, sample
    6. copy running states into new snapshot pages               (after the forward)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hybridkv.core.coordinator import CacheManager
from hybridkv.core.request import Request
from hybridkv.core.scheduler import ScheduledChunk, SchedulerOutput
from hybridkv.kv.plan import MemoryPlan
from hybridkv.layers.attention.base import AttentionMetadata
from hybridkv.layers.attention.registry import get_backend
from hybridkv.layers.state_base import StateMetadata
from hybridkv.models.base import CausalLM
from hybridkv.worker.batch import ForwardBatch
from hybridkv.worker.block_table import BlockTable
from hybridkv.worker.buffers import CacheBuffers
from hybridkv.worker.sampler import Sample, Sampler


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        plan: MemoryPlan,
        cache: CacheManager,
        max_num_seqs: int,
        device: torch.device,
        seed: int = 0,
    ) -> None:
        self.model = model
        self.plan = plan
        self.cache = cache
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
        self.state_group_ids = [g.group_id for g in plan.state_groups]
        backends = {g.backend for g in plan.attention_groups}
        assert len(backends) == 1, "one attention backend per model"
        self.backend = get_backend(backends.pop()).load()()
        model.bind_cache(self.buffers.views, self.backend)
        self.group_of_layer = dict(self.buffers.group_of_layer)
        self.rows: dict[str, int] = {}
        self.free_rows = list(range(max_num_seqs - 1, -1, -1))
        self.generators: dict[str, torch.Generator] = {}
        self.sampler = Sampler(seed)

    # -- rows ----------------------------------------------------------------------------------

    def release(self, requests: Iterable[Request]) -> None:
        """Forget finished or preempted requests (their cache was freed by the scheduler)."""
        for req in requests:
            row = self.rows.pop(req.request_id, None)
            if row is not None:
                for table in self.tables.values():
                    table.clear_row(row)
                self.free_rows.append(row)
            if req.is_finished:
                self.generators.pop(req.request_id, None)

    def _row_of(self, req: Request) -> int:
        row = self.rows.get(req.request_id)
        if row is None:
            row = self.free_rows.pop()
            self.rows[req.request_id] = row
            for table in self.tables.values():
                table.clear_row(row)
        return row

    # -- cache edits ---------------------------------------------------------------------------

    def _apply_allocations(self, out: SchedulerOutput) -> None:
        for gid, pages in out.new_attention_pages.items():
            self.buffers.zero_pages(gid, pages, self.backend.zero_pages)
        for chunk in out.chunks:
            row = self._row_of(chunk.request)
            for gid, blocks in chunk.allocation.new_blocks.items():
                self.tables[gid].append_blocks(row, blocks)
        self._copy_states([op for c in out.chunks for op in c.allocation.copies_in])

    def _copy_states(self, ops: Sequence[tuple[int, int, int]]) -> None:
        """(group, src page, dst page): copy every state tensor of every layer of the group."""
        by_group: dict[int, tuple[list[int], list[int]]] = {}
        for gid, src, dst in ops:
            srcs, dsts = by_group.setdefault(gid, ([], []))
            srcs.append(src)
            dsts.append(dst)
        for gid, (srcs, dsts) in by_group.items():
            src_t = torch.tensor(srcs, device=self.device)
            dst_t = torch.tensor(dsts, device=self.device)
            for name in self.plan.groups[gid].layer_names:
                for view in self.buffers.views[name].values():  # type: ignore[union-attr]
                    view[dst_t] = view[src_t]

    # -- batch ---------------------------------------------------------------------------------

    def build_batch(self, chunks: Sequence[ScheduledChunk]) -> ForwardBatch:
        dev = self.device
        starts = torch.tensor([c.start for c in chunks], dtype=torch.int64)
        q_lens = torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64)
        rows = torch.tensor([self.rows[c.request.request_id] for c in chunks], dtype=torch.int64)
        qsl = torch.zeros(len(chunks) + 1, dtype=torch.int64)
        torch.cumsum(q_lens, 0, out=qsl[1:])
        ids = [t for c in chunks for t in c.request.all_token_ids[c.start : c.end]]
        num_tokens = int(qsl[-1])
        # position of every token: its request's start + its index inside the chunk
        seq_of_token = torch.repeat_interleave(torch.arange(len(chunks)), q_lens)
        positions = starts[seq_of_token] + torch.arange(num_tokens) - qsl[:-1][seq_of_token]
        seq_lens = (starts + q_lens).to(torch.int32)
        max_q = int(q_lens.max())
        token_rows = rows[seq_of_token]
        attention = {
            gid: AttentionMetadata(
                block_table=table.table.index_select(0, rows.to(dev)),
                slot_mapping=table.slot_mapping(token_rows, positions),
                query_start_loc=qsl.to(dev, torch.int32),
                seq_lens=seq_lens.to(dev),
                max_query_len=max_q,
                max_seq_len=int(seq_lens.max()),
            )
            for gid, table in self.tables.items()
        }
        state = {
            gid: StateMetadata(
                state_pages=torch.tensor(
                    [self.cache.state_page(c.request, gid) for c in chunks],
                    dtype=torch.int64,
                    device=dev,
                ),
                has_initial_state=(starts > 0).to(dev),
                query_start_loc=qsl.to(dev, torch.int32),
                max_query_len=max_q,
            )
            for gid in self.state_group_ids
        }
        sampling = [i for i, c in enumerate(chunks) if c.samples]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=positions.to(dev),
            query_start_loc=qsl.to(dev, torch.int32),
            seq_lens=seq_lens.to(dev),
            max_query_len=max_q,
            logits_indices=(qsl[1:] - 1)[sampling].to(dev),
            attention=attention,
            state=state,
            group_of_layer=self.group_of_layer,
        )

    # -- step ----------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> dict[str, Sample]:
        """Run one scheduled step; returns the sampled token of every request that samples."""
        self.release(out.preempted)
        if out.is_empty:
            return {}
        self._apply_allocations(out)
        batch = self.build_batch(out.chunks)
        hidden = self.model(batch)
        samplers = [c.request for c in out.chunks if c.samples]
        samples: list[Sample] = []
        if samplers:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            gens = [self._generator(r) for r in samplers]
            samples = self.sampler(logits, [r.sampling_params for r in samplers], gens)
        self._copy_states([op for c in out.chunks for op in c.allocation.snapshots])
        return {r.request_id: s for r, s in zip(samplers, samples, strict=True)}

    def _generator(self, req: Request) -> torch.Generator | None:
        seed = req.sampling_params.seed
        if seed is None:
            return None
        gen = self.generators.get(req.request_id)
        if gen is None:
            gen = torch.Generator().manual_seed(seed)
            self.generators[req.request_id] = gen
        return gen
