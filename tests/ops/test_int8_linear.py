"""The native int8 weight-only linear (hybridkv/ops/native/int8_linear.c) on both of its paths:
the streaming one (up to 16 rows of x, or x under 64K values: tiles of 1 x 16, 2 x 8 and 4 x 4
read in groups of 4 weight rows, with the far and near prefetches) and the chunked one (more
rows) of AVX-512 builds, or the 8-lane tiles (up to 20 rows) and the AVX2 GEMM of AVX2 builds,
against a float64 reference of the dequantized weight within float32 accumulation
error: every M from 1 to 17 (every tile shape and last tile), K with a masked tail (K % 16 !=
0) or shorter than a vector, N with a partial last block (5, 37), weights with several blocks
per thread, rows of x at a stride, one thread and the team, float32 and bfloat16 x. The layer's
own tests (which path it takes, quantization error) are tests/layers/test_quantization.py."""

from __future__ import annotations

import pytest
import torch

from hybridkv.layers.quantization import Int8Linear, dequantize_rows, quantize_rows
from hybridkv.ops.native import cpu
from hybridkv.ops.native import int8_linear as native_int8

pytestmark = pytest.mark.skipif(
    not native_int8.available(), reason="no native int8 kernel (AVX2 or AVX-512) on this machine"
)

U = 2.0**-24  # float32 unit roundoff
BF16_HALF_STEP = 2.0**-8  # at most, relative to the value (8 significant bits)
STREAM_X = 64 * 1024  # int8_linear.c I8_STREAM_X: x's values up to which M > 16 streams


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def case(m, k, n, dtype, seed=0, pad=5):
    """x [m, k] as a column slice of wider rows (row stride k + pad, unaligned start), the
    quantized weight of a random one with rows of different magnitudes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + pad, generator=g).to(dtype)[:, 3 : 3 + k]
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n)[:, None]
    q, scale = quantize_rows(w)
    return x, q, scale


def check(y, x, q, scale):
    """y within float32 accumulation error of the exact x @ (q * scale).T: each of the at most
    K + 3 roundings (FMAs along k, the reduction tree, the scale) moves it by at most U of the
    sum of |terms|; a bfloat16 y is then rounded once more (by half a bfloat16 step)."""
    assert y.dtype == x.dtype and y.shape == (x.shape[0], q.shape[0])
    wd = dequantize_rows(q, scale).double()
    exact = x.double() @ wd.T
    bound = (x.double().abs() @ wd.abs().T) * (x.shape[1] + 3) * U + 1e-30
    if y.dtype == torch.bfloat16:
        bound = bound * (1 + BF16_HALF_STEP) + BF16_HALF_STEP * exact.abs()
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [5, 16, 53, 100, 771])
@pytest.mark.parametrize("n", [5, 37])
def test_matches_float64_reference_for_every_tile(dtype, k, n, threads):
    for m in range(1, 18):
        x, q, scale = case(m, k, n, dtype, seed=m)
        assert x.stride(0) == k + 5  # strided rows, read in place
        check(native_int8.int8_linear(x, q, scale), x, q, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
def test_many_blocks_per_thread(dtype, m, threads):
    """Weights large enough for the team (over 64K values) and many blocks, prefetches and
    groups per thread, the last block partial (331 = 20 x 16 + 11 rows, = 82 x 4 + 3)."""
    x, q, scale = case(m, 768, 331, dtype, seed=11)
    check(native_int8.int8_linear(x, q, scale), x, q, scale)


@pytest.mark.parametrize("m", [20, 33, 85, 86, 100])
def test_more_rows_stream_while_x_is_small_then_chunk(m, threads):
    """Past 16 rows: streaming while x holds at most STREAM_X values (768 x 85), the chunked
    path above; both within float32 error, bfloat16 x too (chunked: pair products)."""
    for dtype in (torch.float32, torch.bfloat16):
        x, q, scale = case(m, 768, 37, dtype, seed=m)
        assert (m * 768 <= STREAM_X) == (m <= 85)
        check(native_int8.int8_linear(x, q, scale), x, q, scale)


@pytest.mark.parametrize("m", [1, 2, 4, 5, 16, 40])
def test_bfloat16_x_is_the_float32_path_on_its_widened_values(m, threads):
    """bfloat16 x is widened to float32 (exactly) and runs the float32 tiles: its output is the
    float32 output for those values rounded to bfloat16, bit for bit."""
    x, q, scale = case(m, 200, 37, torch.bfloat16, seed=m)
    y = native_int8.int8_linear(x, q, scale)
    assert torch.equal(y, native_int8.int8_linear(x.float(), q, scale).bfloat16())


def test_output_row_stride_and_rows_past_n_untouched():
    """y at a row stride wider than N: the columns past N are not written (both dtypes)."""
    for dtype in (torch.float32, torch.bfloat16):
        for m in (1, 2, 5):
            x, q, scale = case(m, 100, 37, dtype)
            y = torch.full((m, 40), 7.0, dtype=dtype)
            bf16 = int(dtype == torch.bfloat16)
            native_int8.kernel()(x.data_ptr(), x.stride(0), bf16, q.data_ptr(), scale.data_ptr(),
                                 m, 37, 100, y.data_ptr(), 40, bf16)  # fmt: skip
            check(y[:, :37], x, q, scale)
            assert (y[:, 37:] == 7.0).all()


def test_tiny_and_empty_shapes():
    for m, k, n in [(1, 1, 1), (3, 1, 2), (2, 15, 1), (5, 17, 3), (17, 16, 16), (1, 64, 17)]:
        for dtype in (torch.float32, torch.bfloat16):
            x, q, scale = case(m, k, n, dtype, seed=k)
            check(native_int8.int8_linear(x, q, scale), x, q, scale)
    x, q, scale = case(0, 8, 4, torch.float32)
    assert native_int8.int8_linear(x, q, scale).shape == (0, 4)
    x = torch.randn(3, 0)  # no products: zeros
    q, scale = torch.zeros(4, 0, dtype=torch.int8), torch.ones(4, dtype=torch.bfloat16)
    assert torch.equal(native_int8.int8_linear(x, q, scale), torch.zeros(3, 4))


def test_non_finite_inputs_reach_their_rows_only():
    """A NaN or an infinity in a row of x makes that row's outputs non-finite (a bfloat16 NaN
    stays NaN when rounded) and leaves the other rows as they were."""
    for dtype in (torch.float32, torch.bfloat16):
        x, q, scale = case(5, 100, 37, dtype)
        clean = native_int8.int8_linear(x, q, scale)
        x = x.clone()
        x[1, 7], x[3, 50] = float("nan"), float("inf")
        y = native_int8.int8_linear(x, q, scale)
        assert y[1].isnan().all() and not y[3].isfinite().any()
        rows = [0, 2, 4]
        assert torch.equal(y[rows], clean[rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_of_another_width_raises_instead_of_reading_past_its_rows(dtype):
    """`run` (the int8 layers' per-call path) on x whose K is not the weight's: a RuntimeError,
    as F.linear gives, where it used to read K values of each row (past the rows of a narrower
    x, the garbage returned as [M, N])."""
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(torch.nn.Linear(100, 37))
    with torch.inference_mode():
        for k in (50, 150):
            x = torch.randn(2, k).to(dtype)
            with pytest.raises(RuntimeError, match="does not fit"):
                native_int8.run(native_int8.kernel(), x, layer.qweight, layer.scale)
            with pytest.raises(RuntimeError):
                layer(x)
        assert layer(torch.randn(2, 100).to(dtype)).shape == (2, 37)


# --- the AMX-INT8 tiles (int8_amx.c): rows of x past the streaming kernel's -------------------

HAS_AMX_INT8 = cpu.record().supports("amx_int8")
needs_amx_int8 = pytest.mark.skipif(
    not HAS_AMX_INT8, reason="no AMX-INT8 here (the build, the CPU or the OS's tile permission)"
)
DIGITS = 2.0**-15  # int8_amx.c: x within max |x[m, :]| / 64516 (2^-16) of its two digits


def check_amx(y, x, q, scale):
    """y within the AMX kernel's error of x @ (q * scale).T: x as two 8-bit digits per row
    (each value within 2^-16 of its row's largest: DIGITS with a margin for the float32 digit
    arithmetic), exact sums of the digits' products, then `check`'s float32 bound for the
    combination and scaling and a bfloat16 y's final rounding."""
    wd = dequantize_rows(q, scale).double()
    xd = x.double()
    exact = xd @ wd.T
    bound = (xd.abs() @ wd.abs().T) * 8 * U + 1e-30  # the digits' sum, the scales, in float32
    bound = bound + xd.abs().amax(1, keepdim=True) * DIGITS * wd.abs().sum(1)[None, :]
    if y.dtype == torch.bfloat16:
        bound = bound * (1 + BF16_HALF_STEP) + BF16_HALF_STEP * exact.abs()
    assert y.dtype == x.dtype and y.shape == (x.shape[0], q.shape[0])
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), float((err / bound).max())


@needs_amx_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [5, 53, 100, 771])  # not multiples of 32: zero-padded tiles
@pytest.mark.parametrize("n", [5, 37, 331])  # a partial last block of 32 weight rows
def test_amx_matches_the_dequantized_weight(dtype, k, n, threads):
    for m in (1, 17, 33, 64, 130):  # one tile of rows or two, partial passes
        x, q, scale = case(m, k, n, dtype, seed=m + k)
        assert x.stride(0) == k + 5  # strided rows, read in place
        check_amx(native_int8.run_amx(x, q, scale), x, q, scale)


@needs_amx_int8
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_rows_of_x_in_groups(dtype, threads):
    """Prefill rows: x in groups of rows whose tiles stay in L2 (512 KiB: 160 rows at K = 1600),
    each group against every block of weight rows: 600 rows = 3 groups and a partial one; K in
    chunks of 6 steps of 64 (25 steps: 4 chunks and a last of one), the sums kept between."""
    x, q, scale = case(600, 1600, 70, dtype, seed=3)
    check_amx(native_int8.run_amx(x, q, scale), x, q, scale)


@needs_amx_int8
@pytest.mark.parametrize("m", [17, 64])
def test_amx_on_bfloat16_x_is_its_float32_path_rounded(m):
    """bfloat16 x gets the digits of its float32 values: its output is the float32 x output of
    the same values rounded once to bfloat16, bit for bit (same digits, same sums)."""
    x, q, scale = case(m, 200, 37, torch.bfloat16, seed=m)
    y = native_int8.run_amx(x, q, scale)
    assert torch.equal(y, native_int8.run_amx(x.float(), q, scale).bfloat16())


@needs_amx_int8
def test_amx_scratch_kept_between_calls_and_taken_by_one_caller_at_a_time():
    """int8_amx.c keeps its scratch (x's tiles, digit rows, sums, the padded last weight rows)
    between calls, grown when a call needs more: small, large, then small again calls give the
    results of fresh ones; callers on other threads while one holds it allocate their own (the
    kernel runs without the GIL), with the same results bit for bit."""
    import threading

    cases = [case(m, k, n, torch.float32, seed=m) for m, k, n in
             [(24, 100, 37), (600, 1600, 70), (33, 771, 5), (130, 53, 331)]]  # fmt: skip
    first = [native_int8.run_amx(x, q, s) for x, q, s in cases]
    for (x, q, s), y in zip(cases, first, strict=True):
        check_amx(y, x, q, s)
    for (x, q, s), y in zip(reversed(cases), reversed(first), strict=True):
        assert torch.equal(native_int8.run_amx(x, q, s), y)
    failures: list[str] = []

    def caller(i: int) -> None:
        for _ in range(20):
            for j, (x, q, s) in enumerate(cases):
                if (i + j) % 2 == 0 and not torch.equal(native_int8.run_amx(x, q, s), first[j]):
                    failures.append(f"caller {i}, case {j}")

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert not failures


@needs_amx_int8
def test_amx_tiny_shapes_and_non_finite_rows():
    for m, k, n in [(1, 1, 1), (3, 1, 2), (2, 15, 1), (40, 17, 3), (17, 32, 16), (1, 64, 33)]:
        for dtype in (torch.float32, torch.bfloat16):
            x, q, scale = case(m, k, n, dtype, seed=k)
            check_amx(native_int8.run_amx(x, q, scale), x, q, scale)
    x, q, scale = case(0, 8, 4, torch.float32)
    assert native_int8.run_amx(x, q, scale).shape == (0, 4)
    q, scale = torch.zeros(4, 0, dtype=torch.int8), torch.ones(4, dtype=torch.bfloat16)
    assert torch.equal(native_int8.run_amx(torch.randn(3, 0), q, scale), torch.zeros(3, 4))
    x, q, scale = case(40, 100, 37, torch.float32)
    clean = native_int8.run_amx(x, q, scale)
    x = x.clone()
    x[1, 7], x[30, 50] = float("nan"), float("inf")
    y = native_int8.run_amx(x, q, scale)
    assert y[1].isnan().all() and not y[30].isfinite().any()
    rows = [r for r in range(40) if r not in (1, 30)]
    assert torch.equal(y[rows], clean[rows])


def test_int8_chain_takes_amx_where_the_cpu_record_has_it():
    """Past the streaming kernel's rows the chain runs the AMX tiles where the CPU record has
    amx_int8 (built, on the CPU, the tile permission granted), never elsewhere."""
    from hybridkv.layers.quantization import INT8_LINEAR

    for dtype in (torch.float32, torch.bfloat16):
        names = [link.impl.name for link in INT8_LINEAR.chain("cpu", dtype).links]
        assert ("native-amx-int8" in names) == HAS_AMX_INT8
        if HAS_AMX_INT8:
            assert names[-1] == "native-amx-int8" and len(names) == 2
