import pytest
import torch
from torch import nn

from hybridkv.layers.linear import (
    _OPS,
    PackedLinear,
    prepack_available,
    prepack_dtypes,
    prepack_linears,
)
from hybridkv.ops.native import bf16_linear as native_bf16

pytestmark = pytest.mark.skipif(not prepack_available(), reason="no oneDNN in this torch build")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.proj = nn.Linear(16, 24, bias=True)
        self.head = nn.Linear(24, 50, bias=False)
        self.tied = nn.Linear(16, 50, bias=False)
        self.tied.weight = self.emb.weight

    def forward(self, ids):
        h = self.emb(ids)
        return self.head(self.proj(h)) + self.tied(h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_model_matches_and_keeps_names(dtype):
    torch.manual_seed(0)
    model = Tiny().to(dtype).eval()
    ids = torch.randint(0, 50, (7, 3))
    with torch.no_grad():
        before = model(ids).float()
    names = sorted(model.state_dict())
    if dtype not in prepack_dtypes():  # bf16 on a CPU without oneDNN bf16 (AVX2): unchanged
        assert prepack_linears(model) == 0
        assert not any(isinstance(m, PackedLinear) for m in model.modules())
        return
    assert prepack_linears(model) == 3
    assert all(isinstance(m, PackedLinear) for m in (model.proj, model.head, model.tied))
    assert sorted(model.state_dict()) == names
    assert model.tied.weight is model.emb.weight
    with torch.no_grad():
        after = model(ids).float()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(after, before, rtol=tol, atol=tol)


def test_refresh_after_weight_change():
    lin = nn.Linear(8, 4)
    packed = PackedLinear.from_linear(lin)
    with torch.no_grad():
        lin.weight.mul_(2)
    packed.refresh()
    x = torch.randn(3, 8)
    torch.testing.assert_close(packed(x), nn.functional.linear(x, lin.weight, lin.bias))


needs_bf16_kernel = pytest.mark.skipif(
    native_bf16.kernel() is None, reason="no native build with AVX512-BF16 on this machine"
)


def _onednn(packed: PackedLinear, x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, packed.in_features)
    out = _OPS._linear_pointwise(flat, packed.packed_weight, packed.bias, "none", [], "")
    return out.reshape(*x.shape[:-1], packed.out_features)


@needs_bf16_kernel
@pytest.mark.parametrize("bias", [True, False])
def test_bf16_small_batches_run_the_native_kernel(bias):
    """Up to SMALL_M rows a bfloat16 PackedLinear's output is the kernel's, bit for bit (2-D
    rows, strided rows and 3-D inputs); more rows, or autograd on, take oneDNN."""
    torch.manual_seed(0)
    lin = nn.Linear(100, 37, bias=bias).to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    assert packed.small_kernel is not None
    with torch.inference_mode():
        for m in range(1, native_bf16.SMALL_M + 2):
            wide = torch.randn(m, 107).to(torch.bfloat16)
            for x in (wide[:, :100].contiguous(), wide[:, 7:]):
                out = packed(x)
                if m <= native_bf16.SMALL_M:
                    assert torch.equal(out, native_bf16.bf16_linear(x, lin.weight, lin.bias))
                else:
                    assert torch.equal(out, _onednn(packed, x))
                torch.testing.assert_close(
                    out.float(), nn.functional.linear(x, lin.weight, lin.bias).float(),
                    rtol=2e-2, atol=2e-2,
                )  # fmt: skip
        x3 = torch.randn(2, 3, 100).to(torch.bfloat16)
        expect = native_bf16.bf16_linear(x3.reshape(6, 100), lin.weight, lin.bias)
        assert torch.equal(packed(x3), expect.reshape(2, 3, 37))
    x = torch.randn(2, 100).to(torch.bfloat16)
    with torch.enable_grad():
        assert torch.equal(packed(x), _onednn(packed, x))


@needs_bf16_kernel
def test_float32_and_disabled_native_keep_onednn(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    lin = nn.Linear(16, 8).to(torch.bfloat16)
    packed = PackedLinear.from_linear(lin)
    assert packed.small_kernel is None
    x = torch.randn(3, 16).to(torch.bfloat16)
    with torch.inference_mode():
        assert torch.equal(packed(x), _onednn(packed, x))
