import pytest
import torch

from .conformance import (  # noqa: F401
    NEW_TOKENS,
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import (
    engine_greedy,
    save_model,
    seeded,
)

# checkpoints whose decode steps must be captured (test_captured_decode_equals_eager)
CAPTURED = (0, 4)  # both (MoE: the native router and experts, on a CPU with AVX2)

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


def test_float32_moe_decode_is_captured_and_matches_transformers(family, request):  # noqa: F811
    """float32 MoE: the router and the experts are native kernels on a CPU with AVX2 (moe.c's
    hkv_moe_route, hkv_moe_experts), so the decode steps are captured and replayed, and the
    greedy tokens of 8 requests at once are still transformers'."""
    from hybridkv.engine import Engine
    from hybridkv.layers.linear import native_small_linear
    from hybridkv.ops.registry import capabilities

    if request.node.callspec.params["checkpoint"] == 0:
        pytest.skip("the dense checkpoint has no experts")
    if not {"native", "avx2"} <= capabilities("cpu") or not native_small_linear(torch.float32):
        pytest.skip("no AVX2 build here: the MoE runs in PyTorch, decode steps eagerly")
    engine = Engine(str(family.folder), dtype="float32")
    assert engine_greedy(engine, family.plain, NEW_TOKENS) == family.plain_ref
    graphs = engine.runner.graphs
    assert graphs.disabled is None, graphs.disabled
    assert graphs.replays > 0 and graphs.steps
