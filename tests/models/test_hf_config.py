"""The typed-config reader: defaults, aliases, types, one-line errors."""

import math

import pytest

from hybridkv.kv.specs import ConfigError
from hybridkv.models.granitemoehybrid import GraniteMoeHybridConfig
from hybridkv.models.llama import LlamaConfig, Qwen3Config
from hybridkv.models.nemotron_h import NemotronHConfig


def test_missing_and_null_keys_take_the_default():
    cfg = LlamaConfig.from_hf({"hidden_size": 64, "num_attention_heads": 4, "head_dim": None})
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.vocab_size) == (16, 4, 32000)


def test_aliases_and_which_spelling_wins():
    # transformers' NemotronH pops the old mamba_* spelling over the new one
    cfg = NemotronHConfig.from_hf({"n_groups": 4, "mamba_n_groups": 2, "mamba_d_conv": 3})
    assert (cfg.n_groups, cfg.conv_kernel) == (2, 3)
    granite = GraniteMoeHybridConfig.from_hf(
        {"num_hidden_layers": 2, "layers_block_type": ["mamba", "attention"]}
    )
    assert granite.layers == ("mamba", "attention")


def test_values_are_typed_and_frozen():
    cfg = GraniteMoeHybridConfig.from_hf(
        {"num_hidden_layers": 1, "time_step_limit": [0.0, {"__float__": "Infinity"}]}
    )
    assert cfg.dt_limit == (0.0, math.inf) and isinstance(cfg.time_step_limit, tuple)
    assert LlamaConfig.from_hf({"tie_word_embeddings": 1}).tie_word_embeddings is True
    assert LlamaConfig.from_hf({"hidden_size": 64.0}).hidden_size == 64
    with pytest.raises(AttributeError):
        cfg.hidden_size = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("cls", "data", "message"),
    [
        (LlamaConfig, {"hidden_size": 64.5}, "'hidden_size' must be int, got 64.5"),
        (LlamaConfig, {"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be bool"),
        (LlamaConfig, {"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
        (LlamaConfig, {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        (LlamaConfig, {"rope_parameters": {"rope_type": "magic"}}, "unsupported rope type"),
        (Qwen3Config, {"num_hidden_layers": 2, "layer_types": ["x", "y"]}, "unknown layer type"),
        (NemotronHConfig, {"hybrid_override_pattern": "M?"}, "unknown layer type '?'"),
        (NemotronHConfig, {"n_routed_experts": 6, "n_group": 4}, "not a multiple of n_group"),
        (NemotronHConfig, {"mlp_hidden_act": "swoosh"}, "unsupported mlp_hidden_act"),
    ],
)
def test_bad_values_are_one_line_config_errors(cls, data, message):
    with pytest.raises(ConfigError, match=message) as err:
        cls.from_hf(data)
    assert "\n" not in str(err.value) and cls.ARCHITECTURE in str(err.value)
