"""The native int8 weight-only linear (`int8_linear.c`, compiled into the one native library):
ctypes signature and the checks that keep it inside its tensors.
`hybridkv.layers.quantization` is the reference and the caller."""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from hybridkv.ops import native

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGS = [_ptr, _i64, _int, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int]
# hkv_int8_linear_amx (int8_amx.c): the same arguments on AMX-INT8 tiles; 0, or -1 (no tiles,
# no memory)
native.declare({"hkv_int8_linear": _ARGS, "hkv_int8_linear_amx": _ARGS})
native.returns_status("hkv_int8_linear_amx")

DTYPES = (torch.float32, torch.bfloat16)  # of x and y
_kernel: Any = None  # the ctypes function, once looked up
_vectorized: bool | None = None


def available() -> bool:
    """The kernels load and this build has vector tiles (AVX-512, or AVX2 + FMA: the tiles and
    the AVX2 GEMM; the plain-loop build is slower than PyTorch's int8 path, so callers keep
    that one instead)."""
    return kernel() is not None


def kernel() -> Any:
    """The ctypes function `hkv_int8_linear`, or None (no library, a build without AVX2, or
    `HYBRIDKV_NATIVE=0`)."""
    global _kernel, _vectorized
    lib = native.library()
    if lib is None:
        return None
    if _vectorized is None:
        fn = lib.hkv_int8_vectorized
        fn.argtypes, fn.restype = [], ctypes.c_int
        _vectorized, _kernel = bool(fn()), lib.hkv_int8_linear
    return _kernel if _vectorized else None


def weights_fit(q: torch.Tensor, scale: torch.Tensor) -> bool:
    """The kernel takes this weight: int8 [N, K] and bfloat16 [N], contiguous, on the CPU."""
    return (
        q.dim() == 2 and q.dtype == torch.int8 and q.is_contiguous() and q.device.type == "cpu"
        and scale.shape == (q.shape[0],) and scale.dtype == torch.bfloat16
        and scale.is_contiguous() and scale.device.type == "cpu"
    )  # fmt: skip


def run(fn: Any, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The kernel on checked weights (`weights_fit`) and x [M, K] float32/bfloat16 on the
    CPU: [M, N] in x's dtype. The per-call path of the int8 layers (few checks); x of another K
    raises, as F.linear does (the kernel would read K values of each row of x)."""
    x, y, bf16 = _operands(x, q)
    fn(x.data_ptr(), x.stride(0), bf16, q.data_ptr(), scale.data_ptr(), x.shape[0], q.shape[0],
       q.shape[1], y.data_ptr(), q.shape[0], bf16)  # fmt: skip
    return y


def _operands(x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """x with unit column stride, y [M, N] in x's dtype, and whether they are bfloat16; x of
    another K than q raises (the kernels would read K values of each row of x)."""
    if x.shape[1] != q.shape[1]:
        raise RuntimeError(f"x {list(x.shape)} does not fit the weight {list(q.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = torch.empty(x.shape[0], q.shape[0], dtype=x.dtype)
    return x, y, int(x.dtype == torch.bfloat16)


def run_amx(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`run` on AMX-INT8 tiles (`int8_amx.c`: each row of x as two 8-bit digits of its own
    scale, within 2^-16 of its largest value; exact int32 sums), for a CPU record with amx_int8
    (the op chain's choice); raises MemoryError where it cannot run."""
    x, y, bf16 = _operands(x, q)
    fn = native.library().hkv_int8_linear_amx
    status = fn(x.data_ptr(), x.stride(0), bf16, q.data_ptr(), scale.data_ptr(), x.shape[0],
                q.shape[0], q.shape[1], y.data_ptr(), q.shape[0], bf16)  # fmt: skip
    if status:
        raise MemoryError("the native int8 AMX linear could not run (no tiles / memory)")
    return y


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] float32/bfloat16, q int8 [N, K], scale bfloat16 [N] -> x @ (q * scale).T
    [M, N] in x's dtype (float32 math); None when the kernels or these tensors don't fit."""
    fn = kernel()
    if fn is None or not weights_fit(q, scale) or x.dim() != 2 or x.dtype not in DTYPES:
        return None
    if x.device.type != "cpu" or x.shape[1] != q.shape[1]:
        return None
    return run(fn, x, q, scale)
