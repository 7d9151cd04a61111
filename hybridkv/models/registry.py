"""Architecture name -> model class, imported on first use; the architecture a Hugging Face
config describes (`architecture_of`), the cache layers its model declares and their memory plan
(`plan_for_config`, what `hybridkv plan` prints). This module imports no torch."""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING, Any

from hybridkv.kv.plan import MemoryPlan, PlanTarget, make_speculative_plan
from hybridkv.kv.specs import ConfigError
from hybridkv.models.config_helpers import model_dtype, resolve_cache_dtypes, text_config

if TYPE_CHECKING:
    from hybridkv.config import CacheConfig
    from hybridkv.kv.specs import CacheDtypes, CacheLayer
    from hybridkv.models.base import CausalLM
    from hybridkv.models.hf_config import HFConfig

MODELS: dict[str, str] = {
    "GraniteMoeHybridForCausalLM": "hybridkv.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "BambaForCausalLM": "hybridkv.models.bamba:BambaForCausalLM",
    "NemotronHForCausalLM": "hybridkv.models.nemotron_h:NemotronHForCausalLM",
    "LlamaForCausalLM": "hybridkv.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "hybridkv.models.llama:Qwen3ForCausalLM",
    "Qwen3NextForCausalLM": "hybridkv.models.qwen3_next:Qwen3NextForCausalLM",
    "Qwen3_5ForCausalLM": "hybridkv.models.qwen3_next:Qwen3_5ForCausalLM",
    "Qwen3_5MoeForCausalLM": "hybridkv.models.qwen3_next:Qwen3_5MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration": "hybridkv.models.qwen3_next:Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration": (
        "hybridkv.models.qwen3_next:Qwen3_5MoeForConditionalGeneration"
    ),
    "OlmoHybridForCausalLM": "hybridkv.models.olmo_hybrid:OlmoHybridForCausalLM",
    "Zamba2ForCausalLM": "hybridkv.models.zamba2:Zamba2ForCausalLM",
    "JambaForCausalLM": "hybridkv.models.jamba:JambaForCausalLM",
    "MambaForCausalLM": "hybridkv.models.mamba:MambaForCausalLM",
    "FalconMambaForCausalLM": "hybridkv.models.mamba:FalconMambaForCausalLM",
    "FalconH1ForCausalLM": "hybridkv.models.falcon_h1:FalconH1ForCausalLM",
    "Mamba2ForCausalLM": "hybridkv.models.mamba2:Mamba2ForCausalLM",
    "Lfm2ForCausalLM": "hybridkv.models.lfm2:Lfm2ForCausalLM",
    "Lfm2MoeForCausalLM": "hybridkv.models.lfm2:Lfm2MoeForCausalLM",
    "Gemma3ForCausalLM": "hybridkv.models.gemma3:Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration": "hybridkv.models.gemma3:Gemma3ForConditionalGeneration",
    "GptOssForCausalLM": "hybridkv.models.gpt_oss:GptOssForCausalLM",
    "DeepseekV3ForCausalLM": "hybridkv.models.deepseek_v3:DeepseekV3ForCausalLM",
    "DeepseekV2ForCausalLM": "hybridkv.models.deepseek_v3:DeepseekV2ForCausalLM",
    "KimiLinearForCausalLM": "hybridkv.models.kimi_linear:KimiLinearForCausalLM",
}


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


def architecture_of(config: dict[str, Any]) -> str:
    """The supported architecture a config.json describes, or a one-line error."""
    if not isinstance(config, dict):
        raise ConfigError(f"config.json must hold a JSON object, got {type(config).__name__}")
    archs = config.get("architectures")
    if isinstance(archs, list) and archs:
        for arch in archs:
            if arch in MODELS:
                return arch
        name = archs[0]
    elif config.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[config["model_type"]]
    else:
        name = config.get("model_type") or "<no architectures or model_type>"
    raise ConfigError(f"unsupported architecture {name!r}; supported: {', '.join(MODELS)}")


def model_class(architecture: str) -> type[CausalLM]:
    if architecture not in MODELS:
        raise ValueError(
            f"hybridkv cannot run architecture {architecture!r} yet; runnable: "
            f"{', '.join(sorted(MODELS))}"
        )
    module, _, name = MODELS[architecture].partition(":")
    return getattr(importlib.import_module(module), name)


def family_config(config: dict[str, Any]) -> HFConfig:
    """A runnable model's typed config, read from its Hugging Face config dict with the
    defaults of transformers' config class for its architecture."""
    return model_class(architecture_of(config)).config_class.from_hf(text_config(config))


def build_on_meta(
    config: dict[str, Any], tensor_parallel_size: int = 1, mtp: bool = False
) -> CausalLM:
    """The model a Hugging Face config dict describes, built on the meta device (no memory for
    weights); at `tensor_parallel_size` > 1, rank 0's shard (every rank declares the same).
    `mtp`: with its multi-token-prediction layers (speculative decoding, method "mtp")."""
    import torch

    from hybridkv.distributed.parallel import TensorParallel, building

    typed = family_config(config)
    with building(TensorParallel(tensor_parallel_size)), torch.device("meta"):
        model = model_class(architecture_of(config))(typed)
        if mtp:
            model.build_mtp()
        return model


def declared_cache_layers(
    config: dict[str, Any], dtypes: CacheDtypes, tensor_parallel_size: int = 1, mtp: bool = False
) -> list[CacheLayer]:
    """The cache layers a runnable model declares, per rank (what `hybridkv plan` plans)."""
    model = build_on_meta(config, tensor_parallel_size, mtp)
    if tensor_parallel_size > 1:
        unsharded = sorted({type(m).__name__ for _, m in model.cache_owners() if not m.sharded})
        if unsharded:
            raise ValueError(
                f"{type(model).__name__} has no per-rank plan: its {', '.join(unsharded)} "
                "layers are not sharded yet; give tensor_parallel_size 1"
            )
    return model.cache_layers(dtypes)


def plan_for_config(
    config: dict[str, Any],
    cache: CacheConfig,
    max_model_len: int | None = None,
    compute_dtype: str | None = None,
    tensor_parallel_size: int = 1,
    mtp: bool = False,
    speculation: tuple[int, int] = (0, 0),
) -> MemoryPlan:
    """Plan the cache of a Hugging Face config dict (`hybridkv plan`, benchmarks): one rank's
    plan at `tensor_parallel_size` (every rank's is the same); `mtp`: with the cache layers of
    its multi-token-prediction layers; `speculation`: (requests drafting at once, k), whose
    state scratch the budget pays first (`kv.plan.make_speculative_plan`)."""
    dtypes = resolve_cache_dtypes(
        config, cache.kv_cache_dtype, cache.state_dtype, cache.ssm_state_dtype
    )
    layers = declared_cache_layers(config, dtypes, tensor_parallel_size, mtp)
    if max_model_len is None:
        max_model_len = int(text_config(config).get("max_position_embeddings") or 4096)
    target = PlanTarget(max_model_len, compute_dtype=compute_dtype or model_dtype(config))
    plan = make_speculative_plan(layers, cache, architecture_of(config), target, *speculation)
    return dataclasses.replace(plan, tensor_parallel_size=tensor_parallel_size)
