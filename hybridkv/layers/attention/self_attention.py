"""Self-attention as decoder layers use it: q/k/v/o projections named as in Hugging Face
checkpoints, optional per-head q/k RMSNorm (Qwen3), optional RoPE, then paged attention."""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, explicit, rank0_bias
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.attention.layer import PagedAttention
from hybridkv.layers.mlp import RMSNorm
from hybridkv.layers.rotary import RotaryEmbedding

CosSin = tuple[torch.Tensor, torch.Tensor]


class SelfAttention(nn.Module):
    def __init__(
        self,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        bias: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
        qk_norm_eps: float | None = None,
        sinks: bool = False,
        softcap: float | None = None,
    ) -> None:
        """`scale` defaults to 1/sqrt(head_dim); `qk_norm_eps` set adds q_norm / k_norm
        (RMSNorm over each head, before RoPE); `sinks` adds the per-head softmax-denominator
        logits `sinks` [num_heads] (gpt-oss), passed to the kernels like the window; `softcap`
        c caps the scaled scores to c * tanh(s / c) before the softmax (attention logit
        soft-capping, Gemma 2's `attn_logit_softcapping`).

        Under tensor parallelism (`hybridkv.distributed`) each rank keeps num_heads / size
        query heads and its KV heads (split, or one replicated when the size exceeds them);
        o_proj is row-parallel and its output all-reduced."""
        super().__init__()
        self.tp = tp = current()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        full_heads, full_kv = num_heads, num_kv_heads
        num_heads = tp.split(full_heads, "num_attention_heads")
        num_kv_heads, first_kv = tp.replicated(full_kv, "num_key_value_heads")
        self.heads, self.kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        q_out, kv_out = num_heads * head_dim, num_kv_heads * head_dim
        self.q_proj = nn.Linear(hidden_size, q_out, bias=bias)
        self.k_proj = nn.Linear(hidden_size, kv_out, bias=bias)
        self.v_proj = nn.Linear(hidden_size, kv_out, bias=bias)
        self.o_proj = nn.Linear(q_out, hidden_size, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None
        q_spec = column(tp, (0, full_heads * head_dim))
        kv_spec = explicit(tp, (first_kv * head_dim, kv_out))
        declare_shards(self.q_proj, weight=q_spec, bias=q_spec if bias else None)
        declare_shards(self.k_proj, weight=kv_spec, bias=kv_spec if bias else None)
        declare_shards(self.v_proj, weight=kv_spec, bias=kv_spec if bias else None)
        declare_shards(self.o_proj, weight=column(tp, (0, full_heads * head_dim), dim=1))
        declare_shards(self.o_proj, bias=rank0_bias(tp) if bias else None)
        declare_shards(self, sinks=column(tp, (0, full_heads)) if sinks else None)
        scale = head_dim**-0.5 if scale is None else scale
        self.attn = PagedAttention(
            layer_index, num_heads, num_kv_heads, head_dim, scale, sliding_window, softcap
        )
        self.attn.sharded = True  # its heads are this rank's

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
        v = self.v_proj(x).view(t, self.kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if rotary is not None and cos_sin is not None:
            q, k = rotary(q, k, *cos_sin)
        out = self.attn(q, k, v, batch, sinks=self.sinks)  # [T, heads * head_dim]
        return self.tp.all_reduce(self.o_proj(out))
