"""The native router of every build (moe.c's hkv_moe_route through `layers.moe._vector_route`)
on the sigmoid and grouped rules against `RoutingRule` (PyTorch): DeepSeek-V3 / Kimi-Linear
(grouped by top2_sum, a choice bias, renormalised with eps 1e-20, scaled; a Router: float32
logits from a bfloat16 model), Nemotron-H (the same rule, a float32 Router in a bfloat16
model), LFM2-MoE (no groups, an expert bias, eps 1e-6, scores in the model dtype through an
nn.Linear gate) and DeepSeek-V2 (softmax, groups by their best, scaled). Float32 and bfloat16;
odd numbers of experts in equal groups; k of 1, 2, 6 and 8; 1, 3, 17 and 64 tokens. Experts
are compared on the tokens whose choice is clear (the kept groups and the k-th / (k+1)-th
choice apart); weights to a tolerance. Also run under the AVX2 and plain C builds."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.layers import moe as layer
from hybridkv.layers.moe import Router, RoutingRule
from hybridkv.ops import native
from hybridkv.ops.native import moe

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native library")

DTYPES = [torch.float32, torch.bfloat16]
# (tokens, hidden, experts, groups, kept groups, k)
SHAPES = [
    (1, 72, 15, 3, 2, 6), (3, 100, 21, 7, 3, 8), (17, 40, 9, 3, 1, 1), (64, 33, 27, 9, 4, 2),
    (64, 48, 33, 3, 2, 8), (3, 24, 8, 4, 2, 2),
]  # fmt: skip


def deepseek_v3(k: int, groups: int, kept: int) -> RoutingRule:
    """DeepSeek-V3, Kimi-Linear and Nemotron-H (norm_topk_prob, routed_scaling_factor 2.5)."""
    return RoutingRule(
        k, "sigmoid", True, renormalise_eps=1e-20, scaling=2.5, groups=groups,
        groups_kept=kept, group_score="top2_sum", sorted=False,
    )  # fmt: skip


def deepseek_v2(k: int, groups: int, kept: int) -> RoutingRule:
    return RoutingRule(
        k, "softmax", scaling=16.0, groups=groups, groups_kept=kept, group_score="max",
        sorted=False,
    )  # fmt: skip


def lfm2(k: int, renormalise: bool = True) -> RoutingRule:
    return RoutingRule(
        k, "sigmoid", renormalise, renormalise_eps=1e-6, scaling=1.5 if renormalise else 2.5,
        float32=False,
    )  # fmt: skip


def _router(shape, dtype, rule, *, keep_float32=False, correction=True, seed=0) -> Router:
    tokens, hidden, num_experts, *_ = shape
    g = torch.Generator().manual_seed(seed)
    router = Router(hidden, num_experts, rule, correction_bias=correction,
                    keep_float32=keep_float32)  # fmt: skip
    with torch.no_grad():
        router.weight.copy_(torch.randn(num_experts, hidden, generator=g) / hidden**0.5 * 3)
        if correction:
            router.e_score_correction_bias.copy_(torch.randn(num_experts, generator=g) * 0.05)
    return router.to(dtype)


def _x(shape, dtype, seed=1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape[0], shape[1], generator=g).to(dtype)


def _clear(logits: torch.Tensor, rule: RoutingRule, bias: torch.Tensor | None, margin: float):
    """[T] bool: tokens whose kept groups and chosen experts are apart from the next ones by
    more than `margin` (their choice scores computed in float64 from the same logits)."""
    logits = logits.double()
    scores = logits.sigmoid() if rule.scoring == "sigmoid" else logits.softmax(-1)
    choice = scores if bias is None else scores + bias.double()
    t, e = choice.shape
    clear = torch.ones(t, dtype=torch.bool)
    if rule.grouped:
        grouped = choice.view(t, rule.groups, e // rule.groups)
        top2 = grouped.topk(2, dim=-1).values
        gs = top2.sum(-1) if rule.group_score == "top2_sum" else top2[..., 0]
        ranked = gs.sort(-1, descending=True).values
        clear &= ranked[:, rule.groups_kept - 1] - ranked[:, rule.groups_kept] > margin
        best = gs.topk(rule.groups_kept, dim=-1).indices
        keep = torch.zeros_like(gs, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[..., None], float("-inf")).view(t, e)
    ranked = choice.sort(-1, descending=True).values
    if rule.top_k < e:
        clear &= ranked[:, rule.top_k - 1] - ranked[:, rule.top_k] > margin
    return clear


def _compare(ours, theirs, clear, rtol):
    """The same sets of experts on the clear tokens, and their weights within rtol."""
    assert clear.float().mean() >= 0.6, clear
    mine, order = ours.experts[clear].sort(-1)
    expected, their_order = theirs.experts[clear].sort(-1)
    assert torch.equal(mine, expected)
    torch.testing.assert_close(
        ours.weights[clear].gather(1, order).float(),
        theirs.weights[clear].gather(1, their_order).float(), rtol=rtol, atol=1e-6,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("family", ["deepseek_v3", "nemotron_h"])
def test_grouped_sigmoid_router_matches_the_rule(family, shape, dtype):
    """DeepSeek-V3 / Kimi (a Router of the model's dtype) and Nemotron-H (a float32 Router
    in a model of any dtype): float32 logits from x widened; weights float32 as the rule's."""
    *_, groups, kept, k = shape
    rule = deepseek_v3(k, groups, kept)
    router = _router(shape, dtype, rule, keep_float32=family == "nemotron_h", seed=k)
    x = _x(shape, dtype, seed=shape[0])
    bias = router.e_score_correction_bias
    with torch.inference_mode():
        ours = layer._vector_route(x, router, rule, bias, None)
        theirs = layer.torch_route(x, router, rule, bias)
        logits = router.logits(x)
    assert ours.weights.dtype == theirs.weights.dtype == torch.float32
    _compare(ours, theirs, _clear(logits, rule, bias, 1e-5), rtol=1e-5)
    with torch.inference_mode():  # the weights in the experts' dtype, when asked
        rounded = layer._vector_route(x, router, rule, bias, dtype)
    assert rounded.weights.dtype == dtype
    assert torch.equal(rounded.weights, ours.weights.to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_grouped_softmax_router_matches_the_rule(shape, dtype):
    """DeepSeek-V2's group_limited_greedy: softmax, groups by their best expert (the others'
    scores 0), not renormalised, scaled; no choice bias."""
    *_, groups, kept, k = shape
    rule = deepseek_v2(k, groups, kept)
    router = _router(shape, dtype, rule, correction=False, seed=k + 1)
    x = _x(shape, dtype, seed=shape[0] + 1)
    with torch.inference_mode():
        ours = layer._vector_route(x, router, rule, None, None)
        theirs = layer.torch_route(x, router, rule, None)
        logits = router.logits(x)
    _compare(ours, theirs, _clear(logits, rule, None, 1e-6), rtol=1e-5)


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_lfm2_router_matches_the_rule(shape, dtype, renormalise):
    """LFM2-MoE: an nn.Linear gate, logits and sigmoid scores in the model dtype (bfloat16:
    each step rounded as PyTorch's ops), the expert bias (of the model dtype) for the choice
    only; weights of x's dtype."""
    tokens, hidden, num_experts, _, _, k = shape
    rule = lfm2(k, renormalise)
    g = torch.Generator().manual_seed(k + 7)
    gate = nn.Linear(hidden, num_experts, bias=False)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(num_experts, hidden, generator=g) / hidden**0.5 * 3)
    gate = gate.to(dtype)
    bias = (torch.randn(num_experts, generator=g) * 0.1).to(dtype)
    x = _x(shape, dtype, seed=tokens + 2)
    with torch.inference_mode():
        ours = layer._vector_route(x, gate, rule, bias, None)
        theirs = layer.torch_route(x, gate, rule, bias)
        logits = gate(x)
    assert ours.weights.dtype == theirs.weights.dtype == dtype
    if dtype == torch.float32:
        _compare(ours, theirs, _clear(logits, rule, bias, 1e-5), rtol=1e-5)
    else:  # scores 8 bits: a logit summed in another order may round to its neighbour
        _compare(ours, theirs, _clear(logits, rule, bias, 2**-6), rtol=2**-6)


def test_each_step_rounds_as_pytorch_in_bfloat16():
    """Given the same bfloat16 logits (an identity gate), the bfloat16 sigmoid rule's weights
    are PyTorch's bit for bit: sigmoid, the sum, + eps, the division and the scaling each
    rounded."""
    num_experts, k = 12, 4
    rule = lfm2(k)
    g = torch.Generator().manual_seed(5)
    logits = (torch.randn(64, num_experts, generator=g) * 2).bfloat16()
    gate = nn.Linear(num_experts, num_experts, bias=False).bfloat16()
    bias = (torch.randn(num_experts, generator=g) * 0.1).bfloat16()
    with torch.inference_mode():
        gate.weight.copy_(torch.eye(num_experts))
        ours = layer._vector_route(logits, gate, rule, bias, None)
        theirs = rule(logits, bias)
    clear = _clear(logits, rule, bias, 2**-9)
    mine, order = ours.experts[clear].sort(-1)
    expected, their_order = theirs.experts[clear].sort(-1)
    assert torch.equal(mine, expected)
    assert torch.equal(ours.weights[clear].gather(1, order),
                       theirs.weights[clear].gather(1, their_order))  # fmt: skip


def test_rules_the_kernel_does_not_take_stay_on_pytorch():
    """`vector_route_fits` refuses exactly what the kernel does not compute."""
    x = _x((3, 16), torch.bfloat16)
    sigmoid = deepseek_v3(2, 2, 1)
    with torch.inference_mode():
        gpt_oss = Router(16, 4, RoutingRule(2, "topk_softmax", float32=False), bias=True)
        assert layer.vector_route_fits(x, gpt_oss.bfloat16(), gpt_oss.rule)  # a gate bias: yes
        assert not layer.vector_route_fits(x, gpt_oss.float(), gpt_oss.rule)  # mixed dtypes
        plain = Router(16, 4, RoutingRule(2, "softmax", float32=False)).bfloat16()
        assert not layer.vector_route_fits(x, plain, plain.rule)  # softmax in bfloat16
        assert layer.vector_route_fits(x.float(), plain.float(), plain.rule)  # (float32: yes)
        grouped_topk = RoutingRule(2, "topk_softmax", groups=2, groups_kept=1)
        router = Router(16, 4, grouped_topk).bfloat16()
        assert not layer.vector_route_fits(x, router, grouped_topk)  # (its rule ignores them)
        router = Router(16, 4, RoutingRule(2, "topk_softmax")).bfloat16()
        assert not layer.vector_route_fits(x, router, router.rule, torch.zeros(4))
        router = Router(16, 6, sigmoid, correction_bias=True).bfloat16()  # (2 groups of 3)
        assert layer.vector_route_fits(x, router, sigmoid, router.e_score_correction_bias)


def test_fits_checks_the_groups_and_the_bias():
    x = _x((3, 16), torch.float32)
    with torch.inference_mode():
        rule = deepseek_v3(2, 2, 1)
        router = Router(16, 6, rule, correction_bias=True)
        assert layer.vector_route_fits(x, router, rule, router.e_score_correction_bias)
        assert not layer.vector_route_fits(x, Router(16, 7, rule), rule)  # 7 in 2 groups
        pairs = deepseek_v3(2, 6, 3)  # one expert a group: no top-2
        assert not layer.vector_route_fits(x, Router(16, 6, pairs), pairs)
        assert not layer.vector_route_fits(x, router, rule, torch.zeros(5))  # bias [E]
        mixed = Router(16, 6, rule).bfloat16()  # float32 x, a bfloat16 weight: widened once
        assert layer.vector_route_fits(x, mixed, rule)
        assert layer._vector_route(x, mixed, rule, None, None).weights.dtype == torch.float32
        lfm = lfm2(2)
        gate = nn.Linear(16, 6, bias=False)
        assert layer.vector_route_fits(x, gate, lfm, torch.zeros(6))
        assert not layer.vector_route_fits(x, gate.bfloat16(), lfm)  # mixed dtypes
    assert not layer.vector_route_fits(x, router, rule)  # autograd on


def test_declined_tensors():
    x = _x((3, 16), torch.float32)
    w = torch.randn(6, 16)
    rule = moe.NativeRule(moe.SIGMOID, groups=2, kept=1)
    with torch.inference_mode():
        assert moe.vector_route(x, w, 2, rule, torch.zeros(6, dtype=torch.bfloat16)) is None
        assert moe.vector_route(x, w, 2, moe.NativeRule(moe.SIGMOID, groups=4)) is None
        assert moe.vector_route(x, w, 2, rule._replace(bf16_scores=True)) is None  # float32
        assert moe.vector_route(x.bfloat16(), w, 2, rule) is not None  # a float32 router
        assert moe.vector_route(x, w.bfloat16(), 2, rule) is None
        with pytest.raises(ValueError, match="routing mode"):
            moe.vector_route(x, w, 2, 4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_routers_take_the_native_chain(dtype, monkeypatch):
    """On a CPU with AVX2 a Router with a choice bias and groups routes natively (the AMX
    router does not take its float32 logits), as does LFM2's gate with its expert bias; the
    results agree with the PyTorch chain's."""
    from hybridkv.ops.registry import capabilities

    if not {"native", "avx2"} <= capabilities("cpu"):
        pytest.skip("no AVX2 build: the chain is PyTorch's")
    calls = []
    kernel = moe.vector_route
    monkeypatch.setattr(moe, "vector_route", lambda *a: calls.append(1) or kernel(*a))
    shape = (17, 40, 9, 3, 1, 2)
    rule = deepseek_v3(2, 3, 1)
    router = _router(shape, dtype, rule, keep_float32=True)
    x = _x(shape, dtype)
    with torch.inference_mode():
        routing = router(x)
        expected = layer.torch_route(x, router, rule, router.e_score_correction_bias)
        gate = nn.Linear(40, 9, bias=False).to(dtype)
        g = torch.Generator().manual_seed(3)
        gate.weight.copy_(torch.randn(9, 40, generator=g) / 40**0.5 * 3)
        lfm_routing = layer.route(x, gate, lfm2(2), torch.zeros(9, dtype=dtype))
        lfm_expected = layer.torch_route(x, gate, lfm2(2), torch.zeros(9, dtype=dtype))
    assert len(calls) == 2
    clear = _clear(router.logits(x), rule, router.e_score_correction_bias, 1e-5)
    _compare(routing, expected, clear, rtol=1e-5)
    assert lfm_routing.weights.dtype == dtype
    margin = 1e-5 if dtype == torch.float32 else 2**-6
    clear = _clear(F.linear(x, gate.weight), lfm2(2), None, margin)
    _compare(lfm_routing, lfm_expected, clear, rtol=margin)
