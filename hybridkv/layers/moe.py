"""Mixture of experts shared by the families: routing rules, routers, stacked experts and the
native (AMX) route.

    routing = rule(logits)            logits: [T, E] from the family's gate
    out = experts(x, routing)         sum_j routing.weights[t, j] * E_{routing.experts[t, j]}(x[t])

Routing rules (`RoutingRule`), the modes each family declares:

    family                 scoring        groups     renormalise      scaling   choice bias
    GraniteMoeHybrid       topk_softmax   -          -                -         -
    gpt-oss                topk_softmax   -          -                -         -  (model dtype)
    Jamba                  softmax        -          no               -         -
    Qwen3-Next / 3.5-MoE   softmax        -          norm_topk_prob   -         -
    DeepSeek-V2            softmax        max        no               yes       -
    DeepSeek-V3, Kimi      sigmoid        top2_sum   eps 1e-20        yes       e_score_correction
    Nemotron-H             sigmoid        top2_sum   eps 1e-20        yes       e_score_correction
    LFM2-MoE               sigmoid        -          eps 1e-6         yes       expert_bias
                                                                                (model dtype)

Every row routes natively, one kernel call a layer, on a CPU with AVX2 ("native"; gpt-oss's gate
bias and bfloat16 scores too); in bfloat16 on AMX the first four ("native-amx").

- softmax: softmax over every expert, the k largest probabilities (Mixtral, transformers'
  `softmax -> topk`); topk_softmax: the k largest logits, softmax over those k (gpt-oss,
  Granite); sigmoid: independent scores.
- A choice bias changes which experts are chosen, never their weights (the plain scores).
- Groups: the experts split into `groups` equal groups, each scored by its best expert ("max",
  DeepSeek-V2's group_limited_greedy: the others' scores set to 0) or the sum of its best two
  choice scores ("top2_sum", DeepSeek-V3: the others at -inf); only the best `groups_kept`
  groups' experts can be chosen.
- Scores in float32 (the logits cast first) unless the rule says the logits' dtype.

Gates: the families whose gate is an `nn.Linear` keep it (it is pre-packed on the CPU, kept float
by the int8 quantiser) and route with `route`, the `MOE_ROUTE` family (Granite, Jamba,
Qwen3-Next / 3.5-MoE, LFM2-MoE); the others hold a `Router` (weight [E, H], optional bias,
optional e_score_correction_bias: DeepSeek, Kimi, Nemotron-H, gpt-oss) whose forward routes
through the same chain. Native routers, one kernel call a layer: bfloat16 on a CPU with AMX,
"native-amx" for the softmax / topk_softmax rules of an nn.Linear gate without a choice bias,
groups or scaling (`native_route_fits`); float32, and bfloat16 without AMX or past it, on a CPU
with AVX2, "native" for every rule of the table (`RoutingRule.native_rule`,
`vector_route_fits`: a gate bias, a choice bias, groups, eps, scaling; a Router's float32
logits) but softmax scored in bfloat16 (no family's).

Experts: `GatedExperts` (SwiGLU, [gate | up] rows stacked: `mlp.gated_experts`, native on AMX in
bfloat16 and on every CPU with AVX2 in float32 and bfloat16 up to NATIVE_EXPERT_ROWS tokens),
`UngatedExperts` (Nemotron-H: up / down and an activation, float32 sums; with relu2 native on
every CPU with AVX2 up to NATIVE_EXPERT_ROWS tokens, `UNGATED_EXPERTS`) and
`ClampedSwigluExperts` (gpt-oss: x @ W layout, interleaved gate / up, biases, clamps; native
on every CPU with AVX2 up to NATIVE_EXPERT_ROWS tokens, `CLAMPED_EXPERTS`). Tensor
parallel: every expert's intermediate size is split; routers are replicated; the callers
all-reduce the partial sums once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.layers.activation import relu2
from hybridkv.layers.mlp import GatedMLP, _native_expert_rows, amx_experts_fit, gated_experts
from hybridkv.ops.derived import derived
from hybridkv.ops.elementwise import residual_add
from hybridkv.ops.registry import OpImpl, declare

Scoring = Literal["softmax", "topk_softmax", "sigmoid"]
GroupScore = Literal["top2_sum", "max"]


class Routing(NamedTuple):
    """experts: [T, k] int64; weights: [T, k] (float32, or the logits' dtype as the rule says;
    the native router's are bfloat16)."""

    experts: torch.Tensor
    weights: torch.Tensor


@dataclasses.dataclass(frozen=True)
class RoutingRule:
    """How router logits [T, E] choose k experts per token and weigh them (module docstring)."""

    top_k: int
    scoring: Scoring = "softmax"
    renormalise: bool = False  # the k weights divided by their sum (+ renormalise_eps)
    renormalise_eps: float = 0.0
    scaling: float = 1.0  # routed_scaling_factor, after the renormalisation
    float32: bool = True  # scores from float32 logits (False: in the logits' dtype)
    groups: int = 1  # n_group
    groups_kept: int = 1  # topk_group
    group_score: GroupScore = "top2_sum"
    sorted: bool = True  # torch.topk's `sorted`, as each family's reference calls it

    def __post_init__(self) -> None:
        if self.top_k < 0 or self.groups < 1 or not 1 <= self.groups_kept <= self.groups:
            raise ValueError(f"routing needs top_k >= 0 and 1 <= groups_kept <= groups: {self}")
        if self.scoring not in ("softmax", "topk_softmax", "sigmoid"):
            raise ValueError(f"unknown scoring {self.scoring!r}")
        if self.group_score not in ("top2_sum", "max"):
            raise ValueError(f"unknown group score {self.group_score!r}")

    @property
    def grouped(self) -> bool:
        return self.groups_kept < self.groups

    def __call__(self, logits: torch.Tensor, choice_bias: torch.Tensor | None = None) -> Routing:
        """logits: [T, E]; choice_bias: None or [E] -> Routing ([T, k] each)."""
        if self.float32:
            logits = logits.float()
        if self.scoring == "topk_softmax":
            top, experts = logits.topk(self.top_k, dim=-1, sorted=self.sorted)  # [T, k]
            return Routing(experts, self._finish(torch.softmax(top, dim=-1)))
        scores = torch.softmax(logits, dim=-1) if self.scoring == "softmax" else logits.sigmoid()
        choice = scores if choice_bias is None else scores + choice_bias.float()  # [T, E]
        if self.grouped:
            choice = self._keep_best_groups(choice)
        if choice_bias is None:  # the choice is the scores (DeepSeek-V2: the masked ones)
            weights, experts = choice.topk(self.top_k, dim=-1, sorted=self.sorted)
        else:
            experts = choice.topk(self.top_k, dim=-1, sorted=self.sorted).indices
            weights = scores.gather(1, experts)  # [T, k]: the unbiased scores
        return Routing(experts, self._finish(weights))

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice: [T, E] -> the same with the experts outside the best `groups_kept` groups at
        -inf ("top2_sum") or 0 ("max")."""
        t, e = choice.shape
        grouped = choice.view(t, self.groups, e // self.groups)  # [T, groups, E / groups]
        if self.group_score == "top2_sum":
            group_scores, fill = grouped.topk(2, dim=-1).values.sum(dim=-1), float("-inf")
        else:
            group_scores, fill = grouped.amax(dim=-1), 0.0  # [T, groups]
        best = group_scores.topk(self.groups_kept, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], fill).view(t, e)

    def _finish(self, weights: torch.Tensor) -> torch.Tensor:
        """weights: [T, k] -> renormalised and scaled as the rule says."""
        if self.renormalise:
            total = weights.sum(dim=-1, keepdim=True)
            weights = weights / (total + self.renormalise_eps if self.renormalise_eps else total)
        return weights * self.scaling if self.scaling != 1.0 else weights

    @property
    def native_mode(self) -> int | None:
        """The native router's mode computing this rule from bfloat16 logits, or None."""
        from hybridkv.ops.native import moe

        plain = self.float32 and self.sorted and not self.grouped and self.scaling == 1.0
        if not plain:
            return None
        if self.scoring == "topk_softmax" and not self.renormalise:
            return moe.TOPK_SOFTMAX
        if self.scoring == "softmax" and not self.renormalise:
            return moe.SOFTMAX_TOPK
        if self.scoring == "softmax" and not self.renormalise_eps:
            return moe.SOFTMAX_TOPK_RENORMALISED
        return None

    def native_rule(self, logits_dtype: torch.dtype) -> Any:
        """This rule as the native router of every build computes it (`moe.vector_route`)
        from logits of that dtype, an `ops.native.moe.NativeRule` (not named in the signature:
        layers/ import no native module at module level, tests/test_layering.py), or None:
        topk_softmax with groups (its rule ignores them), no experts to choose, or softmax
        scored in bfloat16 (its top-k of rounded probabilities; sigmoid and topk_softmax in
        bfloat16, gpt-oss's, round as the kernel does)."""
        from hybridkv.ops.native import moe

        bf16_scores = not self.float32 and logits_dtype == torch.bfloat16
        if self.top_k < 1 or (bf16_scores and self.scoring == "softmax"):
            return None
        if self.scoring == "topk_softmax" and self.grouped:
            return None
        modes = {"softmax": moe.SOFTMAX_TOPK, "topk_softmax": moe.TOPK_SOFTMAX}
        return moe.NativeRule(
            modes.get(self.scoring, moe.SIGMOID), self.groups, self.groups_kept,
            self.group_score == "max", self.renormalise,
            self.renormalise_eps if self.renormalise else 0.0, self.scaling, bf16_scores,
        )  # fmt: skip


# The routers (`route`), keyed by x's dtype; each implementation takes (x, gate, rule,
# choice_bias, weights_dtype) -> Routing, the gate an nn.Linear (logits gate(x), in x's dtype)
# or a `Router` (its own weight: float32 logits from float32 inputs when the rule says so). The
# native ones take the rules they implement (native-amx: a gate without bias); for the others,
# the chain without them:
#   bfloat16 on a CPU with AMX        native-amx (`native_route_fits`: softmax / topk_softmax,
#                                       renormalised or not, no choice bias, groups or
#                                       scaling; an nn.Linear gate: its logits are bfloat16)
#   float32, and bfloat16 without     native (`vector_route_fits`: every rule of
#     AMX or past native-amx, on a      `RoutingRule.native_rule`: softmax, topk_softmax and
#     CPU with AVX2                     sigmoid, a choice bias, groups by top2_sum or max,
#                                       renormalised with eps, scaled; a gate bias; scores in
#                                       bfloat16 for sigmoid and topk_softmax. The gate's
#                                       product on the small-batch linears, then the rule and
#                                       top-k, one call)
#   otherwise (no AVX2, other devices) torch (the gate's product, then the rule)
# The native routers are one kernel call a layer, so that a decode step of a MoE model can be
# captured (hybridkv/worker/graphs.py).
_CPU, _BF16 = frozenset({"cpu"}), frozenset({"bfloat16"})
_FLOATS = frozenset({"float32", "bfloat16"})
MOE_ROUTE = declare(
    "moe_route",
    (
        OpImpl("native-amx", f"{__name__}:_native_route", _CPU, _BF16, ("native", "amx_bf16"),
               strict=True, description="moe.c: product, scoring and top-k in one pass a token"),
        OpImpl("native", f"{__name__}:_vector_route", _CPU, _FLOATS, ("native", "avx2"),
               strict=True, description="moe.c: the gate on the small-batch linears, the rule"),
        OpImpl("torch", f"{__name__}:torch_route", description="the gate's product, the rule"),
    ),
)  # fmt: skip


def route(
    x: torch.Tensor,
    gate: nn.Linear | Router,
    rule: RoutingRule,
    choice_bias: torch.Tensor | None = None,
    weights_dtype: torch.dtype | None = None,
) -> Routing:
    """x: [T, H] through a gate [E, H] (an nn.Linear, or a Router: its float32 logits as
    `Router.logits` computes them) and `rule` -> Routing: the `MOE_ROUTE` chain of x's dtype,
    without a native router where it does not take these (`native_route_fits`,
    `vector_route_fits`). Native: the gate's product, scoring and top-k in one call. Weights
    in `weights_dtype`; None: as the path computes them (PyTorch: the rule's; native: x's
    dtype for an nn.Linear gate, the rule's for a Router)."""
    chain = MOE_ROUTE.of(x)
    name = chain.links[0].impl.name
    if name == "native-amx" and not native_route_fits(x, gate, rule, choice_bias):
        chain = MOE_ROUTE.chain(x.device, x.dtype, ("amx_bf16",))
        name = chain.links[0].impl.name
    if name == "native" and not vector_route_fits(x, gate, rule, choice_bias, weights_dtype):
        chain = MOE_ROUTE.chain(x.device, x.dtype, ("native",))
    return chain.first(x, gate, rule, choice_bias, weights_dtype)


def native_route_fits(
    x: torch.Tensor,
    gate: nn.Linear | Router,
    rule: RoutingRule,
    choice_bias: torch.Tensor | None = None,
    shared_gate: nn.Linear | None = None,
) -> bool:
    """The native router's rule (`ops.native.moe.route`): inference; a rule it implements
    (`RoutingRule.native_mode`) and 0 < k <= E; nn.Linear gates without bias (a Router's
    logits are float32: this router rounds them to bfloat16), no choice bias; x [T, H], the
    gate's weight [E, H] and the shared gate's [1, H] (if any) contiguous, all bfloat16 on the
    CPU; the OS granted this process AMX's tile data."""
    from hybridkv.ops.native import moe

    mode = rule.native_mode
    if mode is None or choice_bias is not None or torch.is_grad_enabled():
        return False
    if isinstance(gate, Router):
        return False
    gates = (gate,) if shared_gate is None else (gate, shared_gate)
    if any(g.bias is not None for g in gates):
        return False
    weights = [g.weight for g in gates]
    if x.dim() != 2 or any(w.dim() != 2 or not w.is_contiguous() for w in weights):
        return False
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in (x, *weights)):
        return False
    num_experts, hidden = weights[0].shape
    if x.shape[1] != hidden or not 0 < rule.top_k <= num_experts:
        return False
    if shared_gate is not None and weights[1].shape != (1, hidden):
        return False
    return moe.available()


def vector_route_fits(
    x: torch.Tensor,
    gate: nn.Linear | Router,
    rule: RoutingRule,
    choice_bias: torch.Tensor | None = None,
    weights_dtype: torch.dtype | None = None,
) -> bool:
    """The native router of every build (`ops.native.moe.vector_route`): inference; a rule it
    implements (`RoutingRule.native_rule` of the logits' dtype), 0 < k <= E, E in the rule's
    groups; a gate bias [E] of the weight's dtype on the CPU, or None; a choice bias [E] or
    None (a topk_softmax rule: None, as its rule ignores one); x [T, H] and the gate's weight
    [E, H] (contiguous) float32 or bfloat16 on the CPU, of one dtype (a Router scoring in
    float32: either); weights float32 or bfloat16; the native library loaded."""
    from hybridkv.ops import native

    weight, bias = gate.weight, gate.bias
    if torch.is_grad_enabled() or x.dim() != 2 or weight.dim() != 2:
        return False
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != weight.dtype
                             or bias.device.type != "cpu"):  # fmt: skip
        return False
    floats = (torch.float32, torch.bfloat16)
    if x.dtype not in floats or weight.dtype not in floats or not weight.is_contiguous():
        return False
    if weight.dtype != x.dtype and not (isinstance(gate, Router) and rule.float32):
        return False
    if x.device.type != "cpu" or weight.device.type != "cpu":
        return False
    native_rule = rule.native_rule(_logits_dtype(x, gate, rule))
    if native_rule is None or weights_dtype not in (None, *floats):
        return False
    num_experts, hidden = weight.shape
    if x.shape[1] != hidden or not 0 < rule.top_k <= num_experts:
        return False
    if num_experts % rule.groups or (rule.grouped and rule.group_score == "top2_sum"
                                     and num_experts // rule.groups < 2):  # fmt: skip
        return False
    if choice_bias is not None:
        if rule.scoring == "topk_softmax" or choice_bias.shape != (num_experts,):
            return False
        if choice_bias.dtype not in floats or choice_bias.device.type != "cpu":
            return False
    return native.library() is not None


def _logits_dtype(x: torch.Tensor, gate: nn.Linear | Router, rule: RoutingRule) -> torch.dtype:
    """The dtype of the gate's logits: a Router's, float32 when its rule scores in float32."""
    return torch.float32 if isinstance(gate, Router) and rule.float32 else x.dtype


def _float32(t: torch.Tensor, what: str) -> torch.Tensor:
    """t as float32 and contiguous, converted once per version of t (`derived`)."""
    if t.dtype == torch.float32 and t.is_contiguous():
        return t
    return derived(t, what, lambda v: v.float().contiguous())


def _vector_route(
    x: torch.Tensor,
    gate: nn.Linear | Router,
    rule: RoutingRule,
    choice_bias: torch.Tensor | None,
    weights_dtype: torch.dtype | None,
) -> Routing | None:
    from hybridkv.ops.native import moe

    native_rule = rule.native_rule(_logits_dtype(x, gate, rule))
    if native_rule is None:
        return None
    weight, gate_bias = gate.weight, gate.bias  # [E, H], [E] or None
    if _logits_dtype(x, gate, rule) == torch.float32:  # (a Router's: x widened in C)
        weight = _float32(weight, "float32_router")
        gate_bias = None if gate_bias is None else _float32(gate_bias, "float32_router_bias")
    elif gate_bias is not None and not gate_bias.is_contiguous():
        gate_bias = derived(gate_bias, "contiguous_router_bias", torch.Tensor.contiguous)
    if isinstance(gate, Router) and weights_dtype is None:
        weights_dtype = torch.float32 if rule.float32 else x.dtype  # the rule's, as PyTorch's
    bias = None if choice_bias is None else _float32(choice_bias, "float32_choice_bias")
    routed = moe.vector_route(x, weight, rule.top_k, native_rule, bias, weights_dtype, gate_bias)
    return None if routed is None else Routing(*routed)  # weights: [T, k]


def _native_route(
    x: torch.Tensor,
    gate: nn.Linear | Router,
    rule: RoutingRule,
    choice_bias: torch.Tensor | None,
    weights_dtype: torch.dtype | None,
) -> Routing | None:
    from hybridkv.ops.native import moe

    routed = moe.route(x, gate.weight, None, rule.top_k, rule.native_mode)
    if routed is None:
        return None
    weights = routed[1] if weights_dtype is None else routed[1].to(weights_dtype)
    return Routing(routed[0], weights)  # [T, k]: bfloat16 unless asked otherwise


def torch_route(
    x: torch.Tensor,
    gate: nn.Linear | Router,
    rule: RoutingRule,
    choice_bias: torch.Tensor | None,
    weights_dtype: torch.dtype | None = None,
) -> Routing:
    logits = gate.logits(x) if isinstance(gate, Router) else gate(x)  # [T, E]
    routing = rule(logits, choice_bias)
    if weights_dtype is None:
        return routing
    return Routing(routing.experts, routing.weights.to(weights_dtype))


class Router(nn.Module):
    """A gate holding its weight itself (module `gate` / `router` of DeepSeek, Kimi, Nemotron-H,
    gpt-oss): weight [E, H]; bias [E] when `bias`; buffer e_score_correction_bias [E] (the
    choice bias) when `correction_bias`. Logits from float32 inputs when the rule scores in
    float32, else in the model dtype. `keep_float32`: its tensors stay float32 when the model
    moves to another dtype (transformers' `_keep_in_fp32_modules_strict`, Nemotron-H)."""

    def __init__(
        self,
        hidden: int,
        num_experts: int,
        rule: RoutingRule,
        *,
        bias: bool = False,
        correction_bias: bool = False,
        keep_float32: bool = False,
    ) -> None:
        super().__init__()
        self.rule, self.keep_float32 = rule, keep_float32
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.bias = nn.Parameter(torch.zeros(num_experts)) if bias else None
        correction = torch.zeros(num_experts) if correction_bias else None
        self.register_buffer("e_score_correction_bias", correction)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        if not self.keep_float32:
            return super()._apply(fn, recurse)

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.is_floating_point() and out.dtype != torch.float32:
                return t.to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(keep_fp32, recurse)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] -> [T, E]: float32 from float32 inputs when the rule scores in float32,
        else in the model dtype."""
        if self.rule.float32:
            bias = None if self.bias is None else self.bias.float()
            return F.linear(x.float(), self.weight.float(), bias)
        return F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor, weights_dtype: torch.dtype | None = None) -> Routing:
        """x: [T, H] -> Routing ([T, k] each): the `MOE_ROUTE` chain (`route`); weights in
        `weights_dtype` (None: the rule's, float32 or the logits' dtype)."""
        return route(x, self, self.rule, self.e_score_correction_bias, weights_dtype)


# -- experts -----------------------------------------------------------------------------------


class GatedExperts(nn.Module):
    """Stacked SwiGLU experts: gate_up_proj [E, 2I, H] ([gate | up] rows), down_proj [E, H, I]
    (transformers' in-memory names). Tensor parallel: every expert's intermediate slice."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, what: str = "moe_intermediate_size"
    ) -> None:
        super().__init__()
        tp, full = current(), intermediate
        intermediate = tp.split(full, what)
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        declare_shards(
            self, gate_up_proj=column(tp, (0, full), (full, full), dim=1),
            down_proj=column(tp, (0, full), dim=2),
        )  # fmt: skip

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> [T, H], the experts' outputs weighted (weights rounded to x's dtype)."""
        weights = routing.weights.to(x.dtype)
        return gated_experts(x, routing.experts, weights, self.gate_up_proj, self.down_proj)


def looped_experts(
    x: torch.Tensor,
    routing: Routing,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
    accumulate: torch.dtype,
) -> torch.Tensor:
    """sum_j weights[t, j] * expert(experts[t, j], x[t]), summed in `accumulate` -> [T, H] in
    x's dtype. The T * k (token, expert) pairs are sorted by expert once; each expert hit runs
    once on all of its tokens (expert(e, rows): [n, H] -> [n, H])."""
    k = routing.experts.shape[1]
    flat = routing.experts.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    tokens = order // k  # [T * k]: the token of each sorted pair
    pair_weights = routing.weights.reshape(-1)[order, None]  # [T * k, 1]
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = torch.zeros(x.shape, dtype=accumulate, device=x.device)  # [T, H]
    start = 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        h = expert(e, x[tokens[rows]])  # [count, H]
        out.index_add_(0, tokens[rows], (h * pair_weights[rows]).to(accumulate))
    return out.to(x.dtype)


# Nemotron-H's experts (`UngatedExperts`), keyed by x's dtype; each implementation takes
# (experts, x, routing) -> [T, dim]:
#   float32 and bfloat16 on a CPU      native (`relu2_experts_fit`: the relu2 activation, float32
#     with AVX2, up to                   routing weights; `ops.native.moe.vector_relu2_experts`:
#     NATIVE_EXPERT_ROWS tokens          every pair in one call, summed in float32 as below)
#   otherwise                          torch (`looped_experts`)
# The native link is one kernel call a layer, so that a decode step can be captured.
UNGATED_EXPERTS = declare(
    "moe_ungated_experts",
    (
        OpImpl("native", f"{__name__}:_vector_ungated", _CPU, _FLOATS, ("native", "avx2"),
               max_rows=_native_expert_rows, strict=True,
               description="moe.c: every pair of the relu2 experts in one call"),
        OpImpl("torch", f"{__name__}:torch_ungated", description="looped_experts"),
    ),
)  # fmt: skip


def relu2_experts_fit(experts: UngatedExperts, x: torch.Tensor, routing: Routing) -> bool:
    """The native relu2 experts' rule (`ops.native.moe.vector_relu2_experts`): inference; the
    relu2 activation; x [T, dim] and both weights (contiguous) float32 or bfloat16 on the CPU,
    routing weights float32 (the Router's), expert ids int64 [T, k]; the library loaded."""
    from hybridkv.ops import native

    if torch.is_grad_enabled() or experts.act is not relu2 or x.dim() != 2:
        return False
    up, down = experts.up_proj, experts.down_proj
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        return False
    if any(w.dtype != x.dtype or w.device.type != "cpu" or not w.is_contiguous()
           for w in (up, down)):  # fmt: skip
        return False
    chosen, weights = routing
    if chosen.dtype != torch.int64 or weights.dtype != torch.float32 or chosen.dim() != 2:
        return False
    if weights.shape != chosen.shape or chosen.shape[0] != x.shape[0]:
        return False
    return x.shape[1] == up.shape[2] and native.library() is not None


def _vector_ungated(
    experts: UngatedExperts, x: torch.Tensor, routing: Routing
) -> torch.Tensor | None:
    from hybridkv.ops.native import moe

    chosen, weights = routing
    return moe.vector_relu2_experts(x, chosen, weights, experts.up_proj, experts.down_proj)


def torch_ungated(experts: UngatedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    return looped_experts(x, routing, experts.num_experts, experts._expert, torch.float32)


class UngatedExperts(nn.Module):
    """Stacked non-gated expert MLPs, down(act(up x)): up_proj [E, I, H], down_proj [E, H, I]
    (Nemotron-H); the weighted outputs summed in float32, as transformers does. The
    `UNGATED_EXPERTS` chain of x's dtype (native: relu2, `relu2_experts_fit`)."""

    def __init__(
        self, num_experts: int, dim: int, intermediate: int, act: Callable[..., torch.Tensor]
    ) -> None:
        super().__init__()
        tp, full = current(), intermediate
        intermediate = tp.split(full, "moe_intermediate_size")  # every expert's slice
        self.num_experts, self.act = num_experts, act
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        declare_shards(
            self, up_proj=column(tp, (0, full), dim=1), down_proj=column(tp, (0, full), dim=2)
        )

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """rows: [n, dim] -> [n, dim]."""
        return F.linear(self.act(F.linear(rows, self.up_proj[e])), self.down_proj[e])

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, dim]; routing weights float32 (the Router's) -> [T, dim]."""
        chain = UNGATED_EXPERTS.of(x)
        if chain.links[0].impl.name == "native" and not relu2_experts_fit(self, x, routing):
            chain = UNGATED_EXPERTS.chain(x.device, x.dtype, ("native",))
        return chain.for_rows(x.shape[0])(self, x, routing)


# gpt-oss's experts (`ClampedSwigluExperts`), keyed by x's dtype; each implementation takes
# (experts, x, routing) -> [T, H]:
#   float32 and bfloat16 on a CPU      native (`clamped_experts_fit`: routing weights of x's
#     with AVX2, up to                   dtype; `ops.native.moe.vector_clamped_experts` on the
#     NATIVE_EXPERT_ROWS tokens          weights as the checkpoint stores them (x @ W, gate and
#                                        up interleaved: read in place, no second copy of the
#                                        experts): every pair in one call, summed in x's dtype
#                                        as below)
#   otherwise                          torch (`looped_experts`)
# The native link is one kernel call a layer, so that a decode step can be captured.
CLAMPED_EXPERTS = declare(
    "moe_clamped_experts",
    (
        OpImpl("native", f"{__name__}:_vector_clamped", _CPU, _FLOATS, ("native", "avx2"),
               max_rows=_native_expert_rows, strict=True,
               description="moe.c: every pair of gpt-oss's clamped SwiGLU experts in one call"),
        OpImpl("torch", f"{__name__}:torch_clamped", description="looped_experts"),
    ),
)  # fmt: skip


def clamped_experts_fit(experts: ClampedSwigluExperts, x: torch.Tensor, routing: Routing) -> bool:
    """The native clamped experts' rule (`ops.native.moe.vector_clamped_experts`): inference;
    x [T, H] and the four weights float32 or bfloat16 on the CPU, all of one dtype (the two
    projections contiguous: the kernel reads them in place); routing
    weights of x's dtype (the Router's, gpt-oss's rule scoring in the model dtype), expert ids
    int64 [T, k]; the library loaded."""
    from hybridkv.ops import native

    if torch.is_grad_enabled() or x.dim() != 2 or x.device.type != "cpu":
        return False
    if x.dtype not in (torch.float32, torch.bfloat16) or x.shape[1] != experts.hidden:
        return False
    weights = (experts.gate_up_proj, experts.gate_up_proj_bias, experts.down_proj,
               experts.down_proj_bias)  # fmt: skip
    if any(w.dtype != x.dtype or w.device.type != "cpu" for w in weights):
        return False
    if not (experts.gate_up_proj.is_contiguous() and experts.down_proj.is_contiguous()):
        return False  # (read in place)
    chosen, routing_weights = routing
    if chosen.dtype != torch.int64 or routing_weights.dtype != x.dtype or chosen.dim() != 2:
        return False
    if routing_weights.shape != chosen.shape or chosen.shape[0] != x.shape[0]:
        return False
    return native.library() is not None


def _vector_clamped(
    experts: ClampedSwigluExperts, x: torch.Tensor, routing: Routing
) -> torch.Tensor | None:
    from hybridkv.ops.native import moe

    gate_up, gate_up_bias, down, down_bias = experts.native_weights()
    chosen, weights = routing
    return moe.vector_clamped_experts(
        x, chosen, weights, gate_up, gate_up_bias, down, down_bias, experts.alpha, experts.limit
    )


def torch_clamped(experts: ClampedSwigluExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    return looped_experts(x, routing, experts.num_experts, experts._expert, x.dtype)


class ClampedSwigluExperts(nn.Module):
    """gpt-oss's experts as its checkpoints store them (x @ W): gate_up_proj [E, H, 2I] (gate at
    even columns, up at odd), gate_up_proj_bias [E, 2I], down_proj [E, I, H], down_proj_bias
    [E, H]; activation (up + 1) * gate * sigmoid(alpha * gate), gate clamped above at `limit`,
    up to +-limit. The `CLAMPED_EXPERTS` chain of x's dtype (native: `clamped_experts_fit`, on
    the weights as `native_weights` lays them out). Tensor parallel: interleaved (gate, up)
    pairs keep a slice contiguous; the down bias is added by rank 0 only."""

    def __init__(
        self, num_experts: int, hidden: int, intermediate: int, alpha: float, limit: float
    ) -> None:
        super().__init__()
        tp, full = current(), intermediate
        i = tp.split(full, "intermediate_size")
        self.num_experts, self.hidden, self.alpha, self.limit = num_experts, hidden, alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, hidden, 2 * i))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * i))
        self.down_proj = nn.Parameter(torch.empty(num_experts, i, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden))
        declare_shards(
            self, gate_up_proj=column(tp, (0, 2 * full), dim=2),
            gate_up_proj_bias=column(tp, (0, 2 * full), dim=1),
            down_proj=column(tp, (0, full), dim=1), down_proj_bias=rank0_bias(tp),
        )  # fmt: skip

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: [n, 2I] (gate at even columns, up at odd) -> [n, I], the clamped SwiGLU."""
        gate = gate_up[:, 0::2].clamp(max=self.limit)
        up = gate_up[:, 1::2].clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _expert(self, e: int, rows: torch.Tensor) -> torch.Tensor:
        """rows: [n, H] -> [n, H]."""
        h = rows @ self.gate_up_proj[e] + self.gate_up_proj_bias[e]  # [n, 2I]
        return self.activation(h) @ self.down_proj[e] + self.down_proj_bias[e]

    def native_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The weights as the native kernel reads them: the parameters themselves (x @ W, gate
        and up interleaved; moe.c's moe_linear_cols reads that layout, so a model of hundreds of
        experts keeps one copy of them), contiguous biases."""
        return (
            self.gate_up_proj,
            derived(self.gate_up_proj_bias, "contiguous", torch.Tensor.contiguous),
            self.down_proj,
            derived(self.down_proj_bias, "contiguous", torch.Tensor.contiguous),
        )

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H]; routing weights of x's dtype -> [T, H], summed in x's dtype."""
        chain = CLAMPED_EXPERTS.of(x)
        if chain.links[0].impl.name == "native" and not clamped_experts_fit(self, x, routing):
            chain = CLAMPED_EXPERTS.chain(x.device, x.dtype, ("native",))
        return chain.for_rows(x.shape[0])(self, x, routing)


# -- blocks ------------------------------------------------------------------------------------


class _GraniteRouter(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False)


class _ExpertWeights(nn.Module):
    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class GraniteMoE(nn.Module):
    """GraniteMoeHybrid's `block_sparse_moe`: router.layer [E, H] (topk_softmax), SwiGLU experts
    input_linear.weight [E, 2I, H] and output_linear.weight [E, H, I]."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.tp = tp = current()
        full = intermediate_size
        intermediate_size = tp.split(full, "intermediate_size")  # every expert's slice
        self.top_k, self.num_experts = top_k, num_experts
        self.rule = RoutingRule(top_k, "topk_softmax")
        self.router = _GraniteRouter(hidden_size, num_experts)
        self.input_linear = _ExpertWeights(num_experts, 2 * intermediate_size, hidden_size)
        self.output_linear = _ExpertWeights(num_experts, hidden_size, intermediate_size)
        declare_shards(self.input_linear, weight=column(tp, (0, full), (full, full), dim=1))
        declare_shards(self.output_linear, weight=column(tp, (0, full), dim=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; tensor parallel: this rank's partial sum (the caller
        all-reduces it)."""
        experts, weights = route(x, self.router.layer, self.rule)  # [T, k] each
        gate_up, down = self.input_linear.weight, self.output_linear.weight
        return gated_experts(x, experts, weights.to(x.dtype), gate_up, down)


class SharedExpertsMoE(nn.Module):
    """A Router `gate`, GatedExperts `experts` and always-on `shared_experts` (a GatedMLP):
    DeepSeek-V2 / V3, Kimi-Linear. Tensor parallel: every rank routes alike (replicated
    router); the experts' and shared experts' partial sums are all-reduced once."""

    def __init__(self, gate: Router, experts: GatedExperts, shared_experts: GatedMLP) -> None:
        super().__init__()
        self.tp = current()
        self.gate, self.experts, self.shared_experts = gate, experts, shared_experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        routing = self.gate(x, x.dtype)  # weights in x's dtype, as the experts take them
        out = residual_add(self.experts(x, routing), self.shared_experts(x, reduce=False))
        return self.tp.all_reduce(out)


def gated_shared_expert_native(
    x: torch.Tensor,
    gate: nn.Linear,
    rule: RoutingRule,
    experts: GatedExperts,
    shared: GatedMLP,
    shared_gate: nn.Linear,
) -> torch.Tensor | None:
    """experts(x, rule(gate(x))) + sigmoid(shared_gate(x)) * shared(x) (Qwen3-Next's sparse
    block, this rank's partial sum) in bfloat16 on a CPU with AMX, computed as the PyTorch ops
    compute it: the router (both gates' products, softmax, top-k, renormalisation and the
    sigmoid) in one pass per token, the shared expert on AMX (its gate and silu fused; as fast
    as oneDNN's three linears at 300-1740 tokens, faster at decode sizes), and the routed
    experts with the shared output added last. x: [T, H] -> [T, H]; None where any of it does
    not apply (the caller's PyTorch path runs): the `MOE_ROUTE` chain of x's dtype starts
    with the native router and the router and experts take these tensors (`native_route_fits`
    with the shared gate, `mlp.amx_experts_fit`), checked before anything runs."""
    if MOE_ROUTE.of(x).links[0].impl.name != "native-amx":
        return None
    if not native_route_fits(x, gate, rule, None, shared_gate):
        return None
    from hybridkv.ops.native import moe

    gate_up, down = experts.gate_up_proj, experts.down_proj
    routing = moe.route(x, gate.weight, shared_gate.weight, rule.top_k, rule.native_mode)
    if routing is None:  # (native_route_fits holds: never)
        raise RuntimeError("the native router declined tensors native_route_fits accepted")
    chosen, weights, scale = routing  # [T, k], [T, k], [T, 1]
    if not amx_experts_fit(x, chosen, weights, gate_up, down):
        return None
    out = None
    if shared.gate_proj.bias is None:
        # (None where the shared expert's weights are not three bias-free SwiGLU matrices)
        out = moe.swiglu_expert(
            x, shared.gate_proj.weight, shared.up_proj.weight, shared.down_proj.weight, scale
        )
    if out is None:
        out = scale * shared(x, reduce=False)
    return moe.routed_experts(x, chosen, weights, gate_up, down, extra=out)
