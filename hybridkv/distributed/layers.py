"""Vocabulary-parallel embedding and lm_head (each rank holds ceil(vocab / size) rows).

At size 1 `vocab_embedding` and `vocab_head` return an `Embedding` (nn.Embedding with a native
lookup) and a plain `nn.Linear`, so the single-process model is unchanged (and its lm_head is
pre-packed on the CPU).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.parallel import ShardSpec, TensorParallel, current, declare_shards
from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

# The embedding lookup (`Embedding.forward`: weight[ids] * scale), keyed by the table's dtype;
# each implementation takes (ids [T], weight [rows, hidden], scale):
#   float32 / bfloat16 on the CPU   native (one call: a decode step stays capturable), where
#                                   `native_embedding_fits`; else the chain without it
#   otherwise                       torch (F.embedding, then `* scale`)
EMBEDDING = declare(
    "embedding",
    (
        OpImpl("native", "hybridkv.ops.native.elementwise:embedding", frozenset({"cpu"}),
               CPU_FLOATS, ("native",), strict=True, description="one pass (C)"),
        OpImpl("torch", f"{__name__}:torch_embedding", description="F.embedding, * scale"),
    ),
)  # fmt: skip


def _vocab_rows(tp: TensorParallel, vocab: int) -> tuple[int, int]:
    """(rows per rank, this rank's first vocabulary id)."""
    rows = math.ceil(vocab / tp.size)
    return rows, tp.rank * rows


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding over this rank's vocabulary rows; ids outside them give zeros, and the sum
    over ranks (one all-reduce) is the full lookup."""

    def __init__(self, vocab: int, hidden: int, tp: TensorParallel) -> None:
        rows, self.vocab_start = _vocab_rows(tp, vocab)
        super().__init__(rows, hidden)
        self.tp, self.full_vocab = tp, vocab
        declare_shards(self, weight=ShardSpec(0, ((self.vocab_start, rows),), rank=tp.rank))

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        # ids: [T] -> [T, hidden] (* scale, after the sum over ranks, as the lookup would)
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        out = F.embedding(torch.where(inside, local, 0), self.weight)
        out = self.tp.all_reduce(torch.where(inside[:, None], out, 0))
        return out if scale == 1.0 else out * scale


class VocabParallelHead(nn.Linear):
    """lm_head over this rank's vocabulary rows: logits [n, vocab] gathered on rank 0."""

    def __init__(self, hidden: int, vocab: int, tp: TensorParallel) -> None:
        rows, start = _vocab_rows(tp, vocab)
        super().__init__(hidden, rows, bias=False)
        self.tp, self.full_vocab = tp, vocab
        declare_shards(self, weight=ShardSpec(0, ((start, rows),), rank=tp.rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> rank 0: [n, vocab]; other ranks: their [n, rows]
        return self.tp.gather_last_dim(super().forward(x), self.full_vocab)


class Embedding(nn.Embedding):
    """nn.Embedding whose lookup (and an optional scale, a family's embedding multiplier) is one
    native kernel call on the CPU, so that a decode step stays capturable."""

    def forward(self, ids: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        # ids: [T] -> [T, hidden]; the product rounded to the weight's dtype, as `* scale`
        weight = self.weight
        if native_embedding_fits(ids, weight):
            chain = EMBEDDING.of(weight)
        else:
            chain = EMBEDDING.chain(weight.device, weight.dtype, ("native",))
        return chain.first(ids, weight, scale)


def native_embedding_fits(ids: torch.Tensor, weight: torch.Tensor) -> bool:
    """The native lookup's rule: ids [T] int64 and a contiguous weight [rows, hidden], both on
    the CPU (the weight's dtype: the family's)."""
    return (
        ids.dim() == 1 and ids.dtype == torch.int64 and ids.device.type == "cpu"
        and weight.dim() == 2 and weight.is_contiguous() and weight.device.type == "cpu"
    )  # fmt: skip


def torch_embedding(ids: torch.Tensor, weight: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    out = F.embedding(ids, weight)
    return out if scale == 1.0 else out * scale


def vocab_embedding(vocab: int, hidden: int) -> nn.Embedding:
    tp = current()
    if tp.size == 1:
        return Embedding(vocab, hidden)
    return VocabParallelEmbedding(vocab, hidden, tp)


def vocab_head(hidden: int, vocab: int) -> nn.Linear:
    tp = current()
    if tp.size == 1:
        return nn.Linear(hidden, vocab, bias=False)
    return VocabParallelHead(hidden, vocab, tp)
