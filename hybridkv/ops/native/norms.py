"""The RMSNorms of `kernels.c`, each one pass over its rows (PyTorch makes four to six): plain
(`rms_norm`), fused with the residual add before it (`add_rms_norm`), and the mixers' gated,
grouped norm (`gated_rms_norm`), float32 or bfloat16, rounded where `ops.norm` (the
reference) rounds: with SwiGLU's silu * up (`elementwise.py`) 1.6 to 2.5x on the 100M model's
prefill shapes (benchmarks/cpu_kernels.py). Each returns None when the library or these tensors
are not supported."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.derived import derived
from hybridkv.ops.native.common import (
    FLOAT_DTYPES,
    as_rows,
    contiguous_f32,
    is_bf16,
    is_float_cpu,
)

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_rms_norm_f32": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32],
    "hkv_add_rms_norm_f32": [_ptr, _ptr, _f32, _ptr, _ptr, _ptr, _i64, _i64, _f32],
    "hkv_gated_rms_norm_f32": [_ptr, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _f32, _int],
    "hkv_rms_norm_bf16": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _f32, _int],
    "hkv_add_rms_norm_bf16": [_ptr, _ptr, _f32, _ptr, _ptr, _ptr, _i64, _i64, _f32, _int],
    "hkv_gated_rms_norm_mixed": [_ptr, _int, _ptr, _int, _i64, _ptr, _ptr, _int, _i64, _i64,
                                 _i64, _f32, _int, _int],
})  # fmt: skip


def _row_weight(x: torch.Tensor, weight: torch.Tensor, cols: int) -> torch.Tensor | None:
    """The norm weight a row kernel takes for x, cols long, else None: float32 (a float32
    weight, or a bfloat16 one widened exactly: float32 rows times a bfloat16 weight are float32
    products in PyTorch too); for bfloat16 rows also a float32 weight such as a zero-centred
    norm's 1 + weight."""
    if weight.device.type != "cpu" or weight.numel() != cols:
        return None
    if x.dtype == torch.bfloat16 and weight.dtype in FLOAT_DTYPES:
        return derived(weight, "f32", contiguous_f32)
    if x.dtype == torch.float32 and weight.dtype == torch.bfloat16:
        # (float32 rows, a bfloat16 model's weight: the product is float32 either way)
        return derived(weight, "f32", contiguous_f32)
    return weight.contiguous() if weight.dtype == x.dtype else None


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False
) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dimension of float32 or bfloat16 x (and
    weight of its dtype), in one pass; bfloat16 rounds where `ops.norm.rms_norm` does, which
    `weight_in_fp32` decides. None when not supported."""
    lib, rows = native.library(), as_rows(x)
    if lib is None or rows is None:
        return None
    w = _row_weight(x, weight, rows.shape[1])
    if w is None:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    args = (rows.data_ptr(), rows.stride(0), w.data_ptr(), out.data_ptr(), *rows.shape, eps)
    if x.dtype == torch.bfloat16:
        lib.hkv_rms_norm_bf16(*args, int(weight_in_fp32))
    else:
        lib.hkv_rms_norm_f32(*args)
    return out if x.dim() == 2 else out.reshape(x.shape)


def add_rms_norm(
    x: torch.Tensor,
    h: torch.Tensor,
    multiplier: float,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + multiplier * h, its rms_norm) for float32 or bfloat16 x, h of one shape and dtype,
    in one pass; None when not supported."""
    lib = native.library()
    if lib is None or not is_float_cpu(x) or x.shape != h.shape or h.dtype != x.dtype:
        return None
    cols = x.shape[-1]
    w = _row_weight(x, weight, cols)
    if w is None or h.device.type != "cpu":
        return None
    x, h = x.contiguous(), h.contiguous()
    total, out = torch.empty_like(x), torch.empty_like(x)
    args = (
        x.data_ptr(), h.data_ptr(), multiplier, w.data_ptr(), total.data_ptr(), out.data_ptr(),
        x.numel() // max(cols, 1), cols, eps,
    )  # fmt: skip
    if x.dtype == torch.bfloat16:
        lib.hkv_add_rms_norm_bf16(*args, int(weight_in_fp32))
    else:
        lib.hkv_add_rms_norm_f32(*args)
    return total, out


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    weight_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor | None:
    """The Mamba2 gated, grouped RMSNorm (ops.norm.gated_rms_norm) in one pass, x, gate and the
    result (`out_dtype`, default x's) each float32 or bfloat16; None when not supported.
    x, gate: [..., C] (gate rows may be strided)."""
    lib, rows, gates = native.library(), as_rows(x), as_rows(gate)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if lib is None or rows is None or gates is None or out_dtype not in FLOAT_DTYPES:
        return None
    channels = rows.shape[1]
    if gates.shape != rows.shape or channels % group_size:
        return None
    if weight.device.type != "cpu" or weight.numel() != channels:
        return None  # (a weight of another size would be read past)
    if weight.dtype not in FLOAT_DTYPES:
        return None
    w = derived(weight, "f32", contiguous_f32)  # both kernels take a float32 weight
    rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=out_dtype)
    if x.dtype == gate.dtype == out_dtype == torch.float32:
        lib.hkv_gated_rms_norm_f32(
            rows.data_ptr(), gates.data_ptr(), gates.stride(0), w.data_ptr(), out.data_ptr(),
            rows.shape[0], channels, group_size, eps, int(norm_before_gate),
        )  # fmt: skip
    else:
        lib.hkv_gated_rms_norm_mixed(
            rows.data_ptr(), is_bf16(x), gates.data_ptr(), is_bf16(gate), gates.stride(0),
            w.data_ptr(), out.data_ptr(), is_bf16(out), rows.shape[0], channels, group_size,
            eps, int(norm_before_gate), int(weight_in_fp32),
        )  # fmt: skip
    return out.reshape(x.shape)
