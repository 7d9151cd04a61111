"""The argument checks and conversions every wrapper family of this folder shares (the Python
side of `hkv_common.h`): which dtypes a kernel that takes both float types accepts, the
bfloat16 flag the kernels take, rows with unit column stride, float32 copies of weights."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16)  # what the kernels that take both accept


def is_f32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)


def is_float_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype in FLOAT_DTYPES and t.device.type == "cpu" for t in tensors)


def is_bf16(t: torch.Tensor) -> int:
    return int(t.dtype == torch.bfloat16)


def contiguous_f32(t: torch.Tensor) -> torch.Tensor:
    return t.float().contiguous()


def as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x as [rows, cols] with unit column stride (a view when possible), None unless float32 or
    bfloat16."""
    if x.dtype not in FLOAT_DTYPES or x.device.type != "cpu":
        return None
    rows = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    return rows if rows.stride(-1) == 1 else rows.contiguous()
