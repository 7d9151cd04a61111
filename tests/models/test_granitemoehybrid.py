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
CAPTURED = (0,)  # the dense checkpoint (MoE routing runs in PyTorch)

VOCAB = 96


def build(tmp_path_factory, experts: int):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
        num_local_experts=experts, num_experts_per_tok=2, position_embedding_type="rope",
        initializer_range=0.1, attention_multiplier=0.25, embedding_multiplier=2.0,
        residual_multiplier=0.7, logits_scaling=1.5 if experts else 0.5,
        max_position_embeddings=512, tie_word_embeddings=experts == 0,
    )  # fmt: skip
    hf = seeded(GraniteMoeHybridForCausalLM, cfg)
    folder = save_model(hf, tmp_path_factory.mktemp(f"granite{experts}"))
    return folder, hf


@pytest.fixture(scope="module", params=[4, 0], ids=["moe", "dense"])
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param)


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)
