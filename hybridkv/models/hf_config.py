"""Typed family configs: each family reads its Hugging Face config.json once, here.

A family declares a frozen dataclass whose fields are the config.json keys it uses, with the
defaults of transformers' config class for that architecture (each family file says which class
and version). `from_hf` reads a config dict into it:

- a key that is missing or null takes the field's default (as transformers does);
- `ALIASES` maps a field to older spellings it also accepts; the field's own name is read
  first unless the alias tuple names it (then that order: transformers lets some old
  spellings win over the new one);
- lists become tuples (the config is immutable and hashable where possible);
- values are checked against the field's type (int, float, bool, str, or None where allowed):
  a wrong type is a one-line `ConfigError` naming the key;
- `__post_init__` then derives what transformers derives (kv heads from heads, the layout
  from its several spellings, ...) and validates.

Models read their dimensions and layout from this object only.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, Self

from hybridkv.kv.specs import ConfigError

# Layer-type spellings (transformers 5 writes linear_attention / full_attention; checkpoints
# still carry mamba / attention, M / *, ...) -> one name per role.
LAYER_TYPES = {
    "mamba": "mamba", "mamba2": "mamba", "linear_attention": "mamba", "m": "mamba",
    "attention": "attention", "full_attention": "attention", "*": "attention",
    "sliding_attention": "sliding_attention", "sliding": "sliding_attention",
    "mlp": "mlp", "-": "mlp", "moe": "moe", "e": "moe",
}  # fmt: skip


def layer_types(tokens: Any, key: str, allowed: tuple[str, ...], arch: str) -> tuple[str, ...]:
    """A layout in any spelling (a list of names, or a pattern string such as "M*M-") as one
    role name per layer, each one of `allowed`."""
    if isinstance(tokens, str):
        tokens = list(tokens)
    if not isinstance(tokens, list | tuple):
        raise ConfigError(f"config.json of {arch}: {key} must be a list, got {tokens!r}")
    roles = []
    for tok in tokens:
        role = LAYER_TYPES.get(str(tok).strip().lower())
        if role not in allowed:
            raise ConfigError(
                f"config.json of {arch}: unknown layer type {tok!r} in {key}; "
                f"allowed: {', '.join(sorted(k for k, v in LAYER_TYPES.items() if v in allowed))}"
            )
        roles.append(role)
    return tuple(roles)


def config_float(value: Any) -> float:
    """A float from config.json; transformers 5 writes inf as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)


def _freeze(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_freeze(v) for v in value)
    return value


def _allowed_types(annotation: Any) -> tuple[type, ...] | None:
    """The plain types a field accepts, or None when its type is not checked here."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else ()
    options = args or (annotation,)
    plain = {int, float, bool, str, type(None)}
    if not all(o in plain for o in options):
        return None
    return tuple(options)


def _check_type(value: Any, allowed: tuple[type, ...]) -> bool:
    if value is None:
        return type(None) in allowed
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        # 0 / 1 for a flag: Python's truthiness, which transformers' configs accept
        return int in allowed or float in allowed or (bool in allowed and value in (0, 1))
    if isinstance(value, float):
        return float in allowed or (int in allowed and value.is_integer() and math.isfinite(value))
    return isinstance(value, str) and str in allowed


@dataclasses.dataclass(frozen=True)
class HFConfig:
    """Base of the typed family configs (see the module docstring)."""

    ARCHITECTURE: ClassVar[str] = ""
    ALIASES: ClassVar[dict[str, tuple[str, ...]]] = {}

    # What the engine reads of every family (each family repeats them with its own defaults).
    vocab_size: int = 32000
    max_position_embeddings: int = 2048

    @classmethod
    def from_hf(cls, data: Mapping[str, Any]) -> Self:
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            aliases = cls.ALIASES.get(f.name, ())
            for key in aliases if f.name in aliases else (f.name, *aliases):
                if data.get(key) is None:
                    continue
                value = _freeze(data[key])
                allowed = _allowed_types(hints[f.name])
                if allowed is not None and not _check_type(value, allowed):
                    names = " or ".join(t.__name__ for t in allowed if t is not type(None))
                    raise ConfigError(
                        f"config.json of {cls.ARCHITECTURE}: {key!r} must be {names}, "
                        f"got {value!r}"
                    )
                if allowed is not None and int in allowed and isinstance(value, float):
                    value = int(value) if float not in allowed else value
                if allowed == (bool,) and type(value) is int:
                    value = bool(value)
                kwargs[f.name] = value
                break
        try:
            return cls(**kwargs)
        except (TypeError, ValueError, KeyError, ZeroDivisionError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"config.json of {cls.ARCHITECTURE}: {exc}") from None

    def _set(self, name: str, value: Any) -> None:
        """Derive a field in __post_init__ (the dataclass is frozen)."""
        object.__setattr__(self, name, value)

    def _require_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(
                    f"config.json of {self.ARCHITECTURE}: {name} must be a positive integer, "
                    f"got {value!r}"
                )


@dataclasses.dataclass(frozen=True)
class RopeConfig(HFConfig):
    """The rotary keys of a family with RoPE: `rope_parameters` (transformers 5) or the older
    `rope_theta` / `rope_scaling`; theta defaults to 10000, transformers' `default_theta`."""

    rope_parameters: dict | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None

    @property
    def rope(self) -> dict:
        """rope_theta, rope_type and its scaling keys, as `RotaryEmbedding` takes them."""
        from hybridkv.layers.rotary import rope_parameters

        return rope_parameters(
            {
                "rope_parameters": self.rope_parameters,
                "rope_scaling": self.rope_scaling,
                "rope_theta": self.rope_theta or 10000.0,
            }
        )
