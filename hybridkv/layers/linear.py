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
weights widened to float32 a block at a time; 0.94-1.13x the speed of oneDNN's float32 GEMM
at M = 64-512, benchmarks/README.md "AVX2"). The choice is made once per layer from the CPU record
(`native_rows`): by the number of rows alone at each call.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.ops.registry import OpImpl, declare

_OPS = getattr(torch.ops, "mkldnn", None)
# the weight dtypes with a native small-batch linear (`small_kernel`)
SMALL_DTYPES = (torch.bfloat16, torch.float32)


@functools.cache
def small_kernel(dtype: torch.dtype) -> Any:
    """The module of the native small-batch linear for weights of `dtype` (small_m, kernel,
    run, linear), or None. Imported here, when first asked: layers import no ops.native at
    module level (tests/test_layering.py)."""
    if dtype == torch.float32:
        from hybridkv.ops.native import f32_linear

        return f32_linear
    if dtype == torch.bfloat16:
        from hybridkv.ops.native import bf16_linear

        return bf16_linear
    return None


def _small_m(dtype: torch.dtype) -> Callable[[], int]:
    """The `max_rows` of a native link: its kernel's small_m(), read when the chain is bound."""
    return lambda: small_kernel(dtype).small_m()


# The linear family, keyed by the weight's dtype: what a `PackedLinear` runs for x of a given
# number of rows (each implementation takes the layer and x [M, in]). On an AVX-512 Xeon:
#   float32   native-avx512 (rows <= 32), onednn
#   bfloat16  native-avx512-bf16 (rows <= 16), onednn-bf16
# on an AVX2 CPU (oneDNN has no bfloat16 there):
#   float32   native-avx2 (rows <= 24), onednn
#   bfloat16  native-avx2-bf16 (tiles up to 20 rows, the kernel's own GEMM above: any rows)
_CPU, _F32, _BF16 = frozenset({"cpu"}), frozenset({"float32"}), frozenset({"bfloat16"})
_HERE = f"{__name__}:"
LINEAR = declare(
    "linear",
    (
        OpImpl("native-avx512", _HERE + "_run_native", _CPU, _F32, ("native", "avx512"),
               max_rows=_small_m(torch.float32), description="f32_linear.c, 16 lanes"),
        OpImpl("native-avx2", _HERE + "_run_native", _CPU, _F32, ("native", "avx2"),
               max_rows=_small_m(torch.float32), unless=("avx512",),
               description="f32_linear.c, 8 lanes"),
        OpImpl("native-avx512-bf16", _HERE + "_run_native", _CPU, _BF16,
               ("native", "avx512_bf16"), max_rows=_small_m(torch.bfloat16),
               description="bf16_linear.c, vdpbf16ps"),
        OpImpl("onednn", _HERE + "_run_onednn", _CPU, _F32, ("onednn",),
               description="oneDNN on a pre-packed weight"),
        OpImpl("onednn-bf16", _HERE + "_run_onednn", _CPU, _BF16, ("onednn", "onednn_bf16"),
               description="oneDNN on a pre-packed weight"),
        OpImpl("native-avx2-bf16", _HERE + "_run_native", _CPU, _BF16, ("native", "avx2"),
               description="bf16_linear.c tiles, then f32_linear.c's AVX2 GEMM"),
        OpImpl("torch", _HERE + "_run_torch", description="F.linear"),
    ),
)  # fmt: skip


def native_small_linear(dtype: torch.dtype) -> bool:
    """Whether this build runs small-batch linears with weights of `dtype` on a native kernel
    (AVX-512 and AVX2 builds): what lets a decode step be captured (`hybridkv.worker.graphs`);
    without it the step's linears are PyTorch ops and every step runs eagerly."""
    small = small_kernel(dtype)
    return small is not None and small.kernel() is not None


def native_rows(dtype: torch.dtype) -> int:
    """Rows of x up to which linears with weights of `dtype` run on the native kernel: the
    limit of the `LINEAR` chain's native link (its `small_m()` where oneDNN follows; every M
    where the native link is the last, bfloat16 on an AVX2 CPU), 0 without one."""
    if dtype not in SMALL_DTYPES:
        return 0
    link = LINEAR.chain("cpu", dtype).links[0]
    if not link.impl.name.startswith("native") or small_kernel(dtype).kernel() is None:
        return 0
    rows = link.max_rows
    return sys.maxsize if rows is None else rows


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
    return packs + tuple(d for d in SMALL_DTYPES if d not in packs and native_small_linear(d))


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
        """Bind the `LINEAR` chain of the weight's dtype and re-pack (after the weight changed;
        weights are packed once, after loading)."""
        weight = self.weight.detach()
        bias = None if self.bias is None else self.bias.detach()
        small = small_kernel(weight.dtype)
        fits = small is not None and small.weight_fits(weight, bias) and small.kernel() is not None
        # a weight the kernel cannot take (not contiguous): the chain as if without it
        self.chain = LINEAR.chain("cpu", weight.dtype, () if fits else ("native",))
        names = [link.impl.name for link in self.chain.links]
        self.small = small if any(n.startswith("native") for n in names) else None
        self.small_kernel = small.kernel() if self.small is not None else None
        self.packed_weight = None
        if any(n.startswith("onednn") for n in names):
            with torch.no_grad():
                self.packed_weight = _OPS._reorder_linear_weight(weight, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; the engine's activations are [T, in] already
        flat = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        if flat.dtype != self.weight.dtype or torch.is_grad_enabled():
            # x of another dtype, or autograd on (the kernels record no graph): oneDNN where
            # it packed the weight, else PyTorch's own
            if self.packed_weight is not None and flat.dtype == self.weight.dtype:
                out = _run_onednn(self, flat)
            else:
                out = F.linear(flat, self.weight, self.bias)
        else:
            out = self.chain.for_rows(flat.shape[0])(self, flat)
        return out if x.dim() == 2 else out.reshape(*x.shape[:-1], self.out_features)


def _run_native(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    # x: [M, in] of the weight's dtype -> [M, out]
    return layer.small.run(layer.small_kernel, x, layer.weight, layer.bias)


def _run_onednn(layer: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    return _OPS._linear_pointwise(x, layer.packed_weight, layer.bias, "none", [], "")


def _run_torch(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def small_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, in] @ weight.T (+ bias) for a weight used outside its module (a projection whose
    bias a kernel applies itself): the native small-batch kernel of its dtype where it applies
    (inference, x of up to `native_rows` rows), else F.linear."""
    small = small_kernel(x.dtype)
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
