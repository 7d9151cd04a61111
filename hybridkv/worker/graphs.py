"""Captured decode steps on the CPU: a decode step replayed as one native call.

At batch 1 a decode step's arithmetic is the weights streamed once through the GEMVs; what
the interpreter adds around its hundred kernel calls (modules, wrappers, ctypes, tensor
allocations) was 20-30% of the step on the 100m model. When a step is made only of native
kernel calls, `hybridkv.ops.native.program.capture` records them, and later steps of the same
shape run the recording in C (`program.c`), the way CUDA graphs replay launches on a GPU.

What a captured step reads lives in fixed buffers of its batch size (`StaticInputs`): each
step writes its values there in NumPy, then replays:

    step of S decodes --> ids, positions, seq_lens [S];  per attention group: block table rows
                          [S, max_blocks], slots [S];  per state group: state pages [S]
                      --> program.run()  --> logits [S, vocab] (a fixed buffer too)

Which steps: decodes only (one token per request, each with a state, each sampling), up to
`max_size` requests, on the CPU, one process (no tensor parallelism). A size is captured at
its second step (the first runs eagerly and computes what the kernels keep with the weights,
such as transposed conv weights), and from its third step on it replays. A model whose step
computes anything outside native kernels (a PyTorch op somewhere, e.g. a family's MoE routing)
cannot be captured: the first attempt says why in the log and every step stays eager. The
captured program is the eager step's own calls, so its results are the eager step's, bit for
bit (tests/worker/test_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridkv.core.scheduler import ScheduledChunk
from hybridkv.forward_batch import AttentionMetadata, ForwardBatch, StateMetadata
from hybridkv.ops.native.program import Arena, Program, capture
from hybridkv.ops.native.spans import provide_spans

if TYPE_CHECKING:
    from hybridkv.worker.model_runner import ModelRunner

logger = logging.getLogger("hybridkv")


@dataclass(frozen=True)
class StaticInputs:
    """The input buffers of one batch size, as NumPy views (written every step) and as the
    ForwardBatch the captured step read (the same memory)."""

    ids: np.ndarray  # [S] int64
    positions: np.ndarray  # [S] int64
    seq_lens: np.ndarray  # [S] int32
    tables: dict[int, tuple[np.ndarray, np.ndarray]]  # attention group -> [S, max_blocks], [S]
    pages: dict[int, np.ndarray]  # state group -> [S] int64
    batch: ForwardBatch
    # the state kernels' has-initial flags (uint8), first tokens and token counts: the same
    # for every decode step of this size
    spans: tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CapturedStep:
    inputs: StaticInputs
    program: Program
    # [S, vocab] float32: what the program writes, in the arena the captured sizes share (read
    # it before the next step)
    logits: torch.Tensor


def is_decode_step(chunks: Sequence[ScheduledChunk]) -> bool:
    """One token per request, each continuing a request (a state to read) and sampling."""
    return all(c.num_tokens == 1 and c.start > 0 and c.samples for c in chunks)


class DecodeGraphs:
    """The captured decode steps of one model runner, by batch size."""

    def __init__(self, runner: ModelRunner, max_size: int) -> None:
        self.runner = runner
        self.max_size = max_size
        self.steps: dict[int, CapturedStep] = {}
        self.seen: dict[int, int] = {}
        self.disabled: str | None = None  # why this model's steps cannot be captured
        self.replays = 0
        # what the captured steps allocate: one step runs at a time, so all sizes share it
        self.arena = Arena()

    def logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """The logits of a decode step ([S, vocab] float32, one row per chunk), from its
        captured program (capturing it first at the second step of this size); None: run the
        step eagerly."""
        size = len(chunks)
        if self.disabled or not 0 < size <= self.max_size or not is_decode_step(chunks):
            return None
        step = self.steps.get(size)
        if step is not None:
            self._fill(step.inputs, chunks)
            step.program.run()
            self.replays += 1
            return step.logits
        self.seen[size] = self.seen.get(size, 0) + 1
        if self.seen[size] < 2:
            return None
        return self._capture(chunks)

    def _capture(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        inputs = self._static_inputs(len(chunks))
        self._fill(inputs, chunks)
        self._provide_spans(inputs)
        model = self.runner.model
        logits, program, why = capture(
            lambda: model.compute_logits(model(inputs.batch)), self.arena
        )
        if program is None:
            self.disabled = why
            logger.info("decode steps of this model run eagerly: %s", why)
        else:
            self.steps[len(chunks)] = CapturedStep(inputs, program, logits)
        return logits

    # -- the static inputs ---------------------------------------------------------------------

    def _static_inputs(self, size: int) -> StaticInputs:
        """Buffers for `size` decodes, and the step metadata over them: query_start_loc,
        logits_indices, has_initial_state and the state kernels' spans are the same for
        every decode step of this size, the rest is written by `_fill`."""
        runner = self.runner
        ids = np.zeros(size, np.int64)
        positions = np.zeros(size, np.int64)
        seq_lens = np.ones(size, np.int32)
        qsl = torch.arange(size + 1, dtype=torch.int32)
        seq_lens_t = torch.from_numpy(seq_lens)
        tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        attention: dict[int, AttentionMetadata] = {}
        for gid, table in runner.tables.items():
            width = table.table.shape[1]
            rows, slots = np.zeros((size, width), np.int32), np.zeros(size, np.int64)
            tables[gid] = (rows, slots)
            attention[gid] = AttentionMetadata(
                block_table=torch.from_numpy(rows),
                slot_mapping=torch.from_numpy(slots),
                query_start_loc=qsl,
                seq_lens=seq_lens_t,
                max_query_len=1,
                max_seq_len=width * table.kernel_block_size,  # (an upper bound of any step's)
            )
        pages: dict[int, np.ndarray] = {}
        state: dict[int, StateMetadata] = {}
        has = torch.ones(size, dtype=torch.bool)
        spans_rest = (
            torch.ones(size, dtype=torch.uint8),  # has_initial_state as the kernels take it
            torch.arange(size, dtype=torch.int64),  # each request's token
            torch.ones(size, dtype=torch.int64),  # one token each
        )
        for gid in runner.state_pages:
            pages[gid] = np.zeros(size, np.int64)
            meta = StateMetadata(
                state_pages=torch.from_numpy(pages[gid]),
                has_initial_state=has,
                query_start_loc=qsl,
                max_query_len=1,
            )
            state[gid] = meta
        batch = ForwardBatch(
            input_ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            query_start_loc=qsl,
            seq_lens=seq_lens_t,
            max_query_len=1,
            logits_indices=torch.arange(size, dtype=torch.int64),
            attention=attention,
            state=state,
        )
        return StaticInputs(ids, positions, seq_lens, tables, pages, batch, spans_rest)

    def _fill(self, inputs: StaticInputs, chunks: Sequence[ScheduledChunk]) -> None:
        """Write this step's values into the buffers the captured program reads."""
        runner, size = self.runner, len(chunks)
        rows = np.fromiter((runner.rows[c.request_id] for c in chunks), np.int64, size)
        inputs.ids[:] = np.fromiter((c.token_ids[0] for c in chunks), np.int64, size)
        inputs.positions[:] = np.fromiter((c.start for c in chunks), np.int64, size)
        inputs.seq_lens[:] = inputs.positions + 1
        for gid, table in runner.tables.items():
            block_rows, slots = inputs.tables[gid]
            host = table.host_table()
            assert host is not None  # (CPU tables only)
            np.take(host, rows, axis=0, out=block_rows)
            slots[:] = table.slot_mapping_host(rows, inputs.positions)
        for gid, pages in runner.state_pages.items():
            np.take(pages.numpy(), rows, out=inputs.pages[gid])

    def _provide_spans(self, inputs: StaticInputs) -> None:
        """Hand the state kernels the capture step's spans (the same tensors every replay
        reads), so that they convert nothing with tensor ops."""
        size = inputs.ids.shape[0]
        for gid, meta in inputs.batch.state.items():
            pages = inputs.pages[gid]
            provide_spans(
                meta.state_pages, meta.has_initial_state, meta.query_start_loc,
                (meta.state_pages, *inputs.spans), (int(pages.min()), int(pages.max()), 1, 0, size),
            )  # fmt: skip
