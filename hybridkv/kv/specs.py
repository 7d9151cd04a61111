"""Layer specs: what one layer keeps per request.

A *layer spec* describes the cache of one cache layer (design.md section 2):

- `AttentionSpec`: K and V per token (optionally only inside a sliding window),
- `MLASpec`: one compressed latent + rope key per token (DeepSeek-style MLA),
- `StateSpec`: a fixed set of state tensors per request (Mamba1, Mamba2, gated delta net, short
  conv, KDA) that does not grow with the sequence, and the op backends that can run its layers.

Who makes the specs: the model. Each module that owns cache builds its spec from the dimensions
it was constructed with (`hybridkv.layers.cache`), and the engine (and `hybridkv plan`) collects
them from the model built on the meta device (`hybridkv.models.registry.declared_cache_layers`).
Reading a Hugging Face config.json is the models' side (`hybridkv.models.config_helpers`,
`hybridkv.models.registry.architecture_of`); this module imports nothing of hybridkv but
`hybridkv.dtypes`.

A decoder layer may own more than one cache layer (Falcon-H1 runs attention and Mamba2 side by
side), so cache layers carry their own names and the index of the decoder layer they sit in.

Nothing here imports torch: the memory plan is pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridkv.dtypes import canonical_dtype, dtype_bytes


class ConfigError(ValueError):
    """A config.json that cannot be read into layer specs (one-line message)."""


@dataclass(frozen=True)
class AttentionSpec:
    """Full or sliding-window attention: K and V of `num_kv_heads x head_dim` per token.

    `softcap` (attention logit soft-capping, scores c * tanh(s / c)) changes nothing in the
    cache; it is part of the spec because it is what the layer needs of its kernels: the plan
    gives such a group only a backend that declares soft-capping."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    sliding_window: int | None = None
    softcap: float | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"attention needs positive heads and head_dim, got {self}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap must be positive, got {self.softcap}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def kind(self) -> str:
        return "attention" if self.sliding_window is None else "sliding_window"

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention: one latent of `kv_lora_rank + qk_rope_head_dim` per token."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.kv_lora_rank <= 0 or self.qk_rope_head_dim < 0:
            raise ValueError(f"MLA needs a positive kv_lora_rank, got {self}")
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    kind = "mla"
    sliding_window = None
    softcap = None  # (MLA layers take no logit soft-capping)

    @property
    def head_dim(self) -> int:
        """Width of the cached latent (the kernel's head dim)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return self.head_dim * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StateTensor:
    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not self.shape or any(d <= 0 for d in self.shape):
            raise ValueError(f"state tensor {self.name!r} needs a positive shape, got {self.shape}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_bytes(self.dtype)


@dataclass(frozen=True)
class StateOps:
    """Where the ops of one state kind can run, declared by its layer module the way attention
    backends declare kernel block sizes (`hybridkv.layers.attention.registry`).

    The plan picks, per state group, the first declared entry that runs on its platform with its
    dtypes and whose `needs` the machine has (`hybridkv.kv.plan.select_state_ops`); the runner
    imports `impl` and hands the instance to the group's layers.
    """

    name: str  # "native", "triton", "compiled", "torch", ...
    impl: str  # "module:Class", imported on first use
    platforms: frozenset[str] = frozenset({"cpu", "cuda", "rocm"})
    dtypes: frozenset[str] = frozenset({"float32", "bfloat16", "float16"})  # state and compute
    needs: str | None = None  # a capability the machine must have ("native", "triton", ...)
    description: str = ""
    # the model's compute dtypes they take, where fewer than `dtypes` (None: `dtypes`)
    compute_dtypes: frozenset[str] | None = None

    def why_not(
        self,
        platform: str,
        dtypes: Sequence[str],
        capabilities: frozenset[str],
        compute_dtype: str | None = None,
    ) -> str | None:
        """Why these ops cannot run here with state and compute `dtypes` (None: they can)."""
        if platform not in self.platforms:
            return f"runs on {', '.join(sorted(self.platforms))}, not {platform}"
        bad = sorted({d for d in dtypes if d not in self.dtypes})
        if bad:
            return f"runs dtypes {', '.join(sorted(self.dtypes))}, not {', '.join(bad)}"
        compute = self.compute_dtypes
        if compute is not None and compute_dtype is not None and compute_dtype not in compute:
            return f"computes in {', '.join(sorted(compute))}, not {compute_dtype}"
        if self.needs is not None and self.needs not in capabilities:
            return f"needs {self.needs}, which this machine does not have"
        return None


@dataclass(frozen=True)
class StateSpec:
    """A fixed-size recurrent state: the tensors a state kernel keeps for one request.

    `kind` names the cache manager (`hybridkv.core.managers.MANAGERS`); `ops` lists where the
    layers' ops can run, in order of preference (empty for families that are planned only).
    """

    kind: str
    tensors: tuple[StateTensor, ...]
    ops: tuple[StateOps, ...] = ()

    def __post_init__(self) -> None:
        if not self.kind or not self.kind.isidentifier():
            raise ValueError(f"a state kind is a name such as 'mamba2', got {self.kind!r}")
        if not self.tensors:
            raise ValueError("a state spec needs at least one tensor")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"state tensor names must be unique, got {names}")

    @property
    def state_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def tensor_names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tensors)

    @property
    def dtypes(self) -> tuple[str, ...]:
        return tuple(t.dtype for t in self.tensors)

    @property
    def layout(self) -> tuple[tuple[StateTensor, int], ...]:
        """(tensor, byte offset inside the page): packed widest element first, so that every
        offset is aligned to its dtype without gaps; padding sits at the end of the page."""
        order = sorted(self.tensors, key=lambda t: -dtype_bytes(t.dtype))
        out, offset = [], 0
        for t in order:
            out.append((t, offset))
            offset += t.nbytes
        return tuple(out)


LayerSpec = AttentionSpec | MLASpec | StateSpec


@dataclass(frozen=True)
class CacheLayer:
    """One cache layer of a model: its name, the decoder layer it sits in, and its spec."""

    name: str
    layer_index: int
    spec: LayerSpec


# ---------------------------------------------------------------------------------------------
# State spec constructors (shapes as the state kernels keep them; conv state has d_conv-1 columns)
# ---------------------------------------------------------------------------------------------


def mamba2_state(
    n_heads: int,
    head_dim: int,
    d_state: int,
    n_groups: int,
    d_conv: int,
    conv_dtype: str,
    ssm_dtype: str,
) -> StateSpec:
    conv_dim = n_heads * head_dim + 2 * n_groups * d_state
    return StateSpec(
        "mamba2",
        (
            StateTensor("conv", (conv_dim, d_conv - 1), conv_dtype),
            StateTensor("ssm", (n_heads, head_dim, d_state), ssm_dtype),
        ),
    )


def mamba1_state(d_inner: int, d_state: int, d_conv: int, conv_dtype: str, ssm_dtype: str):
    return StateSpec(
        "mamba1",
        (
            StateTensor("conv", (d_inner, d_conv - 1), conv_dtype),
            StateTensor("ssm", (d_inner, d_state), ssm_dtype),
        ),
    )


def short_conv_state(channels: int, kernel: int, dtype: str) -> StateSpec:
    return StateSpec("short_conv", (StateTensor("conv", (channels, kernel - 1), dtype),))


def kda_state(n_heads: int, head_dim: int, d_conv: int, conv_dtype: str, ssm_dtype: str):
    width = n_heads * head_dim
    return StateSpec(
        "kda",
        (
            StateTensor("conv_q", (width, d_conv - 1), conv_dtype),
            StateTensor("conv_k", (width, d_conv - 1), conv_dtype),
            StateTensor("conv_v", (width, d_conv - 1), conv_dtype),
            StateTensor("recurrent", (n_heads, head_dim, head_dim), ssm_dtype),
        ),
    )


@dataclass(frozen=True)
class CacheDtypes:
    """Resolved cache dtypes for one model (`auto` already replaced; the config side resolves
    them: `hybridkv.models.config_helpers.resolve_cache_dtypes`)."""

    kv: str
    conv: str
    ssm: str
