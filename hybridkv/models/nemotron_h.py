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
  dt_limit = `time_step_limit`, default (0, inf) since transformers 5.25 (before: a lower clamp
  at `time_step_min`), gated norm grouped by n_groups).

Checkpoints name tensors `backbone.*` with one tensor per expert
(`mixer.experts.{e}.up_proj.weight`); transformers 5 holds them as `model.*` with stacked
`mixer.experts.up_proj` [experts, inter, dim] and writes the checkpoint form back on save. Both
spellings load here. transformers keeps the router (`gate.weight`, `e_score_correction_bias`) in
float32 whatever the model dtype; so does this model. Word embeddings are never tied (transformers'
NemotronH declares no tied weights).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.activation import relu2
from hybridkv.layers.attention.self_attention import SelfAttention
from hybridkv.layers.mamba2 import Mamba2Mixer
from hybridkv.layers.mlp import RMSNorm
from hybridkv.layers.moe import Router, RoutingRule, UngatedExperts
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import HFConfig, config_float, layer_types
from hybridkv.ops.elementwise import residual_add

# default layout of transformers' NemotronHConfig when config.json gives none
DEFAULT_LAYOUT = ("mamba", "moe", "attention", "mlp")

# checkpoint form of one expert's weight: prefix, expert index, projection
EXPERT_WEIGHT = re.compile(
    r"^(backbone\.layers\.\d+\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$"
)


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu2": relu2,  # (one kernel call: a decode step stays capturable)
    "relu": F.relu,
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported mlp_hidden_act {name!r}; supported: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


@dataclasses.dataclass(frozen=True)
class NemotronHConfig(HFConfig):
    """Defaults: transformers 5.25 `NemotronHConfig`; older key names are `ALIASES`.

    The layout is `layers_block_type` / `layer_types` (lists) or `hybrid_override_pattern` (a
    string of M / * / - / E), else transformers' 4-layer default; `num_hidden_layers` is derived
    from it, as transformers does. `mamba_ssm_cache_dtype` is not read here: it chooses a cache
    dtype, not a dimension (`hybridkv.models.config_helpers.resolve_cache_dtypes`)."""

    ARCHITECTURE = "NemotronHForCausalLM"
    # transformers pops the old `mamba_*` spellings over the new ones when both are given
    ALIASES = {
        "layers_block_type": ("layer_types",),
        "n_groups": ("mamba_n_groups", "n_groups"),
        "conv_kernel": ("mamba_d_conv", "conv_kernel"),
        "time_step_limit": ("mamba_dt_limit", "time_step_limit"),
        "use_conv_bias": ("mamba_conv_bias", "use_conv_bias"),
        "chunk_size": ("mamba_chunk_size", "chunk_size"),
        "n_routed_experts": ("num_local_experts",),
    }

    vocab_size: int = 131072
    hidden_size: int = 4096
    layers_block_type: tuple | None = None
    hybrid_override_pattern: str | None = None
    tie_word_embeddings: bool = False  # transformers' NemotronH never ties them (see below)
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    max_position_embeddings: int = 4096
    intermediate_size: int = 21504
    mlp_hidden_act: str = "relu2"
    mlp_bias: bool = False
    ssm_state_size: int = 128
    mamba_num_heads: int = 128
    mamba_head_dim: int = 64
    mamba_hidden_act: str = "silu"
    n_groups: int = 8
    conv_kernel: int = 4
    time_step_limit: tuple = (0.0, math.inf)  # 5.24 and older: (time_step_min, inf)
    use_conv_bias: bool = True
    chunk_size: int = 128
    use_bias: bool = False
    n_routed_experts: int = 8
    moe_intermediate_size: int = 7688
    moe_shared_expert_intermediate_size: int = 7688
    moe_latent_size: int | None = None
    num_experts_per_tok: int = 2
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    layer_norm_epsilon: float = 1e-5

    def __post_init__(self) -> None:
        if self.layers_block_type is not None:
            kinds = layer_types(
                self.layers_block_type, "layers_block_type", _ROLES, self.ARCHITECTURE
            )
        elif self.hybrid_override_pattern is not None:
            pattern = self.hybrid_override_pattern
            kinds = layer_types(pattern, "hybrid_override_pattern", _ROLES, self.ARCHITECTURE)
        else:
            kinds = DEFAULT_LAYOUT
        if not kinds:
            raise ValueError("the layout (layers_block_type) describes no layer")
        self._set("layers_block_type", kinds)
        self._require_positive(
            "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "ssm_state_size", "mamba_num_heads", "mamba_head_dim", "n_groups", "conv_kernel",
            "chunk_size", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        )  # fmt: skip
        activation(self.mlp_hidden_act)  # a one-line error for an unsupported one
        _ = self.dt_limit  # a one-line error for a malformed time_step_limit
        if self.n_routed_experts % self.n_group:
            raise ValueError(
                f"n_routed_experts {self.n_routed_experts} is not a multiple of n_group "
                f"{self.n_group}"
            )

    @property
    def dt_limit(self) -> tuple[float, float]:
        limit = self.time_step_limit
        if not isinstance(limit, tuple) or len(limit) != 2:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: time_step_limit must be two numbers, "
                f"got {limit!r}"
            )
        return config_float(limit[0]), config_float(limit[1])

    @property
    def layers(self) -> tuple[str, ...]:
        """'mamba', 'attention', 'mlp' or 'moe' per block."""
        assert self.layers_block_type is not None
        return self.layers_block_type

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers)

    def mamba2(self, index: int) -> Mamba2Mixer:
        """intermediate = mamba_num_heads * mamba_head_dim; dt_limit = time_step_limit."""
        return Mamba2Mixer(
            self.hidden_size, self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size,
            self.n_groups, self.conv_kernel, self.chunk_size, self.use_conv_bias, self.use_bias,
            self.layer_norm_epsilon, self.dt_limit,
            self.mamba_hidden_act, layer_index=index,
        )  # fmt: skip


_ROLES = ("mamba", "attention", "mlp", "moe")


class NemotronHMLP(nn.Module):
    """down_proj(act(up_proj(x))), no gate (the '-' blocks and the MoE's shared expert)."""

    def __init__(self, hidden: int, intermediate: int, act: str, bias: bool) -> None:
        super().__init__()
        self.tp = tp = current()  # tensor parallel: this rank's slice of the intermediate
        full, intermediate = intermediate, tp.split(intermediate, "intermediate_size")
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act = activation(act)
        rows = column(tp, (0, full))
        declare_shards(self.up_proj, weight=rows, bias=rows if bias else None)
        declare_shards(self.down_proj, weight=column(tp, (0, full), dim=1))
        declare_shards(self.down_proj, bias=rank0_bias(tp) if bias else None)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `reduce=False`: this rank's partial sum."""
        out = self.down_proj(self.act(self.up_proj(x)))
        return self.tp.all_reduce(out) if reduce else out


class NemotronHMoE(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        hidden, act, bias = cfg.hidden_size, cfg.mlp_hidden_act, cfg.mlp_bias
        num_experts = cfg.n_routed_experts
        latent = cfg.moe_latent_size
        dim = latent if latent else hidden
        # float32 router (kept float32 as transformers keeps it): sigmoid scores, the choice
        # biased by e_score_correction_bias, the best topk_group of n_group groups by their top-2
        rule = RoutingRule(
            cfg.num_experts_per_tok, "sigmoid", cfg.norm_topk_prob, renormalise_eps=1e-20,
            scaling=float(cfg.routed_scaling_factor), groups=cfg.n_group,
            groups_kept=min(cfg.topk_group, cfg.n_group), group_score="top2_sum", sorted=False,
        )  # fmt: skip
        self.gate = Router(hidden, num_experts, rule, correction_bias=True, keep_float32=True)
        self.experts = UngatedExperts(num_experts, dim, cfg.moe_intermediate_size, activation(act))
        self.shared_experts = NemotronHMLP(
            hidden, cfg.moe_shared_expert_intermediate_size, act, bias
        )
        self.fc1_latent_proj = nn.Linear(hidden, dim, bias=bias) if latent else None
        self.fc2_latent_proj = nn.Linear(dim, hidden, bias=bias) if latent else None
        # tensor parallel: experts and shared expert give partial sums (fc2 is linear, its
        # bias added by rank 0 only), all-reduced once
        self.tp = current()
        if self.fc2_latent_proj is not None and bias:
            declare_shards(self.fc2_latent_proj, bias=rank0_bias(self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, hidden]; the router and the shared expert see x, the experts its latent
        routing = self.gate(x)  # weights: [T, k] float32 (the native router's too)
        h = self.fc1_latent_proj(x) if self.fc1_latent_proj is not None else x
        h = self.experts(h, routing)
        if self.fc2_latent_proj is not None:
            h = self.fc2_latent_proj(h)
        # (the sum natively: a decode step stays one list of kernel calls)
        return self.tp.all_reduce(residual_add(h, self.shared_experts(x, reduce=False)))


def build_mixer(cfg: NemotronHConfig, index: int, kind: str) -> nn.Module:
    if kind == "mamba":
        return cfg.mamba2(index)
    if kind == "attention":  # no bias, whatever attention_bias says (as transformers)
        return SelfAttention(
            index, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim,
        )  # fmt: skip
    if kind == "moe":
        return NemotronHMoE(cfg)
    return NemotronHMLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_hidden_act, cfg.mlp_bias)


class NemotronHBlock(nn.Module):
    def __init__(self, cfg: NemotronHConfig, index: int, kind: str) -> None:
        super().__init__()
        self.takes_batch = kind in ("mamba", "attention")
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon, weight_in_fp32=True)
        self.mixer = build_mixer(cfg, index, kind)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        h = self.norm(x)  # [T, hidden]
        h = self.mixer(h, batch) if self.takes_batch else self.mixer(h)
        return residual_add(x, h)


class NemotronHBackbone(nn.Module):
    def __init__(self, cfg: NemotronHConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.embeddings = vocab_embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleList(NemotronHBlock(cfg, i, k) for i, k in enumerate(cfg.layers))
        self.norm_f = RMSNorm(hidden, cfg.layer_norm_epsilon, True)


class NemotronHForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = NemotronHConfig

    def __init__(self, config: NemotronHConfig) -> None:
        super().__init__(config)
        self.tie_word_embeddings = False  # transformers' NemotronH never ties them
        self.num_experts = config.n_routed_experts
        self.backbone = NemotronHBackbone(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)

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
