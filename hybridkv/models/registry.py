"""Architecture name -> model class, imported on first use (this module imports no torch)."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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
    from hybridkv.kv.specs import architecture_of, text_config

    return model_class(architecture_of(config)).config_class.from_hf(text_config(config))


def build_on_meta(config: dict[str, Any], tensor_parallel_size: int = 1) -> CausalLM:
    """The model a Hugging Face config dict describes, built on the meta device (no memory for
    weights); at `tensor_parallel_size` > 1, rank 0's shard (every rank declares the same)."""
    import torch

    from hybridkv.distributed.parallel import TensorParallel, building
    from hybridkv.kv.specs import architecture_of

    typed = family_config(config)
    with building(TensorParallel(tensor_parallel_size)), torch.device("meta"):
        return model_class(architecture_of(config))(typed)


def declared_cache_layers(
    config: dict[str, Any], dtypes: CacheDtypes, tensor_parallel_size: int = 1
) -> list[CacheLayer]:
    """The cache layers a runnable model declares, per rank (what `hybridkv plan` plans)."""
    model = build_on_meta(config, tensor_parallel_size)
    if tensor_parallel_size > 1:
        unsharded = sorted({type(m).__name__ for _, m in model.cache_owners() if not m.sharded})
        if unsharded:
            raise ValueError(
                f"{type(model).__name__} has no per-rank plan: its {', '.join(unsharded)} "
                "layers are not sharded yet; give tensor_parallel_size 1"
            )
    return model.cache_layers(dtypes)
