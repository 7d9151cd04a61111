"""The attention backend interface (its per-step, per-group metadata, `AttentionMetadata`, is in
`hybridkv.forward_batch`)."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Protocol

import torch

from hybridkv.forward_batch import AttentionMetadata


class AttentionImpl(Protocol):
    """A backend implementation: writes new K/V by slot and attends over the paged cache.

    `forward` gets a `softcap` only where the backend's declaration says `softcap=True`: the
    plan gives a soft-capped group no other backend (`AttentionBackendInfo.why_not`)."""

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
        softcap: float | None = None,  # c > 0: scores s become c * tanh(s / c) (logit capping)
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


class KernelModuleBackend:
    """An `AttentionImpl` over a kernels module that provides `write_kv_cache(k, v, kv_cache,
    slot_mapping)`, `zero_pages(buffer_2d, page_ids)` and `paged_attention(q, kv_cache,
    block_table, query_start_loc, seq_lens, scale, sliding_window, max_query_len, max_seq_len,
    sinks=, softcap=)` (hybridkv.ops.attention, Triton's)."""

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
        softcap: float | None = None,
    ) -> torch.Tensor:
        extra: dict = {} if sinks is None else {"sinks": sinks}
        if softcap is not None:
            extra["softcap"] = softcap
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
