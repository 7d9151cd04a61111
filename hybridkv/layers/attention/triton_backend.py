"""The `triton` attention backend: hybridkv's GPU kernels, any kernel block size multiple of 16.

The kernels live in `hybridkv.ops.triton_attention` and are imported on first use, so that
importing this backend never fixes whether Triton compiles or interprets them (without a GPU,
`TRITON_INTERPRET=1` must be set before the kernels module is imported).
"""

from __future__ import annotations

from types import ModuleType

import torch

from hybridkv.layers.attention.base import AttentionMetadata


def _ops() -> ModuleType:
    from hybridkv.ops import triton_attention

    return triton_attention


class TritonAttentionBackend:
    name = "triton"

    def write_kv_cache(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        _ops().write_kv_cache(k, v, kv_cache, slot_mapping)

    def forward(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        return _ops().paged_attention(
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
