"""The Mamba kernels of `kernels.c` over packed requests, states read and written in their
pages: the Mamba2 scan, a whole Mamba2 mixer between its projections, the Mamba1 scan, and the
causal conv1d every state layer with a short convolution runs (Mamba, GDN, KDA, LFM2).

In PyTorch these need gathers into temporaries, the math, and scatters back (and the chunked
prefill scans build [chunks, heads, L, L] tensors); the C versions read the paged cache in
place. On the development CPU (2 cores, 100M hybrid model): a Mamba2 layer's decode step for 64
requests from 4.5 to 0.65 ms, the prefill scan of 2048 tokens (8 requests) from about 40 ms
(chunked, PyTorch) to about 7 ms, the conv1d of those tokens from 11 ms (PyTorch) to 2.7-4.6
ms. The Mamba1 scan (Mamba, FalconMamba, Jamba) runs the same way, float32 or bfloat16.
Each returns None when the library or these tensors are not supported (the callers keep their
PyTorch path: `ops.mamba2`, `ops.mamba1`, `ops.conv1d` are the references)."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.conv1d import CONV_MAX_HISTORY  # the native conv's history (kernels.c)
from hybridkv.ops.derived import derived
from hybridkv.ops.native.common import (
    FLOAT_DTYPES,
    contiguous_f32,
    is_bf16,
    is_f32_cpu,
    is_float_cpu,
)
from hybridkv.ops.native.spans import spans_cover, spans_inside, step_spans

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    # argument types in the C order; `# fmt: skip` keeps them one list per kernel
    "hkv_mamba2_scan": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                        _i64, _ptr, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _ptr, _ptr,
                        _ptr, _ptr, _i64, _i64],
    "hkv_conv1d": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _int,
                   _ptr, _ptr, _int, _int, _ptr, _ptr, _ptr, _i64, _i64],
    "hkv_mamba2_mix": [_ptr, _int, _i64, _ptr, _i64, _int, _ptr, _ptr, _i64, _int, _ptr, _i64,
                       _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr,
                       _ptr, _ptr, _f32, _f32, _ptr, _i64, _f32, _int, _int, _ptr, _int,
                       _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr],
    "hkv_mamba1_scan": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64,
                        _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr,
                        _ptr, _ptr, _ptr, _i64, _i64],
})  # fmt: skip
native.returns_status("hkv_mamba2_mix", "hkv_conv1d", "hkv_mamba1_scan")

# Speculative decoding's per-position states (docs/speculative-decoding.md, "State layers"):
# (scratch [rows, positions, *state shape] in the state's dtype, contiguous; rows [S] int64,
# each request's scratch row or -1). A kernel given them also writes the state after each of a
# request's tokens but its last to scratch[row, i]; None: nothing is kept.
Positions = tuple[torch.Tensor, torch.Tensor] | None


def position_args(positions: Positions, state: torch.Tensor) -> tuple:
    """(scratch pointer, rows pointer, row stride, position stride) for a kernel, all in
    elements of `state`; nothing (None, None, 0, 0) without positions."""
    if positions is None:
        return None, None, 0, 0
    scratch, rows = positions
    ok = (
        scratch.dtype == state.dtype
        and scratch.dim() == state.dim() + 1
        and scratch.shape[2:] == state.shape[1:]
        and scratch.is_contiguous()
        and rows.dtype == torch.int64
        and rows.is_contiguous()
    )
    if not ok:
        raise ValueError(
            f"per-position states: scratch {tuple(scratch.shape)} {scratch.dtype} and rows "
            f"{rows.dtype} do not fit a state {tuple(state.shape)} {state.dtype} (allowed: "
            "contiguous [rows, positions, *state shape] in the state's dtype, int64 rows)"
        )
    return scratch.data_ptr(), rows.data_ptr(), scratch.stride(0), scratch.stride(1)


def mamba2_scan(
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    positions: Positions = None,
) -> torch.Tensor | None:
    """The Mamba2 scan of packed requests natively (token by token, state in place); None when
    the kernels or these tensors are not supported. `positions`: also keep the state after
    every position (`Positions`).

    ssm_state: [num_pages, H, P, N] float32 or bfloat16 (a page-strided view; each page's
    [H, P, N] contiguous); state_pages: [S]; has_initial_state: [S] bool; query_start_loc:
    [S + 1]; x: [T, H, P]; dt: [T, H] processed; A, D: [H]; B, C: [T, G, N], all float32 ->
    y [T, H, P] float32.
    """
    lib = native.library()
    heads, head_dim, d_state = ssm_state.shape[1:]
    if lib is None or not is_f32_cpu(x, dt, A, B, C, D) or not is_float_cpu(ssm_state):
        return None
    if ssm_state.stride()[1:] != (head_dim * d_state, d_state, 1):
        return None
    x, dt, B, C = x.contiguous(), dt.contiguous(), B.contiguous(), C.contiguous()
    A, D = A.contiguous(), D.contiguous()
    pages, has, starts, lens = step_spans(state_pages, has_initial_state, query_start_loc)
    y = torch.empty_like(x)
    lib.hkv_mamba2_scan(
        ssm_state.data_ptr(), ssm_state.stride(0), is_bf16(ssm_state), pages.data_ptr(),
        has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0], heads, head_dim,
        d_state, B.shape[1], x.data_ptr(), heads * head_dim, dt.data_ptr(), A.data_ptr(),
        B.data_ptr(), C.data_ptr(), B.shape[1] * d_state, D.data_ptr(), y.data_ptr(),
        *position_args(positions, ssm_state),
    )  # fmt: skip
    return y


MAMBA1_DTYPES = (torch.float32, torch.bfloat16)  # of x, dt, z, B, C and of the state


def _unit_rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """t: [T, k] in `dtype` with unit column stride (a view when it already is)."""
    t = t.to(dtype)
    return t if t.stride(-1) == 1 or t.shape[-1] == 1 else t.contiguous()


def _f32_or_none(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else derived(t, "f32", contiguous_f32)


def mamba1_scan(
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
    positions: Positions = None,
) -> torch.Tensor | None:
    """The Mamba1 scan of packed requests natively (prefill chunks and decode steps, token by
    token, each state read and written once in its page; `ops.mamba1.mamba1_scan_varlen` is the
    reference, with the same arguments); None when the kernels or these tensors are not
    supported. `positions`: also keep the state after every position (`Positions`).

    x, dt (raw), z: [T, Di] and B, C: [T, N], float32 or bfloat16 (all as x; rows may be
    strided); A: [Di, N]; D, dt_bias: [Di] or None; ssm_state: [num_pages, Di, N] float32 or
    bfloat16 (a page-strided view, each page contiguous); state_pages, has_initial_state: [S];
    query_start_loc: [S + 1] -> y [T, Di] float32.
    """
    lib = native.library()
    if lib is None or x.dim() != 2 or x.dtype not in MAMBA1_DTYPES:
        return None
    tensors = [x, dt, A, B, C, ssm_state] + [t for t in (D, z, dt_bias) if t is not None]
    if any(t.device.type != "cpu" for t in tensors) or ssm_state.dtype not in MAMBA1_DTYPES:
        return None
    tokens, channels = x.shape
    d_state = A.shape[-1]
    if dt.shape != x.shape or (z is not None and z.shape != x.shape):
        return None
    if A.shape != (channels, d_state) or B.shape != (tokens, d_state) or C.shape != B.shape:
        return None
    if any(t is not None and t.shape != (channels,) for t in (D, dt_bias)):
        return None  # (a vector of another size would be read out of bounds)
    if ssm_state.shape[1:] != (channels, d_state) or ssm_state.stride()[1:] != (d_state, 1):
        return None
    if not spans_inside(
        state_pages, has_initial_state, query_start_loc, ssm_state.shape[0], tokens
    ):
        return None  # (pages and tokens must lie inside the state, x and y)
    pages, has, starts, lens = step_spans(state_pages, has_initial_state, query_start_loc)
    # y: rows outside every request stay zero (none when the requests cover the step's tokens)
    covered = spans_cover(state_pages, has_initial_state, query_start_loc, tokens)
    y = (torch.empty if covered else torch.zeros)(tokens, channels, dtype=torch.float32)
    if tokens == 0 or pages.numel() == 0 or channels == 0:
        return y
    dtype = x.dtype
    x, dt, B, C = (_unit_rows(t, dtype) for t in (x, dt, B, C))
    z = None if z is None else _unit_rows(z, dtype)
    A, D, dt_bias = A.to(torch.float32).contiguous(), _f32_or_none(D), _f32_or_none(dt_bias)
    failed = lib.hkv_mamba1_scan(
        ssm_state.data_ptr(), ssm_state.stride(0), int(ssm_state.dtype == torch.bfloat16),
        pages.data_ptr(), has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0],
        channels, d_state, x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0),
        None if z is None else z.data_ptr(), 0 if z is None else z.stride(0), B.data_ptr(),
        B.stride(0), C.data_ptr(), C.stride(0), int(dtype == torch.bfloat16), A.data_ptr(),
        None if D is None else D.data_ptr(), None if dt_bias is None else dt_bias.data_ptr(),
        y.data_ptr(), *position_args(positions, ssm_state),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native Mamba1 scan could not allocate its work space")
    return y


# CONV_MAX_HISTORY (imported above): HKV_CONV_MAX_HISTORY in kernels.c


def conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    silu: bool = False,
    round_bf16: bool = False,
    positions: Positions = None,
) -> torch.Tensor | None:
    """Causal conv1d of packed requests (prefill chunks and decode steps) natively, through silu
    when `silu` (else no activation), its float32 results rounded to bfloat16 values when
    `round_bf16`; None when the kernels or these tensors are not supported. `positions`: also
    keep the state after every position (`Positions`).

    x: [T, C] (rows may be strided; float32 or bfloat16, read in place); weight: [C, K]; bias:
    [C] or None; conv_state:
    [num_pages, C, K - 1] float32 or bfloat16 (page-strided, each page contiguous); state_pages,
    has_initial_state: [S]; query_start_loc: [S + 1] -> y [T, C] float32.
    """
    lib = native.library()
    tensors = (x, weight, conv_state) + (() if bias is None else (bias,))
    if lib is None or not is_float_cpu(*tensors) or x.dim() != 2:
        return None
    channels, width = weight.shape
    if width - 1 > CONV_MAX_HISTORY or conv_state.stride()[1:] != (width - 1, 1):
        return None
    if conv_state.shape[1:] != (channels, width - 1) or x.shape[1] != channels:
        return None  # (a state or rows of another width would be read out of bounds)
    if not spans_inside(
        state_pages, has_initial_state, query_start_loc, conv_state.shape[0], x.shape[0]
    ):
        return None  # (pages and tokens must lie inside the state, x and y)
    if x.stride(-1) != 1:
        x = x.contiguous()  # rows may be strided; float32 or bfloat16 rows are read in place
    # [K, C]: a tap's weights contiguous across channels (kept with the weight)
    wt = derived(weight, "conv_taps_f32", lambda w: w.t().float().contiguous())
    bias = None if bias is None else derived(bias, "f32", contiguous_f32)
    pages, has, starts, lens = step_spans(state_pages, has_initial_state, query_start_loc)
    y = torch.empty(x.shape, dtype=torch.float32)
    failed = lib.hkv_conv1d(
        conv_state.data_ptr(), conv_state.stride(0), is_bf16(conv_state), pages.data_ptr(),
        has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0], channels, width,
        x.data_ptr(), x.stride(0), is_bf16(x), wt.data_ptr(),
        None if bias is None else bias.data_ptr(), int(silu), int(round_bf16), y.data_ptr(),
        *position_args(positions, conv_state),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native conv1d could not allocate its work space")
    return y


def mamba2_mix(
    zxbcdt: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    scan: tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[float, float]],
    norm: tuple[torch.Tensor, int, float, bool, bool],
    n_groups: int,
    out_dtype: torch.dtype,
    positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """A whole Mamba2 mixer between its projections in one native call (hkv_mamba2_mix: conv,
    dt, scan, gated norm; states in place); None when not supported. `positions`: (conv
    scratch, ssm scratch, rows): also keep both states after every position (`Positions`).

    zxbcdt: [T, I + conv_dim + H] in_proj output (float32 or bfloat16, unit column stride);
    conv_weight: [conv_dim, K]; conv_state: [num_pages, conv_dim, K - 1]; ssm_state: [num_pages,
    H, P, N] (each float32 or bfloat16, pages contiguous); scan: (A, D, dt_bias, dt_limit) with
    [H] tensors; norm: (weight [I], group_size, eps, norm_before_gate, weight_in_fp32)
    -> [T, I] in out_dtype (a bf16 model's conv results rounded to bf16 values, as its conv).
    """
    lib = native.library()
    if lib is None or zxbcdt.dim() != 2 or zxbcdt.stride(1) != 1 or out_dtype not in FLOAT_DTYPES:
        return None
    tensors = (zxbcdt, conv_weight, conv_state, ssm_state)
    if not is_float_cpu(*tensors) or (conv_bias is not None and not is_float_cpu(conv_bias)):
        return None
    _, heads, head_dim, d_state = ssm_state.shape
    (conv_dim, width), inner = conv_weight.shape, heads * head_dim
    A, D, dt_bias, (dt_min, dt_max) = scan
    weight, group_size, eps, norm_before_gate, weight_in_fp32 = norm
    if zxbcdt.shape[1] != inner + conv_dim + heads or conv_dim != inner + 2 * n_groups * d_state:
        return None
    if width - 1 > CONV_MAX_HISTORY or conv_state.stride()[1:] != (width - 1, 1):
        return None
    if conv_state.shape[1:] != (conv_dim, width - 1):
        return None  # (a state of another width would be read out of bounds)
    if not spans_inside(
        state_pages, has_initial_state, query_start_loc,
        min(conv_state.shape[0], ssm_state.shape[0]), zxbcdt.shape[0],
    ):  # fmt: skip
        return None  # (pages and tokens must lie inside the states and zxbcdt)
    if ssm_state.stride()[1:] != (head_dim * d_state, d_state, 1) or inner % group_size:
        return None
    if weight.numel() != inner or any(t.numel() != heads for t in (A, D, dt_bias)):
        return None
    f32 = [derived(t, "f32", contiguous_f32) for t in (A, D, dt_bias, weight)]
    wt = derived(conv_weight, "conv_taps_f32", lambda w: w.t().float().contiguous())
    bias = None if conv_bias is None else derived(conv_bias, "f32", contiguous_f32)
    pages, has, starts, lens = step_spans(state_pages, has_initial_state, query_start_loc)
    tokens = zxbcdt.shape[0]
    out = torch.empty(tokens, inner, dtype=out_dtype)
    failed = lib.hkv_mamba2_mix(
        zxbcdt.data_ptr(), is_bf16(zxbcdt), zxbcdt.stride(0), conv_state.data_ptr(),
        conv_state.stride(0), is_bf16(conv_state), wt.data_ptr(),
        None if bias is None else bias.data_ptr(), width, is_bf16(zxbcdt), ssm_state.data_ptr(),
        ssm_state.stride(0), is_bf16(ssm_state), pages.data_ptr(), has.data_ptr(),
        starts.data_ptr(), lens.data_ptr(), pages.shape[0], tokens, heads, head_dim, d_state,
        n_groups, f32[0].data_ptr(), f32[1].data_ptr(), f32[2].data_ptr(), dt_min, dt_max,
        f32[3].data_ptr(), group_size, eps, int(norm_before_gate), int(weight_in_fp32),
        out.data_ptr(), is_bf16(out), *_mixposition_args(positions, conv_state, ssm_state),
    )  # fmt: skip
    return None if failed else out


def _mixposition_args(
    positions: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    conv_state: torch.Tensor,
    ssm_state: torch.Tensor,
) -> tuple:
    """hkv_mamba2_mix's last seven arguments (the two kernels' position arguments)."""
    if positions is None:
        return None, 0, 0, None, 0, 0, None
    conv, ssm, rows = positions
    conv_ptr, rows_ptr, conv_row, conv_pos = position_args((conv, rows), conv_state)
    ssm_ptr, _, ssm_row, ssm_pos = position_args((ssm, rows), ssm_state)
    return conv_ptr, conv_row, conv_pos, ssm_ptr, ssm_row, ssm_pos, rows_ptr
