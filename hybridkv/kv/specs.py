"""Layer specs: what one layer keeps per request.

A *layer spec* describes the cache of one cache layer (design.md section 2):

- `AttentionSpec`: K and V per token (optionally only inside a sliding window),
- `MLASpec`: one compressed latent + rope key per token (DeepSeek-style MLA),
- `StateSpec`: a fixed set of state tensors per request (Mamba1, Mamba2, gated delta net, short
  conv, KDA) that does not grow with the sequence, and the op backends that can run its layers.

Who makes the specs: for a family hybridkv can run, the model does. Each module that owns cache
builds its spec from the dimensions it was constructed with (`hybridkv.layers.cache`), and the
engine (and `hybridkv plan`) collects them from the model built on the meta device
(`hybridkv.models.registry.declared_cache_layers`). The readers at the bottom of this file only
serve the families that can be planned but not run yet (the presets of `hybridkv plan`).

A decoder layer may own more than one cache layer (Falcon-H1 runs attention and Mamba2 side by
side), so cache layers carry their own names and the index of the decoder layer they sit in.

Nothing here imports torch: the memory plan is pure arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hybridkv.dtypes import STATE_DTYPES, canonical_dtype, dtype_bytes, resolve_dtype


class ConfigError(ValueError):
    """A config.json that cannot be read into layer specs (one-line message)."""


@dataclass(frozen=True)
class AttentionSpec:
    """Full or sliding-window attention: K and V of `num_kv_heads x head_dim` per token."""

    num_kv_heads: int
    head_dim: int
    dtype: str
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0 or self.head_dim <= 0:
            raise ValueError(f"attention needs positive heads and head_dim, got {self}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
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

    def why_not(self, platform: str, dtypes: Sequence[str], capabilities: frozenset[str]):
        """Why these ops cannot run here (None: they can)."""
        if platform not in self.platforms:
            return f"runs on {', '.join(sorted(self.platforms))}, not {platform}"
        bad = sorted({d for d in dtypes if d not in self.dtypes})
        if bad:
            return f"runs dtypes {', '.join(sorted(self.dtypes))}, not {', '.join(bad)}"
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


def gated_delta_net_state(
    k_heads: int,
    v_heads: int,
    k_dim: int,
    v_dim: int,
    d_conv: int,
    conv_dtype: str,
    ssm_dtype: str,
) -> StateSpec:
    conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
    return StateSpec(
        "gated_delta_net",
        (
            StateTensor("conv", (conv_dim, d_conv - 1), conv_dtype),
            StateTensor("recurrent", (v_heads, k_dim, v_dim), ssm_dtype),
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


# ---------------------------------------------------------------------------------------------
# Reading a config.json
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheDtypes:
    """Resolved cache dtypes for one model (`auto` already replaced)."""

    kv: str
    conv: str
    ssm: str


class _Config:
    """Read access to a (text) config dict with one-line errors naming the missing key."""

    def __init__(self, data: dict[str, Any], arch: str) -> None:
        self.data = data
        self.arch = arch

    def get(self, *keys: str, default: Any = None) -> Any:
        for key in keys:
            value = self.data.get(key)
            if value is not None:
                return value
        return default

    def req(self, *keys: str) -> Any:
        value = self.get(*keys)
        if value is None:
            names = " or ".join(repr(k) for k in keys)
            raise ConfigError(f"config.json of {self.arch} is missing {names}")
        return value

    def int(self, *keys: str, default: int | None = None) -> int:
        value = self.get(*keys, default=default) if default is not None else self.req(*keys)
        if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
            raise ConfigError(
                f"config.json of {self.arch}: {keys[0]!r} must be an integer, got {value!r}"
            )
        return int(value)

    @property
    def num_layers(self) -> int:
        """num_hidden_layers, or the length of the layout list when a config leaves it out
        (transformers 5 saves NemotronH configs without it)."""
        if self.get("num_hidden_layers") is None:
            for key in ("layers_block_type", "layer_types", "hybrid_override_pattern"):
                if isinstance(self.get(key), list | str):
                    return len(self.get(key))
        n = self.int("num_hidden_layers")
        if n <= 0:
            raise ConfigError(
                f"config.json of {self.arch}: num_hidden_layers must be >= 1, got {n}"
            )
        return n


# Layer-type tokens as families spell them -> our cache roles.
_TOKEN_ROLE = {
    "attention": "attention",
    "full_attention": "attention",
    "*": "attention",
    "global": "attention",
    "full": "attention",
    "sliding_attention": "sliding",
    "sliding": "sliding",
    "local": "sliding",
    "local_attention": "sliding",
    "mamba": "state",
    "mamba2": "state",
    "m": "state",
    "linear_attention": "state",
    "conv": "state",
    "short_conv": "state",
    "kda": "state",
    "linear": "state",
    "hybrid": "hybrid",
    "g": "hybrid",
    "mlp": "none",
    "moe": "none",
    "-": "none",
    "e": "none",
    "ffn": "none",
    "dense": "none",
}


def _roles_from_tokens(tokens: Sequence[str], cfg: _Config, source: str) -> list[str]:
    roles = []
    for tok in tokens:
        role = _TOKEN_ROLE.get(str(tok).strip().lower())
        if role is None:
            allowed = ", ".join(sorted(_TOKEN_ROLE))
            raise ConfigError(
                f"config.json of {cfg.arch}: unknown layer type {tok!r} in {source}; "
                f"allowed: {allowed}"
            )
        roles.append(role)
    return roles


def _roles_from_indices(indices: Sequence[int], n: int, cfg: _Config, key: str, base: int = 0):
    roles = ["state"] * n
    for raw in indices:
        i = int(raw) - base
        if not 0 <= i < n:
            raise ConfigError(
                f"config.json of {cfg.arch}: {key} holds layer {raw}, outside 0..{n - 1 + base}"
            )
        roles[i] = "attention"
    return roles


def layer_roles(cfg: _Config, default: str | None = None) -> list[str]:
    """Per decoder layer: 'attention', 'sliding', 'state', 'hybrid' (both) or 'none'.

    Families spell the layout in many ways (design.md section 10); all are accepted here.
    """
    n = cfg.num_layers
    roles: list[str] | None = None
    source = ""
    for key in ("layer_types", "layers_block_type"):
        value = cfg.get(key)
        if isinstance(value, list):
            roles, source = _roles_from_tokens(value, cfg, key), key
            break
    if roles is None and isinstance(cfg.get("hybrid_override_pattern"), str):
        source = "hybrid_override_pattern"
        roles = _roles_from_tokens(list(cfg.get(source)), cfg, source)
    if roles is None and isinstance(cfg.get("attn_layer_indices"), list):
        source = "attn_layer_indices"
        roles = _roles_from_indices(cfg.get(source), n, cfg, source)
    if roles is None and isinstance(cfg.get("full_attn_idxs"), list):
        source = "full_attn_idxs"
        roles = _roles_from_indices(cfg.get(source), n, cfg, source)
    linear = cfg.get("linear_attn_config")
    if roles is None and isinstance(linear, dict) and linear.get("full_attn_layers"):
        source = "linear_attn_config.full_attn_layers"  # 1-based in Kimi configs
        roles = _roles_from_indices(linear["full_attn_layers"], n, cfg, source, base=1)
    if roles is None and cfg.get("attn_layer_period") is not None:
        period, offset = cfg.int("attn_layer_period"), cfg.int("attn_layer_offset", default=0)
        roles = ["attention" if i % period == offset else "state" for i in range(n)]
        source = "attn_layer_period"
    if roles is None and cfg.get("full_attention_interval") is not None:
        every = cfg.int("full_attention_interval")
        roles = ["attention" if (i + 1) % every == 0 else "state" for i in range(n)]
        source = "full_attention_interval"
    if roles is None:
        if default is None:
            raise ConfigError(
                f"config.json of {cfg.arch} does not say which layers are attention "
                "(no layer_types, layers_block_type, hybrid_override_pattern, "
                "attn_layer_indices, full_attention_interval or full_attn_idxs)"
            )
        roles, source = [default] * n, "default"
    if len(roles) != n:
        raise ConfigError(
            f"config.json of {cfg.arch}: {source} describes {len(roles)} layers but "
            f"num_hidden_layers is {n}"
        )
    return roles


def attention_dims(config: dict[str, Any]) -> tuple[int, int, int]:
    """(heads, kv_heads, head_dim) of a model's attention layers: the one rule that both the
    cache spec and the model's attention module follow, so the KV view always fits."""
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim") or config.get("attention_head_dim")
    return heads, kv_heads, int(head_dim or int(config["hidden_size"]) // heads)


def _roles_to_layers(
    roles: Sequence[str],
    make_attention: Callable[[str], LayerSpec],
    make_state: Callable[[int], LayerSpec] | None,
    state_name: str = "mamba",
    attention_name: str = "attention",
) -> list[CacheLayer]:
    layers: list[CacheLayer] = []
    for i, role in enumerate(roles):
        if role in ("attention", "sliding", "hybrid"):
            layers.append(CacheLayer(f"layers.{i}.{attention_name}", i, make_attention(role)))
        if role in ("state", "hybrid") and make_state is not None:
            layers.append(CacheLayer(f"layers.{i}.{state_name}", i, make_state(i)))
    return layers


_Parser = Callable[[_Config, CacheDtypes], list[CacheLayer]]

# Architecture name (config.json "architectures") -> reader, for the families that hybridkv can
# plan but not run yet. Runnable families declare their cache from the model itself
# (hybridkv.models.registry); a family moves from here to there when it becomes runnable.
ARCHITECTURES: dict[str, _Parser] = {}  # none since Kimi-Linear runs (issue 17)

# model_type -> architecture, for configs without an "architectures" list.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gemma3_text": "Gemma3ForCausalLM",
    "bamba": "BambaForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "jamba": "JambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "zamba2": "Zamba2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "falcon_mamba": "FalconMambaForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "lfm2_moe": "Lfm2MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "kimi_linear": "KimiLinearForCausalLM",
}


def supported_architectures() -> tuple[str, ...]:
    """Every architecture hybridkv can plan: the runnable ones and the plan-only ones."""
    from hybridkv.models.registry import MODELS  # a plain name map; no torch import

    return tuple(MODELS) + tuple(a for a in ARCHITECTURES if a not in MODELS)


def architecture_of(config: dict[str, Any]) -> str:
    """The supported architecture a config.json describes, or a one-line error."""
    if not isinstance(config, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    supported = supported_architectures()
    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        for arch in archs:
            if arch in supported:
                return arch
        name = archs[0]
    elif config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    else:
        name = config.get("model_type") or "<no architectures or model_type>"
    raise ConfigError(f"unsupported architecture {name!r}; supported: {', '.join(supported)}")


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of a config (multimodal wrappers keep it in `text_config`)."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) else config


def model_dtype(config: dict[str, Any]) -> str:
    """The checkpoint's dtype (`dtype` in transformers 5, `torch_dtype` before); bf16 if unset."""
    for source in (text_config(config), config):
        for key in ("dtype", "torch_dtype"):
            if isinstance(source.get(key), str):
                return canonical_dtype(source[key])
    return "bfloat16"


def resolve_cache_dtypes(
    config: dict[str, Any],
    kv_cache_dtype: str = "auto",
    state_dtype: str = "auto",
    ssm_state_dtype: str = "auto",
) -> CacheDtypes:
    """Cache dtypes for a model. `auto` = the model dtype, except that the SSM / recurrent part
    of a state honours the config's own `mamba_ssm_cache_dtype` / `mamba_ssm_dtype`."""
    base = model_dtype(config)
    conv = resolve_dtype(state_dtype, base)
    cfg = text_config(config)
    if ssm_state_dtype != "auto":
        ssm = canonical_dtype(ssm_state_dtype)
    elif state_dtype != "auto":
        ssm = conv
    else:
        ssm = canonical_dtype(
            cfg.get("mamba_ssm_cache_dtype") or cfg.get("mamba_ssm_dtype") or base
        )
    for name, value in (("state_dtype", conv), ("ssm_state_dtype", ssm)):
        if value not in STATE_DTYPES:
            raise ValueError(
                f"{name} {value!r} is not a state dtype; allowed: {', '.join(STATE_DTYPES)}"
            )
    return CacheDtypes(resolve_dtype(kv_cache_dtype, base), conv, ssm)


def read_layers(config: dict[str, Any], dtypes: CacheDtypes | None = None) -> list[CacheLayer]:
    """Read the config of a plan-only family into its cache layers, in layer order (runnable
    families: `hybridkv.models.registry.declared_cache_layers`)."""
    arch = architecture_of(config)
    if arch not in ARCHITECTURES:
        raise ConfigError(f"{arch} declares its cache from the model; it has no config reader")
    dtypes = dtypes or resolve_cache_dtypes(config)
    cfg = _Config(dict(text_config(config)), arch)
    try:
        layers = ARCHITECTURES[arch](cfg, dtypes)
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise ConfigError(f"config.json of {arch} is malformed: {exc!r}") from None
    if not layers:
        raise ConfigError(f"config.json of {arch} describes no layer that keeps a cache")
    return layers
