"""The model declares its cache: for every runnable family, the specs its modules declare
(built on the meta device) are the ones transformers' config class implies, for every real
config bundled as a preset and for a config that leaves every optional key out, and they are
what `hybridkv plan` shows. The typed configs keep transformers' defaults."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from hybridkv.entrypoints.cli import main as cli_main
from hybridkv.kv.presets import load_preset, preset_ids
from hybridkv.kv.specs import CacheDtypes
from hybridkv.models.base import CausalLM
from hybridkv.models.config_helpers import resolve_cache_dtypes
from hybridkv.models.hf_config import LAYER_TYPES
from hybridkv.models.registry import (
    MODELS,
    architecture_of,
    build_on_meta,
    model_class,
    plan_for_config,
)

RUNNABLE = sorted(MODELS)
STATE_KINDS = ("mamba2", "gated_delta_net", "mamba1", "short_conv", "kda")
RUNNABLE_PRESETS = [p for p in preset_ids() if architecture_of(load_preset(p)) in MODELS]
MODEL_TYPES = {
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "BambaForCausalLM": "bamba",
    "NemotronHForCausalLM": "nemotron_h",
    "LlamaForCausalLM": "llama",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "OlmoHybridForCausalLM": "olmo_hybrid",
    "FalconH1ForCausalLM": "falcon_h1",
    "Zamba2ForCausalLM": "zamba2",
    "Mamba2ForCausalLM": "mamba2",
    "Lfm2ForCausalLM": "lfm2",
    "Lfm2MoeForCausalLM": "lfm2_moe",
    "JambaForCausalLM": "jamba",
    "MambaForCausalLM": "mamba",
    "FalconMambaForCausalLM": "falcon_mamba",
    "Gemma3ForCausalLM": "gemma3_text",
    "Gemma3ForConditionalGeneration": "gemma3",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "KimiLinearForCausalLM": "kimi_linear",
}


def hf_config(config: dict):
    """transformers' own config object for a config dict (the source of truth)."""
    from transformers import AutoConfig

    keys = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    if architecture_of(config) == "Zamba2ForCausalLM":
        keys = _zyphra_first_keys(keys)
    hf = AutoConfig.for_model(MODEL_TYPES[architecture_of(config)], **keys)
    return getattr(hf, "text_config", None) or hf  # multimodal wrappers: the text model


def _zyphra_first_keys(keys: dict) -> dict:
    """Zamba2-1.2B's config is in Zyphra's first key names, which transformers 5.24 ignores
    (it would read the model with its defaults: 8 Mamba2 heads, d_state 64, no hybrid layer):
    spelled here as transformers names them."""
    renames = {"state_size": "mamba_d_state", "conv_dimension": "mamba_d_conv",
               "expansion_factor": "mamba_expand",
               "use_shared_attention_lora": "use_shared_attention_adapter"}  # fmt: skip
    out = {renames.get(k, k): v for k, v in keys.items()}
    if "n_mamba_heads" not in out and "mamba_headdim" in out:
        inner = out.get("mamba_expand", 2) * out["hidden_size"]
        out["n_mamba_heads"] = inner // out["mamba_headdim"]
    roles = {"m": "mamba", "g": "hybrid"}
    if out.get("layers_block_type"):
        out["layers_block_type"] = [roles.get(t, t) for t in out["layers_block_type"]]
    return out


def _role(name: str) -> str:
    return LAYER_TYPES[str(name).lower()]


def expected_specs(config: dict, dtypes: CacheDtypes) -> list[tuple]:
    """(layer index, kind, dims) of every cache layer, worked out from transformers' config
    object independently of hybridkv's modules."""
    hf = hf_config(config)
    arch = architecture_of(config)
    out = []
    if arch in ("GraniteMoeHybridForCausalLM", "BambaForCausalLM"):
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        conv = hf.mamba_n_heads * hf.mamba_d_head + 2 * hf.mamba_n_groups * hf.mamba_d_state
        for i, kind in enumerate(hf.layers_block_type):
            if _role(kind) == "mamba":
                ssm = (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state)
                out.append((i, "mamba2", (conv, hf.mamba_d_conv - 1), ssm))
            else:
                out.append((i, "attention", hf.num_key_value_heads, head_dim, None))
    elif arch == "NemotronHForCausalLM":
        conv = hf.mamba_num_heads * hf.mamba_head_dim + 2 * hf.n_groups * hf.ssm_state_size
        for i, kind in enumerate(hf.layers_block_type):
            if _role(kind) == "mamba":
                ssm = (hf.mamba_num_heads, hf.mamba_head_dim, hf.ssm_state_size)
                out.append((i, "mamba2", (conv, hf.conv_kernel - 1), ssm))
            elif _role(kind) == "attention":
                out.append((i, "attention", hf.num_key_value_heads, hf.head_dim, None))
    elif arch == "FalconH1ForCausalLM":  # attention and Mamba2 side by side in every layer
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        inner = hf.mamba_d_ssm or hf.mamba_expand * hf.hidden_size
        conv = inner + 2 * hf.mamba_n_groups * hf.mamba_d_state
        for i in range(hf.num_hidden_layers):
            ssm = (hf.mamba_n_heads, hf.mamba_d_head, hf.mamba_d_state)
            out.append((i, "mamba2", (conv, hf.mamba_d_conv - 1), ssm))
            out.append((i, "attention", hf.num_key_value_heads, head_dim, None))
    elif arch == "Zamba2ForCausalLM":  # Mamba2 in every layer; a KV cache per shared-block call
        conv = hf.mamba_expand * hf.hidden_size + 2 * hf.mamba_ngroups * hf.mamba_d_state
        ssm = (hf.n_mamba_heads, hf.mamba_headdim, hf.mamba_d_state)
        for i in range(len(hf.layers_block_type)):
            out.append((i, "mamba2", (conv, hf.mamba_d_conv - 1), ssm))
        for i in hf.hybrid_layer_ids:
            out.append((i, "attention", hf.num_key_value_heads, hf.attention_head_dim, None))
    elif arch.startswith(("Qwen3Next", "Qwen3_5", "OlmoHybrid")):
        conv = 2 * hf.linear_num_key_heads * hf.linear_key_head_dim
        conv += hf.linear_num_value_heads * hf.linear_value_head_dim
        for i, kind in enumerate(hf.layer_types):
            if _role(kind) == "mamba":
                rec = (hf.linear_num_value_heads, hf.linear_key_head_dim, hf.linear_value_head_dim)
                out.append((i, "gated_delta_net", (conv, hf.linear_conv_kernel_dim - 1), rec))
            else:
                head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
                out.append((i, "attention", hf.num_key_value_heads, head_dim, None))
    elif arch == "Mamba2ForCausalLM":
        inner = hf.expand * hf.hidden_size
        conv = inner + 2 * hf.n_groups * hf.state_size
        ssm = (hf.num_heads, hf.head_dim, hf.state_size)
        out += [(i, "mamba2", (conv, hf.conv_kernel - 1), ssm) for i in range(hf.num_hidden_layers)]
    elif arch == "JambaForCausalLM":
        inner = hf.mamba_expand * hf.hidden_size
        for i, kind in enumerate(hf.layers_block_type):
            if kind == "mamba":
                out.append((i, "mamba1", (inner, hf.mamba_d_conv - 1), (inner, hf.mamba_d_state)))
            else:
                head_dim = hf.hidden_size // hf.num_attention_heads
                out.append((i, "attention", hf.num_key_value_heads, head_dim, None))
    elif arch in ("Lfm2ForCausalLM", "Lfm2MoeForCausalLM"):  # short conv: one conv state
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        kinds = hf.layer_types or ["full_attention"] * hf.num_hidden_layers
        for i, kind in enumerate(kinds):
            if kind == "conv":
                out.append((i, "short_conv", (hf.hidden_size, hf.conv_L_cache - 1)))
            else:
                out.append((i, "attention", hf.num_key_value_heads, head_dim, None))
    elif arch.startswith("Deepseek"):  # MLA in every layer: one latent + rope key per token
        mla = (hf.kv_lora_rank, hf.qk_rope_head_dim)
        out += [(i, "mla", *mla) for i in range(hf.num_hidden_layers)]
    elif arch == "KimiLinearForCausalLM":  # KDA: conv q, k, v and [H, D, D]; MLA (NoPE)
        width, conv = hf.linear_num_heads * hf.linear_head_dim, hf.linear_conv_kernel_dim - 1
        rec = (hf.linear_num_heads, hf.linear_head_dim, hf.linear_head_dim)
        for i, kind in enumerate(hf.layer_types):
            if kind == "full_attention":
                out.append((i, "mla", hf.kv_lora_rank, hf.qk_rope_head_dim))
            else:
                out.append((i, "kda", (width, conv), (width, conv), (width, conv), rec))
    elif arch in ("MambaForCausalLM", "FalconMambaForCausalLM"):
        inner = hf.intermediate_size
        conv, ssm = (inner, hf.conv_kernel - 1), (inner, hf.state_size)
        out += [(i, "mamba1", conv, ssm) for i in range(hf.num_hidden_layers)]
    else:  # Llama, Qwen3, Gemma3
        kinds = getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers
        for i, kind in enumerate(kinds):
            window = hf.sliding_window if kind == "sliding_attention" else None
            if window is not None and not getattr(hf, "use_sliding_window", True):
                window = None
            kind_name = "attention" if window is None else "sliding_window"
            out.append((i, kind_name, hf.num_key_value_heads, hf.head_dim, window))
    return out


def _summary(layer_index: int, spec) -> tuple:
    if spec.kind in STATE_KINDS:
        shapes = (t.shape for t in spec.tensors)  # conv(s), then ssm / recurrent
        return (layer_index, spec.kind, *shapes)
    if spec.kind == "mla":
        return (layer_index, spec.kind, spec.kv_lora_rank, spec.qk_rope_head_dim)
    return (layer_index, spec.kind, spec.num_kv_heads, spec.head_dim, spec.sliding_window)


def declared(config: dict, dtypes: CacheDtypes) -> list[tuple]:
    model = build_on_meta(config)
    assert all(p.is_meta for p in model.parameters())  # no memory was spent on weights
    return sorted(_summary(c.layer_index, c.spec) for c in model.cache_layers(dtypes))


def planned(config: dict, capsys, tmp_path) -> list[tuple]:
    """What `hybridkv plan --json` shows: (layer id, spec) for every cache layer."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert cli_main(["plan", "--model", str(tmp_path), "--json", "--platform", "cpu"]) == 0
    rows = []
    for group in json.loads(capsys.readouterr().out)["groups"]:
        spec = group["spec"]
        for layer_id in group["layer_ids"]:
            if spec["kind"] in STATE_KINDS:
                shapes = (tuple(t["shape"]) for t in spec["tensors"])
                rows.append((layer_id, spec["kind"], *shapes))
            elif spec["kind"] == "mla":
                rows.append((layer_id, "mla", spec["kv_lora_rank"], spec["qk_rope_head_dim"]))
            else:
                rows.append(
                    (layer_id, spec["kind"], spec["num_kv_heads"], spec["head_dim"],
                     spec["sliding_window"])
                )  # fmt: skip
    return sorted(rows)


@pytest.mark.parametrize("preset", RUNNABLE_PRESETS)
def test_real_configs_declare_what_transformers_implies_and_plan_shows(preset, capsys, tmp_path):
    config = load_preset(preset)
    dtypes = resolve_cache_dtypes(config)
    ours = declared(config, dtypes)
    assert ours == sorted(expected_specs(config, dtypes))
    assert planned(config, capsys, tmp_path) == ours


@pytest.mark.parametrize("arch", RUNNABLE)
def test_a_config_without_optional_keys_takes_transformers_defaults(arch, capsys, tmp_path):
    config = {"architectures": [arch]}
    dtypes = resolve_cache_dtypes(config)
    ours = declared(config, dtypes)
    assert ours == sorted(expected_specs(config, dtypes))
    # (Bamba and Granite default to every layer Mamba2: pure state models plan as well)
    assert planned(config, capsys, tmp_path) == ours
    if all(row[1] in STATE_KINDS for row in ours):
        assert not plan_for_config(config, _cpu()).attention_groups


def _cpu():
    from hybridkv.config import CacheConfig

    return CacheConfig(platform="cpu", memory_bytes=2**30)


def _normalise(value):
    if isinstance(value, list | tuple):
        return tuple(_normalise(v) for v in value)
    if isinstance(value, str) and value.lower() in LAYER_TYPES:
        return LAYER_TYPES[value.lower()]
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return value


@pytest.mark.parametrize("arch", RUNNABLE)
def test_typed_config_defaults_are_transformers_defaults(arch):
    """Every field of the typed config, at its default, equals transformers' config object's
    value of the same name (after each derives what it derives)."""
    ours = model_class(arch).config_class.from_hf({})
    theirs = hf_config({"architectures": [arch]})
    skip = {
        "rope_parameters", "rope_theta", "rope_scaling", "hybrid_override_pattern",
        "partial_rotary_factor",  # compared below, through the rope parameters
    }  # fmt: skip
    compared = 0
    for field in dataclasses.fields(ours):
        if field.name in skip or not hasattr(theirs, field.name):
            continue
        mine, want = _normalise(getattr(ours, field.name)), _normalise(getattr(theirs, field.name))
        if isinstance(want, float) and math.isinf(want):
            assert mine == want, field.name
        else:
            assert mine == want, (field.name, mine, want)
        compared += 1
    assert compared >= 10
    if hasattr(ours, "rope"):  # NemotronH has no position embedding
        assert ours.rope["rope_theta"] == theirs.rope_parameters["rope_theta"]
    if hasattr(ours, "rotary_factor"):
        want = theirs.rope_parameters.get("partial_rotary_factor")
        assert want is None or ours.rotary_factor == want


def test_cache_owners_are_found_by_module_path_not_by_name_strings():
    model = build_on_meta(load_preset("ibm-granite/granite-4.0-h-small"))
    names = [name for name, _ in model.cache_owners()]
    assert names[0] == "model.layers.0.mamba" and "model.layers.5.self_attn.attn" in names
    assert [m.layer_index for _, m in model.cache_owners()] == list(range(40))


def test_bind_refuses_views_that_differ_from_the_declared_spec():
    from hybridkv.layers.cache import StateCache
    from hybridkv.layers.mamba2 import Mamba2Mixer
    from hybridkv.ops.mamba2_ops import TorchMamba2Ops

    mixer = Mamba2Mixer(16, 2, 8, 4, layer_index=3)
    dtypes = CacheDtypes("float32", "float32", "float32")
    spec = mixer.declare(dtypes)
    good = {t.name: torch.zeros(2, *t.shape) for t in spec.tensors}
    mixer.bind_cache(StateCache(0, good, TorchMamba2Ops()))
    renamed = {("state" if n == "ssm" else n): v for n, v in good.items()}
    with pytest.raises(ValueError, match="differ from the declared"):
        mixer.bind_cache(StateCache(0, renamed, TorchMamba2Ops()))
    wrong_dtype = {n: v.to(torch.bfloat16) for n, v in good.items()}
    with pytest.raises(ValueError, match="differ from the declared"):
        mixer.bind_cache(StateCache(0, wrong_dtype, TorchMamba2Ops()))


@pytest.mark.parametrize("arch", RUNNABLE)
def test_materialised_models_have_no_buffer_a_checkpoint_would_not_fill(arch):
    """A model built on the meta device keeps nothing its constructor computed into a
    buffer, so every buffer must be persistent (loaded) and constants live on the CPU."""
    model: CausalLM = build_on_meta({"architectures": [arch], "num_hidden_layers": 2})
    persistent = set(model.state_dict())
    assert all(name in persistent for name, _ in model.named_buffers())
    rotary = getattr(model, "rotary", None)
    if rotary is not None:
        assert rotary.inv_freq.device.type == "cpu"
