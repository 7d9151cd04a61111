"""The shape every pure state model shares (Mamba, Falcon Mamba, Mamba2): no attention, every
layer a state mixer, module names as the checkpoints have them.

    x = backbone.embeddings(ids)
    per layer:  x = x + mixer(norm(x))        (x kept in float32 when residual_in_fp32)
    logits = lm_head(backbone.norm_f(x))

The family's typed config supplies `mixer(index)` (the CacheOwner of layer `index`) and the
sizes. The cache holds one state per page and nothing that grows with the prompt; the plan then
makes `page_tokens` the prefix-hash block (`hybridkv.kv.plan._pure_state_page_size`), so prefix
caching works by state snapshots taken at multiples of it (vLLM turns it off for these models).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from hybridkv.distributed.layers import vocab_embedding, vocab_head
from hybridkv.forward_batch import ForwardBatch
from hybridkv.layers.cache import CacheOwner
from hybridkv.layers.mlp import RMSNorm
from hybridkv.models.base import CausalLM
from hybridkv.ops.elementwise import residual_add, to_dtype


class StateModelConfig(Protocol):
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_norm_epsilon: float
    residual_in_fp32: bool

    def mixer(self, index: int) -> CacheOwner: ...


class StateBlock(nn.Module):
    def __init__(self, cfg: StateModelConfig, index: int) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)
        self.mixer = cfg.mixer(index)
        self.residual_in_fp32 = cfg.residual_in_fp32

    def forward(self, x: torch.Tensor, batch: ForwardBatch, dtype: torch.dtype) -> torch.Tensor:
        # x: [T, hidden], float32 when residual_in_fp32 (as transformers keeps the residual)
        h = self.mixer(self.norm(to_dtype(x, dtype)), batch)
        if self.residual_in_fp32 and h.dtype != torch.float32:
            # a bfloat16 model's float32 residual: x.float() + h, both widened exactly
            return residual_add(to_dtype(x, torch.float32), to_dtype(h, torch.float32))
        return residual_add(x, h)


class StateBackbone(nn.Module):
    def __init__(self, cfg: StateModelConfig) -> None:
        super().__init__()
        self.embeddings = vocab_embedding(cfg.vocab_size, cfg.hidden_size)  # tensor parallel
        self.layers = nn.ModuleList(StateBlock(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm_f = RMSNorm(cfg.hidden_size, cfg.layer_norm_epsilon)


class StateCausalLM(CausalLM):
    """A pure state model; subclasses set `config_class`."""

    def __init__(self, config) -> None:  # config: a StateModelConfig HFConfig
        super().__init__(config)
        self.backbone = StateBackbone(config)
        self.lm_head = vocab_head(config.hidden_size, config.vocab_size)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.backbone.embeddings

    def map_weight_name(self, name: str) -> str | None:
        # older checkpoints spell the embeddings `backbone.embedding` (transformers renames too)
        return name.replace("backbone.embedding.", "backbone.embeddings.")

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        x = self.backbone.embeddings(batch.input_ids)  # [T, hidden]
        dtype = x.dtype
        for layer in self.backbone.layers:
            x = layer(x, batch, dtype)
        # transformers: norm_f in the residual's dtype, then the cast for lm_head
        return to_dtype(self.backbone.norm_f(x), dtype)
