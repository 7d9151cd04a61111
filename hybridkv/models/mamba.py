"""Mamba (MambaForCausalLM) and Falcon Mamba (FalconMambaForCausalLM): pure state models, every
layer a Mamba1 mixer, no attention.

    x = embeddings(ids)
    per layer:  x = x + mixer(norm(x))        (x kept in float32 when residual_in_fp32)
    logits = lm_head(norm_f(x))

- Mixer: `hybridkv.layers.mamba1` (in_proj, causal conv1d, x_proj -> dt | B | C, dt_proj,
  selective scan with A_log and the D skip, silu gate, out_proj); intermediate size
  config.json's `intermediate_size` when present (transformers 5.24 sets its derived value first,
  then the saved key over it), else expand * hidden_size;
  time_step_rank "auto" is ceil(hidden_size / 16).
- Falcon Mamba adds weightless RMSNorms of dt, B and C (eps `mixer_rms_eps`) before dt_proj and
  the scan (dt_norms "falcon_mamba"); in transformers 5.24 its config defaults are otherwise
  Mamba's.
- Norms: RMSNorm, the weight applied after the cast back to the input dtype; the block norm
  reads the residual cast to the model dtype, the final norm the residual itself.

Tensor parallel: the mixers split their inner channels (`hybridkv.layers.mamba1`), the
embeddings and lm_head their vocabulary (`hybridkv.models.state_lm`); Falcon Mamba's weightless
dt/B/C norms act on the all-reduced x_proj output, the full vectors.

The cache holds one state per page and nothing that grows with the prompt (see
`hybridkv.models.state_lm`, the model shape shared with Mamba2).

Checkpoints name the modules `backbone.embeddings`, `backbone.layers.{i}.{norm,mixer}`,
`backbone.norm_f`, `lm_head` (tied to the embeddings by default); older ones spell the
embeddings `backbone.embedding` (transformers' load hook renames it, and so does this model).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

from hybridkv.layers.mamba1 import Mamba1Mixer
from hybridkv.models.hf_config import HFConfig
from hybridkv.models.state_lm import StateCausalLM


@dataclasses.dataclass(frozen=True)
class MambaConfig(HFConfig):
    """Defaults: transformers 5.24 `MambaConfig`."""

    ARCHITECTURE = "MambaForCausalLM"
    DT_NORMS: ClassVar[str | None] = None  # the mixer's dt/B/C norms (not a config key)

    vocab_size: int = 50280
    hidden_size: int = 768
    state_size: int = 16
    num_hidden_layers: int = 32
    layer_norm_epsilon: float = 1e-5
    expand: int = 2
    conv_kernel: int = 4
    use_bias: bool = False
    use_conv_bias: bool = True
    hidden_act: str = "silu"
    residual_in_fp32: bool = True
    time_step_rank: int | str = "auto"  # "auto": ceil(hidden_size / 16)
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 2**31 - 1  # no positions: any length (max_model_len caps)
    intermediate_size: int | None = None  # None: expand * hidden_size (a saved one wins)

    def __post_init__(self) -> None:
        self._require_positive(
            "vocab_size", "hidden_size", "state_size", "num_hidden_layers", "expand",
            "conv_kernel",
        )  # fmt: skip
        if self.hidden_act not in ("silu", "swish"):
            raise ValueError(f"hidden_act={self.hidden_act!r} is not supported (only silu)")
        if self.time_step_rank == "auto":
            self._set("time_step_rank", math.ceil(self.hidden_size / 16))
        elif isinstance(self.time_step_rank, str):
            raise ValueError(f"time_step_rank must be an integer or 'auto', got "
                             f"{self.time_step_rank!r}")  # fmt: skip
        self._require_positive("time_step_rank")
        if self.intermediate_size is None:
            self._set("intermediate_size", self.expand * self.hidden_size)
        self._require_positive("intermediate_size")

    @property
    def mixer_eps(self) -> float:
        return 1e-6  # unused without dt/B/C norms

    def mixer(self, index: int) -> Mamba1Mixer:
        assert isinstance(self.time_step_rank, int)
        return Mamba1Mixer(
            self.hidden_size, self.intermediate_size, self.state_size, self.conv_kernel,
            self.time_step_rank, conv_bias=self.use_conv_bias, proj_bias=self.use_bias,
            dt_norms=self.DT_NORMS, norm_eps=self.mixer_eps, activation="silu",
            layer_index=index,
        )  # fmt: skip


@dataclasses.dataclass(frozen=True)
class FalconMambaConfig(MambaConfig):
    """Defaults: transformers 5.24 `FalconMambaConfig` (Mamba's, plus `mixer_rms_eps`)."""

    ARCHITECTURE = "FalconMambaForCausalLM"
    DT_NORMS = "falcon_mamba"

    mixer_rms_eps: float = 1e-6

    @property
    def mixer_eps(self) -> float:
        return self.mixer_rms_eps


class MambaForCausalLM(StateCausalLM):
    tensor_parallel = True  # the Mamba1 mixers split by inner channel (hybridkv.layers.mamba1)

    config_class: type[MambaConfig] = MambaConfig


class FalconMambaForCausalLM(MambaForCausalLM):
    config_class = FalconMambaConfig
