"""hybridkv.layers.moe: every routing mode against a token-by-token float64 reference of the
rule (odd expert counts, k = 1 and k > 1, groups, renormalisation on and off, choice bias,
ties), `route`'s native and PyTorch paths, the Router's parameters, and every kind of experts
against a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from hybridkv.layers import moe
from hybridkv.layers.activation import relu2
from hybridkv.layers.moe import (
    ClampedSwigluExperts,
    GatedExperts,
    Router,
    Routing,
    RoutingRule,
    UngatedExperts,
)
from hybridkv.ops.native import moe as native_moe

# -- the rule, token by token -----------------------------------------------------------------


def _softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    return [v / sum(exps) for v in exps]


def _best(values: list[float], k: int) -> list[int]:
    """The indices of the k largest values (ties: the lower index first)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


def _kept_groups(choice: list[float], rule: RoutingRule) -> list[float]:
    """choice with the experts outside the best `groups_kept` groups masked."""
    size = len(choice) // rule.groups
    groups = [choice[g * size : (g + 1) * size] for g in range(rule.groups)]
    if rule.group_score == "top2_sum":
        scores, fill = [sum(sorted(g, reverse=True)[:2]) for g in groups], -math.inf
    else:
        scores, fill = [max(g) for g in groups], 0.0
    kept = set(_best(scores, rule.groups_kept))
    return [c if i // size in kept else fill for i, c in enumerate(choice)]


def reference(
    logits: torch.Tensor, rule: RoutingRule, bias: torch.Tensor | None = None
) -> list[dict[int, float]]:
    """Per token: {expert: weight} as the rule's definition reads, in float64."""
    out = []
    for row in logits.double().tolist():
        if rule.scoring == "topk_softmax":
            chosen = _best(row, rule.top_k)
            weights = _softmax([row[e] for e in chosen])
        else:
            scores = (
                _softmax(row)
                if rule.scoring == "softmax"
                else [1 / (1 + math.exp(-v)) for v in row]
            )
            choice = (
                scores
                if bias is None
                else [s + b for s, b in zip(scores, bias.tolist(), strict=True)]
            )
            if rule.grouped:
                choice = _kept_groups(choice, rule)
            chosen = _best(choice, rule.top_k)
            weights = [(scores if bias is not None else choice)[e] for e in chosen]
        if rule.renormalise:
            weights = [w / (sum(weights) + rule.renormalise_eps) for w in weights]
        out.append({e: w * rule.scaling for e, w in zip(chosen, weights, strict=True)})
    return out


def as_dicts(routing: Routing) -> list[dict[int, float]]:
    experts, weights = routing.experts.tolist(), routing.weights.double().tolist()
    return [dict(zip(e, w, strict=True)) for e, w in zip(experts, weights, strict=True)]


def assert_routes_as(routing: Routing, expected: list[dict[int, float]], tol: float) -> None:
    got = as_dicts(routing)
    for token, (ours, ref) in enumerate(zip(got, expected, strict=True)):
        assert set(ours) == set(ref), f"token {token}: experts {sorted(ours)} != {sorted(ref)}"
        for e, w in ref.items():
            assert abs(ours[e] - w) <= tol * max(1.0, abs(w)), (token, e, ours[e], w)


RULES = [
    RoutingRule(1, "softmax"),
    RoutingRule(3, "softmax"),
    RoutingRule(3, "softmax", renormalise=True),
    RoutingRule(1, "topk_softmax"),
    RoutingRule(4, "topk_softmax"),
    RoutingRule(2, "sigmoid"),
    RoutingRule(3, "sigmoid", renormalise=True, renormalise_eps=1e-6, scaling=1.7),
    RoutingRule(2, "softmax", scaling=2.5, sorted=False),
]


@pytest.mark.parametrize("num_experts", [5, 7, 8])
@pytest.mark.parametrize("rule", RULES, ids=repr)
def test_rules_match_the_reference(rule, num_experts):
    g = torch.Generator().manual_seed(num_experts + rule.top_k)
    logits = torch.randn(23, num_experts, generator=g) * 2
    routing = rule(logits)
    assert routing.experts.shape == routing.weights.shape == (23, rule.top_k)
    assert routing.experts.dtype == torch.int64 and routing.weights.dtype == torch.float32
    assert_routes_as(routing, reference(logits, rule), tol=1e-6)


@pytest.mark.parametrize("renormalise", [True, False])
@pytest.mark.parametrize("k", [1, 3])
def test_choice_bias_chooses_but_does_not_weigh(k, renormalise):
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(17, 7, generator=g)
    bias = torch.tensor([0.0, 5.0, 0.0, -5.0, 0.0, 0.0, 5.0])  # experts 1 and 6 always chosen
    rule = RoutingRule(k, "sigmoid", renormalise, renormalise_eps=1e-20, scaling=2.0)
    routing = rule(logits, bias)
    assert_routes_as(routing, reference(logits, rule, bias), tol=1e-6)
    assert not bool((routing.experts == 3).any())
    if not renormalise:  # the plain sigmoid scores, times the scaling
        expected = logits.sigmoid().gather(1, routing.experts) * 2.0
        torch.testing.assert_close(routing.weights, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("num_experts", "groups", "kept", "k", "score"),
    [
        (8, 4, 2, 3, "top2_sum"),
        (12, 4, 1, 2, "top2_sum"),
        (9, 3, 2, 4, "max"),
        (9, 3, 1, 1, "max"),
        (8, 2, 2, 3, "top2_sum"),
    ],
)
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_topk_matches_the_reference(num_experts, groups, kept, k, score, bias):
    g = torch.Generator().manual_seed(num_experts * groups + k)
    logits = torch.randn(31, num_experts, generator=g) * 2
    choice_bias = torch.randn(num_experts, generator=g) * 0.3 if bias else None
    scoring = "sigmoid" if score == "top2_sum" else "softmax"
    rule = RoutingRule(
        k, scoring, renormalise=bias, renormalise_eps=1e-20, scaling=1.5, groups=groups,
        groups_kept=kept, group_score=score, sorted=False,
    )  # fmt: skip
    routing = rule(logits, choice_bias)
    assert_routes_as(routing, reference(logits, rule, choice_bias), tol=1e-6)
    # every chosen expert lies in one of at most `kept` groups ("max" fills the others with 0,
    # which a negative choice bias can make win: DeepSeek-V2, the one "max" family, has none)
    size = num_experts // groups
    if not (score == "max" and bias):
        assert all(len({e // size for e in row}) <= kept for row in routing.experts.tolist())


def test_ties_choose_among_equals_and_weigh_alike():
    """Logits with ties at the k-th place: any of the tied experts may be chosen (torch.topk's
    order among equals is its own), but the chosen weights are the reference's."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.5], [0.0] * 5, [3.0, 1.0, 3.0, 1.0, 1.0]])
    for rule in (RoutingRule(2, "softmax"), RoutingRule(2, "topk_softmax"),
                 RoutingRule(2, "sigmoid", renormalise=True)):  # fmt: skip
        routing = rule(logits)
        ours = routing.weights.sort(dim=-1).values.double()
        ref = torch.tensor(
            [sorted(r.values()) for r in reference(logits, rule)], dtype=torch.float64
        )
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
        chosen = logits.gather(1, routing.experts)  # the chosen logits are the largest ones
        torch.testing.assert_close(chosen.sort(-1).values, logits.topk(2).values.sort(-1).values)
        assert all(len(set(row)) == 2 for row in routing.experts.tolist())


def test_scores_in_the_model_dtype_or_float32():
    logits = torch.randn(6, 5).bfloat16()
    assert RoutingRule(2, "sigmoid", float32=False)(logits).weights.dtype == torch.bfloat16
    assert RoutingRule(2, "topk_softmax", float32=False)(logits).weights.dtype == torch.bfloat16
    assert RoutingRule(2, "sigmoid")(logits).weights.dtype == torch.float32
    ref = RoutingRule(2, "sigmoid")(logits.float())
    torch.testing.assert_close(RoutingRule(2, "sigmoid")(logits), ref, rtol=0, atol=0)


def test_rules_refuse_what_they_cannot_mean():
    with pytest.raises(ValueError):
        RoutingRule(2, "softmax", groups=2, groups_kept=3)
    with pytest.raises(ValueError):
        RoutingRule(2, "tanh")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        RoutingRule(-1)


def test_native_modes():
    assert RoutingRule(2, "topk_softmax").native_mode == native_moe.TOPK_SOFTMAX
    assert RoutingRule(2, "softmax").native_mode == native_moe.SOFTMAX_TOPK
    renormalised = RoutingRule(2, "softmax", renormalise=True)
    assert renormalised.native_mode == native_moe.SOFTMAX_TOPK_RENORMALISED
    for rule in (
        RoutingRule(2, "sigmoid"), RoutingRule(2, "softmax", scaling=2.0),
        RoutingRule(2, "softmax", sorted=False), RoutingRule(2, "topk_softmax", float32=False),
        RoutingRule(2, "softmax", groups=2, groups_kept=1),
        RoutingRule(2, "softmax", renormalise=True, renormalise_eps=1e-6),
    ):  # fmt: skip
        assert rule.native_mode is None, rule


# -- route and Router ---------------------------------------------------------------------------


NATIVE_RULES = [
    RoutingRule(2, "softmax"),
    RoutingRule(3, "topk_softmax"),
    RoutingRule(2, "softmax", renormalise=True),
]


@pytest.mark.parametrize("rule", NATIVE_RULES, ids=repr)
def test_route_native_and_pytorch_paths(rule, monkeypatch):
    """Through an nn.Linear gate the native routers (AMX for bfloat16, the small-batch
    linears' one for float32 and bfloat16 elsewhere) choose the same experts as the rule on
    the gate's logits and weigh them as the rule (bfloat16: rounded to bfloat16), but where
    two experts tie at the k-th place; declined, the rule exactly."""
    torch.manual_seed(0)
    gate = torch.nn.Linear(40, 7, bias=False)
    x = torch.randn(29, 40)
    with torch.inference_mode():
        routing, reference_routing = moe.route(x, gate, rule), rule(gate(x))
        assert torch.equal(routing.experts, reference_routing.experts)
        torch.testing.assert_close(routing.weights, reference_routing.weights)
        gate, x = gate.bfloat16(), x.bfloat16()
        native = moe.MOE_ROUTE.of(x).links[0].impl.name in ("native-amx", "native")
        fits = moe.native_route_fits(x, gate, rule) or moe.vector_route_fits(x, gate, rule)
        native = native and fits  # (no native router: the rule's path)
        routing = moe.route(x, gate, rule)
        reference_routing = rule(gate(x))
        monkeypatch.setattr(moe, "native_route_fits", lambda *a, **k: False)
        monkeypatch.setattr(moe, "vector_route_fits", lambda *a, **k: False)
        declined = moe.route(x, gate, rule)  # the chain without the native routers
    torch.testing.assert_close(declined, reference_routing, rtol=0, atol=0)
    ours = routing.experts.sort(-1).values
    assert torch.equal(ours, reference_routing.experts.sort(-1).values)
    weights = routing.weights.float().sort(-1).values
    expected = reference_routing.weights
    expected = expected.bfloat16().float() if native else expected.float()
    torch.testing.assert_close(weights, expected.sort(-1).values)


def test_router_parameters_logits_and_float32():
    rule = RoutingRule(2, "sigmoid", groups=2, groups_kept=1, sorted=False)
    router = Router(16, 6, rule, correction_bias=True, keep_float32=True)
    names = {n: tuple(t.shape) for n, t in router.state_dict().items()}
    assert names == {"weight": (6, 16), "e_score_correction_bias": (6,)}
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_()
    router = router.bfloat16()  # stays float32 (transformers' _keep_in_fp32_modules_strict)
    assert router.weight.dtype == router.e_score_correction_bias.dtype == torch.float32
    x = torch.randn(9, 16).bfloat16()
    logits = F.linear(x.float(), router.weight)
    ours = router(x)
    torch.testing.assert_close(ours, rule(logits, router.e_score_correction_bias), rtol=0, atol=0)
    assert_routes_as(ours, reference(logits, rule, router.e_score_correction_bias), tol=1e-6)

    biased = Router(16, 5, RoutingRule(2, "topk_softmax", float32=False), bias=True)
    assert set(biased.state_dict()) == {"weight", "bias"}
    torch.nn.init.normal_(biased.weight)
    torch.nn.init.normal_(biased.bias)
    biased = biased.bfloat16()
    assert biased.weight.dtype == torch.bfloat16
    logits = F.linear(x, biased.weight, biased.bias)  # in the model dtype
    torch.testing.assert_close(biased(x), biased.rule(logits), rtol=0, atol=0)


# -- experts ------------------------------------------------------------------------------------


def _routing(tokens: int, num_experts: int, k: int, seed: int) -> Routing:
    g = torch.Generator().manual_seed(seed)
    weights, experts = torch.rand(tokens, num_experts, generator=g).topk(k, dim=-1)
    return Routing(experts, weights)


def _fill(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def _per_token(x, routing, expert) -> torch.Tensor:
    """sum_j w[t, j] * expert(e[t, j], x[t]) token by token, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(routing.experts[t].tolist(), routing.weights[t].tolist(), strict=True):
            out[t] += w * expert(e, x[t].double())
    return out


CASES = [(1, 5, 1), (13, 5, 2), (40, 7, 3), (0, 4, 2)]  # tokens, experts, k


@pytest.mark.parametrize(("tokens", "num_experts", "k"), CASES)
def test_gated_experts_match_a_per_token_loop(tokens, num_experts, k):
    experts = GatedExperts(num_experts, 24, 10)
    _fill(experts, tokens + k)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(k))
    routing = _routing(tokens, num_experts, k, seed=tokens)

    def swiglu(e: int, v: torch.Tensor) -> torch.Tensor:
        gate, up = (experts.gate_up_proj[e].double() @ v).chunk(2)
        return experts.down_proj[e].double() @ (F.silu(gate) * up)

    with torch.no_grad():
        out = experts(x, routing)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _per_token(x, routing, swiglu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("tokens", "num_experts", "k"), CASES)
def test_ungated_experts_match_a_per_token_loop(tokens, num_experts, k):
    experts = UngatedExperts(num_experts, 24, 10, relu2)
    _fill(experts, tokens + k)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(k))
    routing = _routing(tokens, num_experts, k, seed=tokens)

    def mlp(e: int, v: torch.Tensor) -> torch.Tensor:
        return experts.down_proj[e].double() @ F.relu(experts.up_proj[e].double() @ v) ** 2

    expected = _per_token(x, routing, mlp)
    with torch.no_grad():
        out = experts(x, routing)
        out_bf16 = experts.bfloat16()(x.bfloat16(), routing)  # float32 weights, float32 sums
    assert out.dtype == torch.float32 and out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    if tokens:
        assert (out_bf16.double() - expected).abs().max() <= 0.03 * expected.abs().max()


@pytest.mark.parametrize(("tokens", "num_experts", "k"), CASES)
def test_clamped_swiglu_experts_match_a_per_token_loop(tokens, num_experts, k):
    experts = ClampedSwigluExperts(num_experts, 24, 10, alpha=1.702, limit=0.7)
    _fill(experts, tokens + k)
    x = torch.randn(tokens, 24, generator=torch.Generator().manual_seed(k)) * 3
    routing = _routing(tokens, num_experts, k, seed=tokens)

    def clamped(e: int, v: torch.Tensor) -> torch.Tensor:
        h = v @ experts.gate_up_proj[e].double() + experts.gate_up_proj_bias[e].double()
        gate, up = h[0::2].clamp(max=0.7), h[1::2].clamp(-0.7, 0.7)
        act = (up + 1) * gate * torch.sigmoid(1.702 * gate)
        return act @ experts.down_proj[e].double() + experts.down_proj_bias[e].double()

    with torch.no_grad():
        out = experts(x, routing)
    assert out.shape == x.shape
    torch.testing.assert_close(out.double(), _per_token(x, routing, clamped), rtol=1e-5, atol=1e-5)


def test_shared_experts_moe_adds_the_shared_mlp():
    from hybridkv.layers.mlp import GatedMLP

    rule = RoutingRule(2, "sigmoid", renormalise=True, renormalise_eps=1e-20, sorted=False)
    block = moe.SharedExpertsMoE(Router(24, 5, rule), GatedExperts(5, 24, 8), GatedMLP(24, 12))
    _fill(block, 3)
    names = set(block.state_dict())
    assert {"gate.weight", "experts.gate_up_proj", "experts.down_proj"} <= names
    assert "shared_experts.gate_proj.weight" in names
    x = torch.randn(11, 24)
    with torch.no_grad():
        expected = block.experts(x, block.gate(x)) + block.shared_experts(x)
        torch.testing.assert_close(block(x), expected, rtol=0, atol=0)
