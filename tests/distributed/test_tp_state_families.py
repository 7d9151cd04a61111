"""Tensor parallelism for the Mamba1, short-conv, Zamba2 and OLMo Hybrid families: 2 processes
over gloo give transformers' greedy tokens (and so TP=1's) on tiny models, among them cases
where a rule replicates (one KV head on both ranks, one Mamba2 group whose norm spans the
ranks); the per-rank state specs follow the size, and a size that does not divide is one line.

Spawning a rank costs seconds: one TP=2 engine per family, a few prompts each."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.entrypoints.cli import main
from hybridkv.kv.presets import load_model_config
from hybridkv.kv.specs import AttentionSpec
from hybridkv.models.config_helpers import resolve_cache_dtypes
from hybridkv.models.registry import declared_cache_layers
from tests.models.conformance import MIN_MARGIN
from tests.models.utils import engine_greedy, prompts, reference_greedy, save_model, seeded

VOCAB = 96
NO_IDS = dict(pad_token_id=None, bos_token_id=None, eos_token_id=None)  # defaults exceed VOCAB
NEW = 12


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for these tiny models (see tests/models/test_zamba2.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def jamba(tmp_path_factory):
    """Jamba with one KV head (replicated on both ranks), top-2 of 4 experts by intermediate
    size, dt_rank 5, projection biases (out_proj's added once), conv kernel 3."""
    from transformers import JambaConfig, JambaForCausalLM

    from tests.models.test_jamba import randomise

    cfg = JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, attn_layer_period=2, attn_layer_offset=1,
        expert_layer_period=2, expert_layer_offset=0, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=8, mamba_d_conv=3, mamba_dt_rank=5, mamba_proj_bias=True,
        initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip
    hf = seeded(JambaForCausalLM, cfg)
    randomise(hf, 0)
    return save_model(hf, tmp_path_factory.mktemp("jamba-tp")), hf


def mamba(tmp_path_factory):
    """Mamba with odd switches: expand 3 (48 inner channels per rank), projection biases,
    no conv bias, untied embeddings, residual in the model dtype."""
    from tests.models.test_mamba import build

    return build(tmp_path_factory, "mamba_odd")


def falcon_mamba(tmp_path_factory):
    """Falcon Mamba: its weightless dt/B/C norms on the all-reduced x_proj output; tied."""
    from tests.models.test_mamba import build

    return build(tmp_path_factory, "falcon_defaults")


def lfm2(tmp_path_factory):
    """LFM2 with one KV head (replicated), per-head q/k norms, short convs with biases."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    from tests.models.test_lfm2 import randomise

    cfg = Lfm2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, full_attn_idxs=[1, 3], conv_bias=True,
        max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip
    hf = seeded(Lfm2ForCausalLM, cfg)
    randomise(hf, 0)
    return save_model(hf, tmp_path_factory.mktemp("lfm2-tp")), hf


def lfm2_moe(tmp_path_factory):
    """LFM2-MoE: sigmoid router with expert bias (replicated), top-4 of 8 experts split by
    intermediate size, 8 KV heads (4 per rank), tied embeddings."""
    from tests.models.test_lfm2 import SEEDS, build

    return build(tmp_path_factory, "moe", SEEDS["moe"])


def zamba2(tmp_path_factory):
    """Zamba2 with attention and MLP adapters, 2 shared blocks called by 3 layers, one Mamba2
    group (replicated, its gated norm spanning the ranks)."""
    from tests.models.test_zamba2 import build

    return build(tmp_path_factory, "adapters")


def zamba2_gqa(tmp_path_factory):
    """Zamba2 with 4 heads over one KV head (replicated), RoPE, biases, 2 Mamba2 groups (one
    per rank), untied (one block per hybrid layer)."""
    from transformers import Zamba2Config, Zamba2ForCausalLM

    from tests.models.test_zamba2 import _randomise

    cfg = Zamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, layers_block_type=["hybrid", "mamba", "hybrid"],
        n_mamba_heads=4, mamba_ngroups=2, mamba_d_state=8, chunk_size=16, use_mem_rope=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, add_bias_linear=True,
        hidden_act="silu", intermediate_size=40, adapter_rank=4, tie_word_embeddings=False,
        initializer_range=0.1, **NO_IDS,
    )  # fmt: skip
    hf = seeded(Zamba2ForCausalLM, cfg)
    _randomise(hf, 0)
    return save_model(hf, tmp_path_factory.mktemp("zamba2-gqa-tp")), hf


def olmo_hybrid(tmp_path_factory):
    """OLMo Hybrid with RoPE and one KV head (replicated): the q / k norms over the whole
    projection sum their squares over the ranks; 2 key / 4 value delta-net heads."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    from tests.models.test_olmo_hybrid import _randomise

    cfg = OlmoHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
        initializer_range=0.1, max_position_embeddings=512, **NO_IDS,
    )  # fmt: skip
    hf = seeded(OlmoHybridForCausalLM, cfg, seed=2)
    _randomise(hf, 2)
    return save_model(hf, tmp_path_factory.mktemp("olmo-hybrid-tp")), hf


FAMILIES = {
    "jamba": jamba, "mamba": mamba, "falcon_mamba": falcon_mamba, "lfm2": lfm2,
    "lfm2_moe": lfm2_moe, "zamba2": zamba2, "zamba2_gqa": zamba2_gqa,
    "olmo_hybrid": olmo_hybrid,
}  # fmt: skip


@pytest.mark.parametrize("build", list(FAMILIES.values()), ids=list(FAMILIES))
def test_family_matches_transformers_and_tp1(build, tmp_path_factory) -> None:
    folder, hf = build(tmp_path_factory)
    ids = prompts(hf.config.vocab_size, [5, 17, 33, 40])
    ref, margin = reference_greedy(hf, ids, NEW)
    assert margin > MIN_MARGIN
    single = Engine(str(folder), dtype="float32", kernel_block_size=8)
    assert engine_greedy(single, ids, NEW) == ref
    engine = Engine(str(folder), dtype="float32", kernel_block_size=8, tensor_parallel_size=2)
    try:
        assert engine.model.lm_head.weight.shape[0] == VOCAB // 2  # its vocabulary rows
        assert all(m.sharded for _, m in engine.model.cache_owners())
        assert engine_greedy(engine, ids, NEW) == ref
    finally:
        engine.shutdown()


# -- per-rank state specs ------------------------------------------------------------------


def _state_shapes(model: str, size: int, kind: str) -> set[tuple]:
    """The distinct (tensor name, shape) of every `kind` state layer at `size`."""
    config = load_model_config(model)
    layers = declared_cache_layers(config, resolve_cache_dtypes(config), size)
    return {
        (t.name, t.shape)
        for layer in layers
        if getattr(layer.spec, "kind", None) == kind
        for t in layer.spec.tensors
    }


@pytest.mark.parametrize("size", [1, 2, 8])
def test_mamba1_state_is_per_rank(size: int) -> None:
    """Jamba-v0.1: d_inner 8192, d_state 16, d_conv 4: conv [8192 / size, 3], ssm
    [8192 / size, 16]; its 8 KV heads split up to 8 ranks."""
    inner = 8192 // size
    assert _state_shapes("ai21labs/Jamba-v0.1", size, "mamba1") == {
        ("conv", (inner, 3)), ("ssm", (inner, 16))
    }  # fmt: skip


@pytest.mark.parametrize("size", [1, 2, 4])
def test_short_conv_state_is_per_rank(size: int) -> None:
    """LFM2-1.2B: 2048 conv channels, L_cache 3: conv [2048 / size, 2]."""
    assert _state_shapes("LiquidAI/LFM2-1.2B", size, "short_conv") == {("conv", (2048 // size, 2))}


@pytest.mark.parametrize("size", [1, 2, 4])
def test_zamba2_calls_cache_their_rank_heads(size: int) -> None:
    """Zamba2-2.7B: each call of a shared block caches 32 / size KV heads of 160 (2 * 2560 /
    32); its Mamba2 layers 80 / size heads of 64, the one group replicated."""
    config = load_model_config("Zyphra/Zamba2-2.7B")
    layers = declared_cache_layers(config, resolve_cache_dtypes(config), size)
    attention = {(s.num_kv_heads, s.head_dim) for s in (x.spec for x in layers)
                 if isinstance(s, AttentionSpec)}  # fmt: skip
    assert attention == {(32 // size, 160)}
    assert _state_shapes("Zyphra/Zamba2-2.7B", size, "mamba2") == {
        ("conv", (5120 // size + 2 * 64, 3)), ("ssm", (80 // size, 64, 64))
    }  # fmt: skip


def test_cli_plans_jamba_per_rank(capsys) -> None:
    assert main(["plan", "--model", "ai21labs/Jamba-v0.1", "--tensor-parallel-size", "2"]) == 0
    assert "per rank of tensor_parallel_size 2" in capsys.readouterr().out


@pytest.mark.parametrize(
    "model,size,message",
    [
        ("ai21labs/Jamba-v0.1", 3, "does not divide mamba d_inner=8192"),
        ("LiquidAI/LFM2-1.2B", 3, "does not divide short conv hidden_size=2048"),
        ("Zyphra/Zamba2-2.7B", 3, "does not divide mamba n_heads=80"),
    ],
)
def test_sizes_that_do_not_divide_are_one_line(capsys, model: str, size: int, message: str):
    assert main(["plan", "--model", model, "--tensor-parallel-size", str(size)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1
