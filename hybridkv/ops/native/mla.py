"""The native MLA kernels (`mla.c`, compiled into the one native library): ctypes signatures and
the checks that keep them inside their tensors.

- `rope_pairs`: DeepSeek's interleaved RoPE (`layers.rotary.torch_rope_pairs`);
- `write_rows`: a step's [c | k_rope] rows into their cache slots (`ops.mla.torch_write_mla`);
- `decode_absorbed`: decode rows from q_nope / q_rope to the values in one call (absorb,
  attend, expand: `ops.mla.torch_mla_decode_rows`), reading the table and lengths as they are
  (no value checks that would read them in Python: a decode step stays capturable).
"""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_mla_rope_pairs": [_ptr, _i64, _i64, _ptr, _ptr, _ptr, _int, _i64, _i64, _i64],
    "hkv_mla_write": [_ptr, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64],
    "hkv_mla_decode_absorbed": [_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _int, _ptr, _int, _i64,
                                _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _f32, _ptr,
                                _ptr],
})  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16)


def available() -> bool:
    return native.library() is not None


def _cpu(*tensors: torch.Tensor) -> bool:
    return all(t.device.type == "cpu" for t in tensors)


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """DeepSeek's interleaved RoPE in one pass: x [T, H, R] (pairs contiguous, tokens and heads
    at any stride), cos, sin [T, R] contiguous of x's dtype (float32 or bfloat16) -> [T, H, R]
    contiguous, laid out [evens' | odds']; None when not supported."""
    lib = native.library()
    if lib is None or x.dim() != 3 or x.dtype not in DTYPES or x.stride(2) != 1:
        return None
    tokens, heads, dim = x.shape
    if dim % 2 or cos.dtype != x.dtype or sin.dtype != x.dtype or not _cpu(x, cos, sin):
        return None
    if cos.shape != (tokens, dim) or sin.shape != (tokens, dim):
        return None
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty(tokens, heads, dim, dtype=x.dtype)
    lib.hkv_mla_rope_pairs(
        x.data_ptr(), x.stride(0), x.stride(1), cos.data_ptr(), sin.data_ptr(), out.data_ptr(),
        int(x.dtype == torch.bfloat16), tokens, heads, dim,
    )  # fmt: skip
    return out


def write_rows(
    c: torch.Tensor, k_rope: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool:
    """Write [c | k_rope] of each token into its slot (slot -1 or past the cache: skipped):
    c [T, rank], k_rope [T, rope] (unit column stride, rows at any stride) of the cache's dtype
    (float32 or bfloat16); kv_cache [num_kernel_blocks, kbs, rank + rope] contiguous;
    slot_mapping [T] int64. False (nothing written) when not supported."""
    lib = native.library()
    if lib is None or c.dim() != 2 or k_rope.dim() != 2 or kv_cache.dim() != 3:
        return False
    if not c.dtype == k_rope.dtype == kv_cache.dtype or c.dtype not in DTYPES:
        return False
    tokens, rank = c.shape
    rope = k_rope.shape[1]
    if k_rope.shape[0] != tokens or kv_cache.shape[2] != rank + rope:
        return False
    if c.stride(1) != 1 or k_rope.stride(1) != 1 or not kv_cache.is_contiguous():
        return False
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (tokens,):
        return False
    if not _cpu(c, k_rope, kv_cache, slot_mapping):
        return False
    slots = slot_mapping.contiguous()
    lib.hkv_mla_write(
        c.data_ptr(), c.stride(0), k_rope.data_ptr(), k_rope.stride(0), kv_cache.data_ptr(),
        slots.data_ptr(), tokens, rank, rope, c.element_size(),
        kv_cache.shape[0] * kv_cache.shape[1],
    )  # fmt: skip
    return True


def decode_absorbed(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_kv_b: torch.Tensor,
    nope_dim: int,
) -> torch.Tensor | None:
    """One decode row per request, from the query projections to the values: q_nope
    [S, heads, nope], q_rope [S, heads, rope] (channels contiguous, any other strides), w_kv_b
    [heads * (nope + v), rank] contiguous, all float32 or all bfloat16; kv_cache
    [num_kernel_blocks, kbs, rank + rope] contiguous, float32 or bfloat16; block_table
    [S, max_blocks] int32 (unit column stride); seq_lens [S] int32 -> [S, heads, v] in q's
    dtype (float32 sums throughout). None when not supported."""
    lib = native.library()
    if lib is None or q_nope.dim() != 3 or q_rope.dim() != 3 or kv_cache.dim() != 3:
        return None
    if not q_nope.dtype == q_rope.dtype == w_kv_b.dtype or q_nope.dtype not in DTYPES:
        return None
    if kv_cache.dtype not in DTYPES or not kv_cache.is_contiguous() or not w_kv_b.is_contiguous():
        return None
    num_seqs, heads, nope = q_nope.shape
    rope = q_rope.shape[2]
    rank = kv_cache.shape[2] - rope
    if nope != nope_dim or q_rope.shape[:2] != (num_seqs, heads) or rank <= 0:
        return None
    if w_kv_b.dim() != 2 or w_kv_b.shape[1] != rank or w_kv_b.shape[0] % heads:
        return None
    v_dim = w_kv_b.shape[0] // heads - nope
    if v_dim <= 0 or q_nope.stride(2) != 1 or (rope and q_rope.stride(2) != 1):
        return None
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        return None
    if block_table.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        return None
    if seq_lens.dtype != torch.int32 or not _cpu(q_nope, q_rope, kv_cache, w_kv_b, block_table):
        return None
    lens = seq_lens.contiguous()
    work = torch.empty(num_seqs, heads, 2 * rank + rope, dtype=torch.float32)
    out = torch.empty(num_seqs, heads, v_dim, dtype=q_nope.dtype)
    if num_seqs == 0:
        return out
    lib.hkv_mla_decode_absorbed(
        q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), q_rope.data_ptr(),
        q_rope.stride(0), q_rope.stride(1), w_kv_b.data_ptr(), int(q_nope.dtype == torch.bfloat16),
        kv_cache.data_ptr(), int(kv_cache.dtype == torch.bfloat16), kv_cache.shape[1], rank,
        rope, nope, v_dim, heads, block_table.data_ptr(), block_table.stride(0), lens.data_ptr(),
        num_seqs, scale, work.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    return out
