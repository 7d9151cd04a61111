"""The native bfloat16 linear for small batches (`bf16_linear.c`, compiled into the one native
library): its ctypes signature, the checks that keep it inside its tensors, and the per-call
path. `hybridkv.layers.linear.PackedLinear` is the caller (bfloat16 weights, up to SMALL_M rows
of x); `F.linear` in float64 is the reference of the tests."""

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

_LINEAR = SmallBatchLinear(torch.bfloat16, "hkv_bf16_linear", "hkv_bf16_linear_fast")
kernel = _LINEAR.kernel  # the kernel, or None (no library, HYBRIDKV_NATIVE=0, no fast path)
weight_fits = _LINEAR.weight_fits
run = _LINEAR.run  # the per-call path on a checked weight
linear = bf16_linear = _LINEAR.linear  # x @ weight.T + bias, or None where it doesn't fit
