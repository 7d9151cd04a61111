"""Depthwise causal conv1d with a paged running state, over a packed ragged batch.

A Mamba2 mixer convolves each channel over time with a short kernel of width K (d_conv, usually
4). Between steps a request keeps its last K-1 *inputs* per channel in one page of the state
cache, `conv_state: [num_pages, channels, K-1]`. A step sees each request's
`[state columns | new tokens]` and writes the new last K-1 inputs back:

    request s, K = 4, 2 new tokens a b, state [p q r]:
    extended row:  p q r a b        outputs at a (p q r a) and b (q r a b)
    new state:     r a b            (fewer than K-1 new tokens keep old columns)

Prefill: requests are packed as `[state_0 | tokens_0 | state_1 | tokens_1 | ...]` and one
`F.conv1d` without padding runs over the whole packed row; every output window of a token lies
inside its own request's segment, so nothing leaks between requests and no per-request padding is
needed. Decode (every request has exactly one token): a direct `[S, C, K]` multiply-sum.

This is the PyTorch reference. The native CPU kernel (`hybridkv.ops.native.ssm.conv1d`) and the
Triton decode kernel (`hybridkv.ops.triton_mamba.conv1d_decode`) are tested against it; which one
a model runs is the plan's choice (`hybridkv.ops.mamba2_ops`), never tried in turn here.

A request without an initial state starts from zeros; its page may hold NaN bit patterns, so
the old state is selected with `torch.where`, never multiplied by zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# History columns (K - 1) per channel the native conv keeps (HKV_CONV_MAX_HISTORY in the native
# kernels.c; `hybridkv.ops.native.ssm` reads it from here): a layer with a wider kernel runs the
# PyTorch ops. Here, so that the layers read it without importing the native package.
CONV_MAX_HISTORY = 8


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unsupported conv1d activation {activation!r} (expected 'silu' or None)")


def _initial_conv_state(
    conv_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Each request's old K-1 input columns, zeros where it has none -> [S, C, K-1]."""
    old = conv_state.index_select(0, state_pages).to(dtype)  # [S, C, K-1]
    if bool(has_initial_state.all()):  # the usual decode step: nothing to select away
        return old
    zero = torch.zeros((), dtype=dtype, device=old.device)
    return torch.where(has_initial_state[:, None, None], old, zero)


def causal_conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per request. x: [S, C] (token s belongs to request s) -> [S, C]."""
    dtype = weight.dtype
    old = _initial_conv_state(conv_state, state_pages, has_initial_state, dtype)  # [S, C, K-1]
    window = torch.cat([old, x.to(dtype)[:, :, None]], dim=-1)  # [S, C, K]
    y = (window * weight[None]).sum(-1)  # [S, C]
    if bias is not None:
        y = y + bias
    conv_state.index_copy_(0, state_pages, window[:, :, 1:].to(conv_state.dtype))
    return _activate(y, activation).to(x.dtype)


def is_decode(max_query_len: int, num_tokens: int, state_pages: torch.Tensor) -> bool:
    """One token per request (token s belongs to request s): the decode kernels' case."""
    return max_query_len == 1 and num_tokens == state_pages.shape[0]


def activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    """The activation after the conv (None or silu), as the decoders apply it."""
    return _activate(y, activation)


def _packed_layout(
    query_start_loc: torch.Tensor, num_tokens: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Positions in the packed `[state_s | tokens_s]*` row (each state is `width` columns).

    Returns token_pos [T] (where token t sits), state_pos [S, width] (where request s's old
    state columns sit) and tail_pos [S, width] (its last `width` columns: the new state).
    """
    device = query_start_loc.device
    starts = query_start_loc[:-1].long()  # [S]
    ends = query_start_loc[1:].long()  # [S]
    num_seqs = starts.shape[0]
    q_lens = ends - starts
    seqs = torch.arange(num_seqs, device=device)
    seq_of_token = torch.repeat_interleave(seqs, q_lens, output_size=num_tokens)  # [T]
    # token t of request s sits after s+1 state blocks
    token_pos = torch.arange(num_tokens, device=device) + (seq_of_token + 1) * width
    cols = torch.arange(width, device=device)
    state_pos = (starts + seqs * width)[:, None] + cols  # [S, width]
    tail_pos = (ends + (seqs + 1) * width - width)[:, None] + cols  # [S, width]
    return token_pos, state_pos, tail_pos


def causal_conv1d_varlen(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Causal depthwise conv of packed requests, reading and updating their paged state.

    x: [T, C]; weight: [C, K]; bias: [C] or None; conv_state: [num_pages, C, K-1] (written in
    place at `state_pages`); state_pages: [S] int64; has_initial_state: [S] bool;
    query_start_loc: [S+1] int32  ->  [T, C] in x.dtype (computed in weight.dtype).
    """
    num_tokens, channels = x.shape
    width = weight.shape[1] - 1
    if num_tokens == 0:
        return x.new_empty(x.shape)
    if is_decode(max_query_len, num_tokens, state_pages):
        return causal_conv1d_decode(
            x, weight, bias, conv_state, state_pages, has_initial_state, activation
        )
    dtype = weight.dtype
    num_seqs = state_pages.shape[0]
    token_pos, state_pos, tail_pos = _packed_layout(query_start_loc, num_tokens, width)

    # Phase 1: the packed row [C, T + S*(K-1)] holding every request's old state and tokens.
    old = _initial_conv_state(conv_state, state_pages, has_initial_state, dtype)  # [S, C, K-1]
    packed = x.new_empty(num_tokens + num_seqs * width, channels, dtype=dtype)
    packed[token_pos] = x.to(dtype)
    packed[state_pos.reshape(-1)] = old.transpose(1, 2).reshape(-1, channels)

    # Phase 2: one depthwise conv without padding; output j covers packed[j : j + K].
    # Token t's window ends at token_pos[t], so it starts at token_pos[t] - (K-1).
    out = F.conv1d(packed.t()[None], weight[:, None, :], bias, groups=channels)[0]  # [C, L-K+1]
    y = out.t()[token_pos - width]  # [T, C]

    # Phase 3: the last K-1 packed columns of each request are its new state.
    new_state = packed[tail_pos]  # [S, K-1, C]
    conv_state.index_copy_(0, state_pages, new_state.transpose(1, 2).to(conv_state.dtype))
    return _activate(y, activation).to(x.dtype)
