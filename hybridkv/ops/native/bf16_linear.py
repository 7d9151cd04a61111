"""The native bfloat16 linear for small batches (`bf16_linear.c`, compiled into the one native
library): its ctypes signature, the checks that keep it inside its tensors, and the per-call
path. `hybridkv.layers.linear.PackedLinear` is the caller (bfloat16 weights, up to `small_m()`
rows of x where oneDNN has bfloat16 kernels, at every M where it has none); `F.linear` in
float64 is the reference of the tests.

Two paths, chosen by the build (`bf16_linear.c`): AVX512-BF16 (vdpbf16ps pair products) and
AVX2 + FMA (bfloat16 widened to float32 in registers by a shift, float32 FMAs; above 20 rows
the AVX2 GEMM of `f32_linear.c`, the weights widened a block at a time). Both: float32
products and sums, one rounding to bfloat16. An AVX2 CPU has no oneDNN bfloat16 (its weight
reorder fails) and PyTorch's own bfloat16 matmul there runs 3-5x below float32, so on AVX2 the
kernel is the whole bfloat16 linear, prefill included."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.native.small_linear import SmallBatchLinear

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p
native.declare({
    "hkv_bf16_linear": [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64],
})  # fmt: skip

# Rows of x up to which the kernel beat oneDNN's packed bf16 linear on the 100m model's shapes
# with the weights out of cache (benchmarks/bf16_linear.py): 1.3-2x at M = 1..8 on 1 and 2
# threads, M = 16 about level on 1 thread and ahead on 2; above, oneDNN's blocked GEMM wins.
SMALL_M = 16
# The AVX2 path where oneDNN has bfloat16 kernels too (an AVX-512 CPU without AVX512-BF16; not
# measured: none at hand): its dot-product tiles' range (bf16_linear.c). Where oneDNN has none
# (AVX2 CPUs), PackedLinear runs the kernel at every M (hybridkv.layers.linear.native_rows).
SMALL_M_AVX2 = 20

_LINEAR = SmallBatchLinear(
    torch.bfloat16, "hkv_bf16_linear", "hkv_bf16_linear_fast", ("avx512", "avx512_bf16")
)
kernel = _LINEAR.kernel  # the kernel, or None (no library, HYBRIDKV_NATIVE=0, no fast path)
weight_fits = _LINEAR.weight_fits
run = _LINEAR.run  # the per-call path on a checked weight
linear = bf16_linear = _LINEAR.linear  # x @ weight.T + bias, or None where it doesn't fit


def small_m() -> int:
    """Rows of x up to which this build's kernel beats oneDNN's bf16 linear: SMALL_M (the
    AVX512-BF16 path) or SMALL_M_AVX2 (read at the call: a test may change them)."""
    return SMALL_M if _LINEAR.wide() else SMALL_M_AVX2
