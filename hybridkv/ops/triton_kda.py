"""The KDA (Kimi delta attention) decode step in Triton, the state updated in its page.

Like the gated-delta decode kernel (`ops.triton_gdn`), each state element is read once and
written once; the difference is the decay, one value per key channel (a [K] vector that scales
the rows of S) instead of one per head:

    program (s, h, v-block)                           page = state_pages[s]
        S = state[page, h, :, v0:v0+BLOCK_V]  --load-->  [K, BLOCK_V]  (zeros when s has none)
        S = exp(g[s,h,:])[:, None] * S                   per-channel decay
        d = beta[s,h] * (v[s,h,v-block] - S^T k[s,h])
        S = S + k[s,h] (outer) d
        o[s,h,v-block] = S^T q[s,h]
        S  --store-->  state[page, h, :, v-block]

q and k arrive normalised (`ops.kda.kda_inputs`), so the kernel has the signature of
`ops.kda.kda_decode_rows` and plugs into `ops.kda.kda_varlen` as its decode step. A request
without an initial state never reads its page (a masked load). Without a GPU it runs through
Triton's interpreter (`TRITON_INTERPRET=1` before import), which is how the tests check it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.kda import KdaInputs
from hybridkv.ops.triton_attention import check_device
from hybridkv.ops.triton_gdn import gdn_decode_blocks


@triton.jit
def _kda_decode_kernel(
    o_ptr,  # [S, H, V] float32
    state_ptr,  # [num_pages, H, K, V]
    pages_ptr,  # [S] int64
    has_init_ptr,  # [S] uint8 (bool)
    q_ptr,  # [S, H, K] float32, normalised and scaled
    k_ptr,  # [S, H, K] float32, normalised
    v_ptr,  # [S, H, V] float32
    g_ptr,  # [S, H, K] float32, log decay per key channel
    beta_ptr,  # [S, H] float32
    stride_ot, stride_oh, stride_ov,
    stride_sb, stride_sh, stride_sk, stride_sv,
    stride_qt, stride_qh, stride_qk,
    stride_kt, stride_kh, stride_kk,
    stride_vt, stride_vh, stride_vv,
    stride_gt, stride_gh, stride_gk,
    stride_bt, stride_bh,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    page = tl.load(pages_ptr + s).to(tl.int64)

    kk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    mask = (kk[:, None] < K) & (vv[None, :] < V)
    # the flag as a [BLOCK_K] vector: Triton's interpreter cannot AND a scalar into a mask
    has_state = (tl.zeros([BLOCK_K], tl.int32) + tl.load(has_init_ptr + s).to(tl.int32)) != 0
    ptrs = (state_ptr + page * stride_sb + head * stride_sh + kk[:, None] * stride_sk
            + vv[None, :] * stride_sv)  # fmt: skip
    S = tl.load(ptrs, mask=mask & has_state[:, None], other=0.0).to(tl.float32)  # [BK, BV]

    q = tl.load(q_ptr + s * stride_qt + head * stride_qh + kk * stride_qk, mask=kk < K, other=0.0)
    k = tl.load(k_ptr + s * stride_kt + head * stride_kh + kk * stride_kk, mask=kk < K, other=0.0)
    v = tl.load(v_ptr + s * stride_vt + head * stride_vh + vv * stride_vv, mask=vv < V, other=0.0)
    g = tl.load(g_ptr + s * stride_gt + head * stride_gh + kk * stride_gk, mask=kk < K, other=0.0)
    beta = tl.load(beta_ptr + s * stride_bt + head * stride_bh)

    S = S * tl.exp(tl.maximum(g, -80.0))[:, None]  # as the reference's clamp
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BLOCK_V]
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)  # [BLOCK_V]
    tl.store(ptrs, S.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + s * stride_ot + head * stride_oh + vv * stride_ov, o, mask=vv < V)


def kda_decode(
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    inputs: KdaInputs,
) -> torch.Tensor:
    """One KDA step of S requests, one token each, updating their state pages in place.

    state: [num_pages, H, K, V]; state_pages: [S] int64; has_initial_state: [S] bool; inputs:
    q, k [S, H, K] (normalised), v [S, H, V], g [S, H, K], beta [S, H], float32 -> o [S, H, V]
    float32. Same semantics as `ops.kda.kda_decode_rows`.
    """
    q, k, v, g, beta = inputs
    num_seqs, heads, key_dim = q.shape
    value_dim = v.shape[2]
    o = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    if num_seqs == 0:
        return o
    check_device(state, q)
    block_k, block_v = gdn_decode_blocks(key_dim, value_dim)
    grid = (num_seqs, heads, triton.cdiv(value_dim, block_v))
    _kda_decode_kernel[grid](
        o, state, state_pages, has_initial_state.view(torch.uint8), q, k, v, g, beta,
        *o.stride(), *state.stride(), *q.stride(), *k.stride(), *v.stride(), *g.stride(),
        *beta.stride(),
        K=key_dim,
        V=value_dim,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
    )  # fmt: skip
    return o
