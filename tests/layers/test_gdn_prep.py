"""Qwen3-Next's gated delta net between projections and conv1d natively (ops.native.gdn_prep):
the qkv and z rows and the gates equal the PyTorch path's (`GatedDeltaNet._project` and
`ops.gated_delta.gdn_gates`), float32 and bfloat16, odd head sizes, strided projection rows; the
layer takes it for the "qwen3_next" layout, and the gates alone for "qwen3_5"."""

from __future__ import annotations

import pytest
import torch

from hybridkv.layers.gated_delta_net import GatedDeltaNet, torch_gdn_prep
from hybridkv.ops import native
from hybridkv.ops.gated_delta import gdn_gates
from hybridkv.ops.native import gdn_prep


def needs_native() -> None:
    if native.library() is None:
        pytest.skip("native kernels unavailable here")


def _layer(hk, hv, kd, vd, dtype, seed=0):
    torch.manual_seed(seed)
    layer = GatedDeltaNet(48, hk, hv, kd, vd, 4, 1e-6, "qwen3_next")
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape) * 0.5)
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hk", "hv", "kd", "vd"), [(2, 4, 16, 8), (1, 3, 24, 40), (2, 2, 8, 8)])
def test_prep_equals_the_pytorch_path(hk, hv, kd, vd, dtype):
    needs_native()
    layer = _layer(hk, hv, kd, vd, dtype, seed=kd + vd)
    x = (torch.randn(11, 48) * 3).to(dtype)
    # a = large (softplus's linear branch above 20) and small, b = both signs
    with torch.inference_mode():
        qkv_ref, z_ref, b, a = layer._project(x)
        wide = torch.randn(11, layer.in_proj_qkvz.out_features + 5).to(dtype)
        wide[:, 2 : 2 + layer.in_proj_qkvz.out_features] = layer.in_proj_qkvz(x)
        qkvz = wide[:, 2 : 2 + layer.in_proj_qkvz.out_features]  # rows at a stride
        ba = layer.in_proj_ba(x)
        ba[0, 1 * (hv // hk)] = 30.0  # an `a`: softplus(30 + dt_bias) is linear there
        b, a = _split_ba(ba, hk, hv)
        g_ref, beta_ref = gdn_gates(a, b, layer.A_log, layer.dt_bias)
        decay, dt_bias = -torch.exp(layer.A_log.float()), layer.dt_bias.float()
        got = gdn_prep.prep(qkvz, ba, hk, hv // hk, kd, vd, decay, dt_bias)
    assert got is not None
    qkv, z, g, beta = got
    assert qkv.dtype == z.dtype == dtype and g.dtype == beta.dtype == torch.float32
    assert torch.equal(qkv, qkv_ref) and torch.equal(z, z_ref)
    torch.testing.assert_close(g, g_ref, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(beta, beta_ref, rtol=2e-6, atol=1e-7)


def _split_ba(ba, hk, hv):
    per = hv // hk
    grouped = ba.view(ba.shape[0], hk, 2 * per)
    b, a = grouped.split([per, per], dim=-1)
    return b.reshape(ba.shape[0], -1), a.reshape(ba.shape[0], -1)


def test_layer_takes_it_for_qwen3_next_and_qwen3_5(monkeypatch):
    """Qwen3-Next's layout: the whole preparation in one pass; Qwen3.5's: its projections,
    then the gates natively; OLMo Hybrid's (three projections concatenated): PyTorch."""
    needs_native()
    calls = []
    for name in ("prep", "gates"):
        real = getattr(gdn_prep, name)
        monkeypatch.setattr(gdn_prep, name, lambda *a, n=name, f=real: calls.append(n) or f(*a))
    x = torch.randn(3, 48)
    with torch.inference_mode():
        assert _layer(2, 4, 16, 8, torch.float32)._native_prep(x) is not None
        qwen3_5 = GatedDeltaNet(48, 2, 4, 16, 8, 4, 1e-6, "qwen3_5")
        got = qwen3_5._native_prep(x)
        assert got is not None
        for a, b in zip(got, torch_gdn_prep(qwen3_5, x), strict=True):
            torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
        olmo = GatedDeltaNet(48, 2, 4, 16, 8, 4, 1e-6, "olmo_hybrid")
        assert olmo._native_prep(x) is None
    assert calls == ["prep", "gates"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hv", [1, 5, 32])
def test_gates_equal_the_pytorch_path(hv, dtype):
    """Qwen3.5's gates from its own b and a projections (rows at a stride): PyTorch's
    `gdn_gates` to the last bits (the exps and log1p of C against PyTorch's vector ones),
    softplus's linear branch above 20 included."""
    needs_native()
    g = torch.Generator().manual_seed(hv)
    wide = (torch.randn(9, 2 * hv + 3, generator=g) * 4).to(dtype)
    b, a = wide[:, 1 : 1 + hv], wide[:, 2 + hv : 2 + 2 * hv]  # [9, hv] each, stride 2 hv + 3
    a[0, 0] = 30.0
    A_log, dt_bias = torch.randn(hv, generator=g), torch.randn(hv, generator=g)
    got = gdn_prep.gates(a, b, -torch.exp(A_log), dt_bias)
    assert got is not None
    g_ref, beta_ref = gdn_gates(a, b, A_log, dt_bias)
    torch.testing.assert_close(got[0], g_ref, rtol=2e-6, atol=1e-7)
    torch.testing.assert_close(got[1], beta_ref, rtol=2e-6, atol=1e-7)
    assert gdn_prep.gates(a, b.float() if dtype == torch.bfloat16 else b.double(),
                          -torch.exp(A_log), dt_bias) is None  # fmt: skip
    assert gdn_prep.gates(a, b, -torch.exp(A_log)[:-1], dt_bias[:-1]) is None


def test_declines_what_it_does_not_take():
    needs_native()
    layer = _layer(2, 4, 16, 8, torch.float32)
    x = torch.randn(3, 48)
    with torch.inference_mode():
        qkvz, ba = layer.in_proj_qkvz(x), layer.in_proj_ba(x)
    decay, dt = torch.ones(4), torch.ones(4)
    assert gdn_prep.prep(qkvz.half(), ba.half(), 2, 2, 16, 8, decay, dt) is None
    assert gdn_prep.prep(qkvz, ba.bfloat16(), 2, 2, 16, 8, decay, dt) is None
    assert gdn_prep.prep(qkvz[:, :-1], ba, 2, 2, 16, 8, decay, dt) is None
    assert gdn_prep.prep(qkvz, ba, 2, 2, 16, 8, decay[:3], dt) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_equals_pytorch(dtype):
    """Qwen3-Next's gated attention output gate: x * sigmoid(gate), the gate read in place from
    each head's [query | gate] projection; PyTorch's rounding (a last-bit difference at most,
    where the two exps differ)."""
    needs_native()
    t, heads, dim = 7, 3, 20
    g = torch.Generator().manual_seed(2)
    proj = (torch.randn(t, heads, 2 * dim, generator=g) * 4).to(dtype)
    _, gate = proj.chunk(2, dim=-1)
    x = torch.randn(t, heads * dim, generator=g).to(dtype)
    out = gdn_prep.sigmoid_gate(x, gate)
    ref = x * torch.sigmoid(gate.reshape(t, -1))
    assert out is not None and out.dtype == dtype
    diff = (out.float() - ref.float()).abs()
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert diff.max() <= tol * ref.float().abs().max()
    assert (diff == 0).float().mean() >= 0.9
    assert gdn_prep.sigmoid_gate(x[:, :-1], gate) is None
    assert gdn_prep.sigmoid_gate(x.half(), gate.half()) is None
