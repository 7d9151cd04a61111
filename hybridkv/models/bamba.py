"""IBM Bamba (BambaForCausalLM): Mamba2 layers with a few attention layers, dense SwiGLU MLPs.

    x = embed(ids)
    per layer:  x += mixer(input_layernorm(x))           mixer = Mamba2 or attention
                x += feed_forward(pre_ff_layernorm(x))
    logits = lm_head(final_layernorm(x))

Attention layers sit at `attn_layer_indices`; they scale scores by 1/sqrt(head_dim) and rotate
only part of each head: `partial_rotary_factor` (transformers 5 stores 0.5 in `rope_parameters`),
or `attn_rotary_emb` channels in older checkpoints (Bamba-9B: 64 of 128), else half the head.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.attention.self_attention import CosSin
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.granitemoehybrid import Mamba2HybridConfig
from hybridkv.ops.elementwise import residual_add

# transformers' BambaConfig forces a partial rotary factor of 0.5 when none is given
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


@dataclasses.dataclass(frozen=True)
class BambaConfig(Mamba2HybridConfig):
    """Defaults: transformers 5.24 `BambaConfig` (where it differs from GraniteMoeHybrid's)."""

    ARCHITECTURE = "BambaForCausalLM"

    vocab_size: int = 128000
    intermediate_size: int = 14336
    num_key_value_heads: int | None = 8
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 262144
    mlp_bias: bool = False
    attn_layer_indices: tuple | None = None  # None: every layer Mamba2
    partial_rotary_factor: float | None = None
    attn_rotary_emb: int | None = None  # older checkpoints: rotated channels per head

    def __post_init__(self) -> None:
        super().__post_init__()
        for i in self.attn_layer_indices or ():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_hidden_layers:
                raise ValueError(
                    f"attn_layer_indices holds {i!r}; layers are 0..{self.num_hidden_layers - 1}"
                )

    @property
    def layers(self) -> tuple[str, ...]:
        attention = set(self.attn_layer_indices or ())
        return tuple(
            "attention" if i in attention else "mamba" for i in range(self.num_hidden_layers)
        )

    @property
    def rotary_factor(self) -> float:
        """Fraction of each attention head that RoPE rotates: `partial_rotary_factor`
        (transformers 5 stores 0.5 in `rope_parameters`), `attn_rotary_emb` channels in older
        checkpoints (Bamba-9B: 64 of 128), else half the head."""
        for value in ((self.rope_parameters or {}).get("partial_rotary_factor"),
                      self.partial_rotary_factor):  # fmt: skip
            if value:
                return float(value)
        if self.attn_rotary_emb:
            return self.attn_rotary_emb / self.head_dim
        return DEFAULT_PARTIAL_ROTARY_FACTOR


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: BambaConfig, index: int, kind: str) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        if kind == "attention":
            self.self_attn = cfg.attention(index)
        else:
            self.mamba = cfg.mamba2(index)
        self.feed_forward = GatedMLP(hidden, cfg.intermediate_size, bias=cfg.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None,
        cos_sin: CosSin | None,
    ) -> torch.Tensor:
        # x: [T, hidden]
        h = self.input_layernorm(x)
        if hasattr(self, "mamba"):
            h = self.mamba(h, batch)
        else:
            assert rotary is not None and cos_sin is not None
            h = self.self_attn(h, batch, rotary, cos_sin)
        x, h = self.pre_ff_layernorm.add_forward(x, h)
        return residual_add(x, self.feed_forward(h))


class BambaModel(nn.Module):
    def __init__(self, cfg: BambaConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.embed_tokens = vocab_embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleList(
            BambaDecoderLayer(cfg, i, kind) for i, kind in enumerate(cfg.layers)
        )
        self.final_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)


class BambaForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = BambaConfig

    def __init__(self, config: BambaConfig) -> None:
        super().__init__(config)
        self.model = BambaModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = None
        if "attention" in config.layers:
            self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.rotary_factor)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype) if self.rotary else None
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.final_layernorm(x)
