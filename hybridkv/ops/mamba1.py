"""Mamba1 selective scan over a packed ragged batch with a paged running state (PyTorch).

Mamba1 (Mamba, FalconMamba, Jamba) keeps one state row of N numbers per inner channel d, and,
unlike Mamba2, its decay differs for every (d, n): A is a full [Di, N] matrix. Per request and
token t, with delta = softplus(dt_t + dt_bias):

    h_t = exp(delta_t[:, None] * A) * h_{t-1} + (delta_t * x_t)[:, None] * B_t[None, :]
    y_t = (h_t @ C_t + D * x_t) * silu(z_t)                         h: [Di, N]

Each request's h lives in one page of `ssm_state: [num_pages, Di, N]`; a request without an
initial state starts from zeros (its page may hold NaN bit patterns: selected away with `where`,
never multiplied by zero); a request with no tokens leaves its page untouched.

As the decay is per (d, n), Mamba2's chunked matrix form does not apply (it would need
[L, L, Di, N] decays per chunk). This reference walks the tokens: one-token requests (decode)
take a single batched step; longer requests are laid out in a padded `[R, L]` grid (padding has
delta = 0 and x = 0, which leaves a state exactly as it was) and advanced one token index at a
time, all of them at once. It is the reference the native and Triton kernels are tested against,
and the prefill path of the Triton ops.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from hybridkv.ops.mamba2 import _split_by_length

# A kernel for one-token requests: (ssm_state, state_pages, has_initial_state, x, dt, A, B, C,
# D, z, dt_bias) -> y [R, Di] float32, with the signature of
# `hybridkv.ops.triton_mamba1.mamba1_decode` (dt raw; D, z, dt_bias may be None).
DecodeRows = Callable[..., torch.Tensor]


def _initial_state(
    ssm_state: torch.Tensor, state_pages: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """Each request's running state, zeros where it has none -> float32 [S, Di, N]."""
    old = ssm_state.index_select(0, state_pages).float()
    if bool(has_initial_state.all()):  # the usual decode step: nothing to select away
        return old
    zero = torch.zeros((), dtype=torch.float32, device=old.device)
    return torch.where(has_initial_state[:, None, None], old, zero)


def process_dt(dt: torch.Tensor, dt_bias: torch.Tensor | None) -> torch.Tensor:
    """Raw dt [T, Di] -> softplus(dt + dt_bias) in float32 [T, Di]."""
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    return F.softplus(dt)


def mamba1_step(
    h: torch.Tensor,
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
) -> torch.Tensor:
    """One token of R requests, float32, in place: h [R, Di, N] is advanced and h @ C returned.

    x, delta: [R, Di]; A: [Di, N]; B, C: [R, N] -> [R, Di] (without the D and z terms).
    """
    h.mul_(torch.exp(delta[:, :, None] * A))
    h.add_((delta * x)[:, :, None] * B[:, None, :])
    return torch.bmm(h, C[:, :, None])[:, :, 0]


def _finish(
    y: torch.Tensor, x: torch.Tensor, D: torch.Tensor | None, z: torch.Tensor | None
) -> torch.Tensor:
    """y [.., Di] float32 -> (y + D * x) * silu(z), float32."""
    if D is not None:
        y = y + D.float() * x
    if z is not None:
        y = y * F.silu(z.float())
    return y


def _grid(
    starts: torch.Tensor, lens: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token index of every (request, position) cell of the padded [R, width] grid, and the
    cells that hold a token. starts, lens: [R] int64 (lens <= width)."""
    pos = torch.arange(width, device=starts.device)
    valid = pos[None, :] < lens[:, None]  # [R, width]
    tok = torch.where(valid, starts[:, None] + pos[None, :], torch.zeros_like(starts)[:, None])
    return tok, valid


def _scan_long(
    x: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    h: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Requests of several tokens, all advanced one position at a time (float32).

    x, delta: [T, Di]; B, C: [T, N]; h: [R, Di, N] (the caller's copy, advanced in place);
    starts, lens: [R]; width >= lens.max() -> (token indices [n], their h @ C [n, Di]) for the
    n tokens of these requests.
    """
    tok, valid = _grid(starts, lens, width)  # [R, W]
    zero = torch.zeros((), dtype=torch.float32, device=x.device)
    x_g = torch.where(valid[..., None], x[tok], zero)  # [R, W, Di]; padding: x = 0
    d_g = torch.where(valid[..., None], delta[tok], zero)  # padding: delta = 0, decay 1
    B_g, C_g = B[tok], C[tok]  # [R, W, N]
    out = torch.empty_like(x_g)
    for j in range(width):
        out[:, j] = mamba1_step(h, x_g[:, j], d_g[:, j], A, B_g[:, j], C_g[:, j])
    return tok[valid], out[valid]


def mamba1_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    out_dtype: torch.dtype = torch.float32,
    decode_rows: DecodeRows | None = None,
) -> torch.Tensor:
    """Mamba1 scan of packed requests, reading and updating their paged state, in float32.

    x, dt, z: [T, Di] (rows may be strided views; dt raw, before softplus; z None: no gate);
    A: [Di, N] float32 (negative, -exp(A_log)); B, C: [T, N]; D, dt_bias: [Di] or None;
    ssm_state: [num_pages, Di, N] float32 or bfloat16, written in place at `state_pages`;
    state_pages: [S] int64; has_initial_state: [S] bool; query_start_loc: [S + 1] int32;
    max_query_len: longest request (an upper bound works) -> y [T, Di] in `out_dtype`.
    `decode_rows` steps the one-token requests instead of the PyTorch step (the Triton kernel
    on GPUs; all of the step, fused, when every request has one token).
    """
    num_tokens, channels = x.shape
    y = torch.zeros(num_tokens, channels, dtype=torch.float32, device=x.device)
    if num_tokens == 0 or state_pages.shape[0] == 0:
        return y.to(out_dtype)
    if decode_rows is not None and max_query_len == 1 and num_tokens == state_pages.shape[0]:
        y = decode_rows(
            ssm_state, state_pages, has_initial_state, x, dt, A, B, C, D, z, dt_bias
        )  # token s: request s
        return y.to(out_dtype)
    xf, Bf, Cf, Af = x.float(), B.float(), C.float(), A.float()
    delta = process_dt(dt, dt_bias)  # [T, Di]
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    dec, pre = _split_by_length(lens)  # zero-length requests are in neither: pages untouched
    if dec.numel() > 0:
        tok = starts[dec]
        pages, has = state_pages[dec], has_initial_state[dec]
        if decode_rows is not None:  # D and z are applied below, with the other tokens'
            y[tok] = decode_rows(ssm_state, pages, has, x[tok], dt[tok], Af, B[tok], C[tok],
                                 None, None, dt_bias)  # fmt: skip
        else:
            h = _initial_state(ssm_state, pages, has)
            y[tok] = mamba1_step(h, xf[tok], delta[tok], Af, Bf[tok], Cf[tok])
            ssm_state.index_copy_(0, pages, h.to(ssm_state.dtype))
    if pre.numel() > 0:
        h = _initial_state(ssm_state, state_pages[pre], has_initial_state[pre])
        width = min(max_query_len, num_tokens)
        tok, out = _scan_long(xf, delta, Af, Bf, Cf, h, starts[pre], lens[pre], width)
        y[tok] = out
        ssm_state.index_copy_(0, state_pages[pre], h.to(ssm_state.dtype))
    return _finish(y, xf, D, z).to(out_dtype)
