"""Feed-forward blocks: RMSNorm modules, SwiGLU MLPs and `gated_experts`, the routed SwiGLU
experts' computation (the mixture-of-experts blocks and routers: `hybridkv.layers.moe`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.layers.activation import silu_and_mul, silu_mul
from hybridkv.ops.derived import derived
from hybridkv.ops.norm import add_rms_norm, rms_norm
from hybridkv.ops.registry import Chain, OpImpl, capabilities, declare


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, weight_in_fp32=self.weight_in_fp32)

    def add_forward(
        self, x: torch.Tensor, h: torch.Tensor, multiplier: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x + h * multiplier and its norm, fused where possible."""
        return add_rms_norm(x, h, multiplier, self.weight, self.eps, self.weight_in_fp32)


# Below this many pairs per expert one batched matmul over every expert (padded to the busiest
# one) beats a loop of small ones; past it each expert's GEMM is large enough on its own.
BATCHED_EXPERT_ROWS = 64


# Tokens up to which the native experts of every build run (`native` in MOE_EXPERTS: the
# small-batch linears, decode-sized); more tokens take it while the busiest expert has at most
# this many pairs (prefill with many experts), else the PyTorch path.
NATIVE_EXPERT_ROWS = 64


def _native_expert_rows() -> int:
    return NATIVE_EXPERT_ROWS  # (read at the call: a test may change it)


# The routed SwiGLU experts (`gated_experts`), keyed by x's dtype; each implementation takes
# (x, pairs: ExpertPairs, gate_up, down); the rows of a call: its tokens when at most the first
# link's max_rows (no expert has more pairs), else its busiest expert's pairs:
#   bfloat16 on a CPU with AMX    native-amx (every size: `ops.native.moe.routed_experts`)
#   float32, and bfloat16         native (`ops.native.moe.vector_experts`: every pair in one
#     without AMX, on a CPU         call, each expert hit's products on the small-batch
#     with AVX2                     linears; rows <= NATIVE_EXPERT_ROWS), torch
#   other devices, no AVX2        torch (a padded bmm or a loop of F.linear per expert)
# The native links are one kernel call a layer that reads the routing from its tensors, so
# that a decode step of a MoE model can be captured (hybridkv/worker/graphs.py).
_CPU, _BF16, _HERE = frozenset({"cpu"}), frozenset({"bfloat16"}), f"{__name__}:"
_FLOATS = frozenset({"float32", "bfloat16"})
MOE_EXPERTS = declare(
    "moe_experts",
    (
        OpImpl("native-amx", _HERE + "_native_amx_experts", _CPU, _BF16, ("native", "amx_bf16"),
               strict=True, description="moe.c: every pair on AMX tiles in one call"),
        OpImpl("native", _HERE + "_native_experts", _CPU, _FLOATS, ("native", "avx2"),
               max_rows=_native_expert_rows, strict=True,
               description="moe.c: every pair in one call, on the small-batch linears"),
        OpImpl("torch", _HERE + "torch_experts",
               description="one padded bmm (few pairs per expert) or F.linear per expert"),
    ),
)  # fmt: skip


class ExpertPairs:
    """The T * k (token, expert) pairs of a call, sorted by expert on first use:

    pairs   (t0,e2) (t0,e0) (t1,e0) (t1,e1) ...  -> order ->  e0 e0 | e1 | e2 ...
    tokens  the token of each sorted pair; counts[e] pairs per expert
    """

    def __init__(self, experts: torch.Tensor, weights: torch.Tensor, num_experts: int) -> None:
        self.experts, self.weights, self.num_experts = experts, weights, num_experts
        self._sorted: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None

    def _sort(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        if self._sorted is None:
            k = self.experts.shape[1]
            flat = self.experts.reshape(-1)  # [T * k]
            order = torch.argsort(flat, stable=True)
            tokens = order // k  # [T * k]: the token of each sorted pair
            pair_weights = self.weights.reshape(-1)[order, None]  # [T * k, 1]
            counts = torch.bincount(flat, minlength=self.num_experts)
            busiest = int(counts.max()) if flat.numel() else 0
            self._sorted = tokens, pair_weights, counts, busiest
        return self._sorted

    @property
    def tokens(self) -> torch.Tensor:
        return self._sort()[0]

    @property
    def pair_weights(self) -> torch.Tensor:
        return self._sort()[1]

    @property
    def counts(self) -> torch.Tensor:
        return self._sort()[2]

    @property
    def busiest(self) -> int:
        return self._sort()[3]


def gated_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Routed SwiGLU experts: out[t] = sum_j weights[t, j] * E_{experts[t, j]}(x[t]) with
    E_e(v) = down[e] @ (silu(g) * u), [g | u] = gate_up[e] @ v.

    x: [T, H]; experts, weights: [T, k] (weights in x's dtype); gate_up: [E, 2I, H];
    down: [E, H, I] -> [T, H] (tensor parallel: this rank's partial sum).

    The `MOE_EXPERTS` chain of x's dtype runs, less the native links whose rules these tensors
    break (`amx_experts_fit`, `vector_experts_fit`): its first link when it takes T rows (no
    expert has more pairs than T: nothing counted, so that a captured decode step stays one
    kernel call), else the link for the busiest expert's pairs:

    - torch: few pairs per expert (decode), one bmm over all experts, each group padded to
      the busiest (rows of a zero token), and the weighted rows go back to their tokens in one
      index_add_; many (prefill): per expert hit, gather its rows, two GEMMs, add them back.
    - native (float32, and bfloat16 without AMX; up to NATIVE_EXPERT_ROWS rows): all of it in
      one native call (`ops.native.moe.vector_experts`: the pairs sorted, per expert hit both
      products on the small-batch linears, each weight streamed once; the per-expert loop's
      roundings).
    - native-amx (bfloat16 on a CPU with AMX): all of it in one native call (`ops.native.moe`:
      the pairs sorted, each expert's groups of up to 32 pairs through both GEMMs on AMX tiles,
      the same roundings as the per-expert paths), at every batch size.

    Per expert, a token's outputs are added in expert order, rounded to x's dtype after each;
    the one index_add_ of the batched path adds them in its own order (in bfloat16 on the CPU
    it was seen to sum a token's rows in float32 and round once), so the two differ in the
    last bits of bfloat16 outputs, each within bfloat16's rounding.
    """
    pairs = ExpertPairs(experts, weights, gate_up.shape[0])
    chain = experts_chain(x, experts, weights, gate_up, down)
    first = chain.links[0]
    if first.max_rows is None or x.shape[0] <= first.max_rows:
        return first.run(x, pairs, gate_up, down)
    return chain.for_rows(pairs.busiest)(x, pairs, gate_up, down)


def experts_chain(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> Chain:
    """The `MOE_EXPERTS` chain for these tensors: x's, as if without AMX where the AMX kernel
    does not take them and without the native kernels where neither does."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return MOE_EXPERTS.of(x)
    amx = x.dtype == torch.bfloat16 and "amx_bf16" in capabilities("cpu")
    if amx and amx_experts_fit(x, experts, weights, gate_up, down):
        return MOE_EXPERTS.of(x)
    if not vector_experts_fit(x, experts, weights, gate_up, down):
        return MOE_EXPERTS.chain(x.device, x.dtype, ("native",))
    return MOE_EXPERTS.chain(x.device, x.dtype, ("amx_bf16",)) if amx else MOE_EXPERTS.of(x)


def amx_experts_fit(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    extra: torch.Tensor | None = None,
) -> bool:
    """The AMX experts kernel's rule (`ops.native.moe.routed_experts`): inference, x [T, H],
    experts (int64) and weights [T, k], gate_up [E, 2I, H], down [E, H, I] (H, I > 0), extra
    None or [T, H], all bfloat16 on the CPU; the OS granted this process AMX's tile data."""
    from hybridkv.ops.native import moe

    if torch.is_grad_enabled() or not moe.available():
        return False
    if x.dim() != 2 or experts.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        return False
    tensors = (x, weights, gate_up, down) + (() if extra is None else (extra,))
    if not all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors):
        return False
    num_experts, two_inter, hidden = gate_up.shape
    if experts.dtype != torch.int64 or x.shape[1] != hidden or two_inter % 2:
        return False
    if down.shape != (num_experts, hidden, two_inter // 2) or hidden == 0 or two_inter == 0:
        return False
    if weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        return False
    return extra is None or extra.shape == x.shape


def vector_experts_fit(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> bool:
    """The native experts kernel of every build (`ops.native.moe.vector_experts`): inference,
    x [T, H], experts (int64) and weights [T, k], gate_up [E, 2I, H] and down [E, H, I]
    contiguous, all float32 or all bfloat16 on the CPU; the native library loaded."""
    from hybridkv.ops import native

    if torch.is_grad_enabled() or x.dtype not in (torch.float32, torch.bfloat16):
        return False
    if x.dim() != 2 or experts.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        return False
    tensors = (x, weights, gate_up, down)
    if not all(t.dtype == x.dtype and t.device.type == "cpu" for t in tensors):
        return False
    if not (gate_up.is_contiguous() and down.is_contiguous()) or experts.dtype != torch.int64:
        return False
    num_experts, two_inter, hidden = gate_up.shape
    if x.shape[1] != hidden or two_inter % 2 or down.shape != (num_experts, hidden, two_inter // 2):
        return False
    if weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        return False
    return native.library() is not None


def _native_amx_experts(
    x: torch.Tensor, pairs: ExpertPairs, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor | None:
    from hybridkv.ops.native import moe

    return moe.routed_experts(x, pairs.experts, pairs.weights, gate_up, down)


def _native_experts(
    x: torch.Tensor, pairs: ExpertPairs, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor | None:
    from hybridkv.ops.native import moe

    return moe.vector_experts(x, pairs.experts, pairs.weights, gate_up, down)


def torch_experts(
    x: torch.Tensor, pairs: ExpertPairs, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    busiest, num_experts = pairs.busiest, gate_up.shape[0]
    total = pairs.experts.numel()
    if 0 < busiest <= BATCHED_EXPERT_ROWS and num_experts * busiest <= 2 * total:
        ys = _experts_batched(x, pairs.tokens, pairs.counts, busiest, gate_up, down)  # [P, H]
        return torch.zeros_like(x).index_add_(0, pairs.tokens, ys * pairs.pair_weights)
    return _looped(x, pairs, gate_up, down, F.linear)


def _looped(x, pairs, gate_up, down, linear) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Per expert hit: gather its rows, two GEMMs (`linear`), add them back to their tokens."""
    out = torch.zeros_like(x)
    tokens, pair_weights = pairs.tokens, pairs.pair_weights
    start = 0
    for expert, count in enumerate(pairs.counts.tolist()):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        # gathered per expert, so a group's rows stay in cache through both GEMMs
        h = silu_and_mul(linear(x[tokens[rows]], gate_up[expert]))  # [count, I]
        out.index_add_(0, tokens[rows], linear(h, down[expert]) * pair_weights[rows])
    return out


def _experts_batched(
    x: torch.Tensor,
    tokens: torch.Tensor,
    counts: torch.Tensor,
    busiest: int,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Every expert's pairs padded to `busiest` rows: [E, busiest, H] through two bmm ->
    the real rows, [P, H], in sorted order (experts ascending, then pairs)."""
    starts = torch.cumsum(counts, 0) - counts  # [E]: first sorted pair of each expert
    slot = torch.arange(busiest, device=x.device)  # [busiest]
    real = slot[None, :] < counts[:, None]  # [E, busiest]
    pair = (starts[:, None] + slot[None, :]).clamp(max=tokens.shape[0] - 1)
    row = torch.where(real, tokens[pair], x.shape[0])  # padding reads the zero row below
    padded = torch.cat([x, x.new_zeros(1, x.shape[1])])[row]  # [E, busiest, H]
    h = silu_and_mul(torch.bmm(padded, gate_up.transpose(1, 2)))  # [E, busiest, I]
    return torch.bmm(h, down.transpose(1, 2))[real]  # [P, H]


class FusedGateUpMLP(nn.Module):
    """SwiGLU with one fused [gate | up] projection (GraniteMoeHybrid's `shared_mlp`).
    Tensor parallel: each rank keeps its slice of the intermediate size (of gate and of up);
    `reduce=False` leaves the all-reduce of the partial output to the caller."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = tp = current()
        full = intermediate_size
        intermediate_size = tp.split(full, "shared_intermediate_size")
        self.input_linear = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = nn.Linear(intermediate_size, hidden_size, bias=False)
        declare_shards(self.input_linear, weight=column(tp, (0, full), (full, full)))
        declare_shards(self.output_linear, weight=column(tp, (0, full), dim=1))

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        out = self.output_linear(silu_and_mul(self.input_linear(x)))
        return self.tp.all_reduce(out) if reduce else out


class GatedMLP(nn.Module):
    """SwiGLU with separate gate / up / down projections (Llama, Qwen3, Bamba). Tensor
    parallel: gate/up column-parallel, down row-parallel (its output all-reduced;
    `reduce=False` leaves the all-reduce of the partial output to the caller)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.tp = tp = current()
        full = intermediate_size
        intermediate_size = tp.split(full, "intermediate_size")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        spec = column(tp, (0, full))
        for proj in (self.gate_proj, self.up_proj):
            declare_shards(proj, weight=spec, bias=spec if bias else None)
        declare_shards(self.down_proj, weight=column(tp, (0, full), dim=1))
        declare_shards(self.down_proj, bias=rank0_bias(tp) if bias else None)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        out = self.down_proj(silu_mul(gate, up))
        return self.tp.all_reduce(out) if reduce else out


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored centred on zero: x_hat * (1 + weight), multiplied in
    float32 and cast once (Qwen3-Next, Qwen3.5; the checkpoints hold `weight`, initialised 0)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, weight_in_fp32=True)
        nn.init.zeros_(self.weight)

    def _scale(self) -> torch.Tensor:
        return derived(self.weight, "one_plus_f32", lambda w: 1.0 + w.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self._scale(), self.eps, weight_in_fp32=True)

    def add_forward(
        self, x: torch.Tensor, h: torch.Tensor, multiplier: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, h, multiplier, self._scale(), self.eps, True)


def __getattr__(name: str) -> object:
    """`GraniteMoE` moved to `hybridkv.layers.moe` (which imports this module, hence the lazy
    look-up); older imports from here still find it."""
    if name == "GraniteMoE":
        from hybridkv.layers.moe import GraniteMoE

        return GraniteMoE
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
