"""Kimi-Linear (KDA + MLA without RoPE, grouped-sigmoid MoE) against transformers'
KimiLinearForCausalLM with the same tiny seeded weights, on every cache setting of
`conformance.CASES`.

Tiny models: 2 KDA heads of 16, MLA with 4 heads (latent 24, nope 8, shared un-rotated key 4,
value 8), 4 experts in 2 groups; A_log, dt_bias and the norms drawn at random so that the
decays and gates are not at their initial values.
"""

from __future__ import annotations

import json

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.kv.specs import kda_state
from hybridkv.models.kimi_linear import KimiLinearConfig
from hybridkv.ops import native

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
    test_kernel_blocks_of_64,
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

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=24,
    q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
    num_experts=4, num_experts_per_token=2, num_expert_group=2, topk_group=1,
    linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                        "full_attn_layers": [2], "kda_layers": [1, 3, 4]},
    initializer_range=0.1, model_max_length=512, pad_token_id=0, bos_token_id=1,
    eos_token_id=2,
)  # fmt: skip


def _randomise(hf, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1.0)
            elif "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2 + 1.0)
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)


def _base():
    return dict(COMMON, first_k_dense_replace=1)


def _lora_dense_two():
    """q LoRA, the first two layers dense, MLA on the last layer, kernel 3."""
    linear = dict(COMMON["linear_attn_config"], full_attn_layers=[4], kda_layers=[1, 2, 3],
                  short_conv_kernel_size=3)  # fmt: skip
    return dict(COMMON, q_lora_rank=12, first_k_dense_replace=2, linear_attn_config=linear,
                n_shared_experts=2, routed_scaling_factor=1.5)  # fmt: skip


BUILDERS = {"kimi_linear": _base, "kimi_linear_lora": _lora_dense_two}
# decode steps captured on the CPU (KDA gates and output norm, MLA natively)
CAPTURED = ("kimi_linear", "kimi_linear_lora")
CAPTURED_BF16 = CAPTURED
# seeds whose greedy tokens keep a top-2 logit margin above conformance.MIN_MARGIN
SEEDS = {"kimi_linear": 3, "kimi_linear_lora": 4}


def build(tmp_path_factory, name: str, seed: int = 0):
    from transformers import KimiLinearConfig as HFKimiLinearConfig
    from transformers import KimiLinearForCausalLM

    hf = seeded(KimiLinearForCausalLM, HFKimiLinearConfig(**BUILDERS[name]()), seed=seed)
    _randomise(hf, seed)
    return save_model(hf, tmp_path_factory.mktemp(name)), hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, SEEDS.get(request.param, 0))


def test_prefill_logits_match(checkpoint):
    engine = check_prefill_logits(*checkpoint)
    kinds = sorted({g.spec.kind for g in engine.plan.groups})
    assert kinds == ["kda", "mla"]


def test_the_checkpoint_config_reads_as_transformers_reads_it():
    """linear_attn_config (1-based layer lists, KDA sizes) over the top-level keys."""
    cfg = KimiLinearConfig.from_hf(dict(COMMON, linear_num_heads=7, linear_head_dim=5))
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention",
                               "linear_attention")  # fmt: skip
    assert (cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim) == (2, 16, 4)
    assert cfg.mlp_layer_types == ("dense", "sparse", "sparse", "sparse")
    default = KimiLinearConfig.from_hf({"num_hidden_layers": 9})
    assert [i for i, t in enumerate(default.layer_types) if t == "full_attention"] == [4, 8]


def test_real_config_declares_the_plan_only_specs():
    from hybridkv.kv.presets import load_preset
    from hybridkv.kv.specs import CacheDtypes, MLASpec
    from hybridkv.models.registry import declared_cache_layers

    config = load_preset("moonshotai/Kimi-Linear-48B-A3B-Instruct")
    dt = CacheDtypes("bfloat16", "bfloat16", "float32")
    layers = declared_cache_layers(config, dt)
    mla = [c.layer_index for c in layers if isinstance(c.spec, MLASpec)]
    assert mla == [3, 7, 11, 15, 19, 23, 26]
    kda = [c.spec for c in layers if not isinstance(c.spec, MLASpec)]
    assert len(kda) == 20
    want = kda_state(32, 128, 4, "bfloat16", "float32")
    assert all((s.kind, s.tensors) == (want.kind, want.tensors) for s in kda)
    assert all(c.spec == MLASpec(512, 64, "bfloat16") for c in layers if c.layer_index in mla)


def test_bad_configs_are_one_line(tmp_path):
    base = {"architectures": ["KimiLinearForCausalLM"], **COMMON}
    bad = [
        ({"num_key_value_heads": 2}, "num_key_value_heads .2. must be more than half of "
         "num_attention_heads .4."),
        ({"num_key_value_heads": 0}, "num_key_value_heads .0. must be more than half"),
        ({"num_experts": 5}, "must be a multiple of num_expert_group"),
        ({"topk_group": 3}, "topk_group .3. must be at most num_expert_group"),
        ({"linear_attn_config": dict(COMMON["linear_attn_config"], kda_layers=[1, 3])},
         "lists no mixer for layers \\[4\\]"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ]  # fmt: skip
    check_config_errors(tmp_path, base, bad)


@pytest.mark.parametrize("kv_heads", [3, 5, 8, None])
def test_num_key_value_heads_read_as_transformers_reads_it(kv_heads, tmp_path_factory):
    """MLA keeps keys and values per query head, so num_key_value_heads changes no weight;
    transformers' attention repeats them heads // kv_heads times: 1 (kv 3 of 4 heads) or 0
    (kv 5, 8: its default SDPA path skips the repeat) leave the math of kv == heads, and
    hybridkv's prefill logits and greedy tokens are transformers' (None: heads, its default).
    Half the heads or fewer (2 or more repeats) fail in transformers and are refused (above)."""
    from transformers import KimiLinearConfig as HFKimiLinearConfig
    from transformers import KimiLinearForCausalLM

    config = HFKimiLinearConfig(**dict(_base(), num_key_value_heads=kv_heads))
    assert config.num_key_value_heads == (4 if kv_heads is None else kv_heads)
    hf = seeded(KimiLinearForCausalLM, config, seed=3)
    _randomise(hf, 3)
    assert hf.config._attn_implementation == "sdpa"
    folder = save_model(hf, tmp_path_factory.mktemp(f"kv{kv_heads}"))
    engine = check_prefill_logits(folder, hf, length=13)
    asks = prompts(VOCAB, [7, 12], seed=2)
    want, _ = reference_greedy(hf, asks, 4)
    assert engine_greedy(engine, asks, 4) == want


def test_bfloat16_state_runs_close_to_float32(checkpoint):
    folder, hf = checkpoint
    asks = prompts(VOCAB, [19, 7], seed=5)
    ref, _ = reference_greedy(hf, asks, 4)
    engine = Engine(str(folder), dtype="float32", ssm_state_dtype="bfloat16", kernel_block_size=8)
    state = next(g for g in engine.plan.state_groups)
    assert {t.name: t.dtype for t in state.spec.tensors}["recurrent"] == "bfloat16"
    got = engine_greedy(engine, asks, 4)
    same = sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 6


def test_bfloat16_model_is_as_close_to_float32_as_transformers_bfloat16(checkpoint):
    """bfloat16 weights, activations and states on the native ops (the KDA rule's kernel takes
    bfloat16; the convs run in PyTorch for bfloat16): prefill logits as close to the float32
    model's as transformers' own bfloat16 model's, by the median over positions."""
    folder, hf = checkpoint
    hf16 = type(hf).from_pretrained(
        str(folder), dtype=torch.bfloat16, experts_implementation="eager"
    )
    engine = Engine(str(folder), dtype="bfloat16", kernel_block_size=8)
    if native.library() is not None:
        assert {type(o).__name__ for o in engine.runner.state_ops.values()} == {"NativeKdaOps"}
    check_bf16_as_close_as_transformers(engine, hf, hf16, prompts(VOCAB, [37], seed=7)[0])


@pytest.mark.triton  # device "auto": on a GPU when there is one, else interpreted on the CPU
def test_engine_on_the_triton_ops_matches_transformers(tmp_path_factory, monkeypatch):
    """A CUDA plan (the interpreter stands in for the GPU): the KDA groups take the "triton"
    ops, and their decode steps run the Triton KDA kernel."""
    from hybridkv import engine as engine_module
    from hybridkv.ops import triton_kda

    monkeypatch.setattr(engine_module, "_capabilities", lambda *a: frozenset({"triton"}))
    calls = {"rule": 0}
    real = triton_kda.kda_decode

    def counted(*args):
        calls["rule"] += 1
        return real(*args)

    monkeypatch.setattr(triton_kda, "kda_decode", counted)
    folder, hf = build(tmp_path_factory, "kimi_linear")
    # float32 MLA: FlashMLA (the cuda default) takes half types only; the Triton backend runs it
    engine = Engine(str(folder), dtype="float32", platform="cuda", kernel_block_size=16,
                    max_num_batched_tokens=24, attention_backend="triton")  # fmt: skip
    assert {type(o).__name__ for o in engine.runner.state_ops.values()} == {"TritonKdaOps"}
    asks = prompts(VOCAB, [37, 5], seed=6)
    ref, _ = reference_greedy(hf, asks, 5)
    assert engine_greedy(engine, asks, 5) == ref
    assert calls["rule"]


def test_config_json_keeps_the_checkpoint_spelling(checkpoint):
    folder, _ = checkpoint
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["KimiLinearForCausalLM"]
    assert "num_experts" in saved  # transformers writes its attribute_map names back
