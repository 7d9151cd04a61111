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
                      --> program.run()  --> logits [S, vocab] (a fixed buffer too), and
                          the final hidden states [S, hidden] the MTP drafter takes

Which steps: decodes (one token per request, each with a state, each sampling) and uniform
verify steps of speculative decoding (q tokens per request, the last known token and q - 1
drafts, every one sampling; their attention runs as decode rows, see
`ModelRunner.build_batch`), up to `max_size` requests, on the CPU, one process (no tensor
parallelism). A shape is (requests S, tokens per request q):

    ids, positions [S*q];  per attention group: block table rows [S*q, max_blocks] (a request's
    row once per token), slots [S*q], seq_lens [S*q] (position + 1);  per state group: state
    pages [S]  -->  program.run()  -->  logits [S*q, vocab] A size is captured at
its second step (the first runs eagerly and computes what the kernels keep with the weights,
such as transposed conv weights), and from its third step on it replays; a verify shape
(q > 1), once any shape was captured, at its first. A model whose step
computes anything outside native kernels (a PyTorch op somewhere, e.g. a family's MoE routing)
cannot be captured: the first attempt says why in the log and every step stays eager. The
captured program is the eager step's own calls, so its results are the eager step's, bit for
bit (tests/worker/test_graphs.py).

The MTP drafter's passes (speculative decoding, method "mtp": `MtpDrafter`) are captured the
same way by `MtpGraphs`, with the same policy: a uniform pass (q pairs per request, every
request drafting; the passes after the first are one pair per request, the first is uniform
where every request left the same number of pairs) of S requests is a shape (S, q), its
program the MTP forward, the draft logits and their argmax:

    pairs of S requests --> next ids, slot positions p, RoPE positions p + 1 [S*q], block
                            table rows, slots, seq_lens (p + 1) [S*q], hidden [S*q, H]
                        --> program.run() --> outputs [S*q, H] (arena), and at each
                            request's last pair the draft logits [S, vocab] and greedy
                            drafts [S] (arena)

The passes run before the step's forward and
share its arena (one program runs at a time). CPU, one process: under tensor parallelism no
step is captured, MTP passes included (their drafts reach the other ranks by an all-reduce).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from hybridkv.core.scheduler import ScheduledChunk
from hybridkv.forward_batch import (
    DECODE_ROWS_MAX_QUERY,
    AttentionMetadata,
    ForwardBatch,
    StateMetadata,
)
from hybridkv.ops.native.program import Arena, Program, capture
from hybridkv.ops.native.spans import provide_spans
from hybridkv.worker.sampler import ARGMAX

if TYPE_CHECKING:
    from hybridkv.worker.model_runner import ModelRunner

logger = logging.getLogger("hybridkv")


@dataclass(frozen=True)
class StaticInputs:
    """The input buffers of one batch size, as NumPy views (written every step) and as the
    ForwardBatch the captured step read (the same memory)."""

    ids: np.ndarray  # [S*q] int64
    positions: np.ndarray  # [S*q] int64
    seq_lens: np.ndarray  # [S*q] int32: each token row's (attention)
    request_lens: np.ndarray  # [S] int32: each request's tokens after the step
    # attention group -> [S*q, max_blocks], [S*q]
    tables: dict[int, tuple[np.ndarray, np.ndarray]]
    pages: dict[int, np.ndarray]  # state group -> [S] int64
    batch: ForwardBatch
    # the state kernels' has-initial flags (uint8), first tokens and token counts: the same
    # for every step of this shape
    spans: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    # [S] int64: each request's scratch row for per-position states (-1: none), verify
    # shapes of state ops that keep them (`ModelRunner.keeps_positions`); else None
    scratch_rows: np.ndarray | None = None


@dataclass(frozen=True)
class CapturedStep:
    inputs: StaticInputs
    program: Program
    # [S, vocab] float32: what the program writes, in the arena the captured sizes share (read
    # it before the next step)
    logits: torch.Tensor
    hidden: torch.Tensor  # [S*q, hidden]: the model's output the logits came from (arena)


def uniform_tokens(chunks: Sequence[ScheduledChunk]) -> int:
    """q when every chunk continues its request with q tokens and samples (a decode: q = 1; a
    verify step: known tokens then drafts, q in all), else 0. The program computes the logits
    of all q tokens of each; the runner keeps the rows each chunk asks for."""
    if not chunks:
        return 0
    q = chunks[0].num_tokens
    if q > DECODE_ROWS_MAX_QUERY:
        return 0
    ok = all(c.num_tokens == q and c.start > 0 and c.samples for c in chunks)
    return q if ok else 0


class CapturedShapes:
    """What the captured decode steps and the captured MTP passes share: the capture policy
    by shape (requests S, tokens each q), the static inputs of a shape and the arena."""

    def __init__(self, runner: ModelRunner, max_size: int, arena: Arena | None = None) -> None:
        self.runner = runner
        self.max_size = max_size
        self.seen: dict[tuple[int, int], int] = {}
        self.disabled: str | None = None  # why this model's q = 1 shapes cannot be captured
        # q > 1 shapes whose capture was refused, and why (e.g. more rows than a native MoE
        # kernel takes): they run eagerly, the other shapes are still captured
        self.refused: dict[tuple[int, int], str] = {}
        self.replays = 0
        # what the captured programs allocate: one runs at a time, so all shapes share it
        self.arena = Arena() if arena is None else arena

    def may_capture(self, size: int, q: int) -> bool:
        """Whether a step of `size` chunks of q tokens each runs (or may yet run) as a captured
        program: not refused so far (a decode shape is tried at its second step, a verify shape
        at its first)."""
        return (
            self.disabled is None
            and 0 < size <= self.max_size
            and 0 < q <= DECODE_ROWS_MAX_QUERY
            and (size, q) not in self.refused
        )

    def _eligible(self, size: int, q: int) -> bool:
        """Whether a uniform step of this shape (q = 0: not uniform) may run captured."""
        return bool(q) and self.may_capture(size, q)

    def _capture_now(self, shape: tuple[int, int], any_captured: bool) -> bool:
        """Counts a sight of a shape not captured yet; whether to capture it now.

        A decode batch size waits for its second step (sizes the batch only passes through
        are not worth a capture). A verify shape (q > 1) is scheduled on purpose, by a draft
        policy that will run it again (adaptive_k measures each shape it explores), so it
        captures at first sight instead of paying an eager step first, once some shape was
        captured: an eager step has then computed what the kernels keep with the weights."""
        self.seen[shape] = self.seen.get(shape, 0) + 1
        first_sight = shape[1] > 1 and any_captured
        return self.seen[shape] >= 2 or first_sight

    def _refuse(self, shape: tuple[int, int], why: str | None, what: str) -> None:
        """A refused capture: a q > 1 shape stays eager, a refused q = 1 shape disables all."""
        if shape[1] > 1:
            self.refused[shape] = why or ""
            logger.info("%s of %d x %d tokens run eagerly: %s", what, *shape, why)
        else:
            self.disabled = why
            logger.info("%s of this model run eagerly: %s", what, why)

    # -- the static inputs ---------------------------------------------------------------------

    def _static_inputs(self, size: int, q: int = 1) -> StaticInputs:
        """Buffers for `size` requests of `q` tokens each, and the step metadata over them:
        query_start_loc, logits_indices, has_initial_state and the state kernels' spans are
        the same for every step of this shape, the rest is written by `_fill`. Attention sees
        one decode row per token (q = 1: one per request), the state layers q-token chunks."""
        runner = self.runner
        num_tokens = size * q
        ids = np.zeros(num_tokens, np.int64)
        positions = np.zeros(num_tokens, np.int64)
        seq_lens = np.ones(num_tokens, np.int32)
        request_lens = np.ones(size, np.int32)
        rows_qsl = torch.arange(num_tokens + 1, dtype=torch.int32)  # one query per row
        qsl = torch.arange(0, num_tokens + 1, q, dtype=torch.int32)  # q tokens per request
        seq_lens_t = torch.from_numpy(seq_lens)
        tables: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        attention: dict[int, AttentionMetadata] = {}
        for gid, table in runner.tables.items():
            width = table.table.shape[1]
            rows = np.zeros((num_tokens, width), np.int32)
            slots = np.zeros(num_tokens, np.int64)
            tables[gid] = (rows, slots)
            attention[gid] = AttentionMetadata(
                block_table=torch.from_numpy(rows),
                slot_mapping=torch.from_numpy(slots),
                query_start_loc=rows_qsl,
                seq_lens=seq_lens_t,
                max_query_len=1,
                max_seq_len=width * table.kernel_block_size,  # (an upper bound of any step's)
            )
        pages: dict[int, np.ndarray] = {}
        state: dict[int, StateMetadata] = {}
        has = torch.ones(size, dtype=torch.bool)
        spans_rest = (
            torch.ones(size, dtype=torch.uint8),  # has_initial_state as the kernels take it
            torch.arange(0, num_tokens, q, dtype=torch.int64),  # each request's first token
            torch.full((size,), q, dtype=torch.int64),  # q tokens each
        )
        scratch_rows = np.full(size, -1, np.int64) if q > 1 and runner.keeps_positions else None
        for gid in runner.state_pages:
            pages[gid] = np.zeros(size, np.int64)
            state[gid] = StateMetadata(
                state_pages=torch.from_numpy(pages[gid]),
                has_initial_state=has,
                query_start_loc=qsl,
                max_query_len=q,
                scratch_rows=None if scratch_rows is None else torch.from_numpy(scratch_rows),
            )
        batch = ForwardBatch(
            input_ids=torch.from_numpy(ids),
            positions=torch.from_numpy(positions),
            query_start_loc=qsl,
            seq_lens=torch.from_numpy(request_lens),
            max_query_len=q,
            logits_indices=torch.arange(num_tokens, dtype=torch.int64),
            attention=attention,
            state=state,
        )
        return StaticInputs(
            ids, positions, seq_lens, request_lens, tables, pages, batch, spans_rest,
            scratch_rows,
        )  # fmt: skip

    def _fill(self, inputs: StaticInputs, chunks: Sequence[ScheduledChunk], q: int) -> None:
        """Write this step's values into the buffers the captured program reads."""
        runner, size = self.runner, len(chunks)
        rows = np.fromiter((runner.rows[c.request_id] for c in chunks), np.int64, size)
        starts = np.fromiter((c.start for c in chunks), np.int64, size)
        if q == 1:
            inputs.ids[:] = np.fromiter((c.token_ids[0] for c in chunks), np.int64, size)
            inputs.positions[:] = starts
            token_rows = rows
        else:
            ids = (t for c in chunks for t in c.token_ids)
            inputs.ids[:] = np.fromiter(ids, np.int64, size * q)
            inputs.positions[:] = np.repeat(starts, q) + np.tile(np.arange(q), size)
            token_rows = np.repeat(rows, q)
        inputs.seq_lens[:] = inputs.positions + 1
        inputs.request_lens[:] = starts + q
        for gid, table in runner.tables.items():
            block_rows, slots = inputs.tables[gid]
            host = table.host_table()
            assert host is not None  # (CPU tables only)
            np.take(host, token_rows, axis=0, out=block_rows)
            slots[:] = table.slot_mapping_host(token_rows, inputs.positions)
        for gid, pages in runner.state_pages.items():
            np.take(pages.numpy(), rows, out=inputs.pages[gid])
        if inputs.scratch_rows is not None:
            scratch_rows = runner.scratch_rows(chunks)  # (checked against the scratch)
            inputs.scratch_rows[:] = -1 if scratch_rows is None else scratch_rows


class DecodeGraphs(CapturedShapes):
    """The captured decode steps of one model runner, by batch size."""

    def __init__(self, runner: ModelRunner, max_size: int) -> None:
        super().__init__(runner, max_size)
        self.steps: dict[tuple[int, int], CapturedStep] = {}  # (requests, tokens each)
        # the final hidden states of the last step `logits` answered ([S*q, hidden], arena
        # memory: copy what must outlive the next step)
        self.hidden: torch.Tensor | None = None

    def logits(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        """The logits of a decode or uniform verify step ([S*q, vocab] float32, q rows per
        chunk), from its captured program (capturing it first: at the second step of a decode
        shape, the first of a verify shape); None: run the step eagerly."""
        size, q = len(chunks), uniform_tokens(chunks)
        if not self._eligible(size, q):
            return None
        step = self.steps.get((size, q))
        if step is not None:
            self._fill(step.inputs, chunks, q)
            step.program.run()
            self.replays += 1
            self.hidden = step.hidden
            return step.logits
        if not self._capture_now((size, q), bool(self.steps)):
            return None
        return self._capture(chunks, q)

    def _capture(self, chunks: Sequence[ScheduledChunk], q: int) -> torch.Tensor:
        inputs = self._static_inputs(len(chunks), q)
        self._fill(inputs, chunks, q)
        self._provide_spans(inputs, q)
        model = self.runner.model

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            hidden = model(inputs.batch)
            return hidden, model.compute_logits(hidden)

        (hidden, logits), program, why = capture(forward, self.arena)
        self.hidden = hidden
        if program is None:
            self._refuse((len(chunks), q), why, "verify steps" if q > 1 else "decode steps")
        else:
            self.steps[(len(chunks), q)] = CapturedStep(inputs, program, logits, hidden)
        return logits

    def _provide_spans(self, inputs: StaticInputs, q: int) -> None:
        """Hand the state kernels the capture step's spans (the same tensors every replay
        reads), so that they convert nothing with tensor ops."""
        num_tokens = inputs.ids.shape[0]
        for gid, meta in inputs.batch.state.items():
            pages = inputs.pages[gid]
            bounds = (int(pages.min()), int(pages.max()), q, 0, num_tokens)
            provide_spans(
                meta.state_pages, meta.has_initial_state, meta.query_start_loc,
                (meta.state_pages, *inputs.spans), bounds,
            )  # fmt: skip


@dataclass(frozen=True)
class PassInputs:
    """The static inputs of an MTP pass shape (requests S, pairs each q)."""

    step: StaticInputs  # its positions: the pairs' slots p (block tables, seq_lens p + 1)
    rope: np.ndarray  # [S*q] int64: the RoPE positions the pass reads, p + 1
    hidden: torch.Tensor  # [S*q, H]: the pairs' hidden states (outside the arena)
    batch: ForwardBatch  # `step.batch` at the RoPE positions


@dataclass(frozen=True)
class CapturedPass:
    inputs: PassInputs
    program: Program
    out: torch.Tensor  # [S*q, H] (arena): the MTP outputs, the next pass's hidden states
    drafts: torch.Tensor  # [S] int64 (arena): the greedy draft at each request's last pair


class MtpGraphs(CapturedShapes):
    """The captured MTP passes of one model runner (`MtpDrafter`), by shape (requests, pairs
    each), under the decode steps' policy: a one-pair shape at its second pass, a shape of
    q > 1 pairs at its first once some shape was captured; a model whose one-pair pass cannot
    be captured keeps every pass eager, a refused q > 1 shape keeps that shape eager."""

    def __init__(self, runner: ModelRunner, max_size: int, arena: Arena) -> None:
        super().__init__(runner, max_size, arena)  # (the decode steps' arena)
        self.passes: dict[tuple[int, int], CapturedPass] = {}

    def draft(
        self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor
    ) -> tuple[torch.Tensor, list[int]] | None:
        """One MTP pass over pairs laid out as chunks (`MtpDrafter._pass`), hidden [S*q, H]:
        (the outputs at each chunk's last pair [S, H], arena memory: copy it before the next
        program runs; each chunk's greedy draft [S]) from the captured program (capturing it
        first); None: run the pass eagerly."""
        size, q = len(chunks), uniform_tokens(chunks)
        if not self._eligible(size, q):
            return None
        step = self.passes.get((size, q))
        if step is not None:
            self._fill_pass(step.inputs, chunks, hidden, q)
            step.program.run()
            self.replays += 1
            out, drafts = step.out, step.drafts
        elif self._capture_now((size, q), bool(self.passes)):
            out, drafts = self._capture(chunks, hidden, q)
        else:
            return None
        return out[q - 1 :: q], drafts.tolist()  # (each chunk's last pair)

    def _capture(
        self, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor, q: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this pass while capturing its program: (outputs [S*q, H], drafts [S])."""
        step = self._static_inputs(len(chunks), q)
        rope = np.zeros_like(step.positions)
        batch = dataclasses.replace(step.batch, positions=torch.from_numpy(rope))
        inputs = PassInputs(step, rope, torch.empty_like(hidden), batch)
        self._fill_pass(inputs, chunks, hidden, q)
        model = self.runner.model

        def forward() -> tuple[torch.Tensor, torch.Tensor]:
            out = model.mtp_forward(batch.input_ids, inputs.hidden, batch)  # [S*q, H]
            last = out.view(len(chunks), q, -1)[:, q - 1]  # [S, H] (a view: rows q*H apart)
            logits = model.mtp_logits(last)  # [S, vocab] float32
            return out, ARGMAX.of(logits).first(logits)  # [S] int64

        (out, drafts), program, why = capture(forward, self.arena)
        if program is None:
            self._refuse((len(chunks), q), why, "MTP passes")
        else:
            self.passes[(len(chunks), q)] = CapturedPass(inputs, program, out, drafts)
        return out, drafts

    def _fill_pass(
        self, inputs: PassInputs, chunks: Sequence[ScheduledChunk], hidden: torch.Tensor, q: int
    ) -> None:
        """Write this pass's pairs into the buffers its program reads: the pairs' next ids and
        slots as a step's tokens (`_fill`), their RoPE positions p + 1, their hidden states."""
        self._fill(inputs.step, chunks, q)
        np.add(inputs.step.positions, 1, out=inputs.rope)
        inputs.hidden.copy_(hidden)
