"""Feed-forward blocks: RMSNorm module, SwiGLU MLPs and the GraniteMoeHybrid mixture of experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.ops import native
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * inter] = [gate | up] -> silu(gate) * up: [..., inter]."""
    out = native.silu_and_mul(x)  # float32 on the CPU: one pass
    if out is not None:
        return out
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


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
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return self.tp.all_reduce(out) if reduce else out


class _Router(nn.Module):
    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.layer = nn.Linear(hidden_size, num_experts, bias=False)


class _ExpertWeights(nn.Module):
    def __init__(self, num_experts: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, out_features, in_features))


class GraniteMoE(nn.Module):
    """Top-k routed experts with stacked weights (checkpoint names `block_sparse_moe.*`).

    router logits -> top-k -> softmax over the k chosen -> each expert runs SwiGLU on the tokens
    routed to it; outputs are summed weighted. Tokens are grouped by expert with one sort, then
    one loop over the experts that received tokens (not over tokens).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int):
        super().__init__()
        self.tp = tp = current()
        full = intermediate_size
        intermediate_size = tp.split(full, "intermediate_size")  # every expert's slice
        self.top_k = top_k
        self.num_experts = num_experts
        self.router = _Router(hidden_size, num_experts)
        self.input_linear = _ExpertWeights(num_experts, 2 * intermediate_size, hidden_size)
        self.output_linear = _ExpertWeights(num_experts, hidden_size, intermediate_size)
        declare_shards(self.input_linear, weight=column(tp, (0, full), (full, full), dim=1))
        declare_shards(self.output_linear, weight=column(tp, (0, full), dim=2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; tensor parallel: this rank's partial sum (the caller
        all-reduces it)."""
        # x: [T, hidden]; logits: [T, experts] (routing in float32, as the reference does)
        logits = self.router.layer(x).float()
        top_logits, top_idx = logits.topk(self.top_k, dim=-1)  # [T, k]
        weights = torch.softmax(top_logits, dim=-1).to(x.dtype)
        flat_expert = top_idx.reshape(-1)  # [T * k]
        order = torch.argsort(flat_expert, stable=True)
        token_of = order // self.top_k
        counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
        out = torch.zeros_like(x)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = order[start : start + count]
            tokens = token_of[start : start + count]
            start += count
            h = silu_and_mul(F.linear(x[tokens], self.input_linear.weight[expert]))
            h = F.linear(h, self.output_linear.weight[expert])
            out.index_add_(0, tokens, h * weights.reshape(-1)[rows, None])
        return out


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose weight is stored centred on zero: x_hat * (1 + weight), multiplied in
    float32 and cast once (Qwen3-Next, Qwen3.5; the checkpoints hold `weight`, initialised 0)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__(hidden_size, eps, weight_in_fp32=True)
        nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, 1.0 + self.weight.float(), self.eps, weight_in_fp32=True)

    def add_forward(
        self, x: torch.Tensor, h: torch.Tensor, multiplier: float = 1.0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, h, multiplier, 1.0 + self.weight.float(), self.eps, True)
