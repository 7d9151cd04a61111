"""Tensor parallelism: who holds which slice, and the collectives between the shards.

A model is built under `building(tp)`: every module that shards reads `current()` in its
constructor, keeps it (`self.tp`), builds its parameters at their per-rank size and declares
where each one comes from in the full checkpoint tensor (`declare_shards`). Nothing reads the
context at run time: the collectives go through the `TensorParallel` the module kept.

Splitting rules (the reference system's, DESIGN.md section 9):

    attention heads          split: size must divide num_attention_heads
    attention KV heads       split while size <= kv heads (size must divide them); beyond,
                             each rank keeps one KV head, replicated (kv heads must divide size)
    Mamba2 / GDN heads       split: size must divide them
    Mamba2 groups            split when size divides n_groups; else replicated (n_groups must
                             divide size: the groups padded up to the size, one per rank)
    MLP / experts            split by intermediate size
    vocabulary               ceil(vocab / size) rows per rank, the last padded with zeros

With size 1 every rule keeps the full tensor and every collective returns its input, so a
model built outside `building(...)` is exactly the single-process model.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class CommCounter:
    """Bytes and calls of the collectives one rank made (the benchmark reads these)."""

    all_reduce_bytes: int = 0
    all_reduce_calls: int = 0
    gather_bytes: int = 0

    def reset(self) -> None:
        self.all_reduce_bytes = self.all_reduce_calls = self.gather_bytes = 0


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group. `group` is the torch process group of
    the forward's collectives (None for planning, where nothing runs)."""

    size: int = 1
    rank: int = 0
    group: Any = None
    counter: CommCounter = field(default_factory=CommCounter, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {self.size!r}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank!r}")

    # -- splitting -------------------------------------------------------------------------

    def split(self, n: int, what: str) -> int:
        """n items split evenly: this rank's count (a one-line error if size does not divide)."""
        if n % self.size:
            raise ValueError(
                f"tensor_parallel_size={self.size} does not divide {what}={n}; give a size "
                f"that divides it"
            )
        return n // self.size

    def first(self, n: int, what: str) -> int:
        """Index of this rank's first item of n split evenly."""
        return self.rank * self.split(n, what)

    def replicated(self, n: int, what: str) -> tuple[int, int]:
        """(count, first index) of items split while the size allows, then replicated: KV heads
        and Mamba2 groups. Size <= n: n / size each (size must divide n); size > n: one each,
        item rank * n // size (n must divide size)."""
        if n % self.size == 0:
            local = n // self.size
            return local, self.rank * local
        if self.size % n:
            raise ValueError(
                f"tensor_parallel_size={self.size} and {what}={n}: one must divide the other"
            )
        return 1, self.rank * n // self.size

    # -- collectives -----------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place (a row-parallel output). Size 1: x itself."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        self.counter.all_reduce_bytes += x.numel() * x.element_size()
        self.counter.all_reduce_calls += 1
        dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """Concatenate every rank's x [n, local] along the last dim on rank 0 -> [n, full];
        other ranks get their own x back (only rank 0 samples)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        self.counter.gather_bytes += x.numel() * x.element_size()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(x, parts, dst=dist.get_global_rank(self.group, 0), group=self.group)
        if self.rank != 0:
            return x
        assert parts is not None
        return torch.cat(parts, dim=-1)[..., :full]


SINGLE = TensorParallel()
_CURRENT: contextvars.ContextVar[TensorParallel] = contextvars.ContextVar("tp", default=SINGLE)


def current() -> TensorParallel:
    """The tensor-parallel place of the model being built (size 1 outside `building`)."""
    return _CURRENT.get()


@contextlib.contextmanager
def building(tp: TensorParallel) -> Iterator[TensorParallel]:
    """Build a model for this rank: modules constructed inside take their per-rank sizes."""
    token = _CURRENT.set(tp)
    try:
        yield tp
    finally:
        _CURRENT.reset(token)


# -- where each per-rank parameter comes from ------------------------------------------------


@dataclass(frozen=True)
class ShardSpec:
    """A per-rank parameter = the concatenation along `dim` of `pieces` (start, length) of the
    full tensor; a piece past the full tensor's end is zero-filled (vocab padding).
    `rank0_only`: the full tensor on rank 0, zeros elsewhere (a row-parallel layer's bias,
    added once by the sum)."""

    dim: int = 0
    pieces: tuple[tuple[int, int], ...] = ()
    rank0_only: bool = False
    rank: int = 0


def declare_shards(module: nn.Module, **specs: ShardSpec | None) -> None:
    """Record where `module`'s parameters (by attribute name) come from; None: replicated."""
    table: dict[str, ShardSpec] = module.__dict__.setdefault("_tp_shards", {})
    for name, spec in specs.items():
        if spec is not None:
            table[name] = spec


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """Every declared parameter of `model`, by its full name."""
    out: dict[str, ShardSpec] = {}
    for prefix, module in model.named_modules():
        for name, spec in module.__dict__.get("_tp_shards", {}).items():
            out[f"{prefix}.{name}" if prefix else name] = spec
    return out


def pieces(tp: TensorParallel, *blocks: tuple[int, int]) -> tuple[tuple[int, int], ...]:
    """This rank's even slice of each (offset, length) block of a fused dimension."""
    return tuple((off + tp.rank * (n // tp.size), n // tp.size) for off, n in blocks)


def column(tp: TensorParallel, *blocks: tuple[int, int], dim: int = 0) -> ShardSpec | None:
    """Spec of a column-parallel weight (output rows split per block); None at size 1."""
    return None if tp.size == 1 else ShardSpec(dim, pieces(tp, *blocks), rank=tp.rank)


def explicit(tp: TensorParallel, *spans: tuple[int, int], dim: int = 0) -> ShardSpec | None:
    """Spec naming this rank's (start, length) spans directly; None at size 1."""
    return None if tp.size == 1 else ShardSpec(dim, tuple(spans), rank=tp.rank)


def rank0_bias(tp: TensorParallel) -> ShardSpec | None:
    return None if tp.size == 1 else ShardSpec(rank0_only=True, rank=tp.rank)


def read_full(source: Any) -> torch.Tensor:
    """A whole tensor from a torch tensor or a safetensors slice."""
    if isinstance(source, torch.Tensor):
        return source
    return source[tuple(slice(None) for _ in source.get_shape())]


def read_shard(source: Any, spec: ShardSpec, shape: Sequence[int]) -> torch.Tensor:
    """This rank's part of a full tensor. `source` is a torch tensor or a safetensors slice
    (`safe_open(...).get_slice(name)`: only the rows asked for are read from the file)."""
    full_shape = list(source.get_shape() if hasattr(source, "get_shape") else source.shape)
    if spec.rank0_only:
        if spec.rank == 0:
            return read_full(source)
        return torch.zeros(full_shape)
    parts = []
    for start, length in spec.pieces:
        stop = min(start + length, full_shape[spec.dim])
        index = [slice(None)] * len(full_shape)
        if stop > start:
            index[spec.dim] = slice(start, stop)
            parts.append(source[tuple(index)])
        missing = length - max(0, stop - start)
        if missing:
            pad_shape = list(full_shape)
            pad_shape[spec.dim] = missing
            dtype = parts[0].dtype if parts else torch.float32
            parts.append(torch.zeros(pad_shape, dtype=dtype))
    out = torch.cat(parts, dim=spec.dim) if len(parts) > 1 else parts[0]
    if tuple(out.shape) != tuple(shape):
        raise ValueError(f"shard of shape {tuple(out.shape)} does not fit {tuple(shape)}")
    return out
