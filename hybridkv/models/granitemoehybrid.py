"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM): Mamba2 and attention layers, dense or MoE.

    x = embed(ids) * embedding_multiplier
    per layer:  x += mixer(norm(x)) * residual_multiplier      mixer = Mamba2 or attention
                x += (moe(norm(x)) + shared_mlp(norm(x))) * residual_multiplier
    logits = lm_head(norm(x)) / logits_scaling

Attention scales scores by `attention_multiplier` (not 1/sqrt(head_dim)); RoPE only when
`position_embedding_type == "rope"` (Granite 4.0-H itself uses no position embedding).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import current
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.attention.self_attention import SelfAttention
from hybridkv.layers.mamba2 import Mamba2Mixer
from hybridkv.layers.mlp import FusedGateUpMLP, RMSNorm
from hybridkv.layers.moe import GraniteMoE
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig, config_float, layer_types
from hybridkv.ops.elementwise import logits_float32, residual_add


@dataclasses.dataclass(frozen=True)
class Mamba2HybridConfig(RopeConfig):
    """The fields Bamba and GraniteMoeHybrid share: attention and Mamba2 mixers (`mamba_*`).

    Defaults: transformers 5.24 `GraniteMoeHybridConfig` (BambaConfig differs in a few, which
    `BambaConfig` below overrides)."""

    vocab_size: int = 32000
    hidden_size: int = 4096
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: num_attention_heads
    head_dim: int | None = None  # not a config field in transformers; honoured if present
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mamba_n_heads: int = 128
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_head: int | str = "auto"  # "auto": mamba_expand * hidden_size // mamba_n_heads
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple | None = (0.0, math.inf)

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "mamba_n_heads", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "mamba_expand",
            "mamba_chunk_size",
        )  # fmt: skip
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        if self.mamba_d_head == "auto":
            self._set("mamba_d_head", self.mamba_expand * self.hidden_size // self.mamba_n_heads)
        self._require_positive("num_key_value_heads", "head_dim", "mamba_d_head")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")

    @property
    def layers(self) -> tuple[str, ...]:
        """'mamba' or 'attention' per decoder layer."""
        raise NotImplementedError

    @property
    def dt_limit(self) -> tuple[float, float]:
        low, high = self.time_step_limit or (0.0, math.inf)
        return config_float(low), config_float(high)

    def attention(self, index: int, scale: float | None = None) -> SelfAttention:
        return SelfAttention(
            index, self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
            self.head_dim, bias=self.attention_bias, scale=scale,
        )  # fmt: skip

    def mamba2(self, index: int) -> Mamba2Mixer:
        """The Mamba2 mixer of these families (identical in Bamba and GraniteMoeHybrid)."""
        return Mamba2Mixer(
            self.hidden_size, self.mamba_n_heads, self.mamba_d_head, self.mamba_d_state,
            self.mamba_n_groups, self.mamba_d_conv, self.mamba_chunk_size, self.mamba_conv_bias,
            self.mamba_proj_bias, self.rms_norm_eps, self.dt_limit, layer_index=index,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class GraniteMoeHybridConfig(Mamba2HybridConfig):
    """Defaults: transformers 5.24 `GraniteMoeHybridConfig` (all-Mamba layout by default)."""

    ARCHITECTURE = "GraniteMoeHybridForCausalLM"
    ALIASES = {"layer_types": ("layers_block_type",)}

    intermediate_size: int = 11008  # each expert's (the MoE's) intermediate size
    shared_intermediate_size: int = 1024
    num_local_experts: int = 8  # 0: dense (shared MLP only)
    num_experts_per_tok: int = 2
    embedding_multiplier: float = 1.0
    logits_scaling: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float = 1.0
    position_embedding_type: str | None = None  # None or "rope"
    layer_types: tuple | None = None  # None: every layer Mamba2

    def __post_init__(self) -> None:
        super().__post_init__()
        kinds = self.layer_types or ("mamba",) * self.num_hidden_layers
        kinds = layer_types(kinds, "layer_types", ("mamba", "attention"), self.ARCHITECTURE)
        if len(kinds) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(kinds)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        self._set("layer_types", kinds)
        if self.position_embedding_type not in (None, "rope"):
            raise ValueError(
                f"position_embedding_type={self.position_embedding_type!r}; allowed: None, rope"
            )

    @property
    def layers(self) -> tuple[str, ...]:
        assert self.layer_types is not None
        return self.layer_types


class GraniteDecoderLayer(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig, index: int, kind: str) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.residual_multiplier = float(cfg.residual_multiplier)
        if kind == "attention":
            self.self_attn = cfg.attention(index, scale=float(cfg.attention_multiplier))
        else:
            self.mamba = cfg.mamba2(index)
        self.block_sparse_moe = (
            GraniteMoE(hidden, cfg.intermediate_size, cfg.num_local_experts,
                       cfg.num_experts_per_tok)
            if cfg.num_local_experts > 0 else None
        )  # fmt: skip
        self.shared_mlp = FusedGateUpMLP(hidden, cfg.shared_intermediate_size)
        self.tp = current()

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rotary, cos_sin) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "mamba"):
            h = self.mamba(h, batch)
        else:
            h = self.self_attn(h, batch, rotary, cos_sin)
        x, h = self.post_attention_layernorm.add_forward(x, h, self.residual_multiplier)
        out = self.shared_mlp(h, reduce=False)  # tensor parallel: partial sums, reduced once
        if self.block_sparse_moe is not None:
            out = residual_add(self.block_sparse_moe(h), out)  # (native: capturable)
        return residual_add(x, self.tp.all_reduce(out), self.residual_multiplier)


class GraniteModel(nn.Module):
    def __init__(self, cfg: GraniteMoeHybridConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.embed_tokens = vocab_embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleList(
            GraniteDecoderLayer(cfg, i, kind) for i, kind in enumerate(cfg.layers)
        )
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)


class GraniteMoeHybridForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = GraniteMoeHybridConfig

    def __init__(self, config: GraniteMoeHybridConfig) -> None:
        super().__init__(config)
        self.model = GraniteModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        self.rotary = None
        if config.position_embedding_type == "rope" and "attention" in config.layers:
            self.rotary = RotaryEmbedding(config.head_dim, config.rope)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids, self.embedding_multiplier)
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype) if self.rotary else None
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return logits_float32(self.lm_head(hidden), self.logits_scaling)
