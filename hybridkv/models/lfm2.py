"""LFM2 (Lfm2ForCausalLM) and LFM2-MoE (Lfm2MoeForCausalLM): gated short-convolution layers
and attention layers, each followed by a SwiGLU feed-forward (LFM2-MoE: a sigmoid-routed
mixture of experts after the first `num_dense_layers` layers).

    x = embed(ids)
    per layer:  x += operator(operator_norm(x))        operator: ShortConv | attention
                x += feed_forward(ffn_norm(x))          SwiGLU MLP (w1, w3, w2) | MoE
    logits = lm_head(embedding_norm(x))                 (the final norm is `embedding_norm`)

- Layout: `layer_types` ("conv" or "full_attention"); LFM2 without it takes `full_attn_idxs`
  (default: every layer attention), as transformers derives it. transformers' LFM2-MoE has no
  default layout (its model fails without `layer_types`); here it then is every layer
  attention, as LFM2's.
- Short conv (`hybridkv.layers.short_conv`): in_proj -> B, C, x; causal depthwise conv of
  `conv_L_cache` taps over B * x (state: the last L_cache - 1 columns); C * conv; out_proj.
  Biases on every piece when `conv_bias`.
- Attention: RoPE (theta 1e6 by default), per-head RMSNorm of q and k before RoPE
  (`q_layernorm` / `k_layernorm`), head_dim = hidden_size // heads unless a `head_dim` key says.
  Checkpoint names `self_attn.out_proj` / `q_layernorm` / `k_layernorm` map onto
  `SelfAttention`'s o_proj / q_norm / k_norm.
- LFM2 MLP width: with `block_auto_adjust_ff_dim`, int(2/3 * intermediate_size), times
  `block_ffn_dim_multiplier`, rounded up to `block_multiple_of`. LFM2-MoE's
  dense MLPs take intermediate_size as it is; experts take moe_intermediate_size.
- MoE router: logits in the model dtype, sigmoid scores; top-k by score + `expert_bias` (when
  `use_expert_bias`) but weighted by the plain score; with `norm_topk_prob` divided by
  (sum + 1e-6); times `routed_scaling_factor`.
- Keys: `block_ff_dim` (LFM2) wins over intermediate_size and `tie_embedding` over
  tie_word_embeddings, as transformers' configs pop them.

Checkpoints hold one tensor per expert (`feed_forward.experts.{e}.w1/w3/w2.weight`), stacked
here into `experts.gate_up_proj` [E, 2I, H] ([w1 | w3] rows) and `experts.down_proj` [E, H, I];
transformers' in-memory stacked names load as they are.

Tensor parallel: the short convs split by channel (`hybridkv.layers.short_conv`), attention by
head (its q/k norms are per head, so replicated), the MLPs and every expert by intermediate
size (the router and expert bias replicated, the experts' partial sums all-reduced once),
embeddings and lm_head by vocabulary.

Defaults: transformers 5.24 `Lfm2Config` and `Lfm2MoeConfig`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import column, current, declare_shards
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.activation import silu_mul
from hybridkv.layers.attention.self_attention import CosSin, SelfAttention
from hybridkv.layers.mlp import RMSNorm
from hybridkv.layers.moe import GatedExperts, RoutingRule, route
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.layers.short_conv import ShortConv
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig
from hybridkv.models.loader import stack_gated_experts
from hybridkv.ops.elementwise import residual_add

EXPERT_WEIGHT = re.compile(r"^(.*\.feed_forward\.experts)\.(\d+)\.(w1|w3|w2)\.weight$")
ATTENTION_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
)
ATTENTION_TYPES = ("full_attention", "attention")


@dataclasses.dataclass(frozen=True)
class Lfm2Config(RopeConfig):
    """Defaults: transformers 5.24 `Lfm2Config`."""

    ARCHITECTURE = "Lfm2ForCausalLM"
    ALIASES = {
        "intermediate_size": ("block_ff_dim", "intermediate_size"),
        "tie_word_embeddings": ("tie_embedding", "tie_word_embeddings"),
    }

    vocab_size: int = 65536
    hidden_size: int = 2560
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None  # not a config field; None: hidden_size // heads
    max_position_embeddings: int = 128_000
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    rope_theta: float | None = 1_000_000.0  # transformers' default_theta for LFM2
    conv_bias: bool = False
    conv_L_cache: int = 3
    block_multiple_of: int = 256
    block_ffn_dim_multiplier: float = 1.0  # null: this default, as for every key
    block_auto_adjust_ff_dim: bool = True
    full_attn_idxs: tuple[int, ...] | None = None
    layer_types: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "conv_L_cache",
        )  # fmt: skip
        if self.layer_types is None and self.ARCHITECTURE == "Lfm2ForCausalLM":
            n = self.num_hidden_layers
            idxs = self.full_attn_idxs if self.full_attn_idxs is not None else tuple(range(n))
            self._set("full_attn_idxs", tuple(idxs))
            types = tuple("full_attention" if i in idxs else "conv" for i in range(n))
            self._set("layer_types", types)
        self._check_layout()
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"config.json of {self.ARCHITECTURE}: hidden_size ({self.hidden_size}) must "
                    f"be a multiple of num_attention_heads ({self.num_attention_heads})"
                )
            self._set("head_dim", self.hidden_size // self.num_attention_heads)
        self._require_positive("head_dim")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: num_attention_heads "
                f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        if self.conv_L_cache < 2:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: conv_L_cache must be at least 2, "
                f"got {self.conv_L_cache}"
            )
        self._check_ff()

    def _check_layout(self) -> None:
        if self.layer_types is None:
            return
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: layer_types has {len(self.layer_types)} "
                f"entries for num_hidden_layers {self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in ("conv", *ATTENTION_TYPES)})
        if bad:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: unknown layer type(s) {bad} in "
                f"layer_types; allowed: conv, full_attention"
            )

    def _check_ff(self) -> None:
        if self.block_auto_adjust_ff_dim:
            self._require_positive("block_multiple_of")
        self._require_positive_value("feed-forward width", self.ff_dim)

    def _require_positive_value(self, what: str, value: int) -> None:
        if value <= 0:
            raise ConfigError(f"config.json of {self.ARCHITECTURE}: {what} is {value}, not > 0")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """'conv' or 'attention' per layer."""
        if self.layer_types is None:
            return ("attention",) * self.num_hidden_layers
        return tuple("conv" if t == "conv" else "attention" for t in self.layer_types)

    @property
    def ff_dim(self) -> int:
        """The dense SwiGLU width, by LFM2's sizing rule."""
        width = self.intermediate_size
        if self.block_auto_adjust_ff_dim:
            width = int(self.block_ffn_dim_multiplier * int(2 * width / 3))
            m = self.block_multiple_of
            width = m * ((width + m - 1) // m)
        return width

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return ()

    def short_conv(self, index: int) -> ShortConv:
        return ShortConv(self.hidden_size, self.conv_L_cache, self.conv_bias, layer_index=index)

    def attention(self, index: int) -> SelfAttention:
        assert self.head_dim is not None
        return SelfAttention(
            index, self.hidden_size, self.num_attention_heads, self.num_key_value_heads,
            self.head_dim, qk_norm_eps=self.norm_eps,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Lfm2MoeConfig(Lfm2Config):
    """Defaults: transformers 5.24 `Lfm2MoeConfig` (no block_* sizing: its dense MLPs take
    intermediate_size as it is)."""

    ARCHITECTURE = "Lfm2MoeForCausalLM"
    ALIASES = {"tie_word_embeddings": ("tie_embedding", "tie_word_embeddings")}

    hidden_size: int = 2048
    intermediate_size: int = 7168
    moe_intermediate_size: int = 1792
    block_auto_adjust_ff_dim: bool = dataclasses.field(default=False, init=False)
    num_dense_layers: int = 2
    num_experts_per_tok: int = 4
    num_experts: int = 32
    use_expert_bias: bool = True
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True

    def _check_ff(self) -> None:
        self._require_positive("moe_intermediate_size", "num_experts", "num_experts_per_tok")
        if self.num_dense_layers < 0:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: num_dense_layers must be >= 0, "
                f"got {self.num_dense_layers}"
            )
        if self.moe_layers and self.num_experts_per_tok > self.num_experts:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: num_experts_per_tok "
                f"({self.num_experts_per_tok}) is more than num_experts ({self.num_experts})"
            )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_dense_layers, self.num_hidden_layers))


class Lfm2MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x). Tensor parallel: w1 / w3 column-parallel, w2
    row-parallel (its output all-reduced)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.tp = tp = current()
        full, intermediate = intermediate, tp.split(intermediate, "feed-forward width")
        self.w1 = nn.Linear(hidden, intermediate, bias=False)
        self.w3 = nn.Linear(hidden, intermediate, bias=False)
        self.w2 = nn.Linear(intermediate, hidden, bias=False)
        rows = column(tp, (0, full))
        declare_shards(self.w1, weight=rows)
        declare_shards(self.w3, weight=rows)
        declare_shards(self.w2, weight=column(tp, (0, full), dim=1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        return self.tp.all_reduce(self.w2(silu_mul(self.w1(x), self.w3(x))))


class Lfm2SparseMoe(nn.Module):
    """Sigmoid router (expert bias for the choice only), top-k, SwiGLU experts. Tensor
    parallel: the router replicated, each expert's intermediate size split."""

    def __init__(self, cfg: Lfm2MoeConfig) -> None:
        super().__init__()
        self.tp = current()
        # sigmoid scores in the model dtype (float32=False), as transformers computes them
        self.rule = RoutingRule(
            cfg.num_experts_per_tok, "sigmoid", cfg.norm_topk_prob, renormalise_eps=1e-6,
            scaling=cfg.routed_scaling_factor, float32=False,
        )  # fmt: skip
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.experts = GatedExperts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        bias = torch.zeros(cfg.num_experts) if cfg.use_expert_bias else None  # [E]
        self.register_buffer("expert_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        routing = route(x, self.gate, self.rule, self.expert_bias)  # bias: the choice only
        return self.tp.all_reduce(self.experts(x, routing))  # partial sums


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: Lfm2Config, index: int) -> None:
        super().__init__()
        if cfg.layer_kinds[index] == "conv":
            self.conv = cfg.short_conv(index)
        else:
            self.self_attn = cfg.attention(index)
        if index in cfg.moe_layers:
            assert isinstance(cfg, Lfm2MoeConfig)
            self.feed_forward: nn.Module = Lfm2SparseMoe(cfg)
        else:
            self.feed_forward = Lfm2MLP(cfg.hidden_size, cfg.ff_dim)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        h = self.operator_norm(x)
        if hasattr(self, "conv"):
            h = self.conv(h, batch)
        else:
            h = self.self_attn(h, batch, rotary, cos_sin)
        x, h = self.ffn_norm.add_forward(x, h)
        return residual_add(x, self.feed_forward(h))


class Lfm2Model(nn.Module):
    def __init__(self, cfg: Lfm2Config) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)  # tensor parallel
        self.layers = nn.ModuleList(Lfm2DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.embedding_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)


class Lfm2ForCausalLM(CausalLM):
    tensor_parallel = True

    config_class: type[Lfm2Config] = Lfm2Config

    def __init__(self, config: Lfm2Config) -> None:
        super().__init__(config)
        self.model = Lfm2Model(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        assert config.head_dim is not None
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden: [num_tokens, hidden]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, rotary_dim]
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.embedding_norm(x)

    def map_weight_name(self, name: str) -> str | None:
        for old, new in ATTENTION_RENAMES:
            name = name.replace(old, new)
        return name


class Lfm2MoeForCausalLM(Lfm2ForCausalLM):
    config_class = Lfm2MoeConfig

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            stack_gated_experts(weights, EXPERT_WEIGHT, self.config.num_experts, ("w1", "w3", "w2"))
        )
