"""The gated delta rule's prefill in chunks on AMX tiles natively (`gdn_chunk.c`, compiled into
the one native library): its ctypes signature and the checks that keep it inside its tensors.
`hybridkv.ops.gdn_ops.NativeGDNOps` calls it for the requests of more than one token when q, k
and v are bfloat16 (one-token requests go to `gdn_decode`, other dtypes to the general
`native.gated_delta_rule`); `hybridkv.ops.gated_delta` is the reference of the tests."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.native import moe

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
native.declare({
    "hkv_gdn_chunk": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                      _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr],
})  # fmt: skip
native.returns_status("hkv_gdn_chunk")

STATE_DTYPES = (torch.float32, torch.bfloat16)
MAX_DIM = 256  # K and V: multiples of 32 up to this


def _output(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`out`, or a new float32 tensor of `shape` when None; None when `out` does not fit."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    fits = out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()
    return out if fits else None


def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] with each token's heads contiguous (a view when they are)."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def applies(q: torch.Tensor, v: torch.Tensor, state: torch.Tensor) -> bool:
    """bfloat16 q, k, v (the raw values the AMX products take exactly), a float32 or bfloat16
    state, head dims the kernel's tiles fit, a CPU with AMX."""
    if q.dtype != torch.bfloat16 or v.dtype != torch.bfloat16 or state.dtype not in STATE_DTYPES:
        return False
    if q.dim() != 3 or v.dim() != 3 or q.device.type != "cpu" or state.device.type != "cpu":
        return False
    dim_k, dim_v = q.shape[2], v.shape[2]
    if dim_k % 32 or dim_v % 32 or dim_k > MAX_DIM or dim_v > MAX_DIM:
        return False
    return moe.available()


def gdn_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The requests of more than one token through the gated delta rule in chunks of 64 tokens,
    states read and written once in their pages (the arguments are `native.gated_delta_rule`'s);
    None when the kernel or these tensors are not supported. Rows of one-token requests in `out`
    (o [T, Hv, V] float32, made when None) are left as they are."""
    lib = native.library()
    if lib is None or not applies(q, v, state) or q.shape != k.shape or k.dtype != q.dtype:
        return None
    if any(t.device.type != "cpu" for t in (k, v, g, beta)):
        return None
    tokens, heads_k, dim_k = q.shape
    heads_v, dim_v = v.shape[1:]
    if v.shape[0] != tokens or heads_k == 0 or heads_v % heads_k:
        return None
    if g.shape != (tokens, heads_v) or beta.shape != g.shape:
        return None
    if state.shape[1:] != (heads_v, dim_k, dim_v):
        return None
    if state.stride()[1:] != (dim_k * dim_v, dim_v, 1):
        return None
    if not native._spans_inside(
        state_pages, has_initial_state, query_start_loc, state.shape[0], tokens
    ):
        return None  # (pages and tokens must lie inside the state, q, k, v and o)
    out = _output(out, (tokens, heads_v, dim_v))
    if out is None:
        return None
    if tokens == 0:
        return out
    pages, has, starts, lens = native._spans(state_pages, has_initial_state, query_start_loc)
    q, k, v = _head_rows(q), _head_rows(k), _head_rows(v)
    g, beta = g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous()
    failed = lib.hkv_gdn_chunk(
        state.data_ptr(), state.stride(0), int(state.dtype == torch.bfloat16), pages.data_ptr(),
        has.data_ptr(), starts.data_ptr(), lens.data_ptr(), pages.shape[0], heads_k, heads_v,
        dim_k, dim_v, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
        v.stride(0), 1, g.data_ptr(), beta.data_ptr(), out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise MemoryError("the native chunked gated delta rule could not allocate its work space")
    return out
