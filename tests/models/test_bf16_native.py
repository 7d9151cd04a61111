"""bfloat16 models on the native CPU kernels (issue 19): the plan picks them for bfloat16
states and activations, and the logits stay as close to transformers' float32 ones as
transformers' own bfloat16 model's are, through prefill chunks that each start from the
bfloat16 state the previous chunk left in its page."""

import pytest
import torch

from hybridkv.engine import Engine

from .utils import (
    check_bf16_as_close_as_transformers,
    engine_prefill_logits,
    position_errors,
    prompts,
    reference_logits,
    save_model,
    seeded,
)

VOCAB = 96


@pytest.fixture(scope="module")
def granite(tmp_path_factory):
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    # head_dim and d_state of 16: a prefill chunk of 8+ tokens takes the blocked scan;
    # initializer_range 0.5 makes the state matter: a chunk that started from zeros instead of
    # its state doubles the error (measured), where 0.1 hid it in bfloat16 noise
    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, shared_intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, layer_types=["mamba", "attention", "mamba"],
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2,
        mamba_chunk_size=16, num_local_experts=0, position_embedding_type="rope",
        initializer_range=0.5, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    hf = seeded(GraniteMoeHybridForCausalLM, cfg)
    folder = save_model(hf, tmp_path_factory.mktemp("granite-bf16"))
    return folder, hf


@pytest.mark.parametrize("chunk", [2048, 12])  # one prefill step; chunks from a bf16 state
def test_granite_bf16_native_state_ops_as_close_as_transformers(granite, chunk):
    from transformers import GraniteMoeHybridForCausalLM

    folder, hf32 = granite
    engine = Engine(
        str(folder), dtype="bfloat16", max_num_batched_tokens=chunk, enable_prefix_caching=False
    )
    assert {g.backend for g in engine.plan.state_groups} == {"native"}
    hf16 = GraniteMoeHybridForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    (ids,) = prompts(VOCAB, [41], seed=3)
    check_bf16_as_close_as_transformers(engine, hf32, hf16, ids)


def test_granite_bf16_native_as_accurate_as_torch_ops(granite):
    """The native kernels and the PyTorch reference ops on the same bfloat16 model (both keep
    a bfloat16 state; they round at different points, so their logits differ by bfloat16
    noise): measured against transformers in float32, native is no less accurate."""
    folder, hf32 = granite
    (ids,) = prompts(VOCAB, [37], seed=4)
    ref32 = reference_logits(hf32, ids)
    errors = {}
    for backend in ("native", "torch"):
        engine = Engine(
            str(folder), dtype="bfloat16", state_backend=backend, max_num_batched_tokens=10,
            enable_prefix_caching=False,
        )  # fmt: skip
        errors[backend] = position_errors(engine_prefill_logits(engine, ids), ref32).median()
    assert 0 < errors["native"] <= 1.1 * errors["torch"]
