"""The gated delta rule's decode step natively (`gdn_decode.c`, compiled into the one native
library): its ctypes signature and the checks that keep it inside its tensors.
`hybridkv.ops.gdn_ops.NativeGDNOps` calls it for steps whose requests all have one token (the
general `gdn.gated_delta_rule` takes the others); `hybridkv.ops.gated_delta` is the
reference of the tests."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native
from hybridkv.ops.native import gdn

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_gdn_decode": [_ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                       _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr, _ptr, _ptr, _ptr,
                       _i64, _ptr, _f32],
})  # fmt: skip
native.returns_status("hkv_gdn_decode")

DTYPES = (torch.float32, torch.bfloat16)  # of q, k, v and of the state
MAX_K = 1024  # the kernel's limit on the key head dim (its normalised q and k on the stack)


def gdn_decode(
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
    norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
) -> torch.Tensor | None:
    """One decode step of the gated delta rule for the requests of one token, states read and
    written in their pages; None when the kernel or these tensors are not supported (the
    arguments are `gdn.gated_delta_rule`'s). Rows of longer requests in `out` (o, made when
    None) are left as they are.

    norm = (z [T, Hv * V] bfloat16 with unit column stride, weight [V] float32, eps): each
    head's o goes on through Qwen3-Next's gated norm (`ops.norm.gated_rms_norm(bf16(o), z,
    weight, eps, V, norm_before_gate=True)`, as its native kernel computes it) and the result is
    y [T, Hv * V] bfloat16 instead of o (every request must have one token then).

    q, k: [T, Hk, K] raw (normalised in the kernel); v: [T, Hv, V]; q, k, v all float32 or all
    bfloat16; g, beta: [T, Hv] float32; state: [num_pages, Hv, K, V] float32 or bfloat16 (each
    page contiguous); state_pages, has_initial_state: [T]; query_start_loc: [T + 1]
    -> o [T, Hv, V] float32.
    """
    lib = native.library()
    if lib is None or not q.dtype == k.dtype == v.dtype:
        return None
    if q.dtype not in DTYPES or state.dtype not in DTYPES:
        return None
    spans = (state_pages, has_initial_state, query_start_loc)
    dims = gdn.gdn_dims(q, k, v, g, beta, state, *spans)
    if dims is None or dims[3] > MAX_K:
        return None
    tokens, _, heads_v, _, dim_v = dims
    o = gdn.float32_output(out, (tokens, heads_v, dim_v)) if norm is None else None
    y = z = weight = None
    eps = 0.0
    if norm is not None:
        z, weight, eps = norm
        if out is not None or z.shape != (tokens, heads_v * dim_v) or z.stride(1) != 1:
            return None
        if z.dtype != torch.bfloat16 or weight.dtype != torch.float32 or weight.shape != (dim_v,):
            return None
        if dim_v > MAX_K or not weight.is_contiguous():
            return None
        y = torch.empty(tokens, heads_v * dim_v, dtype=torch.bfloat16)
    elif o is None:
        return None
    result = o if y is None else y
    if tokens == 0:
        return result
    args = gdn.GDNArgs.prepare(dims, q, k, v, g, beta, state, *spans)
    failed = lib.hkv_gdn_decode(
        *args.leading(), None if o is None else o.data_ptr(), None if y is None else y.data_ptr(),
        None if z is None else z.data_ptr(), 0 if z is None else z.stride(0),
        None if weight is None else weight.data_ptr(), eps,
    )  # fmt: skip
    if failed:
        raise ValueError(f"the native gated delta rule decode takes K, V <= {MAX_K}")
    return result
