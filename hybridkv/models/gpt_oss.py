"""gpt-oss (GptOssForCausalLM): attention in every layer, sliding and full alternating, MoE MLPs.

    x = embed(ids)
    per layer:  x += o_proj(attention(rope(q), rope(k), v; sinks))   on input_layernorm(x)
                x += moe(h)                                          h = post_attention_layernorm(x)
    logits = lm_head(norm(x))

- attention: q/k/v/o with biases; `layer_types` (default: even layers "sliding_attention" with
  `sliding_window`, odd ones full); learned sinks [heads] per layer: one more logit per head in
  the softmax denominator, with no value. Scores scaled by 1/sqrt(head_dim).
- RoPE: YaRN (`rope_parameters`, transformers' default: factor 32, beta_fast 32, beta_slow 1,
  original 4096 positions, truncate False, theta 150000); cos/sin scaled by the attention factor.
- MoE: router = linear with bias over the experts; top-k of its logits, softmax over those k.
  Expert e: gate_up = h @ gate_up_proj[e] + gate_up_proj_bias[e] ([2I], gate at even columns,
  up at odd ones), gate clamped above at `swiglu_limit`, up clamped to +-limit,
  out = ((up + 1) * gate * sigmoid(alpha * gate)) @ down_proj[e] + down_proj_bias[e].
  The checkpoint stores gate_up_proj [E, hidden, 2I] and down_proj [E, I, hidden] (x @ W).

Only the bf16 / fp32 checkpoint layout is read; MXFP4 tensors (`*_blocks`, `*_scales`) are refused.
Defaults: transformers 5.24 `GptOssConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import current
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.attention.self_attention import CosSin, SelfAttention
from hybridkv.layers.mlp import RMSNorm
from hybridkv.layers.moe import ClampedSwigluExperts, Router, RoutingRule
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import HFConfig, layer_types
from hybridkv.ops.elementwise import residual_add

DEFAULT_THETA = 150000.0
DEFAULT_YARN = {
    "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
    "truncate": False, "original_max_position_embeddings": 4096,
}  # fmt: skip
ROPE_TYPES = ("yarn", "default")


@dataclasses.dataclass(frozen=True)
class GptOssConfig(HFConfig):
    """Defaults: transformers 5.24 `GptOssConfig`."""

    ARCHITECTURE: ClassVar[str] = "GptOssForCausalLM"
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {"num_local_experts": ("num_experts",)}

    vocab_size: int = 201088
    hidden_size: int = 2880
    intermediate_size: int = 2880
    num_hidden_layers: int = 36
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    head_dim: int | None = 64
    num_attention_heads: int = 64
    num_key_value_heads: int | None = 8
    sliding_window: int | None = 128
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    rope_parameters: dict | None = None
    rope_theta: float | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_types: tuple | None = None
    attention_bias: bool = True

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_local_experts", "num_experts_per_tok", "num_attention_heads",
        )  # fmt: skip
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        self._require_positive("num_key_value_heads", "head_dim")
        self._check_heads_and_experts()
        if self.layer_types is None:
            kinds = tuple(
                "sliding_attention" if i % 2 == 0 else "attention"
                for i in range(self.num_hidden_layers)
            )
        else:
            allowed = ("attention", "sliding_attention")
            kinds = layer_types(self.layer_types, "layer_types", allowed, self.ARCHITECTURE)
        if len(kinds) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: layer_types has {len(kinds)} entries but "
                f"num_hidden_layers is {self.num_hidden_layers}"
            )
        self._set("layer_types", kinds)
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: sliding_window must be positive, "
                f"got {self.sliding_window}"
            )
        self.rope  # one-line errors for an unsupported rope type, at load time  # noqa: B018

    def _check_heads_and_experts(self) -> None:
        assert self.num_key_value_heads is not None
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: num_attention_heads "
                f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.num_experts_per_tok > self.num_local_experts:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: num_experts_per_tok "
                f"({self.num_experts_per_tok}) must be at most num_local_experts "
                f"({self.num_local_experts})"
            )

    @property
    def rope(self) -> dict[str, Any]:
        """The rope parameters with transformers' defaults (YaRN, theta 150000)."""
        params = dict(self.rope_parameters or DEFAULT_YARN)
        params.setdefault("rope_theta", self.rope_theta or DEFAULT_THETA)
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ROPE_TYPES:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: unsupported rope type {rope_type!r}; "
                f"supported: {', '.join(ROPE_TYPES)}"
            )
        if rope_type == "yarn" and "original_max_position_embeddings" not in params:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: yarn rope_parameters need "
                "original_max_position_embeddings"
            )
        params["rope_type"] = rope_type
        return params

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: full attention)."""
        assert self.layer_types is not None
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )


class GptOssMLP(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        hidden, e = cfg.hidden_size, cfg.num_local_experts
        # logits with bias in the model dtype; the top-k of them, softmax over those k
        rule = RoutingRule(cfg.num_experts_per_tok, "topk_softmax", float32=False)
        self.router = Router(hidden, e, rule, bias=True)
        self.experts = ClampedSwigluExperts(
            e, hidden, cfg.intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit
        )
        self.tp = current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (tensor parallel: the experts' partial sums reduced)."""
        return self.tp.all_reduce(self.experts(x, self.router(x)))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, cfg: GptOssConfig, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        assert cfg.num_key_value_heads is not None and cfg.head_dim is not None
        self.self_attn = SelfAttention(
            index, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            bias=cfg.attention_bias, sliding_window=cfg.windows[index], sinks=True,
        )  # fmt: skip
        self.mlp = GptOssMLP(cfg)
        # transformers keeps these norms in float32 and multiplies by the weight there
        self.input_layernorm = RMSNorm(hidden, eps, weight_in_fp32=True)
        self.post_attention_layernorm = RMSNorm(hidden, eps, weight_in_fp32=True)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (pre-norm residual blocks)."""
        h = self.self_attn(self.input_layernorm(x), batch, rotary, cos_sin)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return residual_add(x, self.mlp(h))


class GptOssModel(nn.Module):
    def __init__(self, cfg: GptOssConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            GptOssDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=True)


class GptOssForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = GptOssConfig

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__(config)
        assert config.head_dim is not None
        self.model = GptOssModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope, max_positions=config.max_position_embeddings
        )

    def map_weight_name(self, name: str) -> str | None:
        if name.endswith(("_blocks", "_scales")):
            raise ValueError(
                f"checkpoint tensor {name!r} is MXFP4-quantised; hybridkv reads gpt-oss "
                "checkpoints in bf16/fp32 only (dequantise it first)"
            )
        return name

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden: [num_tokens, hidden]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, head_dim]
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)
