"""The attention module models use: writes new K/V by slot, then attends over the paged cache."""

from __future__ import annotations

import torch

from hybridkv.forward_batch import AttentionMetadata, ForwardBatch
from hybridkv.kv.specs import AttentionSpec, CacheDtypes
from hybridkv.layers.cache import AttentionCache, CacheOwner


class PagedAttention(CacheOwner):
    """Attention over one cache layer's kernel blocks. q/k/v come already projected (and
    rotated). It declares its spec (`num_kv_heads` x `head_dim` K and V per token, inside
    `sliding_window` if set; `softcap`: scores capped to c * tanh(s / c), which only a backend
    declaring soft-capping is planned for); its view and its group's backend are bound once."""

    def __init__(
        self,
        layer_index: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__(layer_index)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        if softcap is not None and not softcap > 0:
            raise ValueError(f"softcap must be positive, got {softcap}")
        self.scale = scale
        self.sliding_window = sliding_window
        self.softcap = softcap

    def cache_spec(self, dtypes: CacheDtypes) -> AttentionSpec:
        return AttentionSpec(
            self.num_kv_heads, self.head_dim, dtypes.kv, self.sliding_window, self.softcap
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        batch: ForwardBatch,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim] -> [T, heads * head_dim].
        sinks: [heads] or None, the owner's per-head softmax-denominator logits (gpt-oss)."""
        cache = self.cache
        assert isinstance(cache, AttentionCache)
        meta: AttentionMetadata = self.step_metadata(batch)
        cache.backend.write_kv_cache(k, v, cache.kv, meta.slot_mapping)
        out = cache.backend.forward(
            q, cache.kv, meta, self.scale, self.sliding_window, sinks=sinks, softcap=self.softcap
        )
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)
