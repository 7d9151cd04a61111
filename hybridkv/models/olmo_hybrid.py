"""OLMo Hybrid (OlmoHybridForCausalLM): gated delta net layers with an OLMo-3 attention layer
every fourth layer (by default), the same gated delta rule as Qwen3-Next.

    x = embed(ids)
    gated delta net layer (pre-norm, Llama style):
                x += gdn(input_layernorm(x))
                x += mlp(post_attention_layernorm(x))
    attention layer (post-norm, OLMo 2/3 style):
                x += post_attention_layernorm(attention(x))
                x += post_feedforward_layernorm(mlp(x))
    logits = lm_head(norm(x))

- Norms are plain RMSNorms (x_hat * weight, the weight applied in float32 before the cast back).
- Attention: q_norm / k_norm over the whole projection (all heads together, not per head),
  then RoPE over the full head_dim; head_dim = hidden_size / num_attention_heads. Released
  checkpoints use no RoPE at all ("NoPE": `rope_parameters.rope_theta` null), which this
  model follows.
- Gated delta net: separate q/k/v/g/a/b projections (`hybridkv.layers.gated_delta_net`, layout
  "olmo_hybrid"); beta = 2 * sigmoid(b) when `linear_allow_neg_eigval` (the default); the
  output norm has eps 1e-5 whatever `rms_norm_eps` says, as transformers builds it.

Tensor parallel: the gated delta nets shard themselves (`hybridkv.layers.gated_delta_net`);
attention splits its heads (KV heads split, or one replicated per rank) with o_proj
row-parallel; the MLPs split their intermediate size; embeddings and lm_head their vocabulary.
The q / k norms normalise over every head of the full projection, so each rank holds its slice
of their weights and the sums of squares of its q and k slices are all-reduced (one [T, 2]
sum; a KV head replicated on r ranks counts 1 / r on each), then each rank scales its slice.

Checkpoints name the two norms of every layer `attention_layer_norm` / `feedforward_layer_norm`
(read as `input_layernorm` / `post_attention_layernorm`, the names transformers gives them in
memory and which load too), and hold the conv of q, k and v as three tensors
(`linear_attn.{q,k,v}_conv1d.weight`), joined here into the layer's one conv over [q | k | v];
`linear_attn.o_proj` / `o_norm` load into the layer's `out_proj` / `norm`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import column, declare_shards, explicit
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.attention.self_attention import SelfAttention
from hybridkv.layers.gated_delta_net import GatedDeltaNet
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig, layer_types
from hybridkv.ops.norm import _apply_weight as apply_norm_weight

GDN_NORM_EPS = 1e-5  # transformers' OlmoHybridGatedDeltaNet.o_norm, fixed
CONV_PART = re.compile(r"^(.*\.linear_attn)\.([qkv])_conv1d\.weight$")


@dataclasses.dataclass(frozen=True)
class OlmoHybridConfig(RopeConfig):
    """Defaults: transformers 5.24 `OlmoHybridConfig` (the None ones derived as it does)."""

    ARCHITECTURE = "OlmoHybridForCausalLM"

    vocab_size: int = 100352
    hidden_size: int = 3840
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 30
    num_key_value_heads: int | None = None  # None: num_attention_heads
    hidden_act: str = "silu"
    max_position_embeddings: int = 65536
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    layer_types: tuple | None = None  # None: attention on every fourth layer (3, 7, ...)
    linear_num_key_heads: int | None = None  # None: num_attention_heads
    linear_num_value_heads: int | None = None  # None: num_attention_heads
    linear_key_head_dim: int | None = None  # None: int(0.75 * hidden / linear key heads)
    linear_value_head_dim: int | None = None  # None: 2 * linear_key_head_dim
    linear_conv_kernel_dim: int = 4
    linear_allow_neg_eigval: bool = True

    def __post_init__(self) -> None:
        self._require_positive("vocab_size", "hidden_size", "intermediate_size",
                               "num_hidden_layers", "num_attention_heads")  # fmt: skip
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only silu)")
        heads = self.num_attention_heads
        for key in ("num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads"):
            if getattr(self, key) is None:
                self._set(key, heads)
        if self.linear_key_head_dim is None:
            derived = int(0.75 * self.hidden_size / self.linear_num_key_heads)
            self._set("linear_key_head_dim", derived)
        if self.linear_value_head_dim is None:
            self._set("linear_value_head_dim", 2 * self.linear_key_head_dim)
        self._require_positive(
            "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads",
            "linear_key_head_dim", "linear_value_head_dim",
        )  # fmt: skip
        if self.hidden_size % heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({heads}): OLMo Hybrid's head_dim is their quotient"
            )
        if heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        self._set("layer_types", self._layout())
        self.rope  # one-line errors for an unsupported rope type, at load time  # noqa: B018

    def _layout(self) -> tuple[str, ...]:
        n = self.num_hidden_layers
        if self.layer_types is None:  # transformers: every fourth, at least the last one
            kinds = ["attention" if i % 4 == 3 else "mamba" for i in range(n)]
            if "attention" not in kinds:
                kinds[-1] = "attention"
            return tuple(kinds)
        kinds = layer_types(self.layer_types, "layer_types", ("mamba", "attention"),
                            self.ARCHITECTURE)  # fmt: skip
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries but num_hidden_layers is {n}")
        return kinds

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def uses_rope(self) -> bool:
        """False for NoPE checkpoints: `rope_parameters` present with rope_theta null."""
        params = self.rope_parameters
        return not (isinstance(params, dict) and "rope_theta" in params
                    and params["rope_theta"] is None)  # fmt: skip

    @property
    def rope(self) -> dict:
        if not self.uses_rope:
            return {"rope_type": "default", "rope_theta": None}
        return super().rope

    def gdn(self, index: int) -> GatedDeltaNet:
        return GatedDeltaNet(
            self.hidden_size, self.linear_num_key_heads, self.linear_num_value_heads,
            self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim,
            GDN_NORM_EPS, "olmo_hybrid", beta_scale=2.0 if self.linear_allow_neg_eigval else 1.0,
            layer_index=index,
        )  # fmt: skip


class OlmoAttention(SelfAttention):
    """OLMo 2/3 attention: q_norm / k_norm over the whole projection ([heads * head_dim]),
    before RoPE (or none). Tensor parallel: see the module docstring."""

    def __init__(self, cfg: OlmoHybridConfig, index: int) -> None:
        hd = cfg.head_dim
        super().__init__(index, cfg.hidden_size, cfg.num_attention_heads,
                         cfg.num_key_value_heads, hd, cfg.attention_bias)  # fmt: skip
        tp, full_kv = self.tp, cfg.num_key_value_heads
        self.q_norm = RMSNorm(self.heads * hd, cfg.rms_norm_eps, weight_in_fp32=True)
        self.k_norm = RMSNorm(self.kv_heads * hd, cfg.rms_norm_eps, weight_in_fp32=True)
        _, first_kv = tp.replicated(full_kv, "num_key_value_heads")
        declare_shards(self.q_norm, weight=column(tp, (0, cfg.num_attention_heads * hd)))
        declare_shards(self.k_norm, weight=explicit(tp, (first_kv * hd, self.kv_heads * hd)))
        self.q_width, self.k_width = cfg.num_attention_heads * hd, full_kv * hd  # full widths
        self.kv_replicas = max(1, tp.size // full_kv)  # ranks holding each KV head

    def _qk_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of q [T, heads * hd] and k [T, kv_heads * hd] over the full projections:
        this rank's slices, the sums of squares all-reduced (one [T, 2] sum)."""
        if self.tp.size == 1:
            return self.q_norm(q), self.k_norm(k)
        qf, kf = q.float(), k.float()
        local = torch.stack([qf.pow(2).sum(-1), kf.pow(2).sum(-1) / self.kv_replicas], dim=-1)
        sums = self.tp.all_reduce(local)  # [T, 2]
        out = []
        for xf, x, norm, width, col in ((qf, q, self.q_norm, self.q_width, 0),
                                        (kf, k, self.k_norm, self.k_width, 1)):  # fmt: skip
            x_hat = xf * torch.rsqrt(sums[:, col, None] / width + norm.eps)
            out.append(apply_norm_weight(x_hat, norm.weight, x.dtype, norm.weight_in_fp32))
        return out[0], out[1]

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None = None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        t = x.shape[0]
        # q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]
        q, k = self._qk_norms(self.q_proj(x), self.k_proj(x))
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if rotary is not None and cos_sin is not None:  # float32 cos/sin: back to v's dtype
            q, k = (r.to(v.dtype) for r in rotary(q, k, *cos_sin))
        return self.tp.all_reduce(self.o_proj(self.attn(q, k, v, batch)))  # row-parallel


class OlmoHybridDecoderLayer(nn.Module):
    def __init__(self, cfg: OlmoHybridConfig, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.mlp = GatedMLP(hidden, cfg.intermediate_size)
        self.post_attention_layernorm = RMSNorm(hidden, eps, weight_in_fp32=True)
        if cfg.layer_types[index] == "mamba":  # type: ignore[index]
            self.linear_attn = cfg.gdn(index)
            self.input_layernorm = RMSNorm(hidden, eps, weight_in_fp32=True)
        else:
            self.self_attn = OlmoAttention(cfg, index)
            self.post_feedforward_layernorm = RMSNorm(hidden, eps, weight_in_fp32=True)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        if hasattr(self, "linear_attn"):  # pre-norm
            x = x + self.linear_attn(self.input_layernorm(x), batch)
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(self.self_attn(x, batch, rotary, cos_sin))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class OlmoHybridModel(nn.Module):
    def __init__(self, cfg: OlmoHybridConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)  # tensor parallel
        self.layers = nn.ModuleList(
            OlmoHybridDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, weight_in_fp32=True)


class OlmoHybridForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = OlmoHybridConfig

    def __init__(self, config: OlmoHybridConfig) -> None:
        super().__init__(config)
        self.model = OlmoHybridModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope) if config.uses_rope else None

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        # cos/sin in float32, as transformers keeps them for this family
        cos_sin = None
        if self.rotary is not None:
            cos_sin = self.rotary.cos_sin(batch.positions, torch.float32)
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)

    # -- weights -----------------------------------------------------------------------------

    RENAMES = (
        (".attention_layer_norm.", ".input_layernorm."),  # checkpoints' names for the norms
        (".feedforward_layer_norm.", ".post_attention_layernorm."),
        (".linear_attn.o_proj.", ".linear_attn.out_proj."),  # the layer's names
        (".linear_attn.o_norm.", ".linear_attn.norm."),
    )

    def map_weight_name(self, name: str) -> str | None:
        for old, new in self.RENAMES:
            name = name.replace(old, new)
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_joined_convs(weights))


def _joined_convs(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoints hold the depthwise conv of q, k and v as three tensors
    (`linear_attn.{q,k,v}_conv1d.weight`, each [channels, 1, kernel]); the layer's conv1d runs
    over [q | k | v]: yield their concatenation once all three of a layer arrived."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in weights:
        match = CONV_PART.match(name)
        if match is None:
            yield name, tensor
            continue
        prefix, part = match.groups()
        parts = pending.setdefault(prefix, {})
        parts[part] = tensor
        if len(parts) == 3:
            del pending[prefix]
            yield f"{prefix}.conv1d.weight", torch.cat([parts["q"], parts["k"], parts["v"]])
    if pending:
        got = {prefix: sorted(parts) for prefix, parts in pending.items()}
        raise ValueError(f"checkpoint lacks some of q/k/v_conv1d.weight: {got}")
