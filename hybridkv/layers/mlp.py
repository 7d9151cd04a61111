"""Feed-forward blocks: RMSNorm modules, SwiGLU MLPs and `gated_experts`, the routed SwiGLU
experts' computation (the mixture-of-experts blocks and routers: `hybridkv.layers.moe`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.layers.activation import silu_and_mul, silu_mul
from hybridkv.ops.derived import derived
from hybridkv.ops.native import bf16_linear as native_bf16
from hybridkv.ops.native import moe as native_moe
from hybridkv.ops.norm import add_rms_norm, rms_norm


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

    The T * k (token, expert) pairs are sorted by expert once:

        pairs   (t0,e2) (t0,e0) (t1,e0) (t1,e1) ...  -> order ->  e0 e0 | e1 | e2 ...
        tokens  the token of each sorted pair; counts[e] pairs per expert

    Few pairs per expert (decode): in bfloat16 on the CPU, per expert hit the native small-batch
    kernel (its weights streamed once); otherwise one bmm over all experts, each group padded to
    the busiest (rows of a zero token), and the weighted rows go back to their tokens in one
    index_add_. Many (prefill): per expert hit, gather its rows, two GEMMs, add them back.
    Per expert, a token's outputs are added in expert order, rounded to x's dtype after each;
    the one index_add_ of the batched path adds them in its own order (in bfloat16 on the CPU
    it was seen to sum a token's rows in float32 and round once), so the two differ in the
    last bits of bfloat16 outputs, each within bfloat16's rounding.

    bfloat16 on a CPU with AMX: all of it in one native call (`ops.native.moe`: the pairs
    sorted, each expert's groups of up to 32 pairs through both GEMMs on AMX tiles, the same
    roundings as the paths below), at every batch size.
    """
    routed = native_moe.routed_experts(x, experts, weights, gate_up, down)
    if routed is not None:
        return routed
    num_experts, k = gate_up.shape[0], experts.shape[1]
    flat = experts.reshape(-1)  # [T * k]
    order = torch.argsort(flat, stable=True)
    tokens = order // k  # [T * k]: the token of each sorted pair
    pair_weights = weights.reshape(-1)[order, None]  # [T * k, 1]
    counts = torch.bincount(flat, minlength=num_experts)
    busiest = int(counts.max()) if flat.numel() else 0
    out = torch.zeros_like(x)
    small = busiest <= native_bf16.SMALL_M and _small_kernel_fits(x, gate_up, down)
    batched = 0 < busiest <= BATCHED_EXPERT_ROWS and num_experts * busiest <= 2 * flat.numel()
    if batched and not small:
        ys = _experts_batched(x, tokens, counts, busiest, gate_up, down)  # [T * k, H]
        return out.index_add_(0, tokens, ys * pair_weights)
    linear = native_bf16.bf16_linear if small else F.linear
    start = 0
    for expert, count in enumerate(counts.tolist()):
        if count == 0:
            continue
        rows = slice(start, start + count)
        start += count
        # gathered per expert, so a group's rows stay in cache through both GEMMs
        h = silu_and_mul(linear(x[tokens[rows]], gate_up[expert]))  # [count, I]
        out.index_add_(0, tokens[rows], linear(h, down[expert]) * pair_weights[rows])
    return out


def _small_kernel_fits(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the experts' GEMMs of a few rows each take the native bf16 kernel (which streams
    each expert's weights once, where a bmm of padded groups runs far below that)."""
    return (
        x.dtype == torch.bfloat16 and gate_up.dtype == down.dtype == torch.bfloat16
        and gate_up.is_contiguous() and down.is_contiguous() and x.device.type == "cpu"
        and not torch.is_grad_enabled() and native_bf16.kernel() is not None
    )  # fmt: skip


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
