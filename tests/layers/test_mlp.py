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


def _expert_reference(x, experts, weights, gate_up, down):
    """Token by token, in float64: sum_j w_j * down_e (silu(g) * u), [g | u] = gate_up_e x."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].tolist(), strict=True):
            gu = gate_up[e].double() @ x[t].double()
            out[t] += w * (down[e].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


@pytest.mark.parametrize(
    "tokens,k,num_experts,skew",
    [
        (1, 2, 8, False),  # one decode token: 2 of 8 experts hit (padding all 8: looped)
        (24, 2, 8, False),  # decode batch: batched (padded) path
        (24, 3, 5, True),  # most pairs on expert 0: too much padding, looped path
        (300, 2, 8, False),  # prefill: more than BATCHED_EXPERT_ROWS per expert, looped
        (0, 2, 4, False),  # an empty step
    ],
)
def test_gated_experts_match_a_per_token_reference(tokens, k, num_experts, skew, kernels):
    from hybridkv.layers import mlp

    g = torch.Generator().manual_seed(tokens + k)
    hidden, inter = 24, 10
    x = torch.randn(tokens, hidden, generator=g)
    gate_up = torch.randn(num_experts, 2 * inter, hidden, generator=g) / 4
    down = torch.randn(num_experts, hidden, inter, generator=g) / 4
    scores = torch.rand(tokens, num_experts, generator=g)
    if skew:
        scores[:, 0] += 1.0  # every token picks expert 0 first
    weights, experts = scores.topk(k, dim=-1)
    out = mlp.gated_experts(x, experts, weights, gate_up, down)
    expected = _expert_reference(x, experts, weights, gate_up, down)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_gated_experts_batched_and_looped_paths_agree(monkeypatch):
    """The padded bmm and the per-expert loop compute the same sums (float32 rounding)."""
    from hybridkv.layers import mlp

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 32, generator=g)
    gate_up, down = torch.randn(6, 16, 32, generator=g), torch.randn(6, 32, 8, generator=g)
    weights, experts = torch.rand(40, 6, generator=g).topk(2, dim=-1)
    calls = []
    batched_path = mlp._experts_batched
    monkeypatch.setattr(mlp, "_experts_batched", lambda *a: calls.append(1) or batched_path(*a))
    batched = mlp.gated_experts(x, experts, weights, gate_up, down)
    assert calls, "40 tokens over 6 experts should take the batched path"
    monkeypatch.setattr(mlp, "BATCHED_EXPERT_ROWS", 0)
    looped = mlp.gated_experts(x, experts, weights, gate_up, down)
    torch.testing.assert_close(batched, looped, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 24, 300])  # decode (the native experts) and prefill
def test_gated_experts_bf16_match_the_reference(tokens, monkeypatch):
    """bfloat16 experts (the native experts kernel of every build for decode-sized batches,
    where the library loads) stay within bfloat16 rounding of the float64 per-token
    reference."""
    from hybridkv.layers import mlp
    from hybridkv.ops import registry
    from hybridkv.ops.native import cpu
    from hybridkv.ops.native import moe as native_moe

    # the CPU record afresh (an earlier test under HYBRIDKV_NATIVE=0 may have left one without
    # the native instruction sets, and the experts' chain follows it)
    cpu.record.cache_clear()
    registry.reset_all()

    calls = []
    kernel = native_moe.vector_experts
    monkeypatch.setattr(native_moe, "vector_experts", lambda *a: calls.append(1) or kernel(*a))
    # the paths of a CPU without AMX (tests/layers/test_moe_amx.py tests the AMX kernel)
    monkeypatch.setattr(mlp, "amx_experts_fit", lambda *a, **k: False)

    g = torch.Generator().manual_seed(tokens)
    hidden, inter, num_experts = 48, 16, 8
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / 4).bfloat16()
    down = (torch.randn(num_experts, hidden, inter, generator=g) / 4).bfloat16()
    weights, experts = torch.rand(tokens, num_experts, generator=g).topk(2, dim=-1)
    with torch.inference_mode():
        out = mlp.gated_experts(x, experts, weights.bfloat16(), gate_up, down)
    expected = _expert_reference(x, experts, weights.bfloat16().double(), gate_up, down)
    assert out.dtype == torch.bfloat16
    if "avx2" in registry.capabilities("cpu") and "native" in registry.capabilities("cpu"):
        assert bool(calls) == (tokens <= mlp.NATIVE_EXPERT_ROWS)  # (300 tokens: 2 * 300 / 8
        # pairs an expert, past NATIVE_EXPERT_ROWS)
    scale = expected.abs().max()
    assert (out.double() - expected).abs().max() <= 0.03 * scale
