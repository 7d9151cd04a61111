"""Falcon-H1 against transformers, on every cache setting of `conformance.CASES`.

Every decoder layer runs attention and a Mamba2 mixer side by side, so each layer index owns
two cache layers (an attention one and a Mamba2 state) in two groups of the plan.

Two tiny models: "defaults" keeps every config key at its transformers default except the sizes
(scan chunks of 16 tokens included) and initializer_range: multipliers 1, no gated norm, no bias
but the conv's. "mup" draws every muP multiplier away from 1 and has 3 attention heads of an
explicit head_dim (20, not hidden / heads) over one KV head, the gated RMSNorm on and normalising
after the gate (mamba_norm_before_gate off), every bias on (projectors, mixer in_proj, attention,
MLP; the conv's off), mamba_d_ssm null (expand x hidden), 2 Mamba2 groups, a finite dt limit and
tied embeddings. A third, "rmsnorm", has the gated norm on in its default order (normalise, then
gate) and is checked on prefill logits. A_log, dt_bias, D, the norms and the biases are drawn at
random so that decays, gates and norms are not at their initial values.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridkv.engine import Engine

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import engine_greedy, prompts, reference_greedy, save_model, seeded

VOCAB = 96
LAYERS = 3


def _randomise(hf, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def _defaults():
    from transformers import FalconH1Config

    return FalconH1Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8,
        mamba_d_state=16, mamba_chunk_size=16, max_position_embeddings=512,
        initializer_range=0.1,  # not an architecture key: larger weights, clearer top-2 gaps
    )  # fmt: skip


def _mup():
    from transformers import FalconH1Config

    return FalconH1Config(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=LAYERS,
        num_attention_heads=3, num_key_value_heads=1, head_dim=20, mamba_d_ssm=None,
        mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=16,
        mamba_rms_norm=True, mamba_norm_before_gate=False, projectors_bias=True,
        mamba_proj_bias=True, mamba_conv_bias=False, attention_bias=True, mlp_bias=True,
        time_step_limit=(0.05, 1.5), tie_word_embeddings=True,
        embedding_multiplier=1.7, lm_head_multiplier=0.6, key_multiplier=0.8,
        attention_in_multiplier=1.3, attention_out_multiplier=0.7, ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.75, ssm_multipliers=[0.6, 1.4, 0.8, 1.25, 0.9],
        mlp_multipliers=[1.5, 0.8], rope_parameters={"rope_type": "default", "rope_theta": 1e5},
        max_position_embeddings=512,
    )  # fmt: skip


def _rmsnorm():
    from transformers import FalconH1Config

    return FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, mamba_d_ssm=48, mamba_n_heads=4,
        mamba_n_groups=2, mamba_d_state=8, mamba_rms_norm=True, max_position_embeddings=512,
        ssm_multipliers=[1.1, 0.9, 1.0, 1.0, 1.0],
    )  # fmt: skip


BUILDERS = {"defaults": _defaults, "mup": _mup}
SEEDS = {"defaults": 2, "mup": 1}  # seeds whose greedy tokens keep a top-2 margin above MIN_MARGIN


def build(tmp_path_factory, name: str, builder=None, seed: int = 0):
    from transformers import FalconH1ForCausalLM

    hf = seeded(FalconH1ForCausalLM, (builder or BUILDERS[name])(), seed=seed)
    _randomise(hf, seed)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return save_model(hf, tmp_path_factory.mktemp(name)), hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, seed=SEEDS.get(request.param, 0))


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_prefill_logits_match_with_the_gated_norm_before_the_gate(tmp_path_factory):
    check_prefill_logits(*build(tmp_path_factory, "rmsnorm", _rmsnorm))


def test_every_layer_owns_an_attention_and_a_mamba2_cache_layer(checkpoint):
    """Two cache layers per layer index, in two groups, on separate views of the buffers."""
    folder, _ = checkpoint
    engine = Engine(str(folder), dtype="float32", kernel_block_size=8)
    by_kind = {g.kind: g for g in engine.plan.groups}
    assert sorted(by_kind) == ["attention", "mamba2"] and len(engine.plan.groups) == 2
    for group in by_kind.values():
        assert group.layer_ids == tuple(range(LAYERS))
    attn, state = by_kind["attention"], by_kind["mamba2"]
    assert attn.layer_names == tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))
    assert state.layer_names == tuple(f"model.layers.{i}.mamba" for i in range(LAYERS))
    layer = engine.runner.model.model.layers[1]
    assert layer.mamba.cache.group_id == state.group_id
    assert layer.self_attn.attn.cache.group_id == attn.group_id


def test_the_variants_are_what_they_claim(checkpoint):
    folder, hf = checkpoint
    engine = Engine(str(folder), dtype="float32", kernel_block_size=8)
    model = engine.runner.model
    layer = model.model.layers[0]
    mixer, attn = layer.mamba, layer.self_attn
    if hf.config.mamba_rms_norm:  # "mup"
        raw = json.loads((folder / "config.json").read_text())
        assert raw["mamba_d_ssm"] is None and mixer.intermediate_size == 96  # expand x hidden
        assert mixer.gated_norm and not mixer.norm_before_gate and mixer.n_groups == 2
        assert mixer.out_proj.bias is not None and mixer.in_proj.bias is not None
        assert mixer.conv1d.bias is None and mixer.dt_limit == (0.05, 1.5)
        assert mixer.mup_vector is not None and mixer.in_multiplier == 1.2
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (3, 1, 20)
        assert attn.key_multiplier == 0.8 and layer.feed_forward.down_multiplier == 0.8
        assert model.lm_head.weight is model.model.embed_tokens.weight
        assert layer.feed_forward.gate_multiplier == 1.5
    else:
        assert not hasattr(mixer, "norm") and mixer.mup_vector is None
        assert mixer.out_proj.bias is None and mixer.conv1d.bias is not None
        assert mixer.chunk_size == 16 and (attn.heads, attn.head_dim) == (4, 16)
        assert model.embedding_multiplier == model.lm_head_multiplier == 1.0


@pytest.mark.parametrize(
    "keys, message",
    [
        ({"num_key_value_heads": 3}, r"num_attention_heads \(4\) must be a multiple of "
                                     r"num_key_value_heads \(3\)"),
        ({"mamba_n_heads": 7}, r"mamba_n_heads \(7\) must divide .* mamba_d_ssm \(64\)"),
        ({"mamba_n_groups": 3}, r"mamba_n_heads \(8\) must be a multiple of mamba_n_groups"),
        ({"mamba_d_head": 4}, r"mamba_d_head \(4\) x mamba_n_heads \(8\) must equal"),
        ({"ssm_multipliers": [1, 2]}, r"ssm_multipliers must be a list of 5 numbers"),
    ],
)  # fmt: skip
def test_bad_configs_are_one_line(tmp_path, keys, message):
    config = {"architectures": ["FalconH1ForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "num_key_value_heads": 2, "mamba_d_ssm": 64,
              "mamba_n_heads": 8, "num_hidden_layers": 2, "vocab_size": VOCAB, **keys}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as err:
        Engine(str(tmp_path), dtype="float32")
    assert "\n" not in str(err.value)


def test_null_keys_derive_as_transformers_does():
    from hybridkv.models.falcon_h1 import FalconH1Config

    cfg = FalconH1Config.from_hf({"hidden_size": 64, "mamba_expand": 3, "mamba_d_ssm": None,
                                  "mamba_n_heads": 8, "num_attention_heads": 4,
                                  "num_key_value_heads": None})  # fmt: skip
    assert (cfg.mamba_d_ssm, cfg.mamba_d_head, cfg.num_key_value_heads) == (192, 24, 4)
    cfg = FalconH1Config.from_hf({"hidden_size": 64, "num_attention_heads": 16})  # keys absent
    assert (cfg.mamba_d_ssm, cfg.mamba_d_head, cfg.num_key_value_heads) == (1024, 8, 8)


def test_bfloat16_model_runs_close_to_transformers(checkpoint):
    """bfloat16 weights and activations: most greedy tokens equal transformers' bfloat16 ones."""
    from transformers import FalconH1ForCausalLM

    folder, _ = checkpoint
    hf = FalconH1ForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    asks = prompts(VOCAB, [21, 9], seed=7)
    ref, _ = reference_greedy(hf, asks, 4)
    engine = Engine(str(folder), dtype="bfloat16", kernel_block_size=8)
    got = engine_greedy(engine, asks, 4)
    same = sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 6


@pytest.mark.parametrize(
    "preset, page_tokens",
    [("tiiuae/Falcon-H1-0.5B-Instruct", 800), ("tiiuae/Falcon-H1-7B-Instruct", 1568)],
)
def test_real_configs_plan_from_the_model(preset, page_tokens):
    """`hybridkv plan` of the real configs: the cache layers come from the model built on the
    meta device (two per layer), and the page size is what the config-reader planned before."""
    from hybridkv.config import CacheConfig
    from hybridkv.kv.presets import load_preset
    from hybridkv.models.registry import plan_for_config

    config = load_preset(preset)
    plan = plan_for_config(config, CacheConfig(platform="cuda", memory_bytes=2**34))
    assert plan.page_tokens == page_tokens
    layers = config["num_hidden_layers"]
    names = {name for g in plan.groups for name in g.layer_names}
    assert len(names) == 2 * layers and "model.layers.0.self_attn.attn" in names
    assert all(g.layer_ids == tuple(range(layers)) for g in plan.groups)
