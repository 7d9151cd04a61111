"""Compute ops: PyTorch references, native CPU kernels (ops.native) and Triton GPU kernels."""

from __future__ import annotations

from types import ModuleType

import torch


def triton_state_kernels(t: torch.Tensor) -> ModuleType | None:
    """`hybridkv.ops.triton_mamba` when `t` lives on a GPU (CUDA or ROCm) and Triton is
    installed; None otherwise (the caller then runs its PyTorch path)."""
    if t.device.type != "cuda":
        return None
    try:
        from hybridkv.ops import triton_mamba
    except ImportError:  # Triton ships with CUDA and ROCm builds of PyTorch, but may be absent
        return None
    return triton_mamba
