"""Rotary position embeddings (non-interleaved halves, as the Hugging Face Llama family).

Supports rope types `default`, `linear`, `llama3` and `yarn` (gpt-oss: frequencies blended by
a ramp, cos/sin scaled by its attention factor), and a partial rotary factor (only the first
`rotary_dim` channels of each head rotate). cos/sin are computed for the step's positions
in float32, as transformers does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from hybridkv.ops.registry import CPU_FLOATS, OpImpl, declare

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_CPU = frozenset({"cpu"})
# the cos / sin tables of a step's positions (keyed by the table dtype) and the rotation of
# q and k (keyed by their dtype): one native pass each on the CPU (a step stays capturable)
ROPE_COS_SIN = declare(
    "rope_cos_sin",
    (
        OpImpl(
            "native",
            "hybridkv.ops.native.elementwise:rope_cos_sin",
            _CPU,
            CPU_FLOATS,
            ("native",),
            strict=True,
        ),  # fmt: skip
        OpImpl("torch", f"{__name__}:torch_rope_cos_sin"),
    ),
)
ROPE = declare(
    "rope",
    (
        OpImpl("native", f"{__name__}:_native_rope", _CPU, CPU_FLOATS, ("native",), strict=True),
        OpImpl("torch", f"{__name__}:torch_rope"),
    ),
)
# DeepSeek's interleaved RoPE of MLA (pairs rotated, laid out [evens' | odds']; keyed by x's
# dtype): one native pass on the CPU, as ROPE
ROPE_PAIRS = declare(
    "rope_pairs",
    (
        OpImpl("native", f"{__name__}:_native_rope_pairs", _CPU, CPU_FLOATS, ("native",),
               strict=True),
        OpImpl("torch", f"{__name__}:torch_rope_pairs"),
    ),
)  # fmt: skip
# tables of another dtype than q / k (promoted as PyTorch promotes): no kernel takes them
ROPE_MIXED = declare("rope_mixed_dtypes", (OpImpl("torch", f"{__name__}:torch_rope"),))


def rope_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """rope_theta and scaling from `rope_parameters` (transformers 5) or the older keys
    (`rope_theta`, `rope_scaling`); theta defaults to 10000 as transformers' `default_theta`."""
    params = dict(config.get("rope_parameters") or {})
    scaling = config.get("rope_scaling") or {}
    for key, value in scaling.items():
        params.setdefault(key, value)
    params.setdefault("rope_theta", config.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    params["rope_type"] = rope_type
    return params


def _inv_freq(rotary_dim: int, params: Mapping[str, Any]) -> torch.Tensor:
    base = float(params["rope_theta"])
    steps = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu")
    exponents = steps.float() / rotary_dim
    inv_freq = 1.0 / (base**exponents)
    rope_type = params["rope_type"]
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params)
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, params: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between."""
    factor = float(params["factor"])
    low, high = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def yarn_inv_freq(
    dim: int, params: Mapping[str, Any], max_positions: int | None
) -> tuple[torch.Tensor, float]:
    """YaRN (transformers' `_compute_yarn_parameters`): -> (inv_freq [dim / 2], attention factor).

    Dimensions whose wavelength fits `original_max_position_embeddings` many times (beyond
    beta_fast rotations) keep their frequency, those below beta_slow rotations are slowed by
    `factor`, with a linear ramp between."""
    base = float(params["rope_theta"])
    original = float(params["original_max_position_embeddings"])
    factor = params.get("factor")
    if factor is None and max_positions is None:
        raise ValueError("yarn rope parameters need a factor (or the model's max positions)")
    factor = float(factor) if factor is not None else max_positions / original
    attention = params.get("attention_factor")
    if attention is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention = (
            get_mscale(factor, mscale) / get_mscale(factor, mscale_all)
            if mscale and mscale_all
            else get_mscale(factor)
        )
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    index = torch.arange(dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((index - low) / (high - low)).clamp(0, 1)  # [dim / 2]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim)
    extrapolation = 1.0 - ramp  # [dim / 2]: 1 keeps the frequency, 0 slows it by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rope: Mapping[str, Any],
        partial_rotary_factor: float = 1.0,
        max_positions: int | None = None,
    ) -> None:
        """`rope`: what `rope_parameters` returns (rope_theta, rope_type and its scaling keys);
        `max_positions`: the model's, for a yarn factor the parameters leave out."""
        super().__init__()
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        # A plain attribute on the CPU, not a buffer: `model.to(torch.bfloat16)` must not round
        # the frequencies (transformers keeps them in float32; bf16 ones drift by whole radians
        # at long positions), and a model built on the meta device still gets real ones.
        self.attention_scaling = 1.0
        if rope["rope_type"] == "yarn":
            self.inv_freq, self.attention_scaling = yarn_inv_freq(
                self.rotary_dim, rope, max_positions
            )
        else:
            self.inv_freq = _inv_freq(self.rotary_dim, rope)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [num_tokens] -> cos, sin: [num_tokens, rotary_dim] in `dtype`."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        run = ROPE_COS_SIN.chain(positions.device, dtype).first
        return run(positions, self.inv_freq, self.attention_scaling, dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim], k: [num_tokens, kv_heads, head_dim]."""
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim] -> x rotated over its first
    rotary_dim channels (halves), in one native pass on the CPU (`ROPE`'s choice)."""
    if cos.dtype != x.dtype:  # float32 tables on bf16 q / k (OLMo-Hybrid): a float32 result
        return ROPE_MIXED.of(x).first(x, cos, sin, rotary_dim)
    return ROPE.of(x).first(x, cos, sin, rotary_dim)


def torch_rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [n] -> cos, sin [n, 2 * len(inv_freq)] in `dtype` (float32 angles, times
    `scaling`: yarn's attention scaling)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:  # yarn
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


def _native_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor | None:
    from hybridkv.ops.native import elementwise

    if x.shape[0] == 0:  # (an empty step: nothing to rotate)
        return torch.empty(x.shape, dtype=x.dtype)
    x = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads channels contiguously
    return elementwise.rope(x, cos, sin, rotary_dim)


def torch_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> torch.Tensor:
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out


def rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """RoPE over all of x's channels: x [T, heads, d] (channels contiguous, tokens and heads at
    any stride), cos, sin [T, d] -> [T, heads, d]; over halves (`ROPE`) or, `interleaved`,
    over pairs laid out de-interleaved as DeepSeek's MLA (`ROPE_PAIRS`)."""
    if not interleaved:
        return _rotate(x, cos, sin, x.shape[-1])
    if cos.dtype != x.dtype:
        return torch_rope_pairs(x, cos, sin)
    return ROPE_PAIRS.of(x).first(x, cos, sin)


def _native_rope_pairs(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor | None:
    from hybridkv.ops.native import mla

    x = x if x.stride(-1) == 1 else x.contiguous()  # the kernel reads pairs contiguously
    return mla.rope_pairs(x, cos, sin)


def torch_rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved RoPE: pairs (x0, x1), (x2, x3), ... each rotated by one angle;
    the result is laid out de-interleaved [evens' | odds'] as transformers lays it out (q and k
    alike, so their dot product is the same).

    x: [T, heads, d]; cos, sin: [T, d] (= cat(freqs, freqs), the first half is used)
    """
    half = cos.shape[-1] // 2
    c, s = cos[:, None, :half], sin[:, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
