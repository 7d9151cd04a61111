import pytest

from hybridkv.kv.presets import load_model_config, load_preset, preset_ids
from hybridkv.kv.specs import (
    AttentionSpec,
    ConfigError,
    MLASpec,
    StateSpec,
    StateTensor,
)
from hybridkv.models.config_helpers import resolve_cache_dtypes
from hybridkv.models.registry import MODELS, architecture_of, declared_cache_layers


def read(cfg, **dtypes):
    """Cache layers of a config: declared by its model, built on the meta device."""
    return declared_cache_layers(cfg, resolve_cache_dtypes(cfg, **dtypes))


def layers_of(model_id, **dtypes):
    return read(load_preset(model_id), **dtypes)


def kinds(layers):
    out = {}
    for layer in layers:
        out.setdefault(layer.spec.kind, []).append(layer.layer_index)
    return out


def test_every_preset_reads():
    assert len(preset_ids()) == 24
    for model_id in preset_ids():
        layers = layers_of(model_id)
        assert layers, model_id
        assert len({layer.name for layer in layers}) == len(layers)


def test_granite_small_layout_and_state():
    layers = layers_of("ibm-granite/granite-4.0-h-small")
    k = kinds(layers)
    assert k["attention"] == [5, 15, 25, 35]
    assert len(k["mamba2"]) == 36
    state = next(layer.spec for layer in layers if layer.spec.kind == "mamba2")
    shapes = {t.name: t.shape for t in state.tensors}
    # conv keeps d_conv - 1 columns of (intermediate + 2 * groups * d_state) channels
    assert shapes == {"conv": (128 * 64 + 2 * 128, 3), "ssm": (128, 64, 128)}
    assert state.state_bytes == 2 * (8448 * 3 + 128 * 64 * 128)


@pytest.mark.parametrize(
    ("model_id", "expected"),
    [
        ("ibm-ai-platform/Bamba-9B", {"attention": [9, 18, 27]}),
        ("ai21labs/Jamba-v0.1", {"attention": [4, 12, 20, 28]}),
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", {"attention": list(range(3, 48, 4))}),
        ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", {"attention": [5, 12, 19, 26, 33, 42]}),
        ("nvidia/NVIDIA-Nemotron-Nano-9B-v2", {"attention": [14, 21, 30, 39]}),
        ("LiquidAI/LFM2-1.2B", {"attention": [2, 5, 8, 10, 12, 14]}),
        ("LiquidAI/LFM2-8B-A1B", {"attention": [2, 6, 10, 14, 18, 21]}),
        ("moonshotai/Kimi-Linear-48B-A3B-Instruct", {"mla": [3, 7, 11, 15, 19, 23, 26]}),
        ("Zyphra/Zamba2-1.2B", {"attention": [5, 11, 17, 23, 29, 35]}),
        ("Zyphra/Zamba2-2.7B", {"attention": [6, 12, 18, 24, 30, 36, 42, 47, 51]}),
        ("google/gemma-3-27b-it", {"attention": list(range(5, 62, 6))}),
        ("openai/gpt-oss-20b", {"attention": list(range(1, 24, 2))}),
    ],
)
def test_attention_layer_indices(model_id, expected):
    k = kinds(layers_of(model_id))
    for kind, indices in expected.items():
        assert k[kind] == indices


def test_state_kinds_per_family():
    assert set(kinds(layers_of("ai21labs/Jamba-v0.1"))) == {"attention", "mamba1"}
    assert set(kinds(layers_of("Qwen/Qwen3.5-27B"))) == {"attention", "gated_delta_net"}
    assert set(kinds(layers_of("LiquidAI/LFM2-1.2B"))) == {"attention", "short_conv"}
    assert set(kinds(layers_of("moonshotai/Kimi-Linear-48B-A3B-Instruct"))) == {"mla", "kda"}
    assert set(kinds(layers_of("deepseek-ai/DeepSeek-V3"))) == {"mla"}
    assert set(kinds(layers_of("openai/gpt-oss-20b"))) == {"attention", "sliding_window"}


def test_falcon_h1_has_attention_and_mamba_in_every_layer():
    layers = layers_of("tiiuae/Falcon-H1-0.5B-Instruct")
    k = kinds(layers)
    assert k["attention"] == k["mamba2"] == list(range(36))


def test_zamba2_hybrid_layers_keep_mamba_and_one_kv_per_call():
    k = kinds(layers_of("Zyphra/Zamba2-1.2B"))
    assert len(k["mamba2"]) == 38 and len(k["attention"]) == 6
    spec = next(x.spec for x in layers_of("Zyphra/Zamba2-1.2B") if x.spec.kind == "attention")
    assert (spec.num_kv_heads, spec.head_dim) == (32, 128)


def test_sliding_windows():
    gemma = {x.spec for x in layers_of("google/gemma-3-27b-it")}
    assert {s.sliding_window for s in gemma} == {None, 1024}
    gpt = {x.spec for x in layers_of("openai/gpt-oss-20b")}
    assert {s.sliding_window for s in gpt} == {None, 128}


def test_state_element_counts_match_model_config_readme():
    # Per-layer element counts as worked out in shared/model-configs/README.md.
    expected = {
        "Qwen/Qwen3-Next-80B-A3B-Instruct": 32 * 128 * 128 + 8192 * 3,
        "nvidia/Nemotron-H-8B-Base-8K": 128 * 64 * 128 + 10240 * 3,
        "ai21labs/Jamba-v0.1": 8192 * 16 + 8192 * 3,
        "Zyphra/Zamba2-2.7B": 80 * 64 * 64 + 5248 * 3,
        "tiiuae/Falcon-H1-7B-Instruct": 24 * 128 * 256 + 3584 * 3,
        "LiquidAI/LFM2-1.2B": 2048 * 2,
        "moonshotai/Kimi-Linear-48B-A3B-Instruct": 32 * 128 * 128 + 3 * 4096 * 3,
    }
    for model_id, elems in expected.items():
        state = next(x.spec for x in layers_of(model_id) if isinstance(x.spec, StateSpec))
        assert sum(t.nbytes // 2 for t in state.tensors) == elems, model_id


def test_ssm_cache_dtype_is_honoured_and_overridable():
    nano = layers_of("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16")
    state = next(x.spec for x in nano if isinstance(x.spec, StateSpec))
    assert {t.name: t.dtype for t in state.tensors} == {"conv": "bfloat16", "ssm": "float32"}
    qwen = next(x.spec for x in layers_of("Qwen/Qwen3.5-35B-A3B") if isinstance(x.spec, StateSpec))
    assert {t.name: t.dtype for t in qwen.tensors} == {"conv": "bfloat16", "recurrent": "float32"}
    forced = layers_of("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", state_dtype="bfloat16")
    state = next(x.spec for x in forced if isinstance(x.spec, StateSpec))
    assert {t.dtype for t in state.tensors} == {"bfloat16"}


def test_kv_cache_dtype():
    layers = layers_of("meta-llama/Llama-3.1-8B", kv_cache_dtype="fp8")
    assert layers[0].spec.bytes_per_token == 2 * 8 * 128
    mla = layers_of("deepseek-ai/DeepSeek-V3")[0].spec
    assert isinstance(mla, MLASpec) and mla.bytes_per_token == (512 + 64) * 2


def test_transformers5_layer_type_names():
    cfg = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "num_hidden_layers": 3,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "layer_types": ["linear_attention", "full_attention", "linear_attention"],
        "mamba_n_heads": 4,
        "mamba_d_head": 32,
        "mamba_d_state": 16,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    }
    k = kinds(read(cfg))
    assert k == {"mamba2": [0, 2], "attention": [1]}


def test_nemotron_layers_block_type_spelling():
    cfg = {
        "model_type": "nemotron_h",
        "num_hidden_layers": 4,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"],
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "ssm_state_size": 8,
        "n_groups": 2,
    }
    assert kinds(read(cfg)) == {"mamba2": [0], "attention": [1]}


def test_unknown_architecture_lists_supported():
    with pytest.raises(ConfigError, match="unsupported architecture 'FooForCausalLM'") as err:
        architecture_of({"architectures": ["FooForCausalLM"]})
    assert "LlamaForCausalLM" in str(err.value) and "\n" not in str(err.value)


def test_runnable_family_bad_field_is_one_line():
    cfg = load_preset("moonshotai/Kimi-Linear-48B-A3B-Instruct")  # runnable since issue 17
    cfg["linear_attn_config"] = dict(cfg["linear_attn_config"], full_attn_layers=[4, 99])
    with pytest.raises(ConfigError, match="full_attn_layers has layer 99, outside 1..27") as err:
        read(cfg)
    assert "\n" not in str(err.value)


def test_runnable_family_missing_field_takes_the_transformers_default():
    cfg = load_preset("ibm-granite/granite-4.0-h-small")
    del cfg["mamba_n_heads"]  # GraniteMoeHybridConfig: 128; mamba_d_head "auto" follows it
    state = next(x.spec for x in read(cfg) if isinstance(x.spec, StateSpec))
    assert {t.name: t.shape for t in state.tensors}["ssm"] == (128, 2 * 4096 // 128, 128)


def test_wrong_layer_count_and_bad_token():
    cfg = load_preset("ibm-granite/granite-4.0-h-small")
    cfg["num_hidden_layers"] = 12
    with pytest.raises(ConfigError, match="layer_types has 40 entries but num_hidden_layers is 12"):
        read(cfg)
    cfg = load_preset("ibm-granite/granite-4.0-h-small")
    cfg["layer_types"][0] = "banana"
    with pytest.raises(ConfigError, match="unknown layer type 'banana'"):
        read(cfg)


def test_non_integer_field():
    cfg = load_preset("meta-llama/Llama-3.1-8B")
    cfg["num_key_value_heads"] = "eight"
    with pytest.raises(ConfigError, match="'num_key_value_heads' must be int"):
        read(cfg)
    cfg = load_preset("deepseek-ai/DeepSeek-V3")  # runnable: its typed config checks the type
    cfg["kv_lora_rank"] = "eight"
    with pytest.raises(ConfigError, match="'kv_lora_rank' must be int"):
        read(cfg)


def test_load_model_config_paths(tmp_path):
    import json

    cfg = load_preset("Qwen/Qwen3-8B")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(tmp_path) == cfg
    assert load_model_config(tmp_path / "config.json") == cfg
    with pytest.raises(ConfigError, match="neither a folder with config.json"):
        load_model_config(tmp_path / "does-not-exist")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match="has no config.json"):
        load_model_config(empty)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_model_config(tmp_path / "bad.json")


def test_every_architecture_has_a_model_type_or_preset():
    from hybridkv.models.registry import MODEL_TYPES

    assert set(MODEL_TYPES.values()) <= set(MODELS)


def test_specs_validate():
    with pytest.raises(ValueError):
        AttentionSpec(0, 64, "bfloat16")
    with pytest.raises(ValueError, match="unknown dtype"):
        AttentionSpec(2, 64, "int3")
    with pytest.raises(ValueError, match="at least one tensor"):
        StateSpec("lstm", ())
    with pytest.raises(ValueError, match="a state kind is a name"):
        StateSpec("", (StateTensor("h", (2,), "float32"),))
    with pytest.raises(ValueError, match="unique"):
        StateSpec("x", (StateTensor("h", (2,), "float32"), StateTensor("h", (3,), "float32")))
