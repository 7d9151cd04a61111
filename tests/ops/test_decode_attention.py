"""The native decode attention kernel (`hkv_paged_decode`, hybridkv/ops/native/decode_attention.c)
against a float64 softmax of the same (widened) keys and values.

Caches are NaN-filled except for the positions a request owns, so a read of any other slot
(past a request's length, in the rest of its last block, before its window) shows in the
output. Shapes cover group sizes 1..8 and 20, head dims that are and are not multiples of 16 / 32
(the AMX path's tail tile, the odd-dim AVX-512 path), kernel blocks of 1..64 positions, windows,
sinks, logit soft-capping (alone, with windows and sinks, split over threads), empty requests,
long single requests split over two threads, and the builds of the same source for CPUs without
AMX, without AVX512-BF16 and without AVX-512.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hybridkv.ops import native, registry
from hybridkv.ops.attention import paged_attention
from hybridkv.ops.native import decode_attention as native_attn

needs_compiler = pytest.mark.skipif(
    shutil.which("gcc") is None or not sys.platform.startswith("linux"),
    reason="the native kernels are built with gcc on Linux",
)
SOURCE = Path(native.__file__).with_name("decode_attention.c")


def paged_problem(lens, heads, kv_heads, d, kbs, dtype, seed=0):
    """A NaN-filled cache [blocks, 2, kbs, kv_heads, d] holding each request's K and V at random
    blocks; the dense K / V per request (float32, exactly the cached values)."""
    g = torch.Generator().manual_seed(seed)
    blocks = [math.ceil(n / kbs) for n in lens]
    num_blocks = sum(blocks) + 3
    cache = torch.full((num_blocks, 2, kbs, kv_heads, d), float("nan"), dtype=dtype)
    table = torch.zeros(len(lens), max(max(blocks), 1) + 1, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=g)
    ks, vs, used = [], [], 0
    for s, n in enumerate(lens):
        table[s, : blocks[s]] = perm[used : used + blocks[s]].int()
        used += blocks[s]
        k = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        v = torch.randn(n, kv_heads, d, generator=g).to(dtype)
        pos = torch.arange(n)
        cache[table[s, pos // kbs].long(), 0, pos % kbs] = k
        cache[table[s, pos // kbs].long(), 1, pos % kbs] = v
        ks.append(k.float())
        vs.append(v.float())
    q = torch.randn(len(lens), heads, d, generator=g).to(dtype)
    return q, cache, table, torch.tensor(lens, dtype=torch.int32), ks, vs


def reference(q, ks, vs, lens, scale, window=None, sinks=None, softcap=None):
    """float64 softmax(q k^T * scale) v per request ([S, heads, d]); zeros for empty requests.
    softcap c: the scores capped to c * tanh(s / c) first (the sinks are not)."""
    S, heads, d = q.shape
    out = torch.zeros(S, heads, d, dtype=torch.float64)
    for s, n in enumerate(lens):
        first = 0 if window is None else max(0, n - window)
        if n - first <= 0:
            continue
        group = heads // ks[s].shape[1]
        k = ks[s][first:].double().repeat_interleave(group, dim=1)  # [t, heads, d]
        v = vs[s][first:].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[s].double(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], dim=1)
        p = torch.softmax(scores, dim=-1)[:, : k.shape[0]]
        out[s] = torch.einsum("ht,thd->hd", p, v)
    return out


def check(out, ref, dtype):
    assert not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    else:  # the float32 result rounded once: within a bfloat16 step of the exact one
        torch.testing.assert_close(out.double(), ref, rtol=8e-3, atol=2e-5)


SHAPES = [  # heads, kv_heads, head_dim
    (8, 2, 128),  # Qwen3-Next
    (12, 4, 64),  # the 100m Granite
    (6, 2, 80),  # 80 = 2 x 32 + 16: the AMX tail tile
    (4, 4, 16),  # group 1, a head dim of one tail tile
    (16, 2, 32),  # group 8
    (10, 2, 24),  # group 5
    (7, 1, 40),  # one KV head, group 7
    (6, 3, 7),  # odd head dim: AVX-512 masks (no AMX pairs)
    (20, 1, 32),  # group 20: passes of 16 + 4 heads (AMX), 8 + 8 + 4 (AVX-512)
]


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kbs", [1, 3, 16, 64])
def test_matches_float64_softmax(shape, kbs, dtype):
    heads, kv_heads, d = shape
    # 1 position; a partial tile; tiles straddling blocks; > 4 tiles (AMX from 128 position-heads)
    lens = [1, 17, 45, 200, 33]
    q, cache, table, sl, ks, vs = paged_problem(lens, heads, kv_heads, d, kbs, dtype, seed=kbs)
    scale = d**-0.5
    out = native_attn.paged_decode_attention(q, cache, table, sl, scale, None)
    assert out is not None and out.dtype == dtype and out.shape == q.shape
    check(out, reference(q, ks, vs, lens, scale), dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 5, 40, 1000])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_windows_and_sinks(window, with_sinks, dtype):
    heads, kv_heads, d, kbs = 8, 2, 64, 16
    lens = [3, 40, 41, 150, 7, 300]
    q, cache, table, sl, ks, vs = paged_problem(lens, heads, kv_heads, d, kbs, dtype, seed=window)
    sinks = torch.linspace(-3.0, 6.0, heads) if with_sinks else None
    out = native_attn.paged_decode_attention(q, cache, table, sl, 0.2, window, sinks=sinks)
    check(out, reference(q, ks, vs, lens, 0.2, window, sinks), dtype)


SOFTCAP = 1.5  # small against the scores of the tests below (scale 2 / sqrt(d): spread ~2)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kbs", [3, 16])
def test_softcap_matches_float64_softmax(shape, kbs, dtype):
    """Scores capped to c * tanh(s / c) on every path (AMX tiles for the long bfloat16 request,
    AVX-512 rows, odd head dims), against the float64 reference; and the cap matters."""
    heads, kv_heads, d = shape
    lens = [1, 17, 45, 200, 33]
    q, cache, table, sl, ks, vs = paged_problem(lens, heads, kv_heads, d, kbs, dtype, seed=kbs)
    scale = 2 * d**-0.5
    out = native_attn.paged_decode_attention(q, cache, table, sl, scale, None, softcap=SOFTCAP)
    check(out, reference(q, ks, vs, lens, scale, softcap=SOFTCAP), dtype)
    plain = reference(q, ks, vs, lens, scale)
    assert (out.double() - plain).abs().max() > 0.05  # the cap changed the result


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [1, 5, 40])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_softcap_with_windows_and_sinks(window, with_sinks, dtype):
    heads, kv_heads, d, kbs = 6, 2, 64, 16
    lens = [3, 40, 41, 150, 7, 300]
    q, cache, table, sl, ks, vs = paged_problem(lens, heads, kv_heads, d, kbs, dtype, seed=window)
    sinks = torch.linspace(-3.0, 2.0, heads) if with_sinks else None
    out = native_attn.paged_decode_attention(
        q, cache, table, sl, 0.3, window, sinks=sinks, softcap=SOFTCAP
    )
    check(out, reference(q, ks, vs, lens, 0.3, window, sinks, SOFTCAP), dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_softcap_extremes(dtype):
    """Scores hundreds apart (tanh saturates at +-c on both sides, weights of e^(-2c) and
    more), and a cap so large that it is no cap (tanh(y) = y to float32 precision)."""
    lens = [300, 20]
    q, cache, table, sl, ks, vs = paged_problem(lens, 4, 1, 32, 16, dtype, seed=3)
    out = native_attn.paged_decode_attention(q, cache, table, sl, 30.0, None, softcap=SOFTCAP)
    check(out, reference(q, ks, vs, lens, 30.0, softcap=SOFTCAP), dtype)
    huge = native_attn.paged_decode_attention(q, cache, table, sl, 0.2, None, softcap=1e6)
    check(huge, reference(q, ks, vs, lens, 0.2), dtype)
    with pytest.raises(ValueError, match="softcap must be positive"):
        native_attn.paged_decode_attention(q, cache, table, sl, 0.2, None, softcap=0.0)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_empty_requests_get_zeros(dtype):
    lens = [0, 50, 0, 1]
    q, cache, table, sl, ks, vs = paged_problem(lens, 4, 2, 32, 16, dtype)
    out = native_attn.paged_decode_attention(q, cache, table, sl, 0.3, None)
    assert torch.equal(out[[0, 2]].float(), torch.zeros(2, 4, 32))
    check(out, reference(q, ks, vs, lens, 0.3), dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 1500])
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_long_request_split_over_two_threads(dtype, window, softcap):
    """One request of 3000 positions (and a short one): with two threads the long one is split
    into pieces whose softmax states are merged; the result is the one-thread result's."""
    lens = [3000, 20]
    q, cache, table, sl, ks, vs = paged_problem(lens, 8, 2, 128, 32, dtype, seed=7)
    sinks = torch.linspace(-1.0, 2.0, 8)
    before = torch.get_num_threads()
    args = (q, cache, table, sl, 0.1, window)
    try:
        torch.set_num_threads(2)
        two = native_attn.paged_decode_attention(*args, sinks=sinks, softcap=softcap)
        torch.set_num_threads(1)
        one = native_attn.paged_decode_attention(*args, sinks=sinks, softcap=softcap)
    finally:
        torch.set_num_threads(before)
    ref = reference(q, ks, vs, lens, 0.1, window, sinks, softcap)
    check(two, ref, dtype)
    check(one, ref, dtype)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kbs", [2, 8])
def test_tiles_over_blocks_whose_ends_look_consecutive(kbs, dtype):
    """A tile of 16 positions that starts at offset 1 of a kernel block and ends at row 0 of the
    block placed right after the first one in the cache: its first and last K rows are 15 rows
    apart, as in one block, but V rows and other blocks lie between. (The AMX path once read
    such a tile straight from the cache.) Every request's block table is laid out that way."""
    g = torch.Generator().manual_seed(kbs)
    heads, kv_heads, d, n = 16, 4, 24, 16 * 12 + 1
    blocks = -(-n // kbs)
    # the tile from position 1 + 16 j starts in block (1 + 16 j) // kbs at offset 1 and ends
    # at offset 0 of block (16 j + 16) // kbs, where the next tile starts: 2 kbs * step - 1 =
    # 15 rows apart when that block sits step = 8 / kbs blocks after its first in the cache
    step = 8 // kbs
    chain = sorted({(1 + 16 * j) // kbs for j in range(n // 16 + 1)} | {n // kbs})
    chain = [b for b in chain if b < blocks]
    slots = {b: j * step for j, b in enumerate(chain)}
    others = [i for i in range(blocks * step + blocks) if i not in set(slots.values())]
    others = [others[i] for i in torch.randperm(len(others), generator=g).tolist()]
    table = torch.zeros(1, blocks + 1, dtype=torch.int32)
    for b in range(blocks):
        table[0, b] = slots[b] if b in slots else others.pop()
    num_blocks = int(table.max()) + 1
    cache = torch.full((num_blocks, 2, kbs, kv_heads, d), float("nan"), dtype=dtype)
    k = torch.randn(n, kv_heads, d, generator=g).to(dtype)
    v = torch.randn(n, kv_heads, d, generator=g).to(dtype)
    pos = torch.arange(n)
    cache[table[0, pos // kbs].long(), 0, pos % kbs] = k
    cache[table[0, pos // kbs].long(), 1, pos % kbs] = v
    q = torch.randn(1, heads, d, generator=g).to(dtype)
    sl = torch.tensor([n], dtype=torch.int32)
    for window in (n - 1, n - 1 - 16 * 3, None):
        out = native_attn.paged_decode_attention(q, cache, table, sl, d**-0.5, window)
        ref = reference(q, [k.float()], [v.float()], [n], d**-0.5, window)
        check(out, ref, dtype)


@needs_compiler
def test_softmax_over_a_wide_score_range_on_amx_tiles():
    """bfloat16 scores hundreds apart (the weights underflow), long enough for the AMX path."""
    lens = [300]
    q, cache, table, sl, ks, vs = paged_problem(lens, 4, 1, 32, 16, torch.bfloat16, seed=3)
    out = native_attn.paged_decode_attention(q, cache, table, sl, 30.0, None)
    ref = reference(q, ks, vs, lens, 30.0)
    check(out, ref, torch.bfloat16)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_engine_path_matches_pytorch_path(dtype, softcap, monkeypatch):
    """paged_attention's decode (native) against its PyTorch path on the same batch."""
    lens = [90, 1, 257]
    q, cache, table, sl, _, _ = paged_problem(lens, 8, 2, 64, 16, dtype, seed=11)
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    out = paged_attention(q, cache, table, qsl, sl, 0.125, sliding_window=None, softcap=softcap)
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    ref = paged_attention(q, cache, table, qsl, sl, 0.125, sliding_window=None, softcap=softcap)
    assert out.dtype == ref.dtype == dtype
    check(out, ref.double(), dtype)


# Builds of decode_attention.c for other CPUs, run here when this CPU has what they use.
VARIANTS = {
    "sapphirerapids-no-amx": (["-march=sapphirerapids", "-mno-amx-tile"], {"avx512_bf16"}),
    "cooperlake": (["-march=cooperlake"], {"avx512f", "avx512_bf16"}),
    "skylake-avx512": (["-march=skylake-avx512"], {"avx512f", "avx512bw"}),
    "x86-64-v3": (["-march=x86-64-v3"], {"avx2", "fma"}),
}


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@needs_compiler
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_builds_for_other_cpus(variant, tmp_path):
    flags, needs = VARIANTS[variant]
    if not needs <= _cpu_flags():
        pytest.skip(f"this CPU lacks {needs - _cpu_flags()}")
    lib_path = tmp_path / f"{variant}.so"
    cmd = ["gcc", "-O2", *flags, "-fopenmp", "-shared", "-fPIC", "-std=c11", str(SOURCE), "-o",
           str(lib_path), "-lm"]  # fmt: skip
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    fn = ctypes.CDLL(str(lib_path)).hkv_paged_decode
    fn.argtypes, fn.restype = native._SIGNATURES["hkv_paged_decode"], None
    for dtype in (torch.float32, torch.bfloat16):
        for heads, kv_heads, d in [(8, 2, 128), (6, 2, 80), (6, 3, 7)]:
            lens = [1, 45, 200, 0]
            q, cache, table, sl, ks, vs = paged_problem(lens, heads, kv_heads, d, 16, dtype)
            sinks = torch.linspace(-1.0, 1.0, heads)
            out = torch.empty_like(q)
            fn(q.data_ptr(), cache.data_ptr(), int(dtype == torch.bfloat16), 16, kv_heads, d,
               heads, table.data_ptr(), table.stride(0), sl.data_ptr(), 60, len(lens), 0.3,
               0.0, sinks.data_ptr(), out.data_ptr())  # fmt: skip
            check(out, reference(q, ks, vs, lens, 0.3, 60, sinks), dtype)
            fn(q.data_ptr(), cache.data_ptr(), int(dtype == torch.bfloat16), 16, kv_heads, d,
               heads, table.data_ptr(), table.stride(0), sl.data_ptr(), 60, len(lens), 0.3,
               SOFTCAP, sinks.data_ptr(), out.data_ptr())  # fmt: skip
            check(out, reference(q, ks, vs, lens, 0.3, 60, sinks, SOFTCAP), dtype)
