"""gpt-oss's MoE on the native kernels of every build (moe.c's hkv_moe_route with a gate bias
and bfloat16 topk_softmax scores, hkv_moe_experts' clamped SwiGLU mode with expert biases)
against the PyTorch paths they replace (`layers.moe.torch_route`, `torch_clamped`: transformers'
GptOssTopKRouter and GptOssExperts), in float32 and bfloat16: odd sizes, active and inactive
clamps, experts no token chooses, ties in the top-k. Also run under the AVX2 build and the
plain C one (HYBRIDKV_NATIVE_MARCH=x86-64-v3 / x86-64)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.layers import mlp
from hybridkv.layers import moe as layer
from hybridkv.layers.moe import ClampedSwigluExperts, Router, Routing, RoutingRule
from hybridkv.ops import native
from hybridkv.ops.native import moe

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library")

DTYPES = [torch.float32, torch.bfloat16]
# (tokens, hidden, experts, k, intermediate, limit): limit 0.3 clamps most values, 7 few
SHAPES = [
    (1, 64, 4, 2, 48, 7.0),
    (3, 48, 5, 3, 40, 0.3),
    (2, 33, 9, 1, 17, 0.3),  # 7 of 9 experts chosen by no token at least
    (17, 40, 7, 7, 24, 1.0),  # k = E
    (64, 72, 13, 4, 20, 7.0),
]


def _gpt_oss(hidden, num_experts, k, inter, limit, dtype, seed):
    """A gpt-oss router and experts with random weights and biases, and x [T, H]."""
    g = torch.Generator().manual_seed(seed)
    router = Router(hidden, num_experts, RoutingRule(k, "topk_softmax", float32=False), bias=True)
    experts = ClampedSwigluExperts(num_experts, hidden, inter, 1.702, limit)
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=g) / hidden**0.5)
        router.bias.copy_(torch.randn(num_experts, generator=g) * 0.5)
        experts.gate_up_proj.copy_(torch.randn(experts.gate_up_proj.shape, generator=g) * 0.2)
        experts.gate_up_proj_bias.copy_(torch.randn(num_experts, 2 * inter, generator=g) * 0.5)
        experts.down_proj.copy_(torch.randn(experts.down_proj.shape, generator=g) * 0.2)
        experts.down_proj_bias.copy_(torch.randn(num_experts, hidden, generator=g) * 0.5)
    return router.to(dtype), experts.to(dtype), g


def _x(tokens, hidden, dtype, g):
    return (torch.randn(tokens, hidden, generator=g) * 2).to(dtype)


def _apart(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[T] bool: the k-th largest logit more than two bfloat16 steps above the next (or none)."""
    if k == logits.shape[1]:
        return torch.ones(logits.shape[0], dtype=torch.bool)
    top = logits.float().topk(k + 1, dim=-1).values
    return top[:, k - 1] - top[:, k] > 2 * 2**-7 * top[:, k - 1].abs()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_router_with_bias_matches_pytorch(shape, dtype):
    """The biased gate's logits, top-k and softmax of those k in one call: the same experts in
    the same order as the PyTorch router (bfloat16: as sets, for the tokens whose k-th logit is
    clear of the next; the kernel's sums may round a logit to its neighbour), weights within
    float32's rounding (bfloat16: one bfloat16 step)."""
    tokens, hidden, num_experts, k, inter, limit = shape
    router, _, g = _gpt_oss(hidden, num_experts, k, inter, limit, dtype, seed=tokens)
    x = _x(tokens, hidden, dtype, g)
    with torch.inference_mode():
        assert layer.vector_route_fits(x, router, router.rule)
        ours = layer._vector_route(x, router, router.rule, None, None)
        theirs = layer.torch_route(x, router, router.rule, None)
        logits = router.logits(x)
    assert ours.weights.dtype == theirs.weights.dtype == dtype
    if dtype == torch.float32:
        assert torch.equal(ours.experts, theirs.experts)
        torch.testing.assert_close(ours.weights, theirs.weights, rtol=1e-6, atol=2e-6)
        return
    # (bfloat16 logits tie often: the chosen sets, and each expert's weight)
    clear = _apart(logits, k)
    assert clear.float().mean() >= 0.6
    mine, order = ours.experts[clear].sort(-1)
    expected, their_order = theirs.experts[clear].sort(-1)
    assert torch.equal(mine, expected)
    torch.testing.assert_close(
        ours.weights[clear].gather(1, order).float(),
        theirs.weights[clear].gather(1, their_order).float(), rtol=2**-7, atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_router_ties(dtype):
    """Tied logits (a zero gate: the logits are the bias): the kernel takes the lower expert
    among equals, largest first; the chosen logits and the weights are PyTorch's (whose topk
    breaks ties in no set order)."""
    num_experts, k = 6, 3
    router = Router(8, num_experts, RoutingRule(k, "topk_softmax", float32=False), bias=True)
    with torch.no_grad():
        router.bias.copy_(torch.tensor([0.5, 1.0, 1.0, 0.25, 1.0, 0.5]))
    router = router.to(dtype)
    x = torch.randn(4, 8).to(dtype)
    with torch.inference_mode():
        ours = layer._vector_route(x, router, router.rule, None, None)
        theirs = layer.torch_route(x, router, router.rule, None)
    assert ours.experts.tolist() == [[1, 2, 4]] * 4
    bias = router.bias.detach()
    assert torch.equal(bias[ours.experts], bias[theirs.experts])
    assert torch.equal(ours.weights, theirs.weights)
    k2 = RoutingRule(4, "topk_softmax", float32=False)  # 1, 2, 4 tie; then 0 before 5
    with torch.inference_mode():
        ours = layer._vector_route(x, router, k2, None, None)
    assert ours.experts.tolist() == [[1, 2, 4, 0]] * 4


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_clamped_experts_match_the_pytorch_loop(shape, dtype):
    """Every pair in one call: as `looped_experts` computes gpt-oss's experts (float32:
    summation order only; bfloat16: every bias addition and activation step rounded as
    PyTorch's ops, the products' sums in another order: within a bfloat16 step, and most
    values bit-equal)."""
    tokens, hidden, num_experts, k, inter, limit = shape
    router, experts, g = _gpt_oss(hidden, num_experts, k, inter, limit, dtype, seed=tokens + 1)
    x = _x(tokens, hidden, dtype, g)
    with torch.inference_mode():
        routing = layer.torch_route(x, router, router.rule, None)
        assert layer.clamped_experts_fit(experts, x, routing)
        out = layer._vector_clamped(experts, x, routing)
        expected = layer.torch_clamped(experts, x, routing)
    assert out.shape == x.shape and out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        return
    scale = expected.float().abs().max()
    assert (out.float() - expected.float()).abs().max() <= 2**-7 * scale
    assert (out == expected).float().mean() >= 0.9


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_clamps_and_biases_count(dtype):
    """The activation's clamps, the up + 1 and both biases change the output: the kernel
    follows the reference when each of them is active (a limit below most values)."""
    router, experts, g = _gpt_oss(24, 3, 2, 8, 0.05, dtype, seed=11)
    x = _x(5, 24, dtype, g)
    with torch.inference_mode():
        routing = layer.torch_route(x, router, router.rule, None)
        clamped = layer._vector_clamped(experts, x, routing)
        experts.limit = 100.0
        loose = layer._vector_clamped(experts, x, routing)
        expected = layer.torch_clamped(experts, x, routing)
        experts.down_proj_bias.zero_()
        no_bias = layer._vector_clamped(experts, x, routing)
    assert not torch.equal(clamped, loose) and not torch.equal(loose, no_bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(loose, expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_clamped_experts_read_the_routing_from_their_tensors(dtype):
    """A captured step replays the call with the same tensors: expert ids and weights written
    into them in place are what the next call computes with; the weights are read in place, so
    an in-place write to them is what the next call computes with too."""
    router, experts, g = _gpt_oss(16, 6, 2, 8, 0.5, dtype, seed=4)
    x = _x(5, 16, dtype, g)
    chosen = torch.tensor([[1, 2]] * 5)
    weights = torch.full((5, 2), 0.5, dtype=dtype)
    with torch.inference_mode():
        first = layer._vector_clamped(experts, x, Routing(chosen, weights))
        chosen.copy_(torch.tensor([[4, 5]] * 5))
        second = layer._vector_clamped(experts, x, Routing(chosen, weights))
        expected = layer.torch_clamped(experts, x, Routing(chosen, weights))
    assert not torch.equal(first, second)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(second, expected, rtol=tol, atol=tol)
    with torch.no_grad():
        experts.gate_up_proj.mul_(-1)
    with torch.inference_mode():
        third = layer._vector_clamped(experts, x, Routing(chosen, weights))
        expected = layer.torch_clamped(experts, x, Routing(chosen, weights))
    torch.testing.assert_close(third, expected, rtol=tol, atol=tol)


def test_out_of_range_experts_raise():
    _, experts, g = _gpt_oss(16, 3, 1, 8, 7.0, torch.float32, seed=0)
    x = _x(2, 16, torch.float32, g)
    with torch.inference_mode(), pytest.raises(ValueError, match="expert ids"):
        layer._vector_clamped(experts, x, Routing(torch.tensor([[0], [3]]), torch.ones(2, 1)))


def test_declined_tensors():
    """None (or fits False) for what the kernels do not take: the chains then run PyTorch."""
    router, experts, g = _gpt_oss(16, 4, 2, 8, 7.0, torch.float32, seed=1)
    x = _x(3, 16, torch.float32, g)
    chosen, weights = torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    gate_up, gate_up_bias, down, down_bias = experts.native_weights()
    kernel = moe.vector_clamped_experts
    with torch.inference_mode():
        assert layer.clamped_experts_fit(experts, x, Routing(chosen, weights))
        assert not layer.clamped_experts_fit(experts, x, Routing(chosen, weights.bfloat16()))
        assert not layer.clamped_experts_fit(experts, x, Routing(chosen.int(), weights))
        assert not layer.clamped_experts_fit(experts, x.bfloat16(), Routing(chosen, weights))
        args = (chosen, weights, gate_up, gate_up_bias, down, down_bias, 1.702, 7.0)
        assert kernel(x, *args) is not None
        assert kernel(x, chosen, weights, gate_up, gate_up_bias[:, :-1], down, down_bias,
                      1.702, 7.0) is None  # fmt: skip
        assert kernel(x, chosen, weights, gate_up, gate_up_bias, down, down_bias[:-1],
                      1.702, 7.0) is None  # fmt: skip
        assert kernel(x, chosen, weights, gate_up, gate_up_bias.bfloat16(), down, down_bias,
                      1.702, 7.0) is None  # fmt: skip
        bias = torch.zeros(4, dtype=torch.bfloat16)
        assert moe.vector_route(x, router.weight, 2, moe.TOPK_SOFTMAX, gate_bias=bias) is None
        rule = moe.NativeRule(moe.SOFTMAX_TOPK, bf16_scores=True)  # softmax in bfloat16: no
        assert moe.vector_route(x.bfloat16(), router.weight.bfloat16(), 2, rule) is None
    assert kernel(x, *args) is None  # autograd on
    assert not layer.clamped_experts_fit(experts, x, Routing(chosen, weights))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gpt_oss_moe_takes_the_native_chains(dtype, monkeypatch):
    """On a CPU with AVX2 gpt-oss's router and experts run their native kernels up to
    NATIVE_EXPERT_ROWS tokens, PyTorch's loop past them, and both agree."""
    from hybridkv.ops.registry import capabilities

    if not {"native", "avx2"} <= capabilities("cpu"):
        pytest.skip("no AVX2 build: the chains are PyTorch's")
    router, experts, g = _gpt_oss(40, 9, 2, 16, 0.5, dtype, seed=7)
    x = _x(17, 40, dtype, g)
    calls = []
    for name in ("vector_route", "vector_clamped_experts"):
        kernel = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, _k=kernel, _n=name: calls.append(_n) or _k(*a))
    with torch.inference_mode():
        out = experts(x, router(x))
        assert calls == ["vector_route", "vector_clamped_experts"]
        monkeypatch.setattr(mlp, "NATIVE_EXPERT_ROWS", 16)  # 17 tokens: PyTorch's loop
        looped = experts(x, router(x))
    assert calls == ["vector_route", "vector_clamped_experts", "vector_route"]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, looped, rtol=tol, atol=tol)


def test_the_native_experts_read_the_checkpoint_layout_in_place():
    """No second copy of the experts (gpt-oss-20b's are most of its 21B parameters): the kernel
    reads gate_up [E, H, 2I] (gate and up interleaved) and down [E, I, H] as stored, and agrees
    with PyTorch on them, also for an intermediate size past one column tile of the kernel."""
    _, experts, g = _gpt_oss(16, 3, 1, 300, 7.0, torch.float32, seed=5)
    gate_up, _, down, _ = experts.native_weights()
    assert gate_up is experts.gate_up_proj and down is experts.down_proj
    x = _x(3, 16, torch.float32, g)
    routing = Routing(torch.tensor([[0], [2], [0]]), torch.ones(3, 1))
    with torch.inference_mode():
        native = layer._vector_clamped(experts, x, routing)
        expected = layer.torch_clamped(experts, x, routing)
    torch.testing.assert_close(native, expected, rtol=1e-5, atol=1e-5)
