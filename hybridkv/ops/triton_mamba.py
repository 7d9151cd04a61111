"""Mamba2 decode steps in Triton: the state update and the conv1d update, in their state pages.

On a GPU a decode step of a hybrid model is dominated by the Mamba2 state: per request and layer
`H * P * N` float32 numbers (4 MiB for Granite-4.0-H-Small) are read and written once per token.
The PyTorch path (hybridkv.ops.mamba2.ssd_step with a gather before and a scatter after) moves
them several times; these kernels read each state element once and write it once, in its page:

    program (s, h, p-block)                          page = state_pages[s]
        state[page, h, p0:p0+BLOCK_P, :]  --load-->  h0 [BLOCK_P, N]   (zeros when s has none)
        h  = exp(dt[s,h] * A[h]) * h0 + (dt[s,h] * x[s,h,p]) outer B[s, h // (H/G), :]
        y[s,h,p] = h . C[s, h // (H/G), :] + D[h] * x[s,h,p]
        h  --store-->  state[page, h, p-block, :]

The conv1d update does the same for `conv_state: [num_pages, C, K-1]`, one program per request
and block of channels. A request without an initial state never reads its page (a masked load:
the page may hold NaN bit patterns of an earlier owner). Prefill stays in PyTorch
(hybridkv.ops.mamba2 / conv1d). Without a GPU these kernels run through Triton's interpreter
(`TRITON_INTERPRET=1` before import), which is how the tests check them against PyTorch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.triton_attention import check_device


@triton.jit
def _ssm_decode_kernel(
    y_ptr,  # [S, H, P] float32
    state_ptr,  # [num_pages, H, P, N]
    pages_ptr,  # [S] int64
    has_init_ptr,  # [S] uint8 (bool)
    x_ptr,  # [S, H, P] float32
    dt_ptr,  # [S, H] float32, processed
    A_ptr,  # [H] float32
    B_ptr,  # [S, G, N] float32
    C_ptr,  # [S, G, N] float32
    D_ptr,  # [H] float32
    stride_yt, stride_yh, stride_yp,
    stride_sb, stride_sh, stride_sp, stride_sn,
    stride_xt, stride_xh, stride_xp,
    stride_dtt, stride_dth,
    stride_bt, stride_bg, stride_bn,
    stride_ct, stride_cg, stride_cn,
    HEADS_PER_GROUP: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    group = head // HEADS_PER_GROUP
    page = tl.load(pages_ptr + s).to(tl.int64)

    # Phase 1: this program's rows of the old state (never read when the request has none).
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)  # [BLOCK_P]
    n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    mask = (p[:, None] < P) & (n[None, :] < N)
    # the flag as a [BLOCK_P] vector: Triton's interpreter cannot AND a scalar into a mask
    has_state = (tl.zeros([BLOCK_P], tl.int32) + tl.load(has_init_ptr + s).to(tl.int32)) != 0
    ptrs = (state_ptr + page * stride_sb + head * stride_sh + p[:, None] * stride_sp
            + n[None, :] * stride_sn)  # fmt: skip
    h0 = tl.load(ptrs, mask=mask & has_state[:, None], other=0.0)  # [BLOCK_P, BLOCK_N]
    h0 = h0.to(tl.float32)

    # Phase 2: the step's inputs.
    dt = tl.load(dt_ptr + s * stride_dtt + head * stride_dth)
    decay = tl.exp(dt * tl.load(A_ptr + head))
    x = tl.load(x_ptr + s * stride_xt + head * stride_xh + p * stride_xp, mask=p < P, other=0.0)
    b = tl.load(B_ptr + s * stride_bt + group * stride_bg + n * stride_bn, mask=n < N, other=0.0)
    c = tl.load(C_ptr + s * stride_ct + group * stride_cg + n * stride_cn, mask=n < N, other=0.0)

    # Phase 3: update, read out, write back.
    h = h0 * decay + (x * dt)[:, None] * b[None, :]
    y = tl.sum(h * c[None, :], axis=1) + tl.load(D_ptr + head) * x  # [BLOCK_P]
    tl.store(ptrs, h.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + s * stride_yt + head * stride_yh + p * stride_yp, y, mask=p < P)


def ssm_decode_blocks(head_dim: int, d_state: int) -> tuple[int, int]:
    """(BLOCK_P, BLOCK_N) of `ssm_decode`: whole state rows, and about 4096 state elements per
    program (32 float32 registers a thread at 4 warps)."""
    block_n = triton.next_power_of_2(d_state)
    return min(triton.next_power_of_2(head_dim), max(1, 4096 // block_n)), block_n


def ssm_decode(
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """One Mamba2 step of S requests, one token each, updating their state pages in place.

    ssm_state: [num_pages, H, P, N]; state_pages: [S] int64; has_initial_state: [S] bool;
    x: [S, H, P], dt: [S, H] (processed), B, C: [S, G, N], A, D: [H], all float32
    -> y: [S, H, P] float32. Same semantics as `mamba2.ssd_step` with the gather and scatter.
    """
    num_seqs, heads, head_dim = x.shape
    groups, d_state = B.shape[1], B.shape[2]
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    if num_seqs == 0:
        return y
    check_device(ssm_state, x)
    block_p, block_n = ssm_decode_blocks(head_dim, d_state)
    grid = (num_seqs, heads, triton.cdiv(head_dim, block_p))
    _ssm_decode_kernel[grid](
        y, ssm_state, state_pages, has_initial_state.view(torch.uint8),
        x, dt, A, B, C, D,
        *y.stride(), *ssm_state.stride(), *x.stride(), *dt.stride(), *B.stride(), *C.stride(),
        HEADS_PER_GROUP=heads // groups,
        P=head_dim,
        N=d_state,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
    )  # fmt: skip
    return y


CONV_BLOCK_C = 256  # channels per program of `conv1d_decode`


@triton.jit
def _conv_decode_kernel(
    y_ptr,  # [S, C]
    x_ptr,  # [S, C]
    w_ptr,  # [C, K]
    bias_ptr,  # [C] (read only when HAS_BIAS)
    state_ptr,  # [num_pages, C, K-1]
    pages_ptr,  # [S] int64
    has_init_ptr,  # [S] uint8 (bool)
    channels,
    stride_yt, stride_yc,
    stride_xt, stride_xc,
    stride_wc, stride_wk,
    stride_sb, stride_sc, stride_sk,
    K: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_C: tl.constexpr,
):  # fmt: skip
    """window = [old state columns 0..K-2 | x]; y = window . w (+ bias, silu); the new state is
    the window's last K-1 columns: old columns 1..K-2, then x."""
    s = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    j = tl.arange(0, K_PAD)  # [K_PAD] state columns
    page = tl.load(pages_ptr + s).to(tl.int64)
    mc = c < channels
    # the flag as a [BLOCK_C] vector: Triton's interpreter cannot AND a scalar into a mask
    has_state = (tl.zeros([BLOCK_C], tl.int32) + tl.load(has_init_ptr + s).to(tl.int32)) != 0
    col = state_ptr + page * stride_sb + c[:, None] * stride_sc  # [BLOCK_C, 1]
    live = (mc & has_state)[:, None] & (j[None, :] < K - 1)
    old = tl.load(col + j[None, :] * stride_sk, mask=live, other=0.0).to(tl.float32)
    w_old = tl.load(w_ptr + c[:, None] * stride_wc + j[None, :] * stride_wk,
                    mask=mc[:, None] & (j[None, :] < K - 1), other=0.0).to(tl.float32)  # fmt: skip
    x = tl.load(x_ptr + s * stride_xt + c * stride_xc, mask=mc, other=0.0).to(tl.float32)
    w_new = tl.load(w_ptr + c * stride_wc + (K - 1) * stride_wk, mask=mc, other=0.0)
    y = tl.sum(old * w_old, axis=1) + x * w_new.to(tl.float32)  # [BLOCK_C]
    if HAS_BIAS:
        y += tl.load(bias_ptr + c, mask=mc, other=0.0).to(tl.float32)
    if SILU:
        y = y / (1.0 + tl.exp(-y))
    # new state column j = old column j + 1 (a second, shifted load: registers cannot shift)
    next_live = (mc & has_state)[:, None] & (j[None, :] + 1 < K - 1)
    shifted = tl.load(col + (j[None, :] + 1) * stride_sk, mask=next_live, other=0.0)
    new = tl.where(j[None, :] == K - 2, x[:, None], shifted.to(tl.float32))
    tl.store(col + j[None, :] * stride_sk, new.to(state_ptr.dtype.element_ty),
             mask=mc[:, None] & (j[None, :] < K - 1))  # fmt: skip
    tl.store(y_ptr + s * stride_yt + c * stride_yc, y.to(y_ptr.dtype.element_ty), mask=mc)


def conv1d_decode(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """One token per request. x: [S, C] (token s belongs to request s); weight: [C, K];
    conv_state: [num_pages, C, K-1] updated in place -> [S, C] in x.dtype, computed in float32.
    Same semantics as `conv1d.causal_conv1d_decode`."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv1d activation {activation!r} (expected 'silu' or None)")
    num_seqs, channels = x.shape
    width = weight.shape[1]
    y = torch.empty_like(x)
    if num_seqs == 0:
        return y
    check_device(x, conv_state)
    grid = (num_seqs, triton.cdiv(channels, CONV_BLOCK_C))
    _conv_decode_kernel[grid](
        y, x, weight, weight if bias is None else bias, conv_state, state_pages,
        has_initial_state.view(torch.uint8), channels,
        *y.stride(), *x.stride(), *weight.stride(), *conv_state.stride(),
        K=width,
        K_PAD=triton.next_power_of_2(max(width - 1, 1)),
        HAS_BIAS=bias is not None,
        SILU=activation is not None,
        BLOCK_C=CONV_BLOCK_C,
    )  # fmt: skip
    return y


__all__ = ["CONV_BLOCK_C", "conv1d_decode", "ssm_decode", "ssm_decode_blocks"]
