"""Every config key is read as transformers reads it (issue 31).

Generated over every registered architecture that has a transformers 5.24 config class of its
own (the two multimodal wrappers, Gemma3ForConditionalGeneration and
Qwen3_5ForConditionalGeneration, read the same text config classes as Gemma3ForCausalLM and
Qwen3_5ForCausalLM, which are covered). For each architecture a tiny base config (the sizes of
the family's own tests) and, for every numeric or boolean key of its transformers config class
(its dataclass fields) and every alias of its `attribute_map`, one variant with that key at a
valid non-default small value. For each variant:

- transformers builds its model on the meta device, hybridkv builds its own from the same
  config dict as the engine does (`build_on_meta`); the checkpoint transformers would save
  (tied weights removed, its weight conversions reverted, as `save_pretrained` does) loads into
  hybridkv's model by its own `load_weights` (every weight found, every shape equal), and the
  two hold the same number of weight elements (no checkpoint tensor left unread);
- the cache hybridkv declares is the one transformers' config implies
  (`test_declared_cache.expected_specs`);
- a seeded sample of the variants also builds real tiny weights and compares prefill logits.

A variant transformers itself refuses (its config or model construction raises) is listed in
`HF_REFUSES`, named in its test id, and its test checks that transformers still refuses it.
One that transformers builds but cannot run is in `HF_FORWARD_FAILS`; one that transformers
runs but hybridkv refuses on purpose (a model this engine cannot serve) in `REFUSED_ON_PURPOSE`
with the reason: both must be refused by hybridkv in one line naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from typing import Any

import pytest
import torch

from hybridkv.models.config_helpers import resolve_cache_dtypes
from hybridkv.models.registry import MODELS, build_on_meta

from .conformance import check_prefill_logits
from .test_declared_cache import MODEL_TYPES, declared, expected_specs
from .utils import save_model, seeded

VOCAB = 96
NO_IDS: dict[str, Any] = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)

# The tiny base configs (the sizes of each family's own tests).
# fmt: off
_QWEN_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=512,
)
_QWEN_MOE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=4,
                 num_experts_per_tok=2)

BASES: dict[str, dict[str, Any]] = {
    "GraniteMoeHybridForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_head=16,
        mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16, num_local_experts=4,
        num_experts_per_tok=2, position_embedding_type="rope", max_position_embeddings=512,
    ),
    "BambaForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1],
        mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=16, max_position_embeddings=512,
    ),
    "NemotronHForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern="M*-E",
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        mamba_num_heads=6, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=40, n_group=2, topk_group=1,
        max_position_embeddings=512,
    ),
    "LlamaForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    ),
    "Qwen3ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=12,
        max_window_layers=2, max_position_embeddings=512,
    ),
    "Qwen3NextForCausalLM": dict(_QWEN_COMMON, **_QWEN_MOE, intermediate_size=48),
    "Qwen3_5ForCausalLM": dict(_QWEN_COMMON, intermediate_size=48),
    "Qwen3_5MoeForCausalLM": dict(_QWEN_COMMON, **_QWEN_MOE),
    "OlmoHybridForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        max_position_embeddings=512,
    ),
    "Zamba2ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        layers_block_type=["mamba", "hybrid", "hybrid", "hybrid"], n_mamba_heads=4,
        mamba_d_state=8, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4,
        chunk_size=32,
    ),
    "JambaForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=8, max_position_embeddings=512,
    ),
    "MambaForCausalLM": dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2),
    "FalconMambaForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2
    ),
    "FalconH1ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8,
        mamba_d_state=16, mamba_chunk_size=16, max_position_embeddings=512,
    ),
    "Mamba2ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=16, head_dim=8,
        state_size=16, chunk_size=16,
    ),
    "Lfm2ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=8, full_attn_idxs=[1], max_position_embeddings=512,
    ),
    "Lfm2MoeForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=3, num_attention_heads=8, num_experts=4, num_experts_per_tok=2,
        num_dense_layers=1, layer_types=["conv", "full_attention", "conv"],
        max_position_embeddings=512,
    ),
    "Gemma3ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12,
        sliding_window_pattern=2, max_position_embeddings=512,
    ),
    "GptOssForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
        num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=12, max_position_embeddings=512,
    ),
    "DeepseekV3ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=32,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
        max_position_embeddings=512,
    ),
    "DeepseekV2ForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=3, topk_method="group_limited_greedy",
        first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=8, max_position_embeddings=256,
    ),
    "KimiLinearForCausalLM": dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24,
        q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
        num_experts=4, num_experts_per_token=2, num_expert_group=2, topk_group=1,
        first_k_dense_replace=1,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                            "full_attn_layers": [2], "kda_layers": [1, 3, 4]},
        model_max_length=512,
    ),
}
# fmt: on

# Keys not varied, because they change neither the weights, nor the cache, nor the logits of
# a forward without cache (transformers reads them in training, initialisation, generation or
# output plumbing only):
SKIP = {
    # output plumbing / generation
    "output_hidden_states", "output_attentions", "return_dict", "use_cache",
    "chunk_size_feed_forward", "is_encoder_decoder", "tie_encoder_decoder",
    "num_logits_to_keep", "output_router_logits",
    # token ids: what generation and the tokenizer use; the model only uses pad_token_id as
    # the embedding's padding_idx, which changes its initialisation, not its shape
    "pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
    # initialisation only
    "initializer_range", "rescale_prenorm_residual", "time_step_floor", "time_step_scale",
    "time_step_init_scheme", "initializer_factor", "embedding_init_std",
    # training only: dropout, router losses and noise
    "attention_dropout", "hidden_dropout", "embd_pdrop", "resid_pdrop", "dropout",
    "mlp_dropout", "router_aux_loss_coef", "router_z_loss_coef", "router_jitter_noise",
    "aux_loss_alpha", "seq_aux", "z_loss_coef",
    # kernel choice (same math): transformers' fused-kernel switches
    "use_mamba_kernels", "use_kernels",
}  # fmt: skip
SKIP_PATTERNS = re.compile(r".*dropout.*|.*_pdrop$")


def hf_classes(arch: str) -> tuple[type, type]:
    import transformers
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[MODEL_TYPES[arch]], getattr(transformers, arch)


def _kind(annotation: Any, value: Any) -> str | None:
    """'bool', 'int' or 'float' for a numeric or boolean key (from its value, else its
    annotation), None for any other."""
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if value is not None:
        return None
    text = str(annotation)
    options = {t.strip() for t in text.replace("Optional[", "").rstrip("]").split("|")}
    for kind in ("bool", "int", "float"):
        if kind in options:
            return kind
    return None


def _new_value(kind: str, value: Any) -> Any:
    """A valid non-default small value of that kind."""
    if kind == "bool":
        return not value
    if kind == "int":
        if value is None:
            return 8
        return {0: 1, 1: 2}.get(value, 2 * value if value <= 64 else value // 2)
    if value is None or value == 0:
        return 0.25
    return value / 2 if abs(value) < 1e6 else 1.0


# Where the generic choice (double it) is not a valid value for the base config, the value
# used instead (still non-default and small).
# fmt: off
VALUES: dict[str, dict[str, Any]] = {
    "DeepseekV2ForCausalLM": {"n_group": 2, "num_experts_per_tok": 4},  # <= experts in top groups
    "KimiLinearForCausalLM": {"n_group": 1, "num_expert_group": 1, "num_experts_per_tok": 1,
                              "num_experts_per_token": 1},  # >= 2 experts a group
    "Lfm2ForCausalLM": {"num_key_value_heads": 4},  # a divisor of the 8 heads
    "Lfm2MoeForCausalLM": {"num_key_value_heads": 4},
    "NemotronHForCausalLM": {"n_groups": 3},  # a divisor of the 6 Mamba heads
    "Zamba2ForCausalLM": {"num_key_value_heads": 2},
}
# fmt: on


def variants(arch: str) -> list[tuple[str, str, Any]]:
    """(name, key written to config.json, value) for every varied key and alias."""
    config_class, _ = hf_classes(arch)
    base = config_class(**NO_IDS, **BASES[arch])
    fields = {f.name: f.type for f in dataclasses.fields(config_class)}
    out = []
    keys = sorted(set(fields) | set(config_class().to_dict()))
    for key in keys:
        if key in SKIP or SKIP_PATTERNS.fullmatch(key) or key.startswith("_"):
            continue
        current = getattr(base, key, None)
        kind = _kind(fields.get(key), current)
        if kind is None:
            continue
        out.append((key, key, VALUES.get(arch, {}).get(key, _new_value(kind, current))))
    for alias, target in sorted(config_class.attribute_map.items()):
        current = getattr(base, target, None)
        kind = _kind(fields.get(target), current)
        if kind is None or target in SKIP:
            continue
        value = VALUES.get(arch, {}).get(alias, _new_value(kind, current))
        out.append((f"{alias}(alias)", alias, value))
    return out


def config_dict(arch: str, key: str | None = None, value: Any = None) -> dict[str, Any]:
    """The config.json of a variant: the base keys, `key` set to `value` (an alias replaces
    its target)."""
    config_class, _ = hf_classes(arch)
    data: dict[str, Any] = {**NO_IDS, **BASES[arch]}
    if key is not None:
        target = config_class.attribute_map.get(key)
        if target is not None:
            data.pop(target, None)
        data[key] = value
    return json.loads(json.dumps(data))


def build_hf(arch: str, data: dict[str, Any], device: str = "meta"):
    config_class, model_class = hf_classes(arch)
    cfg = config_class(**data)
    with torch.device(device):
        return model_class(cfg)


def checkpoint_of(hf) -> dict[str, torch.Tensor]:
    """What `save_pretrained` writes, by name: tied weights removed, conversions reverted."""
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = remove_tied_weights_from_state_dict(hf.state_dict(), hf)
    return dict(revert_weight_conversion(hf, state))


def _numel(model: torch.nn.Module) -> int:
    seen = {id(p): p.numel() for p in model.parameters()}
    persistent = set(model.state_dict(keep_vars=True))
    seen |= {id(b): b.numel() for n, b in model.named_buffers() if n in persistent}
    return sum(seen.values())


def compare(arch: str, data: dict[str, Any]) -> None:
    """hybridkv's model on the meta device takes transformers' checkpoint whole, and declares
    the cache transformers' config implies."""
    hf = build_hf(arch, data)
    full = {"architectures": [arch], "model_type": MODEL_TYPES[arch], **data}
    ours = build_on_meta(full)
    weights = checkpoint_of(hf)
    ours.load_weights(iter(weights.items()))  # every weight found, every shape equal
    theirs_numel = sum(t.numel() for t in weights.values())
    if _numel(ours) != theirs_numel:
        params = dict(ours.named_parameters(remove_duplicate=False))
        unread = sorted(n for n in weights if ours.map_weight_name(n) not in params)
        raise AssertionError(
            f"checkpoint holds {theirs_numel} elements, hybridkv {_numel(ours)}; "
            f"names hybridkv has no parameter for: {unread[:8]}"
        )
    dtypes = resolve_cache_dtypes(full)
    assert declared(full, dtypes) == sorted(expected_specs(full, dtypes))


_MAMBA_HEADS = "mamba_n_heads * mamba_d_head must equal mamba_expand * hidden_size"
_LAYOUT = "num_hidden_layers must equal the number of layer_types"
# Variants transformers itself refuses (its config class or model construction raises).
HF_REFUSES: dict[str, dict[str, str]] = {
    "BambaForCausalLM": {k: _MAMBA_HEADS for k in
                         ("hidden_size", "mamba_d_head", "mamba_expand", "mamba_n_heads")},
    "FalconH1ForCausalLM": {"mamba_d_head": _MAMBA_HEADS},
    "GraniteMoeHybridForCausalLM": {
        **{k: _MAMBA_HEADS for k in ("hidden_size", "mamba_d_head", "mamba_expand",
                                     "mamba_n_heads")},
        "num_hidden_layers": _LAYOUT,
    },
    "JambaForCausalLM": {"attn_layer_offset": "offset must be smaller than the period",
                         "expert_layer_offset": "offset must be smaller than the period"},
    "KimiLinearForCausalLM": {"num_hidden_layers": _LAYOUT},
    "Lfm2MoeForCausalLM": {"num_hidden_layers": _LAYOUT},
    "Mamba2ForCausalLM": {k: "hidden_size * expand must equal num_heads * head_dim"
                          for k in ("expand", "head_dim", "hidden_size", "num_heads")},
    "Zamba2ForCausalLM": {"num_hidden_layers": _LAYOUT},
}  # fmt: skip

# Variants transformers builds but cannot run (its forward raises on the tiny model): hybridkv
# refuses them in one line naming the key (variant name -> the key the message names).
HF_FORWARD_FAILS: dict[str, dict[str, str]] = {
    "KimiLinearForCausalLM": {"num_attention_heads": "num_key_value_heads"},  # MLA: kv == heads
    "Zamba2ForCausalLM": {  # the adapters add a 2 * hidden term to q, k and v
        "attention_head_dim": "attention_head_dim", "head_dim(alias)": "attention_head_dim",
        "num_key_value_heads": "num_key_value_heads",
        "attention_hidden_size": "attention_hidden_size",  # q/k/v read concat(x, e): 2 * hidden
        "mamba_headdim": "mamba_headdim",  # the mixer reshapes by heads * headdim
    },
}  # fmt: skip

# Variants transformers builds and runs but hybridkv refuses on purpose, in one line naming the
# key: (arch, variant name) -> (the key the message names, why).
REFUSED_ON_PURPOSE: dict[tuple[str, str], tuple[str, str]] = {
    ("Gemma3ForCausalLM", "use_bidirectional_attention"): (
        "use_bidirectional_attention",
        "EmbeddingGemma (an encoder): a prompt token attends to the tokens after it, which "
        "cannot be decoded causally, prefilled in chunks or prefix-cached",
    ),
}

# Findings not fixed yet: (arch, variant name) -> what differs.
XFAIL: dict[tuple[str, str], str] = {}

COVERED = [a for a in sorted(MODELS) if a in BASES]
# their text configs (Gemma3TextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig) are covered
UNCOVERED = {
    "Gemma3ForConditionalGeneration", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
}  # fmt: skip
LOGIT_SAMPLES = 15
# Variants whose logits are always compared: the findings fixed (issue 31).
LOGIT_ALWAYS = {
    ("MambaForCausalLM", "intermediate_size"), ("FalconMambaForCausalLM", "intermediate_size"),
    ("DeepseekV2ForCausalLM", "num_experts(alias)"),
    ("KimiLinearForCausalLM", "tie_word_embeddings"),
    # transformers' Gemma 3 reads attn_logit_softcapping but does not apply it (hybridkv too)
    ("Gemma3ForCausalLM", "attn_logit_softcapping"),
    # MLA: more KV heads than query heads is the math of as many (transformers' SDPA path)
    ("KimiLinearForCausalLM", "num_key_value_heads"),
}  # fmt: skip


def _params() -> tuple[list[Any], list[Any], list[Any], list[Any], list[Any]]:
    meta, refused, both_refuse, accepted, always, on_purpose = [], [], [], [], [], []
    for arch in COVERED:
        for name, key, value in variants(arch):
            test_id = f"{arch}-{name}={value}"
            if name in HF_REFUSES.get(arch, {}):
                refused.append(pytest.param(arch, key, value, id=f"{test_id}-hf-refuses"))
                continue
            named = HF_FORWARD_FAILS.get(arch, {}).get(name)
            if named is not None:
                test_id += "-hf-forward-fails"
                both_refuse.append(pytest.param(arch, key, value, named, id=test_id))
                continue
            if (arch, name) in REFUSED_ON_PURPOSE:
                named = REFUSED_ON_PURPOSE[(arch, name)][0]
                test_id += "-refused-on-purpose"
                on_purpose.append(pytest.param(arch, key, value, named, id=test_id))
                continue
            marks = []
            if (arch, name) in XFAIL:
                marks.append(pytest.mark.xfail(strict=True, reason=XFAIL[(arch, name)]))
            elif (arch, name) in LOGIT_ALWAYS:
                always.append((arch, key, value, test_id))
            else:
                accepted.append((arch, key, value, test_id))
            meta.append(pytest.param(arch, key, value, id=test_id, marks=marks))
    sample = random.Random(31).sample(accepted, min(LOGIT_SAMPLES, len(accepted))) + always
    logits = [pytest.param(a, k, v, id=i) for a, k, v, i in sorted(sample, key=lambda s: s[3])]
    return meta, refused, both_refuse, logits, on_purpose


META, REFUSED, BOTH_REFUSE, LOGITS, ON_PURPOSE = _params()


def test_every_registered_architecture_is_covered():
    assert set(MODELS) == set(COVERED) | UNCOVERED


@pytest.mark.parametrize("arch", COVERED)
def test_base_config_matches(arch):
    compare(arch, config_dict(arch))


@pytest.mark.parametrize(("arch", "key", "value"), META)
def test_variant_weights_and_cache_match_transformers(arch, key, value):
    compare(arch, config_dict(arch, key, value))


@pytest.mark.parametrize(("arch", "key", "value"), REFUSED)
def test_variant_transformers_refuses_still_refused(arch, key, value):
    with pytest.raises(Exception):  # noqa: B017 (whatever transformers raises)
        build_hf(arch, config_dict(arch, key, value))


@pytest.mark.parametrize(("arch", "key", "value", "named"), BOTH_REFUSE)
def test_variant_transformers_cannot_run_is_refused_in_one_line(arch, key, value, named):
    from hybridkv.kv.specs import ConfigError

    data = config_dict(arch, key, value)
    hf = build_hf(arch, data, device="cpu").eval()
    with pytest.raises(RuntimeError), torch.inference_mode():
        hf(torch.tensor([[1, 2, 3, 4]]))
    full = {"architectures": [arch], "model_type": MODEL_TYPES[arch], **data}
    with pytest.raises(ConfigError, match=named) as err:
        build_on_meta(full)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(("arch", "key", "value", "named"), ON_PURPOSE)
def test_variant_refused_on_purpose_is_refused_in_one_line(arch, key, value, named):
    """transformers builds the model (it is not refusing it); hybridkv refuses it in one line
    naming the key (see REFUSED_ON_PURPOSE for why)."""
    from hybridkv.kv.specs import ConfigError

    data = config_dict(arch, key, value)
    build_hf(arch, data)
    full = {"architectures": [arch], "model_type": MODEL_TYPES[arch], **data}
    with pytest.raises(ConfigError, match=named) as err:
        build_on_meta(full)
    assert "\n" not in str(err.value)


def test_refusal_categories_name_real_variants():
    """Every entry of the refusal and xfail tables is a variant that is generated."""
    names = {(arch, name) for arch in COVERED for name, _, _ in variants(arch)}
    listed = set(REFUSED_ON_PURPOSE) | set(XFAIL) | set(LOGIT_ALWAYS)
    listed |= {(a, n) for table in (HF_REFUSES, HF_FORWARD_FAILS) for a in table for n in table[a]}
    assert listed <= names, sorted(listed - names)


@pytest.mark.parametrize(("arch", "key", "value"), LOGITS)
def test_sampled_variant_prefill_logits_match_transformers(arch, key, value, tmp_path):
    data = config_dict(arch, key, value)
    config_class, model_class = hf_classes(arch)
    hf = seeded(model_class, config_class(**data, initializer_range=0.1))
    folder = save_model(hf, tmp_path / "model")
    check_prefill_logits(folder, hf, length=13)
