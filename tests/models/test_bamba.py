import pytest

from hybridkv.models.bamba import BambaConfig

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
CAPTURED = ("half", "quarter")

VOCAB = 96
# "half": transformers' default (partial_rotary_factor 0.5 written into rope_parameters), untied
# lm_head; "quarter": an explicit factor 0.25 with another rope_theta, tied embeddings.
VARIANTS = {
    "half": dict(tie_word_embeddings=False),
    "quarter": dict(
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 500.0,
            "partial_rotary_factor": 0.25,
        },
    ),
}


def build(tmp_path_factory, variant: str):
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
        mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=8, mamba_n_groups=1,
        mamba_chunk_size=16, initializer_range=0.1, max_position_embeddings=512,
        **VARIANTS[variant],
    )  # fmt: skip
    hf = seeded(BambaForCausalLM, cfg)
    folder = save_model(hf, tmp_path_factory.mktemp(f"bamba-{variant}"))
    return folder, hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param)


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_partial_rotary_factor_sources():
    def factor(**keys):
        return BambaConfig.from_hf({"hidden_size": 4096, "num_attention_heads": 32, **keys})

    assert factor().rotary_factor == 0.5  # transformers' BambaConfig default
    assert factor(attn_rotary_emb=32).rotary_factor == 0.25  # pre-5 checkpoints (head dim 128)
    rope = {"rope_theta": 1e4, "partial_rotary_factor": 1.0}
    assert factor(attn_rotary_emb=32, rope_parameters=rope).rotary_factor == 1.0
