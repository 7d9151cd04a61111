"""LFM2 and LFM2-MoE against transformers, on every cache setting of `conformance.CASES`.

Three tiny models: LFM2 and LFM2-MoE with every config key at transformers' default but the
sizes and the layout (8 heads over the default 8 KV heads, conv_L_cache 3, no conv bias, tied
embeddings, LFM2's MLP width by its sizing rule, LFM2-MoE's top-4 of 8 experts after 2 dense
layers with the expert bias); and one odd LFM2-MoE (9 heads over 3 KV heads, conv_L_cache 4,
conv biases on, untied embeddings, top-2 of 4 experts not renormalised, routed scaling 2.5,
MoE on layers 3 and up). Every norm weight and the expert biases are drawn at random.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.ops import native

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import (
    check_bf16_as_close_as_transformers,
    check_config_errors,
    engine_greedy,
    prompts,
    reference_greedy,
    save_model,
    seeded,
)

# checkpoints whose decode steps must be captured (test_captured_decode_equals_eager)
CAPTURED = ("dense", "moe", "odd")  # (MoE: the native router takes the expert bias)
CAPTURED_BF16 = CAPTURED  # (the short conv and the bfloat16 sigmoid rule natively too)

VOCAB = 96


def randomise(hf, seed: int) -> None:
    """Norm weights away from 1, expert biases away from 0, routers away from their init."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
            elif name.endswith("feed_forward.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
        for name, b in hf.named_buffers():
            if name.endswith("expert_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)


def _dense():
    from transformers import Lfm2Config

    return Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=5,
        num_attention_heads=8, full_attn_idxs=[1, 3], max_position_embeddings=512,
        initializer_range=0.1,
    )  # fmt: skip


def _moe():
    from transformers import Lfm2MoeConfig

    return Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=80, moe_intermediate_size=24,
        num_hidden_layers=5, num_attention_heads=8, num_experts=8,
        layer_types=["conv", "full_attention", "conv", "conv", "full_attention"],
        max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip


def _odd():
    from transformers import Lfm2MoeConfig

    return Lfm2MoeConfig(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=40, moe_intermediate_size=20,
        num_hidden_layers=5, num_attention_heads=9, num_key_value_heads=3, conv_L_cache=4,
        conv_bias=True, tie_word_embeddings=False, num_dense_layers=3, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=False, routed_scaling_factor=2.5,
        layer_types=["full_attention", "conv", "conv", "full_attention", "conv"],
        max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip


BUILDERS = {"dense": _dense, "moe": _moe, "odd": _odd}
SEEDS = {"moe": 1, "odd": 1}  # seeds whose greedy tokens keep a top-2 margin above MIN_MARGIN


def build(tmp_path_factory, name: str, seed: int = 0):
    from transformers import Lfm2ForCausalLM, Lfm2MoeForCausalLM

    cfg = BUILDERS[name]()
    cls = Lfm2MoeForCausalLM if cfg.model_type == "lfm2_moe" else Lfm2ForCausalLM
    hf = seeded(cls, cfg, seed=seed)
    randomise(hf, seed)
    return save_model(hf, tmp_path_factory.mktemp(f"lfm2-{name}")), hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, SEEDS.get(request.param, 0))


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_the_variants_are_what_they_claim(checkpoint):
    folder, hf = checkpoint
    model = Engine(str(folder), dtype="float32", kernel_block_size=8).runner.model
    cfg = hf.config
    kinds = tuple("conv" if t == "conv" else "attention" for t in cfg.layer_types)
    assert model.config.layer_kinds == kinds and {"conv", "attention"} <= set(kinds)
    for i, (ours, theirs) in enumerate(zip(model.model.layers, hf.model.layers, strict=True)):
        assert hasattr(ours, "conv") == (kinds[i] == "conv")
        assert type(ours.feed_forward).__name__.endswith("SparseMoe") == (
            type(theirs.feed_forward).__name__.endswith("SparseMoeBlock")
        )
        if hasattr(theirs.feed_forward, "w1"):  # the dense width, by the family's sizing rule
            assert ours.feed_forward.w1.weight.shape == theirs.feed_forward.w1.weight.shape
    conv = next(layer.conv for layer in model.model.layers if hasattr(layer, "conv"))
    assert conv.conv.weight.shape == (cfg.hidden_size, 1, cfg.conv_L_cache)
    assert (conv.in_proj.bias is None) == (not cfg.conv_bias)
    tied = model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings


@pytest.mark.parametrize("backend", ["native", "torch"])
def test_bfloat16_model_is_as_close_to_float32_as_transformers_bfloat16(checkpoint, backend):
    """bfloat16 weights, activations and conv states, on the native conv kernel (float32 math,
    bfloat16 states read and written in place, the result rounded once) and on the PyTorch
    ops: prefill logits stay as close to the float32 model's as transformers' own bfloat16
    model's are, by the median over positions."""
    if backend == "native" and native.library() is None:
        pytest.skip("no native kernels here (no C compiler)")
    folder, hf = checkpoint
    # eager experts: transformers' grouped_mm refuses the odd model's bf16 expert strides
    hf16 = type(hf).from_pretrained(
        str(folder), dtype=torch.bfloat16, experts_implementation="eager"
    )
    ids = prompts(VOCAB, [37], seed=7)[0]
    engine = Engine(str(folder), dtype="bfloat16", kernel_block_size=8, state_backend=backend)
    assert {g.backend for g in engine.plan.groups if g.kind == "short_conv"} == {backend}
    check_bf16_as_close_as_transformers(engine, hf, hf16, ids)


def test_the_dense_width_follows_lfm2s_sizing_rule():
    from transformers import Lfm2Config as HFLfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2MLP

    from hybridkv.models.lfm2 import Lfm2Config

    for keys in (
        {},
        {"block_ffn_dim_multiplier": 1.5, "block_multiple_of": 48},
        {"block_ffn_dim_multiplier": 0.75, "block_multiple_of": 32},
        {"block_auto_adjust_ff_dim": False},
        {"block_ff_dim": 1000, "intermediate_size": 5},
    ):
        theirs = Lfm2MLP(
            HFLfm2Config(hidden_size=64, num_attention_heads=8, **keys)
        ).w1.weight.shape[0]
        ours = Lfm2Config.from_hf({"hidden_size": 64, "num_attention_heads": 8, **keys}).ff_dim
        assert ours == theirs, keys


def test_per_expert_and_in_memory_names_both_load(checkpoint, tmp_path):
    """save_pretrained writes one tensor per expert (w1 / w3 / w2); a checkpoint written from
    the model's own state dict (stacked experts) loads the same."""
    from safetensors.torch import load_file, save_file

    folder, hf = checkpoint
    if hf.config.model_type != "lfm2_moe":
        pytest.skip("no experts")
    saved = load_file(str(folder / "model.safetensors"))
    assert any(".feed_forward.experts.0.w1.weight" in k for k in saved)
    copy = tmp_path / "in-memory-names"
    shutil.copytree(folder, copy)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert any(k.endswith("feed_forward.experts.gate_up_proj") for k in state)
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    asks = prompts(VOCAB, [13, 30], seed=3)
    ref, _ = reference_greedy(hf, asks, 5)
    assert engine_greedy(Engine(str(copy), dtype="float32", kernel_block_size=8), asks, 5) == ref


def test_bad_configs_are_one_line(tmp_path):
    base = {"architectures": ["Lfm2ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 4,
            "num_attention_heads": 16, "num_key_value_heads": 6, "vocab_size": VOCAB}  # fmt: skip
    bad = [
        ({}, "must be a multiple of num_key_value_heads"),
        ({"num_key_value_heads": 8, "num_attention_heads": 24}, "hidden_size .64. must be a"),
        ({"num_key_value_heads": 8, "conv_L_cache": 1}, "conv_L_cache must be at least 2"),
        ({"num_key_value_heads": 8, "layer_types": ["conv"] * 3}, "layer_types has 3 entries"),
        ({"num_key_value_heads": 8, "layer_types": ["conv", "mamba", "conv", "conv"]},
         "unknown layer type"),
        ({"num_key_value_heads": 8, "architectures": ["Lfm2MoeForCausalLM"],
          "num_experts_per_tok": 40}, "is more than num_experts"),
    ]  # fmt: skip
    check_config_errors(tmp_path, base, bad)


def test_the_bundled_presets_plan_as_before(capsys):
    """LFM2-1.2B and LFM2-8B-A1B plan the groups and page size they had as plan-only
    families (the short conv state: [2048, 2] per layer)."""
    from hybridkv.entrypoints.cli import main as cli_main

    for preset, groups in (
        ("LiquidAI/LFM2-1.2B", [[0, 3, 6, 9, 13], [1, 4, 7, 11, 15], [2, 5, 8, 10, 12, 14]]),
        ("LiquidAI/LFM2-8B-A1B", [[0, 4, 8, 12, 16, 20], [1, 5, 9, 13, 17, 22],
                                  [3, 7, 11, 15, 19, 23], [2, 6, 10, 14, 18, 21]]),
    ):  # fmt: skip
        assert cli_main(["plan", "--model", preset, "--json", "--platform", "cuda"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["page_tokens"] == 16
        assert [g["layer_ids"] for g in plan["groups"]] == groups
        conv = [g["spec"] for g in plan["groups"] if g["spec"]["kind"] == "short_conv"]
        assert all(tuple(s["tensors"][0]["shape"]) == (2048, 2) for s in conv)
