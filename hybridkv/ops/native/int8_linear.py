"""The native int8 weight-only linear (`int8_linear.c`, compiled into the one native library):
ctypes signature and the checks that keep it inside its tensors.
`hybridkv.layers.quantization` is the reference and the caller."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
native.declare({
    "hkv_int8_linear": [_ptr, _i64, _int, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int],
})  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16)  # of x and y
_vectorized: bool | None = None


def available() -> bool:
    """The kernels load and this build has the AVX-512 tiles (the plain-loop build is slower
    than PyTorch's int8 path, so callers keep that one instead)."""
    global _vectorized
    lib = native.library()
    if lib is None:
        return False
    if _vectorized is None:
        fn = lib.hkv_int8_vectorized
        fn.argtypes, fn.restype = [], ctypes.c_int
        _vectorized = bool(fn())
    return _vectorized


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float32/bfloat16, q int8 [N, K], scale bfloat16 [N] -> x @ (q * scale).T
    [M, N] in x's dtype (float32 math); None when the kernels or these tensors don't fit."""
    if not available() or x.dim() != 2 or q.dim() != 2 or x.dtype not in DTYPES:
        return None
    if any(t.device.type != "cpu" for t in (x, q, scale)) or q.dtype != torch.int8:
        return None
    m, k = x.shape
    n = q.shape[0]
    if q.shape[1] != k or scale.shape != (n,) or scale.dtype != torch.bfloat16:
        return None
    if not (q.is_contiguous() and scale.is_contiguous()):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype)
    bf16 = int(x.dtype == torch.bfloat16)
    lib = native.library()
    assert lib is not None
    lib.hkv_int8_linear(
        x.data_ptr(), x.stride(0), bf16, q.data_ptr(), scale.data_ptr(), m, n, k,
        y.data_ptr(), n, bf16,
    )  # fmt: skip
    return y
