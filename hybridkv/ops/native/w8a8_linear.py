"""The native int8 x int8 linear (`w8a8_linear.c`, compiled into the one native library): on
AMX-INT8 tiles, with AVX-512 VNNI (vpdpbusd on 512-bit vectors), with AVX2 (vpmaddubsw, or
AVX-VNNI's vpdpbusd), or on aarch64 with NEON (sdot
where the build has the dot product, else 16-bit products); ctypes signatures and the checks
that keep them inside their tensors.
`hybridkv.layers.quantization` (quantization="w8a8") is the caller and holds the reference,
`w8a8_reference`, which this kernel equals bit for bit."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
_ARGS = [_ptr, _i64, _int, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _int]
KERNELS = {
    "amx": "hkv_w8a8_linear",
    "avx512_vnni": "hkv_w8a8_linear_avx512_vnni",  # AVX-512 VNNI without AMX-INT8
    "avx2": "hkv_w8a8_linear_avx2",
    "neon_dot": "hkv_w8a8_linear_neon_dot",  # aarch64 with the dot product (ARMv8.2+)
    "neon": "hkv_w8a8_linear_neon",  # any aarch64
}
native.declare(dict.fromkeys(KERNELS.values(), _ARGS))
native.returns_status(*KERNELS.values())

DTYPES = (torch.float32, torch.bfloat16)  # of x and y
TILE_N, TILE_K = 16, 64  # the packed weight's blocks: 16 output rows x 64 inputs


def packed_shape(n: int, k: int) -> tuple[int, int, int, int, int]:
    """The packed weight of an [n, k] int8 weight: [n/16, k/64, 16, 16, 4] (both padded)."""
    return (-(-n // TILE_N), -(-k // TILE_K), 16, TILE_N, 4)


def check_weights(wp: torch.Tensor, scale: torch.Tensor, n: int, k: int) -> None:
    """The kernels take this weight: packed (`packed_shape(n, k)`, contiguous int8) with its
    bfloat16 [n] scales, on the CPU. Checked once per layer (`W8A8Linear`), not per call."""
    if wp.shape != packed_shape(n, k) or wp.dtype != torch.int8 or not wp.is_contiguous():
        raise ValueError(f"the packed weight {list(wp.shape)} {wp.dtype} is not [{n}, {k}]'s")
    if scale.shape != (n,) or scale.dtype != torch.bfloat16 or not scale.is_contiguous():
        raise ValueError(f"the scale {list(scale.shape)} {scale.dtype} is not bfloat16 [{n}]")
    if wp.device.type != "cpu" or scale.device.type != "cpu":
        raise ValueError("the packed weight and its scales must be on the CPU")


def run(
    x: torch.Tensor,
    wp: torch.Tensor,
    scale: torch.Tensor,
    n: int,
    k: int,
    kernel: str = "amx",
) -> torch.Tensor:
    """x [M, k] float32 / bfloat16 on the CPU, a weight `check_weights` passed -> [M, n] in
    x's dtype, through `kernel` ("amx": AMX-INT8 tiles; "avx512_vnni": 16 columns' 4-byte dot
    products per instruction; "avx2": 8-bit products on 256-bit vectors; "neon_dot" / "neon":
    aarch64's sdot / 16-bit products; the same result). The per-call path: x is checked (a
    wrong K raises, as F.linear does), the weight is not."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype not in DTYPES or x.device.type != "cpu":
        raise RuntimeError(f"x {list(x.shape)} {x.dtype} does not fit the weight [{n}, {k}]")
    if x.stride(1) != 1:
        x = x.contiguous()
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype)
    if m == 0:
        return y
    bf16 = int(x.dtype == torch.bfloat16)
    fn = getattr(native.library(), KERNELS[kernel])
    status = fn(x.data_ptr(), x.stride(0), bf16, m, k, wp.data_ptr(), scale.data_ptr(), n,
                y.data_ptr(), n, bf16)  # fmt: skip
    if status:
        raise MemoryError(f"the native w8a8 linear ({kernel}) could not run (no tiles / memory)")
    return y
