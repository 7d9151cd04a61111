"""What every model shares: cache binding, weight loading by checkpoint name, logits."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.kv.specs import CacheLayer
from hybridkv.worker.batch import ForwardBatch


class CausalLM(nn.Module):
    """A decoder-only model whose module names mirror the Hugging Face checkpoint's, so weights
    load by name. Subclasses build the modules, `forward` and, if needed, `map_weight_name`."""

    def __init__(self, config: dict[str, Any], cache_layers: list[CacheLayer]) -> None:
        super().__init__()
        self.config = config
        self.cache_layers = {layer.name: layer for layer in cache_layers}
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))

    # -- cache -------------------------------------------------------------------------------

    def bind_cache(self, views: Mapping[str, Any], backend: object) -> None:
        """Give every cache-owning module its view (done once, when the cache is allocated)."""
        bound = set()
        for module in self.modules():
            name = getattr(module, "layer_name", None)
            if name is not None and hasattr(module, "bind"):
                module.bind(views[name], backend)
                bound.add(name)
        missing = set(self.cache_layers) - bound
        if missing:
            raise RuntimeError(f"model has no module for cache layers {sorted(missing)}")

    # -- weights -----------------------------------------------------------------------------

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name (None: skip the tensor)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        params.update(dict(self.named_buffers()))
        loaded: set[str] = set()
        for ckpt_name, tensor in weights:
            name = self.map_weight_name(ckpt_name)
            if name is None or name not in params:
                continue
            target = params[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {ckpt_name!r} has shape {tuple(tensor.shape)}, the model "
                    f"expects {tuple(target.shape)}"
                )
            with torch.no_grad():
                target.copy_(tensor.to(target.dtype))
            loaded.add(name)
        if self.tie_word_embeddings and "lm_head.weight" in params:
            self.tie_weights()
            loaded.add("lm_head.weight")
        persistent = {n for n, _ in self.named_parameters()}
        missing = sorted(persistent - loaded)
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} weights: {shown}")

    def tie_weights(self) -> None:
        self.lm_head.weight = self.get_input_embeddings().weight

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    # -- forward -----------------------------------------------------------------------------

    def forward(self, batch: ForwardBatch) -> torch.Tensor:  # -> hidden [num_tokens, hidden]
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [n, hidden] -> logits: [n, vocab] float32."""
        return self.lm_head(hidden).float()
