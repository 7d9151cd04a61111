"""gpt-oss against transformers: alternating sliding / full attention with learned sinks,
attention biases, YaRN RoPE, a biased top-k router and clamped-SwiGLU experts.

Two tiny variants (windows of 12 and 8 tokens, shorter than most prompts):
- "default": transformers' defaults but sizes (YaRN factor 32, alternating layers, GQA 4/2);
- "odd": 3 query heads over 1 KV head, head_dim 12, window 8, its own layer_types, a YaRN
  with truncation and a small original length (the ramp covers mid frequencies), and a
  swiglu_limit of 0.3 so the clamps are active.
Sinks, router and expert biases get random values (transformers starts the expert biases at
zero), so a missing sink or bias shows in the logits.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.kv.specs import ConfigError
from hybridkv.layers.rotary import yarn_inv_freq
from hybridkv.models.gpt_oss import GptOssConfig, GptOssForCausalLM

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import engine_greedy, save_model, seeded

CAPTURED = ("default", "odd")  # (the native router with its bias, the clamped experts)
CAPTURED_BF16 = CAPTURED

VOCAB = 96


def randomise_biases_and_sinks(model) -> None:
    g = torch.Generator().manual_seed(5)
    for name, param in model.named_parameters():
        if name.endswith(("sinks", "_bias", "router.bias")):
            param.data.copy_(torch.randn(param.shape, generator=g) * 0.5)


def build_default():
    from transformers import GptOssConfig as HFGptOssConfig
    from transformers import GptOssForCausalLM as HFGptOss

    cfg = HFGptOssConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=12, initializer_range=0.1,
        max_position_embeddings=512,
    )  # fmt: skip
    model = seeded(HFGptOss, cfg)
    randomise_biases_and_sinks(model)
    return model


def build_odd():
    from transformers import GptOssConfig as HFGptOssConfig
    from transformers import GptOssForCausalLM as HFGptOss

    rope = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "truncate": True,
        "original_max_position_embeddings": 64,
    }
    kinds = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    cfg = HFGptOssConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=4,
        num_local_experts=5, num_experts_per_tok=3, num_attention_heads=3,
        num_key_value_heads=1, head_dim=12, sliding_window=8, layer_types=kinds,
        rope_parameters=rope, swiglu_limit=0.3, initializer_range=0.15,
        max_position_embeddings=256,
    )  # fmt: skip
    model = seeded(HFGptOss, cfg, seed=2)
    randomise_biases_and_sinks(model)
    return model


BUILDERS = {"default": build_default, "odd": build_odd}


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    hf = BUILDERS[request.param]()
    return save_model(hf, tmp_path_factory.mktemp(request.param)), hf


def test_prefill_logits_match(checkpoint):
    folder, hf = checkpoint
    engine = check_prefill_logits(folder, hf)  # 37 tokens: beyond both windows
    ours = dict(engine.model.named_parameters())
    assert set(hf.state_dict()) == set(ours), "checkpoint and model tensors differ"
    windows = [layer.self_attn.attn.sliding_window for layer in engine.model.model.layers]
    assert windows == [
        hf.config.sliding_window if kind == "sliding_attention" else None
        for kind in hf.config.layer_types
    ]
    assert all(ours[n].abs().sum() > 0 for n in ours if n.endswith("sinks"))


def test_yarn_frequencies_match_transformers():
    from transformers import GptOssConfig as HFGptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    for build in (build_default, build_odd):
        hf_cfg = build().config
        ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
        ours = GptOssConfig.from_hf(hf_cfg.to_dict())
        inv_freq, scale = yarn_inv_freq(hf_cfg.head_dim, ours.rope, ours.max_position_embeddings)
        torch.testing.assert_close(inv_freq, ref.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(ref_scale)
    # the full-size defaults too (head_dim 64, theta 150000, no truncation)
    hf_cfg = HFGptOssConfig()
    ref, ref_scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    inv_freq, scale = yarn_inv_freq(64, GptOssConfig().rope, 131072)
    torch.testing.assert_close(inv_freq, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_defaults_follow_transformers():
    cfg = GptOssConfig()
    assert cfg.layer_types[:4] == ("sliding_attention", "attention") * 2
    assert cfg.windows[:2] == (128, None)
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.head_dim) == (128, 4, 64)
    assert GptOssConfig.from_hf({"num_experts": 8}).num_local_experts == 8


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"num_attention_heads": 6, "num_key_value_heads": 4}, "multiple of num_key_value_heads"),
        ({"num_local_experts": 2, "num_experts_per_tok": 3}, "at most num_local_experts"),
        ({"rope_parameters": {"rope_type": "llama3"}}, "unsupported rope type 'llama3'"),
        ({"num_hidden_layers": 3, "layer_types": ["full_attention"]}, "has 1 entries"),
        ({"layer_types": ["mamba"] * 36}, "unknown layer type 'mamba'"),
        ({"sliding_window": 0}, "sliding_window must be positive"),
    ],
)
def test_bad_configs_fail_in_one_line(keys, message):
    with pytest.raises(ConfigError, match=message) as info:
        GptOssConfig.from_hf(keys)
    assert "\n" not in str(info.value)


def test_mxfp4_checkpoint_is_refused_in_one_line():
    cfg = GptOssConfig(num_hidden_layers=2)
    with torch.device("meta"):
        model = GptOssForCausalLM(cfg)
    weights = [("model.layers.0.mlp.experts.gate_up_proj_blocks", torch.zeros(1))]
    with pytest.raises(ValueError, match="MXFP4") as info:
        model.load_weights(weights)
    assert "\n" not in str(info.value)


def test_triton_backend_matches_transformers(family):  # noqa: F811 (the conformance fixture)
    """The sinks through the Triton kernels (interpreted without a GPU): prefill chunks of 13
    tokens over kernel blocks of 16, then decodes, against transformers' greedy tokens."""
    engine = Engine(
        str(family.folder), dtype="float32", attention_backend="triton", kernel_block_size=16,
        max_num_batched_tokens=13,
    )  # fmt: skip
    assert {g.backend for g in engine.plan.attention_groups} == {"triton"}
    assert engine_greedy(engine, family.plain[:3], 8) == [t[:8] for t in family.plain_ref[:3]]
