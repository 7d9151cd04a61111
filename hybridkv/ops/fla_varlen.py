"""The routing every `fla` state ops class shares (`gdn_ops.FlaGDNOps`, `kda_ops.FlaKdaOps`):
a step's requests longer than one token through one call of a flash-linear-attention varlen
chunked kernel behind hybridkv's paging, its one-token requests through the base class's rule
(hybridkv's Triton decode kernel, which reads and writes each state in its page).

    step (T tokens)   | r0 r0 r0 | r1 | r2 r2 |          r1: one token
    r1                -> base rule(rows of r1, one-token sub-metadata)
    r0, r2            -> packed [1, n, ...] (n = 5), cu_seqlens [0, 3, 5]
                         h0 = their pages, zeros where a request has no state: float32
                         [N, H, K, V]; o, ht = fla_chunk(packed, h0, cu_seqlens);
                         ht -> their pages, o -> their rows of the step's output

A subclass names the kernel (`fla_chunk`, which maps hybridkv's rule inputs onto fla's
arguments: its docstring gives the mapping); fla is imported there, at the first prefill, so
this module and the classes import without it.
"""

from __future__ import annotations

import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.ops.gated_delta import _initial_state
from hybridkv.ops.mamba2 import _split_by_length, packed_tokens


class FlaPrefill:
    """Mixin before a state ops class whose `rule(q, k, v, g, beta, state, meta, positions)`
    returns o [T, H, V] float32 and updates `state` [num_pages, H, K, V] in place (the GDN and
    KDA ops): prefill requests through `fla_chunk`, the rest through that class's rule."""

    @staticmethod
    def fla_chunk(
        inputs: tuple[torch.Tensor, ...], h0: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """fla's varlen kernel: inputs q, k, v, g, beta of the packed requests, each [1, n, ...]
        (as the rule takes them); h0 [N, H, K, V] float32; cu_seqlens [N + 1] int64 -> (o
        [1, n, H, V] in q's dtype, final states [N, H, K, V] float32)."""
        raise NotImplementedError

    def rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        meta: StateMetadata,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As the base class's rule; requests longer than one token go through fla. A verify
        step (`positions`: states kept per position) and a decode step go to the base class."""
        if positions is not None or meta.max_query_len == 1:
            return super().rule(q, k, v, g, beta, state, meta, positions)  # type: ignore[misc]
        starts = meta.query_start_loc[:-1].long()
        lens = meta.query_start_loc[1:].long() - starts
        dec, pre = _split_by_length(lens)  # (host sync: their counts size fla's grid)
        out = torch.empty(q.shape[0], v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
        inputs = (q, k, v, g, beta)
        if dec.numel() > 0:
            self._decode(inputs, state, meta, starts[dec], dec, out)
        if pre.numel() > 0:
            self._prefill(inputs, state, meta, starts[pre], lens[pre], pre, out)
        return out

    def _decode(
        self,
        inputs: tuple[torch.Tensor, ...],
        state: torch.Tensor,
        meta: StateMetadata,
        tok: torch.Tensor,
        dec: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The one-token requests `dec` (tok [R]: their tokens) through the base class's rule as
        one decode step, their rows of `out` written."""
        one = torch.arange(dec.numel() + 1, dtype=torch.int32, device=tok.device)
        sub = StateMetadata(meta.state_pages[dec], meta.has_initial_state[dec], one, 1)
        rows = (t[tok] for t in inputs)
        out[tok] = super().rule(*rows, state, sub)  # type: ignore[misc]

    def _prefill(
        self,
        inputs: tuple[torch.Tensor, ...],
        state: torch.Tensor,
        meta: StateMetadata,
        starts: torch.Tensor,
        lens: torch.Tensor,
        pre: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """The requests `pre` (starts, lens [N]: theirs) through `fla_chunk`, their rows of `out`
        written: initial states gathered from their pages (zeros where none), final ones
        written back."""
        n_tok = int(lens.sum())
        _, _, tok = packed_tokens(starts, lens, n_tok)  # [n] their tokens in the batch
        packed = tuple(t.index_select(0, tok)[None] for t in inputs)  # [1, n, ...]
        cu = torch.zeros(lens.numel() + 1, dtype=torch.long, device=tok.device)
        torch.cumsum(lens, 0, out=cu[1:])  # fla's cu_seqlens
        pages = meta.state_pages[pre]
        h0 = _initial_state(state, pages, meta.has_initial_state[pre])  # float32 copy
        o, ht = self.fla_chunk(packed, h0, cu)
        state.index_copy_(0, pages, ht.to(state.dtype))
        out[tok] = o[0].float()
