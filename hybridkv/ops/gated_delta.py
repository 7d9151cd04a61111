"""The gated delta rule (Qwen3-Next, Qwen3.5) over a packed ragged batch with a paged state.

Per request and value head, with q and k L2-normalised (q also scaled by 1/sqrt(K)), the
decay g <= 0 and the update strength beta in (0, 1):

    S_t = exp(g_t) * S_{t-1}                      S: [K, V], the head's recurrent state
    S_t += k_t (outer) beta_t * (v_t - S_t^T k_t)  the delta rule: write only what S mispredicts
    o_t = S_t^T q_t                               o: [V]

Query/key heads serve `Hv / Hk` consecutive value heads each (grouped value attention). Each
request's S lives in one page of `state: [num_pages, Hv, K, V]`; a request without an initial
state starts from zeros (its page may hold NaN bit patterns, selected away with `where`).

Two paths, both in float32 (this module is the PyTorch reference; the native and Triton
kernels are tested against it):

- one-token requests: the recurrence above, batched over requests;
- longer ones: the chunked form (the DeltaNet paper's UT transform, as flash-linear-attention
  computes it). Requests are cut into request-aligned chunks of L tokens and packed into one
  `[num_chunks, L, ...]` grid (the padding has g = 0, beta = 0 and k = 0, so it leaves the state
  unchanged). Inside a chunk, with G the cumulative decay and D_ij = exp(G_i - G_j) for j <= i:

      T = I + strictly_lower((beta k) k^T * D)          solved, not inverted
      U = T^-1 (beta v),   W = T^-1 (beta k exp(G))     the chunk's corrected values / keys
      per chunk j of every request, in order:
        U' = U - W S
        o  = (q exp(G)) S + ((q k^T) * D) U'
        S  = exp(G_L) S + (k exp(G_L - G))^T U'

  Chunk boundaries are those of each step's request slice, so where a prefill chunk ends
  changes the floating-point grouping only (the state carries over exactly).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridkv.ops.derived import derived
from hybridkv.ops.mamba2 import _ChunkLayout as ChunkLayout
from hybridkv.ops.mamba2 import _exp_decay, _split_by_length

# A kernel for one-token requests: (state, state_pages, has_initial_state, q, k, v, g, beta)
# -> o, with the signature of `decode_rows` below.
DecodeRows = Callable[..., torch.Tensor]
L2_EPS = 1e-6  # as transformers' l2norm (and flash-linear-attention's)
CHUNK = 64


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """a, b: [T, Hv] -> g = -exp(A_log) * softplus(a + dt_bias) (the log decay, <= 0) and
    beta = sigmoid(b), both float32 [T, Hv]."""
    decay_rate = derived(A_log, "neg_exp_f32", lambda t: -torch.exp(t.float()))  # [Hv]
    g = decay_rate * F.softplus(a.float() + derived(dt_bias, "f32", torch.Tensor.float))
    return g, b.float().sigmoid()


class RuleInputs(NamedTuple):
    """The rule's inputs in float32, q and k normalised and expanded to the value heads:
    q, k [T, Hv, K]; v [T, Hv, V]; g, beta [T, Hv]."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


def rule_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> RuleInputs:
    """L2-normalise q and k (q also times 1/sqrt(K)) and repeat them for the value heads."""
    num_v, num_k = v.shape[1], q.shape[1]
    qf, kf = q.float(), k.float()
    qf = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + L2_EPS) / math.sqrt(q.shape[-1])
    kf = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + L2_EPS)
    if num_v != num_k:
        qf = qf.repeat_interleave(num_v // num_k, dim=1)
        kf = kf.repeat_interleave(num_v // num_k, dim=1)
    return RuleInputs(qf, kf, v.float(), g.float(), beta.float())


def _initial_state(
    state: torch.Tensor, state_pages: torch.Tensor, has_initial_state: torch.Tensor
) -> torch.Tensor:
    """Each request's state, zeros where it has none -> float32 [R, Hv, K, V] (a copy)."""
    old = state.index_select(0, state_pages).float()
    if bool(has_initial_state.all()):
        return old
    zero = torch.zeros((), dtype=torch.float32, device=old.device)
    return torch.where(has_initial_state[:, None, None, None], old, zero)


def recurrent_step(
    S: torch.Tensor, inputs: RuleInputs
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per request. S: [R, Hv, K, V] float32 (the caller's copy, updated in place);
    inputs for R tokens -> o [R, Hv, V], S."""
    q, k, v, g, beta = inputs
    S.mul_(_exp_decay(g)[..., None, None])
    predicted = torch.einsum("rhkv,rhk->rhv", S, k)  # S^T k: [R, Hv, V]
    delta = (v - predicted) * beta[..., None]
    S.add_(k[..., :, None] * delta[..., None, :])  # k (outer) delta
    return torch.einsum("rhkv,rhk->rhv", S, q), S


def decode_rows(
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    inputs: RuleInputs,
) -> torch.Tensor:
    """One step for R one-token requests, states read from and written to their pages.
    -> o [R, Hv, V] float32."""
    S = _initial_state(state, state_pages, has_initial_state)
    o, S = recurrent_step(S, inputs)
    state.index_copy_(0, state_pages, S.to(state.dtype))
    return o


class _Chunks(NamedTuple):
    """Per-chunk quantities of the chunked form, head-major: [c, Hv, L, ...]."""

    q_dec: torch.Tensor  # q exp(G)            [c, H, L, K]
    k_rev: torch.Tensor  # k exp(G_L - G)      [c, H, L, K]
    U: torch.Tensor  # T^-1 (beta v)           [c, H, L, V]
    W: torch.Tensor  # T^-1 (beta k exp(G))    [c, H, L, K]
    intra: torch.Tensor  # (q k^T) * D         [c, H, L, L]
    decay: torch.Tensor  # exp(G_L)            [c, H]


def _intra_chunk(inputs: RuleInputs, layout: ChunkLayout) -> _Chunks:
    length = layout.chunk_len
    # [c, L, H, ...] -> [c, H, L, ...]
    q, k, v = (layout.pack(x).transpose(1, 2) for x in inputs[:3])
    g, beta = (layout.pack(x).transpose(1, 2) for x in inputs[3:])  # [c, H, L]
    G = g.cumsum(-1)  # [c, H, L]
    lower = torch.ones(length, length, dtype=torch.bool, device=g.device).tril()
    D = _exp_decay(G[..., :, None] - G[..., None, :]).masked_fill(~lower, 0.0)  # [c, H, L, L]
    k_beta = k * beta[..., None]
    T = (k_beta @ k.transpose(-1, -2)) * D
    eG = _exp_decay(G)[..., None]  # [c, H, L, 1]
    rhs = torch.cat([v * beta[..., None], k_beta * eG], dim=-1)  # one solve for U and W
    UW = torch.linalg.solve_triangular(T, rhs, upper=False, unitriangular=True)
    U, W = UW.split([v.shape[-1], k.shape[-1]], dim=-1)
    intra = (q @ k.transpose(-1, -2)) * D
    last = G[..., -1:]
    k_rev = k * _exp_decay(last - G)[..., None]
    return _Chunks(q * eG, k_rev, U, W, intra, _exp_decay(last[..., 0]))


def _scan_chunks(
    ch: _Chunks, S: torch.Tensor, layout: ChunkLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """Carry each request's state through its chunks in order. S: [R, H, K, V] (the caller's
    copy) -> outputs [c, H, L, V], final states [R, H, K, V]. Loops over the chunk index j:
    iteration j advances every request that has a j-th chunk."""
    out = torch.empty_like(ch.U)
    for j in range(layout.max_chunks):
        act = torch.nonzero(layout.n_chunks > j).squeeze(1)  # [r] (host sync: sizes)
        every = act.numel() == S.shape[0]
        cidx = layout.first_chunk[act] + j  # [r]
        cur = S if every else S.index_select(0, act)
        U = ch.U.index_select(0, cidx) - ch.W.index_select(0, cidx) @ cur  # U': [r, H, L, V]
        o = ch.q_dec.index_select(0, cidx) @ cur + ch.intra.index_select(0, cidx) @ U
        out.index_copy_(0, cidx, o)
        nxt = cur * ch.decay.index_select(0, cidx)[..., None, None]
        nxt += ch.k_rev.index_select(0, cidx).transpose(-1, -2) @ U
        if every:
            S = nxt
        else:
            S.index_copy_(0, act, nxt)
    return out, S


def gated_delta_rule_varlen(
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
    decode: DecodeRows | None = None,
) -> torch.Tensor:
    """The gated delta rule of packed requests, reading and updating their paged state.

    q, k: [T, Hk, K] (raw: normalised here); v: [T, Hv, V]; g, beta: [T, Hv] (`gdn_gates`);
    state: [num_pages, Hv, K, V] (written in place at `state_pages`); state_pages: [S] int64;
    has_initial_state: [S] bool; query_start_loc: [S + 1] int32; max_query_len: an upper bound
    on the longest request -> o [T, Hv, V] float32. `decode` replaces the PyTorch recurrence
    for the one-token requests (same signature as `decode_rows`).
    """
    num_tokens = q.shape[0]
    out = torch.empty(num_tokens, v.shape[1], v.shape[2], dtype=torch.float32, device=v.device)
    if num_tokens == 0:
        return out
    inputs = rule_inputs(q, k, v, g, beta)
    step = decode or decode_rows
    if max_query_len == 1 and num_tokens == state_pages.shape[0]:  # token s: request s
        return step(state, state_pages, has_initial_state, inputs)
    starts = query_start_loc[:-1].long()
    lens = query_start_loc[1:].long() - starts
    dec, pre = _split_by_length(lens)
    if dec.numel() > 0:
        tok = starts[dec]
        rows = RuleInputs(*(x.index_select(0, tok) for x in inputs))
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
