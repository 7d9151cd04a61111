"""The element-wise kernels (hybridkv.ops.native.elementwise) against the PyTorch expressions
they replace: the same values, rounded where PyTorch rounds."""

import math

import pytest
import torch

from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.ops import native
from hybridkv.ops.elementwise import logits_float32, residual_add
from hybridkv.ops.native import elementwise as ew
from hybridkv.ops.native import elementwise as native_ew
from tests.ops.test_native import needs_compiler

pytestmark = needs_compiler
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.37, 12.0])
def test_embedding_is_the_lookup_times_the_scale(dtype, scale):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 37, generator=g).to(dtype)
    ids = torch.tensor([3, 0, 49, 3, 17])
    want = torch.nn.functional.embedding(ids, table)
    want = want if scale == 1.0 else want * scale
    assert torch.equal(ew.embedding(ids, table, scale), want)


def test_embedding_refuses_ids_outside_the_table():
    with pytest.raises(IndexError, match="50 rows"):
        ew.embedding(torch.tensor([1, 50]), torch.randn(50, 4))
    with pytest.raises(IndexError):
        ew.embedding(torch.tensor([-1]), torch.randn(50, 4))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mult", [1.0, 0.37, -2.5])
def test_residual_add_rounds_as_pytorch(dtype, mult):
    g = torch.Generator().manual_seed(1)
    x, h = (torch.randn(5, 1000, generator=g).to(dtype) for _ in range(2))
    want = x + h if mult == 1.0 else x + h * mult
    assert torch.equal(ew.add_scaled(x, h, mult), want)
    assert torch.equal(residual_add(x, h, mult), want)


def test_residual_add_of_many_rows_runs_in_parallel_and_agrees():
    x, h = torch.randn(64, 4096), torch.randn(64, 4096)
    assert torch.equal(ew.add_scaled(x, h, 0.5), x + h * 0.5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1.0, 8.0, 0.3])
def test_logits_float32(dtype, divisor):
    x = torch.randn(3, 1001).to(dtype)
    want = x.float() if divisor == 1.0 else x.float() / divisor
    assert torch.equal(ew.logits_f32(x, divisor), want)
    assert torch.equal(logits_float32(x, divisor), want)
    strided = torch.randn(3, 2000).to(dtype)[:, :1001]
    assert torch.equal(ew.logits_f32(strided, divisor), strided.float() / divisor)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divisor", [1.0, 0.3])
@pytest.mark.parametrize("softcap", [30.0, 0.75, -2.0])
def test_soft_capped_logits(dtype, divisor, softcap):
    """Gemma's final logit soft-capping, tanh(x / c) * c in x's dtype, then float32 / divisor:
    PyTorch's values (bfloat16: each of the three steps rounded; the tanh within float32's
    rounding of PyTorch's, so within one bfloat16 step and mostly bit-equal), an odd row length
    and a strided view; values far past the cap saturate at +-c."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 1001, generator=g) * 20).to(dtype)
    x[0, :4] = torch.tensor([1e4, -1e4, 0.0, float("inf")]).to(dtype)
    strided = (torch.randn(2, 2003, generator=g) * 5).to(dtype)[:, :1001]
    for rows in (x, strided):
        want = (torch.tanh(rows / softcap) * softcap).float() / divisor
        got = ew.logits_f32(rows, divisor, softcap)
        assert got.dtype == torch.float32 and got.shape == rows.shape
        assert torch.equal(logits_float32(rows, divisor, softcap), got)
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
        else:
            step = 2**-7 * abs(softcap) / divisor
            assert (got - want).abs().max() <= step
            assert (got == want).float().mean() >= 0.97
    cap = (torch.tensor([1.0, -1.0, 0.0, 1.0]) * abs(softcap)).to(dtype).float() / divisor
    assert torch.equal(ew.logits_f32(x, divisor, softcap)[0, :4], cap)
    assert ew.logits_f32(x, divisor, 0.0) is None  # (no cap of 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_soft_capped_logits_do_not_depend_on_where_a_value_lies(dtype):
    """The soft-cap's vector lanes and its scalar tail give the same bits: the same values one
    column later (every value moves between a vector and the tail or between lanes), across
    the polynomial's boundary |x / c| = 0.3 and far past the cap."""
    g = torch.Generator().manual_seed(5)
    far = torch.tensor([1e3, -1e3, 95.0, -95.0, 0.0, -0.0])
    values = torch.cat([torch.randn(200, generator=g) * 9, torch.linspace(-12, 12, 97), far])
    x = torch.zeros(2, values.numel() + 1, dtype=dtype)
    x[0, :-1] = values.to(dtype)
    x[1, 1:] = values.to(dtype)
    got = ew.logits_f32(x, 0.7, 30.0)
    assert torch.equal(got[0, :-1], got[1, 1:])


def test_soft_capped_logits_of_a_large_vocabulary_run_in_parallel_and_agree():
    x = torch.randn(1, 262144) * 40
    want = torch.tanh(x / 30.0) * 30.0
    torch.testing.assert_close(ew.logits_f32(x, 1.0, 30.0), want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("scaling", [1.0, 1.2])
def test_rope_cos_sin_against_float64(dtype, scaling):
    positions = torch.tensor([0, 1, 7, 63, 4095, 131071])
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    cos, sin = ew.rope_cos_sin(positions, inv_freq, scaling, dtype)
    angles = positions.float()[:, None] * inv_freq[None, :]  # float32 angles, as PyTorch
    emb = torch.cat([angles, angles], dim=-1).double()
    tol = 2e-7 if dtype == torch.float32 else 2**-8  # float32 cos/sin, or one bf16 step
    torch.testing.assert_close(cos.double(), emb.cos() * scaling, rtol=tol, atol=tol)
    torch.testing.assert_close(sin.double(), emb.sin() * scaling, rtol=tol, atol=tol)
    assert cos.dtype == dtype and cos.shape == (6, 64)


def test_rotary_embedding_uses_the_kernel_and_matches_pytorch():
    rope = RotaryEmbedding(32, {"rope_type": "default", "rope_theta": 10000.0})
    positions = torch.arange(0, 300, 7)
    cos, sin = rope.cos_sin(positions, torch.float32)
    freqs = positions.float()[:, None] * rope.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    torch.testing.assert_close(cos, emb.cos(), rtol=0, atol=3e-7)
    torch.testing.assert_close(sin, emb.sin(), rtol=0, atol=3e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_of_separate_projections(dtype):
    gate, up = torch.randn(3, 300).to(dtype), torch.randn(3, 300).to(dtype)
    out = native_ew.silu_mul(gate, up)
    want = torch.nn.functional.silu(gate) * up
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, want, rtol=tol, atol=tol)
    fused = torch.cat([gate, up], dim=-1)
    assert torch.equal(native_ew.silu_and_mul(fused), out)  # the same kernel either way


def test_unsupported_inputs_are_left_to_pytorch():
    assert ew.embedding(torch.tensor([1], dtype=torch.int32), torch.randn(4, 4)) is None
    assert ew.add_scaled(torch.randn(4), torch.randn(5)) is None
    assert ew.add_scaled(torch.randn(4).half(), torch.randn(4).half()) is None
    assert ew.rope_cos_sin(torch.tensor([1]), torch.ones(4).double(), 1.0, torch.float32) is None
    x = torch.randn(2, 3)
    assert ew.logits_f32(x) is x  # float32, nothing to divide: the tensor itself
    assert math.isfinite(float(residual_add(torch.ones(2).half(), torch.ones(2).half())[0]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2_rounds_as_pytorch(dtype):
    x = torch.randn(7, 333).to(dtype)
    assert torch.equal(ew.relu2(x), torch.nn.functional.relu(x).square())


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu2_keeps_nan_as_pytorch(dtype):
    """F.relu keeps a NaN (and the square of it is NaN): the kernel gave 0 for it."""
    x = torch.tensor([float("nan"), -1.0, 0.0, 2.5, float("inf"), -float("inf"), -0.0] * 3)
    x = x.to(dtype).reshape(3, 7)
    got, want = ew.relu2(x), torch.nn.functional.relu(x).square()
    assert got.isnan().sum() == 3
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
def test_mul_of_projection_slices(dtype):
    proj = torch.randn(4, 30).to(dtype)
    a, b = proj[:, :10], proj[:, 20:]  # column slices: strided rows
    assert torch.equal(ew.mul(a, b, dtype), a * b)
    conv = torch.randn(4, 10)  # a float32 kernel result times a model-dtype gate
    assert torch.equal(ew.mul(a, conv, dtype), a * conv.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_mul(dtype):
    proj = torch.randn(3, 80).to(dtype) * 3
    gate, up = proj[:, :40], proj[:, 40:]
    want = torch.nn.functional.gelu(gate, approximate="tanh") * up
    tol = 2e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(ew.gelu_tanh_mul(gate, up), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_concat_is_torch_cat_bit_for_bit(dtype):
    """[a | b] per row (an MTP layer's input), strided rows too; the op family's choice."""
    from hybridkv.ops.elementwise import CONCAT, concat

    x = torch.randn(5, 48).to(dtype)
    x[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    a, b = x[:, :16], x[:, 20:44]  # column slices: strided rows
    want = torch.cat([a, b], dim=-1)
    got = ew.concat_rows(a, b)
    assert got is not None and got.is_contiguous() and got.dtype == dtype
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))
    assert torch.equal(concat(a, b).nan_to_num(), want.nan_to_num())
    assert CONCAT.of(a).describe() == "native"
    assert ew.concat_rows(a, b.to(torch.float16)) is None  # (one dtype)
    assert ew.concat_rows(a, b[:3]) is None  # (the same rows)


def test_to_bfloat16_rounds_as_torch():
    """Nearest even, ties, denormals, infinities and NaN as x.to(torch.bfloat16); strided x is
    declined (the caller's .to then)."""
    if native.library() is None:
        pytest.skip("no native kernels here")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 77, generator=g) * torch.logspace(-40, 38, 77)
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-45])
    x[1, :3] = torch.tensor([1.00390625, 1.01171875, -1.00390625])  # halfway: to even
    out = ew.to_bfloat16(x)
    assert out is not None and out.dtype == torch.bfloat16
    ref = x.to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16)[~ref.isnan()], ref.view(torch.int16)[~ref.isnan()])
    assert out.isnan().equal(ref.isnan())
    assert ew.to_bfloat16(x[:, ::2]) is None and ew.to_bfloat16(x.bfloat16()) is None
