"""Mamba1 mixer over packed ragged batches with paged conv/SSM state.

Parameter names follow transformers' `MambaMixer` / `FalconMambaMixer` / `JambaMambaMixer`
(`in_proj`, `conv1d`, `x_proj`, `dt_proj`, `A_log`, `D`, `out_proj`, Jamba's `dt_layernorm`,
`b_layernorm`, `c_layernorm`) so a checkpoint's mixer tensors load by name. The data flow:

    hidden [T, hidden] -> in_proj -> split (x [Di] | z [Di])
    x -> causal conv1d (+ state) -> activation -> x_proj -> split (dt [R] | B [N] | C [N])
    (dt, B, C -> RMS norms: Jamba, FalconMamba)    dt -> dt_proj (weight only) -> [Di]
    x, dt, B, C, z -> scan (+ state; softplus(dt + dt_proj.bias)) -> y [Di] -> out_proj

Family differences found in transformers 5.x (slow paths), and the constructor options:

- Mamba (MambaForCausalLM): d_inner = `intermediate_size`, d_state = `state_size`, d_conv =
  `conv_kernel`, dt_rank = `time_step_rank`, conv bias `use_conv_bias`, in/out_proj bias
  `use_bias`, activation `hidden_act`; no norms (`dt_norms=None`).
- FalconMamba: Mamba's layout, plus RMS norms *without weights* on dt, B and C right after
  x_proj (`dt_norms="falcon_mamba"`, eps `mixer_rms_eps`); each normalises in float32 and casts
  back to the input dtype. (Its norms hold unused, non-persistent dummy weights.)
- Jamba: d_inner = `mamba_expand * hidden_size`, `mamba_d_state`, `mamba_d_conv`,
  `mamba_dt_rank`, `mamba_conv_bias`, `mamba_proj_bias`; RMS norms *with weights* on dt, B and C
  (`dt_norms="jamba"`, eps `rms_norm_eps`): float32 inside, cast to the input dtype, then times
  the weight.

The mixer owns its cache (`CacheOwner`): it declares a `mamba1` state spec with the tensors
`conv` [Di, d_conv - 1] and `ssm` [Di, N] (as `kv.specs.mamba1_state`), and where its ops can
run (`MAMBA1_OPS`); the plan picks one per group and the runner binds it with the views. The
scan computes in float32 and hands out_proj the model dtype.

Tensor parallel (`hybridkv.distributed`): each rank keeps Di / size inner channels. in_proj is
column-parallel (the x and z halves each split), conv1d, dt_proj, A_log and D per channel;
x_proj is row-parallel, its partial dt | B | C sums all-reduced (so the dt/B/C norms act on the
full vectors, replicated); out_proj is row-parallel and its output all-reduced. The declared
state is one rank's: conv [Di / size, d_conv - 1], ssm [Di / size, N].
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards, rank0_bias
from hybridkv.forward_batch import ForwardBatch, StateMetadata
from hybridkv.kv.specs import CacheDtypes, StateOps, StateSpec, StateTensor
from hybridkv.layers.cache import CacheOwner, StateCache
from hybridkv.layers.linear import small_linear
from hybridkv.ops.derived import derived
from hybridkv.ops.mamba1_ops import Mamba1Params, TorchMamba1Ops
from hybridkv.ops.norm import rms_norm

CONV, SSM = "conv", "ssm"  # the state tensors a Mamba1 layer declares and reads
_OPS = "hybridkv.ops.mamba1_ops:"
_FLOATS = frozenset({"float32", "bfloat16", "float16"})
DT_NORMS = (None, "jamba", "falcon_mamba")
ACTIVATIONS = (None, "silu", "swish")

# Where Mamba1 ops can run, in order of preference (the plan takes the first that runs here).
MAMBA1_OPS = (
    StateOps(
        "native",
        _OPS + "NativeMamba1Ops",
        frozenset({"cpu"}),
        frozenset({"float32", "bfloat16"}),
        needs="native",
        description="C kernels (hybridkv.ops.native): scan in place, float32/bfloat16",
    ),
    StateOps(
        "triton",
        _OPS + "TritonMamba1Ops",
        frozenset({"cuda", "rocm"}),
        _FLOATS,
        needs="triton",
        description="Triton decode steps, PyTorch prefill",
    ),
    StateOps("torch", _OPS + "TorchMamba1Ops", description="PyTorch reference"),
)
TORCH_OPS = TorchMamba1Ops()


class _RMSNormWeight(nn.Module):
    """Holds a Jamba dt/B/C norm's `weight` (applied by `Mamba1Mixer._norm`)."""

    def __init__(self, channels: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))


class Mamba1Mixer(CacheOwner):
    """A Mamba1 mixer whose conv and SSM states live in pages of the state cache."""

    def __init__(
        self,
        hidden_size: int,
        d_inner: int,
        d_state: int,
        d_conv: int,
        dt_rank: int,
        *,
        conv_bias: bool = True,
        proj_bias: bool = False,
        dt_norms: str | None = None,
        norm_eps: float = 1e-6,
        activation: str | None = "silu",
        layer_index: int = 0,
    ):
        super().__init__(layer_index)
        if d_conv < 2:
            raise ValueError(f"d_conv must be at least 2 (one state column), got {d_conv}")
        if dt_norms not in DT_NORMS:
            raise ValueError(f"dt_norms must be one of {DT_NORMS}, got {dt_norms!r}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
        for name, v in (("d_inner", d_inner), ("d_state", d_state), ("dt_rank", dt_rank)):
            if v < 1:
                raise ValueError(f"{name} must be positive, got {v}")
        # Tensor parallel: this rank's inner channels (every Di below is this rank's)
        self.tp = tp = current()
        self.sharded = True  # its channels are this rank's
        full_inner, d_inner = d_inner, tp.split(d_inner, "mamba d_inner")
        self.hidden_size, self.d_inner, self.d_state = hidden_size, d_inner, d_state
        self.d_conv, self.dt_rank = d_conv, dt_rank
        self.dt_norms, self.norm_eps, self.activation = dt_norms, norm_eps, activation
        self._ones: dict[tuple[int, torch.device], torch.Tensor] = {}  # weightless norms' weight

        self.in_proj = nn.Linear(hidden_size, 2 * d_inner, bias=proj_bias)
        # Depthwise: weight [Di, 1, d_conv] as in the checkpoints (padding is unused here).
        self.conv1d = nn.Conv1d(d_inner, d_inner, d_conv, groups=d_inner, bias=conv_bias)
        self.x_proj = nn.Linear(d_inner, dt_rank + 2 * d_state, bias=False)
        self.dt_proj = nn.Linear(dt_rank, d_inner, bias=True)
        A = torch.arange(1, d_state + 1, dtype=torch.float32).expand(d_inner, d_state)
        self.A_log = nn.Parameter(torch.log(A).contiguous())  # [Di, N]
        self.D = nn.Parameter(torch.ones(d_inner))
        self.out_proj = nn.Linear(d_inner, hidden_size, bias=proj_bias)
        if dt_norms == "jamba":
            self.dt_layernorm = _RMSNormWeight(dt_rank)
            self.b_layernorm = _RMSNormWeight(d_state)
            self.c_layernorm = _RMSNormWeight(d_state)
        self._declare_shards(full_inner)

    def _declare_shards(self, full: int) -> None:
        """Where this rank's channels come from: in_proj rows [x | z], x_proj columns."""
        tp = self.tp
        channels, xz = column(tp, (0, full)), column(tp, (0, full), (full, full))
        declare_shards(self.in_proj, weight=xz, bias=xz if self.in_proj.bias is not None else None)
        conv_bias = channels if self.conv1d.bias is not None else None
        declare_shards(self.conv1d, weight=channels, bias=conv_bias)
        declare_shards(self.x_proj, weight=column(tp, (0, full), dim=1))
        declare_shards(self.dt_proj, weight=channels, bias=channels)
        declare_shards(self, A_log=channels, D=channels)
        declare_shards(self.out_proj, weight=column(tp, (0, full), dim=1))
        if self.out_proj.bias is not None:
            declare_shards(self.out_proj, bias=rank0_bias(tp))

    # -- the cache it owns -------------------------------------------------------------------

    def cache_spec(self, dtypes: CacheDtypes) -> StateSpec:
        """conv: the last d_conv - 1 inputs of every inner channel; ssm: the SSM state."""
        return StateSpec(
            "mamba1",
            (
                StateTensor(CONV, (self.d_inner, self.d_conv - 1), dtypes.conv),
                StateTensor(SSM, (self.d_inner, self.d_state), dtypes.ssm),
            ),
            MAMBA1_OPS,
        )

    def _norm(self, x: torch.Tensor, which: str) -> torch.Tensor:
        """The family's RMS norm of one x_proj part (dt, B or C): [T, k] -> [T, k]."""
        if self.dt_norms == "jamba":
            weight = getattr(self, which).weight
            return rms_norm(x, weight, self.norm_eps)
        # falcon_mamba: no weight (the native norm with a weight of ones: the same rounding).
        # float32 ones: the form the kernel reads for either dtype of x, so no step converts
        # them (made in inference mode, a converted copy could not be cached)
        key = (x.shape[-1], x.device)
        ones = self._ones.get(key)
        if ones is None:
            ones = torch.ones(x.shape[-1], dtype=torch.float32, device=x.device)
            self._ones[key] = ones
        return rms_norm(x, ones, self.norm_eps)  # (times float32 ones: the rounding of x_hat)

    def _ssm_inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, Di] after the conv -> dt [T, Di] (before its bias and softplus), B, C [T, N].
        Tensor parallel: x_proj is row-parallel, its partial sums all-reduced."""
        dbc = self.tp.all_reduce(self.x_proj(x))  # [T, R + 2N]
        dt, B, C = dbc.split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.dt_norms is not None:
            dt = self._norm(dt, "dt_layernorm")
            B = self._norm(B, "b_layernorm")
            C = self._norm(C, "c_layernorm")
        return small_linear(dt, self.dt_proj.weight), B, C  # (its bias: in the scan)

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
        ops: TorchMamba1Ops = TORCH_OPS,
        positions: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden_states: [T, hidden]; conv_state: [num_pages, Di, d_conv - 1];
        ssm_state: [num_pages, Di, N] (both updated in place) -> [T, hidden]. positions: (conv,
        ssm) scratch [rows, positions, *state shape] for the states after every position
        (`StateMetadata.scratch_rows`; ops that declare `keeps_positions`)."""
        conv_kept, ssm_kept = (None, None) if positions is None else positions
        xz = self.in_proj(hidden_states)  # [T, 2 Di]
        x, z = xz.split([self.d_inner, self.d_inner], dim=-1)
        # x: [T, Di] after the causal conv and activation
        x = ops.conv1d(
            x, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state, meta, self.activation,
            conv_kept,
        )  # fmt: skip
        dt, B, C = self._ssm_inputs(x)
        A = derived(self.A_log, "neg_exp_f32", lambda a: -torch.exp(a.float()))  # [Di, N]
        params = Mamba1Params(A, self.D, self.dt_proj.bias)
        y = ops.scan(x, dt, B, C, z, ssm_state, meta, params, hidden_states.dtype, ssm_kept)
        return self.out_proj(y)
