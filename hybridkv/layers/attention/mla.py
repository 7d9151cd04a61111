"""Multi-head latent attention (MLA) as DeepSeek-V2/V3 and Kimi-Linear use it.

    q      = q_proj(x)                       or q_b_proj(q_a_layernorm(q_a_proj(x)))  (q LoRA)
           -> [T, heads, nope_dim + rope_dim] = [q_nope | q_rope]
    c, kr  = kv_a_proj_with_mqa(x)           -> [T, kv_lora_rank], [T, rope_dim]
    c      = kv_a_layernorm(c)
    q_rope, kr = rope(q_rope, kr)            interleaved pairs (DeepSeek) or halves; or none
    cache  <- [c | kr] per token             (MLASpec: kv_lora_rank + rope_dim values)
    out    = attention over kv_b_proj(c) = [k_nope | v] per head, key [k_nope | kr]
    y      = o_proj(out)                     [T, heads * v_dim] -> [T, hidden]

Tensor parallel (`hybridkv.distributed`): each rank keeps num_heads / size query heads. q_proj,
q_b_proj and kv_b_proj are column-parallel by head (a head's rows [nope + rope], resp. [nope |
v], are contiguous); q_a_proj, its norm, kv_a_proj_with_mqa and kv_a_layernorm are replicated:
the latent is shared by every head, so every rank caches the same full [c | kr] row and the
per-rank MLASpec equals the full one. o_proj is row-parallel and its output all-reduced. The
decode in latent space absorbs and expands with the rank's heads of W_UK / W_UV only.

The projections carry Hugging Face's names (DeepseekV3Attention, Kimi-Linear's MLA), so
checkpoints load by name. `PagedMLA` owns the cache: it declares the MLASpec and runs the MLA
ops of its group's backend (`torch`: hybridkv.ops.mla, with the native CPU decode; `triton`:
hybridkv.ops.triton_mla's decode kernel).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import torch
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.forward_batch import AttentionMetadata, ForwardBatch
from hybridkv.kv.specs import CacheDtypes, MLASpec
from hybridkv.layers.cache import AttentionCache, CacheOwner
from hybridkv.layers.mlp import RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding, rotate

CosSin = tuple[torch.Tensor, torch.Tensor]

# attention backend that runs the group -> module with write_mla_cache / mla_paged_attention
MLA_OPS: dict[str, str] = {"torch": "hybridkv.ops.mla", "triton": "hybridkv.ops.triton_mla"}


def mla_ops(backend_name: str) -> ModuleType:
    """The MLA ops module of an attention backend (imported on first use)."""
    if backend_name not in MLA_OPS:
        raise ValueError(
            f"attention backend {backend_name!r} has no MLA ops in hybridkv; "
            f"MLA runs on: {', '.join(MLA_OPS)}"
        )
    return importlib.import_module(MLA_OPS[backend_name])


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """DeepSeek's YaRN magnitude correction: 0.1 * mscale * ln(factor) + 1 (1 below factor 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope: Mapping[str, Any] | None) -> float:
    """1/sqrt(nope_dim + rope_dim), times mscale(factor, mscale_all_dim)^2 under YaRN scaling
    with `mscale_all_dim` set (transformers' `yarn_apply_mscale`)."""
    scale = qk_head_dim**-0.5
    if rope is not None and rope.get("rope_type", "default") != "default":
        mscale_all_dim = rope.get("mscale_all_dim", 0)
        if mscale_all_dim:
            m = yarn_mscale(float(rope["factor"]), float(mscale_all_dim))
            scale = scale * m * m
    return scale


class PagedMLA(CacheOwner):
    """The cache owner of one MLA layer: declares `MLASpec(kv_lora_rank, rope_dim)`, writes the
    step's latent rows by slot and attends over its group's kernel blocks."""

    def __init__(
        self,
        layer_index: int,
        num_heads: int,
        kv_lora_rank: int,
        rope_dim: int,
        nope_dim: int,
        v_dim: int,
        scale: float,
    ) -> None:
        super().__init__(layer_index)
        self.sharded = True  # num_heads are this rank's; the latent it caches is the full one
        self.num_heads, self.kv_lora_rank, self.rope_dim = num_heads, kv_lora_rank, rope_dim
        self.nope_dim, self.v_dim, self.scale = nope_dim, v_dim, scale
        self._ops: ModuleType | None = None

    def cache_spec(self, dtypes: CacheDtypes) -> MLASpec:
        return MLASpec(self.kv_lora_rank, self.rope_dim, dtypes.kv)

    def forward(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        c: torch.Tensor,
        k_rope: torch.Tensor,
        w_kv_b: torch.Tensor,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """q_nope: [T, heads, nope]; q_rope: [T, heads, rope]; c: [T, rank] (normed latent);
        k_rope: [T, rope] (rotated key); w_kv_b: kv_b_proj.weight [heads * (nope + v), rank]
        -> [T, heads * v]. The cache row of a token is [c | k_rope]."""
        cache = self.cache
        assert isinstance(cache, AttentionCache)
        if self._ops is None:
            self._ops = mla_ops(cache.backend.name)
        meta: AttentionMetadata = self.step_metadata(batch)
        self._ops.write_mla_rows(c, k_rope, cache.kv, meta.slot_mapping)
        out = self._ops.mla_paged_attention(
            q_nope, q_rope, cache.kv, meta.block_table, meta.query_start_loc, meta.seq_lens,
            self.scale, w_kv_b, self.nope_dim, max_query_len=meta.max_query_len,
        )  # fmt: skip
        return out.reshape(out.shape[0], self.num_heads * self.v_dim)


class MultiHeadLatentAttention(nn.Module):
    def __init__(
        self,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        q_lora_rank: int | None = None,
        bias: bool = False,
        scale: float | None = None,
        norm_eps: float = 1e-6,
        rope_interleave: bool = True,
    ) -> None:
        """An MLA layer with Hugging Face's module names.

        - `q_lora_rank` None: a plain `q_proj` [hidden -> heads * (nope + rope)]; set: `q_a_proj`
          [hidden -> q_lora_rank] (with `bias`), `q_a_layernorm`, `q_b_proj` (no bias).
        - `kv_a_proj_with_mqa` [hidden -> kv_lora_rank + rope] (with `bias`), `kv_a_layernorm`
          over the latent, `kv_b_proj` [kv_lora_rank -> heads * (nope + v)], `o_proj`
          [heads * v -> hidden] (with `bias`).
        - `scale`: the softmax scale (default 1/sqrt(nope + rope); DeepSeek's YaRN correction
          is `mla_softmax_scale`); `norm_eps`: of both LoRA norms (transformers' DeepSeek-V3
          builds them with its RMSNorm default 1e-6, not rms_norm_eps).
        - RoPE is applied in `forward` when a rotary embedding is passed (of `qk_rope_head_dim`
          channels): over interleaved pairs (`rope_interleave`, DeepSeek) or halves. Without
          one the rope part is used as it comes (Kimi-Linear's MLA layers, NoPE; rope dim may
          then be 0).
        - `num_heads` is the model's; built under tensor parallelism the layer keeps
          num_heads / size of them (a one-line error when the size does not divide them).
        """
        super().__init__()
        self.tp = tp = current()
        full_heads = num_heads
        num_heads = tp.split(full_heads, "num_attention_heads")  # this rank's heads
        self.heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.rope_interleave = rope_interleave
        qk_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, num_heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = nn.Linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)
        self._declare_shards(full_heads, qk_dim, bias)
        scale = qk_dim**-0.5 if scale is None else scale
        self.attn = PagedMLA(
            layer_index, num_heads, kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim,
            v_head_dim, scale,
        )  # fmt: skip

    def _declare_shards(self, full_heads: int, qk_dim: int, bias: bool) -> None:
        """This rank's heads: rows of the per-head projections, columns of o_proj (whose bias
        rank 0 adds); the q LoRA down-projection and the latent projection stay whole."""
        tp = self.tp
        q_rows = column(tp, (0, full_heads * qk_dim))
        declare_shards(self.q_proj if self.q_lora_rank is None else self.q_b_proj, weight=q_rows)
        kv_rows = column(tp, (0, full_heads * (self.nope_dim + self.v_dim)))
        declare_shards(self.kv_b_proj, weight=kv_rows)
        declare_shards(self.o_proj, weight=column(tp, (0, full_heads * self.v_dim), dim=1))
        declare_shards(self.o_proj, bias=rank0_bias(tp) if bias else None)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, hidden] -> [T, heads, nope + rope]."""
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.heads, self.nope_dim + self.rope_dim)

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rotary: RotaryEmbedding | None = None,
        cos_sin: CosSin | None = None,
    ) -> torch.Tensor:
        """x: [T, hidden] -> [T, hidden]; `cos_sin`: 2 x [T, rope_dim] of `rotary` (or None)."""
        q = self._query(x)
        q_nope, q_rope = q[..., : self.nope_dim], q[..., self.nope_dim :]
        ckv = self.kv_a_proj_with_mqa(x)  # [T, rank + rope]
        c = self.kv_a_layernorm(ckv[:, : self.kv_lora_rank])
        k_rope = ckv[:, None, self.kv_lora_rank :]  # [T, 1, rope]
        if rotary is not None and cos_sin is not None and self.rope_dim:
            pairs = self.rope_interleave  # (DeepSeek's pairs, else halves)
            q_rope = rotate(q_rope, *cos_sin, pairs)
            k_rope = rotate(k_rope, *cos_sin, pairs)
        # the cache row of each token: [c | k_rope] (written in place, no cat)
        out = self.attn(q_nope, q_rope, c, k_rope[:, 0], self.kv_b_proj.weight, batch)
        return self.tp.all_reduce(self.o_proj(out))  # o_proj is row-parallel
