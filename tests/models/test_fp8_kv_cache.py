"""An fp8 KV cache (`kv_cache_dtype="fp8_e4m3"` / `"fp8_e5m2"`) computes exactly what
transformers computes with its keys and values rounded to that fp8 format before attention: the
cache's only effect is the rounding (no scale: a value is cast, as vLLM does with its default
scale of 1). Every architecture whose attention layers cache keys and values (the MLA families
cache a latent instead), its tiny config-fidelity model with real seeded weights, the prompt
prefilled in chunks of 16 so that later chunks read the earlier ones' keys and values back from
the fp8 cache.
"""

from __future__ import annotations

import sys

import pytest
import torch

from hybridkv.engine import Engine

from .test_config_fidelity import COVERED, config_dict, hf_classes
from .utils import engine_prefill_logits, max_rel_error, prompts, save_model, seeded

NO_KV_CACHE = {  # MLA caches a latent; Mamba-only models cache no attention at all
    "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiLinearForCausalLM",
    "MambaForCausalLM", "FalconMambaForCausalLM", "Mamba2ForCausalLM",
}  # fmt: skip
FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def fp8_reference_logits(hf, ids: list[int], dtype: torch.dtype, monkeypatch) -> torch.Tensor:
    """transformers' float32 logits with every attention call's keys and values rounded to
    `dtype` (the registered attention function, or the module's eager one)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def rounding(attend):
        def attend_rounded(module, q, k, v, *args, **kwargs):
            return attend(module, q, k.to(dtype).to(k.dtype), v.to(dtype).to(v.dtype), *args,
                          **kwargs)  # fmt: skip

        return attend_rounded

    impl = hf.config._attn_implementation
    registered = ALL_ATTENTION_FUNCTIONS.get_interface(impl, None)
    if registered is not None:
        monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, impl, rounding(registered))
    else:  # "eager": the modeling module's own function
        module = sys.modules[type(hf).__module__]
        monkeypatch.setattr(module, "eager_attention_forward",
                            rounding(module.eager_attention_forward))  # fmt: skip
    with torch.inference_mode():
        logits = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    monkeypatch.undo()
    return logits


@pytest.mark.parametrize("kv_cache_dtype", sorted(FP8))
@pytest.mark.parametrize("arch", [a for a in COVERED if a not in NO_KV_CACHE])
def test_fp8_cache_is_transformers_with_rounded_keys_and_values(
    arch, kv_cache_dtype, tmp_path, monkeypatch
):
    config_class, model_class = hf_classes(arch)
    hf = seeded(model_class, config_class(**config_dict(arch), initializer_range=0.1))
    folder = save_model(hf, tmp_path / "model")
    ids = prompts(hf.config.vocab_size, [40], seed=3)[0]
    engine = Engine(
        str(folder), dtype="float32", kernel_block_size=4, kv_cache_dtype=kv_cache_dtype,
        max_num_batched_tokens=16, enable_prefix_caching=False,
    )  # fmt: skip
    assert {g.spec.dtype for g in engine.plan.attention_groups} == {kv_cache_dtype}
    ours = engine_prefill_logits(engine, ids)
    rounded = fp8_reference_logits(hf, ids, FP8[kv_cache_dtype], monkeypatch)
    # measured 4e-7..9e-6; a key within float32 noise of an fp8 rounding midpoint may round one
    # fp8 step apart in the two (Zamba2 e5m2 with chunks: 6.5e-5), the rounding itself 5e-2..0.6
    assert max_rel_error(ours, rounded) <= 1e-3
    with torch.inference_mode():
        plain = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    assert max_rel_error(ours, plain) > 20 * max_rel_error(ours, rounded)
