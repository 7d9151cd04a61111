"""LFM2's gated short convolution over packed ragged batches with a paged conv state.

Parameter names follow transformers' `Lfm2ShortConv` (`in_proj`, `conv`, `out_proj`) so a
checkpoint's tensors load by name. The data flow, with C = conv channels (= hidden_size):

    hidden [T, hidden] -> in_proj -> split (B [T, C] | C_gate [T, C] | x [T, C])
    B * x -> causal depthwise conv1d over L_cache taps (+ state, no activation) -> conv [T, C]
    C_gate * conv -> out_proj -> [T, hidden]

The layer owns its cache (`CacheOwner`): it declares a `short_conv` state spec with one tensor,
`conv` [C, L_cache - 1] (the last L_cache - 1 inputs of the conv, B * x, per channel), the same
name and shape as `hybridkv.kv.specs.short_conv_state`. The conv itself is the
Mamba2 causal conv1d (`hybridkv.ops.mamba2_ops`: packed varlen requests, state pages updated
in place); `SHORT_CONV_OPS` says where it can run.

Tensor parallel (`hybridkv.distributed`): each rank keeps C / size channels. in_proj is
column-parallel (B, C_gate and x each split by channel), the conv per channel, out_proj
row-parallel with its output all-reduced; the declared state is one rank's [C / size,
L_cache - 1].
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.forward_batch import ForwardBatch, StateMetadata
from hybridkv.kv.specs import CacheDtypes, StateOps, StateSpec, StateTensor
from hybridkv.layers.cache import CacheOwner, StateCache
from hybridkv.ops.conv1d import CONV_MAX_HISTORY
from hybridkv.ops.elementwise import mul as _mul
from hybridkv.ops.mamba2_ops import TorchMamba2Ops

CONV = "conv"  # the one state tensor a short conv layer declares and reads
_OPS = "hybridkv.ops.mamba2_ops:"
_FLOATS = frozenset({"float32", "bfloat16", "float16"})

# Where the short conv's ops (the causal conv1d of the Mamba2 ops classes) can run, in order of
# preference (the plan takes the first that runs here).
SHORT_CONV_OPS = (
    StateOps(
        "native",
        _OPS + "NativeMamba2Ops",
        frozenset({"cpu"}),
        frozenset({"float32", "bfloat16"}),
        needs="native",
        description="C conv1d kernel (hybridkv.ops.native), state in place",
    ),
    StateOps(
        "triton",
        _OPS + "TritonMamba2Ops",
        frozenset({"cuda", "rocm"}),
        _FLOATS,
        needs="triton",
        description="Triton conv1d decode step, PyTorch prefill",
    ),
    StateOps("torch", _OPS + "TorchMamba2Ops", description="PyTorch reference"),
)
TORCH_OPS = TorchMamba2Ops()


class ShortConv(CacheOwner):
    """A gated short convolution whose conv state lives in pages of the state cache."""

    def __init__(
        self, hidden_size: int, l_cache: int = 3, bias: bool = False, *, layer_index: int = 0
    ) -> None:
        super().__init__(layer_index)
        if l_cache < 2:
            raise ValueError(f"conv_L_cache must be at least 2 (one state column), got {l_cache}")
        # Tensor parallel: this rank's conv channels (C below is this rank's)
        self.tp = tp = current()
        self.sharded = True  # its channels are this rank's
        channels = tp.split(hidden_size, "short conv hidden_size")
        self.hidden_size, self.channels, self.l_cache = hidden_size, channels, l_cache
        self.in_proj = nn.Linear(hidden_size, 3 * channels, bias=bias)
        # Depthwise: weight [C, 1, L_cache] as in the checkpoints (padding is unused here).
        self.conv = nn.Conv1d(channels, channels, l_cache, groups=channels, bias=bias)
        self.out_proj = nn.Linear(channels, hidden_size, bias=bias)
        self._declare_shards(bias)

    def _declare_shards(self, bias: bool) -> None:
        """This rank's rows: in_proj [B | C_gate | x] each by channel, out_proj's columns."""
        tp, full = self.tp, self.hidden_size
        bcx = column(tp, (0, full), (full, full), (2 * full, full))
        channels = column(tp, (0, full))
        declare_shards(self.in_proj, weight=bcx, bias=bcx if bias else None)
        declare_shards(self.conv, weight=channels, bias=channels if bias else None)
        declare_shards(self.out_proj, weight=column(tp, (0, full), dim=1))
        declare_shards(self.out_proj, bias=rank0_bias(tp) if bias else None)

    def cache_spec(self, dtypes: CacheDtypes) -> StateSpec:
        """conv: the last L_cache - 1 conv inputs (B * x) of every channel."""
        ops = SHORT_CONV_OPS
        if self.l_cache - 1 > CONV_MAX_HISTORY:  # the C conv keeps at most this many
            ops = tuple(o for o in ops if o.name != "native")
        shape = (self.channels, self.l_cache - 1)
        return StateSpec("short_conv", (StateTensor(CONV, shape, dtypes.conv),), ops)

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden_states: [T, hidden] -> [T, hidden], the conv state updated in its pages;
        tensor parallel: out_proj is row-parallel, its output all-reduced."""
        cache = self.cache
        assert isinstance(cache, StateCache)
        meta: StateMetadata = self.step_metadata(batch)
        kept = cache.kept(meta, CONV)  # speculative decoding's per-position states
        out = self.mix(
            hidden_states, cache.tensors[CONV], meta, cache.ops, None if kept is None else kept[0]
        )
        return self.tp.all_reduce(out)

    def mix(
        self,
        hidden_states: torch.Tensor,
        conv_state: torch.Tensor,
        meta: StateMetadata,
        ops: TorchMamba2Ops = TORCH_OPS,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """hidden_states: [T, hidden]; conv_state: [num_pages, C, L_cache - 1] (updated in
        place) -> [T, hidden]. positions: [rows, positions, C, L_cache - 1] scratch for the
        state after every position (`StateMetadata.scratch_rows`)."""
        b, c, x = self.in_proj(hidden_states).chunk(3, dim=-1)  # each [T, C]
        bx = _mul(b, x, x.dtype)  # [T, C] contiguous
        # float32 holding x.dtype's values (a bfloat16 conv result rounded by the kernel, not
        # cast by a tensor op: a bfloat16 decode step stays capturable); _mul reads it exactly
        w = self.conv.weight[:, 0, :]
        conv = ops.conv1d(bx, w, self.conv.bias, conv_state, meta, None, torch.float32, positions)
        return self.out_proj(_mul(c, conv, c.dtype))  # [T, hidden]
