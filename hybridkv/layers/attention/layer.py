"""The attention module models use: writes new K/V by slot, then attends over the paged cache."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.layers.attention.base import AttentionImpl
from hybridkv.worker.batch import ForwardBatch


class PagedAttention(nn.Module):
    """Attention over one cache layer's kernel blocks. q/k/v come already projected (and
    rotated); the cache view and the backend are bound once when the cache is allocated."""

    def __init__(
        self,
        layer_name: str,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.layer_name = layer_name
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.kv_cache: torch.Tensor | None = None
        self.backend: AttentionImpl | None = None

    def bind(self, kv_cache: torch.Tensor, backend: AttentionImpl) -> None:
        # kv_cache: [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]
        self.kv_cache, self.backend = kv_cache, backend

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads * head_dim]."""
        assert self.kv_cache is not None and self.backend is not None, "cache not bound"
        meta = batch.attention_for(self.layer_name)
        self.backend.write_kv_cache(k, v, self.kv_cache, meta.slot_mapping)
        out = self.backend.forward(q, self.kv_cache, meta, self.scale, self.sliding_window)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
