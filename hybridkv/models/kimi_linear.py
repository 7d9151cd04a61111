"""Kimi-Linear (KimiLinearForCausalLM): Kimi delta attention (KDA) layers with a multi-head
latent attention (MLA) layer every few layers, MoE MLPs after the first dense ones.

    x = embed(ids)
    per layer:  x += mixer(input_layernorm(x))     mixer: KDA (layers/kda.py) | MLA without RoPE
                x += ffn(post_attention_layernorm(x))   ffn: SwiGLU MLP | MoE
    logits = lm_head(norm(x))

- Which layers are MLA: `layer_types` ("full_attention" / "linear_attention") if given, else
  the checkpoint's `linear_attn_config` lists `full_attn_layers` and `kda_layers` (1-based),
  else transformers' default (full attention at every 4th index i > 0). KDA sizes come from
  `linear_attn_config` (`num_heads`, `head_dim`, `short_conv_kernel_size`) over the top-level
  `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`, as transformers reads them.
- MLA: no rotary embedding at all (NoPE; transformers applies none): the `qk_rope_head_dim`
  part of the key is shared by the heads and used as it comes, and it is still cached (MLASpec
  bytes per token = kv_lora_rank + qk_rope_head_dim). Softmax scale 1/sqrt(nope + rope); the
  LoRA norms use eps 1e-6 (transformers builds them with its RMSNorm default).
- `num_key_value_heads` changes no weight (kv_b_proj expands the latent into keys and values
  for every query head). transformers' attention then repeats those per-head keys and values
  num_attention_heads // num_key_value_heads times: 1 or 0 times (kv heads above half the
  heads; 0: its default SDPA path skips the repeat, its eager path fails) leave the math of
  kv heads == heads, which hybridkv computes; 2 or more make its forward fail on mismatched
  head counts, so hybridkv refuses those in one line.
- MoE (`mlp_layer_types`, else dense for the first `first_k_dense_replace` layers): DeepSeek-V3's
  grouped sigmoid router with score-correction bias and `routed_scaling_factor`
  (`layers.moe.RoutingRule`, the same routing as transformers' KimiLinear), SwiGLU experts and
  `num_shared_experts` shared experts.
- Checkpoints: the released names (`block_sparse_moe.experts.{e}.w1/w3/w2`, read as
  `mlp.experts` and stacked into `gate_up_proj` / `down_proj`; `self_attn.q_conv1d`,
  `f_a_proj`, `A_log`, ...), which is also how transformers saves them.
- Tensor parallel: KDA by heads (layers/kda.py: per-rank states), MLA by heads (the latent
  replicated), dense MLPs, experts and shared experts by intermediate size (router replicated;
  the MoE's partial sums all-reduced once), vocabulary-parallel embeddings and lm_head.
Defaults: transformers 5.24 `KimiLinearConfig`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.attention.mla import MultiHeadLatentAttention
from hybridkv.layers.kda import KimiDeltaAttention
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.moe import GatedExperts, Router, RoutingRule, SharedExpertsMoE
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import HFConfig
from hybridkv.models.loader import stack_gated_experts
from hybridkv.ops.elementwise import residual_add

EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(w1|w3|w2)\.weight$")
MIXERS = ("full_attention", "linear_attention")
FFNS = ("dense", "sparse")
LORA_NORM_EPS = 1e-6  # transformers' KimiLinearRMSNorm default, used for q_a / kv_a norms


@dataclasses.dataclass(frozen=True)
class KimiLinearConfig(HFConfig):
    """Defaults: transformers 5.24 `KimiLinearConfig` (its attribute_map spellings as aliases)."""

    ARCHITECTURE: ClassVar[str] = "KimiLinearForCausalLM"
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "max_position_embeddings": ("model_max_length",),
        "norm_topk_prob": ("moe_renormalize",),
        "n_group": ("num_expert_group",),
        "num_local_experts": ("num_experts",),
        "num_experts_per_tok": ("num_experts_per_token",),
        "n_shared_experts": ("num_shared_experts",),
    }

    vocab_size: int = 163840
    hidden_size: int = 2304
    intermediate_size: int = 9216
    moe_intermediate_size: int = 1024
    num_hidden_layers: int = 27
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 32  # None: num_attention_heads
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.446
    kv_lora_rank: int = 512
    q_lora_rank: int | None = None
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    num_local_experts: int = 256
    first_k_dense_replace: int = 1
    mlp_layer_types: tuple | None = None
    layer_types: tuple | None = None
    linear_head_dim: int = 128
    linear_num_heads: int = 32
    linear_conv_kernel_dim: int = 4
    linear_attn_config: dict | None = None

    def __post_init__(self) -> None:
        linear = dict(self.linear_attn_config or {})
        for key, field in (("head_dim", "linear_head_dim"), ("num_heads", "linear_num_heads"),
                           ("short_conv_kernel_size", "linear_conv_kernel_dim")):  # fmt: skip
            if linear.get(key) is not None:
                self._set(field, linear[key])
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "kv_lora_rank", "v_head_dim",
            "linear_head_dim", "linear_num_heads", "num_local_experts", "n_group",
            "topk_group", "num_experts_per_tok",
        )  # fmt: skip
        if self.hidden_act != "silu":
            self._fail(f"hidden_act {self.hidden_act!r} is not supported; supported: silu")
        heads = self.num_attention_heads
        kv_heads = heads if self.num_key_value_heads is None else self.num_key_value_heads
        if kv_heads <= 0 or heads // kv_heads > 1:  # (see the module docstring)
            self._fail(f"num_key_value_heads ({kv_heads}) must be more than half of "
                       f"num_attention_heads ({heads}): MLA keeps keys and values per query "
                       "head, and transformers' forward fails when it repeats them")
        if self.linear_conv_kernel_dim < 2:
            self._fail("short_conv_kernel_size must be at least 2, got "
                       f"{self.linear_conv_kernel_dim}")  # fmt: skip
        self._set("layer_types", self._mixers(linear))
        self._set("mlp_layer_types", self._ffns())
        self._check_routing()

    def _fail(self, message: str) -> None:
        raise ConfigError(f"config.json of {self.ARCHITECTURE}: {message}")

    def _mixers(self, linear: dict) -> tuple[str, ...]:
        n = self.num_hidden_layers
        if self.layer_types is not None:
            kinds = tuple(self.layer_types)
        elif "full_attn_layers" in linear and "kda_layers" in linear:
            slots: list[str | None] = [None] * n
            for key, kind in (("full_attn_layers", MIXERS[0]), ("kda_layers", MIXERS[1])):
                for one_based in linear[key]:
                    if not 1 <= int(one_based) <= n:
                        self._fail(f"linear_attn_config.{key} has layer {one_based}, outside "
                                   f"1..{n}")  # fmt: skip
                    slots[int(one_based) - 1] = kind
            missing = [i + 1 for i, s in enumerate(slots) if s is None]
            if missing:
                self._fail(f"linear_attn_config lists no mixer for layers {missing}")
            kinds = tuple(s for s in slots if s is not None)
        else:
            kinds = tuple(MIXERS[0] if i and i % 4 == 0 else MIXERS[1] for i in range(n))
        return self._checked(kinds, "layer_types", MIXERS)

    def _ffns(self) -> tuple[str, ...]:
        if self.mlp_layer_types is not None:
            kinds = tuple(self.mlp_layer_types)
        else:
            first = self.first_k_dense_replace
            kinds = tuple(FFNS[0] if i < first else FFNS[1] for i in range(self.num_hidden_layers))
        return self._checked(kinds, "mlp_layer_types", FFNS)

    def _checked(self, kinds: tuple, key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
        if len(kinds) != self.num_hidden_layers:
            self._fail(f"{key} has {len(kinds)} entries but num_hidden_layers is "
                       f"{self.num_hidden_layers}")  # fmt: skip
        bad = sorted({str(k) for k in kinds if k not in allowed})
        if bad:
            self._fail(f"{key} has {', '.join(bad)}; allowed: {', '.join(allowed)}")
        return kinds

    def _check_routing(self) -> None:
        e, groups = self.num_local_experts, self.n_group
        if e % groups or e // groups < 2:
            self._fail(f"num_experts ({e}) must be a multiple of num_expert_group ({groups}) "
                       "with at least 2 experts per group")  # fmt: skip
        if self.topk_group > groups:
            self._fail(f"topk_group ({self.topk_group}) must be at most num_expert_group "
                       f"({groups})")  # fmt: skip
        if self.num_experts_per_tok > self.topk_group * (e // groups):
            self._fail(f"num_experts_per_token ({self.num_experts_per_tok}) must be at most the "
                       f"experts of topk_group groups ({self.topk_group * (e // groups)})")

    @property
    def routing(self) -> RoutingRule:
        """DeepSeek-V3's: sigmoid scores, choice biased by e_score_correction_bias, groups by
        their top-2 (transformers' KimiLinear routes alike)."""
        return RoutingRule(
            self.num_experts_per_tok, "sigmoid", self.norm_topk_prob, renormalise_eps=1e-20,
            scaling=self.routed_scaling_factor, groups=self.n_group, groups_kept=self.topk_group,
            group_score="top2_sum", sorted=False,
        )  # fmt: skip


class KimiLinearMoE(SharedExpertsMoE):
    """Module `mlp` of a sparse layer (`block_sparse_moe` in checkpoints): the grouped sigmoid
    router `gate` (weight [E, hidden], e_score_correction_bias [E]), `experts`,
    `shared_experts`; the partial sums reduced once (tensor parallel)."""

    def __init__(self, cfg: KimiLinearConfig) -> None:
        hidden, e, inter = cfg.hidden_size, cfg.num_local_experts, cfg.moe_intermediate_size
        gate = Router(hidden, e, cfg.routing, correction_bias=True)
        shared = GatedMLP(hidden, inter * cfg.n_shared_experts)
        super().__init__(gate, GatedExperts(e, hidden, inter), shared)


class KimiLinearDecoderLayer(nn.Module):
    def __init__(self, cfg: KimiLinearConfig, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        assert cfg.layer_types is not None and cfg.mlp_layer_types is not None
        self.self_attn: nn.Module
        if cfg.layer_types[index] == "full_attention":
            self.self_attn = MultiHeadLatentAttention(
                index, hidden, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                cfg.qk_rope_head_dim, cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
                bias=cfg.attention_bias, norm_eps=LORA_NORM_EPS,
            )  # fmt: skip
        else:
            self.self_attn = KimiDeltaAttention(
                hidden, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim,
                eps, layer_index=index,
            )  # fmt: skip
        self.mlp: nn.Module
        if cfg.mlp_layer_types[index] == "sparse":
            self.mlp = KimiLinearMoE(cfg)
        else:
            self.mlp = GatedMLP(hidden, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (pre-norm residual blocks)."""
        h = self.self_attn(self.input_layernorm(x), batch)  # MLA: no rotary (NoPE)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return residual_add(x, self.mlp(h))


class KimiLinearModel(nn.Module):
    def __init__(self, cfg: KimiLinearConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            KimiLinearDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class KimiLinearForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = KimiLinearConfig

    def __init__(self, config: KimiLinearConfig) -> None:
        super().__init__(config)
        # transformers 5.24 never ties Kimi's lm_head (`_tied_weights_keys = {}`), whatever
        # tie_word_embeddings says: the checkpoint's lm_head.weight is read
        self.tie_word_embeddings = False
        self.model = KimiLinearModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoints name a sparse layer's MoE `block_sparse_moe` and a dense layer's MLP
        `mlp`; both are `mlp` here (as in transformers), the experts stacked."""
        renamed = ((n.replace(".block_sparse_moe.", ".mlp."), t) for n, t in weights)
        super().load_weights(
            stack_gated_experts(renamed, EXPERT_WEIGHT, self.config.num_local_experts,
                                ("w1", "w3", "w2"))  # fmt: skip
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden: [num_tokens, hidden]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        for layer in self.model.layers:
            x = layer(x, batch)
        return self.model.norm(x)
