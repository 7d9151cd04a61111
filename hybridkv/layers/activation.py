"""Element-wise activations and gates of the feed-forward and attention blocks, for the models.

Each runs one native pass on the CPU where the kernel takes its tensors (`hybridkv.ops.native`:
one call, so a decode step stays capturable) and otherwise the PyTorch expression in its
docstring, which the kernel rounds exactly as. The models call these, never the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.ops.native import elementwise as native_ew
from hybridkv.ops.native import gdn_prep as native_prep


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up; gate, up: [..., I] of one shape and dtype (SwiGLU's separate gate
    and up projections)."""
    out = native_ew.silu_mul(gate, up)
    return out if out is not None else F.silu(gate) * up


def gelu_tanh_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.gelu(gate, approximate="tanh") * up; gate, up: [T, I] (GeGLU)."""
    out = native_ew.gelu_tanh_mul(gate, up)
    return out if out is not None else F.gelu(gate, approximate="tanh") * up


def relu2(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2, as F.relu(x).square() (Nemotron-H's MLPs and experts)."""
    out = native_ew.relu2(x)
    return out if out is not None else F.relu(x).square()


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(gate): x [T, H * D]; gate [T, H, D] (a view of each head's [query | gate]
    projection, read in place by the kernel) -> [T, H * D] (Qwen3-Next's gated attention)."""
    out = native_prep.sigmoid_gate(x, gate)
    return out if out is not None else x * torch.sigmoid(gate.reshape(x.shape[0], -1))
