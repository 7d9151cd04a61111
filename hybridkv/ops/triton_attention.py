"""Paged attention in Triton over kernel-block tables: the `triton` backend's kernels.

The functions here have the signatures and semantics of `hybridkv.ops.attention` (the PyTorch
reference they are tested against); see that module for the cache layout and the packing of a
ragged batch. On a machine without a GPU they run through Triton's interpreter: set
`TRITON_INTERPRET=1` in the environment *before* this module is imported.

Tiles are decoupled from the kernel block size. A program walks its request's context in tiles
of `TILE_N` positions of its own choosing and maps every position separately to the cache, so a
tile may span several kernel blocks (kernel_block_size 48, TILE_N 64) or cover a sliver of one
(kernel_block_size 2096); shared memory holds tiles, never whole kernel blocks:

    position p of request s                       kbs = kernel_block_size
        |  j = p // kbs,  o = p % kbs
        v
    kernel block id  b = block_table[s, j]        (page mode: b = page * blocks_per_page + i)
        |
        v
    kv_cache[b, 0, o, kv_head, :]   K row  (head_dim elements)
    kv_cache[b, 1, o, kv_head, :]   V row

    tile t (TILE_N = 64), kbs = 48:
    positions  64 ........................ 127
    j          1 (o = 16..47) | 2 (o = 0..31)      two kernel blocks, one tile

A program owns one kv head and a tile of `BLOCK_M` query rows: `BLOCK_Q` query tokens times
`GROUP_PAD` query heads of that kv head (grouped-query attention loads each K/V tile once for
the whole group). Row r is token r // GROUP_PAD, head kv_head * GROUP + r % GROUP_PAD.

Softmax is online and in float32 (base 2: scores are pre-multiplied by log2(e)). Logit
soft-capping (`softcap` c) replaces each scaled score s by c * tanh(s / c) before the mask, as
the PyTorch reference does (the sinks are not capped). Everything
that must not count is removed with `tl.where` or a masked load, never by multiplying with
zero: a page that held a recurrent state may still hold NaN bit patterns in unused slots.

Decode batches (one query per request) may split the context of each request into
`num_kv_splits` segments handled by separate programs (split-K); a second kernel merges the
partial results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def is_interpreted() -> bool:
    """True when Triton's interpreter (TRITON_INTERPRET=1 at import time) runs these kernels."""
    return not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def check_device(*tensors: torch.Tensor) -> None:
    """Refuse CPU tensors unless the kernels are interpreted (they would be read as GPU memory)."""
    if any(t.device.type == "cpu" for t in tensors) and not is_interpreted():
        raise RuntimeError(
            "hybridkv's Triton kernels got CPU tensors: run them on a GPU, or set "
            "TRITON_INTERPRET=1 before hybridkv.ops.triton_attention is imported"
        )


# ---------------------------------------------------------------------------------------------
# write_kv_cache
# ---------------------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    k_ptr,  # [num_tokens, kv_heads, head_dim]
    v_ptr,  # [num_tokens, kv_heads, head_dim]
    cache_ptr,  # [num_kernel_blocks, 2, kbs, kv_heads, head_dim]
    slot_ptr,  # [num_tokens] int64
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_cb, stride_ckv, stride_ct, stride_ch, stride_cd,
    kernel_block_size,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padding token
        return
    block = slot // kernel_block_size
    offset = slot % kernel_block_size
    h = tl.arange(0, KV_HEADS_PAD)[:, None]  # [KV_HEADS_PAD, 1]
    d = tl.arange(0, HEAD_DIM_PAD)[None, :]  # [1, HEAD_DIM_PAD]
    mask = (h < KV_HEADS) & (d < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + h * stride_kh + d * stride_kd, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + h * stride_vh + d * stride_vd, mask=mask)
    dst = cache_ptr + block * stride_cb + offset * stride_ct + h * stride_ch + d * stride_cd
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatter new keys and values into their slots (slot -1: padding, skipped).

    k, v: [num_tokens, kv_heads, head_dim]; slot_mapping: [num_tokens] int64
    kv_cache: [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]
    """
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    check_device(k, v, kv_cache, slot_mapping)
    _write_kv_kernel[(num_tokens,)](
        k, v, kv_cache, slot_mapping,
        *k.stride(), *v.stride(), *kv_cache.stride(),
        kv_cache.shape[2],
        KV_HEADS=kv_heads,
        HEAD_DIM=head_dim,
        KV_HEADS_PAD=triton.next_power_of_2(kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# zero_pages
# ---------------------------------------------------------------------------------------------


@triton.jit
def _zero_pages_kernel(
    buf_ptr,  # [num_pages, words_per_page]
    page_ids_ptr,  # [num_ids] int64
    stride_page,
    words_per_page,
    BLOCK: tl.constexpr,
):
    page = tl.load(page_ids_ptr + tl.program_id(0)).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    zero = tl.zeros([BLOCK], dtype=buf_ptr.dtype.element_ty)
    tl.store(buf_ptr + page * stride_page + offs, zero, mask=offs < words_per_page)


def _as_words(buffer_2d: torch.Tensor) -> torch.Tensor:
    """View a [num_pages, page_bytes] uint8 buffer as the widest integer words that fit."""
    for word in (torch.int64, torch.int32, torch.int16):
        size = word.itemsize
        if (
            buffer_2d.stride(1) == 1
            and buffer_2d.shape[1] % size == 0
            and buffer_2d.stride(0) % size == 0
            and (buffer_2d.data_ptr() % size == 0)
        ):
            return buffer_2d.view(word)
    return buffer_2d


def zero_pages(buffer_2d: torch.Tensor, page_ids: Sequence[int] | torch.Tensor) -> None:
    """Zero whole pages of a byte buffer.

    buffer_2d: [num_pages, page_bytes] uint8; page_ids: [num_ids] page indices. Ids given as a
    host sequence are range-checked; ids already on the device are trusted (no sync).
    """
    if buffer_2d.dtype != torch.uint8 or buffer_2d.dim() != 2:
        raise ValueError(f"zero_pages wants a [num_pages, page_bytes] uint8 buffer, got "
                         f"{tuple(buffer_2d.shape)} {buffer_2d.dtype}")  # fmt: skip
    ids = torch.as_tensor(page_ids, dtype=torch.int64)
    if ids.device.type == "cpu" and ids.numel() > 0:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= buffer_2d.shape[0]:
            raise IndexError(f"page ids {lo}..{hi} outside 0..{buffer_2d.shape[0] - 1}")
    ids = ids.to(buffer_2d.device)
    if ids.numel() == 0:
        return
    check_device(buffer_2d)
    words = _as_words(buffer_2d)
    block = 1024
    grid = (ids.numel(), triton.cdiv(words.shape[1], block))
    _zero_pages_kernel[grid](words, ids, words.stride(0), words.shape[1], BLOCK=block)


# ---------------------------------------------------------------------------------------------
# paged attention: phases
# ---------------------------------------------------------------------------------------------


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q: tl.constexpr):
    """The request whose query tiles contain program `pid` (binary search).

    Request s owns tiles [qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1): at least
    cdiv(q_len, BLOCK_Q) of them, increasing in s; programs past a request's last query exit.
    """
    lo: tl.int32 = 0
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _load_q_tile(
    q_ptr, stride_qt, stride_qh, stride_qd,
    q_start, q_len, ctx_before, tile_in_seq, kv_head,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Query rows of one program: q [BLOCK_M, HEAD_DIM_PAD] plus per-row token, head, validity
    and position (row r = token r // GROUP_PAD of the tile, head kv_head*GROUP + r % GROUP_PAD)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    r = tl.arange(0, BLOCK_M)
    q_idx = tile_in_seq * BLOCK_Q + r // GROUP_PAD  # [BLOCK_M] index among the request's queries
    g = r % GROUP_PAD
    row_valid = (q_idx < q_len) & (g < GROUP)
    token = (q_start + q_idx).to(tl.int64)
    head = kv_head * GROUP + g
    q_pos = ctx_before + q_idx  # position of the query in its request
    d = tl.arange(0, HEAD_DIM_PAD)
    ptrs = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd
    q = tl.load(ptrs, mask=row_valid[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    return q, token, head, row_valid, q_pos


@triton.jit
def _split_tile_range(key_lo, key_hi, split, NUM_SPLITS: tl.constexpr, TILE_N: tl.constexpr):
    """Context tiles [t_lo, t_hi) of this split out of the keys [key_lo, key_hi)."""
    first = key_lo // TILE_N
    n_tiles = tl.cdiv(key_hi, TILE_N) - first
    per_split = tl.cdiv(n_tiles, NUM_SPLITS)
    t_lo = first + split * per_split
    t_hi = tl.minimum(t_lo + per_split, first + n_tiles)
    return t_lo, t_hi


@triton.jit
def _load_kv_tile(
    cache_ptr, block_row_ptr, pos, key_valid, kv_head,
    stride_cb, stride_ckv, stride_ct, stride_ch, stride_cd,
    KBS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """K^T [HEAD_DIM_PAD, TILE_N] and V [TILE_N, HEAD_DIM_PAD] of context positions `pos`.

    Every position goes through the block table on its own (pos -> block_table[pos // KBS],
    pos % KBS). Invalid positions are never read: their slots may hold NaN bit patterns.
    """
    block = tl.load(block_row_ptr + pos // KBS, mask=key_valid, other=0).to(tl.int64)
    offset = pos % KBS
    base = cache_ptr + block * stride_cb + offset * stride_ct + kv_head * stride_ch  # [TILE_N]
    d = tl.arange(0, HEAD_DIM_PAD)
    mask_kt = (d[:, None] < HEAD_DIM) & key_valid[None, :]
    k_t = tl.load(base[None, :] + d[:, None] * stride_cd, mask=mask_kt, other=0.0)
    mask_v = key_valid[:, None] & (d[None, :] < HEAD_DIM)
    v = tl.load(base[:, None] + stride_ckv + d[None, :] * stride_cd, mask=mask_v, other=0.0)
    return k_t, v


@triton.jit
def _tanh(y):
    """tanh in float32: sign(y) (1 - e) / (1 + e), e = 2^(-2 |y| log2(e)), and its Taylor
    polynomial to y^9 below |y| = 0.3 (where 1 - e loses digits): relative error < 3e-7."""
    a = tl.abs(y)
    e = tl.exp2(a * -2.8853900817779268)  # -2 log2(e)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a  # Taylor coefficients of tanh(y) / y: 1, -1/3, 2/15, -17/315, 62/2835
    p = -0.053968254 + a2 * 0.021869489
    p = 1.0 + a2 * (-0.33333333 + a2 * (0.13333333 + a2 * p))
    t = tl.where(a < 0.3, a * p, big)
    return tl.where(y < 0, -t, t)


@triton.jit
def _online_softmax_step(
    q, k_t, v, allowed, m_i, l_i, acc, qk_scale, softcap_log2,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Fold one context tile into the running (max m_i, sum l_i, acc) of every row."""
    if DOT_FP32:  # see paged_attention: mixed dtypes, or bfloat16 in the interpreter
        k_t = k_t.to(tl.float32)
        v = v.to(tl.float32)
    s = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N] log2 units
    if USE_SOFTCAP:  # c * tanh(x / c) in log2 units: softcap_log2 = c * log2(e), s = x * log2(e)
        s = softcap_log2 * _tanh(s / softcap_log2)
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed so far
    p = tl.exp2(s - m_safe[:, None])  # exactly 0 where not allowed
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]                (NUM_SPLITS == 1)
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] f32  (NUM_SPLITS > 1)
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] f32 (running max, running sum)
    q_ptr,  # [num_tokens, num_heads, head_dim]
    cache_ptr,  # [num_kernel_blocks, 2, KBS, kv_heads, head_dim]
    block_table_ptr,  # [num_seqs, max_kernel_blocks] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    seq_lens_ptr,  # [num_seqs] int32
    num_seqs,
    num_heads,
    qk_scale,  # scale * log2(e)
    window,  # sliding window in tokens (read only when USE_WINDOW)
    sinks_ptr,  # [num_heads] per-head softmax-denominator logits (read only when USE_SINKS)
    softcap_log2,  # logit soft-cap * log2(e) (read only when USE_SOFTCAP)
    stride_qt, stride_qh, stride_qd,
    stride_ot, stride_oh, stride_od,
    stride_cb, stride_ckv, stride_ct, stride_ch, stride_cd,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    KBS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    IS_DECODE: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    DOT_FP32: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_PAD
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Phase 1: which request and which of its query tiles this program owns.
    seq = pid if IS_DECODE else _find_seq(query_start_loc_ptr, num_seqs, pid, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = 0 if IS_DECODE else pid - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_before = seq_len - q_len  # queries are the last q_len positions of the context

    # Phase 2: queries, and the keys they may see: causal, and inside the window if any.
    q, token, head, row_valid, q_pos = _load_q_tile(
        q_ptr, stride_qt, stride_qh, stride_qd, q_start, q_len, ctx_before, tile_in_seq,
        kv_head, GROUP, GROUP_PAD, BLOCK_M, HEAD_DIM, HEAD_DIM_PAD,
    )  # fmt: skip
    if DOT_FP32:
        q = q.to(tl.float32)
    first_q_pos = ctx_before + tile_in_seq * BLOCK_Q
    key_hi = tl.minimum(first_q_pos + BLOCK_Q, seq_len)  # exclusive
    key_lo = 0
    if USE_WINDOW:
        key_lo = tl.maximum(first_q_pos - window + 1, 0)
    t_lo, t_hi = _split_tile_range(key_lo, key_hi, split, NUM_SPLITS, TILE_N)

    # Phase 3: walk the context tile by tile through the block table.
    block_row_ptr = block_table_ptr + seq.to(tl.int64) * stride_bt
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    # the sink: a key of score sinks[head] and value 0, counted by split 0 only (a constexpr
    # test, then a runtime one: kernels without sinks compile none of it)
    if USE_SINKS:  # noqa: SIM102
        if split == 0:
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=float("-inf"))
            m_i = sink.to(tl.float32) * 1.4426950408889634  # log2 units, as the scores
            l_i = tl.where(row_valid, 1.0, 0.0)
    for t in range(t_lo, t_hi):
        pos = t * TILE_N + tl.arange(0, TILE_N)  # [TILE_N] context positions
        key_valid = (pos >= key_lo) & (pos < key_hi)
        k_t, v = _load_kv_tile(
            cache_ptr, block_row_ptr, pos, key_valid, kv_head,
            stride_cb, stride_ckv, stride_ct, stride_ch, stride_cd, KBS, HEAD_DIM, HEAD_DIM_PAD,
        )  # fmt: skip
        allowed = key_valid[None, :] & (pos[None, :] <= q_pos[:, None]) & row_valid[:, None]
        if USE_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _online_softmax_step(
            q, k_t, v, allowed, m_i, l_i, acc, qk_scale, softcap_log2, DOT_FP32, DOT_PRECISION,
            USE_SOFTCAP,
        )  # fmt: skip

    # Phase 4: normalise and store, or store the partial state of this split.
    d = tl.arange(0, HEAD_DIM_PAD)
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
        mask = row_valid[:, None] & (d[None, :] < HEAD_DIM)
        tl.store(ptrs + d[None, :] * stride_od, out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        row = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :], acc,
                 mask=row_valid[:, None])  # fmt: skip
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_valid)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, HEAD_DIM_PAD] f32
    part_ml_ptr,  # [num_tokens, num_heads, NUM_SPLITS, 2] f32
    stride_ot, stride_oh, stride_od,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):  # fmt: skip
    """Merge the split-K partial results of one (token, head): rescale to a common max."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = (token * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    m = tl.load(part_ml_ptr + row * 2)  # [NUM_SPLITS]
    l_split = tl.load(part_ml_ptr + row * 2 + 1)
    d = tl.arange(0, HEAD_DIM_PAD)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM_PAD + d[None, :])  # [S, HEAD_DIM_PAD]
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    has_keys = m > float("-inf")  # empty splits contribute nothing
    w = tl.where(has_keys, tl.exp2(m - m_safe), 0.0)
    l_total = tl.sum(tl.where(has_keys, w * l_split, 0.0), axis=0)
    out = tl.sum(tl.where(has_keys[:, None], w[:, None] * acc, 0.0), axis=0)
    out = out / tl.where(l_total == 0.0, 1.0, l_total)
    ptrs = out_ptr + token * stride_ot + head * stride_oh + d * stride_od
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# paged attention: launch configuration and wrapper
# ---------------------------------------------------------------------------------------------


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: few programs keep it fast


@dataclass(frozen=True)
class LaunchConfig:
    """How one paged-attention launch tiles its work (the defaults come from `default_launch`).

    block_m: query rows per program (tokens x padded group heads), a power of two >= 16 that
    the padded group divides; tile_n: context positions per tile, a power of two >= 16.
    """

    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "tile_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")


def default_launch(
    is_decode: bool, group_pad: int, head_dim_pad: int, on_gpu: bool
) -> LaunchConfig:
    """The launch configuration paged_attention uses unless given one."""
    tile_n = 64 if on_gpu else 32
    if is_decode:  # one token: rows are the group's heads, padded to the 16 rows a dot needs
        return LaunchConfig(max(16, group_pad), tile_n, 4, 2)
    # two stages keep Q, K and V tiles of 128-wide heads well inside shared memory
    stages = 2 if head_dim_pad > 64 else 3
    return LaunchConfig(max(64 if on_gpu else 32, group_pad), tile_n, 4, stages)


def _pick_num_splits(
    num_seqs: int, kv_heads: int, max_seq_len: int, tile_n: int, device: torch.device
) -> int:
    """Decode split-K: enough programs to fill the device, each with >= 4 context tiles."""
    programs = num_seqs * kv_heads
    wanted = triton.cdiv(2 * _num_sms(device), max(programs, 1))
    most = max(1, triton.cdiv(max_seq_len, 4 * tile_n))
    splits = max(1, min(wanted, most, 16))
    return 1 << (splits.bit_length() - 1)  # a power of two: few kernel variants


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
    *,
    num_kv_splits: int | None = None,
    launch: LaunchConfig | None = None,
) -> torch.Tensor:
    """Causal attention of packed queries over each request's paged context.

    q: [num_tokens, num_heads, head_dim]; block_table: [num_seqs, max_blocks] int32;
    query_start_loc: [num_seqs + 1]; seq_lens: [num_seqs]  ->  [num_tokens, num_heads, head_dim]
    `num_kv_splits` (decode batches only; a power of two) overrides the split-K heuristic,
    `launch` the tiling (for tuning; see `default_launch`). `sinks` [num_heads] or None: a
    per-head logit added to every softmax denominator (gpt-oss). `softcap` c > 0 or None: each
    score s = scale * q.k becomes c * tanh(s / c) (logit soft-capping).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, kbs, kv_heads, cache_head_dim = kv_cache.shape
    if num_tokens == 0:
        return q.new_empty(q.shape)
    if num_heads % kv_heads or cache_head_dim != head_dim:
        raise ValueError(
            f"{num_heads} query heads / {kv_heads} kv heads, head dims {head_dim} / "
            f"{cache_head_dim}: query heads must be a multiple of kv heads, head dims equal"
        )
    check_device(q, kv_cache, block_table, query_start_loc, seq_lens)
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if sinks is not None:
        if sinks.shape != (num_heads,):
            raise ValueError(f"sinks must have shape ({num_heads},), got {tuple(sinks.shape)}")
        check_device(sinks)
        sinks = sinks.contiguous()
    num_seqs = seq_lens.shape[0]
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    is_decode = max_query_len == 1
    group = num_heads // kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if launch is None:
        launch = default_launch(is_decode, group_pad, head_dim_pad, q.device.type == "cuda")
    elif launch.block_m % group_pad:
        raise ValueError(
            f"block_m={launch.block_m} must be a multiple of the padded group {group_pad} "
            f"({num_heads} query heads / {kv_heads} kv heads)"
        )
    block_m, tile_n = launch.block_m, launch.tile_n

    num_splits = 1
    if is_decode:
        if num_kv_splits is None:
            if max_seq_len is None:
                max_seq_len = int(seq_lens.max())
            num_kv_splits = _pick_num_splits(num_seqs, kv_heads, max_seq_len, tile_n, q.device)
        num_splits = num_kv_splits
        if num_splits < 1 or num_splits & (num_splits - 1):
            raise ValueError(f"num_kv_splits must be a power of two, got {num_splits}")

    out = torch.empty_like(q)
    if num_splits > 1:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, head_dim_pad,
                               dtype=torch.float32, device=q.device)  # fmt: skip
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2,
                              dtype=torch.float32, device=q.device)  # fmt: skip
    else:
        part_acc = part_ml = out  # unused
    grid_m = num_seqs if is_decode else num_tokens // (block_m // group_pad) + num_seqs
    # Dots run in float32 when query and cache dtypes differ, and for half types under the
    # interpreter (Triton 3.9's interpreter multiplies the raw bits of bfloat16 dot operands).
    dot_fp32 = q.dtype != kv_cache.dtype or (is_interpreted() and q.dtype != torch.float32)
    precise = dot_fp32 or q.dtype == torch.float32
    _paged_attention_kernel[(grid_m, kv_heads, num_splits)](
        out, part_acc, part_ml, q, kv_cache, block_table, query_start_loc, seq_lens,
        num_seqs, num_heads, scale * LOG2E, 0 if sliding_window is None else sliding_window,
        q if sinks is None else sinks, 1.0 if softcap is None else softcap * LOG2E,
        *q.stride(), *out.stride(), *kv_cache.stride(), block_table.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_M=block_m,
        TILE_N=tile_n,
        KBS=kbs,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        NUM_SPLITS=num_splits,
        IS_DECODE=is_decode,
        USE_WINDOW=sliding_window is not None,
        USE_SINKS=sinks is not None,
        USE_SOFTCAP=softcap is not None,
        DOT_FP32=dot_fp32,
        DOT_PRECISION="ieee" if precise else "tf32",
        num_warps=launch.num_warps,
        num_stages=launch.num_stages,
    )  # fmt: skip
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_ml, *out.stride(),
            NUM_SPLITS=num_splits, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        )  # fmt: skip
    return out


__all__ = [
    "LaunchConfig",
    "check_device",
    "default_launch",
    "is_interpreted",
    "paged_attention",
    "write_kv_cache",
    "zero_pages",
]
