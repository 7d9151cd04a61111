"""Mamba2 (Mamba2ForCausalLM): a pure state model, every layer a Mamba2 mixer, no attention.

    x = embeddings(ids)
    per layer:  x = x + mixer(norm(x))        (x kept in float32 when residual_in_fp32)
    logits = lm_head(norm_f(x))

The model's shape and its cache: `hybridkv.models.state_lm`.
"""

from __future__ import annotations

import dataclasses
import math

from hybridkv.layers.mamba2 import Mamba2Mixer
from hybridkv.models.hf_config import ConfigError, HFConfig, config_float
from hybridkv.models.state_lm import StateCausalLM


@dataclasses.dataclass(frozen=True)
class Mamba2Config(HFConfig):
    """Defaults: transformers 5.24 `Mamba2Config`."""

    ARCHITECTURE = "Mamba2ForCausalLM"

    vocab_size: int = 32768
    hidden_size: int = 4096
    num_hidden_layers: int = 64
    num_heads: int = 128
    head_dim: int = 64
    state_size: int = 128
    expand: int = 2
    n_groups: int = 8
    conv_kernel: int = 4
    chunk_size: int = 256
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    residual_in_fp32: bool = True
    time_step_limit: tuple = (0.0, math.inf)
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2**31 - 1  # no positions: any length (max_model_len caps)

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "num_hidden_layers", "num_heads", "head_dim",
            "state_size", "expand", "n_groups", "conv_kernel", "chunk_size",
        )  # fmt: skip
        if self.hidden_size * self.expand != self.num_heads * self.head_dim:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: hidden_size * expand "
                f"({self.hidden_size} * {self.expand}) must equal num_heads * head_dim "
                f"({self.num_heads} * {self.head_dim})"
            )
        if self.num_heads % self.n_groups:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: num_heads ({self.num_heads}) must be a "
                f"multiple of n_groups ({self.n_groups})"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: hidden_act must be silu, "
                f"got {self.hidden_act!r}"
            )
        limit = self.time_step_limit
        if not isinstance(limit, tuple) or len(limit) != 2:
            raise ConfigError(
                f"config.json of {self.ARCHITECTURE}: time_step_limit must be two numbers, "
                f"got {limit!r}"
            )

    @property
    def dt_limit(self) -> tuple[float, float]:
        low, high = self.time_step_limit
        return (config_float(low), config_float(high))

    def mixer(self, index: int) -> Mamba2Mixer:
        return Mamba2Mixer(
            self.hidden_size, self.num_heads, self.head_dim, self.state_size, self.n_groups,
            self.conv_kernel, self.chunk_size, self.use_conv_bias, self.use_bias,
            self.layer_norm_epsilon, self.dt_limit, self.hidden_act, layer_index=index,
        )  # fmt: skip


class Mamba2ForCausalLM(StateCausalLM):
    tensor_parallel = True

    config_class = Mamba2Config
