"""The native KDA kernels (`kda.c`, compiled into the one native library): ctypes signatures and
the checks that keep them inside their tensors. `hybridkv.ops.kda` is the reference of the rule;
`gates` and `out_norm` are the layer's glue around it (`hybridkv.layers.kda`: `kda_gate` with
the sigmoid of beta, and `sigmoid_gated_rms_norm`)."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.native.spans import spans_inside, step_spans
from hybridkv.ops.native.ssm import Positions, position_args

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_kda_rule": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _ptr,
                     _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _ptr, _i64,
                     _i64],
    "hkv_kda_gates": [_ptr, _i64, _ptr, _i64, _int, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr],
    "hkv_kda_out_norm": [_ptr, _ptr, _i64, _ptr, _ptr, _int, _i64, _i64, _f32],
})  # fmt: skip
native.returns_status("hkv_kda_rule")  # (a failed work-space allocation)

DTYPES = (torch.float32, torch.bfloat16)  # of q, k, v and of the state


def available() -> bool:
    return native.library() is not None


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] with each token's heads contiguous (a view when they are)."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def _fits(q, k, v, g, beta, state) -> bool:
    tensors = (q, k, v, g, beta, state)
    if any(t.device.type != "cpu" for t in tensors) or q.dim() != 3 or v.dim() != 3:
        return False
    if not q.dtype == k.dtype == v.dtype or q.dtype not in DTYPES or state.dtype not in DTYPES:
        return False
    tokens, heads, dim_k = q.shape
    dim_v = v.shape[2]
    if k.shape != q.shape or g.shape != q.shape or v.shape[:2] != (tokens, heads):
        return False
    if beta.shape != (tokens, heads) or state.shape[1:] != (heads, dim_k, dim_v):
        return False
    return state.stride()[1:] == (dim_k * dim_v, dim_v, 1)


def kda_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: Positions = None,
) -> torch.Tensor | None:
    """KDA of packed requests natively (prefill chunks and decode steps alike, token by token,
    each state read and written once in its page); None when the kernels or these tensors are
    not supported. `positions`: also keep the state after every position
    (`ops.native.ssm.Positions`).

    q, k: [T, H, K] raw (normalised in the kernel); v: [T, H, V]; q, k, v all float32 or all
    bfloat16; g: [T, H, K] log decay; beta: [T, H]; state: [num_pages, H, K, V] float32 or
    bfloat16 (a page-strided view, each page contiguous); state_pages, has_initial_state: [S];
    query_start_loc: [S + 1] -> o [T, H, V] float32.
    """
    lib = native.library()
    if lib is None or not _fits(q, k, v, g, beta, state):
        return None
    tokens, heads, dim_k = q.shape
    dim_v = v.shape[2]
    if not spans_inside(state_pages, has_initial_state, query_start_loc, state.shape[0], tokens):
        return None  # pages and tokens must lie inside the state, q, k, v and o
    pages, has, starts, lens = step_spans(state_pages, has_initial_state, query_start_loc)
    o = torch.empty(tokens, heads, dim_v, dtype=torch.float32)
    if tokens == 0 or pages.numel() == 0:
        return o
    q, k, v = _rows(q), _rows(k), _rows(v)
    g, beta = g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous()
    failed = lib.hkv_kda_rule(
        state.data_ptr(), state.stride(0), int(state.dtype == torch.bfloat16), pages.data_ptr(),
        has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0], heads, dim_k, dim_v,
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        int(q.dtype == torch.bfloat16), g.data_ptr(), beta.data_ptr(), o.data_ptr(),
        *position_args(positions, state),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native KDA rule could not allocate its work space")
    return o


def _f32_vector(t: torch.Tensor, n: int) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.numel() == n


def gates(
    f: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, dt_bias: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """f [T, H * K] (f_b_proj's output), b [T, H] (b_proj's), both float32 or both bfloat16
    with unit column stride; decay = -exp(A_log) float32 [H] and dt_bias float32 [H * K]
    contiguous -> g [T, H, K] float32 (`ops.kda.kda_gate`), beta [T, H] float32 (sigmoid(b) in
    b's dtype, widened); None when the kernel or these tensors don't fit."""
    lib = native.library()
    if lib is None or f.dim() != 2 or b.dim() != 2 or f.dtype != b.dtype or f.dtype not in DTYPES:
        return None
    tokens, heads = b.shape
    if f.shape != (tokens, heads * head_dim) or f.stride(1) != 1 or b.stride(1) != 1:
        return None
    if f.device.type != "cpu" or b.device.type != "cpu":
        return None
    if not _f32_vector(decay, heads) or not _f32_vector(dt_bias, heads * head_dim):
        return None
    decay, dt_bias = decay.contiguous(), dt_bias.contiguous()
    g = torch.empty(tokens, heads, head_dim, dtype=torch.float32)
    beta = torch.empty(tokens, heads, dtype=torch.float32)
    lib.hkv_kda_gates(
        f.data_ptr(), f.stride(0), b.data_ptr(), b.stride(0), int(f.dtype == torch.bfloat16),
        tokens, heads, head_dim, decay.data_ptr(), dt_bias.data_ptr(), g.data_ptr(),
        beta.data_ptr(),
    )  # fmt: skip
    return g, beta


def out_norm(
    o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """o [rows, D] float32 contiguous (the rule's output, a row per token and head), gate
    [rows, D] of the model dtype (float32 or bfloat16, unit column stride), weight float32 [D]
    -> w * rmsnorm(o in the model dtype) * sigmoid(gate) in the model dtype, the float32
    products rounded once (`layers.kda.sigmoid_gated_rms_norm` of o.to(gate.dtype)); None
    when the kernel or these tensors don't fit."""
    lib = native.library()
    if lib is None or o.dim() != 2 or gate.dim() != 2 or o.dtype != torch.float32:
        return None
    rows, dim = o.shape
    if gate.shape != (rows, dim) or gate.dtype not in DTYPES or gate.stride(1) != 1:
        return None
    if not o.is_contiguous() or o.device.type != "cpu" or gate.device.type != "cpu":
        return None
    if not _f32_vector(weight, dim):
        return None
    weight = weight.contiguous()
    out = torch.empty(rows, dim, dtype=gate.dtype)
    lib.hkv_kda_out_norm(
        o.data_ptr(), gate.data_ptr(), gate.stride(0), weight.data_ptr(), out.data_ptr(),
        int(gate.dtype == torch.bfloat16), rows, dim, eps,
    )  # fmt: skip
    return out
