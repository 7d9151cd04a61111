"""Data type names shared by the plan, the configs and the runtime (no torch import here)."""

from __future__ import annotations

# Canonical cache dtype name -> bytes per element.
DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
}

_ALIASES: dict[str, str] = {
    "float": "float32",
    "fp32": "float32",
    "torch.float32": "float32",
    "bf16": "bfloat16",
    "torch.bfloat16": "bfloat16",
    "half": "float16",
    "fp16": "float16",
    "torch.float16": "float16",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
    "float8_e5m2": "fp8_e5m2",
}

STATE_DTYPES = ("float32", "bfloat16", "float16")


def canonical_dtype(name: str) -> str:
    """Return the canonical spelling of a dtype name, or raise with the allowed names."""
    key = str(name).strip().lower()
    key = _ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        allowed = ", ".join(sorted(set(DTYPE_BYTES) | set(_ALIASES)))
        raise ValueError(f"unknown dtype {name!r}; allowed: {allowed}")
    return key


def dtype_bytes(name: str) -> int:
    return DTYPE_BYTES[canonical_dtype(name)]


def resolve_dtype(requested: str, model_dtype: str) -> str:
    """`auto` means the model's own dtype."""
    return canonical_dtype(model_dtype if requested == "auto" else requested)


def torch_dtype(name: str):  # -> torch.dtype; torch is imported lazily
    import torch

    return {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }[canonical_dtype(name)]


_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}


def parse_bytes(text: str | int) -> int:
    """Parse '40GiB', '512MiB', '2G', '1e9' or an int into bytes."""
    if isinstance(text, int):
        return text
    s = str(text).strip().lower().replace(" ", "")
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    number, unit = s[:i], s[i:]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise ValueError(
            f"cannot read memory size {text!r}; use a positive number with an optional unit "
            "such as 512MiB, 40GiB, 2G or 1e9"
        )
    return int(value * _UNITS[unit])
