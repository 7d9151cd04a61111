"""The model declares its cache: the one interface between a cache-owning module and the cache.

Every module that owns cache (attention, each state kind, MLA later) is a `CacheOwner`:

    declare   owner.cache_spec(dtypes) -> its layer spec, from the dimensions it was built with
              (collected from the model on the meta device: `CausalLM.cache_layers`)
    bind      owner.bind_cache(cache)  -> its views of the cache buffers and the kernels of its
              group (`AttentionCache` or `StateCache`), checked against what it declared
    step      owner.step_metadata(batch) -> its group's metadata in the step's `ForwardBatch`

so the names, shapes and dtypes of the state tensors a layer reads are the ones it declared: the
runner builds the views from the declared spec, and `bind_cache` refuses views that differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybridkv.dtypes import torch_dtype
from hybridkv.forward_batch import ForwardBatch
from hybridkv.kv.specs import AttentionSpec, CacheDtypes, LayerSpec, MLASpec, StateSpec
from hybridkv.layers.attention.base import AttentionImpl


@dataclass(frozen=True)
class AttentionCache:
    """An attention layer's view of its group's pages, and the group's backend."""

    group_id: int
    kv: torch.Tensor  # [num_kernel_blocks, 2, kernel_block_size, kv_heads, head_dim]
    backend: AttentionImpl


@dataclass(frozen=True)
class StateCache:
    """A state layer's views (one per declared state tensor, [num_pages, *shape], page-strided)
    and the ops implementation the plan chose for its group."""

    group_id: int
    tensors: Mapping[str, torch.Tensor]
    ops: Any  # the layer kind's ops class (declared in its StateSpec.ops), instantiated
    # speculative decoding with per-position states: tensor name -> [scratch rows, positions,
    # *state shape], where the ops write the state after each draft position
    # (`StateMetadata.scratch_rows`); empty otherwise
    positions: Mapping[str, torch.Tensor] = field(default_factory=dict)

    def kept(self, meta: Any, *names: str) -> tuple[torch.Tensor, ...] | None:
        """The scratch of the named tensors where the step keeps per-position states
        (`meta.scratch_rows`, a `StateMetadata`), else None."""
        if meta.scratch_rows is None:
            return None
        return tuple(self.positions[name] for name in names)


LayerCache = AttentionCache | StateCache


class CacheOwner(nn.Module):
    """Base of every module that owns cache. Subclasses set `layer_index` (the decoder layer
    it sits in) and implement `cache_spec`."""

    layer_index: int
    # True when the module that built it sized it for its tensor-parallel rank (heads split or
    # replicated): only then is its spec a per-rank spec (`hybridkv.distributed`)
    sharded: bool = False

    def __init__(self, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.declared: LayerSpec | None = None
        self._cache: LayerCache | None = None

    def cache_spec(self, dtypes: CacheDtypes) -> LayerSpec:
        """The layer spec of this module, from the dimensions it was constructed with."""
        raise NotImplementedError

    def declare(self, dtypes: CacheDtypes) -> LayerSpec:
        self.declared = self.cache_spec(dtypes)
        return self.declared

    @property
    def cache(self) -> LayerCache:
        if self._cache is None:
            raise RuntimeError(f"{type(self).__name__} of layer {self.layer_index}: no cache bound")
        return self._cache

    def bind_cache(self, cache: LayerCache) -> None:
        """Take the views of this module's cache (once, when the cache is allocated)."""
        spec = self.declared
        if spec is None:
            raise RuntimeError(f"{type(self).__name__}: bind_cache before its spec was declared")
        _check_views(spec, cache, f"{type(self).__name__} of layer {self.layer_index}")
        self._cache = cache

    def step_metadata(self, batch: ForwardBatch) -> Any:
        """This module's group's metadata for the step (AttentionMetadata / StateMetadata)."""
        return batch.metadata_for(self.cache.group_id)


def _check_views(spec: LayerSpec, cache: LayerCache, who: str) -> None:
    if isinstance(spec, StateSpec):
        if not isinstance(cache, StateCache):
            raise TypeError(f"{who} declared a {spec.kind} state but got {type(cache).__name__}")
        got = {n: (tuple(t.shape[1:]), t.dtype) for n, t in cache.tensors.items()}
        want = {t.name: (t.shape, torch_dtype(t.dtype)) for t in spec.tensors}
        if got != want:
            raise ValueError(f"{who}: state views {got} differ from the declared {want}")
        return
    if not isinstance(cache, AttentionCache):
        raise TypeError(f"{who} declared {spec.kind} but got {type(cache).__name__}")
    if isinstance(spec, MLASpec):
        want_shape: tuple[int, ...] = (spec.head_dim,)
    else:
        assert isinstance(spec, AttentionSpec)
        want_shape = (spec.num_kv_heads, spec.head_dim)
    got_shape = tuple(cache.kv.shape[-len(want_shape) :])
    if got_shape != want_shape or cache.kv.dtype != torch_dtype(spec.dtype):
        raise ValueError(
            f"{who}: KV view {tuple(cache.kv.shape)} {cache.kv.dtype} differs from the declared "
            f"{want_shape} {spec.dtype}"
        )
