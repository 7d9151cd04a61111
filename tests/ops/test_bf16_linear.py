"""The native bfloat16 linear for small batches (hybridkv/ops/native/bf16_linear.c): against a
float64 reference within the bfloat16 rounding of the sum, for every tile shape (M = 1, 2 and
4-row tiles with 1..3 rows left), K with a masked tail, N with a partial last block, with and
without bias, strided rows of x, one thread and the team; and what it declines."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops import native, registry
from hybridkv.ops.native import bf16_linear as native_bf16

pytestmark = pytest.mark.skipif(
    native_bf16.kernel() is None, reason="no native bf16 kernel (AVX2 or AVX512-BF16) here"
)

HALF_ULP = 2.0**-8  # bfloat16 keeps 8 significant bits: rounding moves a value by at most this


def reference(x, w, bias):
    """The exact sum (float64 of the bfloat16 values) and the sum of |terms| (for the float32
    accumulation's error, at most K * 2**-24 of it)."""
    ref = x.double() @ w.double().T
    mag = x.double().abs() @ w.double().abs().T
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    return ref, mag


def check(y, x, w, bias):
    assert y.dtype == torch.bfloat16 and y.shape == (x.shape[0], w.shape[0])
    ref, mag = reference(x, w, bias)
    k = x.shape[1]
    bound = ref.abs() * HALF_ULP + mag * (k + 2) * 2.0**-24 + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), float((err / bound).max())


def case(m, k, n, bias, seed=0, pad=5):
    """x as a column slice of wider rows (row stride k + pad, unaligned start)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(m, k + pad, generator=g).to(torch.bfloat16)
    x = rows[:, 3 : 3 + k]
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g).to(torch.bfloat16) if bias else None
    return x, w, b


@pytest.mark.parametrize("k", [24, 100, 768, 1000])
@pytest.mark.parametrize("n", [5, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference_for_every_tile(k, n, bias):
    for m in range(1, 18):
        x, w, b = case(m, k, n, bias, seed=m)
        assert x.stride(0) == k + 5  # strided rows, read in place
        check(native_bf16.bf16_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
def test_many_blocks_per_thread(m, threads):
    """Weights large enough for the team and several blocks (and prefetches) per thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        x, w, b = case(m, 768, 331, True, seed=11)
        check(native_bf16.bf16_linear(x, w, b), x, w, b)
    finally:
        torch.set_num_threads(before)


def test_tiny_and_empty_shapes():
    for m, k, n in [(1, 1, 1), (3, 1, 2), (2, 31, 1), (5, 33, 3), (17, 32, 16)]:
        x, w, b = case(m, k, n, True, seed=k)
        check(native_bf16.bf16_linear(x, w, b), x, w, b)
    x, w, b = case(0, 8, 4, True)
    assert native_bf16.bf16_linear(x, w, b).shape == (0, 4)


def test_inputs_with_a_column_stride_are_copied():
    x, w, b = case(4, 48, 9, True)
    xt = x.t().contiguous().t()  # same values, column stride 4
    assert xt.stride(1) != 1
    assert torch.equal(native_bf16.bf16_linear(xt, w, b), native_bf16.bf16_linear(x, w, b))


def test_declines_what_it_does_not_take():
    x, w, b = case(2, 16, 8, True)
    assert native_bf16.bf16_linear(x.float(), w, b) is None  # float32 x
    assert native_bf16.bf16_linear(x, w.float(), None) is None  # float32 weight
    assert native_bf16.bf16_linear(x, w, b.float()) is None  # float32 bias
    assert native_bf16.bf16_linear(x, w.t().contiguous().t(), b) is None  # strided weight
    assert native_bf16.bf16_linear(x[:, :8], w, b) is None  # K mismatch
    assert native_bf16.bf16_linear(x, w, b[:4]) is None  # bias of another length


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    assert native.library() is None and native_bf16.kernel() is None
    x, w, b = case(2, 16, 8, True)
    assert native_bf16.bf16_linear(x, w, b) is None
