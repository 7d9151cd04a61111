import pytest
import torch

from hybridkv.ops.norm import add_rms_norm, gated_rms_norm, rms_norm

DTYPES = [torch.float32, torch.bfloat16]


def assert_matches(out, expected, kernels):
    """Bit for bit on the PyTorch path; within float32 rounding on the native one, whose
    one-pass sums and silu round differently. In bfloat16 the native kernels round where
    PyTorch does, so a float32 difference can flip at most the last bfloat16 bit of a few
    values."""
    if kernels == "native" and out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=1e-6)
    elif kernels == "native":
        torch.testing.assert_close(out.float(), expected.float(), rtol=2**-7, atol=1e-6)
        assert (out == expected).float().mean() >= 0.9
    else:
        torch.testing.assert_close(out, expected, rtol=0, atol=0)


def inputs(dtype, channels=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 5, channels, generator=g) * 3).to(dtype)
    gate = torch.randn(2, 5, channels, generator=g).to(dtype)
    weight = (torch.randn(channels, generator=g) + 1).to(dtype)
    return x, gate, weight


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["bamba", "granitemoehybrid", "nemotron_h", "zamba2"])
@pytest.mark.parametrize("n_groups", [1, 3])
def test_gated_norm_matches_transformers(family, n_groups, dtype, kernels):
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    cls = {
        "bamba": "BambaRMSNormGated",
        "granitemoehybrid": "GraniteMoeHybridRMSNormGated",
        "nemotron_h": "NemotronHRMSNormGated",
        "zamba2": "Zamba2RMSNormGated",
    }[family]
    x, gate, weight = inputs(dtype)
    ref = getattr(module, cls)(12, group_size=12 // n_groups, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
        expected = ref(x, gate).to(dtype)
    out = gated_rms_norm(x, gate, weight, 1e-5, group_size=12 // n_groups)
    assert out.dtype == dtype
    assert_matches(out, expected, kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_norm_matches_falcon_h1(norm_before_gate, dtype, kernels):
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

    x, gate, weight = inputs(dtype)
    ref = FalconH1RMSNormGated(12, eps=1e-5, n_groups=2, norm_before_gate=norm_before_gate)
    ref = ref.to(dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
        expected = ref(x, gate)
    out = gated_rms_norm(
        x, gate, weight, 1e-5, 6, norm_before_gate=norm_before_gate, weight_in_fp32=True
    )
    assert_matches(out, expected, kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["bamba", "nemotron_h"])
def test_rms_norm_matches_transformers(family, dtype, kernels):
    from transformers.models.bamba.modeling_bamba import BambaRMSNorm
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

    cls = {"bamba": BambaRMSNorm, "nemotron_h": NemotronHRMSNorm}[family]
    x, _, weight = inputs(dtype)
    ref = cls(12, eps=1e-6).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(weight)
        expected = ref(x)
    out = rms_norm(x, weight, 1e-6, weight_in_fp32=family == "nemotron_h")
    assert out.dtype == dtype
    assert_matches(out, expected, kernels)


def test_gate_none_is_plain_grouped_norm():
    x, _, weight = inputs(torch.float32)
    out = gated_rms_norm(x, None, weight, 1e-6, group_size=12)
    torch.testing.assert_close(out, rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("multiplier", [1.0, 0.25])
def test_add_rms_norm_is_the_add_then_the_norm(multiplier, dtype, kernels):
    x, h, weight = inputs(dtype)
    total, normed = add_rms_norm(x, h, multiplier, weight, 1e-6)
    expected = x + h * multiplier
    assert_matches(total, expected, kernels)
    assert_matches(normed, rms_norm(expected, weight, 1e-6), kernels)


def test_native_gated_norm_reads_strided_gate_rows(kernels):
    """The mixer's gate is a column slice of in_proj's output: rows strided, not contiguous."""
    x, _, weight = inputs(torch.float32)
    g = torch.Generator().manual_seed(1)
    projected = torch.randn(2, 5, 40, generator=g) * 4  # [..., z (12) | other columns]
    gate = projected[..., 7:19]
    assert not gate.is_contiguous()
    out = gated_rms_norm(x, gate, weight, 1e-5, group_size=4)
    expected = gated_rms_norm(x.double(), gate.double(), weight.double(), 1e-5, group_size=4)
    torch.testing.assert_close(out, expected.float(), rtol=2e-6, atol=1e-6)
