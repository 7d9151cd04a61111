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

from typing import Any

import torch
from torch import nn

from hybridkv.kv.specs import CacheLayer, attention_dims
from hybridkv.layers.attention.self_attention import CosSin, SelfAttention
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.layers.state_layers import PagedMamba2Mixer
from hybridkv.models.base import CausalLM
from hybridkv.models.granitemoehybrid import mamba2_kwargs
from hybridkv.worker.batch import ForwardBatch

# transformers' BambaConfig forces a partial rotary factor of 0.5 when none is given
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5
# BambaConfig's default, used by transformers when config.json has no intermediate_size
DEFAULT_INTERMEDIATE_SIZE = 14336


def partial_rotary_factor(cfg: dict[str, Any]) -> float:
    """Fraction of each attention head that RoPE rotates."""
    rope = cfg.get("rope_parameters") or {}
    for value in (rope.get("partial_rotary_factor"), cfg.get("partial_rotary_factor")):
        if value:
            return float(value)
    if cfg.get("attn_rotary_emb"):
        return int(cfg["attn_rotary_emb"]) / attention_dims(cfg)[2]
    return DEFAULT_PARTIAL_ROTARY_FACTOR


def check_activation(cfg: dict[str, Any]) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"Bamba with hidden_act={act!r} is not supported (only 'silu')")


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: dict[str, Any], index: int, kind: str) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], cfg.get("rms_norm_eps", 1e-5)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        if kind == "attention":
            self.self_attn = SelfAttention(f"layers.{index}.attention", cfg)
        else:
            self.mamba = PagedMamba2Mixer(f"layers.{index}.mamba", **mamba2_kwargs(cfg))
        bias = bool(cfg.get("mlp_bias", False))
        inter = cfg.get("intermediate_size", DEFAULT_INTERMEDIATE_SIZE)
        self.feed_forward = GatedMLP(hidden, inter, bias=bias)

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
        return x + self.feed_forward(h)


class BambaModel(nn.Module):
    def __init__(self, cfg: dict[str, Any], kinds: list[str]) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(BambaDecoderLayer(cfg, i, k) for i, k in enumerate(kinds))
        self.final_layernorm = RMSNorm(hidden, cfg.get("rms_norm_eps", 1e-5))


class BambaForCausalLM(CausalLM):
    def __init__(self, config: dict[str, Any], cache_layers: list[CacheLayer]) -> None:
        super().__init__(config, cache_layers)
        check_activation(config)
        kinds = [
            "attention" if f"layers.{i}.attention" in self.cache_layers else "mamba"
            for i in range(config["num_hidden_layers"])
        ]
        self.model = BambaModel(config, kinds)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.rotary = None
        if "attention" in kinds:
            rope_cfg = {**config, "partial_rotary_factor": partial_rotary_factor(config)}
            self.rotary = RotaryEmbedding(attention_dims(config)[2], rope_cfg)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype) if self.rotary else None
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.final_layernorm(x)
