"""The native float32 linear for small batches (`f32_linear.c`, compiled into the one native
library): its ctypes signature, the checks that keep it inside its tensors, and the per-call
path. `hybridkv.layers.linear.PackedLinear` is the caller (float32 weights, up to SMALL_M rows
of x); `F.linear` in float64 is the reference of the tests. `bf16_linear.py` is the bfloat16
counterpart."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from hybridkv.ops import native

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
native.declare({
    "hkv_f32_linear": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64],
})  # fmt: skip

# Rows of x up to which the kernel beats oneDNN's packed float32 linear on the 100m model's
# shapes with the weights out of cache (benchmarks/bf16_linear.py --fp32, benchmarks/README.md
# "fp32 native linear"; 2-core Xeon): 1.13-1.75x at M = 1..8 on 1 and 2 threads, 1.07-1.42x at
# M = 32; the crossover lies at M = 48-64 (1536 -> 768: 1.02x at 48, 0.95-0.98x at 64; the
# other shapes 1.0-1.2x at 64), where oneDNN's blocked GEMM catches up with the kernel's
# 4 x 4 tiles. 32: the largest M measured ahead on every shape and thread count.
SMALL_M = 32

_kernel: Any = None  # the ctypes function, once looked up
_fast: bool | None = None


def kernel() -> Any:
    """The ctypes function `hkv_f32_linear` of the native library, or None: no library,
    `HYBRIDKV_NATIVE=0`, or a build without AVX-512 (its plain loop is slower than oneDNN, so
    callers keep oneDNN)."""
    global _kernel, _fast
    lib = native.library()
    if lib is None:
        return None
    if _fast is None:
        fn = lib.hkv_f32_linear_fast
        fn.argtypes, fn.restype = [], ctypes.c_int
        _fast, _kernel = bool(fn()), lib.hkv_f32_linear
    return _kernel if _fast else None


def weight_fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """The kernel takes this weight and bias: float32 [N, K] contiguous and None or float32 [N]
    contiguous, on the CPU."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        return False
    if not weight.is_contiguous():
        return False
    if bias is None:
        return True
    return (
        bias.shape == (weight.shape[0],) and bias.dtype == torch.float32
        and bias.is_contiguous() and bias.device.type == "cpu"
    )  # fmt: skip


def run(fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The kernel on a checked weight and bias (`weight_fits`) and x [M, K] float32 on the CPU
    (any row stride): [M, N] float32. The per-call path (few checks)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, n = x.shape[0], weight.shape[0]
    y = torch.empty(m, n, dtype=torch.float32)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
       m, n, weight.shape[1], y.data_ptr(), n)  # fmt: skip
    return y


def f32_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """x [M, K] @ weight[N, K].T + bias, all float32 (float32 products and sums) -> [M, N];
    None when the fast kernel or these tensors don't fit."""
    fn = kernel()
    if fn is None or not weight_fits(weight, bias) or x.dim() != 2:
        return None
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[1] != weight.shape[1]:
        return None
    return run(fn, x, weight, bias)
