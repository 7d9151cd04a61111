"""Element-wise activations and gates of the feed-forward and attention blocks, for the models.

Each is an op family (`hybridkv.ops.registry`): on the CPU in float32 and bfloat16 one native
pass (`hybridkv.ops.native.elementwise` / `gdn_prep`: one call, so a decode step stays
capturable, rounding exactly as the PyTorch expression in the docstring), elsewhere that
expression. Which runs is chosen once per device and dtype; the models call these, never the
kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

_CPU = frozenset({"cpu"})
_EW = "hybridkv.ops.native.elementwise:"


def _native(fn: str) -> OpImpl:
    return OpImpl("native", fn, _CPU, CPU_FLOATS, ("native",), strict=True)


def _torch(fn: str) -> OpImpl:
    return OpImpl("torch", f"{__name__}:{fn}")


SILU_MUL = declare("silu_mul", (_native(_EW + "silu_mul"), _torch("torch_silu_mul")))
SILU_AND_MUL = declare(
    "silu_and_mul", (_native(_EW + "silu_and_mul"), _torch("torch_silu_and_mul"))
)
GELU_TANH_MUL = declare(
    "gelu_tanh_mul", (_native(f"{__name__}:_native_gelu_tanh_mul"), _torch("torch_gelu_tanh_mul"))
)
RELU2 = declare("relu2", (_native(_EW + "relu2"), _torch("torch_relu2")))
SIGMOID_GATE = declare(
    "sigmoid_gate", (_native(f"{__name__}:_native_sigmoid_gate"), _torch("torch_sigmoid_gate"))
)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up; gate, up: [..., I] of one shape and dtype (SwiGLU's separate gate
    and up projections)."""
    return SILU_MUL.of(gate).first(gate, up)


def torch_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] = [gate | up] -> F.silu(gate) * up: [..., I] (a fused gate_up projection)."""
    return SILU_AND_MUL.of(x).first(x)


def torch_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up; gate, up: [T, I] (GeGLU)."""
    return GELU_TANH_MUL.of(gate).first(gate, up)


def _native_gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor | None:
    from hybridkv.ops.native import elementwise

    # the kernel reads rows with unit column stride: [T, I] views of a projection are
    shape = gate.shape
    gate, up = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    up = up if up.stride(-1) == 1 else up.contiguous()
    out = elementwise.gelu_tanh_mul(gate, up)
    return None if out is None else out.reshape(shape)


def torch_gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2, as F.relu(x).square() (Nemotron-H's MLPs and experts)."""
    return RELU2.of(x).first(x)


def torch_relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate): x [T, H * D]; gate [T, H, D] (a view of each head's [query | gate]
    projection, read in place by the kernel) -> [T, H * D] (Qwen3-Next's gated attention)."""
    return SIGMOID_GATE.of(x).first(x, gate)


def _native_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor | None:
    from hybridkv.ops.native import gdn_prep

    x = x if x.is_contiguous() else x.contiguous()
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    return gdn_prep.sigmoid_gate(x, gate)


def torch_sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(gate.reshape(x.shape[0], -1))
