"""The native router and experts of every build (moe.c's hkv_moe_route, hkv_moe_experts:
`ops.native.moe.vector_route`, `vector_experts`) against the PyTorch paths they replace, in
float32 and bfloat16: odd numbers of experts, k of 1, 2 and 8, hidden sizes that are not
multiples of 16, decode-sized batches. Also run under the AVX2 build and the plain C one
(HYBRIDKV_NATIVE_MARCH=x86-64-v3 / x86-64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.layers import mlp
from hybridkv.layers import moe as layer
from hybridkv.layers.moe import RoutingRule
from hybridkv.ops import native
from hybridkv.ops.native import moe

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library")

DTYPES = [torch.float32, torch.bfloat16]
RULES = {
    moe.TOPK_SOFTMAX: lambda k: RoutingRule(k, "topk_softmax"),
    moe.SOFTMAX_TOPK: lambda k: RoutingRule(k, "softmax"),
    moe.SOFTMAX_TOPK_RENORMALISED: lambda k: RoutingRule(k, "softmax", renormalise=True),
}
# (tokens, hidden, experts, k, intermediate)
SHAPES = [(1, 72, 9, 8, 40), (3, 100, 13, 2, 24), (17, 40, 7, 1, 17), (64, 33, 11, 2, 20)]


def _problem(tokens, hidden, num_experts, inter, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    gate = torch.randn(num_experts, hidden, generator=g).to(dtype)  # random logits: no ties
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(dtype)
    return x, gate, gate_up, down


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", list(RULES))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_route_matches_the_rule(shape, mode, dtype):
    """The same experts, in the same order, as the rule on the gate's logits (bfloat16: the
    logits rounded first, as gate(x)), and their weights within float32's rounding (bfloat16:
    the rule's rounded to bfloat16, within one rounding step)."""
    tokens, hidden, num_experts, k, _ = shape
    x, gate, _, _ = _problem(tokens, hidden, num_experts, 8, dtype, seed=tokens + mode)
    rule = RULES[mode](k)
    with torch.inference_mode():
        experts, weights = moe.vector_route(x, gate, k, mode)
        reference = rule(F.linear(x, gate))
    assert experts.dtype == torch.int64 and weights.dtype == dtype
    expected = reference.weights.to(dtype)
    if dtype == torch.float32:
        assert torch.equal(experts, reference.experts)
        torch.testing.assert_close(weights, expected, rtol=1e-6, atol=2e-6)
        return
    # bfloat16 logits tie often (8 bits of mantissa), and the kernel's sums may round a logit
    # to its neighbour: the tokens whose k-th and (k+1)-th logits are apart, as sets
    clear = _apart(F.linear(x, gate).float(), k)
    assert clear.float().mean() >= 0.75
    ours, order = experts[clear].sort(-1)
    theirs, their_order = reference.experts[clear].sort(-1)
    assert torch.equal(ours, theirs)
    torch.testing.assert_close(
        weights[clear].gather(1, order).float(),
        expected[clear].gather(1, their_order).float(), rtol=2**-7, atol=1e-6,
    )  # fmt: skip


def _apart(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: the token's k-th largest logit lies more than two bfloat16 steps above the
    next one (or there is none)."""
    if k == logits.shape[1]:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    top = logits.topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k] > 2 * 2**-7 * top[:, k - 1].abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_experts_match_the_pytorch_path(shape, dtype):
    """Every pair in one call: close to `torch_experts` (float32: summation order only;
    bfloat16: the per-expert loop's roundings, within bfloat16 of it)."""
    tokens, hidden, num_experts, k, inter = shape
    x, gate, gate_up, down = _problem(tokens, hidden, num_experts, inter, dtype, seed=tokens)
    with torch.inference_mode():
        experts, weights = moe.vector_route(x, gate, k, moe.TOPK_SOFTMAX)
        out = moe.vector_experts(x, experts, weights, gate_up, down)
        pairs = mlp.ExpertPairs(experts, weights, num_experts)
        expected = mlp.torch_experts(x, pairs, gate_up, down)
        looped = mlp._looped(x, pairs, gate_up, down, F.linear)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        scale = expected.float().abs().max()
        assert (out.float() - expected.float()).abs().max() <= 2**-7 * scale
        assert (out.float() - looped.float()).abs().max() <= 2**-7 * scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_experts_read_the_routing_from_their_tensors(dtype):
    """A captured step replays the call with the same tensors: new expert ids and weights
    written into them in place are what the next call computes with (expert 0 unused)."""
    x, _, gate_up, down = _problem(5, 24, 6, 8, dtype, seed=3)
    experts = torch.tensor([[1, 2]] * 5)
    weights = torch.full((5, 2), 0.5, dtype=dtype)
    with torch.inference_mode():
        first = moe.vector_experts(x, experts, weights, gate_up, down)
        experts.copy_(torch.tensor([[4, 5]] * 5))
        second = moe.vector_experts(x, experts, weights, gate_up, down)
        pairs = mlp.ExpertPairs(experts, weights, 6)
        expected = mlp._looped(x, pairs, gate_up, down, F.linear)
    assert not torch.equal(first, second)
    torch.testing.assert_close(second, expected, rtol=1e-5, atol=1e-5)


def test_out_of_range_experts_raise():
    x, _, gate_up, down = _problem(2, 16, 3, 8, torch.float32, seed=0)
    with torch.inference_mode(), pytest.raises(ValueError, match="expert ids"):
        moe.vector_experts(x, torch.tensor([[0], [3]]), torch.ones(2, 1), gate_up, down)


def test_declined_tensors():
    """None for what the kernels do not take (the chains then run PyTorch)."""
    x, gate, gate_up, down = _problem(3, 16, 5, 8, torch.float32, seed=1)
    experts, weights = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    with torch.inference_mode():
        assert moe.vector_route(x, gate.bfloat16(), 2, moe.SOFTMAX_TOPK) is None  # mixed dtypes
        assert moe.vector_route(x, gate, 6, moe.SOFTMAX_TOPK) is None  # k > E
        assert moe.vector_route(x.half(), gate.half(), 2, moe.SOFTMAX_TOPK) is None
        assert moe.vector_experts(x, experts, weights, gate_up.bfloat16(), down) is None
        assert moe.vector_experts(x, experts.int(), weights, gate_up, down) is None
        assert moe.vector_experts(x, experts, weights, gate_up.transpose(1, 2), down) is None
    assert moe.vector_experts(x, experts, weights, gate_up, down) is None  # autograd on


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_chains_take_the_native_kernels(dtype, monkeypatch):
    """On a CPU with AVX2 (and, for bfloat16, without AMX: its kernels come first) the layer
    functions run the native router and experts up to NATIVE_EXPERT_ROWS tokens, and agree
    with the PyTorch chains."""
    from hybridkv.ops.registry import capabilities

    if not {"native", "avx2"} <= capabilities("cpu"):
        pytest.skip("no AVX2 build: the chains are PyTorch's")
    monkeypatch.setattr(mlp, "amx_experts_fit", lambda *a, **k: False)
    monkeypatch.setattr(layer, "native_route_fits", lambda *a, **k: False)
    x, gate_weight, gate_up, down = _problem(17, 40, 9, 16, dtype, seed=7)
    gate = torch.nn.Linear(40, 9, bias=False).to(dtype)
    rule = RoutingRule(2, "topk_softmax")
    calls = []
    for name in ("vector_route", "vector_experts"):
        kernel = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    with torch.inference_mode():
        gate.weight.copy_(gate_weight)
        routing = layer.route(x, gate, rule)
        out = mlp.gated_experts(x, routing.experts, routing.weights, gate_up, down)
        pairs = mlp.ExpertPairs(routing.experts, routing.weights, 9)
        expected = mlp.torch_experts(x, pairs, gate_up, down)
    assert calls == ["vector_route", "vector_experts"]
    assert routing.weights.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_relu2_experts_match_the_pytorch_loop(shape, dtype):
    """Nemotron-H's experts (down relu(up x)^2, float32 routing weights, the weighted rows
    summed in float32 and rounded once) in one call: as `looped_experts` computes them
    (float32: summation order only; bfloat16: the products' roundings, within bfloat16)."""
    from hybridkv.layers.activation import relu2

    tokens, hidden, num_experts, k, inter = shape
    x, gate, gate_up, down = _problem(tokens, hidden, num_experts, inter, dtype, seed=tokens + 9)
    experts = layer.UngatedExperts(num_experts, hidden, inter, relu2).to(dtype)
    with torch.inference_mode():
        experts.up_proj.copy_(gate_up[:, :inter])
        experts.down_proj.copy_(down)
        routing = layer.Routing(
            *moe.vector_route(x, gate, k, moe.TOPK_SOFTMAX, None, torch.float32)
        )
        out = moe.vector_relu2_experts(x, *routing, experts.up_proj, experts.down_proj)
        expected = layer.torch_ungated(experts, x, routing)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    else:
        scale = expected.float().abs().max()
        assert (out.float() - expected.float()).abs().max() <= 2**-7 * scale


def test_relu2_experts_declined():
    """Other activations, bfloat16 routing weights or mixed dtypes stay on PyTorch."""
    from hybridkv.layers.activation import relu2

    x, _, _, _ = _problem(3, 16, 5, 8, torch.float32, seed=2)
    routing = layer.Routing(torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2))
    with torch.inference_mode():
        assert layer.relu2_experts_fit(layer.UngatedExperts(5, 16, 8, relu2), x, routing)
        assert not layer.relu2_experts_fit(layer.UngatedExperts(5, 16, 8, F.gelu), x, routing)
        half = layer.Routing(routing.experts, routing.weights.bfloat16())
        assert not layer.relu2_experts_fit(layer.UngatedExperts(5, 16, 8, relu2), x, half)
        bf16 = layer.UngatedExperts(5, 16, 8, relu2).bfloat16()
        assert not layer.relu2_experts_fit(bf16, x, routing)
        assert moe.vector_relu2_experts(x, *half, bf16.up_proj, bf16.down_proj) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_ungated_chain_takes_the_native_kernel(dtype, monkeypatch):
    """On a CPU with AVX2 UngatedExperts with relu2 runs the native kernel up to
    NATIVE_EXPERT_ROWS tokens, PyTorch's loop past them."""
    from hybridkv.layers.activation import relu2
    from hybridkv.ops.registry import capabilities

    if not {"native", "avx2"} <= capabilities("cpu"):
        pytest.skip("no AVX2 build: the chain is PyTorch's")
    calls = []
    kernel = moe.vector_relu2_experts
    monkeypatch.setattr(moe, "vector_relu2_experts", lambda *a: calls.append(1) or kernel(*a))
    experts = layer.UngatedExperts(6, 24, 16, relu2).to(dtype)
    torch.manual_seed(0)
    with torch.inference_mode():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape) * 0.2)
        for tokens in (5, mlp.NATIVE_EXPERT_ROWS + 1):
            x = torch.randn(tokens, 24).to(dtype)
            chosen = torch.randint(0, 6, (tokens, 2))
            routing = layer.Routing(chosen, torch.rand(tokens, 2))
            out = experts(x, routing)
            torch.testing.assert_close(out, layer.torch_ungated(experts, x, routing),
                                       rtol=2e-2, atol=2e-2)  # fmt: skip
    assert len(calls) == 1
