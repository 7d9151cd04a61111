"""Architecture name -> model class, imported on first use."""

from __future__ import annotations

import importlib

MODELS: dict[str, str] = {
    "GraniteMoeHybridForCausalLM": "hybridkv.models.granitemoehybrid:GraniteMoeHybridForCausalLM",
    "BambaForCausalLM": "hybridkv.models.bamba:BambaForCausalLM",
    "NemotronHForCausalLM": "hybridkv.models.nemotron_h:NemotronHForCausalLM",
    "LlamaForCausalLM": "hybridkv.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "hybridkv.models.llama:Qwen3ForCausalLM",
}


def model_class(architecture: str) -> type:
    if architecture not in MODELS:
        raise ValueError(
            f"hybridkv cannot run architecture {architecture!r} yet; runnable: "
            f"{', '.join(sorted(MODELS))}"
        )
    module, _, name = MODELS[architecture].partition(":")
    return getattr(importlib.import_module(module), name)
