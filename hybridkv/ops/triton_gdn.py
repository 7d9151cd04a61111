"""The gated delta rule's decode step in Triton, the state updated in its page.

On a GPU a decode step of a gated-delta-net layer is dominated by the recurrent state: per
request `Hv * K * V` numbers (Qwen3-Next-80B: 32 x 128 x 128, 2 MiB in float32) read and written
once per token. The PyTorch path (`ops.gated_delta.decode_rows`: a gather, five passes, a
scatter) moves them several times; this kernel reads each state element once and writes it once:

    program (s, h, v-block)                           page = state_pages[s]
        S = state[page, h, :, v0:v0+BLOCK_V]  --load-->  [K, BLOCK_V]  (zeros when s has none)
        S = exp(g[s,h]) * S
        d = beta[s,h] * (v[s,h,v-block] - S^T k[s,h])     the delta rule's correction
        S = S + k[s,h] (outer) d
        o[s,h,v-block] = S^T q[s,h]
        S  --store-->  state[page, h, :, v-block]

q and k arrive normalised and expanded to the value heads (`ops.gated_delta.rule_inputs`), so
the kernel has the `DecodeRows` signature the reference's varlen function takes. A request
without an initial state never reads its page (a masked load: it may hold NaN bit patterns).
Without a GPU the kernel runs through Triton's interpreter (`TRITON_INTERPRET=1` before
import), which is how the tests check it against PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.gated_delta import RuleInputs
from hybridkv.ops.triton_attention import check_device


@triton.jit
def _gdn_decode_kernel(
    o_ptr,  # [S, Hv, V] float32
    state_ptr,  # [num_pages, Hv, K, V]
    pages_ptr,  # [S] int64
    has_init_ptr,  # [S] uint8 (bool)
    q_ptr,  # [S, Hv, K] float32, normalised and scaled
    k_ptr,  # [S, Hv, K] float32, normalised
    v_ptr,  # [S, Hv, V] float32
    g_ptr,  # [S, Hv] float32, log decay
    beta_ptr,  # [S, Hv] float32
    stride_ot, stride_oh, stride_ov,
    stride_sb, stride_sh, stride_sk, stride_sv,
    stride_qt, stride_qh, stride_qk,
    stride_kt, stride_kh, stride_kk,
    stride_vt, stride_vh, stride_vv,
    stride_gt, stride_gh,
    stride_bt, stride_bh,
    K: tl.constexpr,
    V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    page = tl.load(pages_ptr + s).to(tl.int64)

    # Phase 1: this program's columns of the old state (never read when the request has none).
    kk = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V]
    mask = (kk[:, None] < K) & (vv[None, :] < V)
    # the flag as a [BLOCK_K] vector: Triton's interpreter cannot AND a scalar into a mask
    has_state = (tl.zeros([BLOCK_K], tl.int32) + tl.load(has_init_ptr + s).to(tl.int32)) != 0
    ptrs = (state_ptr + page * stride_sb + head * stride_sh + kk[:, None] * stride_sk
            + vv[None, :] * stride_sv)  # fmt: skip
    S = tl.load(ptrs, mask=mask & has_state[:, None], other=0.0).to(tl.float32)  # [BK, BV]

    # Phase 2: the token's inputs.
    q = tl.load(q_ptr + s * stride_qt + head * stride_qh + kk * stride_qk, mask=kk < K, other=0.0)
    k = tl.load(k_ptr + s * stride_kt + head * stride_kh + kk * stride_kk, mask=kk < K, other=0.0)
    v = tl.load(v_ptr + s * stride_vt + head * stride_vh + vv * stride_vv, mask=vv < V, other=0.0)
    decay = tl.exp(tl.load(g_ptr + s * stride_gt + head * stride_gh))
    beta = tl.load(beta_ptr + s * stride_bt + head * stride_bh)

    # Phase 3: decay, correct, read out, write back.
    S = S * decay
    delta = (v - tl.sum(S * k[:, None], axis=0)) * beta  # [BLOCK_V]
    S = S + k[:, None] * delta[None, :]
    o = tl.sum(S * q[:, None], axis=0)  # [BLOCK_V]
    tl.store(ptrs, S.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(o_ptr + s * stride_ot + head * stride_oh + vv * stride_ov, o, mask=vv < V)


def gdn_decode_blocks(key_dim: int, value_dim: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_V) of `gdn_decode`: whole K columns (the delta rule sums over K), about
    4096 state elements per program (32 float32 registers a thread at 4 warps)."""
    block_k = triton.next_power_of_2(key_dim)
    return block_k, min(triton.next_power_of_2(value_dim), max(1, 4096 // block_k))


def gdn_decode(
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    inputs: RuleInputs,
) -> torch.Tensor:
    """One gated-delta step of S requests, one token each, updating their state pages in place.

    state: [num_pages, Hv, K, V]; state_pages: [S] int64; has_initial_state: [S] bool; inputs:
    q, k [S, Hv, K] (normalised, expanded), v [S, Hv, V], g, beta [S, Hv], float32 -> o
    [S, Hv, V] float32. Same semantics as `ops.gated_delta.decode_rows`.
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
    _gdn_decode_kernel[grid](
        o, state, state_pages, has_initial_state.view(torch.uint8), q, k, v, g, beta,
        *o.stride(), *state.stride(), *q.stride(), *k.stride(), *v.stride(), *g.stride(),
        *beta.stride(),
        K=key_dim,
        V=value_dim,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
    )  # fmt: skip
    return o
