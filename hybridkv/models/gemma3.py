"""Gemma 3 text (Gemma3ForCausalLM) and the text model of Gemma3ForConditionalGeneration.

    x = embed(ids) * sqrt(hidden)                      (the scale rounded to the model dtype)
    per layer:  x += post_attention_layernorm(o_proj(attention(rope(q_norm(q)), rope(k_norm(k)),
                                                     v)))     on input_layernorm(x)
                x += post_feedforward_layernorm(down(gelu_tanh(gate(h)) * up(h)))
                                                               h = pre_feedforward_layernorm(x)
    logits = cap * tanh(lm_head(norm(x)) / cap)        cap = final_logit_softcapping, if set

Every RMSNorm multiplies by (1 + weight) in float32 and casts once. Local layers
("sliding_attention") attend inside `sliding_window` with RoPE base `rope_local_base_freq`;
global layers ("full_attention") attend to everything with `rope_theta` and its scaling
(`rope_parameters` keyed by layer type in transformers 5). Scores are scaled by
query_pre_attn_scalar ** -0.5. Defaults: transformers 5.24 `Gemma3TextConfig`.

A ForConditionalGeneration checkpoint keeps the text model under `language_model.model.` (or
`model.language_model.`); the vision tower and the multimodal projector are skipped (one log
line each); prompts are text only.

Two keys of `Gemma3TextConfig` are read as transformers 5.25 reads them, which may surprise:

- `attn_logit_softcapping` (null in every Gemma 3 checkpoint; Gemma 2 had 50) is accepted and
  NOT applied: transformers' Gemma3Attention stores it but never passes it to its attention
  function (its eager path would cap only if given `softcap=`), so a Gemma 3 with the key set
  gives the logits of the same model without it. hybridkv does the same and logs one warning;
  its kernels can soft-cap (`SelfAttention(softcap=)`), for families that do apply it.
- `use_bidirectional_attention` (EmbeddingGemma, an encoder: a prompt token attends to the
  tokens after it as well as before, inside a window on sliding layers) is refused on purpose,
  in one line naming the key: a token's output would depend on tokens after it, so it cannot be
  decoded token by token, prefilled in chunks or served from a prefix cache, which is all this
  engine does; embedding models are not served here.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import column, current, declare_shards
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.activation import gelu_tanh_mul
from hybridkv.layers.attention.self_attention import CosSin, SelfAttention
from hybridkv.layers.mlp import ZeroCenteredRMSNorm
from hybridkv.layers.rotary import RotaryEmbedding, rope_parameters
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import HFConfig, layer_types
from hybridkv.ops.elementwise import logits_float32, residual_add

logger = logging.getLogger("hybridkv")

SUPPORTED_ACTIVATIONS = ("gelu_pytorch_tanh",)
DEFAULT_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


@dataclasses.dataclass(frozen=True)
class Gemma3TextConfig(HFConfig):
    """Defaults: transformers 5.24 `Gemma3TextConfig` (`sliding_window_pattern` is the older
    spelling of the layout, read when `layer_types` is absent)."""

    ARCHITECTURE = "Gemma3ForCausalLM"

    vocab_size: int = 262_208
    hidden_size: int = 2304
    intermediate_size: int = 9216
    num_hidden_layers: int = 26
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    query_pre_attn_scalar: float = 256
    sliding_window: int | None = 4096
    sliding_window_pattern: int = 6
    layer_types: tuple | None = None
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    use_bidirectional_attention: bool | None = False
    rope_parameters: dict | None = None
    rope_theta: float | None = None
    rope_local_base_freq: float | None = None
    rope_scaling: dict | None = None

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window_pattern",
        )  # fmt: skip
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: num_attention_heads "
                f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.hidden_activation not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: hidden_activation="
                f"{self.hidden_activation!r} is not supported (only gelu_pytorch_tanh)"
            )
        if self.use_bidirectional_attention:  # (see the module docstring)
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: use_bidirectional_attention=true "
                "(EmbeddingGemma, an encoder) is not supported: bidirectional attention cannot "
                "be decoded causally, prefilled in chunks or prefix-cached"
            )
        cap = self.final_logit_softcapping
        if cap is not None and not cap > 0:  # (tanh(x / 0) * 0: NaN logits in transformers)
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: final_logit_softcapping must be positive "
                f"or null, got {cap}"
            )
        if self.query_pre_attn_scalar <= 0:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: query_pre_attn_scalar must be positive, "
                f"got {self.query_pre_attn_scalar}"
            )
        self._set("layer_types", self._layout())
        if "sliding_attention" in self.layer_types and (
            self.sliding_window is None or self.sliding_window <= 0
        ):
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: sliding layers need a positive "
                f"sliding_window, got {self.sliding_window!r}"
            )
        self.rope_for("full_attention")  # one-line errors for an unsupported rope, at load time
        self.rope_for("sliding_attention")

    def _layout(self) -> tuple[str, ...]:
        """The kind of each layer: sliding_attention or full_attention."""
        n = self.num_hidden_layers
        if self.layer_types is None:
            pattern = self.sliding_window_pattern
            return tuple(
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                for i in range(n)
            )
        allowed = ("attention", "sliding_attention")
        roles = layer_types(self.layer_types, "layer_types", allowed, self.ARCHITECTURE)
        if len(roles) != n:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: layer_types has {len(roles)} entries but "
                f"num_hidden_layers is {n}"
            )
        return tuple("full_attention" if r == "attention" else r for r in roles)

    def rope_for(self, kind: str) -> dict[str, Any]:
        """The RoPE of one layer kind ("full_attention" / "sliding_attention"), as
        `RotaryEmbedding` takes it: `rope_parameters[kind]`, else the older keys (`rope_theta`
        and `rope_scaling` for global layers, `rope_local_base_freq` for local ones)."""
        nested = dict(self.rope_parameters or {})
        if nested and not set(nested) & set(DEFAULT_THETA):
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: rope_parameters must be keyed by layer "
                f"type (full_attention, sliding_attention), got keys {sorted(nested)}"
            )
        params = dict(nested.get(kind) or {"rope_type": "default"})
        if kind == "full_attention":
            params.update(self.rope_scaling or {})
            theta = self.rope_theta
        else:
            theta = self.rope_local_base_freq
        params.setdefault("rope_theta", theta if theta is not None else DEFAULT_THETA[kind])
        try:
            return rope_parameters({"rope_parameters": params})
        except ValueError as exc:
            raise ConfigError(f"config.json of {self.ARCHITECTURE}: {exc}") from None

    @property
    def windows(self) -> tuple[int | None, ...]:
        """The sliding window of each layer (None: global attention)."""
        assert self.layer_types is not None
        return tuple(
            self.sliding_window if kind == "sliding_attention" else None
            for kind in self.layer_types
        )


class Gemma3MLP(nn.Module):
    """GELU(tanh)-gated MLP with separate gate / up / down projections, no bias."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.tp = tp = current()  # tensor parallel: this rank's slice of the intermediate
        full = intermediate_size
        intermediate_size = tp.split(full, "intermediate_size")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        declare_shards(self.gate_proj, weight=column(tp, (0, full)))
        declare_shards(self.up_proj, weight=column(tp, (0, full)))
        declare_shards(self.down_proj, weight=column(tp, (0, full), dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (row-parallel down_proj: all-reduced)."""
        gate, up = self.gate_proj(x), self.up_proj(x)  # [T, inter]
        act = gelu_tanh_mul(gate, up)  # one pass on the CPU
        return self.tp.all_reduce(self.down_proj(act))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.is_sliding = cfg.windows[index] is not None
        self.self_attn = SelfAttention(
            index, hidden, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            bias=cfg.attention_bias, scale=float(cfg.query_pre_attn_scalar) ** -0.5,
            sliding_window=cfg.windows[index], qk_norm_eps=eps,
        )  # fmt: skip
        # Gemma's q/k norms multiply by (1 + weight) like its other norms
        self.self_attn.q_norm = ZeroCenteredRMSNorm(cfg.head_dim, eps)
        self.self_attn.k_norm = ZeroCenteredRMSNorm(cfg.head_dim, eps)
        self.mlp = Gemma3MLP(hidden, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_feedforward_layernorm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding,
        cos_sin: CosSin,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `rotary` / `cos_sin` are this layer kind's."""
        h = self.self_attn(self.input_layernorm(x), batch, rotary, cos_sin)
        x, h = self.pre_feedforward_layernorm.add_forward(x, self.post_attention_layernorm(h))
        return residual_add(x, self.post_feedforward_layernorm(self.mlp(h)))


class Gemma3TextModel(nn.Module):
    def __init__(self, cfg: Gemma3TextConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3ForCausalLM(CausalLM):
    tensor_parallel = True

    config_class: type[Gemma3TextConfig] = Gemma3TextConfig

    def __init__(self, config: Gemma3TextConfig) -> None:
        super().__init__(config)
        self.model = Gemma3TextModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary_global = RotaryEmbedding(config.head_dim, config.rope_for("full_attention"))
        self.rotary_local = RotaryEmbedding(config.head_dim, config.rope_for("sliding_attention"))
        self.embed_scale = config.hidden_size**0.5
        self.softcap = config.final_logit_softcapping
        self._skipped: dict[str, int] = {}
        if config.attn_logit_softcapping is not None:  # (see the module docstring)
            logger.warning(
                "%s: attn_logit_softcapping=%s is not applied, as transformers' Gemma 3 does "
                "not apply it", config.ARCHITECTURE, config.attn_logit_softcapping,
            )  # fmt: skip

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden: [num_tokens, hidden]."""
        # [T, hidden]; the scale rounded to the model dtype first, as transformers does
        dtype = self.model.embed_tokens.weight.dtype
        x = self.model.embed_tokens(batch.input_ids, self._embed_scale(dtype))
        local = self.rotary_local.cos_sin(batch.positions, x.dtype)  # 2 x [T, head_dim]
        glob = self.rotary_global.cos_sin(batch.positions, x.dtype)
        for layer in self.model.layers:
            if layer.is_sliding:
                x = layer(x, batch, self.rotary_local, local)
            else:
                x = layer(x, batch, self.rotary_global, glob)
        return self.model.norm(x)

    def _embed_scale(self, dtype: torch.dtype) -> float:
        """sqrt(hidden_size) as a value of the model dtype."""
        scales = self.__dict__.setdefault("_embed_scales", {})
        if dtype not in scales:
            scales[dtype] = float(torch.tensor(self.embed_scale, dtype=dtype))
        return scales[dtype]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits: [n, vocab] float32, soft-capped if configured."""
        # (the cap in the model dtype, then float32: one native call on the CPU)
        return logits_float32(self.lm_head(hidden), softcap=self.softcap)

    # -- weights -----------------------------------------------------------------------------

    SKIPPED_PREFIXES: tuple[str, ...] = ()

    def map_weight_name(self, name: str) -> str | None:
        for prefix in self.SKIPPED_PREFIXES:
            if name.startswith(prefix):
                self._skipped[prefix] = self._skipped.get(prefix, 0) + 1
                return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._skipped = {}
        super().load_weights(weights)
        for prefix, count in self._skipped.items():
            logger.info("skipped %d checkpoint tensors under %r (not used here)", count, prefix)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text model of a Gemma 3 multimodal checkpoint; the vision tower and the projector
    are skipped. Hub checkpoints (and transformers 5's save_pretrained) name the text model
    `language_model.model.`, transformers 4.5x's `model.language_model.`: both load."""

    SKIPPED_PREFIXES = (
        "vision_tower.", "multi_modal_projector.",
        "model.vision_tower.", "model.multi_modal_projector.",
    )  # fmt: skip
    TEXT_PREFIXES = {
        "language_model.model.": "model.",
        "model.language_model.": "model.",
        "language_model.lm_head.": "lm_head.",
    }

    def map_weight_name(self, name: str) -> str | None:
        for prefix, ours in self.TEXT_PREFIXES.items():
            if name.startswith(prefix):
                return ours + name[len(prefix) :]
        return super().map_weight_name(name)
