"""Reading a Hugging Face config dict where hybridkv needs it before (or without) a family's
typed config (`hybridkv.models.hf_config`): the language-model part of a multimodal config, the
checkpoint's dtype, and the cache dtypes that follow from them. No torch.

The architecture a config describes, and the families that run it, are
`hybridkv.models.registry`'s (`architecture_of`, `MODELS`).
"""

from __future__ import annotations

from typing import Any

from hybridkv.dtypes import STATE_DTYPES, canonical_dtype, resolve_dtype
from hybridkv.kv.specs import CacheDtypes


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
