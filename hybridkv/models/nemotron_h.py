"""NVIDIA Nemotron-H, Nemotron-Nano-v2 and Nemotron-3-Nano (NemotronHForCausalLM).

Every layer is one pre-norm residual block around a single mixer:

    x = embeddings(ids)
    per layer:  x += mixer(norm(x))     mixer: 'M' Mamba2 | '*' attention | '-' MLP | 'E' MoE
    logits = lm_head(norm_f(x))

- Layout: `layers_block_type` (transformers 5 writes linear_attention / full_attention / mlp /
  moe) or `hybrid_override_pattern` (M / * / - / E, what the hub checkpoints carry).
- Attention: no position embedding at all (no RoPE), scores scaled by 1/sqrt(head_dim), no biases.
- MLP: down_proj(relu2(up_proj(x))) with relu2(x) = relu(x)^2 (`mlp_hidden_act`), no gate.
- MoE (Nemotron-3-Nano): a float32 sigmoid router; `e_score_correction_bias` only changes which
  experts are chosen (grouped top-k: the best `topk_group` of `n_group` expert groups, scored by
  the sum of each group's top-2); weights are the chosen experts' sigmoid scores, normalised to
  sum 1 (`norm_topk_prob`) and times `routed_scaling_factor`. Experts are non-gated relu2 MLPs,
  optionally between `fc1_latent_proj` / `fc2_latent_proj` (`moe_latent_size`); one shared expert
  MLP sees the block input. Routed outputs accumulate in float32, as transformers does.
- Norms: RMSNorm that multiplies the weight in float32 (eps `layer_norm_epsilon`).
- Mamba2: see `hybridkv.layers.mamba2` (intermediate = mamba_num_heads * mamba_head_dim,
  dt_limit = (time_step_min, inf), gated norm grouped by n_groups).

Checkpoints name tensors `backbone.*` with one tensor per expert
(`mixer.experts.{e}.up_proj.weight`); transformers 5 holds them as `model.*` with stacked
`mixer.experts.up_proj` [experts, inter, dim] and writes the checkpoint form back on save. Both
spellings load here. transformers keeps the router (`gate.weight`, `e_score_correction_bias`) in
float32 whatever the model dtype; so does this model. Word embeddings are never tied (transformers'
NemotronH declares no tied weights).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kv.specs import CacheLayer
from hybridkv.layers.attention.self_attention import SelfAttention
from hybridkv.layers.mlp import RMSNorm
from hybridkv.layers.state_layers import PagedMamba2Mixer
from hybridkv.models.base import CausalLM
from hybridkv.worker.batch import ForwardBatch

# block-type spellings -> one pattern character
BLOCK_KINDS = {
    "m": "M", "mamba": "M", "linear_attention": "M",
    "*": "*", "attention": "*", "full_attention": "*",
    "-": "-", "mlp": "-",
    "e": "E", "moe": "E",
}  # fmt: skip

# checkpoint form of one expert's weight: prefix, expert index, projection
EXPERT_WEIGHT = re.compile(
    r"^(backbone\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$"
)


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": _relu2,
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported mlp_hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def block_kinds(cfg: dict[str, Any]) -> list[str]:
    """Per layer 'M', '*', '-' or 'E' from `layers_block_type` / `layer_types` (lists) or
    `hybrid_override_pattern` (a string)."""
    tokens = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not isinstance(tokens, list):
        tokens = cfg.get("hybrid_override_pattern")
    if not isinstance(tokens, list | str) or not tokens:
        raise ValueError("NemotronH config.json needs layers_block_type or hybrid_override_pattern")
    kinds = [BLOCK_KINDS.get(str(t).strip().lower()) for t in tokens]
    if None in kinds:
        bad = sorted({str(t) for t, k in zip(tokens, kinds, strict=True) if k is None})
        raise ValueError(f"unknown NemotronH block types {bad}; known: {sorted(BLOCK_KINDS)}")
    return kinds  # type: ignore[return-value]


def _first(cfg: dict[str, Any], keys: tuple[str, ...], default: Any) -> Any:
    """The first key present (current name first, then the names older configs used)."""
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def mamba2_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mamba2 mixer arguments of NemotronH (defaults: transformers' NemotronHConfig)."""
    time_step_min = float(_first(cfg, ("time_step_min", "mamba_dt_min"), 0.001))
    return dict(
        hidden_size=cfg["hidden_size"], n_heads=cfg["mamba_num_heads"],
        head_dim=cfg["mamba_head_dim"], d_state=cfg["ssm_state_size"],
        n_groups=_first(cfg, ("n_groups", "mamba_n_groups"), 8),
        d_conv=_first(cfg, ("conv_kernel", "mamba_d_conv"), 4),
        chunk_size=_first(cfg, ("chunk_size", "mamba_chunk_size"), 128),
        conv_bias=bool(_first(cfg, ("use_conv_bias", "mamba_conv_bias"), True)),
        proj_bias=bool(cfg.get("use_bias", False)),
        norm_eps=float(cfg.get("layer_norm_epsilon", 1e-5)),
        dt_limit=(time_step_min, math.inf),
        activation=cfg.get("mamba_hidden_act", "silu"),
    )  # fmt: skip


class NemotronHMLP(nn.Module):
    """down_proj(act(up_proj(x))), no gate (the '-' blocks and the MoE's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class NemotronHRouter(nn.Module):
    """Sigmoid top-k router with grouped selection and a selection-only score bias (float32)."""

    def __init__(self, cfg: dict[str, Any], hidden: int, num_experts: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = int(cfg.get("num_experts_per_tok", 2))
        self.n_group = int(cfg.get("n_group", 1) or 1)
        self.topk_group = int(cfg.get("topk_group", 1) or 1)
        self.norm_topk_prob = bool(cfg.get("norm_topk_prob", True))
        self.scaling = float(cfg.get("routed_scaling_factor", 1.0))
        if num_experts % self.n_group:
            raise ValueError(f"n_routed_experts {num_experts} is not a multiple of n_group")
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        """Move with the model but stay float32 (transformers' `_keep_in_fp32_modules_strict`)."""

        def keep_fp32(t: torch.Tensor) -> torch.Tensor:
            out = fn(t)
            if out.is_floating_point() and out.dtype != torch.float32:
                return t.to(device=out.device, dtype=torch.float32)
            return out

        return super()._apply(keep_fp32, recurse)

    def _keep_best_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """choice: [T, E] -> the same with experts outside the best `topk_group` groups at -inf."""
        t = choice.shape[0]
        grouped = choice.view(t, self.n_group, self.num_experts // self.n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        return grouped.masked_fill(~keep[..., None], float("-inf")).view(t, self.num_experts)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, hidden] -> weights [T, k] float32, expert ids [T, k] int64."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_group < self.n_group:
            choice = self._keep_best_groups(choice)
        experts = choice.topk(self.top_k, dim=-1, sorted=False).indices  # [T, k]
        weights = scores.gather(1, experts)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, experts


class NemotronHExperts(nn.Module):
    """Stacked non-gated expert MLPs: up_proj [E, inter, dim], down_proj [E, dim, inter]."""

    def __init__(self, num_experts: int, dim: int, intermediate: int, act: str) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.up_proj = nn.Parameter(torch.empty(num_experts, intermediate, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, intermediate))
        self.act = activation(act)

    def forward(
        self, x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """x: [T, dim]; experts, weights: [T, k] -> sum of weighted expert outputs [T, dim].

        The T * k (token, expert) pairs are sorted by expert once; then one loop over the
        experts that got tokens, each running on all of its tokens at once.
        """
        k = experts.shape[1]
        flat = experts.reshape(-1)  # [T * k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        tokens = order // k  # [T * k] token of each sorted pair
        pair_weights = weights.reshape(-1)[order]  # [T * k] float32
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, dim]
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = slice(start, start + count)
            start += count
            h = self.act(F.linear(x[tokens[rows]], self.up_proj[expert]))  # [n, inter]
            h = F.linear(h, self.down_proj[expert])  # [n, dim]
            out.index_add_(0, tokens[rows], h * pair_weights[rows, None])
        return out.to(x.dtype)


class NemotronHMoE(nn.Module):
    def __init__(self, cfg: dict[str, Any]) -> None:
        super().__init__()
        hidden, act = cfg["hidden_size"], cfg.get("mlp_hidden_act", "relu2")
        bias = bool(cfg.get("mlp_bias", False))
        num_experts = int(_first(cfg, ("n_routed_experts", "num_local_experts"), 8))
        latent = cfg.get("moe_latent_size")
        dim = int(latent) if latent else hidden
        self.gate = NemotronHRouter(cfg, hidden, num_experts)
        self.experts = NemotronHExperts(num_experts, dim, cfg["moe_intermediate_size"], act)
        self.shared_experts = NemotronHMLP(
            hidden, cfg["moe_shared_expert_intermediate_size"], act, bias
        )
        self.fc1_latent_proj = nn.Linear(hidden, dim, bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(dim, hidden, bias=bias) if latent else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; the router and the shared expert see x, the experts its latent
        weights, experts = self.gate(x)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        h = self.experts(h, experts, weights)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        return h + self.shared_experts(x)


def build_mixer(cfg: dict[str, Any], index: int, kind: str) -> nn.Module:
    if kind == "M":
        return PagedMamba2Mixer(f"layers.{index}.mamba", **mamba2_kwargs(cfg))
    if kind == "*":
        return SelfAttention(f"layers.{index}.attention", cfg, bias=False)
    if kind == "E":
        return NemotronHMoE(cfg)
    return NemotronHMLP(
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg.get("mlp_hidden_act", "relu2"),
        bool(cfg.get("mlp_bias", False)),
    )


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        eps = float(cfg.get("layer_norm_epsilon", 1e-5))
        self.norm = RMSNorm(cfg["hidden_size"], eps, weight_in_fp32=True)
        self.mixer = build_mixer(cfg, index, kind)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.norm(x)  # [T, hidden]
        h = self.mixer(h, batch) if self.kind in ("M", "*") else self.mixer(h)
        return x + h


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: dict[str, Any], kinds: list[str]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.embeddings = nn.Embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, k) for i, k in enumerate(kinds))
        self.norm_f = RMSNorm(hidden, float(cfg.get("layer_norm_epsilon", 1e-5)), True)


class NemotronHForCausalLM(CausalLM):
    def __init__(self, config: dict[str, Any], cache_layers: list[CacheLayer]) -> None:
        super().__init__(config, cache_layers)
        self.tie_word_embeddings = False  # transformers' NemotronH never ties them
        kinds = block_kinds(config)
        self._check_cache_layers(kinds)
        self.num_experts = int(_first(config, ("n_routed_experts", "num_local_experts"), 8))
        self.backbone = NemotronHBackbone(config, kinds)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    def _check_cache_layers(self, kinds: list[str]) -> None:
        """The cache layers must be exactly the Mamba2 and attention blocks of the layout."""
        own = {f"layers.{i}.mamba" for i, k in enumerate(kinds) if k == "M"}
        own |= {f"layers.{i}.attention" for i, k in enumerate(kinds) if k == "*"}
        if own != set(self.cache_layers):
            raise ValueError(
                f"NemotronH layout {''.join(kinds)!r} does not match the cache layers "
                f"{sorted(self.cache_layers)}"
            )

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith("model."):  # transformers' in-memory prefix
            return "backbone." + name[len("model.") :]
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._stack_experts(weights))

    def _stack_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert checkpoint tensors -> one stacked tensor per layer and projection (yielded
        once all experts of it arrived); every other tensor passes through."""
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for ckpt_name, tensor in weights:
            name = self.map_weight_name(ckpt_name)
            match = EXPERT_WEIGHT.match(name or "")
            if match is None:
                yield ckpt_name, tensor
                continue
            prefix, expert, proj = match.groups()
            stacked = f"{prefix}.{proj}"
            parts = pending.setdefault(stacked, {})
            parts[int(expert)] = tensor  # [out, in]
            if len(parts) == self.num_experts:
                del pending[stacked]
                if sorted(parts) != list(range(self.num_experts)):
                    raise ValueError(f"{stacked}: expert ids {sorted(parts)} in checkpoint")
                yield stacked, torch.stack([parts[e] for e in range(self.num_experts)])
        if pending:
            got = {name: len(parts) for name, parts in pending.items()}
            raise ValueError(f"checkpoint lacks some of the {self.num_experts} experts: {got}")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.backbone.embeddings(batch.input_ids)  # [T, hidden]
        for layer in self.backbone.layers:
            x = layer(x, batch)
        return self.backbone.norm_f(x)
