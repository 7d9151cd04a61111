"""The native MoE kernels (`moe.c`, compiled into the one native library): their ctypes
signatures, the weight packing, the checks that keep them inside their tensors.

On AMX tiles, bfloat16:
- `routed_experts`: `hybridkv.layers.mlp.gated_experts` for bfloat16 experts (its PyTorch path
  where this returns None);
- `swiglu_expert`: one SwiGLU MLP (gate, up, down weights) scaled per token, as Qwen3-Next's
  gated shared expert, `sigmoid(g) * down(silu(gate x) * up x)`;
- `route`: the softmax routers (and Qwen3-Next's shared-expert gate) in one pass per token.

On every build (AVX-512, AVX2 + FMA or plain C: the small-batch linears' kernels), float32 or
bfloat16:
- `vector_route`: a gate's product (with its bias, if any), the rule (softmax, topk_softmax or
  sigmoid; a choice bias, groups, renormalisation with eps, scaling: `NativeRule`) and top-k in
  one call;
- `vector_experts`, `vector_relu2_experts`, `vector_clamped_experts`: every (token, expert) pair
  of the SwiGLU, relu2 (Nemotron-H) or clamped SwiGLU (gpt-oss, biases) experts in one call.

Both round as the PyTorch paths they replace (see moe.c); the tests compare them with a float64
reference and with those paths."""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch
import torch.nn.functional as F

from hybridkv.ops import native
from hybridkv.ops.derived import derived

_i64, _int, _f32, _ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_void_p
native.declare({
    "hkv_moe_bf16": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr,
                     _i64, _ptr, _i64],
    "hkv_moe_route_bf16": [_ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _ptr,
                           _ptr, _ptr],
})  # fmt: skip
native.declare({
    "hkv_moe_route": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _int, _int, _ptr, _i64,
                      _i64, _int, _f32, _f32, _ptr, _ptr, _ptr],
    "hkv_moe_experts": [_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int,
                        _int, _ptr, _ptr, _f32, _f32, _ptr, _i64],
})  # fmt: skip
native.returns_status("hkv_moe_bf16", "hkv_moe_experts")

TILE_N, TILE_K = 16, 32  # a packed tile: 16 output rows x 32 values of k

_ready: bool | None = None


def available() -> bool:
    """The library is built with AMX-BF16 and the kernel granted this process the tile data
    (`HYBRIDKV_NATIVE=0`, no compiler or a CPU without AMX: False)."""
    global _ready
    lib = native.library()
    if lib is None:
        return False
    if _ready is None:
        fn = lib.hkv_amx_ready  # a feature probe (cpu.c): a plain ctypes function
        fn.argtypes, fn.restype = [], ctypes.c_int
        _ready = bool(fn())
    return _ready


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _tiles(w: torch.Tensor) -> torch.Tensor:
    """w: [E, N, K] (y = x @ w[e]^T) -> AMX B tiles [E, N/16, K/32, 16, 16, 2], N and K padded
    with zeros: element [e, nb, kb, kp, n, p] = w[e, nb*16 + n, kb*32 + 2*kp + p]."""
    e, n, k = w.shape
    w = F.pad(w, (0, -k % TILE_K, 0, -n % TILE_N))
    nb, kb = w.shape[1] // TILE_N, w.shape[2] // TILE_K
    tiles = w.reshape(e, nb, TILE_N, kb, TILE_K // 2, 2).permute(0, 1, 3, 4, 2, 5)
    return tiles.contiguous()


def pack_gate_up(gate_up: torch.Tensor) -> torch.Tensor:
    """[E, 2I, H] ([gate | up] rows) -> tiles of [E, 2Ip, H], Ip = I rounded up to 16: 16-row
    blocks alternating gate and up (zero rows past I in each)."""
    e, two_i, h = gate_up.shape
    inter = two_i // 2
    pad = _round_up(inter, TILE_N) - inter
    gate, up = (F.pad(w, (0, 0, 0, pad)) for w in gate_up.detach().split(inter, dim=1))
    blocks = torch.stack([gate.reshape(e, -1, TILE_N, h), up.reshape(e, -1, TILE_N, h)], dim=2)
    return _tiles(blocks.reshape(e, -1, h))


def pack_down(down: torch.Tensor) -> torch.Tensor:
    """[E, H, I] -> tiles of [E, H, Kp2], Kp2 = I rounded up to 16, then to 32 (zeros)."""
    inter = down.shape[2]
    return _tiles(F.pad(down.detach(), (0, _round_up(inter, TILE_N) - inter)))


def _version(t: torch.Tensor) -> int:
    return -1 if t.is_inference() else t._version


def _bf16_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)


def _run(x, experts, weights, gate_up_tiles, down_tiles, num_experts, inter, extra=None):
    """The kernel on checked tensors (experts None: expert 0 for every pair) -> [T, H]
    bfloat16."""
    tokens, k = weights.shape
    hidden = x.shape[1]
    out = torch.empty(tokens, hidden, dtype=torch.bfloat16)
    if tokens == 0 or k == 0:
        return out.zero_() if extra is None else out.copy_(extra)
    if x.stride(1) != 1:
        x = x.contiguous()
    if extra is not None and extra.stride(1) != 1:
        extra = extra.contiguous()
    weights = weights.contiguous()
    experts = None if experts is None else experts.contiguous()
    code = native.library().hkv_moe_bf16(
        x.data_ptr(), x.stride(0), tokens, hidden, None if experts is None else experts.data_ptr(),
        weights.data_ptr(), k, num_experts, gate_up_tiles.data_ptr(), down_tiles.data_ptr(),
        _round_up(inter, TILE_N), None if extra is None else extra.data_ptr(),
        0 if extra is None else extra.stride(0), out.data_ptr(), out.stride(0),
    )  # fmt: skip
    if code == -1:
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    if code != 0:
        raise MemoryError("the native experts could not allocate their work space")
    return out


def routed_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    extra: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """`layers.mlp.gated_experts` on AMX tiles: x [T, H]; experts (int64), weights [T, k];
    gate_up [E, 2I, H]; down [E, H, I]; extra: None or [T, H], added last -> [T, H] bfloat16,
    rounded as the PyTorch path rounds (see moe.c); None when the kernel or these tensors don't
    fit (all bfloat16 on the CPU, no autograd)."""
    if not available() or torch.is_grad_enabled():
        return None
    if x.dim() != 2 or experts.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        return None
    if not _bf16_cpu(x, weights, gate_up, down) or experts.dtype != torch.int64:
        return None
    num_experts, two_inter, hidden = gate_up.shape
    if x.shape[1] != hidden or two_inter % 2 or down.shape != (num_experts, hidden, two_inter // 2):
        return None
    if hidden == 0 or two_inter == 0:  # (no tiles to pack: the PyTorch path's zeros)
        return None
    if weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        return None
    if extra is not None and (extra.shape != x.shape or not _bf16_cpu(extra)):
        return None
    gate_up_tiles = derived(gate_up, "amx_gate_up", pack_gate_up)
    down_tiles = derived(down, "amx_down", pack_down)
    return _run(x, experts, weights, gate_up_tiles, down_tiles, num_experts, two_inter // 2,
                extra)  # fmt: skip


def swiglu_expert(
    x: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
    scale: torch.Tensor,
) -> torch.Tensor | None:
    """scale * down(silu(x @ gate^T) * (x @ up^T)) with every product rounded as PyTorch's
    bfloat16 ops round it: x [T, H]; gate, up [I, H]; down [H, I] (nn.Linear weights, no bias);
    scale [T, 1] -> [T, H] bfloat16; None when the kernel or these tensors don't fit."""
    if not available() or torch.is_grad_enabled() or x.dim() != 2:
        return None
    if not _bf16_cpu(x, gate, up, down, scale):
        return None
    inter, hidden = gate.shape
    if up.shape != gate.shape or down.shape != (hidden, inter) or x.shape[1] != hidden:
        return None
    if hidden == 0 or inter == 0:
        return None
    if scale.shape != (x.shape[0], 1):
        return None
    # packed from both weights: the key names up's version, so either changing re-packs
    key = f"amx_swiglu:{_version(up)}:{up.data_ptr()}:{_version(down)}:{down.data_ptr()}"
    gate_up_tiles, down_tiles = derived(
        gate, key, lambda g: (pack_gate_up(torch.cat([g, up])[None]), pack_down(down[None]))
    )
    return _run(x, None, scale, gate_up_tiles, down_tiles, 1, inter)


# routing modes of `route` (moe.c's hkv_moe_route_bf16)
SOFTMAX_TOPK = 0  # softmax over every expert, the k largest probabilities (Jamba)
SOFTMAX_TOPK_RENORMALISED = 1  # the same, the k renormalised to sum 1 (Qwen3-Next)
TOPK_SOFTMAX = 2  # the k largest logits, then the softmax of those k (Granite MoE)
SIGMOID = 3  # independent sigmoid scores (DeepSeek-V3, Kimi, Nemotron-H, LFM2-MoE): vector_route


class NativeRule(NamedTuple):
    """A routing rule as `vector_route` (moe.c's struct moe_rule) computes it: `mode`
    (SOFTMAX_TOPK, SOFTMAX_TOPK_RENORMALISED, TOPK_SOFTMAX, SIGMOID) on float32 logits; the
    best `kept` of `groups` equal expert groups (kept < groups), scored by their best choice
    (`group_max`) or the sum of their best two; the k weights renormalised (+ eps when
    nonzero), then times `scaling`; `bf16_scores`: the scores and every step after them rounded
    to bfloat16 (sigmoid and topk_softmax: PyTorch's ops on bfloat16 logits)."""

    mode: int
    groups: int = 1
    kept: int = 1
    group_max: bool = False
    renormalise: bool = False
    eps: float = 0.0
    scaling: float = 1.0
    bf16_scores: bool = False


def route(
    x: torch.Tensor,
    router: torch.Tensor,
    shared_gate: torch.Tensor | None,
    k: int,
    mode: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """A softmax router in one pass per token: x [T, H]; router [E, H] and shared_gate [1, H]
    or None (nn.Linear weights, no bias) -> experts [T, k] int64 (largest first), weights
    [T, k] bfloat16 as `mode` says (SOFTMAX_TOPK, SOFTMAX_TOPK_RENORMALISED, TOPK_SOFTMAX) and
    scale [T, 1] bfloat16 = sigmoid(x @ shared_gate^T) (None without one, Qwen3-Next's shared
    expert gate), from the bfloat16 logits in float32 as the PyTorch ops compute them (see
    moe.c); None when the kernel or these tensors don't fit."""
    if mode not in (SOFTMAX_TOPK, SOFTMAX_TOPK_RENORMALISED, TOPK_SOFTMAX):
        raise ValueError(f"routing mode {mode!r}: expected 0, 1 or 2 (moe.SOFTMAX_TOPK, ...)")
    if not available() or torch.is_grad_enabled() or x.dim() != 2 or router.dim() != 2:
        return None
    gates = (router,) if shared_gate is None else (router, shared_gate)
    if not _bf16_cpu(x, *gates) or not all(g.is_contiguous() for g in gates):
        return None
    num_experts, hidden = router.shape
    if x.shape[1] != hidden or not 0 < k <= num_experts:
        return None
    if shared_gate is not None and shared_gate.shape != (1, hidden):
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens = x.shape[0]
    experts = torch.empty(tokens, k, dtype=torch.int64)
    weights = torch.empty(tokens, k, dtype=torch.bfloat16)
    scale = None if shared_gate is None else torch.empty(tokens, 1, dtype=torch.bfloat16)
    work = torch.empty(tokens * (num_experts + k), dtype=torch.float32)
    native.library().hkv_moe_route_bf16(
        x.data_ptr(), x.stride(0), tokens, hidden, router.data_ptr(), num_experts,
        None if shared_gate is None else shared_gate.data_ptr(), k, mode,
        experts.data_ptr(), weights.data_ptr(), None if scale is None else scale.data_ptr(),
        work.data_ptr(),
    )  # fmt: skip
    return experts, weights, scale


# -- every build: the router and experts on the small-batch linears ---------------------------

_FLOATS = (torch.float32, torch.bfloat16)
SWIGLU, RELU2, CLAMPED = 0, 1, 2  # hkv_moe_experts' activations (moe.c's MOE_SWIGLU, ...)


def _same_float_cpu(*tensors: torch.Tensor) -> bool:
    """All float32 or all bfloat16, on the CPU."""
    dtype = tensors[0].dtype
    return dtype in _FLOATS and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors)


def vector_route(
    x: torch.Tensor,
    router: torch.Tensor,
    k: int,
    rule: int | NativeRule,
    choice_bias: torch.Tensor | None = None,
    weights_dtype: torch.dtype | None = None,
    gate_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A gate in one call (moe.c's hkv_moe_route, any build): x [T, H]; router [E, H]
    contiguous, both float32 or both bfloat16 (logits in x's dtype, as an nn.Linear gate's),
    or a float32 router (float32 logits from x widened: a Router's); gate_bias: None or [E] of
    the router's dtype (contiguous), added to the logits as F.linear adds it; rule: a
    `NativeRule` or its mode alone; choice_bias: None or [E] float32 (contiguous) -> experts
    [T, k] int64 (largest choice first), weights [T, k] of `weights_dtype` (float32 or
    bfloat16; default x's); None when the library or these tensors don't fit."""
    rule = rule if isinstance(rule, NativeRule) else NativeRule(rule)
    if rule.mode not in (SOFTMAX_TOPK, SOFTMAX_TOPK_RENORMALISED, TOPK_SOFTMAX, SIGMOID):
        raise ValueError(f"routing mode {rule.mode!r}: expected 0-3 (moe.SOFTMAX_TOPK, ...)")
    lib = native.library()
    if lib is None or torch.is_grad_enabled() or x.dim() != 2 or router.dim() != 2:
        return None
    widened = router.dtype == torch.float32 and x.dtype == torch.bfloat16
    if not (widened or _same_float_cpu(x, router)) or not router.is_contiguous():
        return None
    if x.device.type != "cpu" or router.device.type != "cpu":
        return None
    num_experts, hidden = router.shape
    if x.shape[1] != hidden or not 0 < k <= num_experts or not _groups_fit(rule, num_experts):
        return None
    if rule.bf16_scores and (rule.mode not in (SIGMOID, TOPK_SOFTMAX)
                             or router.dtype != torch.bfloat16):  # fmt: skip
        return None
    if gate_bias is not None and not (
        gate_bias.shape == (num_experts,) and gate_bias.dtype == router.dtype
        and gate_bias.device.type == "cpu" and gate_bias.is_contiguous()
    ):  # fmt: skip
        return None
    if choice_bias is not None and not _choice_bias_fits(choice_bias, num_experts):
        return None
    weights_dtype = x.dtype if weights_dtype is None else weights_dtype
    if weights_dtype not in _FLOATS:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    tokens = x.shape[0]
    experts = torch.empty(tokens, k, dtype=torch.int64)
    weights = torch.empty(tokens, k, dtype=weights_dtype)
    work = torch.empty(tokens * (3 * num_experts + hidden + rule.groups + k), dtype=torch.float32)
    types = (x.dtype == torch.bfloat16) | (router.dtype == torch.bfloat16) << 1
    types |= (weights_dtype == torch.bfloat16) << 2
    flags = rule.renormalise | rule.group_max << 1 | rule.bf16_scores << 2
    lib.hkv_moe_route(
        x.data_ptr(), x.stride(0), tokens, hidden, router.data_ptr(),
        None if gate_bias is None else gate_bias.data_ptr(), num_experts, k, types,
        rule.mode, None if choice_bias is None else choice_bias.data_ptr(), rule.groups,
        rule.kept, flags, rule.eps, rule.scaling, experts.data_ptr(), weights.data_ptr(),
        work.data_ptr(),
    )  # fmt: skip
    return experts, weights


def _groups_fit(rule: NativeRule, num_experts: int) -> bool:
    """E in equal groups (top2_sum: two experts a group at least), 1 <= kept <= groups."""
    if rule.groups < 1 or not 1 <= rule.kept <= rule.groups or num_experts % rule.groups:
        return False
    return rule.kept == rule.groups or rule.group_max or num_experts // rule.groups >= 2


def _choice_bias_fits(bias: torch.Tensor, num_experts: int) -> bool:
    """[E] float32, contiguous, on the CPU."""
    return (
        bias.shape == (num_experts,) and bias.dtype == torch.float32
        and bias.device.type == "cpu" and bias.is_contiguous()
    )  # fmt: skip


def vector_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor | None:
    """`layers.mlp.gated_experts` in one call (moe.c's hkv_moe_experts, any build): x [T, H];
    experts (int64), weights [T, k]; gate_up [E, 2I, H], down [E, H, I] contiguous; all float32
    or all bfloat16 (rounded as the PyTorch path's per-expert loop) -> [T, H]; None when the
    library or these tensors don't fit. The kernel reads the expert ids and weights from their
    tensors: a captured step replays it correctly for any routing."""
    if torch.is_grad_enabled() or not _same_float_cpu(x, weights, gate_up, down):
        return None
    if gate_up.dim() != 3 or gate_up.shape[1] % 2:
        return None
    return _experts(x, experts, weights, gate_up, down, gate_up.shape[1] // 2, SWIGLU)


def vector_relu2_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor | None:
    """Nemotron-H's experts (`layers.moe.UngatedExperts` with relu2) in one call (moe.c's
    hkv_moe_experts, any build): out[t] = sum_j w[t, j] * down_e relu(up_e x[t])^2; x [T, H];
    experts (int64), weights [T, k] float32; up [E, I, H], down [E, H, I] contiguous, of x's
    dtype (float32 or bfloat16: each product and relu2 rounded as PyTorch's ops; the weighted
    rows summed in float32, in expert order, rounded once) -> [T, H]; None when the library or
    these tensors don't fit."""
    if torch.is_grad_enabled() or not _same_float_cpu(x, up, down):
        return None
    if weights.dtype != torch.float32 or weights.device.type != "cpu" or up.dim() != 3:
        return None
    return _experts(x, experts, weights, up, down, up.shape[1], RELU2)


def vector_clamped_experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor,
    down: torch.Tensor,
    down_bias: torch.Tensor,
    alpha: float,
    limit: float,
) -> torch.Tensor | None:
    """gpt-oss's experts (`layers.moe.ClampedSwigluExperts`) in one call (moe.c's
    hkv_moe_experts, any build): out[t] = sum_j w[t, j] * (h @ down_e + down_bias_e),
    h = (clamp(u, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit),
    (gate, u) pairs = x[t] @ gate_up_e + gate_up_bias_e; x [T, H]; experts (int64), weights
    [T, k]; the weights as the checkpoint stores them (x @ W, read in place: no second copy of
    the experts): gate_up [E, H, 2I] with gate and up interleaved by column, gate_up_bias
    [E, 2I] (the same order), down [E, I, H], down_bias [E, H], contiguous; all float32 or all
    bfloat16 (each product, bias addition and activation step rounded as PyTorch's ops; the
    weighted rows summed in x's dtype in expert order) -> [T, H]; None when the library or these
    tensors don't fit."""
    if torch.is_grad_enabled() or not _same_float_cpu(x, weights, gate_up, down):
        return None
    if not _same_float_cpu(x, gate_up_bias, down_bias) or gate_up.dim() != 3 or down.dim() != 3:
        return None
    num_experts, hidden, two_inter = gate_up.shape
    if two_inter % 2 or gate_up_bias.shape != (num_experts, two_inter):
        return None
    if down.shape != (num_experts, two_inter // 2, hidden):
        return None
    if down_bias.shape != (num_experts, hidden):
        return None
    if not (gate_up_bias.is_contiguous() and down_bias.is_contiguous()):
        return None
    return _experts(x, experts, weights, gate_up, down, two_inter // 2, CLAMPED,
                    (gate_up_bias, down_bias), alpha, limit)  # fmt: skip


def _experts(
    x: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    first: torch.Tensor,
    down: torch.Tensor,
    inter: int,
    act: int,
    biases: tuple[torch.Tensor, torch.Tensor] | None = None,
    alpha: float = 0.0,
    limit: float = 0.0,
) -> torch.Tensor | None:
    """hkv_moe_experts on tensors of checked dtypes: first [E, 2I or I, H], down [E, H, I]
    (CLAMPED: first [E, H, 2I], down [E, I, H], checked by the caller); biases: None or
    (first's [E, 2I], down's [E, H]), checked."""
    lib = native.library()
    if lib is None or x.dim() != 2 or experts.dim() != 2 or first.dim() != 3 or down.dim() != 3:
        return None
    if experts.dtype != torch.int64 or not (first.is_contiguous() and down.is_contiguous()):
        return None
    num_experts = first.shape[0]
    hidden = first.shape[1] if act == CLAMPED else first.shape[2]
    want_down = (num_experts, inter, hidden) if act == CLAMPED else (num_experts, hidden, inter)
    if x.shape[1] != hidden or down.shape != want_down:
        return None
    if weights.shape != experts.shape or experts.shape[0] != x.shape[0]:
        return None
    if x.stride(1) != 1:
        x = x.contiguous()
    experts, weights = experts.contiguous(), weights.contiguous()
    tokens, k = experts.shape
    out = torch.empty(tokens, hidden, dtype=x.dtype)
    code = lib.hkv_moe_experts(
        x.data_ptr(), x.stride(0), tokens, hidden, experts.data_ptr(), weights.data_ptr(), k,
        num_experts, first.data_ptr(), down.data_ptr(), inter, int(x.dtype == torch.bfloat16),
        act, None if biases is None else biases[0].data_ptr(),
        None if biases is None else biases[1].data_ptr(), alpha, limit, out.data_ptr(),
        out.stride(0),
    )  # fmt: skip
    if code == -1:
        raise ValueError(f"expert ids must lie in 0..{num_experts - 1}")
    if code != 0:
        raise MemoryError("the native experts could not allocate their work space")
    return out
