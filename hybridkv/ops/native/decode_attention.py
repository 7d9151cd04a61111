"""Paged attention's native kernels: decode attention over the paged KV cache
(`hkv_paged_decode`, `decode_attention.c`) and the cache write of a step's keys and values
(`hkv_write_kv`, `kernels.c`). An attention layer's decode step on the development CPU (2
cores, 64 requests of 100..640 tokens): from about 10 ms (PyTorch's gathers) to 2.2 ms.
`ops.attention` calls them and is the reference of the tests."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.derived import derived
from hybridkv.ops.native.common import FLOAT_DTYPES, contiguous_f32, is_bf16, is_float_cpu

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_paged_decode": [_ptr, _ptr, _int, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _i64,
                         _f32, _f32, _ptr, _ptr],
    "hkv_write_kv": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
})  # fmt: skip


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """`ops.attention.write_kv_cache` in one pass: k, v [T, kv_heads, head_dim] (each token's
    heads contiguous, tokens at any stride) of the cache's dtype (float32 or bfloat16);
    kv_cache [num_kernel_blocks, 2, kbs, kv_heads, head_dim] contiguous; slot_mapping [T]
    int64. False (nothing written) when not supported."""
    lib = native.library()
    if lib is None or k.dtype not in FLOAT_DTYPES or not k.dtype == v.dtype == kv_cache.dtype:
        return False
    if k.device.type != "cpu" or v.device.type != "cpu" or kv_cache.device.type != "cpu":
        return False
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != kv_cache.shape[3:]:
        return False
    heads, dim = k.shape[1:]
    if k.stride()[1:] != (dim, 1) or v.stride()[1:] != (dim, 1) or not kv_cache.is_contiguous():
        return False
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        return False
    slots = slot_mapping.contiguous()
    kbs = kv_cache.shape[2]
    lib.hkv_write_kv(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), kv_cache.data_ptr(),
        slots.data_ptr(), k.shape[0], kbs, heads * dim, k.element_size(),
        kv_cache.shape[0] * kbs,
    )  # fmt: skip
    return True


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor | None:
    """Decode attention natively: None when the kernels or these tensors are not supported.
    sinks: [heads] float32 or None (a per-head logit in every softmax denominator, gpt-oss).
    softcap: c > 0 or None: each score s = scale * q.k becomes c * tanh(s / c) (the kernel's
    tanh: absolute error about 2e-7, see decode_attention.c).

    q: [S, heads, d]; kv_cache: [num_kernel_blocks, 2, kbs, kv_heads, d] contiguous, of q's
    dtype (float32 or bfloat16; float32 math either way); block_table: [S, max_blocks] int32;
    seq_lens: [S] -> [S, heads, d] in q's dtype.
    """
    lib = native.library()
    if lib is None or not is_float_cpu(q) or q.dtype != kv_cache.dtype:
        return None
    if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
        return None
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        return None
    num_seqs, num_heads, head_dim = q.shape
    kbs, kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    if seq_lens.shape != (num_seqs,) or block_table.shape[0] != num_seqs:
        return None
    lens = seq_lens.to(torch.int32).contiguous()  # (the step's own int32 lengths: a view)
    window = 0 if sliding_window is None else int(sliding_window)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype)
    sink = None if sinks is None else derived(sinks, "f32", contiguous_f32)
    lib.hkv_paged_decode(
        q.data_ptr(), kv_cache.data_ptr(), is_bf16(q), kbs, kv_heads, head_dim, num_heads,
        block_table.data_ptr(), block_table.stride(0), lens.data_ptr(), window, num_seqs, scale,
        0.0 if softcap is None else float(softcap), None if sink is None else sink.data_ptr(),
        out.data_ptr(),
    )  # fmt: skip
    return out
