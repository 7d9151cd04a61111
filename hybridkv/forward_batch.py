"""The immutable description of one forward step, passed down the model's call stack: the
batch (`ForwardBatch`) and the per-group metadata it carries (`AttentionMetadata` for each
attention group, `StateMetadata` for each state group).

    requests (packed):  | r0: 5 prefill tokens | r1: 1 decode | r2: 3 prefill (chunk) |
    query_start_loc:    0                      5              6                      9
    positions:          p0 .. p0+4              q              s .. s+2
    logits_indices:                         4              5                      8   (samplers)

Each attention group has its own kernel block table and slot mapping (its kernel block size may
differ); each state group its running-state page per request. Nothing here is mutated after
construction, and no layer reads any other global context.

These are the ground floor of the package: the worker builds them, the layers and the ops read
them, and this module imports nothing of hybridkv (tests/test_layering.py checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

# Continuation steps whose chunks are at most this long attend as decode rows: one row of
# AttentionMetadata per token (its request's table row, seq_len = its position + 1), so each
# query computes what the decode step of its position would (speculative decoding's verify
# chunks, the tokens a rejection recomputes, small prefill pieces).
DECODE_ROWS_MAX_QUERY = 16


@dataclass(frozen=True)
class AttentionMetadata:
    """What an attention kernel needs for one attention group in one step (immutable).

    Requests are packed: request s owns query tokens query_start_loc[s]:query_start_loc[s+1],
    the last q_len of its seq_lens[s] context tokens.
    """

    block_table: torch.Tensor  # [num_seqs, max_kernel_blocks] int32 kernel-block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 for padding
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class StateMetadata:
    """What a state mixer (Mamba1/2, gated delta net, short conv, KDA) needs for one state group
    in one step (immutable).

    Requests are packed as in `AttentionMetadata`. Each request's running state lives in one
    page of the group (`state_pages`); a request that starts from nothing has
    `has_initial_state = False` and its page content must be ignored (it may hold NaN bit
    patterns left by an attention group: select with `where`, never multiply by zero).
    """

    state_pages: torch.Tensor  # [num_seqs] int64 page id of each request's running state
    has_initial_state: torch.Tensor  # [num_seqs] bool
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    # speculative decoding with per-position states (state ops that declare
    # `keeps_positions`): [num_seqs] int64, each request's scratch row (-1: none). The layer
    # also writes the state after each of such a request's tokens but its last into row
    # `scratch_rows[s]`, position i of its `StateCache.positions` (None: a step without drafts)
    scratch_rows: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.state_pages.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1


@dataclass(frozen=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context length after this step
    max_query_len: int
    logits_indices: torch.Tensor  # [num_sampled] int64, last token of each sampling request
    attention: Mapping[int, AttentionMetadata]  # attention group id -> metadata
    state: Mapping[int, StateMetadata]  # state group id -> metadata

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def metadata_for(self, group_id: int) -> AttentionMetadata | StateMetadata:
        """A group's metadata (modules find theirs through `CacheOwner.step_metadata`)."""
        meta = self.attention.get(group_id)
        return meta if meta is not None else self.state[group_id]
