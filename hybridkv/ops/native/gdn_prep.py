"""Qwen3-Next's glue between GEMMs natively (`gdn_prep.c`, compiled into the one native
library): `prep`, the gated delta net's key-head-grouped projection outputs split into the
conv1d's [q | k | v] rows and z, and the rule's gates, in one pass (`hybridkv.layers.
gated_delta_net.GatedDeltaNet`, "qwen3_next" layout); `gates`, the rule's gates alone (the
"qwen3_5" layout, whose b and a have their own projections); `sigmoid_gate`, the gated
attention's output gate (`hybridkv.models.qwen3_next.GatedAttention`). Their PyTorch paths (the
references of the tests) run where these return None."""

from __future__ import annotations

import ctypes

import torch

from hybridkv.ops import native

_i64, _int, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
native.declare({
    "hkv_gdn_prep": [_ptr, _i64, _ptr, _i64, _int, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr,
                     _ptr, _ptr, _ptr, _ptr],
    "hkv_gdn_gates": [_ptr, _i64, _ptr, _i64, _int, _i64, _i64, _ptr, _ptr, _ptr, _ptr],
    "hkv_sigmoid_gate": [_ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _int, _ptr],
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
    if ba.dtype != qkvz.dtype or qkvz.device.type != "cpu" or ba.device.type != "cpu":
        return None
    tokens = qkvz.shape[0]
    if qkvz.shape[1] != num_k_heads * (2 * head_k_dim + 2 * per * head_v_dim):
        return None
    if ba.shape != (tokens, 2 * hv) or qkvz.stride(1) != 1 or ba.stride(1) != 1:
        return None
    if not _gate_params_fit(decay, dt_bias, hv):
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


def _gate_params_fit(decay: torch.Tensor, dt_bias: torch.Tensor, hv: int) -> bool:
    """decay and dt_bias are float32 [Hv] on the CPU."""
    return all(
        t.shape == (hv,) and t.dtype == torch.float32 and t.device.type == "cpu"
        for t in (decay, dt_bias)
    )


def gates(
    a: torch.Tensor, b: torch.Tensor, decay: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """a, b [T, Hv] (both float32 or both bfloat16, unit column stride), decay = -exp(A_log)
    and dt_bias float32 [Hv] -> g, beta [T, Hv] float32 (`ops.gated_delta.gdn_gates`); None
    when the kernel or these tensors don't fit."""
    lib = native.library()
    if lib is None or a.dim() != 2 or a.shape != b.shape or a.dtype != b.dtype:
        return None
    tokens, hv = a.shape
    if a.dtype not in DTYPES or a.stride(1) != 1 or b.stride(1) != 1:
        return None
    if a.device.type != "cpu" or b.device.type != "cpu" or not _gate_params_fit(decay, dt_bias, hv):
        return None
    decay, dt_bias = decay.contiguous(), dt_bias.contiguous()
    g = torch.empty(tokens, hv, dtype=torch.float32)
    beta = torch.empty(tokens, hv, dtype=torch.float32)
    lib.hkv_gdn_gates(
        a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), int(a.dtype == torch.bfloat16),
        tokens, hv, decay.data_ptr(), dt_bias.data_ptr(), g.data_ptr(), beta.data_ptr(),
    )  # fmt: skip
    return g, beta


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    """x * sigmoid(gate) rounded as PyTorch rounds it: x [T, H * D] contiguous; gate [T, H, D]
    with unit last stride (a view of each head's [query | gate] projection); both float32 or
    both bfloat16 -> [T, H * D]; None when the kernel or these tensors don't fit."""
    lib = native.library()
    if lib is None or x.dim() != 2 or gate.dim() != 3 or x.dtype != gate.dtype:
        return None
    if x.dtype not in DTYPES or x.device.type != "cpu" or gate.device.type != "cpu":
        return None
    tokens, heads, dim = gate.shape
    if x.shape != (tokens, heads * dim) or not x.is_contiguous() or gate.stride(2) != 1:
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.hkv_sigmoid_gate(
        x.data_ptr(), gate.data_ptr(), gate.stride(0), gate.stride(1), tokens, heads, dim,
        int(x.dtype == torch.bfloat16), out.data_ptr(),
    )  # fmt: skip
    return out
