"""Per-position states for state ops written in PyTorch (and those that hand their one-token
requests to a Triton kernel): speculative decoding's verify steps keep the state after every
position of a speculating request (`StateMetadata.scratch_rows`), here by running such requests
one token at a time through the backend's own op, as decode steps.

    step of S requests     r0: prefill chunk    r1: verify [t d1 d2 d3]   r2: verify [t d1]
    1. the others at once: run(r0's tokens)                                          (as usual)
    2. position 0:                              run(t)  -> kept[row1, 0]  run(t) -> kept[row2, 0]
       position 1:                              run(d1) -> kept[row1, 1]  run(d1)  (its last)
       position 2:                              run(d2) -> kept[row1, 2]
       position 3:                              run(d3)  (its last: the page holds it)

Each position is one call of the op on a sub-batch of one-token requests, so the numbers are
the decode step's. The native kernels do the same inside C (hkv_mamba2_scan and the others).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from hybridkv.forward_batch import StateMetadata

# (the op's per-token inputs gathered for a sub-batch, its metadata) -> its outputs [tokens, ...]
RunOp = Callable[[Sequence[torch.Tensor | None], StateMetadata], torch.Tensor]


def run_keeping_positions(
    inputs: Sequence[torch.Tensor | None],
    meta: StateMetadata,
    state: torch.Tensor,
    kept: torch.Tensor,
    run: RunOp,
) -> torch.Tensor:
    """The op over the whole step, with the state after each token but the last of every
    request with a scratch row copied to kept[row, i]. inputs: per-token tensors [T, ...] (None
    passes through); state: [num_pages, *shape]; kept: [rows, positions, *shape]."""
    assert meta.scratch_rows is not None
    rows = meta.scratch_rows.tolist()
    bounds = meta.query_start_loc.tolist()
    starts, lens = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    verify = [s for s, n in enumerate(lens) if rows[s] >= 0 and n > 0]
    others = [s for s, n in enumerate(lens) if rows[s] < 0 and n > 0]
    outputs: list[tuple[list[int], torch.Tensor]] = []
    if others:
        tokens = [starts[s] + i for s in others for i in range(lens[s])]
        sub = _sub_meta(meta, others, [lens[s] for s in others], None)
        outputs.append((tokens, run(_gather(inputs, tokens), sub)))
    pages = meta.state_pages.tolist()
    for i in range(max((lens[s] for s in verify), default=0)):
        sel = [s for s in verify if lens[s] > i]
        tokens = [starts[s] + i for s in sel]
        sub = _sub_meta(meta, sel, [1] * len(sel), None if i == 0 else True)
        outputs.append((tokens, run(_gather(inputs, tokens), sub)))
        keep = [s for s in sel if i < lens[s] - 1]
        if keep:
            src = torch.tensor([pages[s] for s in keep], device=state.device)
            dst = torch.tensor([rows[s] for s in keep], device=kept.device)
            kept[dst, i] = state.index_select(0, src).to(kept.dtype)
    return _scatter(outputs, bounds[-1])


def _gather(inputs: Sequence[torch.Tensor | None], tokens: list[int]) -> list[torch.Tensor | None]:
    if not tokens:
        return list(inputs)
    index = None
    out: list[torch.Tensor | None] = []
    for t in inputs:
        if t is None:
            out.append(None)
            continue
        if index is None or index.device != t.device:
            index = torch.tensor(tokens, device=t.device)
        out.append(t.index_select(0, index))
    return out


def _sub_meta(
    meta: StateMetadata, requests: list[int], lens: list[int], has: bool | None
) -> StateMetadata:
    """The metadata of `requests` alone, with `lens` tokens each (packed in order); `has`:
    every one starts from its page (later positions), None: as in the step."""
    device = meta.state_pages.device
    index = torch.tensor(requests, device=device)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    has_initial = meta.has_initial_state.index_select(0, index.to(meta.has_initial_state.device))
    if has is not None:
        has_initial = torch.full_like(has_initial, has)
    return StateMetadata(
        state_pages=meta.state_pages.index_select(0, index),
        has_initial_state=has_initial,
        query_start_loc=qsl.to(meta.query_start_loc.device),
        max_query_len=max(lens),
    )


def _scatter(outputs: list[tuple[list[int], torch.Tensor]], num_tokens: int) -> torch.Tensor:
    """The sub-batches' outputs back at their tokens: [num_tokens, ...]."""
    first = outputs[0][1]
    out = first.new_zeros((num_tokens, *first.shape[1:]))
    for tokens, y in outputs:
        out[torch.tensor(tokens, device=y.device)] = y
    return out
