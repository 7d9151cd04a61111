"""quantization="w8a8"'s linear: the packed weight layout, the PyTorch reference against exact
arithmetic, and the AMX-INT8 kernel (`w8a8_linear.c`) against the reference bit for bit
(skipped where this CPU or build has no AMX-INT8: the reference then runs)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.layers.quantization import (
    W8A8_LINEAR,
    dequantize_rows,
    pack_w8a8,
    quantize_activations,
    quantize_rows,
    unpack_w8a8,
    w8a8_reference,
)
from hybridkv.ops.native import cpu
from hybridkv.ops.native import w8a8_linear as native_w8a8

HAS_AMX_INT8, HAS_AVX2 = cpu.record().supports("amx_int8"), cpu.record().supports("avx2")
HAS_VNNI = cpu.record().supports("avx512_vnni")
HAS_NEON_DOT, HAS_NEON = cpu.record().supports("neon_dot"), cpu.record().supports("neon")
needs_amx_int8 = pytest.mark.skipif(
    not HAS_AMX_INT8, reason="no AMX-INT8 here (build, CPU or OS tile permission)"
)


def _kernel(name: str, runs: bool, reason: str):
    return pytest.param(name, marks=pytest.mark.skipif(not runs, reason=reason))


# (the NEON kernels run on aarch64 only: tests/ops/test_native_aarch64.py checks them under qemu)
KERNELS = [
    pytest.param("amx", marks=needs_amx_int8),
    _kernel("avx512_vnni", HAS_VNNI, "no AVX-512 VNNI build"),
    _kernel("avx2", HAS_AVX2, "no AVX2 build"),
    _kernel("neon_dot", HAS_NEON_DOT, "no aarch64 dot product build"),
    _kernel("neon", HAS_NEON, "no aarch64 NEON build"),
]
RUNS = {"amx": HAS_AMX_INT8, "avx512_vnni": HAS_VNNI, "avx2": HAS_AVX2,
        "neon_dot": HAS_NEON_DOT, "neon": HAS_NEON}  # fmt: skip
RUNNABLE = [kernel for kernel, runs in RUNS.items() if runs]  # in the declaration's order
# (M, N, K): tails of every tile dimension, one or two A / B tiles, K past one 64-block
SHAPES = [(1, 16, 64), (1, 1, 1), (5, 40, 100), (15, 17, 64), (16, 32, 128), (17, 31, 130),
          (33, 70, 768), (64, 300, 200), (100, 48, 1536)]  # fmt: skip


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed + 7919 * m + 31 * n + k)
    q, scale = quantize_rows(torch.randn(n, k, generator=g))
    x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).to(dtype)
    if m > 3:
        x[3] = 0  # a zero row: zero outputs, no division by zero
    return x, q, scale


@pytest.mark.parametrize(("n", "k"), [(1, 1), (16, 64), (17, 65), (40, 100), (3, 200)])
def test_pack_is_the_tile_layout_and_unpacks(n, k):
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    packed = pack_w8a8(q)
    assert packed.shape == native_w8a8.packed_shape(n, k) and packed.is_contiguous()
    for nn_, kk in [(0, 0), (n - 1, k - 1), (n // 2, k // 3)]:
        nb, r, j = nn_ // 16, (kk % 64) // 4, kk % 4
        assert packed[nb, kk // 64, r, nn_ % 16, j] == q[nn_, kk]
    assert torch.equal(unpack_w8a8(packed, n, k), q)
    assert int(packed.abs().sum()) == int(q.abs().sum())  # the padding is zeros


def test_activations_round_per_row_half_to_even():
    x = torch.tensor([[1.0, -0.5, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [254.0, 1.0, 3.0, -127.0]])
    xq, sx = quantize_activations(x)
    assert xq[0].tolist() == [127.0, -64.0, 32.0, 0.0]  # -63.5 -> -64, 31.75 -> 32
    assert xq[1].tolist() == [0.0] * 4 and sx[1].item() == 0.0
    assert xq[2].tolist() == [127.0, 0.0, 2.0, -64.0]  # 0.5 -> 0, 1.5 -> 2, -63.5 -> -64
    torch.testing.assert_close(sx[:, 0], torch.tensor([1 / 127, 0.0, 2.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_reference_is_the_exact_product_of_the_rounded_operands(m, n, k, dtype):
    x, q, scale = _case(m, n, k, dtype)
    got = w8a8_reference(x, pack_w8a8(q), scale, n, k)
    assert got.dtype == dtype and got.shape == (m, n)
    xq, sx = quantize_activations(x)
    exact = (xq.double() * sx.double()) @ (q.double() * scale.double()[:, None]).T
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(got.double(), exact, rtol=tol, atol=tol * float(exact.abs().max()))
    # and within the activations' 8-bit rounding of the weight-only product
    full = x.double() @ dequantize_rows(q, scale).double().T
    assert float((got.double() - full).abs().max()) <= 0.03 * float(full.abs().max()) + 1e-6


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_kernel_equals_the_reference_bit_for_bit(m, n, k, dtype, kernel):
    x, q, scale = _case(m, n, k, dtype)
    packed = pack_w8a8(q)
    assert torch.equal(native_w8a8.run(x, packed, scale, n, k, kernel),
                       w8a8_reference(x, packed, scale, n, k))  # fmt: skip


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("threads", [1, 2])
def test_strided_rows_and_threads(threads, kernel):
    m, n, k = 40, 200, 320
    wide, q, scale = _case(m, n, k + 24, torch.float32)
    x = wide[:, 8 : 8 + k]  # a row stride past its width
    q = q[:, :k].contiguous()
    packed = pack_w8a8(q)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native_w8a8.run(x, packed, scale, n, k, kernel)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, w8a8_reference(x.contiguous(), packed, scale, n, k))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_input_spoils_its_row_only(bad):
    x, q, scale = _case(6, 40, 96, torch.float32)
    x[2, 5] = bad
    packed = pack_w8a8(q)
    ref = w8a8_reference(x, packed, scale, 40, 96)
    assert ref[2].isnan().all() and ref[[0, 1, 3, 4, 5]].isfinite().all()
    for kernel in RUNNABLE:
        got = native_w8a8.run(x, packed, scale, 40, 96, kernel)
        assert got[2].isnan().all()
        assert torch.equal(got[[0, 1, 3, 4, 5]], ref[[0, 1, 3, 4, 5]])


@pytest.mark.parametrize("kernel", KERNELS)
def test_empty_rows_and_wrong_shapes_are_refused(kernel):
    x, q, scale = _case(4, 20, 64, torch.float32)
    packed = pack_w8a8(q)
    assert native_w8a8.run(x[:0], packed, scale, 20, 64, kernel).shape == (0, 20)
    with pytest.raises(RuntimeError, match=r"x \[4, 64\] torch.float32 does not fit the weight"):
        native_w8a8.run(x, packed, scale, 20, 65, kernel)
    native_w8a8.check_weights(packed, scale, 20, 64)
    with pytest.raises(ValueError, match="packed weight"):
        native_w8a8.check_weights(packed[:1], scale, 20, 64)
    with pytest.raises(ValueError, match="scale"):
        native_w8a8.check_weights(packed, scale.float(), 20, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_too_small_for_127_over_their_max(dtype):
    """max |x| < 127 / FLT_MAX: 127 / a is infinite, so the reference rounds every nonzero
    value to +-127 and zeros to 0 (0 * inf = NaN, made 0); the kernels do the same (the vector
    conversions alone would turn those NaNs into -128 on x86)."""
    x, q, scale = _case(3, 21, 70, torch.float32)
    x[0] = 0.0
    x[0, [3, 5, 69]] = torch.tensor([1e-38, -2e-38, 3e-39])
    x[1] = torch.randn(70) * 1e-30  # tiny but 127 / a finite: the ordinary path
    x = x.to(dtype)
    packed = pack_w8a8(q)
    ref = w8a8_reference(x, packed, scale, 21, 70)
    xq, _ = quantize_activations(x[:1])
    assert sorted(set(xq[0].tolist())) == [-127.0, 0.0, 127.0]
    for kernel in RUNNABLE:
        assert torch.equal(native_w8a8.run(x, packed, scale, 21, 70, kernel), ref), kernel


def test_declaration_takes_the_kernel_where_the_cpu_has_amx_int8():
    chain = W8A8_LINEAR.chain(torch.device("cpu"), torch.float32)
    want = {"amx": "native-amx-int8", "avx512_vnni": "native-avx512-vnni", "avx2": "native-avx2",
            "neon_dot": "native-neon-dot", "neon": "native-neon"}  # fmt: skip
    assert chain.describe() == (want[RUNNABLE[0]] if RUNNABLE else "torch")
    names = ["native-amx-int8", "native-avx512-vnni", "native-avx2", "native-neon-dot",
             "native-neon", "torch"]  # fmt: skip
    assert [i.name for i in W8A8_LINEAR.impls] == names
