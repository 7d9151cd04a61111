"""CPU linear layers with weights pre-packed for oneDNN.

This is what PyTorch's own CPU compiler does when it freezes a model: the weight is reordered
once into oneDNN's blocked layout, so each GEMM skips that work. Measured on the development
CPU (2 cores, fp32): 200-220 GFLOP/s against 110-190 for `F.linear`, the largest gain at decode
batch sizes (M = 64: 1.6-1.9x). Accumulation stays float32 (error ~1e-6 relative, as plain).

Parameters are shared, not copied, so names, state dicts and tied weights are unchanged; the
packed weight is an extra, non-persistent tensor. Anything unsupported keeps `nn.Linear`.

bfloat16 weights at small batches (x of up to `bf16_linear.small_m()` rows: decode steps) run on
the native kernel instead (`hybridkv/ops/native/bf16_linear.c`: the weight itself, unpacked,
streamed once per call with AVX512-BF16 pair products; float32 sums rounded once, as oneDNN's).
A decode step's linears are bound by streaming their weights, and oneDNN's packed bf16 linear
streams them at 60-75% of a plain read at M = 1 and further below at M = 8, where the kernel
reaches 85-100% (benchmarks/README.md, "bf16 linear for small batches"). float32 weights do the
same up to `f32_linear.small_m()` rows on `hybridkv/ops/native/f32_linear.c` (AVX-512 FMAs,
float32 products and sums like oneDNN's, in another order): at M = 1 on the development CPU
(2 threads) oneDNN's packed float32 linear streams 12-24 GB/s, the kernel 22-29 GB/s, at or
above a plain read of the same bytes, and it stays 1.1-1.75x ahead up to 32 rows ("fp32 native
linear" in the same section). Without the kernels (`HYBRIDKV_NATIVE=0`, no compiler, a CPU
without AVX2) every call stays on oneDNN.

AVX2 CPUs (no AVX-512: most AMD EPYC and laptops): both kernels have AVX2 paths (8 lanes), so
float32 runs them up to `f32_linear.SMALL_M_AVX2` rows and oneDNN's float32 GEMM above. oneDNN
has no bfloat16 there (its weight reorder fails: `prepack_dtypes()`), and PyTorch's bfloat16
matmul runs 3-5x below float32 (a bf16 model decoded 3x slower than fp32 on a 2-core EPYC), so
a bfloat16 linear is a `PackedLinear` without a packed weight that runs the native kernel at
every M: its dot-product tiles up to 20 rows, the AVX2 GEMM of `f32_linear.c` above (the
weights widened to float32 a block at a time; within 0-15% of oneDNN's float32 GEMM at M =
64-512, benchmarks/README.md "AVX2"). The choice is made once per layer from the CPU record
(`native_rows`): by the number of rows alone at each call.
"""

from __future__ import annotations

import functools
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.ops.native import bf16_linear as native_bf16
from hybridkv.ops.native import f32_linear as native_f32

_OPS = getattr(torch.ops, "mkldnn", None)
# weight dtype -> the module of its native small-batch linear (SMALL_M, kernel, run, linear)
SMALL_KERNELS = {torch.bfloat16: native_bf16, torch.float32: native_f32}


def native_small_linear(dtype: torch.dtype) -> bool:
    """Whether this build runs small-batch linears with weights of `dtype` on a native kernel
    (AVX-512 and AVX2 builds): what lets a decode step be captured (`hybridkv.worker.graphs`);
    without it the step's linears are PyTorch ops and every step runs eagerly."""
    small = SMALL_KERNELS.get(dtype)
    return small is not None and small.kernel() is not None


def native_rows(dtype: torch.dtype) -> int:
    """Rows of x up to which linears with weights of `dtype` run on the native kernel (the one
    place of that choice): its `small_m()` where oneDNN packs the dtype (above, oneDNN's
    blocked GEMM), every M where oneDNN cannot (bfloat16 on an AVX2 CPU: the kernel's own GEMM
    takes the larger M), 0 without the kernel."""
    small = SMALL_KERNELS.get(dtype)
    if small is None or small.kernel() is None:
        return 0
    return small.small_m() if dtype in prepack_dtypes() else sys.maxsize


@functools.cache
def prepack_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes oneDNN packs on this CPU: float32 always; bfloat16 where oneDNN has
    bf16 kernels (AVX512-BW/VL/DQ or AMX; not on an AVX2-only CPU, where its reorder fails)."""
    bf16 = getattr(_OPS, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def linear_dtypes() -> tuple[torch.dtype, ...]:
    """The weight dtypes `prepack_linears` swaps for a `PackedLinear`: those oneDNN packs, and
    those it cannot but a native kernel runs at every M (bfloat16 on an AVX2 CPU)."""
    packs = prepack_dtypes()
    return packs + tuple(d for d in SMALL_KERNELS if d not in packs and native_small_linear(d))


def prepack_available() -> bool:
    return (
        _OPS is not None
        and hasattr(_OPS, "_linear_pointwise")
        and hasattr(_OPS, "_reorder_linear_weight")
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward runs oneDNN on a pre-packed copy of its weight, or the
    native kernel of its dtype for x of up to `native_rows` rows."""

    # oneDNN's copy of the weight; None where oneDNN cannot pack its dtype (bfloat16 on AVX2:
    # the native kernel at every M, `native_rows`)
    packed_weight: torch.Tensor | None
    # the module of the native small-batch linear of the weight's dtype (small_m, run) and its
    # kernel, for x of up to `native_rows` rows; None: oneDNN at every size
    small: Any
    small_kernel: Any

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias  # shared parameters
        packed.refresh()
        return packed

    def refresh(self) -> None:
        """Re-pack after the weight changed (weights are packed once, after loading)."""
        weight = self.weight.detach()
        self.packed_weight = None
        if weight.dtype in prepack_dtypes():
            with torch.no_grad():
                self.packed_weight = _OPS._reorder_linear_weight(weight, None)
        bias = None if self.bias is None else self.bias.detach()
        small = SMALL_KERNELS.get(weight.dtype)
        fits = small is not None and small.weight_fits(weight, bias)
        self.small = small if fits else None
        self.small_kernel = small.kernel() if fits else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; the engine's activations are [T, in] already
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        small = self.small
        if (
            self.small_kernel is not None
            and flat.dtype == self.weight.dtype
            and not torch.is_grad_enabled()  # the kernel records no autograd graph
            # `native_rows`: every M without a packed weight, else up to small_m() rows (read at
            # each call: a test may change it)
            and (self.packed_weight is None or flat.shape[0] <= small.small_m())
        ):
            out = small.run(self.small_kernel, flat, self.weight, self.bias)
        elif self.packed_weight is not None:
            out = _OPS._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        else:  # no packed weight (bfloat16 on AVX2) and autograd on, or x of another dtype
            out = F.linear(flat, self.weight, self.bias)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, in] @ weight.T (+ bias) for a weight used outside its module (a projection whose
    bias a kernel applies itself): the native small-batch kernel of its dtype where it applies
    (inference, x of up to `native_rows` rows), else F.linear."""
    small = SMALL_KERNELS.get(x.dtype)
    if small is not None and not torch.is_grad_enabled() and x.shape[0] <= native_rows(x.dtype):
        out = small.linear(x, weight, bias)
        if out is not None:
            return out
    return F.linear(x, weight, bias)


def prepack_linears(model: nn.Module) -> int:
    """Swap every CPU fp32/bf16 `nn.Linear` of `model` whose dtype is in `linear_dtypes()`
    for a `PackedLinear` (checked against `F.linear` once); returns how many were swapped."""
    if not prepack_available():
        return 0
    dtypes = linear_dtypes()
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            if child.weight.dtype not in dtypes:
                continue
            try:
                packed = PackedLinear.from_linear(child)
                probe = torch.randn(2, child.in_features, dtype=child.weight.dtype)
                tol = 1e-2 if child.weight.dtype == torch.bfloat16 else 1e-4
                with torch.no_grad():
                    ok = torch.allclose(packed(probe), child(probe), rtol=tol, atol=tol)
            except RuntimeError:
                ok = False
            if ok:
                setattr(parent, name, packed)
                swapped += 1
    return swapped
