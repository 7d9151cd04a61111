"""IBM Granite 4.0-H (GraniteMoeHybridForCausalLM): Mamba2 and attention layers, dense or MoE.

    x = embed(ids) * embedding_multiplier
    per layer:  x += mixer(norm(x)) * residual_multiplier      mixer = Mamba2 or attention
                x += (moe(norm(x)) + shared_mlp(norm(x))) * residual_multiplier
    logits = lm_head(norm(x)) / logits_scaling

Attention scales scores by `attention_multiplier` (not 1/sqrt(head_dim)); RoPE only when
`position_embedding_type == "rope"` (Granite 4.0-H itself uses no position embedding).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hybridkv.kv.specs import CacheLayer
from hybridkv.layers.attention.self_attention import SelfAttention
from hybridkv.layers.mlp import FusedGateUpMLP, GraniteMoE, RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.layers.state_layers import PagedMamba2Mixer
from hybridkv.models.base import CausalLM
from hybridkv.worker.batch import ForwardBatch


def config_float(value: Any) -> float:
    """A float from config.json; transformers 5 writes inf as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def mamba2_kwargs(cfg: dict[str, Any]) -> dict[str, Any]:
    """Mamba2 mixer arguments of the Bamba / GraniteMoeHybrid family."""
    hidden = cfg["hidden_size"]
    n_heads = cfg["mamba_n_heads"]
    head_dim = cfg.get("mamba_d_head")
    if head_dim in (None, "auto"):
        head_dim = cfg.get("mamba_expand", 2) * hidden // n_heads
    limit = cfg.get("time_step_limit") or (0.0, math.inf)
    return dict(
        hidden_size=hidden, n_heads=n_heads, head_dim=int(head_dim),
        d_state=cfg["mamba_d_state"], n_groups=cfg.get("mamba_n_groups", 1),
        d_conv=cfg.get("mamba_d_conv", 4), chunk_size=cfg.get("mamba_chunk_size", 256),
        conv_bias=cfg.get("mamba_conv_bias", True), proj_bias=cfg.get("mamba_proj_bias", False),
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        dt_limit=(config_float(limit[0]), config_float(limit[1])),
    )  # fmt: skip


class GraniteDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int, kind: str) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.residual_multiplier = float(cfg.get("residual_multiplier", 1.0))
        if kind == "attention":
            scale = float(cfg.get("attention_multiplier", 1.0))
            self.self_attn = SelfAttention(f"layers.{index}.attention", cfg, scale=scale)
        else:
            self.mamba = PagedMamba2Mixer(f"layers.{index}.mamba", **mamba2_kwargs(cfg))
        experts = int(cfg.get("num_local_experts", 0) or 0)
        self.block_sparse_moe = (
            GraniteMoE(hidden, cfg["intermediate_size"], experts, cfg["num_experts_per_tok"])
            if experts > 0 else None
        )  # fmt: skip
        self.shared_mlp = FusedGateUpMLP(hidden, cfg["shared_intermediate_size"])

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rotary, cos_sin) -> torch.Tensor:
        h = self.input_layernorm(x)
        if hasattr(self, "mamba"):
            h = self.mamba(h, batch)
        else:
            h = self.self_attn(h, batch, rotary, cos_sin)
        x, h = self.post_attention_layernorm.add_forward(x, h, self.residual_multiplier)
        out = self.shared_mlp(h)
        if self.block_sparse_moe is not None:
            out = self.block_sparse_moe(h) + out
        if self.residual_multiplier == 1.0:
            return x + out
        return x + out * self.residual_multiplier


class GraniteModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], kinds: list[str]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(GraniteDecoderLayer(cfg, i, k) for i, k in enumerate(kinds))
        self.norm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-6))


class GraniteMoeHybridForCausalLM(CausalLM):
    def __init__(self, config: dict[str, Any], cache_layers: list[CacheLayer]) -> None:
        super().__init__(config, cache_layers)
        kinds = [
            "attention" if f"layers.{i}.attention" in self.cache_layers else "mamba"
            for i in range(config["num_hidden_layers"])
        ]
        self.model = GraniteModel(config, kinds)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.embedding_multiplier = float(config.get("embedding_multiplier", 1.0))
        self.logits_scaling = float(config.get("logits_scaling", 1.0))
        self.rotary = None
        if config.get("position_embedding_type") == "rope" and "attention" in kinds:
            head_dim = (
                config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
            )
            self.rotary = RotaryEmbedding(head_dim, config)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids) * self.embedding_multiplier
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype) if self.rotary else None
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        return logits if self.logits_scaling == 1.0 else logits / self.logits_scaling
