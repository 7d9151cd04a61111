"""The per-request span arrays every state kernel takes (state pages, has-initial flags, first
token and token count of each request), converted from a step's state metadata once per step
and shared by the state layers of a group; the model runner can hand them in ready-made
(`provide_spans`). The checks that keep a kernel inside its tensors (`spans_inside`,
`spans_cover`) compare a few ints reduced once per step."""

from __future__ import annotations

from collections import OrderedDict

import torch

Spans = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# Step metadata `step_spans` converted recently, by the ids of its three tensors: every state layer
# of a group gets the same three tensors in a step, so the conversion runs once per group and
# step instead of once per kernel call (groups interleave by layer, hence one entry per group).
# The inputs are held (so their ids cannot be reused while cached) and, where they have one,
# their version checked (an in-place change recomputes); the step metadata the engine builds is
# made in inference mode (no version counter) and never written after. The oldest entries go
# first (a step's own groups are always the newest, whatever came before them).
_SPANS_KEPT = 64
_recent_spans: OrderedDict[tuple[int, ...], tuple[tuple[torch.Tensor, ...], tuple[int, ...], Spans]]
_recent_spans = OrderedDict()
_span_bounds: dict[tuple[int, ...], tuple[int, int, int, int, int]] = {}  # by the same keys


def _keep_spans(key: tuple[int, ...], entry: tuple) -> None:
    """Remember a step's converted spans, dropping the oldest beyond _SPANS_KEPT."""
    _recent_spans[key] = entry
    _recent_spans.move_to_end(key)
    while len(_recent_spans) > _SPANS_KEPT:
        old, _ = _recent_spans.popitem(last=False)
        _span_bounds.pop(old, None)


def step_spans(
    state_pages: torch.Tensor, has_initial_state: torch.Tensor, query_start_loc: torch.Tensor
) -> Spans:
    """The per-request arrays the state kernels take: pages, has-initial flags (uint8), first
    token and token count, all contiguous int64 except the flags."""
    inputs = (state_pages, has_initial_state, query_start_loc)
    key = tuple(id(t) for t in inputs)
    versions = tuple(-1 if t.is_inference() else t._version for t in inputs)
    hit = _recent_spans.get(key)
    if hit is not None and hit[1] == versions:
        return hit[2]
    bounds = query_start_loc.to(torch.int64)
    spans = (
        state_pages.to(torch.int64).contiguous(),
        has_initial_state.to(torch.uint8).contiguous(),
        bounds[:-1].contiguous(),
        (bounds[1:] - bounds[:-1]).contiguous(),
    )
    _span_bounds.pop(key, None)
    _keep_spans(key, (inputs, versions, spans))
    return spans


def provide_spans(
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    spans: Spans,
    bounds: tuple[int, int, int, int, int],
) -> None:
    """Hand the state kernels a step's spans converted by the caller (the model runner builds
    them in NumPy with the step): `step_spans` and `spans_inside` then find them instead of
    converting the metadata with tensor ops. bounds: (min page, max page, min request length,
    first token, end of the last request), as `_span_bounds_of` computes them."""
    inputs = (state_pages, has_initial_state, query_start_loc)
    key = tuple(id(t) for t in inputs)
    versions = tuple(-1 if t.is_inference() else t._version for t in inputs)
    _span_bounds[key] = bounds
    _keep_spans(key, (inputs, versions, spans))


def _span_bounds_of(
    state_pages: torch.Tensor, has_initial_state: torch.Tensor, query_start_loc: torch.Tensor
) -> tuple[int, int, int, int, int] | None:
    """(min page, max page, min request length, first token, end of the last request) of a
    step's spans, reduced once per metadata as `step_spans` converts it; None when the metadata
    is inconsistent (pages and requests of different counts)."""
    pages, _, starts, lens = step_spans(state_pages, has_initial_state, query_start_loc)
    key = tuple(id(t) for t in (state_pages, has_initial_state, query_start_loc))
    bounds = _span_bounds.get(key)
    if bounds is None:
        if pages.shape[0] != lens.shape[0]:
            return None
        if pages.numel() == 0:
            bounds = (0, -1, 0, 0, 0)
        else:
            bounds = (
                int(pages.min()), int(pages.max()), int(lens.min()), int(starts.min()),
                int((starts + lens).max()),
            )  # fmt: skip
        if key in _recent_spans:
            _span_bounds[key] = bounds
    return bounds


def spans_inside(
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_pages: int,
    num_tokens: int,
) -> bool:
    """Whether every request's page lies in [0, num_pages) and its tokens in [0, num_tokens)
    (a kernel would read and write out of bounds otherwise); a kernel call compares five ints
    (`_span_bounds_of`)."""
    bounds = _span_bounds_of(state_pages, has_initial_state, query_start_loc)
    if bounds is None:
        return False
    page_min, page_max, len_min, first, end = bounds
    return (
        page_min >= 0 and page_max < num_pages and len_min >= 0 and first >= 0 and end <= num_tokens
    )


def spans_cover(
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
) -> bool:
    """Whether the requests' tokens are all of [0, num_tokens) (spans of query_start_loc from
    0 to num_tokens): a kernel then writes every row of its output."""
    bounds = _span_bounds_of(state_pages, has_initial_state, query_start_loc)
    return bounds is not None and bounds[3] == 0 and bounds[4] == num_tokens
