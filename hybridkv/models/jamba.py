"""Jamba (JambaForCausalLM): Mamba1 layers with an attention layer every `attn_layer_period`
layers, and a sparse mixture of experts every `expert_layer_period` layers.

    x = embed(ids)
    per layer:  x += mixer(input_layernorm(x))          mixer: Mamba1 | attention
                x += ffn(pre_ff_layernorm(x))            ffn: SwiGLU MLP | top-k MoE
    logits = lm_head(final_layernorm(x))

- Layer i is attention when i % attn_layer_period == attn_layer_offset, else Mamba1; its
  feed-forward block is the MoE when num_experts > 1 and i % expert_layer_period ==
  expert_layer_offset, else a dense SwiGLU MLP (transformers' `layers_num_experts`).
- Attention: no position embedding at all (no RoPE), no biases; head_dim = hidden_size //
  num_attention_heads (or a `head_dim` key, which transformers' attention also reads).
- Mamba1 mixer (`hybridkv.layers.mamba1`, dt_norms "jamba"): dt, B and C pass through RMSNorms
  with weights (`dt_layernorm`, `b_layernorm`, `c_layernorm`, eps = rms_norm_eps) before dt_proj
  and the scan; dt_rank "auto" is ceil(hidden_size / 16).
- MoE: router logits in the model dtype, softmax in float32 over all experts, top-k, the k
  weights *not* renormalised; SwiGLU experts. No shared expert.
- Norms: RMSNorm, the weight applied after the cast back to the input dtype.

Checkpoints hold one tensor per expert (`feed_forward.experts.{e}.{gate,up,down}_proj.weight`,
as Jamba-v0.1 and transformers' `save_pretrained` write them), stacked here into
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]; transformers' in-memory
(stacked) names load as they are.

Tensor parallel: the Mamba1 mixers split by inner channel (`hybridkv.layers.mamba1`), attention
by head (`SelfAttention`), the dense MLPs and every expert by intermediate size (the router is
replicated, the experts' partial sums all-reduced once), embeddings and lm_head by vocabulary.

Defaults: transformers 5.24 `JambaConfig` (`num_local_experts` is read as `num_experts`, its
attribute map).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import current
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.attention.self_attention import SelfAttention
from hybridkv.layers.mamba1 import Mamba1Mixer
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.moe import GatedExperts, RoutingRule, route
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import HFConfig
from hybridkv.models.loader import stack_gated_experts
from hybridkv.ops.elementwise import residual_add

EXPERT_WEIGHT = re.compile(
    r"^(.*\.feed_forward\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"
)


@dataclasses.dataclass(frozen=True)
class JambaConfig(HFConfig):
    """Defaults: transformers 5.24 `JambaConfig`."""

    ARCHITECTURE = "JambaForCausalLM"
    ALIASES = {"num_experts": ("num_local_experts",)}

    vocab_size: int = 65536
    tie_word_embeddings: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # not a JambaConfig field; None: hidden_size // heads
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    num_experts_per_tok: int = 2
    num_experts: int = 16
    expert_layer_period: int = 2
    expert_layer_offset: int = 1
    attn_layer_period: int = 8
    attn_layer_offset: int = 4
    mamba_d_state: int = 16
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_dt_rank: int | str = "auto"  # "auto": ceil(hidden_size / 16)
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "num_experts", "num_experts_per_tok",
            "expert_layer_period", "attn_layer_period", "mamba_d_state", "mamba_d_conv",
            "mamba_expand",
        )  # fmt: skip
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only silu)")
        if self.mamba_dt_rank == "auto":
            self._set("mamba_dt_rank", math.ceil(self.hidden_size / 16))
        elif isinstance(self.mamba_dt_rank, str):
            raise ValueError(f"mamba_dt_rank must be an integer or 'auto', got "
                             f"{self.mamba_dt_rank!r}")  # fmt: skip
        if self.head_dim is None:
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        self._require_positive("mamba_dt_rank", "head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        for kind in ("attn", "expert"):
            period, offset = (getattr(self, f"{kind}_layer_{k}") for k in ("period", "offset"))
            if not 0 <= offset < period:
                raise ValueError(
                    f"{kind}_layer_offset ({offset}) must be >= 0 and < {kind}_layer_period"
                    f" ({period})"
                )
        if self.moe_layers and self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.num_experts_per_tok}) is more than num_experts "
                f"({self.num_experts})"
            )

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'attention' or 'mamba' per layer."""
        period, offset = self.attn_layer_period, self.attn_layer_offset
        return tuple(
            "attention" if i % period == offset else "mamba" for i in range(self.num_hidden_layers)
        )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward block is the MoE (none when num_experts is 1)."""
        if self.num_experts <= 1:
            return ()
        period, offset = self.expert_layer_period, self.expert_layer_offset
        return tuple(i for i in range(self.num_hidden_layers) if i % period == offset)

    def mamba1(self, index: int) -> Mamba1Mixer:
        assert isinstance(self.mamba_dt_rank, int)
        return Mamba1Mixer(
            self.hidden_size, self.mamba_expand * self.hidden_size, self.mamba_d_state,
            self.mamba_d_conv, self.mamba_dt_rank, conv_bias=self.mamba_conv_bias,
            proj_bias=self.mamba_proj_bias, dt_norms="jamba", norm_eps=self.rms_norm_eps,
            activation="silu", layer_index=index,
        )  # fmt: skip

    def attention(self, index: int) -> SelfAttention:
        assert self.head_dim is not None
        return SelfAttention(index, self.hidden_size, self.num_attention_heads,
                             self.num_key_value_heads, self.head_dim)  # fmt: skip


class JambaSparseMoe(nn.Module):
    """Softmax router over every expert, top-k (weights not renormalised), SwiGLU experts.
    Tensor parallel: the router replicated, each expert's intermediate size split."""

    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.tp = current()
        self.rule = RoutingRule(cfg.num_experts_per_tok, "softmax")  # not renormalised
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GatedExperts(cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        routing = route(x, self.router, self.rule)  # bfloat16 on AMX: one native pass
        return self.tp.all_reduce(self.experts(x, routing))  # partial sums


class JambaDecoderLayer(nn.Module):
    def __init__(self, cfg: JambaConfig, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        if cfg.layer_kinds[index] == "attention":
            self.self_attn = cfg.attention(index)
        else:
            self.mamba = cfg.mamba1(index)
        if index in cfg.moe_layers:
            self.feed_forward: nn.Module = JambaSparseMoe(cfg)
        else:
            self.feed_forward = GatedMLP(hidden, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        h = self.input_layernorm(x)
        h = self.mamba(h, batch) if hasattr(self, "mamba") else self.self_attn(h, batch)
        x, h = self.pre_ff_layernorm.add_forward(x, h)
        return residual_add(x, self.feed_forward(h))


class JambaModel(nn.Module):
    def __init__(self, cfg: JambaConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)  # tensor parallel
        self.layers = nn.ModuleList(JambaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class JambaForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = JambaConfig

    def __init__(self, config: JambaConfig) -> None:
        super().__init__(config)
        self.model = JambaModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, batch)
        return self.model.final_layernorm(x)

    # -- weights -----------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(stack_gated_experts(weights, EXPERT_WEIGHT, self.config.num_experts))
