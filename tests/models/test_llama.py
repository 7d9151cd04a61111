"""Llama (llama3 rope, biases, tied embeddings) and Qwen3 (q/k norm, head_dim != hidden/heads,
optionally sliding-window layers) against transformers.

The sliding variant has 2 full + 2 sliding layers (window 12, shorter than most prompts), so
the plan holds a full-attention group next to sliding ones.
"""

import pytest

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import (
    save_model,
    seeded,
)

# checkpoints whose decode steps must be captured (test_captured_decode_equals_eager)
CAPTURED = ("llama3", "qwen3", "qwen3-sliding")

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


def test_prefill_logits_match(checkpoint):
    folder, hf = checkpoint
    engine = check_prefill_logits(folder, hf)
    ours = dict(engine.model.named_parameters(remove_duplicate=False))
    assert set(hf.state_dict()) <= set(ours), "checkpoint tensors the model does not load"
    tied = engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert tied == hf.config.tie_word_embeddings
    windows = [layer.self_attn.attn.sliding_window for layer in engine.model.model.layers]
    assert windows == [
        hf.config.sliding_window if kind == "sliding_attention" else None
        for kind in getattr(hf.config, "layer_types", None) or ["full_attention"] * len(windows)
    ]
    # (the 37-token prompt of check_prefill_logits is longer than the sliding window, 12)
