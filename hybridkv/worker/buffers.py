"""Cache buffers and per-layer views (design.md section 4).

There are `layers_per_group` flat byte buffers of `num_pages * page_bytes`; buffer i is shared by
layer position i of every group, so a page id is valid in every buffer. A page belongs to one
group at a time, so views of layers of different groups never overlap in the bytes a page holds.

    buffer i:  | page 0 | page 1 | page 2 | ...            (page_bytes each)
    attention page:  | kb 0: [K|V] | kb 1: [K|V] | ... | kb r-1: [K|V] |
    state page:      | ssm (fp32) | conv (bf16) | padding |

Attention view: [num_pages * blocks_per_page, 2, kernel_block_size, kv_heads, head_dim]
MLA view:       [num_pages * blocks_per_page, kernel_block_size, kv_lora_rank + rope_dim]
State views:    one [num_pages, *shape] tensor per state tensor, page stride = page_bytes.
"""

from __future__ import annotations

import mmap
from collections.abc import Callable, Sequence

import torch

from hybridkv.dtypes import dtype_bytes, torch_dtype
from hybridkv.kv.plan import GroupPlan, MemoryPlan
from hybridkv.kv.specs import AttentionSpec, MLASpec, StateSpec
from hybridkv.ops.attention import zero_pages as reference_zero_pages

LayerView = torch.Tensor | dict[str, torch.Tensor]


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def zeroed_bytes(num_bytes: int, device: torch.device) -> torch.Tensor:
    """A zero-filled uint8 buffer of `num_bytes`. On the CPU an anonymous memory mapping: the
    OS hands out zeroed pages as they are first touched, so a pool costs neither time nor memory
    until its pages are used (torch.zeros writes every byte first: ~0.1 s and the whole size in
    resident memory per 500 MiB, at every engine start)."""
    if device.type != "cpu" or num_bytes == 0:
        return torch.zeros(num_bytes, dtype=torch.uint8, device=device)
    # the tensor holds the mapping (its storage references the buffer) until it is freed
    return torch.frombuffer(mmap.mmap(-1, num_bytes), dtype=torch.uint8)


class CacheBuffers:
    def __init__(self, plan: MemoryPlan, device: str | torch.device = "cpu") -> None:
        self.plan = plan
        self.device = torch.device(device)
        self.buffers = [
            zeroed_bytes(plan.num_pages * plan.page_bytes, self.device)
            for _ in range(plan.layers_per_group)
        ]
        self.views: dict[str, LayerView] = {}
        self.group_of_layer: dict[str, int] = {}
        for group in plan.groups:
            for position, name in enumerate(group.layer_names):
                self.views[name] = self._view(group, self.buffers[position])
                self.group_of_layer[name] = group.group_id

    def _view(self, group: GroupPlan, buf: torch.Tensor) -> LayerView:
        spec = group.spec
        if isinstance(spec, StateSpec):
            return self._state_views(spec, buf)
        num_kernel_blocks = self.plan.num_pages * group.blocks_per_page
        typed = buf.view(torch_dtype(spec.dtype))
        kbs = group.kernel_block_size
        if isinstance(spec, MLASpec):
            return typed.view(num_kernel_blocks, kbs, spec.head_dim)
        assert isinstance(spec, AttentionSpec)
        return typed.view(num_kernel_blocks, 2, kbs, spec.num_kv_heads, spec.head_dim)

    def _state_views(self, spec: StateSpec, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        page_bytes = self.plan.page_bytes
        views = {}
        for tensor, offset in spec.layout:
            size = dtype_bytes(tensor.dtype)
            typed = buf.view(torch_dtype(tensor.dtype))
            views[tensor.name] = typed.as_strided(
                (self.plan.num_pages, *tensor.shape),
                (page_bytes // size, *_contiguous_strides(tensor.shape)),
                offset // size,
            )
        return views

    def zero_pages(
        self,
        group_id: int,
        page_ids: Sequence[int] | torch.Tensor,
        zero: Callable[[torch.Tensor, torch.Tensor], None] = reference_zero_pages,
    ) -> None:
        """Zero pages newly handed to a group in the buffers its layers use: a page that held a
        state may hold NaN bit patterns that an attention kernel must never read. `zero` is the
        attention backend's (a Triton kernel on GPUs); it gets [num_pages, page_bytes] uint8 and
        the page ids, copied to the device once for all layers."""
        ids = torch.as_tensor(page_ids, dtype=torch.int64, device=self.device)
        if ids.numel() == 0:
            return
        n_layers = len(self.plan.groups[group_id].layer_names)
        for buf in self.buffers[:n_layers]:
            zero(buf.view(self.plan.num_pages, self.plan.page_bytes), ids)
