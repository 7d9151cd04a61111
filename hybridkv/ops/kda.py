"""Kimi delta attention (KDA, Kimi-Linear): the delta rule with a per-channel decay, over a packed
ragged batch with a paged state. The PyTorch reference; the native and Triton kernels are tested
against it.

Per request and head, with q and k L2-normalised (q also scaled by 1/sqrt(K)), the log decay
g_t <= 0 of one value per KEY CHANNEL ([K], not one per head as in the gated delta net) and the
update strength beta_t in (0, 1):

    S_t = diag(exp(g_t)) S_{t-1}                  S: [K, V]; row i decays by exp(g_t[i])
    S_t += k_t (outer) beta_t * (v_t - S_t^T k_t)  the delta rule
    o_t = S_t^T q_t                               o: [V]

Why its own module, and its own state kind ("kda", `kv.specs.kda_state`), rather than the gated
delta net with a per-channel gate: the recurrence is the same but every place the decay enters
changes shape ([T, H] -> [T, H, K]): the chunked form's decay between positions i and j becomes
a [K] vector, so the intra-chunk products need it inside the contraction over K instead of as a
scalar factor outside it, and the cache differs too (q, k and v have one short convolution each,
three conv states, and no grouped value heads). Extending `ops.gated_delta` would have made every
one of its paths branch on the gate's shape; this module reuses its pieces that do not depend on
the gate (the chunk layout, the zero-state selection, the L2 norm constant) instead.

Two paths, both in float32:

- one-token requests: the recurrence above, batched over requests;
- longer ones: the chunked form, requests cut into request-aligned chunks of L tokens packed into
  `[num_chunks, L, ...]` (padding has g = 0, beta = 0, k = 0: it leaves the state unchanged).
  With G the cumulative log decay inside a chunk ([L, K]) and, for j <= i, the channel decays
  D_ij = exp(G_i - G_j) ([K], every entry <= 1):

      A_ij = sum_c beta_i k_i[c] D_ij[c] k_j[c]   (j < i)      T = I + A
      U = T^-1 (beta v),   W = T^-1 (beta k exp(G))
      per chunk of every request, in order:
        U' = U - W S
        o  = (q exp(G)) S + P U'        P_ij = sum_c q_i[c] D_ij[c] k_j[c]  (j <= i)
        S  = diag(exp(G_L)) S + (k exp(G_L - G))^T U'

  A and P need [L, L, K] decays per chunk and head (`CHUNK` is 32 to keep them small: 32 x 32 x
  K floats), built for a slice of chunks at a time within `DECAY_BUDGET`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from hybridkv.ops.gated_delta import L2_EPS, ChunkLayout, _initial_state
from hybridkv.ops.mamba2 import _exp_decay, _split_by_length

# A kernel for one-token requests: (state, state_pages, has_initial_state, inputs) -> o [R, H, V]
KdaDecodeRows = Callable[..., torch.Tensor]
CHUNK = 32
DECAY_BUDGET = 64 * 2**20  # bytes of [chunks, H, L, L, K] decays built at once


def kda_gate(
    f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> torch.Tensor:
    """The forget gate: f [T, H * K] (f_b_proj(f_a_proj(x))), A_log [H] (any shape with H
    elements), dt_bias [H * K] -> g = -exp(A_log[h]) * softplus(f + dt_bias), float32 [T, H, K]."""
    heads = A_log.numel()
    x = (f.float() + dt_bias.float()).view(f.shape[0], heads, -1)
    # transformers' softplus: x itself above 20 (log(1 + exp(x)) below)
    soft = torch.where(x > 20.0, x, torch.log1p(torch.exp(x.clamp(max=20.0))))
    return -A_log.float().reshape(1, heads, 1).exp() * soft


class KdaInputs(NamedTuple):
    """The rule's inputs in float32, q and k normalised: q, k [T, H, K]; v [T, H, V];
    g [T, H, K] (log decay per key channel); beta [T, H]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def kda_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> KdaInputs:
    """L2-normalise q and k (as transformers: x / sqrt(sum x^2 + eps)); q also times 1/sqrt(K)."""
    qf, kf = q.float(), k.float()
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2_EPS) / math.sqrt(q.shape[-1])
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2_EPS)
    return KdaInputs(qf, kf, v.float(), g.float(), beta.float())


def kda_step(S: torch.Tensor, inputs: KdaInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request. S: [R, H, K, V] float32 (the caller's copy, updated in place)
    -> o [R, H, V], S."""
    q, k, v, g, beta = inputs
    S.mul_(_exp_decay(g)[..., None])  # row c of S decays by exp(g[c])
    predicted = torch.einsum("rhkv,rhk->rhv", S, k)  # S^T k: [R, H, V]
    delta = (v - predicted) * beta[..., None]
    S.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("rhkv,rhk->rhv", S, q), S


def kda_decode_rows(
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    inputs: KdaInputs,
) -> torch.Tensor:
    """One step for R one-token requests, states read from and written to their pages
    (state: [num_pages, H, K, V]) -> o [R, H, V] float32."""
    S = _initial_state(state, state_pages, has_initial_state)
    o, S = kda_step(S, inputs)
    state.index_copy_(0, state_pages, S.to(state.dtype))
    return o


class _Chunks(NamedTuple):
    """Per-chunk quantities of the chunked form, head-major: [c, H, L, ...]."""

    q_dec: torch.Tensor  # q exp(G)              [c, H, L, K]
    k_rev: torch.Tensor  # k exp(G_L - G)        [c, H, L, K]
    U: torch.Tensor  # T^-1 (beta v)             [c, H, L, V]
    W: torch.Tensor  # T^-1 (beta k exp(G))      [c, H, L, K]
    intra: torch.Tensor  # P                     [c, H, L, L]
    decay: torch.Tensor  # exp(G_L)              [c, H, K]


def _intra_chunk(inputs: KdaInputs, layout: ChunkLayout) -> _Chunks:
    """The per-chunk quantities of every chunk, computed a slice of chunks at a time so that the
    [chunks, H, L, L, K] decays never exceed `DECAY_BUDGET` bytes (8192 tokens of 32 heads of
    128 would otherwise hold 4 GiB of them)."""
    q, k, v, g = (layout.pack(x).transpose(1, 2) for x in inputs[:4])  # [c, H, L, ...]
    beta = layout.pack(inputs.beta).transpose(1, 2)  # [c, H, L]
    per_chunk = 4 * q.shape[1] * layout.chunk_len**2 * q.shape[-1]
    step = max(1, DECAY_BUDGET // per_chunk)
    parts = [
        _chunk_slice(q[a : a + step], k[a : a + step], v[a : a + step], g[a : a + step],
                     beta[a : a + step])  # fmt: skip
        for a in range(0, q.shape[0], step)
    ]
    return _Chunks(*(torch.cat(fields) for fields in zip(*parts, strict=True)))


def _chunk_slice(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> _Chunks:
    """q, k, g: [c, H, L, K]; v: [c, H, L, V]; beta: [c, H, L] -> their `_Chunks`."""
    length = q.shape[2]
    G = g.cumsum(-2)  # [c, H, L, K]
    lower = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    # D[i, j] = exp(G_i - G_j) for j <= i, else 0: [c, H, L, L, K]
    D = _exp_decay((G[..., :, None, :] - G[..., None, :, :]).clamp(max=0.0))
    D = D * lower[..., None]
    k_beta = k * beta[..., None]
    A = torch.einsum("zhic,zhijc,zhjc->zhij", k_beta, D, k)  # lower part used
    T = A.masked_fill(~lower, 0.0)  # T's diagonal is ignored: the solve is unit-triangular
    eG = _exp_decay(G)  # [c, H, L, K]
    rhs = torch.cat([v * beta[..., None], k_beta * eG], dim=-1)  # one solve for U and W
    UW = torch.linalg.solve_triangular(T, rhs, upper=False, unitriangular=True)
    U, W = UW.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = torch.einsum("zhic,zhijc,zhjc->zhij", q, D, k)
    last = G[..., -1:, :]  # [c, H, 1, K]
    k_rev = k * _exp_decay(last - G)
    return _Chunks(q * eG, k_rev, U, W, intra, _exp_decay(last[..., 0, :]))


def _scan_chunks(
    ch: _Chunks, S: torch.Tensor, layout: ChunkLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry each request's state through its chunks in order. S: [R, H, K, V] (the caller's
    copy) -> outputs [c, H, L, V], final states [R, H, K, V]."""
    out = torch.empty_like(ch.U)
    for j in range(layout.max_chunks):
        act = torch.nonzero(layout.n_chunks > j).squeeze(1)  # requests with a j-th chunk
        cidx = layout.first_chunk[act] + j  # [r]
        cur = S.index_select(0, act)
        U = ch.U.index_select(0, cidx) - ch.W.index_select(0, cidx) @ cur  # U': [r, H, L, V]
        o = ch.q_dec.index_select(0, cidx) @ cur + ch.intra.index_select(0, cidx) @ U
        out.index_copy_(0, cidx, o)
        nxt = cur * ch.decay.index_select(0, cidx)[..., None]
        nxt += ch.k_rev.index_select(0, cidx).transpose(-1, -2) @ U
        S.index_copy_(0, act, nxt)
    return out, S


def kda_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    chunk_size: int = CHUNK,
    decode: KdaDecodeRows | None = None,
) -> torch.Tensor:
    """KDA over packed requests, reading and updating their paged state.

    q, k: [T, H, K] (raw: normalised here); v: [T, H, V]; g: [T, H, K] log decay (`kda_gate`);
    beta: [T, H]; state: [num_pages, H, K, V] (written in place at `state_pages`); state_pages:
    [S] int64; has_initial_state: [S] bool; query_start_loc: [S + 1] int32; max_query_len: an
    upper bound on the longest request -> o [T, H, V] float32. `decode` replaces the PyTorch
    recurrence for one-token requests (same signature as `kda_decode_rows`).
    """
    num_tokens = q.shape[0]
    out = torch.empty(num_tokens, v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
    if num_tokens == 0:
        return out
    inputs = kda_inputs(q, k, v, g, beta)
    step = decode or kda_decode_rows
    if max_query_len == 1 and num_tokens == state_pages.shape[0]:  # token s: request s
        return step(state, state_pages, has_initial_state, inputs)
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    dec, pre = _split_by_length(lens)
    if dec.numel() > 0:
        tok = starts[dec]
        rows = KdaInputs(*(x.index_select(0, tok) for x in inputs))
        out[tok] = step(state, state_pages[dec], has_initial_state[dec], rows)
    if pre.numel() > 0:
        length = min(chunk_size, max_query_len)
        layout = ChunkLayout(starts[pre], lens[pre], length, num_tokens - dec.numel(),
                             max_query_len)  # fmt: skip
        S0 = _initial_state(state, state_pages[pre], has_initial_state[pre])
        o, S = _scan_chunks(_intra_chunk(inputs, layout), S0, layout)
        out[layout.tok] = layout.unpack(o.transpose(1, 2))  # [c, L, H, V] -> tokens
        state.index_copy_(0, state_pages[pre], S.to(state.dtype))
    return out

