"""Mamba2 mixer over packed ragged batches with paged conv/SSM state.

Parameter names follow the transformers mixers (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`,
`norm.weight`, `out_proj`) so a checkpoint's mixer tensors load by name. The data flow:

    hidden [T, hidden] -> in_proj -> split (gate [I] | xBC [I + 2GN] | dt [H])
    xBC -> causal conv1d (+ state) -> silu -> split (x [H, P] | B [G, N] | C [G, N])
    x, dt, B, C -> scan (+ state) -> y [I] -> gated RMSNorm(y, gate) -> out_proj -> [T, hidden]

with I = n_heads * head_dim. Family differences found in transformers 5.x, and the constructor
option that covers each:

- Bamba, GraniteMoeHybrid: identical mixers. `dt_limit = config.time_step_limit` (default
  (0, inf)); in_proj and out_proj bias = `mamba_proj_bias`; conv bias = `mamba_conv_bias`;
  norm eps = `rms_norm_eps`; head_dim = `mamba_d_head` (intermediate = mamba_expand * hidden).
- NemotronH: same layout and names (the mixer is `backbone.layers.i.mixer`), but
  intermediate = mamba_num_heads * mamba_head_dim, bias = `use_bias` / `use_conv_bias`,
  eps = `layer_norm_epsilon`, dt_limit = `time_step_limit` (transformers 5.25; up to 5.24 it
  was (time_step_min, inf), a lower clamp). Its n_groups (often 8) also groups the gated norm.
- Zamba2: dt_limit = (time_step_min, inf), a lower clamp the others do not have (still so in
  transformers 5.25); conv bias always on, norm eps fixed
  to 1e-5, bias = `add_bias_linear`. Supported with plain arguments.
- Falcon-H1: supported with `in_multiplier` (ssm_in_multiplier, scales the mixer input),
  `proj_multipliers` (ssm_multipliers for the z, x, B, C, dt slices of in_proj's output; stored
  as the non-persistent buffer `mup_vector`, as transformers does), `gated_norm=False`
  (mamba_rms_norm off: y * silu(gate), no norm weight), `norm_before_gate`
  (mamba_norm_before_gate) and `norm_weight_in_fp32=True` (its norm multiplies the weight before
  the cast), `out_proj_bias` (projectors_bias, separate from mamba_proj_bias). Its
  `ssm_out_multiplier` is applied by the decoder layer, outside the mixer. `mamba_d_ssm` sets
  I, which must equal n_heads * head_dim here.

The mixer owns its cache (`CacheOwner`): it declares a `mamba2` state spec with the tensors
`conv` [conv_dim, d_conv - 1] and `ssm` [n_heads, head_dim, d_state], and where its ops can run
(`MAMBA2_OPS`: native C kernels, Triton, a compiled decode step, PyTorch); the plan picks one
per group and the runner binds it with the views.

Where transformers itself is inconsistent: its one-token decode path ignores dt_limit and rounds
the scan output to the model dtype before the norm; here dt_limit applies to every token and the
scan output stays float32 into the norm (what its prefill path does), so decode equals prefill.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.distributed.parallel import current, declare_shards, explicit, rank0_bias
from hybridkv.forward_batch import ForwardBatch, StateMetadata
from hybridkv.kv.specs import CacheDtypes, StateOps, StateSpec, StateTensor
from hybridkv.layers.cache import CacheOwner, StateCache
from hybridkv.ops.conv1d import CONV_MAX_HISTORY
from hybridkv.ops.derived import derived
from hybridkv.ops.mamba2_ops import NormArgs, PositionScratch, ScanParams, TorchMamba2Ops
from hybridkv.ops.norm import _apply_weight as apply_norm_weight
from hybridkv.ops.norm import gated_rms_norm

SCAN_CHUNK_CAP = 64
CONV, SSM = "conv", "ssm"  # the state tensors a Mamba2 layer declares and reads
_OPS = "hybridkv.ops.mamba2_ops:"
_FLOATS = frozenset({"float32", "bfloat16", "float16"})

# Where Mamba2 ops can run, in order of preference (the plan takes the first that runs here).
MAMBA2_OPS = (
    StateOps(
        "native",
        _OPS + "NativeMamba2Ops",
        frozenset({"cpu"}),
        frozenset({"float32", "bfloat16"}),
        needs="native",
        description="C kernels (hybridkv.ops.native), state in place",
    ),
    StateOps(
        "triton",
        _OPS + "TritonMamba2Ops",
        frozenset({"cuda", "rocm"}),
        _FLOATS,
        needs="triton",
        description="Triton decode steps, PyTorch prefill",
    ),
    StateOps(
        "compiled",
        _OPS + "CompiledMamba2Ops",
        frozenset({"cpu"}),
        _FLOATS,
        needs="compile",
        description="torch.compile'd decode step, PyTorch prefill",
    ),
    StateOps("torch", _OPS + "TorchMamba2Ops", description="PyTorch reference"),
)
TORCH_OPS = TorchMamba2Ops()


class _GatedNormWeight(nn.Module):
    """Holds `norm.weight` (the computation lives in `hybridkv.ops.norm.gated_rms_norm`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))


class Mamba2Mixer(CacheOwner):
    """A Mamba2 mixer whose conv and SSM states live in pages of the state cache."""

    def __init__(
        self,
        hidden_size: int,
        n_heads: int,
        head_dim: int,
        d_state: int,
        n_groups: int = 1,
        d_conv: int = 4,
        chunk_size: int = 256,
        conv_bias: bool = True,
        proj_bias: bool = False,
        norm_eps: float = 1e-5,
        dt_limit: tuple[float, float] = (0.0, math.inf),
        activation: str | None = "silu",
        *,
        layer_index: int = 0,
        out_proj_bias: bool | None = None,
        norm_group_size: int | None = None,
        gated_norm: bool = True,
        norm_before_gate: bool = False,
        norm_weight_in_fp32: bool = False,
        in_multiplier: float = 1.0,
        proj_multipliers: Sequence[float] | None = None,
    ):
        super().__init__(layer_index)
        if n_heads % n_groups != 0:
            raise ValueError(f"n_heads {n_heads} must be a multiple of n_groups {n_groups}")
        if d_conv < 2:
            raise ValueError(f"d_conv must be at least 2 (one state column), got {d_conv}")
        # Tensor parallel: this rank's heads, and its groups (split, or replicated when the
        # size exceeds them); every size below is this rank's.
        self.tp = tp = current()
        self.sharded = True  # its heads (and groups) are this rank's
        full_heads, full_groups = n_heads, n_groups
        full_group_size = norm_group_size or n_heads * head_dim // n_groups
        n_heads = tp.split(full_heads, "mamba n_heads")
        n_groups, first_group = tp.replicated(full_groups, "mamba n_groups")
        self.hidden_size, self.n_heads, self.head_dim = hidden_size, n_heads, head_dim
        self.d_state, self.n_groups, self.d_conv = d_state, n_groups, d_conv
        self.chunk_size = chunk_size
        # The chunked scan is exact for any chunk length; its intra-chunk work grows with the
        # length, and 64 measured fastest on CPU (2048 tokens, 24 heads: 89 ms at 128, 46 at 64).
        self.scan_chunk = min(chunk_size, SCAN_CHUNK_CAP)
        self.norm_eps = norm_eps
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.activation = activation
        self.intermediate_size = n_heads * head_dim
        self.conv_dim = self.intermediate_size + 2 * n_groups * d_state
        self.norm_group_size = full_group_size
        # a norm group wider than this rank's channels spans ranks: its sum of squares is
        # all-reduced (one column per group of the full layer)
        self.norm_groups_full = full_heads * head_dim // full_group_size
        self.norm_spans_ranks = full_group_size > self.intermediate_size
        if self.norm_spans_ranks and full_group_size % self.intermediate_size:
            raise ValueError(
                f"tensor_parallel_size={tp.size}: a rank's {self.intermediate_size} mamba "
                f"channels do not tile its norm groups of {full_group_size}"
            )
        self.gated_norm = gated_norm
        self.norm_before_gate = norm_before_gate
        self.norm_weight_in_fp32 = norm_weight_in_fp32
        self.in_multiplier = in_multiplier

        projection_size = self.intermediate_size + self.conv_dim + n_heads
        self.in_proj = nn.Linear(hidden_size, projection_size, bias=proj_bias)
        # Depthwise: weight [conv_dim, 1, d_conv] as in the checkpoints (padding is unused here).
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, d_conv, groups=self.conv_dim, bias=conv_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(n_heads))
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n_heads + 1, dtype=torch.float32)))
        self.D = nn.Parameter(torch.ones(n_heads))
        if gated_norm:
            self.norm = _GatedNormWeight(self.intermediate_size)
        out_bias = proj_bias if out_proj_bias is None else out_proj_bias
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=out_bias)
        # A constant, not a buffer: built on the CPU even when the model is built on the meta
        # device (a meta buffer would come back uninitialised when the model is materialised).
        self.mup_vector = None if proj_multipliers is None else self._mup_vector(proj_multipliers)
        self._declare_shards(full_heads, full_groups, first_group)

    def _declare_shards(self, full_heads: int, full_groups: int, first_group: int) -> None:
        """Where this rank's rows come from: in_proj [z | x | B | C | dt], conv [x | B | C]."""
        tp, n = self.tp, self.d_state
        full_i, gn = full_heads * self.head_dim, full_groups * n
        i_l, h_l, g_l = self.intermediate_size, self.n_heads, self.n_groups
        r_i, r_h, r_g = tp.rank * i_l, tp.rank * h_l, first_group * n
        rows = explicit(
            tp, (r_i, i_l), (full_i + r_i, i_l), (2 * full_i + r_g, g_l * n),
            (2 * full_i + gn + r_g, g_l * n), (2 * full_i + 2 * gn + r_h, h_l),
        )  # fmt: skip
        conv = explicit(tp, (r_i, i_l), (full_i + r_g, g_l * n), (full_i + gn + r_g, g_l * n))
        heads = explicit(tp, (r_h, h_l))
        in_bias, conv_bias = self.in_proj.bias is not None, self.conv1d.bias is not None
        declare_shards(self.in_proj, weight=rows, bias=rows if in_bias else None)
        declare_shards(self.conv1d, weight=conv, bias=conv if conv_bias else None)
        declare_shards(self, dt_bias=heads, A_log=heads, D=heads)
        if self.gated_norm:
            declare_shards(self.norm, weight=explicit(tp, (r_i, i_l)))
        declare_shards(self.out_proj, weight=explicit(tp, (r_i, i_l), dim=1))
        if self.out_proj.bias is not None:
            declare_shards(self.out_proj, bias=rank0_bias(tp))

    # -- the cache it owns -------------------------------------------------------------------

    def cache_spec(self, dtypes: CacheDtypes) -> StateSpec:
        """conv: the last d_conv - 1 inputs of every conv channel; ssm: the SSM state."""
        ops = MAMBA2_OPS
        if self.d_conv - 1 > CONV_MAX_HISTORY:  # the C conv keeps at most this many
            ops = tuple(o for o in ops if o.name != "native")
        return StateSpec(
            "mamba2",
            (
                StateTensor(CONV, (self.conv_dim, self.d_conv - 1), dtypes.conv),
                StateTensor(SSM, (self.n_heads, self.head_dim, self.d_state), dtypes.ssm),
            ),
            ops,
        )

    def _mup_vector(self, multipliers: Sequence[float]) -> torch.Tensor:
        """Per-channel scale of in_proj's output from 5 multipliers (z, x, B, C, dt)."""
        if len(multipliers) != 5:
            raise ValueError("proj_multipliers needs 5 values: z, x, B, C, dt")
        gn = self.n_groups * self.d_state
        sizes = [self.intermediate_size, self.intermediate_size, gn, gn, self.n_heads]
        parts = [
            torch.full((n,), float(m), device="cpu")
            for n, m in zip(sizes, multipliers, strict=True)
        ]
        return torch.cat(parts)  # [projection_size]

    def _project_in(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> zxbcdt [T, I + conv_dim + H]: gate | xBC | dt."""
        if self.in_multiplier != 1.0:
            hidden_states = hidden_states * self.in_multiplier
        zxbcdt = self.in_proj(hidden_states)  # [T, I + conv_dim + H]
        if self.mup_vector is not None:
            if self.mup_vector.device != zxbcdt.device:
                self.mup_vector = self.mup_vector.to(zxbcdt.device)
            zxbcdt = zxbcdt * self.mup_vector.to(zxbcdt.dtype)
        return zxbcdt

    def _output_gate(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """Gated RMSNorm (or plain silu gating when the family has no norm). y: [T, I] fp32."""
        if not self.gated_norm:
            return y * F.silu(gate)
        if self.norm_spans_ranks:
            return self._spanning_norm(y, gate)
        return gated_rms_norm(
            y,
            gate,
            self.norm.weight,
            self.norm_eps,
            self.norm_group_size,
            norm_before_gate=self.norm_before_gate,
            weight_in_fp32=self.norm_weight_in_fp32,
            out_dtype=gate.dtype,  # the model dtype: out_proj's input
        )

    def _spanning_norm(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """The gated norm when this rank's channels are one part of a norm group that spans
        ranks: its sum of squares is summed over ranks (one [T, groups] all-reduce).
        y: [T, I_local] float32, gate: [T, I_local] -> [T, I_local]."""
        if self.norm_before_gate:
            raise ValueError("a gated norm applied before the gate cannot span ranks")
        xf = y.float() * F.silu(gate.float())
        group = self.tp.rank * self.intermediate_size // self.norm_group_size
        sums = torch.zeros(y.shape[0], self.norm_groups_full, device=y.device)
        sums[:, group] = xf.pow(2).sum(-1)
        sums = self.tp.all_reduce(sums)
        x_hat = xf * torch.rsqrt(sums[:, group, None] / self.norm_group_size + self.norm_eps)
        return apply_norm_weight(x_hat, self.norm.weight, y.dtype, self.norm_weight_in_fp32)

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden_states: [T, hidden] -> [T, hidden], states updated in this layer's pages;
        tensor parallel: out_proj is row-parallel, its output all-reduced."""
        cache = self.cache
        assert isinstance(cache, StateCache)
        meta: StateMetadata = self.step_metadata(batch)
        positions = cache.kept(meta, CONV, SSM)  # speculative decoding's per-position states
        out = self.mix(
            hidden_states, cache.tensors[CONV], cache.tensors[SSM], meta, cache.ops, positions
        )
        return self.tp.all_reduce(out)

    def mix(
        self,
        hidden_states: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        ops: TorchMamba2Ops = TORCH_OPS,
        positions: PositionScratch | None = None,
    ) -> torch.Tensor:
        """hidden_states: [T, hidden]; conv_state: [num_pages, conv_dim, d_conv - 1];
        ssm_state: [num_pages, n_heads, head_dim, d_state] (both updated in place) -> [T, hidden].
        positions: (conv, ssm) scratch [rows, positions, *state shape] for the states after
        every position (`StateMetadata.scratch_rows`; ops that declare `keeps_positions`).
        """
        zxbcdt = self._project_in(hidden_states)  # [T, I + conv_dim + H]
        params = self._scan_params()
        if self.fusable:  # the ops may run the whole mixer in one call
            y = ops.fused_mix(
                zxbcdt, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state, ssm_state,
                meta, params, self._norm_args(), self.n_groups, positions,
            )  # fmt: skip
            if y is not None:
                return self.out_proj(y)
        gate, xbc, dt = zxbcdt.split([self.intermediate_size, self.conv_dim, self.n_heads], -1)
        y = self._conv_and_scan(xbc, dt, conv_state, ssm_state, meta, params, ops, positions)
        y = self._output_gate(y, gate)
        return self.out_proj(y.to(hidden_states.dtype))

    def _conv_and_scan(
        self,
        xbc: torch.Tensor,
        dt: torch.Tensor,
        conv_state: torch.Tensor,
        ssm_state: torch.Tensor,
        meta: StateMetadata,
        params: ScanParams,
        ops: TorchMamba2Ops,
        positions: PositionScratch | None = None,
    ) -> torch.Tensor:
        """xbc: [T, conv_dim], dt: [T, H] raw -> y: [T, I] float32 (kept for the norm, as
        transformers' prefill does); both states updated in place."""
        conv_kept, ssm_kept = (None, None) if positions is None else positions
        num_tokens, gn = xbc.shape[0], self.n_groups * self.d_state
        # xbc: [T, conv_dim] after the causal conv and activation, in float32: the scan's dtype
        xbc = ops.conv1d(
            xbc, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state, meta,
            self.activation, torch.float32, conv_kept,
        )  # fmt: skip
        x, B, C = xbc.split([self.intermediate_size, gn, gn], dim=-1)
        y = ops.scan(
            x.reshape(num_tokens, self.n_heads, self.head_dim),
            dt,
            B.reshape(num_tokens, self.n_groups, self.d_state),
            C.reshape(num_tokens, self.n_groups, self.d_state),
            ssm_state,
            meta,
            params,
            torch.float32,
            ssm_kept,
        )
        return y.reshape(num_tokens, self.intermediate_size)

    def _scan_params(self) -> ScanParams:
        return ScanParams(
            derived(self.A_log, "neg_exp_f32", lambda a: -torch.exp(a.float())),
            derived(self.D, "f32", torch.Tensor.float),
            derived(self.dt_bias, "f32", torch.Tensor.float),
            self.scan_chunk,
            self.dt_limit,
        )

    def _norm_args(self) -> NormArgs:
        return NormArgs(
            self.norm.weight, self.norm_group_size, self.norm_eps, self.norm_before_gate,
            self.norm_weight_in_fp32,
        )  # fmt: skip

    @property
    def fusable(self) -> bool:
        """Whether the whole mixer may run as one op (`fused_mix`): silu conv, a gated norm
        local to this rank."""
        return self.gated_norm and not self.norm_spans_ranks and self.activation in (
            "silu", "swish",
        )  # fmt: skip
