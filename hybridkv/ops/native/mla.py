"""The native MLA decode (`mla.c`, compiled into the one native library): ctypes signature and
the checks that keep it inside its tensors. `hybridkv.ops.mla.mla_decode` is the reference."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_mla_decode": [_ptr, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _f32,
                       _ptr],
})  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16)


def _fits(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor, rank: int) -> bool:
    if q.device.type != "cpu" or kv_cache.device.type != "cpu" or q.dim() != 3:
        return False
    if q.dtype not in DTYPES or kv_cache.dtype != q.dtype or not kv_cache.is_contiguous():
        return False
    if kv_cache.dim() != 3 or kv_cache.shape[2] != q.shape[2] or not 0 < rank <= q.shape[2]:
        return False
    return block_table.dtype == torch.int32 and block_table.stride(-1) == 1


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor | None:
    """As `hybridkv.ops.mla.mla_decode` (q [S, heads, rank + rope] -> [S, heads, rank] in q's
    dtype), natively; None when the kernels or these tensors are not supported.

    kv_cache: [num_kernel_blocks, kbs, rank + rope] contiguous, of q's dtype (float32 or
    bfloat16; float32 math either way); block_table: [S, max_blocks] int32.
    """
    lib = native.library()
    if lib is None or not _fits(q, kv_cache, block_table, kv_lora_rank):
        return None
    num_seqs, heads, width = q.shape
    kbs = kv_cache.shape[1]
    lens = seq_lens.to(torch.int64).contiguous()
    if num_seqs == 0 or lens.shape[0] != num_seqs or block_table.shape[0] != num_seqs:
        return None
    # every row read must lie inside the cache and the table
    if int(lens.min()) < 0 or int(lens.max()) > block_table.shape[1] * kbs:
        return None
    if int(block_table.min()) < 0 or int(block_table.max()) >= kv_cache.shape[0]:
        return None
    q = q.contiguous()
    out = torch.empty(num_seqs, heads, kv_lora_rank, dtype=torch.float32)
    lib.hkv_mla_decode(
        q.data_ptr(), kv_cache.data_ptr(), int(q.dtype == torch.bfloat16), kbs, kv_lora_rank,
        width - kv_lora_rank, heads, block_table.data_ptr(), block_table.stride(0),
        lens.data_ptr(), num_seqs, scale, out.data_ptr(),
    )  # fmt: skip
    return out.to(q.dtype)


def available() -> bool:
    return native.library() is not None
