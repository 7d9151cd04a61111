"""Multi-head latent attention (MLA, DeepSeek-V2/V3, Kimi-Linear) over a paged latent cache, in
PyTorch: the reference the native and Triton decode kernels are tested against.

One token of one layer caches one row of `kv_lora_rank + rope_dim` values, no separate K and V:

    kv_cache: [num_kernel_blocks, kernel_block_size, kv_lora_rank + rope_dim]
    row of a token:  [ c (normed latent, kv_lora_rank) | k_rope (rotated key, rope_dim) ]

kv_b_proj maps c to each head's key part and value: W_UK [heads, nope_dim, kv_lora_rank] and
W_UV [heads, v_dim, kv_lora_rank]. Head h scores key t as

    q_nope[h] . (W_UK[h] c_t) + q_rope[h] . kr_t  =  (W_UK[h]^T q_nope[h]) . c_t + q_rope . kr_t

so a decode works in latent space: the absorbed query `[W_UK^T q_nope | q_rope]` attends over
the cached rows as one shared key/value head (the value is the row's first kv_lora_rank
values), and W_UV is applied to the latent output (`mla_decode` returns [S, heads, kv_lora_rank],
the interface of FlashMLA-style kernels). A prefill chunk expands the latents of its context to
K and V (cheaper when many queries share the context) and attends as ordinary attention.

Batches are packed and ragged as in `hybridkv.ops.attention` (query_start_loc, seq_lens: the
queries are the last q_len of seq_len positions); invisible positions read the null block.

Two op families (`hybridkv.ops.registry`), keyed by the cache's dtype: `WRITE_MLA` (the step's
[c | k_rope] rows into their slots) and `MLA_DECODE_ROWS` (decode rows from q_nope / q_rope to
the values: absorb, attend, expand). On the CPU in float32 and bfloat16 both are native kernels
(`hybridkv.ops.native.mla`), so a decode step of an MLA model is made only of kernel calls and
can be captured (`hybridkv.worker.graphs`); elsewhere (and `HYBRIDKV_NATIVE=0`) the PyTorch
code here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridkv.ops.attention import NULL_BLOCK, zero_pages
from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

__all__ = [
    "write_mla_cache", "write_mla_rows", "zero_pages", "gather_latent", "mla_decode",
    "mla_prefill", "mla_paged_attention", "absorb_query",
]  # fmt: skip

DecodeFn = Callable[..., torch.Tensor]
_CPU = frozenset({"cpu"})
WRITE_MLA = declare(
    "write_mla",
    (
        OpImpl("native", f"{__name__}:_native_write_mla", _CPU, CPU_FLOATS, ("native",),
               strict=True, description="[c | k_rope] rows copied into their slots (C)"),
        OpImpl("torch", f"{__name__}:torch_write_mla"),
    ),
)  # fmt: skip
MLA_DECODE_ROWS = declare(
    "mla_decode_rows",
    (
        OpImpl("native", f"{__name__}:_native_mla_decode_rows", _CPU, CPU_FLOATS, ("native",),
               strict=True, description="absorb, latent attention and W_UV in one call (C)"),
        OpImpl("torch", f"{__name__}:torch_mla_decode_rows"),
    ),
)  # fmt: skip


def write_mla_rows(
    c: torch.Tensor, k_rope: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write each token's row [c | k_rope] into its slot (slot -1: padding, skipped): c
    [T, kv_lora_rank] (normed latent), k_rope [T, rope_dim] (rotated key); `WRITE_MLA`'s
    choice for the cache's device and dtype."""
    WRITE_MLA.of(kv_cache).first(c, k_rope, kv_cache, slot_mapping)


def _native_write_mla(
    c: torch.Tensor, k_rope: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> bool | None:
    from hybridkv.ops.native import mla as native_mla

    c, k_rope = c.to(kv_cache.dtype), k_rope.to(kv_cache.dtype)  # (views when they are)
    c = c if c.stride(-1) == 1 else c.contiguous()
    k_rope = k_rope if k_rope.stride(-1) == 1 else k_rope.contiguous()
    return native_mla.write_rows(c, k_rope, kv_cache, slot_mapping.long()) or None


def torch_write_mla(
    c: torch.Tensor, k_rope: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    write_mla_cache(torch.cat([c, k_rope.to(c.dtype)], dim=-1), kv_cache, slot_mapping)


def write_mla_cache(
    latent: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new rows by slot (slot -1: padding, skipped).

    latent: [num_tokens, kv_lora_rank + rope_dim] (normed c, then the rotated key);
    kv_cache: [num_kernel_blocks, kernel_block_size, kv_lora_rank + rope_dim]
    """
    kbs = kv_cache.shape[1]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        latent, slot_mapping = latent[valid], slot_mapping[valid]
    kv_cache[slot_mapping // kbs, slot_mapping % kbs] = latent.to(kv_cache.dtype)


def gather_latent(
    kv_cache: torch.Tensor, block_table: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Rows of every request's positions 0..T-1; invisible positions read the null block.

    block_table: [S, max_blocks]; visible: [S, T] bool -> [S, T, kv_lora_rank + rope_dim]
    """
    num_seqs, num_pos = visible.shape
    kbs = kv_cache.shape[1]
    rows = kv_cache.view(-1, kv_cache.shape[2])  # [num_kernel_blocks * kbs, width]
    pos = torch.arange(num_pos, device=visible.device)
    block_idx = (pos // kbs).clamp(max=block_table.shape[1] - 1)
    idx = block_table.long()[:, block_idx] * kbs + pos % kbs  # [S, T]
    idx = torch.where(visible, idx, torch.full_like(idx, NULL_BLOCK * kbs))
    return rows.index_select(0, idx.reshape(-1)).view(num_seqs, num_pos, rows.shape[1])


def absorb_query(q_nope: torch.Tensor, q_rope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """The latent-space query of a decode.

    q_nope: [S, heads, nope_dim]; q_rope: [S, heads, rope_dim]; w_uk: [heads, nope_dim, rank]
    -> [S, heads, rank + rope_dim]
    """
    q_lat = torch.einsum("shd,hdr->shr", q_nope, w_uk.to(q_nope.dtype))
    return torch.cat([q_lat, q_rope], dim=-1)


def mla_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """One absorbed query per request over its whole context, float32 math.

    q: [S, heads, rank + rope_dim]; block_table: [S, max_blocks]; seq_lens: [S]
    -> [S, heads, rank] (the attention-weighted latent, in q's dtype)
    """
    seq_lens = seq_lens.long()
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    pos = torch.arange(max_len, device=q.device)
    visible = pos[None, :] < seq_lens[:, None]  # [S, T]
    rows = gather_latent(kv_cache, block_table, visible).float()  # [S, T, width]
    scores = torch.einsum("shw,stw->sht", q.float(), rows) * scale  # [S, heads, T]
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("sht,str->shr", probs, rows[..., :kv_lora_rank])
    return out.to(q.dtype)


def mla_prefill(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    w_kv_b: torch.Tensor,
    nope_dim: int,
) -> torch.Tensor:
    """One request's chunk, its context's latents expanded to K and V.

    q_nope: [L, heads, nope_dim]; q_rope: [L, heads, rope_dim] are the last L of `seq_len`
    positions; w_kv_b: [heads * (nope_dim + v_dim), rank] (kv_b_proj.weight) -> [L, heads, v_dim]
    """
    q_len, heads, _ = q_nope.shape
    rank = kv_cache.shape[2] - q_rope.shape[2]
    visible = torch.ones(1, seq_len, dtype=torch.bool, device=q_nope.device)
    rows = gather_latent(kv_cache, table_row[None], visible)[0]  # [T, width]
    kv = F.linear(rows[:, :rank].to(w_kv_b.dtype), w_kv_b).view(seq_len, heads, -1)
    k_nope, v = kv[..., :nope_dim], kv[..., nope_dim:]  # [T, heads, nope], [T, heads, v_dim]
    k_rope = rows[:, None, rank:].to(k_nope.dtype).expand(seq_len, heads, -1)
    k = torch.cat([k_nope, k_rope], dim=-1)  # [T, heads, nope + rope]
    q = torch.cat([q_nope, q_rope], dim=-1)  # [L, heads, nope + rope]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    allowed = torch.arange(seq_len, device=q.device)[None, :] <= q_pos  # [L, T]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).float(), k.transpose(0, 1).float(), v.transpose(0, 1).float(),
        attn_mask=allowed, scale=scale,
    )  # fmt: skip
    return out.transpose(0, 1).to(q_nope.dtype)  # [L, heads, v_dim]


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
    decode: DecodeFn | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Causal MLA of packed queries over each request's paged latents.

    q_nope: [T, heads, nope_dim]; q_rope: [T, heads, rope_dim]; w_kv_b: kv_b_proj.weight
    [heads * (nope_dim + v_dim), rank] -> [T, heads, v_dim].

    Decode rows (one query) run together: through `MLA_DECODE_ROWS` (absorb, attend, expand),
    or, given a latent-space `decode` kernel (Triton's), absorbed here, attended by it and
    expanded by W_UV here; each prefill chunk is expanded on its own. `max_query_len` 1 with
    one table row per token: every row a decode (nothing is read back from the batch).
    """
    num_tokens, heads, _ = q_nope.shape
    rank = kv_cache.shape[2] - q_rope.shape[2]
    if decode is None and max_query_len == 1 and num_tokens == block_table.shape[0]:
        return _decode_rows(q_nope, q_rope, kv_cache, block_table, seq_lens, scale, w_kv_b,
                            nope_dim)  # fmt: skip
    w = w_kv_b.view(heads, -1, rank)  # [heads, nope + v_dim, rank]
    w_uk, w_uv = w[:, :nope_dim], w[:, nope_dim:]
    out = q_nope.new_empty(num_tokens, heads, w_uv.shape[1])
    if num_tokens == 0:
        return out
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = q_lens == 1
    if bool(is_decode.any()):
        rows = torch.nonzero(is_decode).flatten()
        tokens = query_start_loc[:-1].long()[rows]
        if decode is None:
            out[tokens] = _decode_rows(
                q_nope[tokens], q_rope[tokens], kv_cache, block_table[rows], seq_lens[rows],
                scale, w_kv_b, nope_dim,
            ).to(out.dtype)  # fmt: skip
        else:
            q = absorb_query(q_nope[tokens], q_rope[tokens], w_uk)  # [S, heads, rank + rope]
            latent = decode(q, kv_cache, block_table[rows], seq_lens[rows], scale, rank)
            out[tokens] = torch.einsum("shr,hvr->shv", latent, w_uv.to(latent.dtype)).to(
                out.dtype
            )
    starts, lens, ctx = query_start_loc.tolist(), q_lens.tolist(), seq_lens.tolist()
    for s, n in enumerate(lens):
        if n > 1:
            a = starts[s]
            out[a : a + n] = mla_prefill(
                q_nope[a : a + n], q_rope[a : a + n], kv_cache, block_table[s], ctx[s], scale,
                w_kv_b, nope_dim,
            )  # fmt: skip
    return out


def _decode_rows(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_kv_b: torch.Tensor,
    nope_dim: int,
) -> torch.Tensor:
    """One query per request: `MLA_DECODE_ROWS`' choice for the cache's device and the cache's
    and the query's dtypes."""
    run = MLA_DECODE_ROWS.of(kv_cache, q_nope).first
    return run(q_nope, q_rope, kv_cache, block_table, seq_lens, scale, w_kv_b, nope_dim)


def _native_mla_decode_rows(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_kv_b: torch.Tensor,
    nope_dim: int,
) -> torch.Tensor | None:
    from hybridkv.ops.native import mla as native_mla

    # the kernel takes int32 tables and lengths (the step's own: views) and q, w of one dtype
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    lens = seq_lens if seq_lens.dtype == torch.int32 else seq_lens.int()
    w = w_kv_b if w_kv_b.dtype == q_nope.dtype else w_kv_b.to(q_nope.dtype)
    return native_mla.decode_absorbed(
        q_nope, q_rope.to(q_nope.dtype), kv_cache, table, lens, scale, w.contiguous(), nope_dim
    )


def torch_mla_decode_rows(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    w_kv_b: torch.Tensor,
    nope_dim: int,
) -> torch.Tensor:
    """Decode rows in PyTorch: q_nope [S, heads, nope], q_rope [S, heads, rope] -> [S, heads,
    v_dim] (absorb_query, mla_decode, then W_UV; each rounded to q's dtype)."""
    heads = q_nope.shape[1]
    rank = kv_cache.shape[2] - q_rope.shape[2]
    w = w_kv_b.view(heads, -1, rank)  # [heads, nope + v_dim, rank]
    w_uk, w_uv = w[:, :nope_dim], w[:, nope_dim:]
    q = absorb_query(q_nope, q_rope, w_uk)  # [S, heads, rank + rope]
    latent = mla_decode(q, kv_cache, block_table, seq_lens, scale, rank)
    return torch.einsum("shr,hvr->shv", latent, w_uv.to(latent.dtype)).to(q_nope.dtype)
