"""The gated delta rule's prefill in chunks on AMX tiles natively (`gdn_chunk.c`, compiled into
the one native library): its ctypes signature and the checks that keep it inside its tensors.
`hybridkv.ops.gdn_ops.NativeGDNOps` calls it for the requests of more than one token when q, k
and v are bfloat16 (one-token requests go to `gdn_decode`, other dtypes to the general
`gdn.gated_delta_rule`); `hybridkv.ops.gated_delta` is the reference of the tests."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.native import gdn, moe

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
native.declare({
    "hkv_gdn_chunk": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                      _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr],
})  # fmt: skip
native.returns_status("hkv_gdn_chunk")

STATE_DTYPES = (torch.float32, torch.bfloat16)
MAX_DIM = 256  # K and V: multiples of 32 up to this


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
    states read and written once in their pages (the arguments are `gdn.gated_delta_rule`'s);
    None when the kernel or these tensors are not supported. Rows of one-token requests in `out`
    (o [T, Hv, V] float32, made when None) are left as they are."""
    lib = native.library()
    if lib is None or not applies(q, v, state) or k.dtype != q.dtype:
        return None
    spans = (state_pages, has_initial_state, query_start_loc)
    dims = gdn.gdn_dims(q, k, v, g, beta, state, *spans)
    if dims is None:
        return None
    tokens, _, heads_v, _, dim_v = dims
    out = gdn.float32_output(out, (tokens, heads_v, dim_v))
    if out is None or tokens == 0:
        return out
    args = gdn.GDNArgs.prepare(dims, q, k, v, g, beta, state, *spans)
    if lib.hkv_gdn_chunk(*args.leading(), out.data_ptr()):
        raise MemoryError("the native chunked gated delta rule could not allocate its work space")
    return out
