"""Paged attention in PyTorch: the reference every other backend is tested against.

The KV write and the decode rows are op families (`hybridkv.ops.registry`): on the CPU in
float32 and bfloat16 caches the native kernels (`hybridkv.ops.native.decode_attention`), else
the PyTorch code below; chosen once per device and cache dtype (`HYBRIDKV_NATIVE=0`: PyTorch).

The cache of one layer is `kv_cache: [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]`
(K at index 0, V at index 1). A batch is ragged and packed: request s owns query tokens
`query_start_loc[s] : query_start_loc[s+1]`, which are the *last* q_len of its `seq_lens[s]`
context tokens (earlier context was written by previous steps; prefill chunks and decodes mix).

    request s, q_len = 3, seq_len = 7, kernel_block_size = 4
    context positions:   0 1 2 3 | 4 5 6            block_table[s] = [9, 2]
    kernel blocks:       kb 9    | kb 2
    queries:                         4 5 6   (query i sits at seq_len - q_len + i)

Query at position p attends to key positions k with k <= p (causal) and, with a sliding window
W, k > p - W. Unused slots may hold anything, NaN bit patterns included (a page that held a state
before): they are never multiplied by zero. Positions a query must not see are *selected away*:
their gather index points at the null block (kernel block 0, in page 0, which the pool never
hands out and nothing ever writes, so it holds zeros), and their scores are -inf.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from hybridkv.ops.registry import CPU_FLOATS, OpError, OpImpl, declare

_CPU = frozenset({"cpu"})
# keyed by the cache's dtype
WRITE_KV = declare(
    "write_kv",
    (
        OpImpl("native", f"{__name__}:_native_write_kv", _CPU, CPU_FLOATS, ("native",)),
        OpImpl("torch", f"{__name__}:torch_write_kv"),
    ),
)
DECODE_ATTENTION = declare(
    "decode_attention",
    (
        OpImpl("native", f"{__name__}:_native_decode", _CPU, CPU_FLOATS, ("native",), strict=True,
               description="paged, in place (C; AMX / AVX512-BF16 / AVX2 by the CPU record)"),
        OpImpl("torch", f"{__name__}:torch_decode_attention"),
    ),
)  # fmt: skip


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys and values into their slots (slot -1: padding, skipped).

    k, v: [num_tokens, kv_heads, head_dim]; slot_mapping: [num_tokens] int64
    kv_cache: [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]
    """
    WRITE_KV.of(kv_cache).first(k, v, kv_cache, slot_mapping)


def _native_write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    from hybridkv.ops.native import decode_attention

    # the kernel copies each token's heads as one run of the cache's dtype
    k, v = _heads_contiguous(k.to(kv_cache.dtype)), _heads_contiguous(v.to(kv_cache.dtype))
    if not decode_attention.write_kv_cache(k, v, kv_cache, slot_mapping.long()):
        shapes = (tuple(k.shape), tuple(kv_cache.shape), kv_cache.is_contiguous())
        raise OpError(f"the native KV write declined k, cache, contiguous {shapes}")


def _heads_contiguous(x: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, dim] with each token's heads one contiguous run (tokens at any stride)
    return x if x.stride()[1:] == (x.shape[2], 1) else x.contiguous()


def torch_write_kv(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    kbs = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    blocks = slot_mapping // kbs
    offsets = slot_mapping % kbs
    kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)


def zero_pages(buffer_2d: torch.Tensor, page_ids: Sequence[int] | torch.Tensor) -> None:
    """Zero whole pages of a byte buffer. buffer_2d: [num_pages, page_bytes] uint8."""
    ids = torch.as_tensor(page_ids, dtype=torch.int64, device=buffer_2d.device)
    if ids.numel():
        buffer_2d.index_fill_(0, ids, 0)


NULL_BLOCK = 0


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every request's positions 0..T-1; invisible positions read the null block.

    block_table: [S, max_blocks]; visible: [S, T] bool -> k, v: [S, T, kv_heads, head_dim]

        position t  ->  (block_table[s, t // kbs], t % kbs)   if visible[s, t]
                    ->  (NULL_BLOCK, 0)                        otherwise (zeros)

    One `index_select` over the cache seen as rows of [kv_heads, head_dim] copies whole rows
    (advanced indexing with two index tensors goes element by element: 1.7x slower here):

        row of (block b, K or V, offset o) = (2 * b + kv) * kbs + o
    """
    num_seqs, num_pos = visible.shape
    kbs = kv_cache.shape[2]
    rows = kv_cache.view(-1, *kv_cache.shape[3:])  # [num_kernel_blocks * 2 * kbs, kvh, d]
    pos = torch.arange(num_pos, device=visible.device)
    block_idx = (pos // kbs).clamp(max=block_table.shape[1] - 1)
    k_rows = block_table.long()[:, block_idx] * (2 * kbs) + pos % kbs  # [S, T]
    k_rows = torch.where(visible, k_rows, torch.full_like(k_rows, NULL_BLOCK * 2 * kbs))
    both = torch.stack([k_rows, k_rows + kbs], dim=1)  # [S, 2, T]: K rows, then V rows
    kv = rows.index_select(0, both.view(-1)).view(num_seqs, 2, num_pos, *rows.shape[1:])
    return kv[:, 0], kv[:, 1]


# Decodes are split into at most this many groups of similar context length, so the gathered
# K/V of a group is padded to its own longest context instead of the batch's.
MAX_DECODE_GROUPS = 4
MIN_DECODE_GROUP = 8  # requests; below this a group's fixed cost outweighs the padding saved


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Softmax attention in float32. q: [B, heads, L, d]; k, v: [B, kvh, T, d]; mask: bool,
    broadcast to [B, heads, L, T] -> [B, heads, L, d].

    `sinks` [heads] (gpt-oss): one more logit per head in the softmax denominator, with no
    value: p_t = exp(s_t) / (exp(sink) + sum_u exp(s_u)).
    `softcap` c (Gemma 2's attention logit soft-capping): the scaled scores become
    c * tanh(s / c) before the mask and the softmax (the sinks are not capped).
    """
    q, k, v = q.float(), k.float(), v.float()
    gqa = q.shape[1] != k.shape[1]
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    if gqa:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [B, heads, L, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1), v)
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, v)


def _decode_groups(seq_lens: list[int]) -> list[list[int]]:
    """Request indices in groups of similar length (longest first), each sorted."""
    order = sorted(range(len(seq_lens)), key=lambda i: -seq_lens[i])
    num = max(1, min(MAX_DECODE_GROUPS, len(order) // MIN_DECODE_GROUP))
    size = -(-len(order) // num)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_seq_len: int,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per request, all requests at once.

    q: [S, heads, d]; block_table: [S, max_blocks]; seq_lens: [S] -> [S, heads, d]
    """
    seq_lens = seq_lens.long()
    k_pos = torch.arange(max_seq_len, device=q.device)
    visible = k_pos[None, :] < seq_lens[:, None]  # [S, T]
    if sliding_window is not None:
        visible &= k_pos[None, :] > seq_lens[:, None] - 1 - sliding_window
    k, v = gather_context(kv_cache, block_table, visible)  # [S, T, kvh, d]
    # [S, heads, 1, d] x [S, kvh, T, d] (views, no copies), float32 math
    out = _attend(
        q[:, :, None, :], k.transpose(1, 2), v.transpose(1, 2), visible[:, None, None, :],
        scale, sinks, softcap,
    )  # fmt: skip
    return out[:, :, 0, :].to(q.dtype)


def _grouped_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One query per request: `DECODE_ATTENTION`'s choice for the cache's device and dtype."""
    run = DECODE_ATTENTION.of(kv_cache).first
    return run(q, kv_cache, block_table, seq_lens, scale, sliding_window, sinks, softcap)


def _native_decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor | None:
    from hybridkv.ops.native import decode_attention

    # the kernel reads q in the cache's dtype (float32 math either way) and int32 tables
    table = block_table if block_table.dtype == torch.int32 else block_table.int()
    out = decode_attention.paged_decode_attention(
        q.to(kv_cache.dtype), kv_cache, table, seq_lens, scale, sliding_window, sinks=sinks,
        softcap=softcap,
    )  # fmt: skip
    return None if out is None else out.to(q.dtype)


def torch_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """`_decode_attention` per group of similar context lengths (see `_decode_groups`)."""
    lens = seq_lens.tolist()
    groups = _decode_groups(lens)
    if len(groups) == 1:
        return _decode_attention(
            q, kv_cache, block_table, seq_lens, scale, sliding_window, max(lens), sinks, softcap
        )
    out = torch.empty_like(q)
    for members in groups:
        idx = torch.tensor(members, device=q.device)
        out[idx] = _decode_attention(
            q[idx], kv_cache, block_table[idx], seq_lens[idx], scale, sliding_window,
            lens[members[0]], sinks, softcap,
        )  # fmt: skip
    return out


def _prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    table_row: torch.Tensor,
    seq_len: int,
    scale: float,
    sliding_window: int | None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """One request's chunk: q [L, heads, d] are its last L of `seq_len` positions."""
    q_len = q.shape[0]
    q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
    k_pos = torch.arange(seq_len, device=q.device)[None, :]
    allowed = k_pos <= q_pos  # [L, T]
    visible = torch.ones_like(k_pos, dtype=torch.bool)  # [1, T]
    if sliding_window is not None:
        allowed &= k_pos > q_pos - sliding_window
        # blocks that left the window may have been reused by other groups: select them away
        visible = k_pos > seq_len - q_len - sliding_window
    k, v = gather_context(kv_cache, table_row[None], visible)  # [1, T, kvh, d]
    # [1, heads, L, d] x [1, kvh, T, d]: scaled_dot_product_attention in float32
    out = _attend(
        q.transpose(0, 1)[None], k[0].transpose(0, 1)[None], v[0].transpose(0, 1)[None],
        allowed, scale, sinks, softcap,
    )  # fmt: skip
    return out[0].transpose(0, 1).to(q.dtype)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over each request's paged context.

    q: [num_tokens, num_heads, head_dim]; block_table: [num_seqs, max_blocks] int32;
    query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs]  ->  [num_tokens, num_heads, head_dim]
    sinks: [num_heads] or None: a per-head logit added to every softmax denominator (gpt-oss).
    softcap: c > 0 or None: scores s = scale * q.k become c * tanh(s / c) (logit soft-capping).

    Decodes (one query) run together in one batched computation; each prefill chunk runs on
    its own (a loop over the step's prefill requests, usually a few: their query and context
    lengths differ, and padding them to a common shape would cost far more than the loop).
    """
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if max_query_len == 1 and q.shape[0] == block_table.shape[0]:  # decodes only: one row each
        return _grouped_decode_attention(
            q, kv_cache, block_table, seq_lens, scale, sliding_window, sinks, softcap
        )
    out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = q_lens == 1
    if bool(is_decode.any()):
        rows = torch.nonzero(is_decode).flatten()
        tokens = query_start_loc[:-1].long()[rows]
        out[tokens] = _grouped_decode_attention(
            q[tokens], kv_cache, block_table[rows], seq_lens[rows], scale, sliding_window, sinks,
            softcap,
        )  # fmt: skip
    starts, lens, ctx = query_start_loc.tolist(), q_lens.tolist(), seq_lens.tolist()
    for s, n in enumerate(lens):
        if n > 1:
            a = starts[s]
            out[a : a + n] = _prefill_attention(
                q[a : a + n], kv_cache, block_table[s], ctx[s], scale, sliding_window, sinks,
                softcap,
            )  # fmt: skip
    return out
