"""What the native small-batch linears share (`bf16_linear.c`, `f32_linear.c`): y = x @ w^T
(+ bias) on the nn.Linear weight itself, for the few rows of x of a decode step. Each dtype's
module (`bf16_linear.py`, `f32_linear.py`) declares its kernel's signature and the rows of x up
to which it beats oneDNN (`SMALL_M` for the AVX-512 kernels, `SMALL_M_AVX2` for the AVX2 ones:
`small_m()` gives the build's), and exposes one `SmallBatchLinear`'s methods."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from hybridkv.ops import native


def loaded_record() -> Any:
    """The CPU record (`cpu.record()`) taken with the native library loaded: where it was first
    taken while `HYBRIDKV_NATIVE=0` (no library, nothing built), it is taken again. For the
    callers that choose by the build once its kernel exists."""
    from hybridkv.ops.native import cpu  # (cpu imports the loader, which imports us)

    record = cpu.record()
    if not record.native_loaded and native.library() is not None:
        cpu.record.cache_clear()  # (recorded while HYBRIDKV_NATIVE=0: record it again)
        record = cpu.record()
    return record


class SmallBatchLinear:
    """One dtype's kernel `name`, usable where the library's build has its fast path (`probe`
    returns 1: a plain loop is built without the instruction set, slower than oneDNN, so the
    callers keep oneDNN then). `wide`: the CPU-record features of its AVX-512 path (else the
    build runs its AVX2 path)."""

    def __init__(self, dtype: torch.dtype, name: str, probe: str, wide: tuple[str, ...]) -> None:
        self.dtype, self.name, self.probe, self.wide_features = dtype, name, probe, wide
        self._fast: bool | None = None
        self._wide: bool | None = None

    def kernel(self) -> Any:
        """The kernel (a recordable `native.Kernel`), or None: no library, `HYBRIDKV_NATIVE=0`,
        or no fast path in this build."""
        lib = native.library()
        if lib is None:
            return None
        if self._fast is None:
            fn = getattr(lib, self.probe)
            fn.argtypes, fn.restype = [], ctypes.c_int
            self._fast = bool(fn())
        return getattr(lib, self.name) if self._fast else None

    def wide(self) -> bool:
        """The build runs the kernel's AVX-512 path (its features built and on this CPU: the
        CPU record, decided once), not its AVX2 one."""
        if self._wide is None:
            self._wide = loaded_record().supports(*self.wide_features)
        return self._wide

    def weight_fits(self, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """The kernel takes this weight and bias: [N, K] contiguous and None or [N] contiguous,
        both of its dtype, on the CPU."""
        if weight.dim() != 2 or weight.dtype != self.dtype or weight.device.type != "cpu":
            return False
        if not weight.is_contiguous():
            return False
        if bias is None:
            return True
        return (
            bias.shape == (weight.shape[0],) and bias.dtype == self.dtype
            and bias.is_contiguous() and bias.device.type == "cpu"
        )  # fmt: skip

    def run(
        self, fn: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        """The kernel on a checked weight and bias (`weight_fits`) and x [M, K] of its dtype on
        the CPU (any row stride): [M, N]. The per-call path (few checks); x of another K raises,
        as F.linear does (the kernel would read K values of each row of x)."""
        if x.shape[1] != weight.shape[1]:
            raise RuntimeError(f"x {list(x.shape)} does not fit the weight {list(weight.shape)}")
        if x.stride(1) != 1:
            x = x.contiguous()
        m, n = x.shape[0], weight.shape[0]
        y = torch.empty(m, n, dtype=self.dtype)
        fn(x.data_ptr(), x.stride(0), weight.data_ptr(), None if bias is None else bias.data_ptr(),
           m, n, weight.shape[1], y.data_ptr(), n)  # fmt: skip
        return y

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """x [M, K] @ weight[N, K].T + bias, all of its dtype (float32 sums) -> [M, N]; None
        when the fast kernel or these tensors don't fit."""
        fn = self.kernel()
        if fn is None or not self.weight_fits(weight, bias) or x.dim() != 2:
            return None
        if x.dtype != self.dtype or x.device.type != "cpu" or x.shape[1] != weight.shape[1]:
            return None
        return self.run(fn, x, weight, bias)
