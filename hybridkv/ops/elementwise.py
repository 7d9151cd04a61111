"""Element-wise steps between the layers: the residual add and the float32 logits.

Native kernels (`hybridkv.ops.native.elementwise`) where they apply, rounding as the PyTorch
expressions here do (the reference, and the path for other dtypes and devices). A decode step
made only of kernel calls can be captured and replayed (`hybridkv.ops.native.program`); these
keep the steps between the layers inside it.
"""

from __future__ import annotations

import torch

from hybridkv.ops.native import elementwise as native_ew


def residual_add(x: torch.Tensor, h: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
    """x + h * multiplier (x + h when multiplier is 1): the residual stream after a block."""
    out = native_ew.add_scaled(x, h, multiplier)
    if out is not None:
        return out
    return x + h if multiplier == 1.0 else x + h * multiplier


def logits_float32(logits: torch.Tensor, divisor: float = 1.0) -> torch.Tensor:
    """The lm_head's output as float32 logits, divided by `divisor` (a family's logit scale).
    logits: [n, vocab]."""
    out = native_ew.logits_f32(logits, divisor) if logits.dim() == 2 else None
    if out is not None:
        return out
    out = logits.float()
    return out if divisor == 1.0 else out / divisor


def to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype), exactly as torch converts, on a native kernel for a contiguous float32 <->
    bfloat16 conversion on the CPU (a decode step that converts stays capturable)."""
    if x.dtype == dtype:
        return x
    if x.dtype == torch.bfloat16 and dtype == torch.float32:
        return logits_float32(x)  # (the exact widening: nothing divided)
    out = native_ew.to_bfloat16(x) if dtype == torch.bfloat16 else None
    return out if out is not None else x.to(dtype)
