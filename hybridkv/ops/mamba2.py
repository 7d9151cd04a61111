"""Mamba2 selective state-space scan over a packed ragged batch with a paged running state.

Per request, with dt = clamp(softplus(dt_raw + dt_bias), dt_limit) and heads sharing the B/C of
their group (H/G heads per group):

    h_t = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t        h: [H, P, N]
    y_t = C_t . h_t + D * x_t

Each request's h lives in one page of `ssm_state: [num_pages, H, P, N]`; a request without an
initial state starts from zeros (its page may hold NaN bit patterns: selected away with `where`).

Two paths, both computed in float32:

- decode (every request has one token): the one-step recurrence above, batched over requests.
- prefill / mixed batches: the chunked "SSD" form (Mamba2 paper, section 6). Requests with one
  token still take the one-step path; the others are cut into *request-aligned* chunks of
  `L = min(chunk_size, longest prompt)` tokens (the last chunk of a request is padded with
  dt = 0, which leaves the state unchanged). All chunks of all requests are packed into one
  `[num_chunks, L, ...]` tensor; inside a chunk the output is a masked quadratic form, across
  chunks a short loop (one iteration per chunk index, all requests at once) carries the state.

    request 0: 5 tokens, request 1: 2 tokens, L = 4
    chunks:    [r0 t0..t3] [r0 t4 pad pad pad] [r1 t0 t1 pad pad]
    state loop j=0: chunks 0 and 2 start from h0; j=1: chunk 1 starts from chunk 0's end state
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

# A kernel for one-token requests: (ssm_state, state_pages, has_initial_state, x, dt, A, B, C,
# D) -> y, with the signature of `hybridkv.ops.triton_mamba.ssm_decode`.
DecodeRows = Callable[..., torch.Tensor]


def _process_dt(
    dt: torch.Tensor, dt_bias: torch.Tensor, dt_limit: tuple[float, float]
) -> torch.Tensor:
    """Raw dt [T, H] -> clamp(softplus(dt + dt_bias), dt_limit) in float32 [T, H]."""
    dt = F.softplus(dt.float() + dt_bias.float())
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def _initial_ssm_state(
    ssm_state: torch.Tensor, state_pages: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """Each request's running state, zeros where it has none -> float32 [S, H, P, N]."""
    old = ssm_state.index_select(0, state_pages).float()
    if bool(has_initial_state.all()):  # the usual decode step: nothing to select away
        return old
    zero = torch.zeros((), dtype=torch.float32, device=old.device)
    return torch.where(has_initial_state[:, None, None, None], old, zero)


def ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One recurrent step for R requests (float32, dt already processed).

    x: [R, H, P]; dt: [R, H]; A, D: [H]; B, C: [R, G, N]; h0: [R, H, P, N] (a float32 copy the
    caller owns: it is updated in place and returned) -> y [R, H, P], h [R, H, P, N]

        h = exp(dt * A) * h0 + (dt * x) outer B        y = h . C + D * x

    Done as one in-place scale and two batched matmuls, so the large state is read and written
    a minimum number of times (decode is memory bound). The heads of a group share B and C, so
    the matmuls batch over [R * G] matrices of [hpg * P, N] (large, few: the read-out runs as
    C^T h^T, which the BLAS does about 6x faster than [R * H] tiny matrix-vector products).
    """
    num, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    rows = heads // groups * head_dim  # hpg * P state rows per group
    h0.mul_(torch.exp(dt * A)[:, :, None, None])
    h = h0.view(num * groups, rows, d_state)
    xdt = (x * dt[..., None]).reshape(num * groups, rows, 1)
    h.baddbmm_(xdt, B.reshape(num * groups, 1, d_state))  # h += (dt * x) outer B
    # y: [R * G, 1, N] @ [R * G, N, rows] -> [R * G, 1, rows]
    y = torch.bmm(C.reshape(num * groups, 1, d_state), h.transpose(1, 2))
    y = y.view(num, heads, head_dim) + D[:, None] * x
    return y, h.view(num, heads, head_dim, d_state)


def packed_tokens(
    starts: torch.Tensor, lens: torch.Tensor, n_tok: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tokens of some requests of a step, one request after another: starts, lens [R]
    int64 (n_tok == lens.sum()) -> (request of each token [n], its position in the request
    [n], its index in the step's batch [n]).

        batch    | r0 r0 r0 | r1 | r2 r2 |        requests r0, r2 chosen
        tok      [0  1  2        4  5]            their tokens, packed: index in the batch
        pos      [0  1  2        0  1]
    """
    reqs = torch.arange(lens.shape[0], device=starts.device)
    req_of_tok = torch.repeat_interleave(reqs, lens, output_size=n_tok)  # [n]
    pos = torch.arange(n_tok, device=starts.device) - (torch.cumsum(lens, 0) - lens)[req_of_tok]
    return req_of_tok, pos, starts[req_of_tok] + pos


class _ChunkLayout:
    """Where each token of the chunked requests sits in the packed `[num_chunks, L]` grid."""

    def __init__(
        self, starts: torch.Tensor, lens: torch.Tensor, chunk_len: int, n_tok: int, max_len: int
    ):
        # starts, lens: [R] int64 (every lens >= 1); n_tok == lens.sum(); max_len >= lens.max()
        self.chunk_len = chunk_len
        self.max_chunks = -(-max_len // chunk_len)  # chunks of the longest request
        self.n_chunks = (lens + chunk_len - 1) // chunk_len  # [R]
        self.first_chunk = torch.cumsum(self.n_chunks, 0) - self.n_chunks  # [R]
        # One host sync: the chunk count sizes the packed buffers.
        self.num_chunks = int(self.n_chunks.sum())
        req_of_tok, i, self.tok = packed_tokens(starts, lens, n_tok)  # [n] each
        self.chunk_of_tok = self.first_chunk[req_of_tok] + torch.div(
            i, chunk_len, rounding_mode="floor"
        )
        self.offset = i % chunk_len  # [n]

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """Token tensor t: [T, ...] -> [num_chunks, L, ...], zeros in the padding."""
        out = t.new_zeros(self.num_chunks, self.chunk_len, *t.shape[1:])
        out[self.chunk_of_tok, self.offset] = t[self.tok]
        return out

    def unpack(self, c: torch.Tensor) -> torch.Tensor:
        """[num_chunks, L, ...] -> [n, ...] in the order of `self.tok`."""
        return c[self.chunk_of_tok, self.offset]


# Log-decays below this are clamped before `exp`: e^-80 (about 2e-35) is already far below the
# float32 resolution of the terms that survive next to it (every output has a term of decay 1),
# and x86 computes `exp` about 10x slower when the result underflows to a denormal or zero.
_MIN_LOG_DECAY = -80.0


def _exp_decay(log_decay: torch.Tensor) -> torch.Tensor:
    """exp of a log-decay (<= 0), without the denormal slow path."""
    return log_decay.clamp(min=_MIN_LOG_DECAY).exp_()


def _segsum_exp(dA: torch.Tensor) -> torch.Tensor:
    """Decay between positions of a chunk: [c, L, H] -> [c, H, L(target l), L(source s)].

    out[l, s] = exp(sum of dA over (s, l]) for l >= s, else 0. Summing masked values (instead
    of subtracting two cumulative sums) keeps it accurate when the cumulative sum is large.
    """
    a = dA.permute(0, 2, 1)  # [c, H, L]
    length = a.shape[-1]
    rows = a[..., :, None].expand(*a.shape, length)  # [c, H, k, s] = a[k]
    ones = torch.ones(length, length, dtype=torch.bool, device=a.device)
    strict = torch.tril(ones, diagonal=-1)  # k > s
    seg = torch.where(strict, rows, torch.zeros((), dtype=a.dtype, device=a.device))
    seg = seg.cumsum(dim=-2)  # [c, H, l, s] = sum_{s < k <= l} a[k]
    # above the diagonal seg is 0 (exp 1): select those away
    zero = torch.zeros((), dtype=a.dtype, device=a.device)
    return torch.where(torch.tril(ones), _exp_decay(seg), zero)


def _intra_chunk(
    xdt: torch.Tensor, dA: torch.Tensor, B: torch.Tensor, C: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-chunk work that needs no state from earlier chunks.

    xdt: [c, L, H, P] (x * dt); dA: [c, L, H]; B, C: [c, L, G, N]
    -> y_diag [c, L, H, P] (output from this chunk's own tokens), chunk_states [c, H, P, N]
       (state at the chunk end starting from zero), a_cum [c, L, H] (cumulative log decay).
    """
    nc, length, heads, head_dim = xdt.shape
    groups, d_state = B.shape[2], B.shape[3]
    hpg = heads // groups
    xdt_g = xdt.view(nc, length, groups, hpg, head_dim)  # [c, L, G, hpg, P]
    # Diagonal blocks: y[l] = sum_{s <= l} (C_l . B_s) decay(s -> l) xdt_s
    cb = torch.einsum("clgn,csgn->cgls", C, B)  # [c, G, L, L]
    decay = _segsum_exp(dA).view(nc, groups, hpg, length, length)  # [c, G, hpg, L, L]
    scores = cb[:, :, None] * decay  # [c, G, hpg, L, L]
    y_diag = torch.einsum("cgjls,csgjp->clgjp", scores, xdt_g).reshape(xdt.shape)
    # Chunk states: sum_l decay(l -> end) xdt_l (outer) B_l
    a_cum = torch.cumsum(dA, dim=1)  # [c, L, H]
    to_end = _exp_decay(a_cum[:, -1:] - a_cum).view(nc, length, groups, hpg, 1)
    states = torch.einsum("clgn,clgjp->cgjpn", B, xdt_g * to_end)
    return y_diag, states.reshape(nc, heads, head_dim, d_state), a_cum


def _pass_states(
    chunk_states: torch.Tensor, chunk_decay: torch.Tensor, h0: torch.Tensor, layout: _ChunkLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry the state across each request's chunks.

    chunk_states: [c, H, P, N]; chunk_decay: [c, H] (exp of the chunk's total log decay);
    h0: [R, H, P, N] (a copy the caller owns: updated in place) -> start state of every chunk
    [c, H, P, N], final state [R, H, P, N].
    Loops over the chunk index j (not over requests): iteration j advances every request that
    has a j-th chunk; the others keep their state.
    """
    start = torch.empty_like(chunk_states)
    running = h0  # [R, H, P, N]: the caller's own copy, advanced in place
    for j in range(layout.max_chunks):
        # requests with a j-th chunk; all of them while j is below the shortest request
        act = torch.nonzero(layout.n_chunks > j).squeeze(1)  # [r] (host sync: sizes)
        every = act.numel() == running.shape[0]
        cidx = layout.first_chunk[act] + j  # [r] their j-th chunks
        # index_select / index_copy_ copy whole [H, P, N] slices (index_put goes element-wise)
        cur = running if every else running.index_select(0, act)
        start.index_copy_(0, cidx, cur)
        nxt = cur * chunk_decay.index_select(0, cidx)[:, :, None, None]
        nxt += chunk_states.index_select(0, cidx)
        if every:
            running = nxt
        else:
            running.index_copy_(0, act, nxt)
    return start, running


def _ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h0: torch.Tensor,
    layout: _ChunkLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked scan of R requests (float32, dt already processed).

    x: [T, H, P]; dt: [T, H]; B, C: [T, G, N]; h0: [R, H, P, N]; `layout` picks the tokens
    -> y [n, H, P] for the tokens `layout.tok`, final state [R, H, P, N].
    """
    nc, length = layout.num_chunks, layout.chunk_len
    groups, d_state = B.shape[1], B.shape[2]
    heads, head_dim = x.shape[1], x.shape[2]
    x_c, dt_c = layout.pack(x), layout.pack(dt)  # [c, L, H, P], [c, L, H]; padding dt = 0
    B_c, C_c = layout.pack(B), layout.pack(C)  # [c, L, G, N]
    xdt = x_c * dt_c[..., None]
    dA = dt_c * A  # [c, L, H]

    y_diag, chunk_states, a_cum = _intra_chunk(xdt, dA, B_c, C_c)
    start, final = _pass_states(chunk_states, _exp_decay(a_cum[:, -1]), h0, layout)

    # Off-diagonal blocks: the chunk's start state read out by C, decayed to position l.
    start_g = start.view(nc, groups, heads // groups, head_dim, d_state)
    y_off = torch.einsum("clgn,cgjpn->clgjp", C_c, start_g).reshape(nc, length, heads, head_dim)
    # y = y_diag + y_off * exp(a_cum) + D * x, in place (these are the largest tensors here)
    y = y_off.mul_(_exp_decay(a_cum)[..., None]).add_(y_diag).add_(D[:, None] * x_c)
    return layout.unpack(y), final


def _split_by_length(lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Indices of one-token requests and of longer ones (host sync: their counts size buffers).

    Splitting keeps decodes out of the chunk grid, where each would cost a whole padded chunk.
    Zero-length requests are in neither and keep their page untouched.
    """
    return torch.nonzero(lens == 1).squeeze(1), torch.nonzero(lens > 1).squeeze(1)


def decode_in_place(
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """One decode step of R requests that all have a state, read and written in their pages.

    Written as plain elementwise code so that `torch.compile` fuses it into a couple of loops
    (gather, update, read-out, scatter): 3.4x faster than `ssd_step` plus the eager gather and
    scatter on the development CPU. x: [R, H, P]; dt: [R, H] processed; B, C: [R, G, N] -> y.
    """
    heads, groups = x.shape[1], B.shape[1]
    h = ssm_state.index_select(0, state_pages).float()  # [R, H, P, N]
    Bh = B.repeat_interleave(heads // groups, dim=1)[:, :, None, :]  # [R, H, 1, N]
    Ch = C.repeat_interleave(heads // groups, dim=1)[:, :, None, :]
    h = h * torch.exp(dt * A)[..., None, None] + (x * dt[..., None])[..., None] * Bh
    y = (h * Ch).sum(-1) + D[:, None] * x  # [R, H, P]
    ssm_state.index_copy_(0, state_pages, h.to(ssm_state.dtype))
    return y


class ScanInputs(NamedTuple):
    """The scan's inputs in float32, dt processed: x [T, H, P], dt [T, H], A, D [H], B, C
    [T, G, N]."""

    x: torch.Tensor
    dt: torch.Tensor
    A: torch.Tensor
    B: torch.Tensor
    C: torch.Tensor
    D: torch.Tensor


def scan_inputs(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    dt_limit: tuple[float, float],
) -> ScanInputs:
    """Every scan implementation computes in float32 from the same processed inputs."""
    return ScanInputs(
        x.float(), _process_dt(dt, dt_bias, dt_limit), A.float(), B.float(), C.float(), D.float()
    )


def mamba2_scan_varlen(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    chunk_size: int,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    out_dtype: torch.dtype | None = None,
    decode_rows: DecodeRows | None = None,
) -> torch.Tensor:
    """Mamba2 scan of packed requests, reading and updating their paged state (PyTorch).

    x: [T, H, P]; dt: [T, H] raw; A: [H] (negative); B, C: [T, G, N]; D, dt_bias: [H];
    ssm_state: [num_pages, H, P, N] (written in place at `state_pages`); state_pages: [S] int64;
    has_initial_state: [S] bool; query_start_loc: [S+1] int32; max_query_len: longest request
    (an upper bound works: it sets the chunk length and the number of state-passing steps)
    -> y [T, H, P] in `out_dtype` (default x.dtype), computed in float32. `decode_rows` steps
    the one-token requests instead of the PyTorch recurrence (the Triton kernel on GPUs).
    This is the reference the native and Triton kernels are tested against.
    """
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if x.shape[0] == 0:
        return x.new_empty(x.shape, dtype=out_dtype)
    inputs = scan_inputs(x, dt, A, B, C, D, dt_bias, dt_limit)
    if max_query_len == 1 and x.shape[0] == state_pages.shape[0]:  # token s: request s
        return _decode_rows(ssm_state, state_pages, has_initial_state, inputs, decode_rows).to(
            out_dtype
        )
    xf, dtf, Af, Bf, Cf, Df = inputs
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    dec, pre = _split_by_length(lens)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if dec.numel() > 0:
        tok = starts[dec]
        rows = ScanInputs(xf[tok], dtf[tok], Af, Bf[tok], Cf[tok], Df)
        y[tok] = _decode_rows(
            ssm_state, state_pages[dec], has_initial_state[dec], rows, decode_rows
        )
    if pre.numel() > 0:
        chunk_len = min(chunk_size, max_query_len)
        n_tok = x.shape[0] - dec.numel()
        layout = _ChunkLayout(starts[pre], lens[pre], chunk_len, n_tok, max_query_len)
        h0_pre = _initial_ssm_state(ssm_state, state_pages[pre], has_initial_state[pre])
        y_pre, h = _ssd_chunked(xf, dtf, Af, Bf, Cf, Df, h0_pre, layout)
        y[layout.tok] = y_pre
        ssm_state.index_copy_(0, state_pages[pre], h.to(ssm_state.dtype))
    return y.to(out_dtype)


def _decode_rows(
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    inputs: ScanInputs,
    kernel: DecodeRows | None,
) -> torch.Tensor:
    """One step for R requests of one token each, states read and written in their pages.
    inputs: x [R, H, P], dt [R, H], A [H], B, C [R, G, N], D [H] -> y [R, H, P] float32."""
    if kernel is not None:  # e.g. Triton: one fused pass over each state, in place
        return kernel(ssm_state, state_pages, has_initial_state, *inputs)
    h0 = _initial_ssm_state(ssm_state, state_pages, has_initial_state)  # [R, H, P, N]
    y, h = ssd_step(*inputs, h0)
    ssm_state.index_copy_(0, state_pages, h.to(ssm_state.dtype))
    return y
