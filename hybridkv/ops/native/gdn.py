"""The gated delta rule of packed requests (`hkv_gated_delta_rule` in `kernels.c`: prefill
chunks and decode steps, token by token) and the argument checks and forms that its other
kernels share (`gdn_decode.py`, `gdn_chunk.py`: `gdn_dims`, `GDNArgs`). Qwen3-Next, Qwen3.5
(one thread, 24 value heads of 64 x 64 state): 2048 prefill tokens from 144 to 8.2 ms, a decode
step of 64 requests from 16 to 1.2 ms. `ops.gated_delta` is the reference."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from hybridkv.ops import native
from hybridkv.ops.native.common import is_bf16
from hybridkv.ops.native.spans import spans_inside, step_spans
from hybridkv.ops.native.ssm import Positions, position_args

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
native.declare({
    "hkv_gated_delta_rule": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64,
                             _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr,
                             _ptr, _ptr, _i64, _i64],
})  # fmt: skip
native.returns_status("hkv_gated_delta_rule")  # (a failed work-space allocation)

GDN_DTYPES = (torch.float32, torch.bfloat16)  # of q, k, v and of the state


def head_rows(x: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D] with each token's heads contiguous (a view when they are): the rows the
    gated delta rule kernels read at a token stride."""
    if x.stride(2) == 1 and (x.shape[1] == 1 or x.stride(1) == x.shape[2]):
        return x
    return x.contiguous()


def float32_output(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`out`, or a new float32 tensor of `shape` when None; None when `out` does not fit."""
    if out is None:
        return torch.empty(shape, dtype=torch.float32)
    fits = out.shape == shape and out.dtype == torch.float32 and out.is_contiguous()
    return out if fits else None


def gdn_dims(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    state_pages: torch.Tensor,
    has_initial_state: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> tuple[int, int, int, int, int] | None:
    """(T, Hk, Hv, K, V) when the gated delta rule's arguments agree as every native kernel of
    the rule needs (shapes below, CPU tensors, each state page contiguous, every page and token
    span inside the tensors); None otherwise. Dtypes are each kernel's own check.

    q, k: [T, Hk, K]; v: [T, Hv, V] (Hk divides Hv); g, beta: [T, Hv]; state:
    [num_pages, Hv, K, V]; state_pages, has_initial_state: [S]; query_start_loc: [S + 1].
    """
    if q.dim() != 3 or v.dim() != 3 or q.shape != k.shape:
        return None
    if any(t.device.type != "cpu" for t in (q, k, v, g, beta, state)):
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
    if not spans_inside(state_pages, has_initial_state, query_start_loc, state.shape[0], tokens):
        return None  # (pages and tokens must lie inside the state, q, k, v and o)
    return tokens, heads_k, heads_v, dim_k, dim_v


@dataclass(frozen=True)
class GDNArgs:
    """The arguments that the rule's kernels (hkv_gated_delta_rule, hkv_gdn_decode,
    hkv_gdn_chunk) take first, in their order: `leading()`. It holds the tensors whose
    pointers it passes, so they live as long as the call's arguments are in use."""

    state: torch.Tensor
    spans: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    dims: tuple[int, int, int, int, int]
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def prepare(
        cls,
        dims: tuple[int, int, int, int, int],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
        state_pages: torch.Tensor,
        has_initial_state: torch.Tensor,
        query_start_loc: torch.Tensor,
    ) -> GDNArgs:
        """`gdn_dims`' checked arguments in the forms the kernels read: q, k, v heads
        contiguous per token, g and beta float32 contiguous, the spans as int64 arrays."""
        spans = step_spans(state_pages, has_initial_state, query_start_loc)
        g, beta = g.to(torch.float32).contiguous(), beta.to(torch.float32).contiguous()
        return cls(state, spans, dims, head_rows(q), head_rows(k), head_rows(v), g, beta)

    def leading(self) -> tuple[Any, ...]:
        pages, has, starts, lens = self.spans
        _, heads_k, heads_v, dim_k, dim_v = self.dims
        q, k, v, state = self.q, self.k, self.v, self.state
        return (
            state.data_ptr(), state.stride(0), is_bf16(state), pages.data_ptr(), has.data_ptr(),
            starts.data_ptr(), lens.data_ptr(), pages.shape[0], heads_k, heads_v, dim_k, dim_v,
            q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
            is_bf16(q), self.g.data_ptr(), self.beta.data_ptr(),
        )  # fmt: skip


def gated_delta_rule(
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
    """The gated delta rule of packed requests natively (prefill chunks and decode steps, token
    by token, each state read and written once in its page; `ops.gated_delta` is the reference);
    None when the kernels or these tensors are not supported. `positions`: also keep the state
    after every position (`ops.native.ssm.Positions`; such a request runs one token at a time).

    q, k: [T, Hk, K] raw (normalised in the kernel); v: [T, Hv, V]; q, k, v all float32 or all
    bfloat16 (token rows may be strided); g, beta: [T, Hv] (float32); state:
    [num_pages, Hv, K, V] float32 or bfloat16 (a page-strided view, each page contiguous);
    state_pages, has_initial_state: [S]; query_start_loc: [S + 1] -> o [T, Hv, V] float32.
    """
    lib = native.library()
    if lib is None or not q.dtype == k.dtype == v.dtype:
        return None
    if q.dtype not in GDN_DTYPES or state.dtype not in GDN_DTYPES:
        return None
    spans = (state_pages, has_initial_state, query_start_loc)
    dims = gdn_dims(q, k, v, g, beta, state, *spans)
    if dims is None:
        return None
    tokens, _, heads_v, _, dim_v = dims
    o = torch.empty(tokens, heads_v, dim_v, dtype=torch.float32)
    args = GDNArgs.prepare(dims, q, k, v, g, beta, state, *spans)
    if tokens == 0 or args.spans[0].numel() == 0:
        return o
    failed = lib.hkv_gated_delta_rule(
        *args.leading(), o.data_ptr(), *position_args(positions, state)
    )
    if failed:
        raise MemoryError("the native gated delta rule could not allocate its work space")
    return o
