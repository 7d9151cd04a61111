"""Zyphra Zamba2 (Zamba2ForCausalLM): a Mamba2 backbone with a few transformer blocks whose
weights are shared between the layers that call them.

    x = e = embed(ids)                                  e: the embeddings, kept for every call
    Mamba2 layer i:   x = x + mamba(norm(x))
    hybrid layer i (its h-th shared-block call, h = 0, 1, ...; block b = h % num_mem_blocks):
                      t = shared_block[b](x, e, h)      [T, hidden]
                      t = linear_i(t)                   one per layer, not shared
                      x = x + mamba(norm(x + t))        the residual is x, not x + t
    shared_block[b](x, e, h):
                      u = input_layernorm(concat(x, e)) [T, 2 * hidden]
                      a = attention(u, h)               [T, hidden]   (no residual)
                      out = mlp(pre_ff_layernorm(a), h) [T, hidden]   (no residual)
    logits = lm_head(final_layernorm(x))                lm_head tied to embed by default

- Attention sees 2 * hidden channels: head_dim = config.json's attention_head_dim (alias
  head_dim), by default 2 * hidden // num_attention_heads; scores scaled by
  (head_dim / 2) ** -0.5, no biases; RoPE over the whole head when `use_mem_rope`.
- Adapters (LoRA-like, two bias-free linears through `adapter_rank`) belong to one call h:
  q/k/v adapters when `use_shared_attention_adapter` (each adds a [2 * hidden] term, so it needs
  heads * head_dim == kv_heads * head_dim == 2 * hidden), and a gate_up adapter on the MLP
  unless `use_shared_mlp_adapter` is false (a key of Zyphra's configs; transformers 5.24 always
  builds it). They live in the shared block's `*_adapter_list.{h}`, whose other slots are
  empty (`nn.Identity`), as in the checkpoints.
- MLP: down(act(gate) * up) with one fused gate_up_proj ([gate | up]), act = `hidden_act`
  (default "gelu", the exact erf form); biases `add_bias_linear`.
- Mamba2 (`hybridkv.layers.mamba2`): conv bias always on, in/out projection bias
  `add_bias_linear`, gated-norm eps fixed at 1e-5, dt_limit = (time_step_min, inf).
- Norms: RMSNorm, weight applied after the cast back (eps `rms_norm_eps`).

The cache of the shared blocks. Weights are shared, KV is not: each call h attends over its own
keys and values. So each hybrid layer owns one weightless `PagedAttention` (`layers.{i}.attn`,
a `CacheOwner` declaring kv_heads x head_dim per token) and hands it to the shared block, whose
attention projects q/k/v with the shared weights and the call's adapters, then attends through
that handle. The shared block itself owns no cache: it is registered as `shared_transformer`
in every hybrid layer that calls it (one module object), and PyTorch lists a module reached by
several paths once, under the first, so its weights get exactly the names the checkpoints give
them (`layers.{first hybrid layer of block b}.shared_transformer.*`) and it is loaded once.
Checkpoints that repeat the shared weights under every calling layer (transformers' in-memory
state dict) load too: the copies, identical, are not read.

Untied word embeddings: transformers 5.24 ties the shared blocks through the same mechanism as
the embeddings (`_tied_weights_keys`), so with `tie_word_embeddings` false it gives every hybrid
layer a block of its own (still with the adapter slots of block h % num_mem_blocks), and a
checkpoint it saves holds every copy. Such a model is built the same way here; a copy the
checkpoint leaves out is taken from the block's first layer (the checkpoint shares it), where
transformers would leave it randomly initialised.

Tensor parallel: the Mamba2 mixers shard themselves (`hybridkv.layers.mamba2`); the shared
attention splits its heads (KV heads split, or one replicated per rank) and each call's cache
holds this rank's heads; o_proj and the MLP's down_proj are row-parallel, each all-reduced; the
MLP splits its intermediate size ([gate | up] each by rows). An adapter's first matrix
(`.0.weight`, [rank, in]) is replicated, its second (`.1.weight`, [out, rank]) sliced like the
rows of the weight it adapts. The per-layer `linear` acts on the all-reduced block output and
is replicated; embeddings and lm_head are split by vocabulary.

Config: transformers 5.24 `Zamba2Config`: attention_head_dim (or `head_dim`) is read from
config.json when present, else derived; mamba_headdim is derived from n_mamba_heads. Zyphra's first
configs use other keys (`state_size`, `conv_dimension`, `expansion_factor`,
`use_shared_attention_lora`, layer types "m" / "g", `mamba_headdim` without `n_mamba_heads`);
transformers 5.24 ignores them, reading those checkpoints with its defaults, which do not fit
their weights. They are read here as what they mean (so Zamba2-1.2B's config plans as before).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.distributed.parallel import (
    ShardSpec,
    column,
    current,
    declare_shards,
    explicit,
    rank0_bias,
)
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.attention.layer import PagedAttention
from hybridkv.layers.attention.self_attention import CosSin
from hybridkv.layers.mamba2 import Mamba2Mixer
from hybridkv.layers.mlp import RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding
from hybridkv.models.base import CausalLM
from hybridkv.models.hf_config import RopeConfig

MAMBA_NORM_EPS = 1e-5  # transformers' Zamba2MambaMixer.norm, fixed
LONG_CONTEXT_POSITIONS = 16384  # transformers: max_position_embeddings when use_long_context

# Layer-type spellings of `layers_block_type`: transformers 5 writes linear_attention / hybrid,
# older transformers mamba / hybrid, Zyphra's first configs m / g.
LAYER_ROLES = {"mamba": "mamba", "mamba2": "mamba", "linear_attention": "mamba", "m": "mamba",
               "hybrid": "hybrid", "g": "hybrid"}  # fmt: skip

# transformers' ACT2FN names this model computes, and how.
ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}

SHARED_WEIGHT = re.compile(r"^model\.layers\.(\d+)(\.shared_transformer\..*)$")


def default_layout() -> tuple[str, ...]:
    """transformers' Zamba2Config layout when config.json has none (Zamba2-2.7B's: 54 layers,
    hybrid at 6, 12, ..., 42, 47, 51), whatever num_hidden_layers says."""
    m, g = "mamba", "hybrid"
    return (m,) + (m, m, m, m, m, g) * 7 + (m, m, m, m, g) + (m, m, m, g) + (m, m)


@dataclasses.dataclass(frozen=True)
class Zamba2Config(RopeConfig):
    """Defaults: transformers 5.24 `Zamba2Config` (the None ones derived as it does)."""

    ARCHITECTURE = "Zamba2ForCausalLM"
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {
        "layers_block_type": ("layer_types",),  # transformers' attribute_map
        "mamba_d_state": ("state_size",),  # Zyphra's first configs (transformers ignores them)
        "mamba_d_conv": ("conv_dimension",),
        "mamba_expand": ("expansion_factor",),
        "use_shared_attention_adapter": ("use_shared_attention_lora",),
        "attention_head_dim": ("head_dim",),  # transformers' attribute_map
    }

    vocab_size: int = 32000
    max_position_embeddings: int = 4096  # LONG_CONTEXT_POSITIONS when use_long_context
    hidden_size: int = 2560
    num_hidden_layers: int = 54  # the layout decides the layers, as in transformers
    layers_block_type: tuple | None = None  # None: default_layout()
    hybrid_layer_ids: tuple | None = None  # derived from the layout (read only without one)
    mamba_d_state: int = 64
    mamba_d_conv: int = 4
    mamba_expand: int = 2
    mamba_ngroups: int = 1
    time_step_min: float = 0.001
    n_mamba_heads: int | None = None  # None: expand * hidden // mamba_headdim if given, else 8
    mamba_headdim: int | None = None  # derived: expand * hidden // n_mamba_heads
    chunk_size: int = 256
    add_bias_linear: bool = False
    intermediate_size: int | None = None  # None: 4 * hidden_size
    hidden_act: str = "gelu"
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None  # None: num_attention_heads
    attention_head_dim: int | None = None  # None: 2 * hidden_size // num_attention_heads
    attention_hidden_size: int | None = None  # derived: 2 * hidden_size (a saved one is checked)
    num_mem_blocks: int = 1
    use_shared_attention_adapter: bool = False
    adapter_rank: int = 128
    use_shared_mlp_adapter: bool = True  # not a transformers 5.24 key (it always has them)
    use_mem_rope: bool = False
    rms_norm_eps: float = 1e-5
    use_long_context: bool = False
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "mamba_d_state", "mamba_d_conv", "mamba_expand",
            "mamba_ngroups", "chunk_size", "num_attention_heads", "num_mem_blocks",
            "adapter_rank",
        )  # fmt: skip
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_act={self.hidden_act!r} is not supported; allowed: "
                f"{', '.join(ACTIVATIONS)}"
            )
        if self.use_long_context:
            self._set("max_position_embeddings", LONG_CONTEXT_POSITIONS)
        self._derive_sizes()
        self._check_mamba()
        self._check_attention()
        layout = self._layout()
        self._set("layers_block_type", layout)
        self._set("hybrid_layer_ids", tuple(i for i, r in enumerate(layout) if r == "hybrid"))
        if self.use_mem_rope:
            self.rope  # one-line errors for an unsupported rope type, at load time  # noqa: B018

    def _derive_sizes(self) -> None:
        inner = self.mamba_expand * self.hidden_size
        given = self.mamba_headdim
        if self.n_mamba_heads is None:  # Zyphra's first configs give the head size instead
            self._set("n_mamba_heads", inner // given if given else 8)
        self._require_positive("n_mamba_heads")
        if self.n_mamba_heads and given is not None and given != inner // self.n_mamba_heads:
            # transformers sets its derived value, then the saved key over it: its mixer would
            # reshape by a head size that does not fit
            raise ValueError(
                f"mamba_headdim ({given}) must be mamba_expand * hidden_size ({inner}) // "
                f"n_mamba_heads ({self.n_mamba_heads})"
            )
        self._set("mamba_headdim", inner // self.n_mamba_heads)
        if self.intermediate_size is None:
            self._set("intermediate_size", 4 * self.hidden_size)
        if self.num_key_value_heads is None:
            self._set("num_key_value_heads", self.num_attention_heads)
        if self.attention_head_dim is None:  # a stored value is honoured, as transformers does
            self._set("attention_head_dim", self.width // self.num_attention_heads)
        self._require_positive("intermediate_size", "num_key_value_heads")

    def _check_mamba(self) -> None:
        inner, heads = self.mamba_expand * self.hidden_size, self.n_mamba_heads
        if inner % heads:
            raise ValueError(
                f"mamba_expand * hidden_size ({inner}) must be a multiple of n_mamba_heads "
                f"({heads}): Zamba2's Mamba2 head size is their quotient"
            )
        if heads % self.mamba_ngroups:
            raise ValueError(
                f"n_mamba_heads ({heads}) must be a multiple of mamba_ngroups "
                f"({self.mamba_ngroups})"
            )

    def _check_attention(self) -> None:
        heads, kv_heads, width = self.num_attention_heads, self.num_key_value_heads, self.width
        if heads % kv_heads:
            raise ValueError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                f"({kv_heads})"
            )
        if self.head_dim <= 0:
            raise ValueError(
                f"attention_head_dim must be >= 1 (default 2 * hidden_size // "
                f"num_attention_heads), got {self.head_dim}: num_attention_heads ({heads}) "
                f"exceeds 2 * hidden_size ({width})?"
            )
        if self.attention_hidden_size not in (None, width):
            raise ValueError(
                f"attention_hidden_size ({self.attention_hidden_size}) must be 2 * hidden_size "
                f"({width}): the shared block attends over concat(x, embeddings)"
            )
        self._set("attention_hidden_size", width)
        hd = self.head_dim
        if self.use_shared_attention_adapter and (heads * hd != width or kv_heads != heads):
            raise ValueError(
                f"use_shared_attention_adapter needs num_attention_heads * attention_head_dim "
                f"({heads} * {hd}) == 2 * hidden_size ({width}) and num_key_value_heads "
                f"({kv_heads}) == num_attention_heads: each adapter adds a {width}-wide term to "
                "q, k and v"
            )
        if self.use_mem_rope and hd % 2:
            raise ValueError(f"use_mem_rope needs an even attention_head_dim, got {hd}")

    def _layout(self) -> tuple[str, ...]:
        ids = self.hybrid_layer_ids
        if ids is not None and not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ValueError(f"hybrid_layer_ids must be layer numbers, got {list(ids)}")
        if self.layers_block_type is not None:  # then hybrid_layer_ids is ignored, as there
            return self._roles(self.layers_block_type)
        if ids is not None:  # a layout given only by its hybrid layers (transformers ignores it)
            return tuple(
                "hybrid" if i in ids else "mamba"
                for i in range(max(self.num_hidden_layers, max(ids, default=-1) + 1))
            )
        return default_layout()

    def _roles(self, tokens: tuple) -> tuple[str, ...]:
        roles = []
        for tok in tokens:
            role = LAYER_ROLES.get(str(tok).strip().lower())
            if role is None:
                raise ConfigError(
                    f"config.json of {self.ARCHITECTURE}: unknown layer type {tok!r} in "
                    f"layers_block_type; allowed: {', '.join(LAYER_ROLES)}"
                )
            roles.append(role)
        return tuple(roles)

    @property
    def width(self) -> int:
        """The shared block's input width: concat(hidden, embeddings)."""
        return 2 * self.hidden_size

    @property
    def head_dim(self) -> int:
        """transformers' attention_head_dim: config.json's value (or its `head_dim`), else
        2 * hidden_size // num_attention_heads."""
        assert self.attention_head_dim is not None  # set in __post_init__
        return self.attention_head_dim

    @property
    def shares_blocks(self) -> bool:
        """transformers 5.24 ties the shared blocks only together with the word embeddings
        (its `_tied_weights_keys`): an untied model has one block per hybrid layer."""
        return self.tie_word_embeddings

    @property
    def num_calls(self) -> int:
        """How many times the shared blocks run per token (one KV cache each)."""
        assert self.hybrid_layer_ids is not None
        return len(self.hybrid_layer_ids)

    def mamba2(self, index: int) -> Mamba2Mixer:
        assert self.n_mamba_heads is not None and self.mamba_headdim is not None
        return Mamba2Mixer(
            self.hidden_size, self.n_mamba_heads, self.mamba_headdim, self.mamba_d_state,
            self.mamba_ngroups, self.mamba_d_conv, self.chunk_size, conv_bias=True,
            proj_bias=self.add_bias_linear, norm_eps=MAMBA_NORM_EPS,
            dt_limit=(self.time_step_min, math.inf), layer_index=index,
        )  # fmt: skip


# -- the shared transformer block ------------------------------------------------------------


def _adapter(width: int, rank: int, out: int) -> nn.Sequential:
    """x -> up(down(x)): checkpoint names `.0.weight` [rank, width] and `.1.weight` [out, rank]."""
    return nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, out, bias=False))


def _adapter_slots(
    cfg: Zamba2Config, block: int, out: int, width: int, rows: ShardSpec | None = None
) -> nn.ModuleList:
    """One slot per shared-block call h; block `block` runs the calls h % num_mem_blocks ==
    block, whose slots hold that call's adapter; the others stay empty (as in transformers).
    `out` is this rank's output size and `rows` where its rows come from (tensor parallel:
    the up matrix sliced like the adapted weight; the down matrix replicated)."""
    slots = nn.ModuleList(
        _adapter(width, cfg.adapter_rank, out) if h % cfg.num_mem_blocks == block
        else nn.Identity()
        for h in range(cfg.num_calls)
    )  # fmt: skip
    for slot in slots:
        if isinstance(slot, nn.Sequential):
            declare_shards(slot[1], weight=rows)
    return slots


def _attention_heads(cfg: Zamba2Config) -> tuple[int, int, int]:
    """This rank's (query heads, KV heads, first KV head) of the shared attention."""
    tp = current()
    heads = tp.split(cfg.num_attention_heads, "num_attention_heads")
    kv_heads, first_kv = tp.replicated(cfg.num_key_value_heads, "num_key_value_heads")
    return heads, kv_heads, first_kv


class SharedAttention(nn.Module):
    """The shared block's attention: projections from 2 * hidden (plus the call's adapters),
    attending through the calling layer's own KV cache (`kv`)."""

    def __init__(self, cfg: Zamba2Config, block: int) -> None:
        super().__init__()
        width, hd = cfg.width, cfg.head_dim
        # tensor parallel: this rank's heads (every size below is this rank's)
        self.tp = tp = current()
        self.heads, self.kv_heads, first_kv = _attention_heads(cfg)
        self.head_dim = hd
        q_out, kv_out = self.heads * hd, self.kv_heads * hd
        self.q_proj = nn.Linear(width, q_out, bias=False)
        self.k_proj = nn.Linear(width, kv_out, bias=False)
        self.v_proj = nn.Linear(width, kv_out, bias=False)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=False)
        q_rows = column(tp, (0, cfg.num_attention_heads * hd))
        kv_rows = explicit(tp, (first_kv * hd, kv_out))
        declare_shards(self.q_proj, weight=q_rows)
        declare_shards(self.k_proj, weight=kv_rows)
        declare_shards(self.v_proj, weight=kv_rows)
        declare_shards(self.o_proj, weight=column(tp, (0, cfg.num_attention_heads * hd), dim=1))
        self.adapters = cfg.use_shared_attention_adapter
        if self.adapters:  # (the config makes q, k and v each width wide)
            self.linear_q_adapter_list = _adapter_slots(cfg, block, q_out, width, q_rows)
            self.linear_k_adapter_list = _adapter_slots(cfg, block, kv_out, width, kv_rows)
            self.linear_v_adapter_list = _adapter_slots(cfg, block, kv_out, width, kv_rows)

    def forward(
        self,
        x: torch.Tensor,
        call: int,
        kv: PagedAttention,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None,
        cos_sin: CosSin | None,
    ) -> torch.Tensor:
        """x: [T, 2 * hidden] -> [T, hidden]; tensor parallel: o_proj's output all-reduced."""
        t = x.shape[0]
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.adapters:
            q = q + self.linear_q_adapter_list[call](x)
            k = k + self.linear_k_adapter_list[call](x)
            v = v + self.linear_v_adapter_list[call](x)
        # q: [T, heads, head_dim]; k, v: [T, kv_heads, head_dim]
        q = q.view(t, self.heads, self.head_dim)
        k = k.view(t, self.kv_heads, self.head_dim)
        v = v.view(t, self.kv_heads, self.head_dim)
        if rotary is not None and cos_sin is not None:
            q, k = rotary(q, k, *cos_sin)
        return self.tp.all_reduce(self.o_proj(kv(q, k, v, batch)))  # kv: [T, heads * head_dim]


class SharedMLP(nn.Module):
    """down(act(gate) * up) with a fused [gate | up] projection and the call's adapter.
    Tensor parallel: gate and up each split by rows, down row-parallel (all-reduced)."""

    def __init__(self, cfg: Zamba2Config, block: int) -> None:
        super().__init__()
        hidden, full, bias = cfg.hidden_size, cfg.intermediate_size, cfg.add_bias_linear
        assert full is not None
        self.tp = tp = current()
        inter = tp.split(full, "intermediate_size")
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        rows = column(tp, (0, full), (full, full))
        declare_shards(self.gate_up_proj, weight=rows, bias=rows if bias else None)
        declare_shards(self.down_proj, weight=column(tp, (0, full), dim=1))
        declare_shards(self.down_proj, bias=rank0_bias(tp) if bias else None)
        self.adapters = cfg.use_shared_mlp_adapter
        if self.adapters:
            self.gate_up_proj_adapter_list = _adapter_slots(cfg, block, 2 * inter, hidden, rows)

    def forward(self, x: torch.Tensor, call: int) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        gate_up = self.gate_up_proj(x)  # [T, 2 * intermediate]
        if self.adapters:
            gate_up = gate_up + self.gate_up_proj_adapter_list[call](x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.tp.all_reduce(self.down_proj(self.act(gate) * up))


class SharedTransformer(nn.Module):
    """One of the `num_mem_blocks` shared blocks (see the module docstring). Owns no cache."""

    def __init__(self, cfg: Zamba2Config, block: int) -> None:
        super().__init__()
        self.block = block
        self.input_layernorm = RMSNorm(cfg.width, cfg.rms_norm_eps)
        self.self_attn = SharedAttention(cfg, block)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = SharedMLP(cfg, block)

    def forward(
        self,
        x: torch.Tensor,
        embeddings: torch.Tensor,
        call: int,
        kv: PagedAttention,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None,
        cos_sin: CosSin | None,
    ) -> torch.Tensor:
        """x, embeddings: [T, hidden] -> [T, hidden]."""
        u = self.input_layernorm(torch.cat([x, embeddings], dim=-1))  # [T, 2 * hidden]
        a = self.self_attn(u, call, kv, batch, rotary, cos_sin)
        return self.feed_forward(self.pre_ff_layernorm(a), call)


# -- decoder layers --------------------------------------------------------------------------


class Zamba2MambaLayer(nn.Module):
    """x + mamba(norm(x + t)), t the shared block's output in hybrid layers (else 0)."""

    def __init__(self, cfg: Zamba2Config, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba = cfg.mamba2(index)

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, shared_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]."""
        h = x if shared_out is None else x + shared_out
        return x + self.mamba(self.input_layernorm(h), batch)


class Zamba2HybridLayer(nn.Module):
    """A call of a shared block, its own linear and KV cache, then a Mamba2 layer.

    `attn` is this call's cache: a `PagedAttention` without weights (it declares
    kv_heads x head_dim per token as its own cache layer, `layers.{i}.attn`) that the shared
    block's attention writes its keys and values to and attends over. `shared_transformer` is
    the block object shared with the other layers of the same block (its weights load once)."""

    def __init__(self, cfg: Zamba2Config, index: int, call: int, shared: SharedTransformer) -> None:
        super().__init__()
        self.call = call
        self.shared_transformer = shared
        scale = (cfg.head_dim / 2) ** -0.5  # transformers: the head sees 2 x hidden
        heads, kv_heads, _ = _attention_heads(cfg)  # tensor parallel: this rank's
        self.attn = PagedAttention(index, heads, kv_heads, cfg.head_dim, scale)
        self.attn.sharded = True  # its heads are this rank's
        self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mamba_decoder = Zamba2MambaLayer(cfg, index)

    def forward(
        self,
        x: torch.Tensor,
        embeddings: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None,
        cos_sin: CosSin | None,
    ) -> torch.Tensor:
        """x, embeddings: [T, hidden] -> [T, hidden]."""
        t = self.shared_transformer(x, embeddings, self.call, self.attn, batch, rotary, cos_sin)
        return self.mamba_decoder(x, batch, self.linear(t))


class Zamba2Model(nn.Module):
    def __init__(self, cfg: Zamba2Config) -> None:
        super().__init__()
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size)  # tensor parallel
        blocks: dict[int, SharedTransformer] = {}  # block id -> the block (shared blocks)
        calls = {i: h for h, i in enumerate(cfg.hybrid_layer_ids or ())}
        layers: list[nn.Module] = []
        for i, role in enumerate(cfg.layers_block_type or ()):
            if role == "mamba":
                layers.append(Zamba2MambaLayer(cfg, i))
                continue
            b = calls[i] % cfg.num_mem_blocks
            if not cfg.shares_blocks:
                block = SharedTransformer(cfg, b)
            elif b in blocks:
                block = blocks[b]
            else:
                block = blocks[b] = SharedTransformer(cfg, b)
            layers.append(Zamba2HybridLayer(cfg, i, calls[i], block))
        self.layers = nn.ModuleList(layers)
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Zamba2ForCausalLM(CausalLM):
    tensor_parallel = True

    config_class = Zamba2Config

    def __init__(self, config: Zamba2Config) -> None:
        super().__init__(config)
        self.model = Zamba2Model(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)
        self.rotary = None
        if config.use_mem_rope and config.hybrid_layer_ids:
            self.rotary = RotaryEmbedding(config.head_dim, config.rope)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        e = self.model.embed_tokens(batch.input_ids)  # [T, hidden]
        cos_sin = self.rotary.cos_sin(batch.positions, e.dtype) if self.rotary else None
        x = e
        for layer in self.model.layers:
            if isinstance(layer, Zamba2HybridLayer):
                x = layer(x, e, batch, self.rotary, cos_sin)
            else:
                x = layer(x, batch)
        return self.model.final_layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        cfg = self.config
        assert isinstance(cfg, Zamba2Config)
        if not cfg.shares_blocks:
            weights = _unshared_blocks(weights, cfg)
        super().load_weights(weights)


def _unshared_blocks(
    weights: Iterable[tuple[str, torch.Tensor]], cfg: Zamba2Config
) -> Iterator[tuple[str, torch.Tensor]]:
    """Untied models hold one block per hybrid layer (as transformers 5.24 builds them). A
    layer whose block the checkpoint leaves out gets the weights of its block's first layer
    (the checkpoint shares them); the copies a checkpoint does hold load as they are."""
    ids = cfg.hybrid_layer_ids or ()
    home = {i: ids[h % cfg.num_mem_blocks] for h, i in enumerate(ids)}  # layer -> block's first
    seen: set[tuple[int, str]] = set()
    kept: dict[tuple[int, str], torch.Tensor] = {}  # (home layer, name tail) -> tensor
    for name, tensor in weights:
        yield name, tensor
        match = SHARED_WEIGHT.match(name)
        if match is None:
            continue
        layer, tail = int(match.group(1)), match.group(2)
        seen.add((layer, tail))
        if home.get(layer) == layer:
            kept[(layer, tail)] = tensor
    for layer, first in home.items():
        for (source, tail), tensor in kept.items():
            if source == first and (layer, tail) not in seen:
                yield f"model.layers.{layer}{tail}", tensor
