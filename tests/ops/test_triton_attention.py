"""The Triton kernels against the PyTorch reference (hybridkv.ops.attention).

Without a GPU the kernels run through Triton's interpreter on the CPU (TRITON_INTERPRET=1, set
by the root conftest.py and again below in case this module is imported on its own); with one,
the same tests run the compiled kernels on it. Block tables
are built in page mode: pages of `ratio` kernel blocks, page p -> kernel blocks p*r .. p*r+r-1,
pages handed out in random order; the cache starts as NaN bit patterns everywhere.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.forward_batch import AttentionMetadata  # noqa: E402
from hybridkv.layers.attention.registry import get_backend  # noqa: E402
from hybridkv.ops import attention as ref  # noqa: E402
from hybridkv.ops import registry
from hybridkv.ops import triton_attention as tri  # noqa: E402

CPU = torch.device("cpu")
DEV = torch.device("cuda") if torch.cuda.is_available() else CPU  # where the kernels run

pytestmark = pytest.mark.triton


@dataclass
class Case:
    cache: torch.Tensor  # [num_pages * ratio, 2, kbs, kv_heads, head_dim]
    table: torch.Tensor  # [num_seqs, width] int32 kernel-block ids
    q: torch.Tensor  # [num_tokens, heads, head_dim]
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32


@pytest.fixture(autouse=True)
def pytorch_reference(monkeypatch):
    """Compare the Triton kernels with the PyTorch reference itself, not the native CPU kernel
    that `ref.paged_attention` would use for decode rows."""
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting


def page_mode_table(
    seq_lens: list[int], kbs: int, ratio: int, num_pages: int, gen: torch.Generator
) -> torch.Tensor:
    """Random pages per request, expanded to kernel-block ids; spare columns point at a page
    nobody owns (its slots stay NaN)."""
    page_tokens = kbs * ratio
    need = [-(-s // page_tokens) for s in seq_lens]
    assert sum(need) < num_pages
    perm = torch.randperm(num_pages, generator=gen)
    spare = int(perm[-1])
    width = max(need) * ratio + 1
    table = torch.full((len(seq_lens), width), spare * ratio, dtype=torch.int32)
    used = 0
    for s, n in enumerate(need):
        pages = perm[used : used + n]
        used += n
        blocks = (pages[:, None] * ratio + torch.arange(ratio)).flatten()  # p -> p*r .. p*r+r-1
        table[s, : blocks.numel()] = blocks.int()
    return table


def make_case(
    q_lens: list[int],
    seq_lens: list[int],
    kbs: int,
    ratio: int = 1,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    q_dtype: torch.dtype | None = None,
    device: torch.device = DEV,
    seed: int = 0,
) -> Case:
    """A NaN-filled paged cache holding every request's context: earlier context written by
    the reference, this step's tokens by the Triton kernel (checked against the reference)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-s // (kbs * ratio)) for s in seq_lens) + 2
    page_bytes = ratio * 2 * kbs * kv_heads * head_dim * dtype.itemsize
    buffer = torch.empty(num_pages * page_bytes, dtype=torch.uint8, device=device)
    cache = buffer.view(dtype).view(num_pages * ratio, 2, kbs, kv_heads, head_dim)
    cache.fill_(float("nan"))
    cache[0] = 0  # the null block (page 0 is never handed out): the reference reads it
    table = page_mode_table(seq_lens, kbs, ratio, num_pages, gen).to(device)
    expected = cache.clone()
    for s, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
        pos = torch.arange(seq_len, device=device)
        slots = table[s, pos // kbs].long() * kbs + pos % kbs
        # already in the cache dtype: the interpreter casts float32 -> bfloat16 by truncation,
        # a GPU rounds to nearest even (as torch does)
        k = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(device, dtype)
        v = torch.randn(seq_len, kv_heads, head_dim, generator=gen).to(device, dtype)
        new = seq_len - q_len  # earlier context: written by previous steps
        ref.write_kv_cache(k[:new], v[:new], cache, slots[:new])
        tri.write_kv_cache(k[new:], v[new:], cache, slots[new:])
        ref.write_kv_cache(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, equal_nan=True, rtol=0, atol=0)
    q = torch.randn(sum(q_lens), heads, head_dim, generator=gen).to(device, q_dtype or dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return Case(cache, table, q, qsl.to(device), seq_lens_t)


def check(case: Case, window: int | None = None, tol: float = 2e-5, **kwargs) -> torch.Tensor:
    args = (case.q, case.cache, case.table, case.query_start_loc, case.seq_lens, 0.3)
    out = tri.paged_attention(*args, sliding_window=window, **kwargs)
    expected = ref.paged_attention(*args, sliding_window=window)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert not torch.isnan(out).any(), "NaN from an unused slot leaked into the output"
    torch.testing.assert_close(out.float(), expected.float(), rtol=tol, atol=tol)
    return out


# --- paged attention ----------------------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1, 3, 17])
@pytest.mark.parametrize("kbs", [16, 48, 64])
def test_mixed_batch_matches_reference(kbs: int, ratio: int) -> None:
    # prefill chunk over earlier context, decode at length 1, prefill from 0, long decode
    check(make_case([5, 1, 37, 1], [70, 1, 37, 130], kbs, ratio))


@pytest.mark.parametrize("kbs", [16, 48])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_decode_ragged_split_k(kbs: int, splits: int) -> None:
    case = make_case([1] * 5, [1, 17, 95, 200, 64], kbs, ratio=3, heads=8, kv_heads=2)
    check(case, num_kv_splits=splits)


def test_decode_split_k_heuristic_and_bad_value() -> None:
    case = make_case([1] * 3, [300, 2, 129], 16, ratio=17)
    check(case)  # the heuristic picks splits for a small batch
    with pytest.raises(ValueError, match="power of two"):
        check(case, num_kv_splits=3)


@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("kind", ["prefill", "decode"])
def test_sliding_window(window: int, kind: str) -> None:
    if kind == "prefill":
        q_lens, seq_lens = [20, 3, 50], [20, 90, 120]
    else:
        q_lens, seq_lens = [1, 1, 1], [5, 90, 150]
    check(make_case(q_lens, seq_lens, 48, ratio=3), window=window)
    if kind == "decode":
        check(make_case(q_lens, seq_lens, 48, ratio=3), window=window, num_kv_splits=4)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(3, 3, 16), (6, 2, 24), (8, 1, 32)])
def test_group_sizes_and_head_dims(heads: int, kv_heads: int, head_dim: int) -> None:
    # MHA, a group of 3 (padded to 4 rows), MQA with 8 heads; a head dim that is no power of 2
    case = make_case([4, 1, 9], [40, 33, 9], 16, 3, heads, kv_heads, head_dim)
    check(case)


@pytest.mark.parametrize(("kbs", "ratio"), [(80, 2), (528, 1), (2096, 1)])
def test_non_power_of_two_and_huge_kernel_blocks(kbs: int, ratio: int) -> None:
    # tiles are the kernel's own: a 2096-token kernel block is walked in small tiles
    seq_lens = [kbs + 20, 30, kbs * ratio + 5]
    check(make_case([3, 30, 1], seq_lens, kbs, ratio, heads=2, kv_heads=1))


@pytest.mark.parametrize(
    "launch",
    [tri.LaunchConfig(16, 16), tri.LaunchConfig(32, 64, num_warps=2), tri.LaunchConfig(64, 16)],
)
def test_launch_config_override(launch) -> None:
    # tiles smaller and larger than the 48-token kernel blocks, decode and prefill rows
    case = make_case([5, 1, 19], [70, 100, 19], 48, ratio=3, heads=8, kv_heads=2)
    check(case, launch=launch)
    check(make_case([1, 1], [70, 100], 48, ratio=3), launch=launch, num_kv_splits=2)


def test_launch_config_rejects_bad_values() -> None:
    with pytest.raises(ValueError, match="tile_n must be a power of two >= 16, got 48"):
        tri.LaunchConfig(16, 48)
    with pytest.raises(ValueError, match="num_warps"):
        tri.LaunchConfig(16, 16, num_warps=3)
    case = make_case([1], [20], 16, heads=64, kv_heads=2)  # a group of 32 rows
    with pytest.raises(ValueError, match="block_m=16 must be a multiple of the padded group 32"):
        check(case, launch=tri.LaunchConfig(16, 16))


def test_nan_garbage_never_leaks() -> None:
    # every slot outside the valid context is NaN: unused slots of owned pages, the pages of
    # other requests, spare table columns, and the query rows' padding lanes
    case = make_case([2, 1, 16], [33, 47, 16], 16, ratio=3, heads=6, kv_heads=2)
    assert torch.isnan(case.cache).any()
    out = check(case)
    assert torch.isfinite(out).all()
    out = check(make_case([1, 1], [33, 47], 16, ratio=3), num_kv_splits=4)
    assert torch.isfinite(out).all()


def test_bf16_and_mixed_dtypes_in_interpreter() -> None:
    check(make_case([4, 1], [50, 70], 16, 3, dtype=torch.bfloat16), tol=2e-2)
    check(make_case([4, 1], [50, 70], 16, 3, dtype=torch.bfloat16, q_dtype=torch.float32))


def test_empty_batch() -> None:
    case = make_case([1], [5], 16)
    q = case.q[:0]
    out = tri.paged_attention(q, case.cache, case.table[:0], case.query_start_loc[:1],
                              case.seq_lens[:0], 0.3)  # fmt: skip
    assert out.shape == (0, *q.shape[1:])


# --- write_kv_cache and zero_pages --------------------------------------------------------------


def test_write_kv_cache_skips_padding_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = torch.full((6, 2, 48, 3, 24), float("nan"), device=DEV)
    expected = cache.clone()
    qkv = torch.randn(7, 3 * 3 * 24, generator=gen).to(DEV)  # k, v: strided views of a fused qkv
    k = qkv[:, 3 * 24 : 6 * 24].view(7, 3, 24)
    v = qkv[:, 6 * 24 :].view(7, 3, 24)
    slots = torch.tensor([5, -1, 48 * 3 + 47, -1, 0, 48 * 5 + 1, 100], device=DEV)
    tri.write_kv_cache(k, v, cache, slots)
    ref.write_kv_cache(k, v, expected, slots)
    torch.testing.assert_close(cache, expected, equal_nan=True, rtol=0, atol=0)
    assert int((~torch.isnan(cache)).sum()) == 5 * 2 * 3 * 24  # padding tokens wrote nothing
    tri.write_kv_cache(k[:0], v[:0], cache, slots[:0])  # no tokens: no launch


@pytest.mark.parametrize("page_bytes", [1000, 4096, 2 * 528 * 64 + 6])
def test_zero_pages_zeroes_exactly_the_given_pages(page_bytes: int) -> None:
    gen = torch.Generator().manual_seed(2)
    buf = torch.randint(1, 256, (7, page_bytes), dtype=torch.uint8, generator=gen).to(DEV)
    expected = buf.clone()
    expected[[0, 3, 6]] = 0
    tri.zero_pages(buf, [3, 0, 6])
    assert torch.equal(buf, expected)
    tri.zero_pages(buf, torch.tensor([], dtype=torch.int64))
    assert torch.equal(buf, expected)
    with pytest.raises(IndexError):
        tri.zero_pages(buf, [7])


def test_zero_pages_on_an_offset_view() -> None:
    flat = torch.full((1 + 5 * 64,), 9, dtype=torch.uint8, device=DEV)
    pages = flat[1:].view(5, 64)  # misaligned for wide words: falls back to bytes
    tri.zero_pages(pages, torch.tensor([4, 1]))
    assert flat[0] == 9 and pages[[1, 4]].eq(0).all() and pages[[0, 2, 3]].eq(9).all()


# --- the backend ---------------------------------------------------------------------------------


def test_triton_backend_matches_torch_backend() -> None:
    triton_backend = get_backend("triton").load()()
    torch_backend = get_backend("torch").load()()
    assert triton_backend.name == "triton"
    case = make_case([3, 1], [20, 40], 48, ratio=3)
    slots = torch.tensor([5, -1], dtype=torch.int64, device=DEV)
    meta = AttentionMetadata(case.table, slots, case.query_start_loc, case.seq_lens, 3, 40)
    out = triton_backend.forward(case.q, case.cache, meta, 0.2, sliding_window=9)
    expected = torch_backend.forward(case.q, case.cache, meta, 0.2, sliding_window=9)
    torch.testing.assert_close(out, expected, rtol=2e-5, atol=2e-5)
    kv = torch.ones(2, 2, 16, device=DEV)
    cache_a, cache_b = case.cache.clone(), case.cache.clone()
    triton_backend.write_kv_cache(kv, kv, cache_a, slots)
    torch_backend.write_kv_cache(kv, kv, cache_b, slots)
    torch.testing.assert_close(cache_a, cache_b, equal_nan=True)
    pages_a = cache_a.view(torch.uint8).view(cache_a.shape[0] // 3, -1)  # pages of 3 blocks
    pages_b = cache_b.view(torch.uint8).view(cache_b.shape[0] // 3, -1)
    triton_backend.zero_pages(pages_a, [1, 2])
    torch_backend.zero_pages(pages_b, [1, 2])
    assert pages_a[1:3].eq(0).all() and torch.equal(pages_a, pages_b)


# --- compiled (not interpreted) kernels, without a GPU --------------------------------------------

REPO = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_hopper_and_mi300_without_a_gpu() -> None:
    """Lower every kernel as a launch on an H200 or an MI300X would
    (benchmarks/triton_compile_report.py, its quick set: ~25 s of compiling for the whole
    set on a fresh machine): catches what the interpreter accepts but a compiler refuses,
    spills and shared-memory overflow."""
    pytest.importorskip("triton.backends.nvidia.compiler")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    script = REPO / "benchmarks" / "triton_compile_report.py"
    result = subprocess.run([sys.executable, str(script), "--check", "--quick"], env=env,
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for target in ("target sm_90a", "target gfx942"):
        assert target in result.stdout
    assert result.stdout.count("paged_attention decode kbs 128") == 2


# --- on a GPU: bf16, larger shapes ----------------------------------------------------------


@pytest.mark.gpu
class TestOnCuda:
    DEV = torch.device("cuda")

    @pytest.mark.parametrize(("kbs", "ratio"), [(16, 1), (16, 33), (48, 11), (64, 17), (528, 1)])
    @pytest.mark.parametrize("window", [None, 300])
    def test_mixed_batch_bf16(self, kbs: int, ratio: int, window: int | None) -> None:
        q_lens = [200, 1, 1, 513, 1, 64]
        seq_lens = [1000, 1, 2047, 513, 3000, 64]
        case = make_case(q_lens, seq_lens, kbs, ratio, 32, 8, 128, torch.bfloat16, device=self.DEV)
        check(case, window=window, tol=2e-2)

    @pytest.mark.parametrize("splits", [None, 1, 8])
    def test_decode_bf16(self, splits: int | None) -> None:
        seq_lens = [1, 17, 4096, 333, 2000, 1025, 64, 3]
        case = make_case([1] * 8, seq_lens, 32, 17, 32, 8, 128, torch.bfloat16, device=self.DEV)
        check(case, tol=2e-2, num_kv_splits=splits)

    def test_write_kv_and_zero_pages(self) -> None:
        cache = torch.full((40, 2, 48, 8, 128), float("nan"), device=self.DEV)
        expected = cache.clone()
        k, v = torch.randn(2, 300, 8, 128, device=self.DEV).unbind(0)
        slots = torch.randperm(40 * 48, device=self.DEV)[:300]
        slots[::7] = -1
        tri.write_kv_cache(k, v, cache, slots)
        ref.write_kv_cache(k, v, expected, slots)
        torch.testing.assert_close(cache, expected, equal_nan=True, rtol=0, atol=0)
        buf = torch.randint(1, 256, (9, 1 << 20), dtype=torch.uint8, device=self.DEV)
        want = buf.clone()
        want[[2, 5]] = 0
        tri.zero_pages(buf, torch.tensor([5, 2], device=self.DEV))
        assert torch.equal(buf, want)
