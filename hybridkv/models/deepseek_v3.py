"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention in every layer, MoE MLPs.

    x = embed(ids)
    per layer:  x += mla(input_layernorm(x))              (layers/attention/mla.py)
                x += mlp(post_attention_layernorm(x))     dense in the first
                                                          `first_k_dense_replace` layers, then MoE
    logits = lm_head(norm(x))

- MLA: optional q LoRA (`q_lora_rank` None: plain q_proj), latent `kv_lora_rank` + rotary key
  `qk_rope_head_dim` cached per token; interleaved RoPE (`rope_interleave`) over the rope part
  (rope dim = qk_rope_head_dim, YaRN with mscale / mscale_all_dim as transformers computes it);
  softmax scale 1/sqrt(nope + rope) times mscale(factor, mscale_all_dim)^2 under YaRN.
- MoE: sigmoid scores of a float32 router; choice scores = scores + e_score_correction_bias;
  the experts split into `n_group` groups, a group scored by the sum of its top-2 choice scores,
  the best `topk_group` groups kept, the top `num_experts_per_tok` experts among them chosen;
  weights = their (uncorrected) scores, normalised to sum 1 if `norm_topk_prob`, times
  `routed_scaling_factor`. Plus `n_shared_experts` always-on experts (one SwiGLU of
  moe_intermediate_size * n_shared_experts).
- Checkpoints: per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, ...) or stacked ones
  (`mlp.experts.gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]).
- Multi-token prediction (`num_mtp_layers`, alias num_nextn_predict_layers): checkpoint layers
  `model.layers.{num_hidden_layers + i}` are skipped unless speculative decoding asks for them
  (`build_mtp`); then each loads as transformers' MtpLayer reads it: enorm, hnorm, eh_proj, a
  decoder block (always MoE) and `shared_head.norm` (its post-norm); the embedding and lm_head
  are the target's (the layer's own `embed_tokens` / `shared_head.head` copies are skipped).
  One MTP step: out = shared_head.norm(block(eh_proj([enorm(embed(t_{p+1})) | hnorm(h_p)])))
  at RoPE position p + 1; draft logits = lm_head(out).
- Tensor parallel: MLA by heads (layers/attention/mla.py; the latent replicated), dense MLPs,
  experts and shared experts by intermediate size (router replicated; the experts' and shared
  experts' partial sums all-reduced once), vocabulary-parallel embeddings and lm_head.
Defaults: transformers 5.24 `DeepseekV3Config`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Self

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.attention.mla import CosSin, MultiHeadLatentAttention, mla_softmax_scale
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.moe import GatedExperts, Router, RoutingRule, SharedExpertsMoE
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig
from hybridkv.models.loader import stack_gated_experts
from hybridkv.ops.elementwise import concat, residual_add

EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
ROPE_TYPES = ("default", "yarn", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config(RopeConfig):
    """Defaults: transformers 5.24 `DeepseekV3Config`."""

    ARCHITECTURE: ClassVar[str] = "DeepseekV3ForCausalLM"
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "n_routed_experts": ("num_local_experts",),
        "num_mtp_layers": ("num_nextn_predict_layers",),
    }

    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    first_k_dense_replace: int = 3
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_interleave: bool = True
    attention_bias: bool = False
    num_mtp_layers: int = 1  # multi-token-prediction layers the checkpoint carries

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
            "num_hidden_layers", "num_attention_heads", "n_routed_experts", "kv_lora_rank",
            "v_head_dim", "n_group", "topk_group", "num_experts_per_tok",
        )  # fmt: skip
        if self.q_lora_rank is not None:
            self._require_positive("q_lora_rank")
        if self.num_mtp_layers < 0:
            self._fail(f"num_mtp_layers must be >= 0, got {self.num_mtp_layers}")
        if self.qk_rope_head_dim < 0 or self.qk_nope_head_dim < 0:
            self._fail("qk_rope_head_dim and qk_nope_head_dim must be >= 0")
        if self.qk_rope_head_dim % 2:
            self._fail(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.hidden_act != "silu":
            self._fail(f"hidden_act {self.hidden_act!r} is not supported; supported: silu")
        self._check_routing()
        rope_type = self.rope["rope_type"]
        if rope_type not in ROPE_TYPES:
            self._fail(f"unsupported rope type {rope_type!r}; supported: {', '.join(ROPE_TYPES)}")

    @classmethod
    def from_hf(cls, data: Mapping[str, Any]) -> Self:
        """As HFConfig reads it, but an explicit `q_lora_rank: null` means no q LoRA (a plain
        q_proj), not the default rank."""
        cfg = super().from_hf(data)
        if "q_lora_rank" in data and data["q_lora_rank"] is None:
            cfg = dataclasses.replace(cfg, q_lora_rank=None)
        return cfg

    def _fail(self, message: str) -> None:
        raise ConfigError(f"config.json of {self.ARCHITECTURE}: {message}")

    def _check_routing(self) -> None:
        e, groups = self.n_routed_experts, self.n_group
        if e % groups or e // groups < 2:
            self._fail(
                f"n_routed_experts ({e}) must be a multiple of n_group ({groups}) with at "
                "least 2 experts per group"
            )
        if self.topk_group > groups:
            self._fail(f"topk_group ({self.topk_group}) must be at most n_group ({groups})")
        if self.num_experts_per_tok > self.topk_group * (e // groups):
            self._fail(
                f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most the experts "
                f"of topk_group groups ({self.topk_group * (e // groups)})"
            )

    mlp_bias: ClassVar[bool] = False  # a DeepSeek-V2 key; V3 has none
    correction_bias: ClassVar[bool] = True  # the router's e_score_correction_bias buffer

    @property
    def routing(self) -> RoutingRule:
        """Sigmoid scores, choice biased by e_score_correction_bias, groups by their top-2."""
        return RoutingRule(
            self.num_experts_per_tok, "sigmoid", self.norm_topk_prob, renormalise_eps=1e-20,
            scaling=self.routed_scaling_factor, groups=self.n_group, groups_kept=self.topk_group,
            group_score="top2_sum", sorted=False,
        )  # fmt: skip

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return mla_softmax_scale(self.qk_head_dim, self.rope)


class DeepseekV3MoE(SharedExpertsMoE):
    """Router `gate` (weight [E, hidden], float32 logits; V3: e_score_correction_bias [E]),
    SwiGLU `experts`, `shared_experts` (one SwiGLU of moe_intermediate_size * n_shared_experts)."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        hidden, e, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        gate = Router(hidden, e, cfg.routing, correction_bias=cfg.correction_bias)
        shared = GatedMLP(hidden, inter * cfg.n_shared_experts, bias=cfg.mlp_bias)
        super().__init__(gate, GatedExperts(e, hidden, inter), shared)
        self.top_k_unset = cfg.num_experts_per_tok is None  # (DeepSeek-V2 may leave it out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        if self.top_k_unset:
            raise ConfigError(
                "config.json of DeepseekV2ForCausalLM: num_experts_per_tok is not set"
            )
        return super().forward(x)


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV3Config, index: int, moe: bool | None = None) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = MultiHeadLatentAttention(
            index, hidden, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim, cfg.v_head_dim, q_lora_rank=cfg.q_lora_rank,
            bias=cfg.attention_bias, scale=cfg.softmax_scale, rope_interleave=cfg.rope_interleave,
        )  # fmt: skip
        self.mlp: nn.Module
        if (index >= cfg.first_k_dense_replace) if moe is None else moe:
            self.mlp = DeepseekV3MoE(cfg)
        else:
            self.mlp = GatedMLP(hidden, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden] (pre-norm residual blocks)."""
        h = self.self_attn(self.input_layernorm(x), batch, rotary, cos_sin)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return residual_add(x, self.mlp(h))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class SharedHead(nn.Module):
    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekMTPLayer(DeepseekV3DecoderLayer):
    """One multi-token-prediction layer: a decoder block (MoE, as transformers' MTP config
    forces) plus enorm / hnorm / eh_proj in front and shared_head.norm behind."""

    def __init__(self, cfg: DeepseekV3Config, index: int) -> None:
        super().__init__(cfg, index, moe=True)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)  # replicated under TP
        self.shared_head = SharedHead(cfg)


class DeepseekMTP(nn.Module):
    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        n = cfg.num_hidden_layers
        self.layers = nn.ModuleList(
            DeepseekMTPLayer(cfg, n + i) for i in range(cfg.num_mtp_layers)
        )


MTP_SKIPPED = (".embed_tokens.", ".shared_head.head.")  # the target's are used


class DeepseekV3ForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = DeepseekV3Config

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config)
        self.model = DeepseekV3Model(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(
            config.qk_rope_head_dim, config.rope, max_positions=config.max_position_embeddings
        )

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(
            stack_gated_experts(weights, EXPERT_WEIGHT, self.config.n_routed_experts)
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """-> hidden: [num_tokens, hidden]."""
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # 2 x [T, rope_dim]
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)

    # -- multi-token prediction --------------------------------------------------------------

    def make_mtp(self) -> nn.Module:
        return DeepseekMTP(self.config)

    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        assert isinstance(self.mtp, DeepseekMTP)
        layer = self.mtp.layers[0]
        e = layer.enorm(self.model.embed_tokens(input_ids))  # [T, H]
        x = layer.eh_proj(concat(e, layer.hnorm(hidden)))  # [T, 2H] -> [T, H]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        x = DeepseekV3DecoderLayer.forward(layer, x, batch, self.rotary, cos_sin)
        return layer.shared_head.norm(x)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint layers past num_hidden_layers are the MTP layers: `mtp.layers.{i}` once
        built (their copies of the embedding and head skipped), else skipped."""
        if not name.startswith("model.layers."):
            return name
        index, _, rest = name[len("model.layers.") :].partition(".")
        first = self.config.num_hidden_layers
        if not index.isdigit() or int(index) < first:
            return name
        if self.mtp is None or any(s in f".{rest}" for s in MTP_SKIPPED):
            return None
        return f"mtp.layers.{int(index) - first}.{rest}"


# -- DeepSeek-V2 -------------------------------------------------------------------------------

TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclasses.dataclass(frozen=True)
class DeepseekV2Config(DeepseekV3Config):
    """DeepSeek-V2 (and V2-Lite): the same MLA (always interleaved RoPE) and layer shape; the
    router is a softmax over the experts, top-k of all of them (`topk_method` "greedy") or of the
    best `topk_group` groups by their best expert ("group_limited_greedy"), weights times
    `routed_scaling_factor`, never renormalised (transformers ignores norm_topk_prob here).
    Defaults: transformers 5.24 `DeepseekV2Config` (num_experts_per_tok has none: a checkpoint
    must give it to run)."""

    ARCHITECTURE: ClassVar[str] = "DeepseekV2ForCausalLM"
    # transformers' DeepseekV2Config attribute_map (V3's num_local_experts is not one of V2's)
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "n_routed_experts": ("num_experts",),
        "num_mtp_layers": ("num_nextn_predict_layers",),
    }

    vocab_size: int = 102400
    hidden_size: int = 4096
    intermediate_size: int = 11008
    moe_intermediate_size: int = 1407
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    n_shared_experts: int = 2
    n_routed_experts: int = 64
    routed_scaling_factor: float = 1.0
    n_group: int | None = None  # type: ignore[assignment]
    topk_group: int | None = None  # type: ignore[assignment]
    topk_method: str = "greedy"
    num_experts_per_tok: int | None = None  # type: ignore[assignment]
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = False
    max_position_embeddings: int = 2048
    mlp_bias: bool = False  # type: ignore[misc]
    num_mtp_layers: int = 0  # (DeepSeek-V2 checkpoints carry none)

    def _check_routing(self) -> None:
        if self.topk_method not in TOPK_METHODS:
            self._fail(f"topk_method {self.topk_method!r}; supported: {', '.join(TOPK_METHODS)}")
        e, k = self.n_routed_experts, self.num_experts_per_tok
        if k is not None and not 0 < k <= e:
            self._fail(f"num_experts_per_tok ({k}) must be in 1..n_routed_experts ({e})")
        if self.topk_method == "greedy":
            return
        groups, keep = self.n_group, self.topk_group
        if groups is None or keep is None or e % groups or not 0 < keep <= groups:
            self._fail(
                f"group_limited_greedy needs n_group dividing n_routed_experts ({e}) and "
                f"topk_group in 1..n_group, got n_group={groups}, topk_group={keep}"
            )
        if k is not None and k > keep * (e // groups):
            self._fail(f"num_experts_per_tok ({k}) exceeds the experts of topk_group groups")

    def _require_positive(self, *names: str) -> None:
        optional = ("n_group", "topk_group", "num_experts_per_tok")
        super()._require_positive(*(n for n in names if n not in optional))

    correction_bias: ClassVar[bool] = False  # (V3's e_score_correction_bias)

    @property
    def routing(self) -> RoutingRule:
        """Softmax over every expert; "group_limited_greedy": only the best topk_group groups
        by their best expert (the others' scores 0); never renormalised."""
        limited = self.topk_method == "group_limited_greedy"
        groups, kept = (self.n_group, self.topk_group) if limited else (1, 1)
        assert groups is not None and kept is not None
        return RoutingRule(
            self.num_experts_per_tok or 0, "softmax", scaling=self.routed_scaling_factor,
            groups=groups, groups_kept=kept, group_score="max", sorted=False,
        )  # fmt: skip


class DeepseekV2ForCausalLM(DeepseekV3ForCausalLM):
    config_class = DeepseekV2Config
