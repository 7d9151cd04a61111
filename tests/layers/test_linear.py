import pytest
import torch
from torch import nn

from hybridkv.layers.linear import PackedLinear, prepack_available, prepack_linears

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
