"""DeepSeek-V3 against transformers: multi-head latent attention over the paged latent cache
(prefill expanded, decode in latent space), grouped sigmoid routing with the score-correction
bias, shared experts, the first layers dense.

Two tiny variants, every other key at transformers' default:
- "default": q LoRA, interleaved RoPE, 16 experts in 8 groups (transformers' n_group 8,
  topk_group 4, 8 experts per token), first 3 layers dense (of 4);
- "odd": 3 heads, no q LoRA (plain q_proj), RoPE over halves, YaRN with mscale_all_dim (the
  softmax-scale correction), attention biases, 2 groups of 3 experts, first layer dense.
The router's correction bias and the norms get random values (transformers starts them at
zero / one), so a missing bias shows in the logits.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.kv.specs import ConfigError, MLASpec
from hybridkv.models.deepseek_v3 import DeepseekV3Config

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
    test_kernel_blocks_of_64,
)
from .utils import (
    check_bf16_as_close_as_transformers,
    engine_greedy,
    prompts,
    save_model,
    seeded,
)

VOCAB = 96


def _randomise(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


def build_default():
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM as HFModel

    cfg = HFConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, n_routed_experts=16, kv_lora_rank=32,
        q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=12, qk_nope_head_dim=16,
        initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip
    model = seeded(HFModel, cfg, seed=2)
    _randomise(model, 5)
    return model


def build_odd():
    from transformers import DeepseekV3Config as HFConfig
    from transformers import DeepseekV3ForCausalLM as HFModel

    rope = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 64, "beta_fast": 8.0,
        "beta_slow": 1.0,
    }  # fmt: skip
    cfg = HFConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=3, n_routed_experts=6, n_group=2,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=2, first_k_dense_replace=1,
        kv_lora_rank=20, q_lora_rank=None, qk_rope_head_dim=6, v_head_dim=10,
        qk_nope_head_dim=14, rope_interleave=False, attention_bias=True, rope_parameters=rope,
        initializer_range=0.12, max_position_embeddings=256, norm_topk_prob=False,
        routed_scaling_factor=1.5,
    )  # fmt: skip
    model = seeded(HFModel, cfg, seed=5)
    _randomise(model, 8)
    return model


def build_v2():
    """DeepSeek-V2: softmax routing limited to the best groups, no q LoRA (V2-Lite's shape),
    biased dense and shared MLPs, the first layer dense."""
    from transformers import DeepseekV2Config as HFConfig
    from transformers import DeepseekV2ForCausalLM as HFModel

    cfg = HFConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, moe_intermediate_size=12,
        num_hidden_layers=3, num_attention_heads=4, n_routed_experts=8, n_group=4,
        topk_group=2, num_experts_per_tok=3, topk_method="group_limited_greedy",
        first_k_dense_replace=1, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=12, qk_nope_head_dim=8, mlp_bias=True, routed_scaling_factor=2.0,
        initializer_range=0.12, max_position_embeddings=256,
    )  # fmt: skip
    model = seeded(HFModel, cfg, seed=V2_SEED)
    _randomise(model, V2_SEED + 3)
    return model


V2_SEED = 0
BUILDERS = {"default": build_default, "odd": build_odd, "v2": build_v2}
# decode steps captured on the CPU (MLA: RoPE, cache write and absorbed decode natively)
CAPTURED = ("default", "odd", "v2")
CAPTURED_BF16 = CAPTURED


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    hf = BUILDERS[request.param]()
    return save_model(hf, tmp_path_factory.mktemp(request.param)), hf


def test_prefill_logits_match(checkpoint):
    folder, hf = checkpoint
    engine = check_prefill_logits(folder, hf)
    ours = dict(engine.model.named_parameters()) | dict(engine.model.named_buffers())
    assert set(hf.state_dict()) == set(ours), "checkpoint and model tensors differ"
    cfg = hf.config
    specs = {g.spec for g in engine.plan.attention_groups}
    assert specs == {MLASpec(cfg.kv_lora_rank, cfg.qk_rope_head_dim, "float32")}
    assert {g.kind for g in engine.plan.groups} == {"mla"}


def test_softmax_scale_has_the_yarn_correction():
    hf = build_odd()
    ours = DeepseekV3Config.from_hf(hf.config.to_dict())
    assert ours.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    assert ours.softmax_scale != pytest.approx(ours.qk_head_dim**-0.5)


def test_defaults_follow_transformers():
    cfg = DeepseekV3Config()
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.q_lora_rank) == (512, 64, 1536)
    assert (cfg.n_group, cfg.topk_group, cfg.first_k_dense_replace) == (8, 4, 3)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"n_routed_experts": 12}, "multiple of n_group"),
        ({"topk_group": 9}, "at most n_group"),
        ({"num_experts_per_tok": 200}, "at most the experts of topk_group"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"qk_rope_head_dim": 7}, "must be even"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "unsupported rope type"),
    ],
)
def test_bad_configs_fail_in_one_line(keys, message):
    with pytest.raises(ConfigError, match=message) as info:
        DeepseekV3Config.from_hf(keys)
    assert "\n" not in str(info.value)


def test_triton_backend_matches_transformers(family):  # noqa: F811 (the conformance fixture)
    """The Triton MLA decode (interpreted without a GPU) over kernel blocks of 64, FlashMLA's
    size, two to a page: chunked prefill of 13 tokens, then decodes, against transformers'
    greedy tokens."""
    engine = Engine(
        str(family.folder), dtype="float32", attention_backend="triton", kernel_block_size=64,
        page_tokens=128, max_num_batched_tokens=13,
    )  # fmt: skip
    assert {(g.runner, g.kernel_block_size) for g in engine.plan.attention_groups} == {
        ("triton", 64)
    }
    assert engine_greedy(engine, family.plain[:3], 8) == [t[:8] for t in family.plain_ref[:3]]


@pytest.mark.parametrize("chunk", [None, 1])
def test_bfloat16_is_as_close_as_transformers_own(chunk, tmp_path):
    """bfloat16 weights and latent cache: the expanded prefill (whole prompt) and the latent
    decode (one-token chunks: every position a decode row, on the native bf16 kernel) are as
    close to transformers' float32 logits as transformers' own bfloat16 model."""
    hf = build_default()
    folder = save_model(hf, tmp_path / "m")
    hf16 = build_default().to(torch.bfloat16)
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk, "max_num_seqs": 1}
    engine = Engine(str(folder), dtype="bfloat16", kernel_block_size=8, **kwargs)
    check_bf16_as_close_as_transformers(engine, hf, hf16, prompts(VOCAB, [37], seed=7)[0])
