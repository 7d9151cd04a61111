"""Llama (llama3 rope, biases, tied embeddings) and Qwen3 (q/k norm, head_dim != hidden/heads,
optionally sliding-window layers) against transformers.

The sliding variant has 2 full + 2 sliding layers (window 12, shorter than most prompts). With
1 full + 3 sliding layers the plan has 4 groups and the `preempt` case's 14 pages cannot hold a
64-token prompt prefilled in one step, so the scheduler rightly aborts it as too large.
"""

import pytest

from hybridkv.engine import Engine

from .conformance import CASES, check_case, make_family
from .utils import (
    engine_prefill_logits,
    max_rel_error,
    prompts,
    reference_logits,
    save_model,
    seeded,
)

VOCAB = 96
# head_dim 16: wavelengths 6 .. 2e4 tokens hit the kept, blended and slowed bands of llama3
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True,
        rope_parameters=LLAMA3_ROPE, rms_norm_eps=1e-5, initializer_range=0.1,
        max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    return seeded(LlamaForCausalLM, cfg)


def build_qwen3(sliding: bool):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0}, initializer_range=0.1,
        max_position_embeddings=512, tie_word_embeddings=False,
        use_sliding_window=sliding, sliding_window=12, max_window_layers=2,
    )  # fmt: skip
    model = seeded(Qwen3ForCausalLM, cfg)
    # q_norm / k_norm start at ones: give them random weights so a skipped norm shows up
    for name, param in model.named_parameters():
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.data.uniform_(0.5, 1.5)
    return model


BUILDERS = {
    "llama3": build_llama,
    "qwen3": lambda: build_qwen3(sliding=False),
    "qwen3-sliding": lambda: build_qwen3(sliding=True),
}


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    hf = BUILDERS[request.param]()
    return save_model(hf, tmp_path_factory.mktemp(request.param)), hf


@pytest.fixture(scope="module")
def family(checkpoint):
    folder, hf = checkpoint
    return make_family(folder, hf, VOCAB)


def test_prefill_logits_match(checkpoint):
    folder, hf = checkpoint
    engine = Engine(str(folder), dtype="float32", kernel_block_size=4, enable_prefix_caching=False)
    ours = dict(engine.model.named_parameters(remove_duplicate=False))
    assert set(hf.state_dict()) <= set(ours), "checkpoint tensors the model does not load"
    tied = engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert tied == hf.config.tie_word_embeddings
    windows = [layer.self_attn.attn.sliding_window for layer in engine.model.model.layers]
    assert windows == [
        hf.config.sliding_window if kind == "sliding_attention" else None
        for kind in getattr(hf.config, "layer_types", None) or ["full_attention"] * len(windows)
    ]
    ids = prompts(VOCAB, [37])[0]  # longer than the sliding window (12)
    assert max_rel_error(engine_prefill_logits(engine, ids), reference_logits(hf, ids)) <= 1e-4


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_greedy_matches_transformers(family, case):
    check_case(family, case)
