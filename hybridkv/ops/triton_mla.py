"""MLA decode in Triton over kernel-block tables: the `triton` backend's MLA ops (and those of
the MLA backends declared for planning, FlashMLA 64 / CUTLASS MLA 128 / FlashInfer MLA 32/64,
which run on it). Same signatures and semantics as `hybridkv.ops.mla` (the reference; see it
for the latent cache layout); set `TRITON_INTERPRET=1` before importing this module on a
machine without a GPU.

Decode: one program per (request, block of BLOCK_H heads). The absorbed queries of its heads
[BLOCK_H, rank + rope] attend over the request's latent rows in tiles of TILE_N positions; each
position is mapped to its kernel block separately, so any kernel block size works (a tile may
span several blocks or cover part of one):

    position p  ->  row (block_table[s, p // kbs] * kbs + p % kbs) of kv_cache viewed as
                    [num_kernel_blocks * kbs, rank + rope]
    scores [BLOCK_H, TILE_N] = q_lat . c^T + q_rope . k_rope^T     (one shared "KV head")
    acc    [BLOCK_H, rank]  += softmax-weights . c                  (online, float32, base 2)

Positions past seq_len are masked loads (read as zero, never multiplied into a NaN) and -inf
scores. Prefill chunks and the cache write are the PyTorch reference's (torch ops on the
device): a prefill expands latents to K/V, which is matmul work, not a paged-attention kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops import mla as reference
from hybridkv.ops.attention import zero_pages

__all__ = [
    "write_mla_cache", "write_mla_rows", "zero_pages", "mla_decode", "mla_paged_attention"
]

LOG2E = 1.4426950408889634
write_mla_cache = reference.write_mla_cache
write_mla_rows = reference.write_mla_rows


@triton.jit
def _mla_decode_kernel(
    q_ptr,  # [S, heads, RANK + ROPE]
    cache_ptr,  # [num_kernel_blocks * KBS, RANK + ROPE]
    table_ptr,  # [S, table_stride] int32
    seq_lens_ptr,  # [S] int32
    out_ptr,  # [S, heads, RANK] float32
    num_heads,
    table_stride,
    scale_log2,
    KBS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    s = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    r = tl.arange(0, BLOCK_R)
    p = tl.arange(0, BLOCK_P)
    width = RANK + ROPE
    hmask = heads < num_heads
    q_rows = (s * num_heads + heads).to(tl.int64) * width
    q_lat = tl.load(
        q_ptr + q_rows[:, None] + r[None, :], mask=hmask[:, None] & (r[None, :] < RANK), other=0.0
    )
    q_pe = tl.load(
        q_ptr + q_rows[:, None] + RANK + p[None, :],
        mask=hmask[:, None] & (p[None, :] < ROPE),
        other=0.0,
    )
    if DOT_FP32:
        q_lat, q_pe = q_lat.to(tl.float32), q_pe.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + s)
    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    denom = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], tl.float32)
    for start in range(0, seq_len, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        valid = pos < seq_len
        block = tl.load(table_ptr + s * table_stride + pos // KBS, mask=valid, other=0)
        rows = (block.to(tl.int64) * KBS + pos % KBS) * width  # [TILE_N]
        c = tl.load(
            cache_ptr + rows[:, None] + r[None, :],
            mask=valid[:, None] & (r[None, :] < RANK),
            other=0.0,
        )  # [TILE_N, BLOCK_R]
        k_pe = tl.load(
            cache_ptr + rows[:, None] + RANK + p[None, :],
            mask=valid[:, None] & (p[None, :] < ROPE),
            other=0.0,
        )  # [TILE_N, BLOCK_P]
        if DOT_FP32:
            c, k_pe = c.to(tl.float32), k_pe.to(tl.float32)
            scores = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
            scores += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            scores = tl.dot(q_lat, tl.trans(c)) + tl.dot(q_pe, tl.trans(k_pe))
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))  # [BLOCK_H, N]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp2(m - m_new)
        probs = tl.exp2(scores - m_new[:, None])
        denom = denom * alpha + tl.sum(probs, axis=1)
        if DOT_FP32:  # noqa: SIM108 (a constexpr branch, not a value choice)
            pv = tl.dot(probs, c, input_precision="ieee")
        else:
            pv = tl.dot(probs.to(c.dtype), c)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / denom[:, None]
    out_rows = (s * num_heads + heads).to(tl.int64) * RANK
    tl.store(
        out_ptr + out_rows[:, None] + r[None, :], out, mask=hmask[:, None] & (r[None, :] < RANK)
    )


def _interpreted() -> bool:
    return not isinstance(_mla_decode_kernel, triton.runtime.JITFunction)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    tile_n: int = 32,
    block_h: int = 16,
) -> torch.Tensor:
    """As `hybridkv.ops.mla.mla_decode`: q [S, heads, rank + rope] -> [S, heads, rank]."""
    num_seqs, heads, width = q.shape
    rope = width - kv_lora_rank
    out = torch.empty(num_seqs, heads, kv_lora_rank, dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out.to(q.dtype)
    if q.device.type == "cpu" and not _interpreted():
        raise RuntimeError("hybridkv's Triton MLA kernel got CPU tensors: set TRITON_INTERPRET=1")
    table = block_table.to(torch.int32).contiguous()
    grid = (num_seqs, triton.cdiv(heads, block_h))
    _mla_decode_kernel[grid](
        q.contiguous(), kv_cache.contiguous(), table, seq_lens.to(torch.int32).contiguous(), out,
        heads, table.shape[1], scale * LOG2E,
        KBS=kv_cache.shape[1], RANK=kv_lora_rank, ROPE=rope, BLOCK_H=block_h,
        BLOCK_R=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_P=max(16, triton.next_power_of_2(max(rope, 1))), TILE_N=tile_n,
        DOT_FP32=kv_cache.dtype == torch.float32 or _interpreted(),
    )  # fmt: skip
    return out.to(q.dtype)


def mla_paged_attention(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_kv_b: torch.Tensor,
    nope_dim: int,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """As `hybridkv.ops.mla.mla_paged_attention`, decode rows through the Triton kernel."""
    return reference.mla_paged_attention(
        q_nope, q_rope, kv_cache, block_table, query_start_loc, seq_lens, scale, w_kv_b,
        nope_dim, decode=mla_decode, max_query_len=max_query_len,
    )  # fmt: skip
