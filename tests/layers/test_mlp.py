import pytest
import torch
import torch.nn.functional as F

from hybridkv.layers.mlp import RMSNorm, silu_and_mul


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_the_definition(dtype, kernels):
    g = torch.Generator().manual_seed(0)
    # wide range: silu's two branches, saturation and values past exp's clamp at -87
    x = (torch.randn(3, 7, 2 * 40, generator=g) * 30).to(dtype)
    x[0, 0, 0], x[0, 0, 1] = -200.0, 200.0
    out = silu_and_mul(x)
    expected = F.silu(x[..., :40].double()) * x[..., 40:].double()
    assert out.dtype == dtype and out.shape == (3, 7, 40)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


def test_silu_and_mul_reads_strided_rows(kernels):
    g = torch.Generator().manual_seed(0)
    wide = torch.randn(6, 50, generator=g) * 5
    x = wide[:, 3:43]  # rows 50 floats apart
    torch.testing.assert_close(silu_and_mul(x), silu_and_mul(x.contiguous()), rtol=0, atol=0)
    torch.testing.assert_close(silu_and_mul(x), F.silu(x[:, :20]) * x[:, 20:], rtol=2e-6, atol=1e-6)


def test_rms_norm_add_forward_equals_add_then_forward(kernels):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(24, generator=g))
    x, h = torch.randn(2, 9, 24, generator=g), torch.randn(2, 9, 24, generator=g)
    total, normed = norm.add_forward(x, h, 0.5)
    torch.testing.assert_close(total, x + 0.5 * h, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(normed, norm(x + 0.5 * h), rtol=2e-6, atol=1e-6)
