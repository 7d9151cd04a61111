import math

import pytest
import torch

from hybridkv.ops.attention import paged_attention, write_kv_cache


def naive_attention(q, k, v, scale, window=None, sinks=None, cap=None):
    """One request, dense, float64: q [q_len, h, d] at the end of k/v [seq_len, kvh, d].
    `cap`: logit soft-capping (c * tanh(s / c), before the mask, as Gemma 2's eager attention);
    `sinks` [h]: one more logit per head that has no value (gpt-oss), never capped."""
    q_len, h, _ = q.shape
    seq_len, kvh, _ = k.shape
    k = k.double().repeat_interleave(h // kvh, dim=1)
    v = v.double().repeat_interleave(h // kvh, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale  # [h, q_len, seq_len]
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    mask = k_pos <= q_pos
    if window is not None:
        mask &= k_pos > q_pos - window
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.double()[:, None, None].expand(h, q_len, 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., :seq_len]
    return torch.einsum("hqk,khd->qhd", probs, v)


def make_batch(q_lens, seq_lens, kbs, heads, kv_heads, d, num_blocks, seed=0, nan_fill=True):
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(num_blocks, 2, kbs, kv_heads, d, generator=g)
    if nan_fill:
        cache.fill_(float("nan"))
        cache[0] = 0  # the null block: never handed out, never written, always zeros
    perm = torch.randperm(num_blocks - 1, generator=g) + 1
    max_blocks = max(math.ceil(s / kbs) for s in seq_lens)
    table = torch.zeros(len(seq_lens), max_blocks + 2, dtype=torch.int32)
    ks, vs, used = [], [], 0
    for s, seq_len in enumerate(seq_lens):
        n = math.ceil(seq_len / kbs)
        table[s, :n] = perm[used : used + n].int()
        used += n
        ks.append(torch.randn(seq_len, kv_heads, d, generator=g))
        vs.append(torch.randn(seq_len, kv_heads, d, generator=g))
    # write every context token through the slot mapping
    for s, seq_len in enumerate(seq_lens):
        pos = torch.arange(seq_len)
        slots = table[s, pos // kbs].long() * kbs + pos % kbs
        write_kv_cache(ks[s], vs[s], cache, slots)
    qs = [torch.randn(ql, heads, d, generator=g) for ql in q_lens]
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    return cache, table, torch.cat(qs), qsl, torch.tensor(seq_lens, dtype=torch.int32), qs, ks, vs


@pytest.mark.parametrize("kbs", [1, 3, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_matches_naive_with_nan_garbage(kbs, window, kernels):
    q_lens, seq_lens = [7, 1, 3, 1], [7, 20, 9, 1]
    cache, table, q, qsl, sl, qs, ks, vs = make_batch(q_lens, seq_lens, kbs, 4, 2, 8, 64)
    out = paged_attention(q, cache, table, qsl, sl, 0.3, sliding_window=window)
    assert not torch.isnan(out).any()
    ref = torch.cat([naive_attention(qs[i], ks[i], vs[i], 0.3, window) for i in range(4)])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_padding_slots_are_skipped():
    cache = torch.zeros(4, 2, 2, 1, 2)
    k = torch.ones(3, 1, 2)
    write_kv_cache(k, k * 2, cache, torch.tensor([3, -1, 0]))
    assert cache[1, 0, 1].sum() == 2 and cache[0, 1, 0].sum() == 4
    assert cache.sum() == 12


@pytest.mark.parametrize("window", [None, 6])
def test_many_decodes_in_length_groups_match_naive(window, kernels):
    # 40 decodes (4 length groups) mixed with two prefill chunks, ragged lengths, NaN garbage
    g = torch.Generator().manual_seed(3)
    dec_lens = torch.randint(1, 50, (40,), generator=g).tolist()
    q_lens, seq_lens = [1] * 20 + [5] + [1] * 20 + [3], dec_lens[:20] + [9] + dec_lens[20:] + [3]
    cache, table, q, qsl, sl, qs, ks, vs = make_batch(q_lens, seq_lens, 4, 6, 2, 8, 600)
    out = paged_attention(q, cache, table, qsl, sl, 0.3, sliding_window=window)
    assert not torch.isnan(out).any()
    ref = torch.cat([naive_attention(qs[i], ks[i], vs[i], 0.3, window) for i in range(42)])
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def test_decode_groups_partition_requests_by_length():
    from hybridkv.ops.attention import MAX_DECODE_GROUPS, _decode_groups

    lens = [5, 90, 12, 40, 7, 66, 3, 21] * 5
    groups = _decode_groups(lens)
    assert len(groups) == MAX_DECODE_GROUPS
    assert sorted(i for grp in groups for i in grp) == list(range(len(lens)))
    # every request of a group is at least as long as every request of the next group
    for a, b in zip(groups, groups[1:], strict=False):
        assert min(lens[i] for i in a) >= max(lens[i] for i in b)
    assert _decode_groups([4, 2, 9]) == [[2, 0, 1]]  # few requests: one group
