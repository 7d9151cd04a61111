"""The native bfloat16 experts on AMX tiles (ops.native.moe): routed experts against a float64
per-token reference and against the PyTorch path of `gated_experts` (the same roundings: equal
but for the order of the float32 sums inside a GEMM), the shared-expert form, odd sizes (hidden
and intermediate sizes that are no multiple of the tiles, one and many pairs per expert, experts
without tokens, k = 1 and k > 16), the fused addend, and the packing. Skipped on a CPU without
AMX (the callers keep their PyTorch paths there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hybridkv.layers import mlp
from hybridkv.layers import moe as layers_moe
from hybridkv.ops.native import moe

BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def _cpu_record_afresh():
    """The CPU record is computed once per process (an lru_cache): one computed in an earlier
    test under HYBRIDKV_NATIVE=0 lacks the native instruction sets, and the op choices
    (hybridkv.ops.registry) follow it. Compute it afresh."""
    from hybridkv.ops import registry
    from hybridkv.ops.native import cpu

    cpu.record.cache_clear()
    registry.reset_all()


def needs_amx() -> None:
    if not moe.available():
        pytest.skip("no AMX-BF16 kernel here (CPU without AMX, no compiler, HYBRIDKV_NATIVE=0)")


def _reference64(x, experts, weights, gate_up, down):
    """Token by token in float64 from the bfloat16 values."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = down.shape[2]
    for t in range(x.shape[0]):
        for e, w in zip(experts[t].tolist(), weights[t].double().tolist(), strict=True):
            gu = gate_up[e].double() @ x[t].double()
            out[t] += w * (down[e].double() @ (F.silu(gu[:inter]) * gu[inter:]))
    return out


def _pytorch_path(x, experts, weights, gate_up, down, monkeypatch):
    with monkeypatch.context() as m:
        m.setattr(mlp, "amx_experts_fit", lambda *a, **k: False)  # the chain without AMX
        return mlp.gated_experts(x, experts, weights, gate_up, down)


def _problem(tokens, num_experts, hidden, inter, k, seed, skew=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(BF16)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5).to(BF16)
    down = (torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5).to(BF16)
    scores = torch.rand(tokens, num_experts, generator=g)
    if skew:
        scores[:, 0] += 1.0  # every token takes expert 0: one expert with many blocks
    top, experts = scores.topk(k, dim=-1)
    weights = (top / top.sum(-1, keepdim=True)).to(BF16)
    return x, experts, weights, gate_up, down


CASES = [
    # tokens, experts, hidden, intermediate, k
    (1, 8, 768, 128, 2),  # one decode token
    (64, 8, 768, 128, 2),  # a decode step of the benchmark model
    (700, 8, 768, 128, 2),  # prefill: blocks of 128 pairs, several per expert
    (37, 5, 100, 40, 3),  # hidden and intermediate no multiple of the tiles
    (9, 4, 24, 10, 4),  # k = E: every expert, tiny sizes
    (50, 3, 64, 24, 1),  # k = 1
    (20, 40, 48, 16, 18),  # k > 16 (the per-token sort leaves the stack), idle experts
    (130, 2, 32, 520, 2),  # a wide intermediate (the down GEMM's K > hidden)
]


@pytest.mark.parametrize(("tokens", "num_experts", "hidden", "inter", "k"), CASES)
def test_routed_experts_match_float64_and_the_pytorch_path(
    tokens, num_experts, hidden, inter, k, monkeypatch
):
    needs_amx()
    problem = _problem(tokens, num_experts, hidden, inter, k, seed=tokens + inter)
    with torch.inference_mode():
        out = moe.routed_experts(*problem)
        ref = _pytorch_path(*problem, monkeypatch)
    assert out is not None and out.dtype == BF16 and out.shape == ref.shape
    exact = _reference64(*problem)
    scale = exact.abs().max()
    assert (out.double() - exact).abs().max() <= 0.02 * scale  # bfloat16 roundings
    # the PyTorch path rounds at the same points: at most a last-bit difference here and there
    # (where its GEMM summed in another order)
    diff = (out.double() - ref.double()).abs()
    assert diff.max() <= 0.01 * scale
    assert (diff == 0).double().mean() >= 0.75


def test_skewed_routing_and_the_fused_addend(monkeypatch):
    """Most pairs on one expert (several blocks of it, split columns elsewhere), and `extra`
    added last, rounded as `routed + extra` in bfloat16."""
    needs_amx()
    problem = _problem(300, 6, 96, 48, 2, seed=1, skew=True)
    extra = torch.randn(300, 96, generator=torch.Generator().manual_seed(2)).to(BF16)
    with torch.inference_mode():
        out = moe.routed_experts(*problem, extra=extra)
        ref = _pytorch_path(*problem, monkeypatch) + extra
    diff = (out.double() - ref.double()).abs()
    assert diff.max() <= 0.01 * ref.double().abs().max()
    assert (diff == 0).double().mean() >= 0.9


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter"), [(3, 40, 24), (64, 768, 512), (300, 64, 72)]
)
def test_swiglu_expert_matches_pytorch(tokens, hidden, inter):
    """scale * down(silu(gate x) * up x): PyTorch's bfloat16 ops round at the same points."""
    needs_amx()
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, hidden, generator=g).to(BF16)
    gate = (torch.randn(inter, hidden, generator=g) / hidden**0.5).to(BF16)
    up = (torch.randn(inter, hidden, generator=g) / hidden**0.5).to(BF16)
    down = (torch.randn(hidden, inter, generator=g) / inter**0.5).to(BF16)
    scale = torch.sigmoid(torch.randn(tokens, 1, generator=g)).to(BF16)
    with torch.inference_mode():
        out = moe.swiglu_expert(x, gate, up, down, scale)
        ref = scale * F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
    h = F.silu(x.double() @ gate.double().T) * (x.double() @ up.double().T)
    exact = scale.double() * (h @ down.double().T)
    assert out is not None and out.dtype == BF16
    assert (out.double() - exact).abs().max() <= 0.02 * exact.abs().max()
    diff = (out.double() - ref.double()).abs()
    assert diff.max() <= 0.01 * exact.abs().max() and (diff == 0).double().mean() >= 0.9


def test_packing_layout():
    """Tile (nb, kb) holds rows nb*16.. and columns kb*32.. with pairs of k side by side; gate
    and up blocks alternate; padding is zeros."""
    w = torch.arange(2 * 2 * 20 * 40, dtype=torch.float32).reshape(2, 40, 40)  # E=2, I=20
    tiles = moe.pack_gate_up(w)  # [2, 2*32/16, 64/32, 16, 16, 2]
    assert tiles.shape == (2, 4, 2, 16, 16, 2)
    # tile (nb=1: up block 0), kb=1, kp=3, n=5, p=1 -> up row 5, column 32 + 7
    assert tiles[1, 1, 1, 3, 5, 1] == w[1, 20 + 5, 39]
    assert tiles[0, 2, 0, 0, 3, 0] == w[0, 16 + 3, 0]  # gate block 1, row 19
    assert tiles[0, 2, 0, 0, 4, 0] == 0  # gate row 20: past I
    assert tiles[0, 0, 1, 4, 0, 0] == 0  # column 40: past H
    down = moe.pack_down(w[:, :, :20])  # [2, 40 -> 48, 20 -> 32]
    assert down.shape == (2, 3, 1, 16, 16, 2)
    assert down[1, 2, 0, 9, 7, 1] == w[1, 32 + 7, 19] and down[1, 2, 0, 10, 7, 0] == 0


def test_declines_what_it_does_not_take():
    needs_amx()
    x, experts, weights, gate_up, down = _problem(4, 3, 32, 16, 2, seed=0)
    with torch.inference_mode():
        assert moe.routed_experts(x.float(), experts, weights, gate_up, down) is None
        assert moe.routed_experts(x, experts.int(), weights, gate_up, down) is None
        assert moe.routed_experts(x, experts, weights.float(), gate_up, down) is None
        assert moe.routed_experts(x, experts, weights, gate_up, down[:, :, :8]) is None
        with pytest.raises(ValueError, match="expert ids"):
            moe.routed_experts(x, experts + 3, weights, gate_up, down)
    assert moe.routed_experts(x, experts, weights, gate_up, down) is None  # autograd on
    with torch.inference_mode():
        out = moe.routed_experts(x[:0], experts[:0], weights[:0], gate_up, down)
    assert out.shape == (0, 32)


def test_packed_weights_follow_the_parameter():
    """The tiles are kept with the weight (ops.derived) and made again after it changes."""
    needs_amx()
    x, experts, weights, gate_up, down = _problem(16, 4, 32, 16, 2, seed=3)
    gate_up, down = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)
    with torch.inference_mode():
        first = moe.routed_experts(x, experts, weights, gate_up, down)
    with torch.no_grad():
        gate_up.mul_(2.0)
    with torch.inference_mode():
        second = moe.routed_experts(x, experts, weights, gate_up, down)
    assert not torch.equal(first, second)
    with torch.no_grad():
        gate_up.mul_(0.5)
    with torch.inference_mode():
        assert torch.equal(moe.routed_experts(x, experts, weights, gate_up, down), first)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "hidden", "k", "normalize"),
    [(64, 8, 768, 2, True), (300, 8, 96, 2, True), (7, 5, 40, 3, False), (20, 64, 200, 10, True)],
)
def test_route_matches_the_pytorch_router(tokens, num_experts, hidden, k, normalize):
    """softmax top-k of bf16 logits (renormalised or not) and sigmoid of the shared gate, as
    Qwen3-Next's PyTorch ops compute them. Expert sets may differ only where two experts tie at
    the k-th place (torch.topk's order among equals is its own): there the weights still agree."""
    needs_amx()
    g = torch.Generator().manual_seed(tokens + k)
    x = torch.randn(tokens, hidden, generator=g).to(BF16)
    router = (torch.randn(num_experts, hidden, generator=g) / hidden**0.5).to(BF16)
    shared_gate = (torch.randn(1, hidden, generator=g) / hidden**0.5).to(BF16)
    with torch.inference_mode():
        logits = F.linear(x, router)
        probs = torch.softmax(logits.float(), dim=-1)
        top, experts = probs.topk(k, dim=-1)
        if normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        scale = torch.sigmoid(F.linear(x, shared_gate))
        got = moe.route(x, router, shared_gate, k, int(normalize))
        alone = moe.route(x, router, None, k, int(normalize))
    assert got is not None and alone is not None and alone[2] is None
    ours, weights, our_scale = got
    assert ours.dtype == torch.int64 and weights.dtype == BF16 and our_scale.shape == (tokens, 1)
    assert torch.equal(alone[0], ours) and torch.equal(alone[1], weights)
    same_set = (ours.sort(-1).values == experts.sort(-1).values).all(-1)
    kth = probs.gather(1, experts[:, -1:])  # the k-th probability: ties there only
    tie = (probs == kth).sum(-1) > 1
    assert bool((same_set | tie).all())
    assert torch.equal(weights.sort(-1).values, top.to(BF16).sort(-1).values)
    assert torch.equal(our_scale, scale)


@pytest.mark.parametrize(
    ("tokens", "num_experts", "hidden", "k"),
    [(64, 8, 768, 2), (300, 40, 96, 8), (7, 5, 40, 5), (20, 64, 200, 10), (3, 3, 17, 1)],
)
def test_route_topk_softmax_matches_granites_router(tokens, num_experts, hidden, k):
    """Granite MoE's routing: the k largest bf16 logits, then the softmax of those k in float32
    rounded to bf16, as GraniteMoE's PyTorch ops compute them; expert sets may differ only
    where two logits tie at the k-th place."""
    needs_amx()
    g = torch.Generator().manual_seed(tokens + k)
    x = torch.randn(tokens, hidden, generator=g).to(BF16)
    router = (torch.randn(num_experts, hidden, generator=g) / hidden**0.5).to(BF16)
    with torch.inference_mode():
        logits = F.linear(x, router).float()
        top, experts = logits.topk(k, dim=-1)
        weights_ref = torch.softmax(top, dim=-1).to(BF16)
        got = moe.route(x, router, None, k, moe.TOPK_SOFTMAX)
    assert got is not None and got[2] is None
    ours, weights, _ = got
    assert ours.dtype == torch.int64 and weights.dtype == BF16 and ours.shape == (tokens, k)
    same_set = (ours.sort(-1).values == experts.sort(-1).values).all(-1)
    kth = logits.gather(1, experts[:, -1:])
    tie = (logits == kth).sum(-1) > 1
    assert bool((same_set | tie).all())
    # largest first, as torch.topk orders them
    assert bool((logits.gather(1, ours).diff(dim=-1) <= 0).all())
    rows = same_set & ~tie
    assert torch.equal(weights[rows], weights_ref[rows])


def test_granite_moe_native_routing_equals_its_pytorch_routing(monkeypatch):
    """A bfloat16 Granite MoE layer takes the native router on AMX and equals its PyTorch
    routing (the native router declined) on the same input."""
    needs_amx()
    from hybridkv.layers.mlp import GraniteMoE

    torch.manual_seed(0)
    layer = GraniteMoE(64, 48, num_experts=6, top_k=2).to(BF16)
    for p in layer.parameters():
        p.data.normal_(0, 0.1)
    x = torch.randn(9, 64).to(BF16)
    with torch.inference_mode():
        native_out = layer(x)
        monkeypatch.setattr(layers_moe, "native_route_fits", lambda *a, **k: False)
        torch_out = layer(x)  # the route chain without the native router
    torch.testing.assert_close(native_out, torch_out, rtol=0, atol=0)


def test_route_declines_what_it_does_not_take():
    needs_amx()
    x = torch.randn(4, 32).to(BF16)
    router = torch.randn(6, 32).to(BF16)
    with torch.inference_mode():
        assert moe.route(x.float(), router, None, 2, moe.SOFTMAX_TOPK) is None
        assert moe.route(x, router, None, 7, moe.SOFTMAX_TOPK) is None  # k > E
        assert moe.route(x, router[:, :16], None, 2, moe.SOFTMAX_TOPK) is None
        assert moe.route(x, router, router[:2], 2, moe.SOFTMAX_TOPK) is None  # shared gate: 1 row


@pytest.mark.parametrize(("hidden", "inter"), [(32, 0), (0, 16)])
def test_declines_empty_sizes(hidden, inter):
    """An intermediate or hidden size of 0 has no tiles to pack (the packing raised): None, and
    `gated_experts` gives the PyTorch path's zeros."""
    needs_amx()
    x, experts, weights, gate_up, down = _problem(5, 3, hidden, inter, 2, seed=4)
    scale = torch.full((5, 1), 0.5, dtype=BF16)
    with torch.inference_mode():
        assert moe.routed_experts(x, experts, weights, gate_up, down) is None
        gate, up = gate_up[0, :inter], gate_up[0, inter:]
        assert moe.swiglu_expert(x, gate, up, down[0], scale) is None
        out = mlp.gated_experts(x, experts, weights, gate_up, down)
    assert out.shape == (5, hidden) and bool((out == 0).all())
