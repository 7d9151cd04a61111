"""Per-step metadata of a state group (Mamba1/2, gated delta net, short conv, KDA)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateMetadata:
    """What a state mixer needs for one state group in one step (immutable).

    Requests are packed as in `AttentionMetadata`. Each request's running state lives in one
    page of the group (`state_pages`); a request that starts from nothing has
    `has_initial_state = False` and its page content must be ignored (it may hold NaN bit
    patterns left by an attention group: select with `where`, never multiply by zero).
    """

    state_pages: torch.Tensor  # [num_seqs] int64 page id of each request's running state
    has_initial_state: torch.Tensor  # [num_seqs] bool
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int

    @property
    def num_seqs(self) -> int:
        return self.state_pages.shape[0]

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
