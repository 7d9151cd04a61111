"""The `torch` attention backend: hybridkv's reference, any kernel block size, CPU default."""

from __future__ import annotations

import torch

from hybridkv.layers.attention.base import AttentionMetadata
from hybridkv.ops import attention as ops


class TorchAttentionBackend:
    name = "torch"

    def write_kv_cache(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        ops.write_kv_cache(k, v, kv_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return ops.paged_attention(
            q,
            kv_cache,
            meta.block_table,
            meta.query_start_loc,
            meta.seq_lens,
            scale,
            sliding_window,
            meta.max_query_len,
            meta.max_seq_len,
        )
