"""The native float32 linear for small batches (`f32_linear.c`, compiled into the one native
library): its ctypes signature, the checks that keep it inside its tensors, and the per-call
path. `hybridkv.layers.linear.PackedLinear` is the caller (float32 weights, up to `small_m()`
rows of x); `F.linear` in float64 is the reference of the tests. `bf16_linear.py` is the
bfloat16 counterpart.

Two paths, chosen by the build (`f32_linear.c`): AVX-512 (16 lanes, tiles of up to 4 x 4) and
AVX2 + FMA (8 lanes, tiles of up to 4 x 2); without AVX2 the probe says no fast path and every
float32 linear stays on oneDNN. Above `small_m()` rows oneDNN's packed float32 GEMM runs, on
AVX2 too (its AVX2 GEMM is within a few % of `hkv_avx2_gemm` at M = 64-512)."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.native.small_linear import SmallBatchLinear

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
# The same for the AVX2 path (8 lanes, 4 x 2 tiles; x86-64-v3 build with oneDNN and MKL capped
# at AVX2 on the same Xeon, 1 thread: benchmarks/README.md "AVX2"): 1.2-1.6x at M = 1..8,
# 1.2-1.3x at 16, 1.0-1.08x at 24, 0.9-1.08x at 32 (768 -> 3224, 1536 -> 768, 768 -> 32000).
SMALL_M_AVX2 = 24

_LINEAR = SmallBatchLinear(torch.float32, "hkv_f32_linear", "hkv_f32_linear_fast", ("avx512",))
kernel = _LINEAR.kernel  # the kernel, or None (no library, HYBRIDKV_NATIVE=0, no fast path)
weight_fits = _LINEAR.weight_fits
run = _LINEAR.run  # the per-call path on a checked weight
linear = f32_linear = _LINEAR.linear  # x @ weight.T + bias, or None where it doesn't fit


def small_m() -> int:
    """Rows of x up to which this build's kernel beats oneDNN: SMALL_M (AVX-512) or
    SMALL_M_AVX2 (read at the call: a test may change them)."""
    return SMALL_M if _LINEAR.wide() else SMALL_M_AVX2
