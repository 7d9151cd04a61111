"""Qwen3-Next (Qwen3NextForCausalLM) and Qwen3.5 (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM and
the text part of their ForConditionalGeneration checkpoints): gated delta net layers with a
gated attention layer every `full_attention_interval` layers.

    x = embed(ids)
    per layer:  x += mixer(norm(x))          mixer: gated delta net | gated attention
                x += ffn(norm(x))            ffn: SwiGLU MLP | MoE with a gated shared expert
    logits = lm_head(norm(x))

- Norms are zero-centred RMSNorms: x_hat * (1 + weight).
- Gated attention: q_proj yields, per head, [query | gate]; per-head q/k norms (zero-centred);
  RoPE on the first `partial_rotary_factor` of each head (0.25 by default); the attention output
  is multiplied by sigmoid(gate) before o_proj. Qwen3.5's multimodal RoPE sections all read the
  same position for text, so for text prompts it is this RoPE.
- MoE: softmax router, top-k experts (weights renormalised to sum 1 unless Qwen3-Next's
  `norm_topk_prob` is false), SwiGLU experts, plus a shared expert scaled by
  sigmoid(shared_expert_gate(x)). Qwen3-Next puts it on layers where `(i + 1) %
  decoder_sparse_step == 0` and `i not in mlp_only_layers` (else a dense MLP); Qwen3.5-MoE on
  every layer; Qwen3.5 (dense) nowhere.
- Gated delta net: `hybridkv.layers.gated_delta_net` (Qwen3-Next's fused, key-head-grouped
  projections; Qwen3.5's separate ones).

Checkpoints hold one tensor per expert (`mlp.experts.{e}.gate_proj.weight`, ...), stacked here
into `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I] (transformers' own
names, which load as they are). A ForConditionalGeneration checkpoint keeps the text model
under `model.language_model.`; its `model.visual.` tensors are skipped, as are the
multi-token-prediction tensors (`mtp.`) every real checkpoint carries, with one log line, unless
speculative decoding asks for them (method "mtp", `build_mtp`): then `mtp.fc`,
`mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0` (a gated-attention decoder
layer; its feed-forward block as layer 0's) and `mtp.norm` load, and one MTP step is

    x = fc([norm_e(embed(t_{p+1})) | norm_h(h_p)])      h_p: the target's final (normed) hidden
    x = mtp.layers.0(x) at RoPE position p + 1           its attention: a cache layer of its own
    out = mtp.norm(x);  draft logits = lm_head(out)     (vLLM's Qwen3NextMTP; `out` feeds the
                                                         next autoregressive step)
"""

from __future__ import annotations

import dataclasses
import logging
import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import current, declare_shards, explicit, rank0_bias
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.activation import sigmoid_gate
from hybridkv.layers.attention.layer import PagedAttention
from hybridkv.layers.attention.self_attention import CosSin
from hybridkv.layers.gated_delta_net import GatedDeltaNet
from hybridkv.layers.mlp import GatedMLP, ZeroCenteredRMSNorm
from hybridkv.layers.moe import GatedExperts, RoutingRule, gated_shared_expert_native, route
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig, layer_types
from hybridkv.ops.elementwise import concat, residual_add

logger = logging.getLogger("hybridkv")
# transformers' default partial rotary factor for these families ("assign default for BC")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


@dataclasses.dataclass(frozen=True)
class Qwen3NextConfig(RopeConfig):
    """Defaults: transformers 5.24 `Qwen3NextConfig`."""

    ARCHITECTURE = "Qwen3NextForCausalLM"

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 5632
    num_hidden_layers: int = 48
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    head_dim: int = 256
    hidden_act: str = "silu"
    max_position_embeddings: int = 32768
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    partial_rotary_factor: float | None = None  # older spelling; transformers 5 keeps it in rope
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple | None = None  # None: attention every full_attention_interval layers
    full_attention_interval: int = 4
    # MoE (num_experts 0: dense MLPs everywhere)
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple | None = None
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    num_experts_per_tok: int = 10
    num_experts: int = 512
    norm_topk_prob: bool = True
    # multi-token prediction layers of the checkpoint (Qwen3.5 writes the count; Qwen3-Next's
    # config.json does not and its checkpoints carry one, vLLM's default)
    mtp_num_hidden_layers: int = 1

    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "mtp_num_hidden_layers": ("num_nextn_predict_layers",)
    }
    GDN_LAYOUT = "qwen3_next"

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "linear_key_head_dim", "linear_value_head_dim",
            "linear_num_key_heads", "linear_num_value_heads", "full_attention_interval",
        )  # fmt: skip
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only silu)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})"
            )
        if self.mtp_num_hidden_layers < 0:
            n = self.mtp_num_hidden_layers
            raise ValueError(f"mtp_num_hidden_layers must be >= 0, got {n}")
        n, every = self.num_hidden_layers, self.full_attention_interval
        if self.layer_types is None:
            kinds = tuple("attention" if (i + 1) % every == 0 else "mamba" for i in range(n))
        else:
            allowed = ("mamba", "attention")
            kinds = layer_types(self.layer_types, "layer_types", allowed, self.ARCHITECTURE)
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries but num_hidden_layers is {n}")
        self._set("layer_types", kinds)
        self._set("mlp_only_layers", tuple(self.mlp_only_layers or ()))
        self.rope  # one-line errors for an unsupported rope type, at load time  # noqa: B018

    @property
    def num_mtp_layers(self) -> int:
        return self.mtp_num_hidden_layers

    @property
    def mixers(self) -> tuple[str, ...]:
        """'gdn' or 'attention' per layer."""
        assert self.layer_types is not None
        return tuple("gdn" if k == "mamba" else "attention" for k in self.layer_types)

    def ffn(self, index: int) -> str:
        """'moe' or 'mlp' for the feed-forward block of a layer."""
        sparse = self.num_experts > 0 and (index + 1) % max(1, self.decoder_sparse_step) == 0
        return "moe" if sparse and index not in (self.mlp_only_layers or ()) else "mlp"

    @property
    def normalize_topk(self) -> bool:
        return self.norm_topk_prob

    @property
    def rotary_factor(self) -> float:
        for value in ((self.rope_parameters or {}).get("partial_rotary_factor"),
                      self.partial_rotary_factor):  # fmt: skip
            if value:
                return float(value)
        return DEFAULT_PARTIAL_ROTARY_FACTOR

    def gdn(self, index: int) -> GatedDeltaNet:
        return GatedDeltaNet(
            self.hidden_size, self.linear_num_key_heads, self.linear_num_value_heads,
            self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel_dim,
            self.rms_norm_eps, self.GDN_LAYOUT, layer_index=index,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Qwen3_5TextConfig(Qwen3NextConfig):
    """Defaults: transformers 5.24 `Qwen3_5TextConfig` (dense MLPs, no MoE)."""

    ARCHITECTURE = "Qwen3_5ForCausalLM"
    GDN_LAYOUT = "qwen3_5"

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    num_experts: int = 0


@dataclasses.dataclass(frozen=True)
class Qwen3_5MoeTextConfig(Qwen3NextConfig):
    """Defaults: transformers 5.24 `Qwen3_5MoeTextConfig` (MoE on every layer, top-k weights
    always renormalised)."""

    ARCHITECTURE = "Qwen3_5MoeForCausalLM"
    GDN_LAYOUT = "qwen3_5"

    vocab_size: int = 248320
    hidden_size: int = 2048
    num_hidden_layers: int = 40
    num_attention_heads: int = 16
    num_key_value_heads: int = 2
    num_experts_per_tok: int = 8
    num_experts: int = 256

    def ffn(self, index: int) -> str:
        return "moe"

    @property
    def normalize_topk(self) -> bool:
        return True


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------


class GatedAttention(nn.Module):
    """Attention whose output is gated per channel by sigmoid(gate), the gate coming from the
    second half of each head's q_proj output; zero-centred q/k norms; partial RoPE."""

    def __init__(self, cfg: Qwen3NextConfig, index: int) -> None:
        super().__init__()
        hidden, hd = cfg.hidden_size, cfg.head_dim
        # tensor parallel: this rank's heads; KV heads split, or one replicated per rank
        self.tp = tp = current()
        self.heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
        self.kv_heads, first_kv = tp.replicated(cfg.num_key_value_heads, "num_key_value_heads")
        self.head_dim = hd
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * hd * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.heads * hd, hidden, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(hd, cfg.rms_norm_eps)
        self.attn = PagedAttention(index, self.heads, self.kv_heads, hd, hd**-0.5)
        self.attn.sharded = True  # its heads are this rank's
        q_rows = explicit(tp, (tp.rank * self.heads * 2 * hd, self.heads * 2 * hd))
        kv_rows = explicit(tp, (first_kv * hd, self.kv_heads * hd))
        for proj, spec in ((self.q_proj, q_rows), (self.k_proj, kv_rows), (self.v_proj, kv_rows)):
            declare_shards(proj, weight=spec, bias=spec if bias else None)
        o_cols = explicit(tp, (tp.rank * self.heads * hd, self.heads * hd), dim=1)
        declare_shards(self.o_proj, weight=o_cols)
        declare_shards(self.o_proj, bias=rank0_bias(tp) if bias else None)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        t = x.shape[0]
        # per head [query | gate]: [T, heads, 2 * head_dim]
        q, gate = self.q_proj(x).view(t, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).view(t, self.kv_heads, self.head_dim))
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        q, k = rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, batch)  # [T, heads * head_dim]
        return self.tp.all_reduce(self.o_proj(sigmoid_gate(out, gate)))  # gate read in place


class SparseMoe(nn.Module):
    """Softmax top-k router `gate` (renormalised as `normalize_topk` says), GatedExperts
    `experts`, and a `shared_expert` scaled by sigmoid(shared_expert_gate(x))."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.rule = RoutingRule(cfg.num_experts_per_tok, "softmax", cfg.normalize_topk)
        self.gate = nn.Linear(hidden, cfg.num_experts, bias=False)
        self.experts = GatedExperts(cfg.num_experts, hidden, cfg.moe_intermediate_size)
        self.shared_expert = GatedMLP(hidden, cfg.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)
        self.tp = current()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        fused = gated_shared_expert_native(
            x, self.gate, self.rule, self.experts, self.shared_expert, self.shared_expert_gate
        )
        if fused is not None:
            return self.tp.all_reduce(fused)
        routed = self.experts(x, route(x, self.gate, self.rule))  # this rank's partial sums
        # the gate is replicated, so it scales the shared expert's partial sum before the one
        # all-reduce of both: sigmoid(gate [T, 1]) * shared [T, hidden], the gate broadcast as
        # [T, hidden heads of 1] (stride 0), one native call each for the gate and the sum (a
        # decode step stays capturable)
        t = x.shape[0]
        shared = self.shared_expert(x, reduce=False)
        gate = self.shared_expert_gate(x).view(t, 1, 1).expand(t, shared.shape[1], 1)
        return self.tp.all_reduce(residual_add(routed, sigmoid_gate(shared, gate)))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig, index: int, ffn_index: int | None = None) -> None:
        """`index`: the cache layer index (an MTP layer: num_hidden_layers + i, always gated
        attention); `ffn_index`: the layer whose feed-forward kind it takes (default: index)."""
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        if index < cfg.num_hidden_layers and cfg.mixers[index] == "gdn":
            self.linear_attn = cfg.gdn(index)
        else:
            self.self_attn = GatedAttention(cfg, index)
        if cfg.ffn(index if ffn_index is None else ffn_index) == "moe":
            self.mlp: nn.Module = SparseMoe(cfg)
        else:
            self.mlp = GatedMLP(hidden, cfg.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(hidden, eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(hidden, eps)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        h = self.input_layernorm(x)  # [T, hidden]
        if hasattr(self, "linear_attn"):
            h = self.linear_attn(h, batch)
        else:
            h = self.self_attn(h, batch, rotary, cos_sin)
        x, h = self.post_attention_layernorm.add_forward(x, h)
        return residual_add(x, self.mlp(h))


class Qwen3NextModel(nn.Module):
    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = ZeroCenteredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3NextMTP(nn.Module):
    """The multi-token-prediction layers (checkpoint prefix `mtp.`); the embedding and lm_head
    are the target's. Replicated projections under tensor parallelism (fc is [H, 2H])."""

    def __init__(self, cfg: Qwen3NextConfig) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(hidden, eps)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(cfg, cfg.num_hidden_layers + i, ffn_index=i)
            for i in range(cfg.num_mtp_layers)
        )
        self.norm = ZeroCenteredRMSNorm(hidden, eps)


class Qwen3NextForCausalLM(CausalLM):
    tensor_parallel = True

    config_class: type[Qwen3NextConfig] = Qwen3NextConfig

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__(config)
        self.model = Qwen3NextModel(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.rotary_factor)
        self._skipped: dict[str, int] = {}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.norm(x)

    # -- multi-token prediction --------------------------------------------------------------

    def make_mtp(self) -> nn.Module:
        return Qwen3NextMTP(self.config)

    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        mtp = self.mtp
        assert isinstance(mtp, Qwen3NextMTP)
        e = mtp.pre_fc_norm_embedding(self.model.embed_tokens(input_ids))  # [T, H]
        # (a native concatenation: an MTP pass is capturable, hybridkv.worker.graphs)
        x = mtp.fc(concat(e, mtp.pre_fc_norm_hidden(hidden)))  # [T, 2H] -> [T, H]
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)
        x = mtp.layers[0](x, batch, self.rotary, cos_sin)
        return mtp.norm(x)

    # -- weights -----------------------------------------------------------------------------

    SKIPPED_PREFIXES = ("mtp.",)  # multi-token prediction: loaded only after build_mtp

    def map_weight_name(self, name: str) -> str | None:
        for prefix in self.SKIPPED_PREFIXES:
            if prefix == "mtp." and self.mtp is not None:
                continue
            if name.startswith(prefix):
                self._skipped[prefix] = self._skipped.get(prefix, 0) + 1
                return None
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._skipped = {}
        super().load_weights(self._stack_experts(weights))
        for prefix, count in self._skipped.items():
            logger.info("skipped %d checkpoint tensors under %r (not used here)", count, prefix)

    def _stack_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert checkpoint tensors -> `experts.gate_up_proj` / `experts.down_proj`, each
        yielded once every expert of its layer arrived; every other tensor passes through."""
        pending: dict[str, dict[tuple[int, str], torch.Tensor]] = {}
        for ckpt_name, tensor in weights:
            name = self.map_weight_name(ckpt_name)
            match = EXPERT_WEIGHT.match(name or "")
            if match is None:
                if name is not None:
                    yield name, tensor
                continue
            prefix, expert, proj = match.groups()
            parts = pending.setdefault(prefix, {})
            parts[(int(expert), proj)] = tensor
            experts = self._num_experts(prefix)
            if len(parts) == 3 * experts:
                del pending[prefix]
                yield from _stacked(prefix, parts, experts)
        if pending:
            got = {prefix: len(parts) for prefix, parts in pending.items()}
            raise ValueError(f"checkpoint lacks some experts' tensors: {got}")

    def _num_experts(self, prefix: str) -> int:
        module = self.get_submodule(prefix)
        assert isinstance(module, GatedExperts)
        return module.num_experts


def _stacked(
    prefix: str, parts: dict[tuple[int, str], torch.Tensor], experts: int
) -> Iterator[tuple[str, torch.Tensor]]:
    gate_up = [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]]) for e in range(experts)]
    yield f"{prefix}.gate_up_proj", torch.stack(gate_up)
    yield f"{prefix}.down_proj", torch.stack([parts[(e, "down_proj")] for e in range(experts)])


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    config_class = Qwen3_5TextConfig


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    config_class = Qwen3_5MoeTextConfig


class _TextOfConditionalGeneration:
    """The text model of a ForConditionalGeneration checkpoint: `model.language_model.` is the
    text model, `model.visual.` (the vision tower) is skipped; prompts are text only."""

    SKIPPED_PREFIXES = ("mtp.", "model.visual.")

    def map_weight_name(self, name: str) -> str | None:
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model.") :]
        return super().map_weight_name(name)  # type: ignore[misc]


class Qwen3_5ForConditionalGeneration(_TextOfConditionalGeneration, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(_TextOfConditionalGeneration, Qwen3_5MoeForCausalLM):
    pass
