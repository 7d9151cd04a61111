"""RMS normalisation as the Hugging Face hybrid families compute it (float32 inside).

Where the families differ (read in transformers 5.x):

- Plain RMSNorm. Bamba, GraniteMoeHybrid, Falcon-H1 and Zamba2 cast the normalised value back to
  the input dtype and *then* multiply by the weight (Llama style: `weight * x_hat.to(dtype)`).
  NemotronH multiplies by the weight in float32 and casts the product (`weight_in_fp32=True`).
- Gated RMSNorm of the Mamba2 mixers. Bamba, GraniteMoeHybrid, NemotronH and Zamba2 gate first
  (`x * silu(gate)`), normalise per group of `intermediate_size // n_groups` channels, cast to the
  input dtype, then multiply by the weight. Falcon-H1 differs: it multiplies by the weight in
  float32 before the cast, and by default (`mamba_norm_before_gate=True`) it normalises first
  and gates after (`norm_before_gate=True`, `weight_in_fp32=True` here).

In float32 every variant gives the same numbers up to rounding order; they differ in bf16/fp16.
All functions return the input dtype. Each is an op family (`hybridkv.ops.registry`): in
float32 and bfloat16 on the CPU the native kernels (`hybridkv.ops.native.norms`) compute each
in one pass over memory, rounding bfloat16 where the code here does; the code here is the
reference and the implementation for other dtypes and devices, or without a compiler. Which
runs is chosen once per device and dtype (`hybridkv plan --platform cpu` prints it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

_NATIVE = "hybridkv.ops.native.norms:"
_CPU = frozenset({"cpu"})


def _native(fn: str) -> OpImpl:
    return OpImpl("native", _NATIVE + fn, _CPU, CPU_FLOATS, ("native",), strict=True,
                  description="one pass over the rows (C)")  # fmt: skip


RMS_NORM = declare("rms_norm", (_native("rms_norm"), OpImpl("torch", f"{__name__}:torch_rms_norm")))
ADD_RMS_NORM = declare(
    "add_rms_norm", (_native("add_rms_norm"), OpImpl("torch", f"{__name__}:torch_add_rms_norm"))
)
GATED_RMS_NORM = declare(
    "gated_rms_norm",
    (_native("gated_rms_norm"), OpImpl("torch", f"{__name__}:torch_gated_rms_norm")),
)


def _normalise(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dimension; x is float32."""
    variance = x.pow(2).mean(-1, keepdim=True)
    return x * torch.rsqrt(variance + eps)


def _apply_weight(
    x_hat: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype, weight_in_fp32: bool
) -> torch.Tensor:
    """Multiply the float32 normalised value by the weight, in the family's order, -> `dtype`."""
    if weight_in_fp32:
        return (weight.float() * x_hat).to(dtype)
    return (weight * x_hat.to(dtype)).to(dtype)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False
) -> torch.Tensor:
    """RMSNorm over the last dimension. x: [..., hidden]; weight: [hidden] -> [..., hidden]."""
    return RMS_NORM.of(x, weight).first(x, weight, eps, weight_in_fp32)


def torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False
) -> torch.Tensor:
    x_hat = _normalise(x.float(), eps)
    return _apply_weight(x_hat, weight, x.dtype, weight_in_fp32)


def add_rms_norm(
    x: torch.Tensor,
    h: torch.Tensor,
    multiplier: float,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A residual add and the next norm: (s, rms_norm(s)) with s = x + h * multiplier.
    x, h: [..., hidden] of one dtype; weight: [hidden]."""
    return ADD_RMS_NORM.of(x, h, weight).first(x, h, multiplier, weight, eps, weight_in_fp32)


def torch_add_rms_norm(
    x: torch.Tensor,
    h: torch.Tensor,
    multiplier: float,
    weight: torch.Tensor,
    eps: float,
    weight_in_fp32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    total = x + (h if multiplier == 1.0 else h * multiplier)
    return total, torch_rms_norm(total, weight, eps, weight_in_fp32)


def gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
    weight_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Gated, grouped RMSNorm of a Mamba2 mixer output, computed in x's dtype and returned in
    `out_dtype` (default x's; a float32 scan output normed and cast to the model dtype).

    x, gate: [..., channels]; weight: [channels]; channels % group_size == 0 -> [..., channels].
    Default (Bamba, GraniteMoeHybrid, NemotronH, Zamba2): normalise(x * silu(gate)) per group of
    `group_size` channels, cast to x.dtype, times weight. Falcon-H1: `norm_before_gate=True,
    weight_in_fp32=True` gives silu(gate) * (weight * normalise(x)) computed in float32.
    """
    if gate is None:  # a plain grouped norm (no kernel of its own): the reference
        return torch_gated_rms_norm(
            x, gate, weight, eps, group_size, norm_before_gate, weight_in_fp32, out_dtype
        )
    run = GATED_RMS_NORM.of(x, gate).first
    return run(x, gate, weight, eps, group_size, norm_before_gate, weight_in_fp32, out_dtype)


def torch_gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool = False,
    weight_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    out = _gated_rms_norm(x, gate, weight, eps, group_size, norm_before_gate, weight_in_fp32)
    return out if out_dtype is None else out.to(out_dtype)


def _gated_rms_norm(
    x: torch.Tensor,
    gate: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    weight_in_fp32: bool,
) -> torch.Tensor:
    """The PyTorch reference of `gated_rms_norm`, in x's dtype."""
    dtype = x.dtype
    xf = x.float()
    gate_f = None if gate is None else F.silu(gate.float())
    if gate_f is not None and not norm_before_gate:
        xf = xf * gate_f
    *prefix, channels = xf.shape
    # grouped: [..., n_groups, group_size]
    grouped = xf.reshape(*prefix, channels // group_size, group_size)
    x_hat = _normalise(grouped, eps).reshape(*prefix, channels)
    if gate_f is not None and norm_before_gate:
        # Falcon-H1 order: weight in float32, then gate, then one cast.
        return (weight.float() * x_hat * gate_f).to(dtype)
    return _apply_weight(x_hat, weight, dtype, weight_in_fp32)
