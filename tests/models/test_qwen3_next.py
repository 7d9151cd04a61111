"""Qwen3-Next and Qwen3.5 (dense, MoE, and the text part of a ForConditionalGeneration
checkpoint) against transformers, on every cache setting of `conformance.CASES`.

Tiny models: 4 key heads of 16 for 8 value heads of 8 (each key head serves 2 value heads),
3 gated-delta-net layers to 1 gated attention layer (head_dim 16, partial RoPE), MoE where the
family has it; A_log, dt_bias and the norms drawn at random so that the decays and gates are
not at their initial values.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from hybridkv.engine import Engine

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import (
    engine_greedy,
    prompts,
    reference_greedy,
    save_model,
    save_tokenizer,
    seeded,
)

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_num_key_heads=2, linear_num_value_heads=4, initializer_range=0.1,
    max_position_embeddings=512,
)  # fmt: skip
MOE = dict(moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=4,
           num_experts_per_tok=2)  # fmt: skip


def _randomise(hf, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(
                    torch.randn(p.shape, generator=g) * 0.2
                    + (1.0 if "linear_attn.norm" in name else 0.0)
                )


def _next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # MoE on layers 1 and 3 (decoder_sparse_step 2), layer 3 listed as dense: one MoE layer
    cfg = Qwen3NextConfig(**COMMON, **MOE, intermediate_size=48, decoder_sparse_step=2,
                          mlp_only_layers=[3])  # fmt: skip
    return Qwen3NextForCausalLM, cfg


def _next_dense_unnormalised():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    cfg = Qwen3NextConfig(**COMMON, **MOE, intermediate_size=48, norm_topk_prob=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                           "partial_rotary_factor": 0.5})  # fmt: skip
    return Qwen3NextForCausalLM, cfg


def _qwen3_5():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM, Qwen3_5TextConfig(**COMMON, intermediate_size=48)


def _qwen3_5_moe():
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    return Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**COMMON, **MOE)


# decode steps captured (float32, bfloat16): Qwen3.5 dense (its gates natively, `gdn_prep`);
# the MoE ones too (the native router and experts; the shared expert's sigmoid gate natively)
CAPTURED = ("qwen3_5", "qwen3_next", "qwen3_5_moe")
CAPTURED_BF16 = CAPTURED
BUILDERS = {
    "qwen3_next": _next,
    "qwen3_next_all_moe": _next_dense_unnormalised,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
}


def build(tmp_path_factory, name: str, seed: int = 0):
    cls, cfg = BUILDERS[name]()
    hf = seeded(cls, cfg, seed=seed)
    _randomise(hf, seed)
    return save_model(hf, tmp_path_factory.mktemp(name)), hf


# seeds whose greedy tokens keep a top-2 logit margin above conformance.MIN_MARGIN
SEEDS = {"qwen3_next_all_moe": 1}


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, SEEDS.get(request.param, 0))


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_conditional_generation_checkpoint_loads_its_text_model(tmp_path, caplog):
    """A Qwen3.5 checkpoint saved as Qwen3_5ForConditionalGeneration (vision tower and all)
    runs its text model; real checkpoints' mtp.* tensors are skipped with one log line."""
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    text = dict(COMMON, intermediate_size=48)
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=64)
    config = Qwen3_5Config(text_config=text, vision_config=vision)
    hf = seeded(Qwen3_5ForConditionalGeneration, config)
    _randomise(hf, 1)
    folder = tmp_path / "vl"
    hf.save_pretrained(folder)
    save_tokenizer(folder, VOCAB)
    weights = load_file(folder / "model.safetensors")
    weights["mtp.fc.weight"] = torch.zeros(4, 4)  # as real checkpoints carry
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    assert json.loads((folder / "config.json").read_text())["architectures"] == [
        "Qwen3_5ForConditionalGeneration"
    ]
    with caplog.at_level(logging.INFO, logger="hybridkv"):
        engine = Engine(str(folder), dtype="float32", kernel_block_size=8)
    assert "skipped 1 checkpoint tensors under 'mtp.'" in caplog.text
    assert "under 'model.visual.'" in caplog.text
    asks = prompts(VOCAB, [11, 23], seed=4)
    with torch.inference_mode():
        ref = []
        for ids in asks:  # the text model's own greedy tokens (full forwards)
            seq = list(ids)
            for _ in range(6):
                logits = hf(input_ids=torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            ref.append(seq[len(ids) :])
    assert engine_greedy(engine, asks, 6) == ref


def test_bad_head_counts_are_one_line(tmp_path):
    folder, _ = build_cfg(tmp_path, linear_num_key_heads=3)
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads") as err:
        Engine(str(folder), dtype="float32")
    assert "\n" not in str(err.value)


def build_cfg(tmp_path, **overrides):
    """A config.json whose values transformers itself would refuse to build a model from."""
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Qwen3NextForCausalLM"], **COMMON, **MOE, **overrides})
    )
    return tmp_path, None


def test_a_state_dtype_the_ops_cannot_take_is_one_line(checkpoint):
    folder, _ = checkpoint
    with pytest.raises(ValueError, match="state_dtype must be auto or one of") as err:
        Engine(str(folder), dtype="float32", state_dtype="fp8")
    assert "\n" not in str(err.value)


def test_bfloat16_state_runs_close_to_float32(checkpoint):
    folder, hf = checkpoint
    asks = prompts(VOCAB, [19, 7], seed=5)
    ref, _ = reference_greedy(hf, asks, 4)
    engine = Engine(str(folder), dtype="float32", ssm_state_dtype="bfloat16", kernel_block_size=8)
    state = next(g for g in engine.plan.state_groups)
    assert {t.name: t.dtype for t in state.spec.tensors}["recurrent"] == "bfloat16"
    got = engine_greedy(engine, asks, 4)
    assert (
        sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True)) >= 6
    )


@pytest.mark.triton  # device "auto": on a GPU when there is one, else interpreted on the CPU
def test_engine_on_the_triton_ops_matches_transformers(tmp_path_factory, monkeypatch):
    """A CUDA plan (the interpreter stands in for the GPU here): the gated-delta groups take the
    "triton" ops by declaration, and their decode steps run the Triton kernels of the rule and
    of the conv1d."""
    from hybridkv import engine as engine_module
    from hybridkv.ops import triton_gdn, triton_mamba

    monkeypatch.setattr(engine_module, "_capabilities", lambda *a: frozenset({"triton"}))
    calls: dict[str, int] = {"rule": 0, "conv": 0}

    def counted(name, real):
        def run(*args):
            calls[name] += 1
            return real(*args)

        return run

    monkeypatch.setattr(triton_gdn, "gdn_decode", counted("rule", triton_gdn.gdn_decode))
    monkeypatch.setattr(triton_mamba, "conv1d_decode", counted("conv", triton_mamba.conv1d_decode))
    folder, hf = build(tmp_path_factory, "qwen3_5")
    engine = Engine(
        str(folder), dtype="float32", platform="cuda", kernel_block_size=16,
        max_num_batched_tokens=24,
    )  # fmt: skip
    assert {g.backend for g in engine.plan.groups} == {"triton"}
    assert {type(o).__name__ for o in engine.runner.state_ops.values()} == {"TritonGDNOps"}
    asks = prompts(VOCAB, [37, 5], seed=6)
    ref, _ = reference_greedy(hf, asks, 5)
    assert engine_greedy(engine, asks, 5) == ref
    assert calls["rule"] and calls["conv"]  # the decode steps took the Triton kernels
