"""Paged attention in pure PyTorch: the reference every other backend is tested against.

The cache of one layer is `kv_cache: [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]`
(K at index 0, V at index 1). A batch is ragged and packed: request s owns query tokens
`query_start_loc[s] : query_start_loc[s+1]`, which are the *last* q_len of its `seq_lens[s]`
context tokens (earlier context was written by previous steps; prefill chunks and decodes mix).

    request s, q_len = 3, seq_len = 7, kernel_block_size = 4
    context positions:   0 1 2 3 | 4 5 6            block_table[s] = [9, 2]
    kernel blocks:       kb 9    | kb 2
    queries:                         4 5 6   (query i sits at seq_len - q_len + i)

Query at position p attends to key positions k with k <= p (causal) and, with a sliding window
W, k > p - W. Positions past seq_len and masked positions are removed with `where` (never by
multiplying by zero): a page that held a state before may contain NaN bit patterns.
"""

from __future__ import annotations

import torch


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys and values into their slots (slot -1: padding, skipped).

    k, v: [num_tokens, kv_heads, head_dim]; slot_mapping: [num_tokens] int64
    kv_cache: [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]
    """
    kbs = kv_cache.shape[2]
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
    blocks = slot_mapping // kbs
    offsets = slot_mapping % kbs
    kv_cache[blocks, 0, offsets] = k.to(kv_cache.dtype)
    kv_cache[blocks, 1, offsets] = v.to(kv_cache.dtype)


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, max_seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of every request's first `max_seq_len` positions through its block table.

    block_table: [num_seqs, max_blocks] -> k, v: [num_seqs, max_seq_len, kv_heads, head_dim]
    Positions past a request's own length hold whatever the table points at (masked later).
    """
    kbs = kv_cache.shape[2]
    n_blocks = -(-max_seq_len // kbs)
    table = block_table[:, :n_blocks].long()  # [num_seqs, n_blocks]
    blocks = kv_cache[table]  # [num_seqs, n_blocks, 2, kbs, kv_heads, head_dim]
    num_seqs = table.shape[0]
    k = blocks[:, :, 0].reshape(num_seqs, n_blocks * kbs, *kv_cache.shape[3:])
    v = blocks[:, :, 1].reshape(num_seqs, n_blocks * kbs, *kv_cache.shape[3:])
    return k[:, :max_seq_len], v[:, :max_seq_len]


def _pad_queries(
    q: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed queries -> [num_seqs, max_query_len, heads, head_dim] plus the index maps."""
    num_seqs = query_start_loc.numel() - 1
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).long()
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs, device=q.device), q_lens)
    idx_in_seq = (
        torch.arange(q.shape[0], device=q.device) - query_start_loc[:-1].long()[seq_of_token]
    )
    padded = q.new_zeros(num_seqs, max_query_len, *q.shape[1:])
    padded[seq_of_token, idx_in_seq] = q
    return padded, seq_of_token, idx_in_seq


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
) -> torch.Tensor:
    """Causal attention of packed queries over each request's paged context.

    q: [num_tokens, num_heads, head_dim]; block_table: [num_seqs, max_blocks] int32;
    query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs]  ->  [num_tokens, num_heads, head_dim]
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = kv_cache.shape[3]
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    max_query_len = int(q_lens.max()) if max_query_len is None else max_query_len
    max_seq_len = int(seq_lens.max()) if max_seq_len is None else max_seq_len
    if q.shape[0] == 0:
        return q.new_empty(q.shape)

    # Phase 1: gather context and pad queries (vectorised over the batch).
    k, v = gather_context(kv_cache, block_table, max_seq_len)  # [S, T, kvh, d]
    qp, seq_of_token, idx_in_seq = _pad_queries(q, query_start_loc, max_query_len)  # [S, Q, h, d]

    # Phase 2: masks. Query i of request s sits at seq_len - q_len + i.
    seq_lens_l = seq_lens.long()
    q_pos = (seq_lens_l - q_lens.long())[:, None] + torch.arange(max_query_len, device=q.device)
    k_pos = torch.arange(max_seq_len, device=q.device)
    allowed = (k_pos[None, None, :] <= q_pos[:, :, None]) & (
        k_pos[None, None, :] < seq_lens_l[:, None, None]
    )  # [S, Q, T]
    if sliding_window is not None:
        allowed &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    # Garbage (possibly NaN) in unused slots must not reach the output: select, never multiply.
    k_valid = (k_pos[None, :] < seq_lens_l[:, None])[:, :, None, None]
    k = torch.where(k_valid, k, torch.zeros((), dtype=k.dtype, device=k.device))
    v = torch.where(k_valid, v, torch.zeros((), dtype=v.dtype, device=v.device))

    # Phase 3: grouped-query attention in float32.
    group = num_heads // kv_heads
    qf = qp.float().reshape(qp.shape[0], max_query_len, kv_heads, group, head_dim)
    scores = torch.einsum("sqhgd,sthd->shgqt", qf, k.float()) * scale  # [S, kvh, g, Q, T]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(torch.isnan(probs), torch.zeros_like(probs), probs)  # fully masked rows
    out = torch.einsum("shgqt,sthd->sqhgd", probs, v.float())
    out = out.reshape(qp.shape[0], max_query_len, num_heads, head_dim)
    return out[seq_of_token, idx_in_seq].to(q.dtype)
