"""Random paged MLA batches and a float64 reference that expands every latent (shared by the
reference, native and Triton MLA tests)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MLACase:
    cache: torch.Tensor  # [num_kernel_blocks, kbs, rank + rope], NaN where nothing was written
    table: torch.Tensor  # [S, width] int32 kernel-block ids (page mode, pages shuffled)
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    latents: list[torch.Tensor]  # per request: [seq_len, rank + rope], what the cache holds
    q_nope: torch.Tensor  # [T, heads, nope]
    q_rope: torch.Tensor  # [T, heads, rope]
    w_kv_b: torch.Tensor  # [heads * (nope + v), rank]
    rank: int
    nope: int
    scale: float


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    kbs: int,
    ratio: int = 2,
    heads: int = 3,
    rank: int = 20,
    rope: int = 6,
    nope: int = 10,
    v_dim: int = 7,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> MLACase:
    g = torch.Generator().manual_seed(seed)
    width = rank + rope
    blocks_needed = [-(-n // kbs) for n in seq_lens]
    pages_needed = sum(-(-b // ratio) for b in blocks_needed)
    num_pages = pages_needed + 2  # page 0 is the null page
    cache = torch.full((num_pages * ratio, kbs, width), float("nan"), dtype=dtype)
    cache[:ratio] = 0  # the null page holds zeros
    order = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    max_blocks = max(blocks_needed)
    table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    latents = []
    for s, n in enumerate(seq_lens):
        ids = []
        while len(ids) < blocks_needed[s]:
            page = order.pop()
            ids += [page * ratio + i for i in range(ratio)]
        ids = ids[: blocks_needed[s]]
        table[s, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        lat = torch.randn(n, width, generator=g).to(dtype)
        for t in range(n):
            cache[ids[t // kbs], t % kbs] = lat[t]
        latents.append(lat)
    total = sum(q_lens)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    return MLACase(
        cache, table, torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seq_lens, dtype=torch.int32), latents,
        torch.randn(total, heads, nope, generator=g).to(dtype),
        torch.randn(total, heads, rope, generator=g).to(dtype),
        (torch.randn(heads * (nope + v_dim), rank, generator=g) * 0.3).to(dtype),
        rank, nope, (nope + rope) ** -0.5,
    )  # fmt: skip


def expanded_reference(case: MLACase) -> torch.Tensor:
    """Causal attention with every latent expanded to K/V, in float64 -> [T, heads, v_dim]."""
    heads = case.q_nope.shape[1]
    w = case.w_kv_b.double().view(heads, -1, case.rank)
    outs = []
    starts = case.query_start_loc.tolist()
    for s, lat in enumerate(case.latents):
        a, b = starts[s], starts[s + 1]
        n = lat.shape[0]
        lat = lat.double()
        kv = torch.einsum("tr,hdr->thd", lat[:, : case.rank], w)  # [n, heads, nope + v]
        k = torch.cat([kv[..., : case.nope], lat[:, None, case.rank :].expand(n, heads, -1)], -1)
        v = kv[..., case.nope :]
        q = torch.cat([case.q_nope[a:b], case.q_rope[a:b]], -1).double()  # [L, heads, qk]
        scores = torch.einsum("lhd,thd->hlt", q, k) * case.scale
        q_pos = torch.arange(n - (b - a), n)[:, None]
        scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos, float("-inf"))
        outs.append(torch.einsum("hlt,thv->lhv", torch.softmax(scores, -1), v))
    return torch.cat(outs)


def absorbed(case: MLACase, rows: list[int]) -> torch.Tensor:
    """The latent-space queries of the given token rows: [len(rows), heads, rank + rope]."""
    from hybridkv.ops.mla import absorb_query

    heads = case.q_nope.shape[1]
    w_uk = case.w_kv_b.view(heads, -1, case.rank)[:, : case.nope]
    return absorb_query(case.q_nope[rows], case.q_rope[rows], w_uk)
