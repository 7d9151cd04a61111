"""The attention backend interface and its per-step, per-group metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

import torch


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


class AttentionImpl(Protocol):
    """A backend implementation: writes new K/V by slot and attends over the paged cache."""

    name: str

    def write_kv_cache(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None: ...

    def zero_pages(self, buffer_2d: torch.Tensor, page_ids: Sequence[int] | torch.Tensor) -> None:
        """Zero pages ([num_pages, page_bytes] uint8 rows) newly handed to an attention group."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]: a softmax-denominator logit per head
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


class KernelModuleBackend:
    """An `AttentionImpl` over a kernels module that provides `write_kv_cache(k, v, kv_cache,
    slot_mapping)`, `zero_pages(buffer_2d, page_ids)` and `paged_attention(q, kv_cache,
    block_table, query_start_loc, seq_lens, scale, sliding_window, max_query_len, max_seq_len)`
    (hybridkv.ops.attention, Triton's)."""

    name = ""

    def kernels(self) -> ModuleType:
        raise NotImplementedError

    def write_kv_cache(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        self.kernels().write_kv_cache(k, v, kv_cache, slot_mapping)

    def zero_pages(self, buffer_2d: torch.Tensor, page_ids: Sequence[int] | torch.Tensor) -> None:
        self.kernels().zero_pages(buffer_2d, page_ids)

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        extra = {} if sinks is None else {"sinks": sinks}
        return self.kernels().paged_attention(
            q,
            kv_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window,
            meta.max_query_len,
            meta.max_seq_len,
            **extra,
        )
