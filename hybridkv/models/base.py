"""What every model shares: its typed config, the cache it declares, weight loading, logits.

    cfg = Family.config_class.from_hf(config_dict)     # the one reading of config.json
    with torch.device("meta"):
        model = Family(cfg)                              # no memory for weights yet
    layers = model.cache_layers(dtypes)                  # every CacheOwner's spec -> the plan
    model.materialise(device, dtype)                     # real (uninitialised) tensors
    model.load_weights(iter_weights(folder))             # every weight, by checkpoint name
    model.bind_cache(caches)                             # views + kernels, per cache layer
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

import torch
from torch import nn

from hybridkv.distributed.parallel import read_full, read_shard, shard_specs
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import CacheDtypes, CacheLayer
from hybridkv.layers.cache import CacheOwner, LayerCache
from hybridkv.models.hf_config import HFConfig
from hybridkv.ops.elementwise import logits_float32


class CausalLM(nn.Module):
    """A decoder-only model whose module names mirror the Hugging Face checkpoint's, so weights
    load by name. Subclasses set `config_class`, build the modules from the typed config,
    implement `forward` and, if needed, `map_weight_name`."""

    config_class: ClassVar[type[HFConfig]] = HFConfig
    # True where every module of the family shards (hybridkv.distributed); the others refuse
    # tensor_parallel_size > 1 in one line
    tensor_parallel: ClassVar[bool] = False

    def __init__(self, config: HFConfig) -> None:
        super().__init__()
        self.config = config
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.mtp: nn.Module | None = None  # multi-token prediction layers (`build_mtp`)

    # -- cache -------------------------------------------------------------------------------

    def cache_owners(self) -> list[tuple[str, CacheOwner]]:
        """Every module that owns cache, with its module path, in layer order."""
        return [(n, m) for n, m in self.named_modules() if isinstance(m, CacheOwner)]

    def cache_layers(self, dtypes: CacheDtypes) -> list[CacheLayer]:
        """The cache layers this model declares (each owner's spec, named by its path)."""
        return [CacheLayer(n, m.layer_index, m.declare(dtypes)) for n, m in self.cache_owners()]

    def bind_cache(self, caches: Mapping[str, LayerCache]) -> None:
        """Give every cache owner its views and its group's kernels (once)."""
        owners = dict(self.cache_owners())
        if set(owners) != set(caches):
            missing, extra = sorted(set(owners) - set(caches)), sorted(set(caches) - set(owners))
            raise RuntimeError(f"cache layers differ from the model's: missing {missing}, {extra}")
        for name, module in owners.items():
            module.bind_cache(caches[name])

    # -- weights -----------------------------------------------------------------------------

    def materialise(self, device: torch.device, dtype: torch.dtype) -> CausalLM:
        """Turn a model built on the meta device into real tensors of `dtype` on `device`,
        uninitialised: `load_weights` fills every one of them. Constants that are not weights
        are plain CPU tensors built at construction (rotary frequencies), never buffers that
        a checkpoint would not fill (`check_no_unloaded_buffers`)."""
        check_no_unloaded_buffers(self)
        return self.to(dtype=dtype).to_empty(device=device)

    def map_weight_name(self, name: str) -> str | None:
        """Checkpoint tensor name -> parameter name (None: skip the tensor)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Weights by checkpoint name: full tensors, or safetensors slices (`iter_weights(...,
        lazy=True)`); a tensor-parallel shard takes only its declared rows of each."""
        params = dict(self.named_parameters())
        params.update(dict(self.named_buffers()))
        shards = shard_specs(self)
        loaded: set[str] = set()
        for ckpt_name, source in weights:
            name = self.map_weight_name(ckpt_name)
            if name is None or name not in params:
                continue
            target = params[name]
            spec = shards.get(name)
            if spec is not None:
                tensor = read_shard(source, spec, target.shape)
            else:
                tensor = read_full(source)
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
        missing = sorted(set(params) - loaded)
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
        return logits_float32(self.lm_head(hidden))

    # -- multi-token prediction (speculative decoding, method "mtp") ---------------------------
    #
    # A family whose checkpoints carry MTP layers reads their count from config.json
    # (`num_mtp_layers` of its config), builds them on request (`build_mtp`, on the meta
    # device like the rest: each MTP layer's attention is a cache owner the plan sees) and
    # loads their tensors. One MTP step over a batch of pairs (the target's final hidden state
    # at position p, the token at p + 1):
    #
    #     out = mtp_forward(next_ids [T], hidden [T, H], batch)   # batch: RoPE position p + 1
    #     logits = mtp_logits(out)                                 # the draft for p + 2
    #
    # and `out` is the hidden state the next (autoregressive) MTP step takes.

    def build_mtp(self) -> None:
        """Add the MTP layer (before `cache_layers`, `materialise` and `load_weights`): one,
        the count of every released checkpoint; a chain of several is not built."""
        n = int(getattr(self.config, "num_mtp_layers", 0) or 0)
        name = type(self).__name__
        if n < 1:
            raise ValueError(f"{name} has no multi-token-prediction layers")
        if n > 1:
            raise ValueError(
                f"{name}: checkpoints with {n} MTP layers are not supported; method 'mtp' runs "
                "checkpoints with one (num_nextn_predict_layers / mtp_num_hidden_layers)"
            )
        self.mtp = self.make_mtp()

    def make_mtp(self) -> nn.Module:
        """The family's MTP layer module (families with MTP checkpoints)."""
        raise ValueError(f"{type(self).__name__} has no multi-token-prediction layers")

    def mtp_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch
    ) -> torch.Tensor:
        """input_ids: [T] (the token after each pair's position), hidden: [T, H] -> [T, H]."""
        raise NotImplementedError

    def mtp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP output [n, H] -> draft logits [n, vocab] float32 (the shared lm_head)."""
        return self.compute_logits(hidden)


def check_no_unloaded_buffers(model: nn.Module) -> None:
    """Every buffer must be persistent (a checkpoint fills it): a model materialised from the
    meta device keeps nothing of what its constructor computed into a buffer."""
    persistent = set(model.state_dict(keep_vars=True))
    loose = [n for n, _ in model.named_buffers() if n not in persistent]
    if loose:
        raise RuntimeError(f"non-persistent buffers would be lost when materialising: {loose}")
