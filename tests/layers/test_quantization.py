"""int8 weight-only linears (hybridkv.layers.quantization): scales per output row, zero rows,
the matmul against the dequantized weight (both kernel paths, bf16 and fp32 inputs), what
quantize_model swaps, keeps and frees."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridkv.layers import quantization as quant
from hybridkv.layers.linear import PackedLinear, prepack_available, prepack_linears
from hybridkv.layers.quantization import (
    Int8Linear,
    bf16_gemm_int8_matmul,
    bf16_int8_matmul,
    dequantize_rows,
    int8_matmul,
    quantize_model,
    quantize_rows,
)
from hybridkv.ops.native import int8_linear as native_int8

BF16_ULP = 2.0**-8  # relative spacing of bfloat16 (8 significant bits)


def weight(out: int, inp: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes (per-row scales matter), one row all zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=g) * torch.logspace(-3, 0, out)[:, None]
    w[out // 2] = 0
    return w


def test_scales_are_per_row_absmax_over_127_and_zero_rows_are_exact():
    w = weight(24, 40)
    q, scale = quantize_rows(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == (24,)
    expect = (w.abs().amax(1) / 127).to(torch.bfloat16)
    expect[12] = 1  # the zero row
    torch.testing.assert_close(scale, expect, rtol=0, atol=0)
    assert int(q.abs().max()) == 127 and int(q[12].abs().max()) == 0
    # every row uses its full range: its largest element maps to +-127 (or 126 by rounding
    # against the bfloat16 scale)
    top = q.abs().amax(1)
    assert bool(((top >= 126) | (torch.arange(24) == 12)).all())
    err = (dequantize_rows(q, scale) - w).abs()
    assert bool((err <= scale.float()[:, None] / 2 * (1 + 1e-6)).all())
    assert float(err[12].max()) == 0


def test_stacked_weights_quantize_per_expert_and_row():
    w = torch.stack([weight(8, 16, seed=s) * (s + 1) for s in range(3)])  # [E, out, in]
    q, scale = quantize_rows(w)
    assert q.shape == w.shape and scale.shape == (3, 8)
    for e in range(3):
        qe, se = quantize_rows(w[e])
        assert torch.equal(q[e], qe) and torch.equal(scale[e], se)


def check_quantization_error(xd, q, scale, w, out, k) -> None:
    """The zero row gives zeros, and the dequantized weight's error against the float weight
    is the quantization error, bounded by sum_k |x_k| * scale_n / 2."""
    assert float(out[:, 18].abs().max()) == 0
    exact = xd @ dequantize_rows(q, scale).double().T
    quant_bound = xd.abs() @ (scale.double()[:, None] / 2).expand(w.shape[0], k).T
    assert bool(((exact - xd @ w.double().T).abs() <= quant_bound * (1 + 1e-6)).all())


MS = [1, 3, 7, quant.SMALL_M, quant.SMALL_M + 1, 70]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", [48, 24])  # 24: not a multiple of KERNEL_K, the GEMM path
def test_torch_path_equals_dequantized_weight_times_bf16_input(dtype, m, k, monkeypatch):
    """PyTorch's paths (M <= SMALL_M: _weight_int8pack_mm; above: chunked dequantize + GEMM,
    here in chunks of 5 rows) give x_bf16 @ (q * scale).T up to bfloat16 rounding of the
    output, so the int8 layer's error against the float layer is the dequantized weight's."""
    monkeypatch.setattr(quant, "CHUNK_ELEMENTS", 5 * k)  # 5 rows per chunk
    w = weight(37, k)
    q, scale = quantize_rows(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = bf16_int8_matmul(x, q, scale)
    assert out.dtype == dtype and out.shape == (m, 37)
    xb = x.to(torch.bfloat16).double()  # the path's input rounding
    exact = xb @ dequantize_rows(q, scale).double().T
    # bf16 outputs: at most one rounding of the float32 sum, plus (GEMM path) the scale
    # multiply's; a float32 model's output is rounded once
    kernel = m <= quant.SMALL_M and k % quant.KERNEL_K == 0
    ulps = 1 if dtype == torch.float32 or kernel else 2
    bound = ulps * BF16_ULP * exact.abs() + 1e-6 * exact.abs().max()
    assert bool(((out.double() - exact).abs() <= bound).all())
    check_quantization_error(xb, q, scale, w, out, k)


@pytest.mark.skipif(not native_int8.available(), reason="no native int8 kernel (AVX2) here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("k", [48, 53, 5])  # 53 and 5: a masked tail of K % 16 values
def test_native_kernel_equals_dequantized_weight_times_input(dtype, m, k):
    """The native kernel: float32 math on the input as given (bfloat16 widened exactly), so
    its output is x @ (q * scale).T to float32 rounding (bf16: one final rounding), every
    tile shape included (M % 4 rows, 37 = 6 x 6 + 1 outputs)."""
    w = weight(37, k)
    q, scale = quantize_rows(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    out = native_int8.int8_linear(x, q, scale)
    assert out is not None and out.dtype == dtype and out.shape == (m, 37)
    xd = x.double()
    exact = xd @ dequantize_rows(q, scale).double().T
    magnitude = xd.abs() @ dequantize_rows(q, scale).double().abs().T
    bound = 1e-6 * magnitude + (BF16_ULP * exact.abs() if dtype == torch.bfloat16 else 0)
    assert bool(((out.double() - exact).abs() <= bound).all())
    check_quantization_error(xd, q, scale, w, out, k)
    # the int8 layers' path: the chain's link for m rows (the kernel's tiles up to its rows;
    # past them AMX tiles, oneDNN's bfloat16 GEMM or PyTorch's dequantize + GEMM)
    run = quant.INT8_LINEAR.chain(x.device, x.dtype).for_rows(m)
    assert torch.equal(int8_matmul(x, q, scale), run(x, q, scale))
    if run is quant._native:
        assert torch.equal(int8_matmul(x, q, scale), out)
    strided = torch.randn(m, k + 7).to(dtype)[:, 3 : 3 + k]  # rows at a stride
    strided.copy_(x)
    assert torch.equal(native_int8.int8_linear(strided, q, scale), out)


def test_native_limits_follow_the_build():
    """AVX-512 builds: the measured SMALL_M / BF16_GEMM_M (fast bfloat16 GEMMs) or DEQUANT_M;
    an AVX2 build's kernel runs at every M (its own GEMM above 20 rows); without the kernel,
    PyTorch's paths at their limits."""
    from hybridkv.ops.native import cpu

    limits = quant.native_limits()
    if native_int8.available() and not cpu.record().supports("avx512"):
        assert limits[0] >= 2**31 and limits[1] >= 2**31
    else:  # float32 x leaves the kernel for oneDNN's bfloat16 GEMM where it is fast
        fast_bf16 = cpu.record().onednn_bf16
        assert limits == (quant.SMALL_M, quant.BF16_GEMM_M if fast_bf16 else quant.DEQUANT_M)


@pytest.mark.skipif(not native_int8.available(), reason="no native int8 kernel (AVX2) here")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_matmul_at_prefill_sizes(dtype):
    """Past DEQUANT_M rows (on AVX-512: oneDNN's bfloat16 GEMM where it is fast, else float32
    chunks; the kernel's GEMM on AVX2), an odd K: float32 math on the dequantized weight, but
    for bfloat16 x (PyTorch's path on AVX-512 above SMALL_M) and the bfloat16 GEMM (x and the
    output rounded to bfloat16)."""
    w = weight(37, 77)
    q, scale = quantize_rows(w)
    x = torch.randn(quant.DEQUANT_M + 5, 77, generator=torch.Generator().manual_seed(1))
    x = x.to(dtype)
    out = int8_matmul(x, q, scale)
    xd = x.double()
    exact = xd @ dequantize_rows(q, scale).double().T
    magnitude = xd.abs() @ dequantize_rows(q, scale).double().abs().T
    chain = quant.INT8_LINEAR.chain(x.device, x.dtype, ())
    run = chain.for_rows(x.shape[0])  # x rounded to bfloat16 on these paths
    in_bf16 = dtype == torch.bfloat16 or run in (bf16_gemm_int8_matmul, quant._native_amx)
    bound = 1e-6 * magnitude + (BF16_ULP * (magnitude + 2 * exact.abs()) if in_bf16 else 0)
    assert out.dtype == dtype
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_bf16_gemm_path_in_blocks(monkeypatch):
    """float32 prefill rows on oneDNN's bfloat16 GEMM: whole, or the weight converted a block of
    rows at a time (the lm_head's size), within bfloat16 rounding of x and of the output."""
    w = weight(50, 64)
    q, scale = quantize_rows(w)
    x = torch.randn(130, 64, generator=torch.Generator().manual_seed(2))
    exact = x.double() @ dequantize_rows(q, scale).double().T
    magnitude = x.double().abs() @ dequantize_rows(q, scale).double().abs().T
    bound = 1e-6 * magnitude + BF16_ULP * (magnitude + 2 * exact.abs())
    whole = bf16_gemm_int8_matmul(x, q, scale)
    monkeypatch.setattr(quant, "BF16_GEMM_ELEMENTS", 64 * 16)  # blocks of 16 of the 50 rows
    blocks = bf16_gemm_int8_matmul(x, q, scale)
    for out in (whole, blocks):
        assert out.dtype == torch.float32
        assert bool(((out.double() - exact).abs() <= bound).all())


def test_kernel_input_at_an_unaligned_offset_is_copied():
    """A bfloat16 x that views its storage at an offset the kernel's aligned loads cannot take
    (16 bytes past a 32-byte boundary) gives the same result as an aligned copy."""
    q, scale = quantize_rows(weight(20, 64))
    flat = torch.randn(8 + 3 * 64).to(torch.bfloat16)
    x = flat[8:].view(3, 64)  # 16 bytes into the storage
    assert x.data_ptr() % quant.KERNEL_ALIGN
    torch.testing.assert_close(bf16_int8_matmul(x, q, scale), bf16_int8_matmul(x.clone(), q, scale))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_keeps_the_float_bias_and_leading_dims(dtype):
    lin = nn.Linear(32, 20, bias=True).to(dtype)
    layer = Int8Linear.from_linear(lin)
    assert layer.bias is lin.bias and layer.bias.dtype == dtype
    x = torch.randn(2, 3, 32, dtype=dtype)
    with torch.no_grad():
        out = layer(x)
        ref = x.float() @ layer.dequantized_weight().T + lin.bias.float()
    assert out.shape == (2, 3, 20) and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)


class Tiny(nn.Module):
    """An embedding tied to `lm_head`, two projections, a router and a `dt_proj` (read as a
    weight by its module), a norm and a conv: only the projections and the head go int8."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 64)
        self.up = nn.Linear(64, 96, bias=True)
        self.down = nn.Linear(96, 64, bias=False)
        self.router = nn.Linear(64, 4, bias=False)
        self.dt_proj = nn.Linear(8, 64, bias=True)
        self.norm = nn.LayerNorm(64)
        self.conv = nn.Conv1d(64, 64, 3, groups=64)
        self.lm_head = nn.Linear(64, 50, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + self.down(torch.relu(self.up(self.norm(h))))
        return self.lm_head(h)


@pytest.mark.parametrize(("dtype", "ratio"), [(torch.float32, 4), (torch.bfloat16, 2)])
def test_quantize_model_swaps_keeps_and_frees(dtype, ratio):
    torch.manual_seed(0)
    model = Tiny().to(dtype).eval()
    ids = torch.randint(0, 50, (9,))
    with torch.no_grad():
        before = model(ids).float()
    report = quantize_model(model)
    assert set(report.quantized) == {"up", "down", "lm_head"}
    assert set(report.kept_float) == {"router", "dt_proj"}
    assert all(isinstance(getattr(model, n), Int8Linear) for n in ("up", "down", "lm_head"))
    assert type(model.router) is nn.Linear and type(model.dt_proj) is nn.Linear
    assert model.embed.weight.dtype == dtype and model.norm.weight.dtype == dtype
    # weights: [out, in] x 4 (fp32) or x 2 (bf16) bytes -> 1 byte + a 2-byte scale per row
    sizes = [(96, 64), (64, 96), (50, 64)]
    floats = sum(o * i for o, i in sizes) * ratio
    assert report.float_bytes == floats
    assert report.int8_bytes == sum(o * i + 2 * o for o, i in sizes)
    assert ratio * 0.95 < report.float_bytes / report.int8_bytes <= ratio
    # the tied head's float weight stays (the embedding looks it up): only up/down are freed
    assert report.freed_bytes == (96 * 64 + 64 * 96) * ratio
    assert {n for n, _ in model.named_parameters()} >= {"embed.weight", "up.bias"}
    assert "up.weight" not in dict(model.named_parameters())
    with torch.no_grad():
        after = model(ids).float()
    assert float((after - before).abs().max() / before.abs().max()) < 0.05


def test_lm_head_can_stay_float():
    model = Tiny().eval()
    report = quantize_model(model, lm_head=False)
    assert "lm_head" in report.kept_float and type(model.lm_head) is nn.Linear


@pytest.mark.skipif(not prepack_available(), reason="no oneDNN in this torch build")
def test_quantize_after_prepack_and_prepack_after_quantize_leave_int8_alone():
    model = Tiny().eval()
    assert prepack_linears(model) == 5
    assert isinstance(model.up, PackedLinear)
    report = quantize_model(model)
    assert isinstance(model.up, Int8Linear) and "up" in report.quantized
    assert prepack_linears(model) == 0  # the router and dt_proj are already packed
    assert isinstance(model.router, PackedLinear)
