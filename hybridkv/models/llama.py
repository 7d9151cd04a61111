"""Llama (LlamaForCausalLM) and Qwen3 (Qwen3ForCausalLM): dense decoders, attention everywhere.

    x = embed(ids)
    per layer:  x += o_proj(attention(rope(q), rope(k), v))    on input_layernorm(x)
                x += down(silu(gate(h)) * up(h))               h = post_attention_layernorm(x)
    logits = lm_head(norm(x))                                  lm_head may be tied to embed

Qwen3 differs only in a per-head RMSNorm on q and k (`q_norm`, `k_norm`, over head_dim) applied
before RoPE, in having no MLP bias, and in its sliding-window layers (`layer_types`, or
`use_sliding_window` + `max_window_layers`; the window goes to PagedAttention, which declares
it in its spec). Scores are scaled by 1/sqrt(head_dim).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.attention.self_attention import CosSin, SelfAttention
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig, layer_types
from hybridkv.ops.elementwise import residual_add

SUPPORTED_ACTIVATIONS = ("silu", "swish")


@dataclasses.dataclass(frozen=True)
class LlamaConfig(RopeConfig):
    """Defaults: transformers 5.24 `LlamaConfig`."""

    ARCHITECTURE = "LlamaForCausalLM"

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: num_attention_heads
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads",
        )  # fmt: skip
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        self._require_positive("num_key_value_heads", "head_dim")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only silu)")
        self.rope  # one-line errors for an unsupported rope type, at load time  # noqa: B018

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: full attention); Llama has none."""
        return (None,) * self.num_hidden_layers

    @property
    def qk_norm(self) -> bool:
        return False

    @property
    def has_mlp_bias(self) -> bool:
        return self.mlp_bias


@dataclasses.dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    """Defaults: transformers 5.24 `Qwen3Config` (head_dim 128 whatever the hidden size;
    sliding windows only with use_sliding_window)."""

    ARCHITECTURE = "Qwen3ForCausalLM"

    vocab_size: int = 151936
    intermediate_size: int = 22016
    num_key_value_heads: int | None = 32
    head_dim: int | None = 128
    max_position_embeddings: int = 32768
    use_sliding_window: bool = False
    sliding_window: int | None = 4096
    max_window_layers: int = 28
    layer_types: tuple | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        window = self.sliding_window if self.use_sliding_window else None
        if self.layer_types is None:
            kinds = tuple(
                "sliding_attention" if window is not None and i >= self.max_window_layers
                else "attention"
                for i in range(self.num_hidden_layers)
            )  # fmt: skip
        else:
            allowed = ("attention", "sliding_attention")
            kinds = layer_types(self.layer_types, "layer_types", allowed, self.ARCHITECTURE)
        if len(kinds) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(kinds)} entries but num_hidden_layers is "
                f"{self.num_hidden_layers}"
            )
        if window is not None and window <= 0:
            raise ValueError(f"sliding_window must be positive, got {window}")
        self._set("layer_types", kinds)
        self._set("sliding_window", window)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """A "sliding_attention" layer without use_sliding_window attends fully (transformers:
        its window is None)."""
        assert self.layer_types is not None
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )

    @property
    def qk_norm(self) -> bool:
        return True

    @property
    def has_mlp_bias(self) -> bool:
        return False  # Qwen3's MLP never has a bias


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = SelfAttention(
            index, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            bias=cfg.attention_bias, sliding_window=cfg.windows[index],
            qk_norm_eps=eps if cfg.qk_norm else None,
        )  # fmt: skip
        self.mlp = GatedMLP(hidden, cfg.intermediate_size, bias=cfg.has_mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (pre-norm residual blocks)."""
        h = self.self_attn(self.input_layernorm(x), batch, rotary, cos_sin)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return residual_add(x, self.mlp(h))


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.embed_tokens = vocab_embedding(cfg.vocab_size, hidden)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(hidden, cfg.rms_norm_eps)


class LlamaForCausalLM(CausalLM):
    """Llama 2/3/3.1/3.2 (rope default, linear or llama3)."""

    tensor_parallel = True

    config_class: type[LlamaConfig] = LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden: [num_tokens, hidden]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, rotary_dim]
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense: Llama plus per-head q/k RMSNorm before RoPE; no MLP bias."""

    config_class = Qwen3Config
