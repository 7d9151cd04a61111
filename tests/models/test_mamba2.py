"""Mamba2ForCausalLM (a pure state model: no attention layer) against transformers, on every
cache setting of `conformance.CASES`.

Two tiny models: one with every config key at transformers' default but the sizes (8 groups,
residual in float32, conv bias, no projection bias); one with an odd head count (5 heads, one
group), projection biases, no conv bias, a dt limit and the residual in the model dtype.
A_log, dt_bias, D and the norms are drawn at random so that decays, gates and norms are not at
their initial values.
"""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.models.hf_config import ConfigError
from hybridkv.models.mamba2 import Mamba2Config

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import engine_greedy, prompts, reference_greedy, save_model, seeded

# checkpoints whose decode steps must be captured (test_captured_decode_equals_eager)
CAPTURED = ("defaults", "odd_heads")
CAPTURED_BF16 = CAPTURED  # (float32 residuals converted and added natively too)

VOCAB = 96


def _randomise(hf, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


def _defaults():
    from transformers import Mamba2Config as HFMamba2Config

    return HFMamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_heads=16, head_dim=8,
        state_size=16, chunk_size=16, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


def _odd_heads():
    from transformers import Mamba2Config as HFMamba2Config

    return HFMamba2Config(
        vocab_size=VOCAB, hidden_size=40, num_hidden_layers=2, num_heads=5, head_dim=24,
        expand=3, state_size=8, n_groups=1, conv_kernel=3, chunk_size=8, use_bias=True,
        use_conv_bias=False, residual_in_fp32=False, time_step_limit=(0.01, 2.0),
        tie_word_embeddings=True, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip


BUILDERS = {"defaults": _defaults, "odd_heads": _odd_heads}
SEEDS: dict[str, int] = {}  # seeds whose greedy tokens keep a top-2 margin above MIN_MARGIN


def transformers_norms_groups() -> bool:
    """transformers' Mamba2 normalises the gated norm per group of n_groups, as mamba_ssm and
    hybridkv do. Older releases (5.17, the GPU image's) normalise the whole intermediate vector
    at once: with n_groups > 1 their logits are another model's, no reference."""
    from transformers.models.mamba2 import modeling_mamba2

    return hasattr(modeling_mamba2, "Mamba2RMSNormGated")


def build(tmp_path_factory, name: str, seed: int = 0):
    from transformers import Mamba2ForCausalLM

    hf = seeded(Mamba2ForCausalLM, BUILDERS[name](), seed=seed)
    _randomise(hf, seed)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return save_model(hf, tmp_path_factory.mktemp(name)), hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, SEEDS.get(request.param, 0))


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_plan_has_no_attention(checkpoint):
    """One state per page, page_tokens the hash block, hits in multiples of it."""
    engine = Engine(str(checkpoint[0]), dtype="float32", page_tokens=32)
    plan = engine.plan
    assert not plan.attention_groups and plan.state_groups
    assert plan.attention_bytes_per_token == 0
    assert plan.page_bytes >= plan.state_bytes and plan.page_bytes % 64 == 0
    assert plan.hash_block_tokens == plan.hit_tokens == 32


def test_prefix_hits_on_snapshots(checkpoint):
    """The next turn (prompt + answer + more) hits the first request's rolling tail snapshot,
    at a multiple of page_tokens, and still generates transformers' tokens."""
    folder, hf = checkpoint
    first = prompts(VOCAB, [45], seed=5)
    answer, _ = reference_greedy(hf, first, 4)
    second = [first[0] + answer[0] + prompts(VOCAB, [11], seed=6)[0]]
    ref, _ = reference_greedy(hf, second, 8)
    engine = Engine(str(folder), dtype="float32", page_tokens=16)
    assert engine_greedy(engine, first, 4) == answer
    hits = engine.cache.stats.hit_tokens
    assert engine_greedy(engine, second, 8) == ref
    # 45 + 3 tokens computed: the tail snapshot at 48
    assert engine.cache.stats.hit_tokens - hits == 48
    engine.cache.check_integrity()


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"num_heads": 6}, "hidden_size \\* expand"),
        ({"n_groups": 3}, "multiple of n_groups"),
        ({"hidden_act": "gelu"}, "hidden_act must be silu"),
    ],
)
def test_bad_config(changes, match):
    base = _defaults().to_dict()
    with pytest.raises(ConfigError, match=match):
        Mamba2Config.from_hf({**base, **changes})
