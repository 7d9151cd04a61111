"""Llama (LlamaForCausalLM) and Qwen3 (Qwen3ForCausalLM): dense decoders, attention everywhere.

    x = embed(ids)
    per layer:  x += o_proj(attention(rope(q), rope(k), v))    on input_layernorm(x)
                x += down(silu(gate(h)) * up(h))               h = post_attention_layernorm(x)
    logits = lm_head(norm(x))                                  lm_head may be tied to embed

Qwen3 differs only in a per-head RMSNorm on q and k (`q_norm`, `k_norm`, over head_dim) applied
before RoPE, and in having no MLP bias. Scores are scaled by 1/sqrt(head_dim). A layer is
sliding-window when its cache layer says so (`read_layers` reads `layer_types`, or Qwen's
`use_sliding_window` + `max_window_layers`); the window goes to PagedAttention.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridkv.kv.specs import CacheLayer, attention_dims
from hybridkv.layers.attention.self_attention import CosSin, SelfAttention
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.worker.batch import ForwardBatch

SUPPORTED_ACTIVATIONS = ("silu", "swish")


def norm_eps(cfg: dict[str, Any]) -> float:
    return float(cfg.get("rms_norm_eps", 1e-6))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: dict[str, Any],
        cache_layer: CacheLayer,
        qk_norm: bool,
        mlp_bias: bool,
    ) -> None:
        super().__init__()
        hidden, eps = cfg["hidden_size"], norm_eps(cfg)
        window = cache_layer.spec.sliding_window
        self.self_attn = SelfAttention(
            cache_layer.name, cfg, sliding_window=window, qk_norm_eps=eps if qk_norm else None
        )
        self.mlp = GatedMLP(hidden, cfg["intermediate_size"], bias=mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (pre-norm residual blocks)."""
        h = self.self_attn(self.input_layernorm(x), batch, rotary, cos_sin)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return x + self.mlp(h)


class LlamaModel(nn.Module):
    def __init__(
        self, cfg: dict[str, Any], cache_layers: list[CacheLayer], qk_norm: bool, mlp_bias: bool
    ) -> None:
        super().__init__()
        hidden = cfg["hidden_size"]
        self.embed_tokens = nn.Embedding(cfg["vocab_size"], hidden)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, layer, qk_norm, mlp_bias) for layer in cache_layers
        )
        self.norm = RMSNorm(hidden, norm_eps(cfg))


class LlamaForCausalLM(CausalLM):
    """Llama 2/3/3.1/3.2 (rope default, linear or llama3). Subclasses switch Qwen3's traits."""

    qk_norm = False  # Qwen3: per-head RMSNorm on q and k
    honours_mlp_bias = True  # Llama has `mlp_bias`; Qwen3's MLP never has a bias

    def __init__(self, config: dict[str, Any], cache_layers: list[CacheLayer]) -> None:
        super().__init__(config, cache_layers)
        act = config.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"{type(self).__name__} supports hidden_act silu, got {act!r}")
        mlp_bias = self.honours_mlp_bias and bool(config.get("mlp_bias", False))
        layers = self._layers_in_order(config["num_hidden_layers"])
        self.model = LlamaModel(config, layers, self.qk_norm, mlp_bias)
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        self.rotary = RotaryEmbedding(attention_dims(config)[2], config)

    def _layers_in_order(self, num_layers: int) -> list[CacheLayer]:
        """The cache layer of every decoder layer (`layers.{i}.attention`), one per layer."""
        names = [f"layers.{i}.attention" for i in range(num_layers)]
        missing = [n for n in names if n not in self.cache_layers]
        if missing:
            raise ValueError(
                f"{type(self).__name__} needs an attention cache layer per decoder layer; "
                f"missing {missing[:3]}"
            )
        return [self.cache_layers[n] for n in names]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden: [num_tokens, hidden]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, rotary_dim]
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama plus per-head q/k RMSNorm before RoPE; no MLP bias."""

    qk_norm = True
    honours_mlp_bias = False
