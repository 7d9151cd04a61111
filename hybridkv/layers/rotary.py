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

from hybridkv.ops.native import elementwise as native_ew

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


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
        out = native_ew.rope_cos_sin(positions, self.inv_freq, self.attention_scaling, dtype)
        if out is not None:  # (one kernel call: the same values, a step stays capturable)
            return out
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:  # yarn
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [num_tokens, heads, head_dim], k: [num_tokens, kv_heads, head_dim]."""
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, rotary_dim] -> x rotated over its first
    rotary_dim channels (halves), in one native pass on the CPU where it applies."""
    out = native_ew.rope(x, cos, sin, rotary_dim)
    if out is not None:
        return out
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    out = rot * cos[:, None, :] + rotated * sin[:, None, :]
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
