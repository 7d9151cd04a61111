"""Element-wise steps between the layers: the residual add, the float32 logits, conversions,
products of projection slices and the concatenation of two rows (an MTP layer's input).

Each is an op family (`hybridkv.ops.registry`): on the CPU in float32 and bfloat16 a native
kernel (`hybridkv.ops.native.elementwise`) rounding as the PyTorch expression here does, else
that expression (the reference, and the path for other dtypes and devices); chosen once per
device and dtype. A decode step made only of kernel calls can be captured and replayed
(`hybridkv.ops.native.program`); these keep the steps between the layers inside it.
"""

from __future__ import annotations

import torch

from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

_CPU = frozenset({"cpu"})


def _family(name: str) -> tuple[OpImpl, ...]:
    return (
        OpImpl("native", f"{__name__}:_native_{name}", _CPU, CPU_FLOATS, ("native",), strict=True),
        OpImpl("torch", f"{__name__}:torch_{name}"),
    )


RESIDUAL_ADD = declare("residual_add", _family("residual_add"))  # keyed by x's dtype
LOGITS_FLOAT32 = declare("logits_float32", _family("logits_float32"))  # by the logits' dtype
TO_BFLOAT16 = declare("to_bfloat16", _family("to_bfloat16"))  # by the source dtype
MUL = declare("mul", _family("mul"))  # by the product's dtype
CONCAT = declare("concat", _family("concat"))  # by a's dtype


def residual_add(x: torch.Tensor, h: torch.Tensor, multiplier: float = 1.0) -> torch.Tensor:
    """x + h * multiplier (x + h when multiplier is 1): the residual stream after a block."""
    return RESIDUAL_ADD.of(x).first(x, h, multiplier)


def _native_residual_add(x: torch.Tensor, h: torch.Tensor, multiplier: float) -> torch.Tensor:
    from hybridkv.ops.native import elementwise

    return elementwise.add_scaled(x, h if h.dtype == x.dtype else h.to(x.dtype), multiplier)


def torch_residual_add(x: torch.Tensor, h: torch.Tensor, multiplier: float) -> torch.Tensor:
    return x + h if multiplier == 1.0 else x + h * multiplier


def logits_float32(
    logits: torch.Tensor, divisor: float = 1.0, softcap: float | None = None
) -> torch.Tensor:
    """The lm_head's output as float32 logits, divided by `divisor` (a family's logit scale),
    soft-capped first in the logits' dtype when `softcap` is set (nonzero: Gemma's final logit
    soft-capping, tanh(logits / softcap) * softcap). logits: [n, vocab]."""
    return LOGITS_FLOAT32.of(logits).first(logits, divisor, softcap)


def _native_logits_float32(
    logits: torch.Tensor, divisor: float, softcap: float | None = None
) -> torch.Tensor | None:
    from hybridkv.ops.native import elementwise

    # the kernel takes [rows, cols] with unit column stride
    rows = logits.reshape(-1, logits.shape[-1]) if logits.dim() != 2 else logits
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = elementwise.logits_f32(rows, divisor, softcap)
    return None if out is None else out.reshape(logits.shape)


def torch_logits_float32(
    logits: torch.Tensor, divisor: float, softcap: float | None = None
) -> torch.Tensor:
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap  # in the logits' dtype
    out = logits.float()
    return out if divisor == 1.0 else out / divisor


def to_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype), exactly as torch converts; float32 -> bfloat16 and back are op families (a
    decode step that converts stays capturable)."""
    if x.dtype == dtype:
        return x
    if x.dtype == torch.bfloat16 and dtype == torch.float32:
        return logits_float32(x)  # (the exact widening: nothing divided)
    if x.dtype == torch.float32 and dtype == torch.bfloat16:
        return TO_BFLOAT16.of(x).first(x)
    return x.to(dtype)


def _native_to_bfloat16(x: torch.Tensor) -> torch.Tensor | None:
    from hybridkv.ops.native import elementwise

    return elementwise.to_bfloat16(x if x.is_contiguous() else x.contiguous())


def torch_to_bfloat16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16)


def mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """a.to(dtype) * b.to(dtype): [rows, cols] contiguous, for 2-D a and b of one shape (column
    slices of a projection, read in place by the kernel)."""
    return MUL.chain(a.device, dtype).first(a, b, dtype)


def _native_mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    from hybridkv.ops.native import elementwise

    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    if a.dtype not in (torch.float32, torch.bfloat16):
        a = a.to(dtype)
    if b.dtype not in (torch.float32, torch.bfloat16):
        b = b.to(dtype)
    return elementwise.mul(a, b, dtype)


def torch_mul(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (a.to(dtype) * b.to(dtype)).contiguous()


def concat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.cat([a, b], dim=-1) of 2-D a [rows, m] and b [rows, n] of one dtype -> [rows,
    m + n], the same bits (an MTP layer's [embedding | hidden] input: a pass stays capturable)."""
    return CONCAT.of(a).first(a, b)


def _native_concat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    from hybridkv.ops.native import elementwise

    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    return elementwise.concat_rows(a, b)


def torch_concat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.cat([a, b], dim=-1)
