"""The native bfloat16 linear for small batches (`bf16_linear.c`, compiled into the one native
library): its ctypes signature, the checks that keep it inside its tensors, and the per-call
path. `hybridkv.layers.linear.PackedLinear` is the caller (bfloat16 weights, up to SMALL_M rows
of x); `F.linear` in float64 is the reference of the tests."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from hybridkv.ops import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
native.declare({
    "hkv_bf16_linear": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64],
})  # fmt: skip

# Rows of x up to which the kernel beat oneDNN's packed bf16 linear on the 100m model's shapes
# with the weights out of cache (benchmarks/bf16_linear.py): 1.3-2x at M = 1..8 on 1 and 2
# threads, M = 16 about level on 1 thread and ahead on 2; above, oneDNN's blocked GEMM wins.
SMALL_M = 16

_kernel: Any = None  # the ctypes function, once looked up
_fast: bool | None = None


def kernel() -> Any:
    """The ctypes function `hkv_bf16_linear`, or None: no library, `HYBRIDKV_NATIVE=0`, or a
    build without AVX512-BF16 (its plain loop is slower than oneDNN, so callers keep oneDNN)."""
    global _kernel, _fast
    lib = native.library()
    if lib is None:
        return None
    if _fast is None:
        fn = lib.hkv_bf16_linear_fast
        fn.argtypes, fn.restype = [], ctypes.c_int
        _fast, _kernel = bool(fn()), lib.hkv_bf16_linear
    return _kernel if _fast else None


def weight_fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel takes this weight and bias: bfloat16 [N, K] contiguous and None or bfloat16
    [N] contiguous, on the CPU."""
    if weight.dim() != 2 or weight.dtype != torch.bfloat16 or weight.device.type != "cpu":
        return False
    if not weight.is_contiguous():
        return False
    if bias is None:
        return True
    return (
        bias.shape == (weight.shape[0],) and bias.dtype == torch.bfloat16
        and bias.is_contiguous() and bias.device.type == "cpu"
    )  # fmt: skip


def run(fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel on a checked weight and bias (`weight_fits`) and x [M, K] bfloat16 on the CPU
    (any row stride): [M, N] bfloat16. The per-call path (few checks)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=torch.bfloat16)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
       m, n, weight.shape[1], y.data_ptr(), n)  # fmt: skip
    return y


def bf16_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K].T + bias, all bfloat16 (float32 sums, rounded once) -> [M, N];
    None when the fast kernel or these tensors don't fit."""
    fn = kernel()
    if fn is None or not weight_fits(weight, bias) or x.dim() != 2:
        return None
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[1] != weight.shape[1]:
        return None
    return run(fn, x, weight, bias)
