"""The Mamba1 scan's decode step in Triton, the state updated in its page.

On a GPU a decode step of a Mamba1 layer (Mamba, FalconMamba, Jamba) is dominated by its state:
per request `Di * N` numbers (Jamba-1.5-Large: 16384 x 16, 1 MiB in float32 per layer) read and
written once per token. The PyTorch path (`ops.mamba1`: a gather, an exp pass, two updates, a
matmul, a scatter) moves them several times; this kernel reads each state element once and
writes it once:

    program (s, d-block)                                page = state_pages[s]
        h = state[page, d0:d0+BLOCK_D, :]   --load-->   [BLOCK_D, N]  (zeros when s has none)
        delta = softplus(dt[s, d] + dt_bias[d])
        h = exp(delta[:, None] * A[d, :]) * h + (delta * x[s, d])[:, None] * B[s, None, :]
        y[s, d] = (h @ C[s] + D[d] * x[s, d]) * silu(z[s, d])
        h  --store-->  state[page, d-block, :]

D, z and dt_bias are optional (constexpr flags); x, dt, z, B, C may be bfloat16 and strided,
the state float32 or bfloat16, the math float32. A request without an initial state never reads
its page (a masked load: it may hold NaN bit patterns). Without a GPU the kernel runs through
Triton's interpreter (`TRITON_INTERPRET=1` before import), which is how the tests check it
against the PyTorch reference (`ops.mamba1`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hybridkv.ops.triton_attention import check_device


@triton.jit
def _softplus(v):
    """log(1 + e^v) as torch computes it (v above 20: v), log1p accurate for tiny e^v."""
    e = tl.exp(tl.minimum(v, 20.0))
    u = 1.0 + e
    # log1p(e) = log(u) * e / (u - 1): exact where u rounds to 1 (Goldberg's correction)
    log1p = tl.where(u == 1.0, e, tl.log(u) * e / tl.where(u == 1.0, 1.0, u - 1.0))
    return tl.where(v > 20.0, v, log1p)


@triton.jit
def _mamba1_decode_kernel(
    y_ptr,  # [S, Di] float32
    state_ptr,  # [num_pages, Di, N]
    pages_ptr,  # [S] int64
    has_init_ptr,  # [S] uint8 (bool)
    x_ptr, dt_ptr, z_ptr,  # [S, Di] (z read only when HAS_Z)
    A_ptr,  # [Di, N] float32
    B_ptr, C_ptr,  # [S, N]
    D_ptr, bias_ptr,  # [Di] float32 (read only when HAS_D / HAS_BIAS)
    channels,
    stride_yt,
    stride_sb, stride_sd, stride_sn,
    stride_xt, stride_dtt, stride_zt,
    stride_ad, stride_an,
    stride_bt, stride_ct,
    N: tl.constexpr,
    HAS_D: tl.constexpr,
    HAS_Z: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    s = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)  # [BLOCK_D]
    n = tl.arange(0, BLOCK_N)  # [BLOCK_N]
    md, mn = d < channels, n < N
    mask = md[:, None] & mn[None, :]
    page = tl.load(pages_ptr + s).to(tl.int64)

    # Phase 1: this program's rows of the old state (never read when the request has none).
    # the flag as a [BLOCK_D] vector: Triton's interpreter cannot AND a scalar into a mask
    has_state = (tl.zeros([BLOCK_D], tl.int32) + tl.load(has_init_ptr + s).to(tl.int32)) != 0
    ptrs = state_ptr + page * stride_sb + d[:, None] * stride_sd + n[None, :] * stride_sn
    h = tl.load(ptrs, mask=mask & has_state[:, None], other=0.0).to(tl.float32)

    # Phase 2: the step's inputs.
    x = tl.load(x_ptr + s * stride_xt + d, mask=md, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + s * stride_dtt + d, mask=md, other=0.0).to(tl.float32)
    if HAS_BIAS:
        dt += tl.load(bias_ptr + d, mask=md, other=0.0).to(tl.float32)
    delta = _softplus(dt)  # [BLOCK_D]
    A = tl.load(A_ptr + d[:, None] * stride_ad + n[None, :] * stride_an, mask=mask, other=0.0)
    b = tl.load(B_ptr + s * stride_bt + n, mask=mn, other=0.0).to(tl.float32)
    c = tl.load(C_ptr + s * stride_ct + n, mask=mn, other=0.0).to(tl.float32)

    # Phase 3: update, read out, write back.
    h = tl.exp(delta[:, None] * A.to(tl.float32)) * h + (delta * x)[:, None] * b[None, :]
    y = tl.sum(h * c[None, :], axis=1)  # [BLOCK_D]
    if HAS_D:
        y += tl.load(D_ptr + d, mask=md, other=0.0).to(tl.float32) * x
    if HAS_Z:
        z = tl.load(z_ptr + s * stride_zt + d, mask=md, other=0.0).to(tl.float32)
        y = y * (z / (1.0 + tl.exp(-z)))
    tl.store(ptrs, h.to(state_ptr.dtype.element_ty), mask=mask)
    tl.store(y_ptr + s * stride_yt + d, y, mask=md)


def decode_blocks(d_inner: int, d_state: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_N) of `mamba1_decode`: whole state rows, and about 2048 state elements
    per program (16 float32 registers a thread at 4 warps, with A beside them)."""
    block_n = triton.next_power_of_2(d_state)
    return min(triton.next_power_of_2(d_inner), max(1, 2048 // block_n)), block_n


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[S, k] with unit column stride (the kernel takes a row stride only)."""
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def mamba1_decode(
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
) -> torch.Tensor:
    """One Mamba1 step of S requests, one token each (token s belongs to request s), updating
    their state pages in place.

    ssm_state: [num_pages, Di, N] float32 or bfloat16; state_pages: [S] int64;
    has_initial_state: [S] bool; x, dt (raw, before softplus), z: [S, Di]; A: [Di, N] float32;
    B, C: [S, N]; D, dt_bias: [Di] or None -> y [S, Di] float32. Same semantics as
    `ops.mamba1.mamba1_scan_varlen` for one-token requests.
    """
    num_seqs, channels = x.shape
    d_state = A.shape[1]
    y = torch.empty(num_seqs, channels, dtype=torch.float32, device=x.device)
    if num_seqs == 0:
        return y
    check_device(ssm_state, x)
    x, dt, B, C = _rows(x), _rows(dt), _rows(B), _rows(C)
    z = None if z is None else _rows(z)
    A = A.to(torch.float32)
    block_d, block_n = decode_blocks(channels, d_state)
    grid = (num_seqs, triton.cdiv(channels, block_d))
    _mamba1_decode_kernel[grid](
        y, ssm_state, state_pages, has_initial_state.view(torch.uint8),
        x, dt, x if z is None else z, A, B, C,
        A if D is None else D.to(torch.float32), A if dt_bias is None else dt_bias.float(),
        channels,
        y.stride(0), *ssm_state.stride(), x.stride(0), dt.stride(0),
        0 if z is None else z.stride(0), *A.stride(), B.stride(0), C.stride(0),
        N=d_state,
        HAS_D=D is not None,
        HAS_Z=z is not None,
        HAS_BIAS=dt_bias is not None,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
    )  # fmt: skip
    return y


__all__ = ["decode_blocks", "mamba1_decode"]
