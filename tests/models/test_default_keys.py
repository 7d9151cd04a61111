"""Checkpoints whose config.json leaves out every key at its transformers default load as
transformers reads them, token for token.

Each tiny model keeps a default that differs from what the config's other keys would suggest,
where the two used to disagree: Nemotron-H `n_groups` (default 8, not 1), Qwen3 `head_dim`
(default 128, not hidden / heads), GraniteMoeHybrid `num_local_experts` (default 8: MoE, not
dense), Bamba `num_key_value_heads` (default 8), Llama `num_key_value_heads` (default: heads).
"""

from __future__ import annotations

import json

import pytest

from hybridkv.engine import Engine

from .conformance import MIN_MARGIN, check_prefill_logits
from .utils import engine_greedy, prompts, reference_greedy, save_model, seeded

VOCAB = 96


def nemotron_h():
    from transformers import NemotronHConfig, NemotronHForCausalLM

    return NemotronHForCausalLM, NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern="M*M-", num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=48, mamba_num_heads=8,
        mamba_head_dim=16, ssm_state_size=8, chunk_size=16, time_step_min=0.05,
        initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip  (n_groups: the default 8)


def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM, Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1,
        max_position_embeddings=512,
    )  # fmt: skip  (head_dim: the default 128)


def granite():
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    return GraniteMoeHybridForCausalLM, GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba"], mamba_n_heads=8, mamba_d_state=8,
        mamba_chunk_size=16, initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip  (num_local_experts: the default 8; mamba_d_head: "auto")


def bamba():
    from transformers import BambaConfig, BambaForCausalLM

    return BambaForCausalLM, BambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=8, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_state=8,
        mamba_chunk_size=16, initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip  (num_key_value_heads: the default 8)


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM, LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip  (num_key_value_heads: None, so the heads)


def qwen3_next():
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM, Qwen3NextConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=48, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip  (head_dim 256, 16 key / 32 value heads of 128, partial rotary 0.25)


FAMILIES = {"nemotron_h": nemotron_h, "qwen3": qwen3, "granite": granite, "bamba": bamba,
            "llama": llama, "qwen3_next": qwen3_next}  # fmt: skip


def strip_defaults(folder, config_class) -> list[str]:
    """Delete from config.json every key whose value is transformers' default."""
    path = folder / "config.json"
    saved = json.loads(path.read_text())
    defaults = config_class().to_dict()
    keep = {"architectures", "model_type"}
    dropped = [k for k, v in saved.items() if k not in keep and k in defaults and v == defaults[k]]
    path.write_text(json.dumps({k: v for k, v in saved.items() if k not in dropped}))
    return dropped


@pytest.fixture(scope="module", params=list(FAMILIES))
def stripped(request, tmp_path_factory):
    cls, cfg = FAMILIES[request.param]()
    hf = seeded(cls, cfg)
    folder = save_model(hf, tmp_path_factory.mktemp(f"defaults-{request.param}"))
    dropped = strip_defaults(folder, type(cfg))
    return request.param, folder, hf, dropped


def test_the_telling_defaults_are_left_out(stripped):
    name, _, _, dropped = stripped
    telling = {"nemotron_h": "n_groups", "qwen3": "head_dim", "granite": "num_local_experts",
               "bamba": "num_key_value_heads", "llama": "vocab_size",
               "qwen3_next": "linear_num_value_heads"}  # fmt: skip
    if name == "llama":  # num_key_value_heads is written (as the heads); its default is None
        assert "num_key_value_heads" not in dropped
    else:
        assert telling[name] in dropped
    assert "hidden_size" not in dropped  # what differs from the defaults stays


def test_prefill_logits_and_greedy_tokens_match_transformers(stripped):
    _, folder, hf, _ = stripped
    check_prefill_logits(folder, hf, length=21)
    asks = prompts(VOCAB, [9, 17], seed=3)
    ref, margin = reference_greedy(hf, asks, 6)
    assert margin > MIN_MARGIN
    engine = Engine(str(folder), dtype="float32", kernel_block_size=8)
    assert engine_greedy(engine, asks, 6) == ref
