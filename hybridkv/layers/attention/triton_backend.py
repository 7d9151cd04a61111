"""The `triton` attention backend: hybridkv's GPU kernels, any kernel block size multiple of 16.

The kernels live in `hybridkv.ops.triton_attention` and are imported on first use, so that
importing this backend never fixes whether Triton compiles or interprets them (without a GPU,
`TRITON_INTERPRET=1` must be set before the kernels module is imported).
"""

from __future__ import annotations

from types import ModuleType

from hybridkv.layers.attention.base import KernelModuleBackend


class TritonAttentionBackend(KernelModuleBackend):
    name = "triton"

    def kernels(self) -> ModuleType:
        from hybridkv.ops import triton_attention

        return triton_attention
