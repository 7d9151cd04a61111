"""The `torch` attention backend: hybridkv's reference, any kernel block size, CPU default."""

from __future__ import annotations

from types import ModuleType

from hybridkv.layers.attention.base import KernelModuleBackend
from hybridkv.ops import attention


class TorchAttentionBackend(KernelModuleBackend):
    name = "torch"

    def kernels(self) -> ModuleType:
        return attention
