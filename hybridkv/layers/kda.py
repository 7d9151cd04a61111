"""Kimi delta attention (KDA), the linear-attention layer of Kimi-Linear, with its conv and
recurrent states in pages.

    hidden x [T, hidden] -> q_proj, k_proj, v_proj -> [T, H * D] each
    q, k, v: each through its own causal depthwise conv1d (silu), with its own conv state
    g = -exp(A_log[h]) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)   [T, H, D] per key channel
    beta = sigmoid(b_proj(x))                                        [T, H]      (KDA_GATES)
    o = KDA rule(q, k, v, g, beta)                 (ops.kda; state [H, D, D] per page)
    o_proj(rmsnorm(o) * o_norm.weight * sigmoid(g_b_proj(g_a_proj(x))))   per head of D
                                                                     (KDA_OUT_NORM)

KDA is a state kind of its own ("kda"), not the gated delta net with a per-channel gate:
`hybridkv.ops.kda` gives the reasons (the decay's shape changes every path of the rule, and the
cache holds three conv states). Parameter names follow the released checkpoints (`q_conv1d`,
`k_conv1d`, `v_conv1d`, `f_a_proj`, `f_b_proj`, `A_log` [1, 1, H, 1], `dt_bias` [H * D],
`b_proj`, `g_a_proj`, `g_b_proj`, `o_norm.weight`, `o_proj`), which is also how transformers
saves them; the model's loader maps transformers' in-memory names (`conv1d` stacking the three,
`forget_gate.*`) onto these.

The layer owns its cache (`CacheOwner`): a `kda` state of `conv_q`, `conv_k`, `conv_v`
[H * D, conv_kernel - 1] and `recurrent` [H, D, D], the same spec as
`hybridkv.kv.specs.kda_state`, and declares where its ops can run (`KDA_OPS`).

Tensor parallel (`hybridkv.distributed`): each rank keeps H / size heads, every size above is
the rank's (so the state spec is per rank). q/k/v_proj, their convs, f_b_proj, g_b_proj,
dt_bias (rows of the rank's head channels), b_proj and A_log (the rank's heads) are split;
the low-rank first halves f_a_proj and g_a_proj and o_norm (one weight per head channel) are
replicated; o_proj is row-parallel and its output all-reduced.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.distributed.parallel import column, current, declare_shards
from hybridkv.forward_batch import ForwardBatch, StateMetadata
from hybridkv.kv.specs import CacheDtypes, StateOps, StateSpec, StateTensor
from hybridkv.layers.cache import CacheOwner, StateCache
from hybridkv.ops.derived import derived
from hybridkv.ops.kda import kda_gate
from hybridkv.ops.kda_ops import TorchKdaOps
from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

CONVS = ("conv_q", "conv_k", "conv_v")  # the state tensors this layer declares and reads
RECURRENT = "recurrent"
_OPS = "hybridkv.ops.kda_ops:"

# Where the ops can run, in order of preference (the plan takes the first that runs here).
# "fla" comes after "triton": declared and tested, chosen only when asked for by name until its
# accuracy on a GPU is understood (benchmarks/README.md, the fla section).
KDA_OPS = (
    StateOps(
        "native",
        _OPS + "NativeKdaOps",
        frozenset({"cpu"}),
        frozenset({"float32", "bfloat16"}),  # the rule's kernel takes both (float32 math)
        needs="native",
        description="C kernels (hybridkv.ops.native), state in place; PyTorch conv1d for "
        "bfloat16 activations or conv state",
    ),
    StateOps(
        "triton",
        _OPS + "TritonKdaOps",
        frozenset({"cuda", "rocm"}),
        frozenset({"float32", "float16", "bfloat16"}),
        needs="triton",
        description="Triton decode steps (conv1d and rule), PyTorch chunked prefill",
    ),
    StateOps(
        "fla",
        _OPS + "FlaKdaOps",
        frozenset({"cuda"}),
        frozenset({"float32", "float16", "bfloat16"}),
        needs="fla",
        description="flash-linear-attention's chunked KDA kernel for prefill chunks (fla-core, "
        "when installed), hybridkv's Triton decode steps; opt-in (state_backend='fla'): on an "
        "H200 its bf16 Kimi-Linear logits were 2.2x further from float32 than triton's",
        compute_dtypes=frozenset({"float16", "bfloat16"}),
    ),
    StateOps("torch", _OPS + "TorchKdaOps", description="PyTorch reference"),
)
TORCH_OPS = TorchKdaOps()

# The layer's glue around the rule, keyed by x's dtype (a decode step stays capturable on the
# CPU: no PyTorch op between its kernels); each implementation takes the layer first:
#   kda_gates (layer, f [T, H * K], b [T, H]) -> g [T, H, K], beta [T, H] float32
#   kda_out_norm (layer, o [T * H, K] float32, gate [T * H, K]) -> [T * H, K] in gate's dtype
_CPU = frozenset({"cpu"})
KDA_GATES = declare(
    "kda_gates",
    (
        OpImpl("native", f"{__name__}:_native_kda_gates", _CPU, CPU_FLOATS, ("native",),
               strict=True, description="kda.c: g and beta in one pass"),
        OpImpl("torch", f"{__name__}:torch_kda_gates"),
    ),
)  # fmt: skip
KDA_OUT_NORM = declare(
    "kda_out_norm",
    (
        OpImpl("native", f"{__name__}:_native_kda_out_norm", _CPU, CPU_FLOATS, ("native",),
               strict=True, description="kda.c: rounding, norm and sigmoid gate in one pass"),
        OpImpl("torch", f"{__name__}:torch_kda_out_norm"),
    ),
)  # fmt: skip


class _NormWeight(nn.Module):
    """Holds `o_norm.weight` (the computation is `sigmoid_gated_rms_norm`)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))


def sigmoid_gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x, gate: [N, D]; weight: [D] -> weight * rmsnorm(x) * sigmoid(gate), all in float32 and
    rounded to x.dtype once at the end (as transformers' KimiLinearRMSNormGated)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * xf * torch.sigmoid(gate.float())).to(x.dtype)


def _depthwise(channels: int, kernel: int) -> nn.Conv1d:
    """A depthwise causal conv without bias: weight [channels, 1, kernel] as in the checkpoints."""
    return nn.Conv1d(channels, channels, kernel, groups=channels, bias=False)


class KimiDeltaAttention(CacheOwner):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        head_dim: int,
        conv_kernel: int = 4,
        norm_eps: float = 1e-5,
        *,
        layer_index: int = 0,
    ) -> None:
        super().__init__(layer_index)
        if conv_kernel < 2:
            raise ValueError(f"short_conv_kernel_size must be at least 2, got {conv_kernel}")
        self.tp = tp = current()
        self.sharded = True  # its heads are this rank's
        full_heads = num_heads
        num_heads = tp.split(full_heads, "linear_attn_config.num_heads")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.width = width = num_heads * head_dim
        self.conv_kernel, self.norm_eps = conv_kernel, norm_eps
        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        self.q_conv1d = _depthwise(width, conv_kernel)
        self.k_conv1d = _depthwise(width, conv_kernel)
        self.v_conv1d = _depthwise(width, conv_kernel)
        self.f_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.f_b_proj = nn.Linear(head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(1, 1, num_heads, 1))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.b_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self.g_a_proj = nn.Linear(hidden_size, head_dim, bias=False)
        self.g_b_proj = nn.Linear(head_dim, width, bias=False)
        self.o_norm = _NormWeight(head_dim)
        self.o_proj = nn.Linear(width, hidden_size, bias=False)
        self._declare_shards(full_heads)

    def _declare_shards(self, full_heads: int) -> None:
        """This rank's head channels (rows [rank * H/size * D, +H/size * D) of every per-channel
        tensor) and heads; the checkpoint lays every one out head by head."""
        tp, full_width = self.tp, full_heads * self.head_dim
        channels = column(tp, (0, full_width))
        for module in (self.q_proj, self.k_proj, self.v_proj, self.q_conv1d, self.k_conv1d,
                       self.v_conv1d, self.f_b_proj, self.g_b_proj):  # fmt: skip
            declare_shards(module, weight=channels)
        declare_shards(self, dt_bias=channels, A_log=column(tp, (0, full_heads), dim=2))
        declare_shards(self.b_proj, weight=column(tp, (0, full_heads)))
        declare_shards(self.o_proj, weight=column(tp, (0, full_width), dim=1))

    # -- the cache it owns -------------------------------------------------------------------

    def cache_spec(self, dtypes: CacheDtypes) -> StateSpec:
        """conv_q/k/v: the last conv_kernel - 1 inputs of each conv; recurrent: S per head."""
        conv = (self.width, self.conv_kernel - 1)
        shape = (self.num_heads, self.head_dim, self.head_dim)
        tensors = tuple(StateTensor(name, conv, dtypes.conv) for name in CONVS)
        return StateSpec("kda", (*tensors, StateTensor(RECURRENT, shape, dtypes.ssm)), KDA_OPS)

    # -- forward ----------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """hidden_states: [T, hidden] -> [T, hidden], states updated in this layer's pages."""
        cache = self.cache
        assert isinstance(cache, StateCache)
        meta: StateMetadata = self.step_metadata(batch)
        convs = tuple(cache.tensors[name] for name in CONVS)
        kept = cache.kept(meta, *CONVS, RECURRENT)  # speculative decoding's per-position states
        out = self.mix(hidden_states, convs, cache.tensors[RECURRENT], meta, cache.ops, kept)
        return self.tp.all_reduce(out)  # o_proj is row-parallel

    def mix(
        self,
        hidden_states: torch.Tensor,
        conv_states: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        recurrent_state: torch.Tensor,
        meta: StateMetadata,
        ops: TorchKdaOps = TORCH_OPS,
        positions: tuple[torch.Tensor, ...] | None = None,
    ) -> torch.Tensor:
        """hidden_states: [T, hidden]; conv_states: 3 x [num_pages, H * D, conv_kernel - 1];
        recurrent_state: [num_pages, H, D, D] (all updated in place) -> [T, hidden].
        positions: the q, k, v conv and recurrent scratch [rows, positions, *state shape] for
        the states after every position (`StateMetadata.scratch_rows`)."""
        kept = (None,) * 4 if positions is None else positions
        x = hidden_states
        t, heads, dim = x.shape[0], self.num_heads, self.head_dim
        qkv = []
        for proj, conv, state, conv_kept in zip(
            (self.q_proj, self.k_proj, self.v_proj),
            (self.q_conv1d, self.k_conv1d, self.v_conv1d),
            conv_states,
            kept[:3],
            strict=True,
        ):
            w = conv.weight[:, 0, :]
            y = ops.conv1d(proj(x), w, None, state, meta, "silu", None, conv_kept)
            qkv.append(y.reshape(t, heads, dim))  # [T, H, D]
        f = self.f_b_proj(self.f_a_proj(x))  # [T, H * D]
        g, beta = KDA_GATES.of(x).first(self, f, self.b_proj(x))  # [T, H, D], [T, H] float32
        o = ops.rule(*qkv, g, beta, recurrent_state, meta, kept[3])  # [T, H, D] float32
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(t * heads, dim)
        y = KDA_OUT_NORM.of(x).first(self, o.reshape(t * heads, dim), gate)  # [T * H, D]
        return self.o_proj(y.reshape(t, self.width))


def torch_kda_gates(
    layer: KimiDeltaAttention, f: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """f: [T, H * D], b: [T, H] -> g [T, H, D], beta [T, H] float32 (beta: the sigmoid in the
    model dtype, as transformers computes it, widened)."""
    return kda_gate(f, layer.A_log, layer.dt_bias), torch.sigmoid(b).float()


def _native_kda_gates(
    layer: KimiDeltaAttention, f: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor] | None:
    from hybridkv.ops.native import kda as native_kda

    decay = derived(layer.A_log, "neg_exp_f32", lambda w: -torch.exp(w.float()).reshape(-1))
    dt_bias = derived(layer.dt_bias, "f32", torch.Tensor.float)
    f = f if f.stride(-1) == 1 else f.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    return native_kda.gates(f, b, decay, dt_bias, layer.head_dim)


def torch_kda_out_norm(
    layer: KimiDeltaAttention, o: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor:
    """o: [N, D] float32, gate: [N, D] -> [N, D] in gate's dtype; transformers rounds the
    rule's output to the model dtype before the norm."""
    return sigmoid_gated_rms_norm(o.to(gate.dtype), gate, layer.o_norm.weight, layer.norm_eps)


def _native_kda_out_norm(
    layer: KimiDeltaAttention, o: torch.Tensor, gate: torch.Tensor
) -> torch.Tensor | None:
    from hybridkv.ops.native import kda as native_kda

    weight = derived(layer.o_norm.weight, "f32", torch.Tensor.float)
    gate = gate if gate.stride(-1) == 1 else gate.contiguous()
    return native_kda.out_norm(o.contiguous(), gate, weight, layer.norm_eps)
