"""The element-wise steps between a forward pass's kernels: embedding lookup, residual add,
rotary cos/sin, float32 logits, relu2, products of rows, bfloat16 casts, GeGLU's gelu(gate) * up
and the concatenation of rows (`elementwise.c`); SwiGLU's silu(gate) * up, the rotary embedding
and the argmax of rows (`kernels.c`). Each returns None when the native library or these tensors are
not supported; `hybridkv.ops.elementwise` (and the layers) fall back to PyTorch then."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.native.common import FLOAT_DTYPES, as_rows, is_bf16, is_f32_cpu, is_float_cpu

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_embedding": [_ptr, _i64, _ptr, _i64, _i64, _int, _f32, _int, _ptr],
    "hkv_add_scaled": [_ptr, _ptr, _f32, _ptr, _i64, _int],
    "hkv_rope_cos_sin": [_ptr, _i64, _ptr, _i64, _f32, _int, _ptr, _ptr],
    "hkv_logits_f32": [_ptr, _i64, _int, _ptr, _i64, _i64, _f32, _f32],
    "hkv_relu2": [_ptr, _ptr, _i64, _int],
    "hkv_mul_rows": [_ptr, _i64, _int, _ptr, _i64, _int, _ptr, _int, _i64, _i64],
    "hkv_to_bf16": [_ptr, _ptr, _i64],
    "hkv_gelu_tanh_mul": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64, _int],
    "hkv_concat_rows": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64],
    # (in kernels.c)
    "hkv_silu_mul_f32": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "hkv_silu_mul_bf16": [_ptr, _i64, _ptr, _i64, _ptr, _i64, _i64],
    "hkv_rope": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64, _i64],
    "hkv_argmax_f32": [_ptr, _i64, _i64, _i64, _ptr],
})  # fmt: skip
native.returns_status("hkv_embedding")


def embedding(ids: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor | None:
    """weight[ids] (* scale, rounded to weight's dtype): ids [n] int64, weight [rows, cols]
    float32 or bfloat16 contiguous -> [n, cols]. An id outside the table raises IndexError."""
    lib = native.library()
    if lib is None or not is_float_cpu(weight) or not weight.is_contiguous() or weight.dim() != 2:
        return None
    if ids.dim() != 1 or ids.dtype != torch.int64 or ids.device.type != "cpu":
        return None
    ids = ids.contiguous()
    rows, cols = weight.shape
    out = torch.empty(ids.shape[0], cols, dtype=weight.dtype)
    bad = lib.hkv_embedding(
        ids.data_ptr(), ids.shape[0], weight.data_ptr(), rows, cols, is_bf16(weight),
        scale, int(scale != 1.0), out.data_ptr(),
    )  # fmt: skip
    if bad:
        raise IndexError(f"{bad} token ids outside the embedding's {rows} rows")
    return out


def add_scaled(x: torch.Tensor, h: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor | None:
    """x + h * multiplier (rounded as PyTorch rounds it) for float32 or bfloat16 x and h of one
    shape and dtype; None when not supported."""
    lib = native.library()
    if lib is None or not is_float_cpu(x) or x.dtype != h.dtype or x.shape != h.shape:
        return None
    if h.device.type != "cpu":
        return None
    x, h = x.contiguous(), h.contiguous()
    out = torch.empty_like(x)
    lib.hkv_add_scaled(
        x.data_ptr(), h.data_ptr(), multiplier, out.data_ptr(), x.numel(), is_bf16(x)
    )
    return out


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos, sin [n, 2 * len(inv_freq)] of positions [n] int64 (float32 angles, times scaling,
    in `dtype`: float32 or bfloat16); None when not supported."""
    lib = native.library()
    if lib is None or dtype not in FLOAT_DTYPES or positions.dim() != 1:
        return None
    if positions.dtype != torch.int64 or positions.device.type != "cpu":
        return None
    if inv_freq.dtype != torch.float32 or inv_freq.device.type != "cpu" or inv_freq.dim() != 1:
        return None
    positions, inv_freq = positions.contiguous(), inv_freq.contiguous()
    n, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(n, 2 * half, dtype=dtype)
    sin = torch.empty(n, 2 * half, dtype=dtype)
    lib.hkv_rope_cos_sin(
        positions.data_ptr(), n, inv_freq.data_ptr(), half, scaling,
        int(dtype == torch.bfloat16), cos.data_ptr(), sin.data_ptr(),
    )  # fmt: skip
    return cos, sin


def logits_f32(
    x: torch.Tensor, divisor: float = 1.0, softcap: float | None = None
) -> torch.Tensor | None:
    """x.float() / divisor for float32 or bfloat16 x [rows, cols] (unit column stride), x
    soft-capped first when softcap is set (nonzero): tanh(x / softcap) * softcap in x's dtype,
    as Gemma computes it; a float32 x with divisor 1 and no cap is returned as it is. None
    when not supported (a cap of 0)."""
    if x.dtype == torch.float32 and divisor == 1.0 and softcap is None:
        return x
    if softcap == 0:
        return None
    lib = native.library()
    if lib is None or not is_float_cpu(x) or x.dim() != 2 or x.stride(1) != 1:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    lib.hkv_logits_f32(
        x.data_ptr(), x.stride(0), is_bf16(x), out.data_ptr(), x.shape[0], x.shape[1],
        divisor, 0.0 if softcap is None else softcap,
    )  # fmt: skip
    return out


def to_bfloat16(x: torch.Tensor) -> torch.Tensor | None:
    """x.to(torch.bfloat16) for contiguous float32 x on the CPU (rounded as torch rounds), as
    a native kernel call (a step that casts stays capturable); None when not supported."""
    lib = native.library()
    if lib is None or x.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if not x.is_contiguous():
        return None
    out = torch.empty(x.shape, dtype=torch.bfloat16)
    lib.hkv_to_bf16(x.data_ptr(), out.data_ptr(), x.numel())
    return out


def relu2(x: torch.Tensor) -> torch.Tensor | None:
    """relu(x) ** 2 of float32 or bfloat16 x (rounded as `F.relu(x).square()`); None when
    not supported."""
    lib = native.library()
    if lib is None or not is_float_cpu(x):
        return None
    x = x.contiguous()
    out = torch.empty_like(x)
    lib.hkv_relu2(x.data_ptr(), out.data_ptr(), x.numel(), is_bf16(x))
    return out


def mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """a.to(dtype) * b.to(dtype) -> [rows, cols] in `dtype` (float32 or bfloat16), for 2-D a
    and b of one shape, each float32 or bfloat16 with unit column stride (rows may be strided:
    column slices of a projection); None when not supported."""
    lib = native.library()
    if lib is None or not is_float_cpu(a, b) or dtype not in FLOAT_DTYPES:
        return None
    if a.dim() != 2 or a.shape != b.shape or a.stride(1) != 1 or b.stride(1) != 1:
        return None
    out = torch.empty(a.shape, dtype=dtype)
    lib.hkv_mul_rows(
        a.data_ptr(), a.stride(0), is_bf16(a), b.data_ptr(), b.stride(0),
        is_bf16(b), out.data_ptr(), int(dtype == torch.bfloat16), *a.shape,
    )  # fmt: skip
    return out


def concat_rows(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """torch.cat([a, b], dim=-1) of 2-D float32 or bfloat16 a [rows, m] and b [rows, n] of one
    dtype, each with unit column stride (rows may be strided) -> [rows, m + n] contiguous, the
    same bits; None when not supported."""
    lib = native.library()
    if lib is None or not is_float_cpu(a, b) or a.dtype != b.dtype:
        return None
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[0]:
        return None
    if a.stride(1) != 1 or b.stride(1) != 1:
        return None
    out = torch.empty(a.shape[0], a.shape[1] + b.shape[1], dtype=a.dtype)
    size = a.element_size()
    lib.hkv_concat_rows(
        a.data_ptr(), a.stride(0) * size, a.shape[1] * size, b.data_ptr(), b.stride(0) * size,
        b.shape[1] * size, out.data_ptr(), a.shape[0],
    )  # fmt: skip
    return out


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """F.gelu(gate, approximate="tanh") * up for 2-D float32 or bfloat16 gate and up of one
    shape and dtype (unit column stride; rows may be strided); None when not supported."""
    lib = native.library()
    if lib is None or not is_float_cpu(gate) or gate.dtype != up.dtype or gate.dim() != 2:
        return None
    if gate.shape != up.shape or gate.stride(1) != 1 or up.stride(1) != 1:
        return None
    out = torch.empty(gate.shape, dtype=gate.dtype)
    lib.hkv_gelu_tanh_mul(
        gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), out.data_ptr(),
        *gate.shape, is_bf16(gate),
    )  # fmt: skip
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """[..., 2I] = [gate | up] -> silu(gate) * up: [..., I] for float32 or bfloat16 x
    (bfloat16: silu rounded before the product, as PyTorch); None when not supported."""
    rows = as_rows(x)
    if rows is None or x.shape[-1] % 2:
        return None
    inter = x.shape[-1] // 2
    out = _silu_mul_rows(rows[:, :inter], rows[:, inter:])
    return out if out is None or x.dim() == 2 else out.reshape(*x.shape[:-1], inter)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for float32 or bfloat16 gate and up of one shape and dtype (separate
    gate and up projections), rounded as PyTorch's `F.silu(gate) * up`; None when not
    supported."""
    g, u = as_rows(gate), as_rows(up)
    if g is None or u is None or gate.shape != up.shape or gate.dtype != up.dtype:
        return None
    out = _silu_mul_rows(g, u)
    return out if out is None or gate.dim() == 2 else out.reshape(gate.shape)


def _silu_mul_rows(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """g, u: [rows, I] with unit column stride, any row stride -> silu(g) * u [rows, I]."""
    lib = native.library()
    if lib is None:
        return None
    out = torch.empty(g.shape, dtype=g.dtype)
    kernel = lib.hkv_silu_mul_bf16 if g.dtype == torch.bfloat16 else lib.hkv_silu_mul_f32
    kernel(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), out.data_ptr(), *g.shape)
    return out


def rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor | None:
    """The rotary embedding of `layers.rotary._rotate` in one pass: x [T, H, D] (channels
    contiguous, tokens and heads at any stride), cos, sin [T, rotary_dim] of x's dtype (float32
    or bfloat16) -> [T, H, D] contiguous; None when not supported."""
    lib = native.library()
    if lib is None or x.dim() != 3 or not is_float_cpu(x) or x.stride(2) != 1:
        return None
    tokens, heads, dim = x.shape
    if rotary_dim % 2 or not 0 < rotary_dim <= dim or tokens == 0:
        return None
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape != (tokens, rotary_dim):
        return None
    if sin.shape != cos.shape or cos.device.type != "cpu" or sin.device.type != "cpu":
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.hkv_rope(
        x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        is_bf16(x), tokens, heads, dim, rotary_dim,
    )  # fmt: skip
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """torch.argmax(x, dim=-1) of a float32 [rows, cols] x (ties: the first index; a row with
    NaN: its first NaN), vectorised and in parallel; None when not supported."""
    lib = native.library()
    if lib is None or x.dim() != 2 or not is_f32_cpu(x) or x.shape[1] == 0:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], dtype=torch.int64)
    lib.hkv_argmax_f32(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.data_ptr())
    return out
