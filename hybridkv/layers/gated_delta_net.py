"""The gated delta net layer (Qwen3-Next, Qwen3.5) with its conv and recurrent states in pages.

    hidden [T, H] -> projections -> q, k [T, Hk, K], v [T, Hv, V] (through one causal conv1d
    over [q | k | v] with silu), z [T, Hv, V], b, a [T, Hv]
    g = -exp(A_log) * softplus(a + dt_bias)      beta = sigmoid(b)
    o = gated delta rule(q, k, v, g, beta)        (ops.gated_delta; state [Hv, K, V] per page)
    out_proj(rmsnorm(o) * weight * silu(z))      the norm is per value head, before the gate

Parameter names follow transformers (`in_proj_qkvz`, `in_proj_ba` in Qwen3-Next; `in_proj_qkv`,
`in_proj_z`, `in_proj_b`, `in_proj_a` in Qwen3.5; `conv1d`, `dt_bias`, `A_log`, `norm.weight`,
`out_proj`) so checkpoints load by name. Qwen3-Next's fused projections are grouped by key
head: for key head h the columns hold [q_h | k_h | v of its Hv/Hk value heads | z of them].

The layer owns its cache (`CacheOwner`): a `gated_delta_net` state of `conv` [2 * Hk * K + Hv *
V, conv_kernel - 1] and `recurrent` [Hv, K, V], and declares where its ops can run
(`GDN_OPS`).
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.distributed.parallel import current, declare_shards, explicit
from hybridkv.forward_batch import ForwardBatch, StateMetadata
from hybridkv.kv.specs import CacheDtypes, StateOps, StateSpec, StateTensor
from hybridkv.layers.cache import CacheOwner, StateCache
from hybridkv.ops.derived import derived
from hybridkv.ops.elementwise import to_dtype
from hybridkv.ops.gated_delta import gdn_gates
from hybridkv.ops.gdn_ops import TorchGDNOps
from hybridkv.ops.norm import gated_rms_norm
from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

CONV, RECURRENT = "conv", "recurrent"  # the state tensors this layer declares and reads
LAYOUTS = ("qwen3_next", "qwen3_5", "olmo_hybrid")
_OPS = "hybridkv.ops.gdn_ops:"

# Where the ops can run, in order of preference (the plan takes the first that runs here).
GDN_OPS = (
    StateOps(
        "fla",
        _OPS + "FlaGDNOps",
        frozenset({"cuda"}),
        frozenset({"float32", "float16", "bfloat16"}),
        needs="fla",
        description="flash-linear-attention's chunked kernel for prefill chunks (fla-core, "
        "when installed), hybridkv's Triton decode steps",
        compute_dtypes=frozenset({"float16", "bfloat16"}),
    ),
    StateOps(
        "native",
        _OPS + "NativeGDNOps",
        frozenset({"cpu"}),
        frozenset({"float32", "bfloat16"}),  # the rule's kernel takes both (float32 math)
        needs="native",
        description="C kernels (hybridkv.ops.native), state in place; PyTorch conv1d for "
        "bfloat16 activations or conv state",
    ),
    StateOps(
        "triton",
        _OPS + "TritonGDNOps",
        frozenset({"cuda", "rocm"}),
        frozenset({"float32", "float16", "bfloat16"}),
        needs="triton",
        description="Triton decode steps (conv1d and rule), PyTorch chunked prefill",
    ),
    StateOps("torch", _OPS + "TorchGDNOps", description="PyTorch reference"),
)
TORCH_OPS = TorchGDNOps()

# The input preparation of a step (`GatedDeltaNet._prep`: the projections, then qkv, z and the
# gates g, beta), keyed by x's dtype; each implementation takes (layer, x [T, hidden]):
#   float32 / bfloat16 on the CPU   native (Qwen3-Next's and Qwen3.5's layouts:
#                                   `GatedDeltaNet.native_prep_fits`; else the chain without it)
#   otherwise                       torch (four strided reshapes, a cat, `gdn_gates`)
GDN_PREP = declare(
    "gdn_prep",
    (
        OpImpl("native", f"{__name__}:_native_gdn_prep", frozenset({"cpu"}), CPU_FLOATS,
               ("native",), strict=True, description="gdn_prep.c: one pass over the outputs"),
        OpImpl("torch", f"{__name__}:torch_gdn_prep", description="reshapes, cat, gdn_gates"),
    ),
)  # fmt: skip


class _NormWeight(nn.Module):
    """Holds `norm.weight` (the computation is `ops.norm.gated_rms_norm`)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))


class GatedDeltaNet(CacheOwner):
    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int = 4,
        norm_eps: float = 1e-6,
        layout: str = "qwen3_next",
        *,
        beta_scale: float = 1.0,
        layer_index: int = 0,
    ) -> None:
        """`layout`: the checkpoint's projections (Qwen3-Next's fused, key-head-grouped qkvz and
        ba; Qwen3.5's qkv, z, b, a; OLMo Hybrid's q, k, v, g, b, a). `beta_scale`: 2 lets beta
        reach [0, 2] (OLMo Hybrid's `linear_allow_neg_eigval`, negative eigenvalues)."""
        super().__init__(layer_index)
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({num_k_heads})"
            )
        if layout not in LAYOUTS:
            raise ValueError(f"unknown gated delta net layout {layout!r}; known: {LAYOUTS}")
        if conv_kernel < 2:
            raise ValueError(f"linear_conv_kernel_dim must be at least 2, got {conv_kernel}")
        # Tensor parallel: this rank's key and value heads (every size below is this rank's)
        self.tp = tp = current()
        self.sharded = True  # its heads (and groups) are this rank's
        num_k_heads = tp.split(num_k_heads, "linear_num_key_heads")
        num_v_heads = tp.split(num_v_heads, "linear_num_value_heads")
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.norm_eps = norm_eps
        self.layout = layout
        self.beta_scale = beta_scale
        if layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden_size, self.conv_dim + self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden_size, 2 * num_v_heads, bias=False)
        elif layout == "olmo_hybrid":
            self.q_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
            self.k_proj = nn.Linear(hidden_size, self.key_dim, bias=False)
            self.v_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.g_proj = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.b_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.a_proj = nn.Linear(hidden_size, num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden_size, num_v_heads, bias=False)
        # depthwise, no bias: weight [conv_dim, 1, kernel] as in the checkpoints
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = _NormWeight(head_v_dim)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self._declare_shards()

    def _declare_shards(self) -> None:
        """This rank's rows: heads are contiguous in every projection (Qwen3-Next's fused ones
        are grouped by key head, so a rank's key heads are one block of rows)."""
        tp = self.tp
        if tp.size == 1:
            return
        kd, vd, hv = self.key_dim, self.value_dim, self.num_v_heads
        full_k = kd * tp.size
        k_rows, v_rows = explicit(tp, (tp.rank * kd, kd)), explicit(tp, (tp.rank * vd, vd))
        heads = explicit(tp, (tp.rank * hv, hv))
        qkv = explicit(
            tp, (tp.rank * kd, kd), (full_k + tp.rank * kd, kd), (2 * full_k + tp.rank * vd, vd)
        )
        declare_shards(self.conv1d, weight=qkv)
        declare_shards(self, dt_bias=heads, A_log=heads)
        declare_shards(self.out_proj, weight=explicit(tp, (tp.rank * vd, vd), dim=1))
        if self.layout == "qwen3_next":
            fused = self.conv_dim + self.value_dim
            declare_shards(self.in_proj_qkvz, weight=explicit(tp, (tp.rank * fused, fused)))
            declare_shards(self.in_proj_ba, weight=explicit(tp, (tp.rank * 2 * hv, 2 * hv)))
        elif self.layout == "olmo_hybrid":
            for name, spec in (("q", k_rows), ("k", k_rows), ("v", v_rows), ("g", v_rows),
                               ("b", heads), ("a", heads)):  # fmt: skip
                declare_shards(getattr(self, f"{name}_proj"), weight=spec)
        else:
            declare_shards(self.in_proj_qkv, weight=qkv)
            declare_shards(self.in_proj_z, weight=v_rows)
            declare_shards(self.in_proj_b, weight=heads)
            declare_shards(self.in_proj_a, weight=heads)

    # -- the cache it owns -------------------------------------------------------------------

    def cache_spec(self, dtypes: CacheDtypes) -> StateSpec:
        """conv: the last conv_kernel - 1 inputs of [q | k | v]; recurrent: S per value head."""
        return StateSpec(
            "gated_delta_net",
            (
                StateTensor(CONV, (self.conv_dim, self.conv_kernel - 1), dtypes.conv),
                StateTensor(
                    RECURRENT, (self.num_v_heads, self.head_k_dim, self.head_v_dim), dtypes.ssm
                ),
            ),
            GDN_OPS,
        )

    # -- projections ------------------------------------------------------------------------

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: [T, hidden] -> qkv [T, conv_dim] (as [q | k | v]), z [T, value_dim], b, a [T, Hv]."""
        if self.layout == "qwen3_5":
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        if self.layout == "olmo_hybrid":
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
            return qkv, self.g_proj(x), self.b_proj(x), self.a_proj(x)
        t = x.shape[0]
        per = self.num_v_heads // self.num_k_heads  # value heads per key head
        kd, vd = self.head_k_dim, self.head_v_dim
        # [T, Hk, K | K | per*V | per*V]: grouped by key head
        qkvz = self.in_proj_qkvz(x).view(t, self.num_k_heads, 2 * kd + 2 * per * vd)
        q, k, v, z = qkvz.split([kd, kd, per * vd, per * vd], dim=-1)
        ba = self.in_proj_ba(x).view(t, self.num_k_heads, 2 * per)
        b, a = ba.split([per, per], dim=-1)
        qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return qkv, z.reshape(t, -1), b.reshape(t, -1), a.reshape(t, -1)

    def native_prep_fits(self, x: torch.Tensor) -> bool:
        """The native preparation's rule: Qwen3-Next's layout (its projections grouped by key
        head: split and gated in one pass) or Qwen3.5's (its own projections, the gates in one
        pass), x [T, hidden] on the CPU (its dtype: the family's). OLMo Hybrid's concatenates
        three projections in PyTorch anyway."""
        native_layout = self.layout in ("qwen3_next", "qwen3_5")
        return native_layout and x.device.type == "cpu" and x.dim() == 2

    def _prep(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, hidden] -> qkv, z, g, beta: the `GDN_PREP` chain of x's dtype (without the
        native link where `native_prep_fits` says no)."""
        if self.native_prep_fits(x):
            chain = GDN_PREP.of(x)
        else:
            chain = GDN_PREP.chain(x.device, x.dtype, ("native",))
        return chain.first(self, x)

    def _native_prep(self, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The native preparation where its rule holds (`native_prep_fits`), else None."""
        return _native_gdn_prep(self, x) if self.native_prep_fits(x) else None

    # -- forward ----------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden_states: [T, hidden] -> [T, hidden], states updated in this layer's pages."""
        cache = self.cache
        assert isinstance(cache, StateCache)
        meta: StateMetadata = self.step_metadata(batch)
        positions = cache.kept(meta, CONV, RECURRENT)  # speculative decoding's per-position states
        out = self.mix(
            hidden_states, cache.tensors[CONV], cache.tensors[RECURRENT], meta, cache.ops,
            positions,
        )  # fmt: skip
        return self.tp.all_reduce(out)  # out_proj is row-parallel

    def mix(
        self,
        hidden_states: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        meta: StateMetadata,
        ops: TorchGDNOps = TORCH_OPS,
        positions: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden_states: [T, hidden]; conv_state: [num_pages, conv_dim, conv_kernel - 1];
        recurrent_state: [num_pages, Hv, K, V] (both updated in place) -> [T, hidden].
        positions: (conv, recurrent) scratch [rows, positions, *state shape] for the states
        after every position (`StateMetadata.scratch_rows`; ops that `keeps_positions`)."""
        conv_kept, rule_kept = (None, None) if positions is None else positions
        t = hidden_states.shape[0]
        qkv, z, g, beta = self._prep(hidden_states)  # g, beta: [T, Hv] float32
        # native decode steps: the conv's float32 results (bfloat16 values for a bfloat16 model)
        # go to the decode kernel as they are, without a bfloat16 copy to widen again (prefill
        # chunks of a bfloat16 model keep bfloat16 q, k, v: the AMX chunk kernel takes those)
        conv_dtype = torch.float32 if ops.name == "native" and meta.max_query_len == 1 else None
        qkv = ops.conv1d(
            qkv, self.conv1d.weight[:, 0, :], None, conv_state, meta, "silu", conv_dtype,
            conv_kept,
        )  # fmt: skip
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        if self.beta_scale != 1.0:
            beta = beta * self.beta_scale
        q = q.reshape(t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(t, self.num_v_heads, self.head_v_dim)
        # the native decode kernel goes on through the norm itself (bfloat16 models)
        rule_norm = getattr(ops, "rule_norm", None)
        y = None
        if rule_norm is not None and z.dtype == torch.bfloat16:
            y = rule_norm(q, k, v, g, beta, recurrent_state, meta, z, self.norm.weight,
                          self.norm_eps)  # fmt: skip
        if y is None:
            o = ops.rule(q, k, v, g, beta, recurrent_state, meta, rule_kept)  # [T, Hv, V] fp32
            # transformers rounds the rule's output to the model dtype before the norm, which
            # normalises each value head with one [V] weight: rows of [T * Hv, V]
            # (to_dtype: a native conversion, so a bfloat16 verify step stays capturable)
            o = to_dtype(o, hidden_states.dtype).reshape(t * self.num_v_heads, self.head_v_dim)
            z = z.reshape(t * self.num_v_heads, self.head_v_dim)
            y = gated_rms_norm(
                o, z, self.norm.weight, self.norm_eps, self.head_v_dim, norm_before_gate=True
            )
        return self.out_proj(y.reshape(t, self.value_dim))


def _native_gdn_prep(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """Qwen3-Next's layout on the CPU: the projections, then qkv, z and the gates in one native
    pass over their outputs (`ops.native.gdn_prep`), in_proj_ba on the native bf16 kernel at any
    batch size where it takes the weight (bfloat16, no bias: 16-odd outputs, oneDNN's call costs
    more than its work), the layer's own linear otherwise. Qwen3.5's: its four projections,
    then the gates in one native pass."""
    from hybridkv.ops.native import bf16_linear, gdn_prep

    decay = derived(layer.A_log, "neg_exp_f32", lambda w: -torch.exp(w.float()))
    dt_bias = derived(layer.dt_bias, "f32", torch.Tensor.float)
    if layer.layout == "qwen3_5":
        qkv, z, b, a = layer._project(x)
        gates = gdn_prep.gates(a, b, decay, dt_bias)
        return None if gates is None else (qkv, z, *gates)
    qkvz = layer.in_proj_qkvz(x)
    weight, bias = layer.in_proj_ba.weight, layer.in_proj_ba.bias
    kernel = bf16_linear.kernel()
    fits = x.dtype == torch.bfloat16 and bias is None and kernel is not None
    if fits and bf16_linear.weight_fits(weight, None):
        ba = bf16_linear.run(kernel, x, weight, None)
    else:
        ba = layer.in_proj_ba(x)
    per = layer.num_v_heads // layer.num_k_heads
    return gdn_prep.prep(
        qkvz, ba, layer.num_k_heads, per, layer.head_k_dim, layer.head_v_dim, decay, dt_bias
    )


def torch_gdn_prep(layer: GatedDeltaNet, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    qkv, z, b, a = layer._project(x)
    g, beta = gdn_gates(a, b, layer.A_log, layer.dt_bias)  # [T, Hv] float32
    return qkv, z, g, beta
