"""The immutable description of one forward step, passed down the model's call stack.

    requests (packed):  | r0: 5 prefill tokens | r1: 1 decode | r2: 3 prefill (chunk) |
    query_start_loc:    0                      5              6                      9
    positions:          p0 .. p0+4              q              s .. s+2
    logits_indices:                         4              5                      8   (samplers)

Each attention group has its own kernel block table and slot mapping (its kernel block size may
differ); each state group its running-state page per request. Nothing here is mutated after
construction, and no layer reads any other global context.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hybridkv.layers.attention.base import AttentionMetadata
from hybridkv.layers.state_base import StateMetadata


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
