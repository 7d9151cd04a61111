"""TII Falcon-H1 (FalconH1ForCausalLM): attention and a Mamba2 mixer side by side in every
decoder layer, on the same normed input, their outputs summed; muP multipliers throughout.

    x = embed(ids) * embedding_multiplier
    per layer:  h = input_layernorm(x)
                x += mamba(h) * ssm_out_multiplier
                   + attention(h * attention_in_multiplier) * attention_out_multiplier
                x += feed_forward(pre_ff_layernorm(x))
    mamba(h):   Mamba2 on h * ssm_in_multiplier, in_proj's output scaled per slice by
                ssm_multipliers (z, x, B, C, dt)
    feed_forward(h) = down(up(h) * silu(gate(h) * mlp_multipliers[0])) * mlp_multipliers[1]
    logits = lm_head(final_layernorm(x)) * lm_head_multiplier

- Attention: keys scaled by `key_multiplier` (before RoPE, as transformers does), scores by
  1/sqrt(head_dim); head_dim = `head_dim` when the config has it (the released checkpoints do:
  Falcon-H1-0.5B has 8 heads of 64 at hidden 1024), else hidden_size / num_attention_heads.
  q/k/v/o biases = `attention_bias`.
- Mamba2 mixer (`hybridkv.layers.mamba2.Mamba2Mixer`): intermediate = `mamba_d_ssm` (null:
  mamba_expand * hidden_size); in_proj bias = `mamba_proj_bias`, out_proj bias =
  `projectors_bias`; `mamba_rms_norm` on: grouped gated RMSNorm with the weight applied in float32,
  normalising before the gate when `mamba_norm_before_gate` (the default); off: y * silu(gate).
- Norms are plain RMSNorms (x_hat cast back, then times the weight).

Every decoder layer owns two cache layers: `model.layers.i.self_attn.attn` (attention) and
`model.layers.i.mamba` (a Mamba2 state), both with layer index i. The checkpoint's tensor names
are the modules' names; the muP vector is not a weight (transformers keeps it as a non-persistent
buffer): it is built from `ssm_multipliers`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.attention.self_attention import CosSin, SelfAttention
from hybridkv.layers.mamba2 import Mamba2Mixer
from hybridkv.layers.mlp import GatedMLP, RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig, config_float

MUP_PARTS = ("z", "x", "B", "C", "dt")  # the slices of in_proj's output ssm_multipliers scale


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class FalconH1Config(RopeConfig):
    """Defaults: transformers 5.24 `FalconH1Config` (the None ones derived as it does)."""

    ARCHITECTURE = "FalconH1ForCausalLM"

    vocab_size: int = 128000
    tie_word_embeddings: bool = False
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = 8  # null: num_attention_heads
    head_dim: int | None = None  # not a FalconH1Config field; the checkpoints carry it
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    attention_bias: bool = False
    mlp_bias: bool = False
    mamba_d_ssm: int | None = 1024  # null: mamba_expand * hidden_size
    mamba_n_heads: int = 128
    mamba_d_head: int | str = "auto"  # "auto": intermediate // mamba_n_heads
    mamba_n_groups: int = 1
    mamba_d_state: int = 256
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_chunk_size: int = 256
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_norm_before_gate: bool = True
    mamba_rms_norm: bool = False
    time_step_limit: tuple | None = (0.0, math.inf)
    projectors_bias: bool = False
    lm_head_multiplier: float = 1.0
    embedding_multiplier: float = 1.0
    mlp_multipliers: tuple | None = None  # None: (1.0, 1.0) = (gate, down)
    key_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    ssm_multipliers: tuple | None = None  # None: five 1.0 = (z, x, B, C, dt)
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0

    @classmethod
    def from_hf(cls, data: Mapping[str, Any]) -> Self:
        """An explicit null differs from a missing key for two fields: transformers derives
        mamba_d_ssm = mamba_expand * hidden_size and num_key_value_heads = num_attention_heads
        from a null, where a missing key takes the default (1024, 8)."""
        data = dict(data)
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}

        def value(key: str) -> Any:
            return defaults[key] if data.get(key) is None else data[key]

        if "mamba_d_ssm" in data and data["mamba_d_ssm"] is None:
            expand, hidden = value("mamba_expand"), value("hidden_size")
            if _is_int(expand) and _is_int(hidden):  # else the key's own check reports it
                data["mamba_d_ssm"] = expand * hidden
        if "num_key_value_heads" in data and data["num_key_value_heads"] is None:
            data["num_key_value_heads"] = value("num_attention_heads")
        return super().from_hf(data)

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "mamba_n_heads", "mamba_n_groups", "mamba_d_state",
            "mamba_d_conv", "mamba_expand", "mamba_chunk_size",
        )  # fmt: skip
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only silu)")
        heads = self.num_attention_heads
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", heads)
        if self.head_dim is None:
            self._set("head_dim", self.hidden_size // heads)
        if self.mamba_d_ssm is None:
            self._set("mamba_d_ssm", self.mamba_expand * self.hidden_size)
        self._require_positive("num_key_value_heads", "head_dim", "mamba_d_ssm")
        if heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})"
            )
        self._check_mamba()
        self._set("mlp_multipliers", self._multipliers("mlp_multipliers", 2))
        self._set("ssm_multipliers", self._multipliers("ssm_multipliers", len(MUP_PARTS)))

    def _check_mamba(self) -> None:
        inner, n_heads = self.mamba_d_ssm, self.mamba_n_heads
        if inner % n_heads:
            raise ValueError(
                f"mamba_n_heads ({n_heads}) must divide the Mamba2 intermediate size "
                f"mamba_d_ssm ({inner})"
            )
        if self.mamba_d_head == "auto":
            self._set("mamba_d_head", inner // n_heads)
        self._require_positive("mamba_d_head")
        if self.mamba_d_head * n_heads != inner:
            raise ValueError(
                f"mamba_d_head ({self.mamba_d_head}) x mamba_n_heads ({n_heads}) must equal "
                f"mamba_d_ssm ({inner})"
            )
        if n_heads % self.mamba_n_groups:
            raise ValueError(
                f"mamba_n_heads ({n_heads}) must be a multiple of mamba_n_groups "
                f"({self.mamba_n_groups})"
            )

    def _multipliers(self, key: str, count: int) -> tuple[float, ...]:
        values = getattr(self, key)
        if values is None:
            return (1.0,) * count
        if not isinstance(values, tuple) or len(values) != count:
            raise ValueError(f"{key} must be a list of {count} numbers, got {values!r}")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
            raise ValueError(f"{key} must be a list of {count} numbers, got {values!r}")
        return tuple(float(v) for v in values)

    @property
    def dt_limit(self) -> tuple[float, float]:
        low, high = self.time_step_limit or (0.0, math.inf)
        return config_float(low), config_float(high)

    def mamba2(self, index: int) -> Mamba2Mixer:
        mup = self.ssm_multipliers
        assert mup is not None
        return Mamba2Mixer(
            self.hidden_size, self.mamba_n_heads, int(self.mamba_d_head), self.mamba_d_state,
            self.mamba_n_groups, self.mamba_d_conv, self.mamba_chunk_size, self.mamba_conv_bias,
            self.mamba_proj_bias, self.rms_norm_eps, self.dt_limit, "silu",
            layer_index=index,
            out_proj_bias=self.projectors_bias,
            gated_norm=self.mamba_rms_norm,
            norm_before_gate=self.mamba_norm_before_gate,
            norm_weight_in_fp32=True,
            in_multiplier=float(self.ssm_in_multiplier),
            proj_multipliers=None if all(m == 1.0 for m in mup) else mup,
        )  # fmt: skip


class FalconH1Attention(SelfAttention):
    """Self-attention whose keys are scaled by `key_multiplier` before RoPE."""

    def __init__(self, cfg: FalconH1Config, index: int) -> None:
        assert cfg.num_key_value_heads is not None and cfg.head_dim is not None
        super().__init__(
            index, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, bias=cfg.attention_bias,
        )  # fmt: skip
        self.key_multiplier = float(cfg.key_multiplier)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None = None,
        cos_sin: CosSin | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        t = x.shape[0]
        # q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]
        q = self.q_proj(x).view(t, self.heads, self.head_dim)
        k = self.k_proj(x).view(t, self.kv_heads, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if rotary is not None and cos_sin is not None:
            q, k = rotary(q, k, *cos_sin)
        out = self.o_proj(self.attn(q, k, v, batch))  # attn: [T, heads * head_dim]
        return self.tp.all_reduce(out)  # tensor parallel: o_proj is row-parallel


class FalconH1MLP(GatedMLP):
    """SwiGLU with muP multipliers on the gate projection's output and on the output."""

    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        assert cfg.mlp_multipliers is not None
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        gate = self.gate_proj(x)  # [T, intermediate]
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        out = self.tp.all_reduce(self.down_proj(self.up_proj(x) * F.silu(gate)))
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: FalconH1Config, index: int) -> None:
        super().__init__()
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(hidden, eps)
        self.mamba = cfg.mamba2(index)
        self.self_attn = FalconH1Attention(cfg, index)
        self.pre_ff_layernorm = RMSNorm(hidden, eps)
        self.feed_forward = FalconH1MLP(cfg)
        self.ssm_out_multiplier = float(cfg.ssm_out_multiplier)
        self.attention_in_multiplier = float(cfg.attention_in_multiplier)
        self.attention_out_multiplier = float(cfg.attention_out_multiplier)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rotary: RotaryEmbedding, cos_sin: CosSin
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        h = self.input_layernorm(x)
        mixed = self.mamba(h, batch)  # [T, hidden]
        if self.ssm_out_multiplier != 1.0:
            mixed = mixed * self.ssm_out_multiplier
        attn_in = h if self.attention_in_multiplier == 1.0 else h * self.attention_in_multiplier
        attended = self.self_attn(attn_in, batch, rotary, cos_sin)  # [T, hidden]
        if self.attention_out_multiplier != 1.0:
            attended = attended * self.attention_out_multiplier
        x, h = self.pre_ff_layernorm.add_forward(x, mixed + attended)
        return x + self.feed_forward(h)


class FalconH1Model(nn.Module):
    def __init__(self, cfg: FalconH1Config) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            FalconH1DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers)
        )
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class FalconH1ForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = FalconH1Config

    def __init__(self, config: FalconH1Config) -> None:
        super().__init__(config)
        assert config.head_dim is not None
        self.model = FalconH1Model(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope)
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.lm_head_multiplier = float(config.lm_head_multiplier)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        if self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        cos_sin = self.rotary.cos_sin(batch.positions, x.dtype)  # in the model dtype, as HF
        for layer in self.model.layers:
            x = layer(x, batch, self.rotary, cos_sin)
        return self.model.final_layernorm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits: [n, vocab] float32 (scaled in the model dtype)."""
        logits = self.lm_head(hidden)
        if self.lm_head_multiplier != 1.0:
            logits = logits * self.lm_head_multiplier
        return logits.float()
