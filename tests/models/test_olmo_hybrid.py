"""OLMo Hybrid against transformers, on every cache setting of `conformance.CASES`.

Two tiny models: one with RoPE, grouped KV heads, 2 value heads per key head and beta in [0, 2]
(`linear_allow_neg_eigval`, the default); one as the released checkpoints are (no RoPE: rope
theta null), with 3 heads, the linear head sizes derived from the defaults (key 12, value 24),
beta in [0, 1] and tied embeddings. A_log, dt_bias and the norms are drawn at random so that
decays, gates and norms are not at their initial values.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import engine_greedy, prompts, reference_greedy, save_model, seeded

VOCAB = 96
NO_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # defaults exceed VOCAB


def _randomise(hf, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


def _rope_gqa():
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        initializer_range=0.1, max_position_embeddings=512, **NO_IDS,
    )  # fmt: skip


def _nope_derived_heads():
    from transformers import OlmoHybridConfig

    return OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=5,
        num_attention_heads=3, linear_allow_neg_eigval=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": None},
        layer_types=["linear_attention", "full_attention", "linear_attention",
                     "linear_attention", "full_attention"],
        initializer_range=0.1, max_position_embeddings=512, **NO_IDS,
    )  # fmt: skip


BUILDERS = {"rope_gqa": _rope_gqa, "nope_derived_heads": _nope_derived_heads}
SEEDS = {"rope_gqa": 2}  # seeds whose greedy tokens keep a top-2 margin above MIN_MARGIN


def build(tmp_path_factory, name: str, seed: int = 0):
    from transformers import OlmoHybridForCausalLM

    hf = seeded(OlmoHybridForCausalLM, BUILDERS[name](), seed=seed)
    _randomise(hf, seed)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return save_model(hf, tmp_path_factory.mktemp(name)), hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, SEEDS.get(request.param, 0))


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_the_variants_are_what_they_claim(checkpoint):
    folder, hf = checkpoint
    engine = Engine(str(folder), dtype="float32", kernel_block_size=8)
    model = engine.runner.model
    gdn = next(m for m in model.modules() if type(m).__name__ == "GatedDeltaNet")
    if hf.config.linear_allow_neg_eigval:
        assert model.rotary is not None and gdn.beta_scale == 2.0
    else:
        assert model.rotary is None and gdn.beta_scale == 1.0
        assert (gdn.head_k_dim, gdn.head_v_dim) == (12, 24)  # derived as transformers does


def test_bad_head_counts_are_one_line(tmp_path):
    import json

    config = {"architectures": ["OlmoHybridForCausalLM"], "hidden_size": 64,
              "num_attention_heads": 4, "linear_num_key_heads": 3, "linear_num_value_heads": 4,
              "linear_key_head_dim": 8, "num_hidden_layers": 4, "vocab_size": VOCAB}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="must be a multiple of linear_num_key_heads") as err:
        Engine(str(tmp_path), dtype="float32")
    assert "\n" not in str(err.value)
    config.update(linear_num_key_heads=2, hidden_size=66, num_attention_heads=4)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="hidden_size .66. must be a multiple of") as err:
        Engine(str(tmp_path), dtype="float32")
    assert "\n" not in str(err.value)


def test_bfloat16_model_runs_close_to_transformers(checkpoint):
    """bfloat16 weights and activations (float32 recurrent state, as "auto" picks): most
    greedy tokens equal transformers' bfloat16 ones."""
    from transformers import OlmoHybridForCausalLM

    folder, _ = checkpoint
    hf = OlmoHybridForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    asks = prompts(VOCAB, [21, 9], seed=7)
    ref, _ = reference_greedy(hf, asks, 4)
    engine = Engine(str(folder), dtype="bfloat16", kernel_block_size=8)
    got = engine_greedy(engine, asks, 4)
    same = sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 6


def test_transformers_in_memory_names_load_too(checkpoint, tmp_path):
    """A checkpoint written from the model's own state dict (one fused conv1d, the
    input_layernorm / post_attention_layernorm names) loads as the converted one does."""
    import shutil

    from safetensors.torch import save_file

    folder, hf = checkpoint
    copy = tmp_path / "in-memory-names"
    shutil.copytree(folder, copy)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert any(k.endswith("linear_attn.conv1d.weight") for k in state)
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    asks = prompts(VOCAB, [13, 30], seed=3)
    ref, _ = reference_greedy(hf, asks, 5)
    assert engine_greedy(Engine(str(copy), dtype="float32", kernel_block_size=8), asks, 5) == ref
