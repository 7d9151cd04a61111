"""Qwen3-Next's gated delta net between its projections and its conv1d natively (`gdn_prep.c`,
compiled into the one native library): the key-head-grouped projection outputs split into the
conv1d's [q | k | v] rows and z, and the rule's gates, in one pass. `hybridkv.layers.
gated_delta_net.GatedDeltaNet` calls it for the "qwen3_next" layout; its PyTorch path (the
reference of the tests) runs where this returns None."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
native.declare({
    "hkv_gdn_prep": [_ptr, _i64, _ptr, _i64, _int, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr,
                     _ptr, _ptr, _ptr, _ptr],
})  # fmt: skip

DTYPES = (torch.float32, torch.bfloat16)


def prep(
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    num_k_heads: int,
    per: int,
    head_k_dim: int,
    head_v_dim: int,
    decay: torch.Tensor,
    dt_bias: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """qkvz [T, Hk * (2K + 2 per V)] and ba [T, Hk * 2 per] (Qwen3-Next's projections, grouped
    by key head; float32 or bfloat16 alike, unit column stride); decay = -exp(A_log) and dt_bias
    float32 [Hv] -> qkv [T, 2 Hk K + Hv V] ([q | k | v]), z [T, Hv V] (qkvz's dtype), g and
    beta [T, Hv] float32 (`ops.gated_delta.gdn_gates`); None when the kernel or these tensors
    don't fit."""
    lib = native.library()
    hv = num_k_heads * per
    if lib is None or qkvz.dim() != 2 or ba.dim() != 2 or qkvz.dtype not in DTYPES:
        return None
    if ba.dtype != qkvz.dtype or any(t.device.type != "cpu" for t in (qkvz, ba, decay, dt_bias)):
        return None
    tokens = qkvz.shape[0]
    if qkvz.shape[1] != num_k_heads * (2 * head_k_dim + 2 * per * head_v_dim):
        return None
    if ba.shape != (tokens, 2 * hv) or qkvz.stride(1) != 1 or ba.stride(1) != 1:
        return None
    if decay.shape != (hv,) or dt_bias.shape != (hv,):
        return None
    if decay.dtype != torch.float32 or dt_bias.dtype != torch.float32:
        return None
    decay, dt_bias = decay.contiguous(), dt_bias.contiguous()
    qkv = torch.empty(tokens, 2 * num_k_heads * head_k_dim + hv * head_v_dim, dtype=qkvz.dtype)
    z = torch.empty(tokens, hv * head_v_dim, dtype=qkvz.dtype)
    g = torch.empty(tokens, hv, dtype=torch.float32)
    beta = torch.empty(tokens, hv, dtype=torch.float32)
    lib.hkv_gdn_prep(
        qkvz.data_ptr(), qkvz.stride(0), ba.data_ptr(), ba.stride(0),
        int(qkvz.dtype == torch.bfloat16), tokens, num_k_heads, per, head_k_dim, head_v_dim,
        decay.data_ptr(), dt_bias.data_ptr(), qkv.data_ptr(), z.data_ptr(), g.data_ptr(),
        beta.data_ptr(),
    )  # fmt: skip
    return qkv, z, g, beta
