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

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from hybridkv.forward_batch import StateMetadata

# (the op's per-token inputs gathered for a sub-batch, its metadata) -> its outputs [tokens, ...]
RunOp = Callable[[Sequence[torch.Tensor | None], StateMetadata], torch.Tensor]


@dataclass(frozen=True)
class SubStep:
    """One call of the op: its tokens of the step ([n] index), its metadata, and where the
    states it leaves go (pages -> scratch rows, at `position`; None: nothing kept)."""

    tokens: torch.Tensor
    meta: StateMetadata
    position: int = -1
    keep: tuple[torch.Tensor, torch.Tensor] | None = None  # (pages [m], scratch rows [m])


# every state layer of a group gets the same metadata in a step: its sub-steps are worked out
# once (by the identity of the metadata, held while cached) and shared by the layers
_SCHEDULES_KEPT = 16
_schedules: OrderedDict[int, tuple[StateMetadata, tuple[SubStep, ...]]] = OrderedDict()


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
    outputs = []
    for sub in schedule(meta):
        gathered = [None if t is None else t.index_select(0, sub.tokens) for t in inputs]
        outputs.append((sub.tokens, run(gathered, sub.meta)))
        if sub.keep is not None:
            pages, rows = sub.keep
            kept[rows, sub.position] = state.index_select(0, pages).to(kept.dtype)
    first = outputs[0][1]
    num_tokens = next(t for t in inputs if t is not None).shape[0]
    out = first.new_zeros((num_tokens, *first.shape[1:]))
    for tokens, y in outputs:
        out[tokens] = y
    return out


def schedule(meta: StateMetadata) -> tuple[SubStep, ...]:
    """The step's sub-steps: the requests without a scratch row at once, then each position of
    the speculating ones as one-token requests (module docstring)."""
    hit = _schedules.get(id(meta))
    if hit is not None and hit[0] is meta:
        return hit[1]
    subs = _work_out(meta)
    _schedules[id(meta)] = (meta, subs)
    while len(_schedules) > _SCHEDULES_KEPT:
        _schedules.popitem(last=False)
    return subs


def _work_out(meta: StateMetadata) -> tuple[SubStep, ...]:
    assert meta.scratch_rows is not None
    device = meta.state_pages.device
    rows = meta.scratch_rows.tolist()
    pages = meta.state_pages.tolist()
    bounds = meta.query_start_loc.tolist()
    starts, lens = bounds[:-1], [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    verify = [s for s, n in enumerate(lens) if rows[s] >= 0 and n > 0]
    others = [s for s, n in enumerate(lens) if rows[s] < 0 and n > 0]

    def index(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    subs = []
    if others:
        tokens = [starts[s] + i for s in others for i in range(lens[s])]
        subs.append(SubStep(index(tokens), _sub_meta(meta, others, [lens[s] for s in others])))
    for i in range(max((lens[s] for s in verify), default=0)):
        sel = [s for s in verify if lens[s] > i]
        keep = [s for s in sel if i < lens[s] - 1]
        subs.append(SubStep(
            index([starts[s] + i for s in sel]),
            _sub_meta(meta, sel, [1] * len(sel), None if i == 0 else True),
            i,
            (index([pages[s] for s in keep]), index([rows[s] for s in keep])) if keep else None,
        ))  # fmt: skip
    return tuple(subs)


def _sub_meta(
    meta: StateMetadata, requests: list[int], lens: list[int], has: bool | None = None
) -> StateMetadata:
    """The metadata of `requests` alone, with `lens` tokens each (packed in order); `has`:
    every one starts from its page (later positions), None: as in the step."""
    device = meta.state_pages.device
    index = torch.tensor(requests, device=device)
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    has_initial = meta.has_initial_state.index_select(0, index.to(meta.has_initial_state.device))
    if has is not None:
        has_initial = torch.full_like(has_initial, has)
    return StateMetadata(
        state_pages=meta.state_pages.index_select(0, index),
        has_initial_state=has_initial,
        query_start_loc=torch.tensor(bounds, dtype=torch.int32, device=device),
        max_query_len=max(lens),
    )
