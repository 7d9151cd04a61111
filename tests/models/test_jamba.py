"""Jamba against transformers, on every cache setting of `conformance.CASES`.

Two tiny models: one with every config key at transformers' default but the sizes (attention
on layer 4 of 5 by the default period 8 / offset 4, top-2 of 16 experts on layers 1 and 3, 8 KV
heads, dt_rank "auto", conv bias on, projection bias off; d_state 8, not 16, so that pages are
16 tokens and the small pool of the preempt case preempts); one with odd sizes (9 heads over 3
KV heads, dt_rank 5, conv bias off, projection biases on, conv kernel 3, attention every third
layer from 1, top-2 of 4 experts every third layer from 2, tied embeddings). A_log, D, the
dt_proj bias and every norm weight (the dt/B/C norms too) are drawn at random, away from their
initial values.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from hybridkv.engine import Engine

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import (
    check_bf16_as_close_as_transformers,
    check_config_errors,
    engine_greedy,
    prompts,
    reference_greedy,
    save_model,
    seeded,
)

VOCAB = 96
PRESET = "ai21labs/Jamba-v0.1"


def randomise(hf, seed: int) -> None:
    """A_log, D, dt_proj bias and norm weights away from their init values."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("A_log", ".D")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("dt_proj.bias"):  # softplus of about -1 +- 0.5: dt ~ 0.3
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1.0)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


def _defaults():
    from transformers import JambaConfig

    # defaults: 8 KV heads, top-2 of 16 experts, periods / offsets, d_conv 4, dt_rank auto
    return JambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=5,
        num_attention_heads=8, mamba_d_state=8, initializer_range=0.1,
        max_position_embeddings=512,
    )  # fmt: skip


def _odd():
    from transformers import JambaConfig

    return JambaConfig(
        vocab_size=VOCAB, hidden_size=72, intermediate_size=40, num_hidden_layers=6,
        num_attention_heads=9, num_key_value_heads=3, attn_layer_period=3, attn_layer_offset=1,
        expert_layer_period=3, expert_layer_offset=2, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=6, mamba_d_conv=3, mamba_expand=1, mamba_dt_rank=5,
        mamba_conv_bias=False, mamba_proj_bias=True, rms_norm_eps=1e-5,
        tie_word_embeddings=True, initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip


BUILDERS = {"defaults": _defaults, "odd": _odd}
# decode steps captured (float32, bfloat16): Mamba1 natively, the MoE's router and experts too
CAPTURED = ("defaults", "odd")
CAPTURED_BF16 = CAPTURED
SEEDS = {"defaults": 3}  # seeds whose greedy tokens keep a top-2 margin above MIN_MARGIN


def build(tmp_path_factory, name: str, seed: int = 0):
    from transformers import JambaForCausalLM

    hf = seeded(JambaForCausalLM, BUILDERS[name](), seed=seed)
    randomise(hf, seed)
    if hf.config.tie_word_embeddings:
        hf.tie_weights()
    return save_model(hf, tmp_path_factory.mktemp(f"jamba-{name}")), hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, SEEDS.get(request.param, 0))


def test_bfloat16_steps_are_captured_on_amx(checkpoint):
    """In bfloat16 on an AMX CPU the router (softmax over every expert, top-k), the experts
    and the Mamba1 mixers are native kernels: decode steps are captured and replayed, with the
    eager steps' tokens and log-probabilities."""
    from hybridkv import LLM, SamplingParams
    from hybridkv.ops.native import moe

    if not moe.available():
        pytest.skip("no AMX-BF16 kernels here (the MoE stays in PyTorch: eager steps)")
    folder, _ = checkpoint
    asks = prompts(VOCAB, [7, 19, 3], seed=5)
    params = [
        SamplingParams(max_tokens=5 + 3 * i, temperature=0, logprobs=1, ignore_eos=True)
        for i in range(3)
    ]
    runs = {}
    for eager in (True, False):
        llm = LLM(str(folder), dtype="bfloat16", enforce_eager=eager)
        runs[eager] = [(o.token_ids, o.logprobs) for o in llm.generate(asks, params)]
        graphs = llm.engine.runner.graphs
    assert runs[False] == runs[True]
    assert graphs.disabled is None, graphs.disabled
    assert graphs.replays > 0


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_the_variants_are_what_they_claim(checkpoint):
    folder, hf = checkpoint
    model = Engine(str(folder), dtype="float32", kernel_block_size=8).runner.model
    cfg = hf.config
    kinds = tuple("mamba" if k == "mamba" else "attention" for k in cfg.layers_block_type)
    assert model.config.layer_kinds == kinds and "attention" in kinds and "mamba" in kinds
    moe = tuple(i for i, n in enumerate(cfg.layers_num_experts) if n > 1)
    assert model.config.moe_layers == moe and moe
    for i, layer in enumerate(model.model.layers):
        assert (type(layer.feed_forward).__name__ == "JambaSparseMoe") == (i in moe)
        assert hasattr(layer, "mamba") == (kinds[i] == "mamba")
    assert model.config.mamba_dt_rank == cfg.mamba_dt_rank  # "auto" derived as transformers
    mixer = next(layer.mamba for layer in model.model.layers if hasattr(layer, "mamba"))
    assert (mixer.conv1d.bias is None) == (not cfg.mamba_conv_bias)
    assert (mixer.in_proj.bias is None) == (not cfg.mamba_proj_bias)
    assert mixer.dt_layernorm.weight.shape == (cfg.mamba_dt_rank,)


def test_bad_configs_are_one_line(tmp_path):
    base = {"architectures": ["JambaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 5,
            "num_attention_heads": 16, "num_key_value_heads": 6, "vocab_size": VOCAB}  # fmt: skip
    bad = [
        ({}, "must be a multiple of num_key_value_heads"),
        ({"num_key_value_heads": 8, "attn_layer_offset": 8}, "attn_layer_offset .8. must be"),
        ({"num_key_value_heads": 8, "mamba_dt_rank": "big"}, "mamba_dt_rank must be"),
        ({"num_key_value_heads": 8, "num_experts_per_tok": 17}, "is more than num_experts"),
        ({"num_key_value_heads": 8, "hidden_act": "gelu"}, "hidden_act='gelu' is not"),
    ]
    check_config_errors(tmp_path, base, bad)


def test_bfloat16_model_is_as_close_to_float32_as_transformers_bfloat16(checkpoint):
    """bfloat16 weights, activations and states: prefill logits (in chunks at the snapshot
    blocks) stay as close to the float32 model's as transformers' own bfloat16 model's are, by
    the median over positions (one position can flip an expert choice whose router
    probabilities bfloat16 cannot tell apart). Greedy tokens are no test here: in bfloat16 the
    step's batch changes the rounding, and these random models have near ties."""
    from transformers import JambaForCausalLM

    folder, hf = checkpoint
    hf16 = JambaForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    ids = prompts(VOCAB, [37], seed=7)[0]
    engine = Engine(str(folder), dtype="bfloat16", kernel_block_size=8)
    check_bf16_as_close_as_transformers(engine, hf, hf16, ids)


def test_transformers_in_memory_names_load_too(checkpoint, tmp_path):
    """A checkpoint written from the model's own state dict (stacked experts) loads as the
    per-expert one does."""
    import shutil

    from safetensors.torch import save_file

    folder, hf = checkpoint
    copy = tmp_path / "in-memory-names"
    shutil.copytree(folder, copy)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    assert any(k.endswith("feed_forward.experts.gate_up_proj") for k in state)
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    asks = prompts(VOCAB, [13, 30], seed=3)
    ref, _ = reference_greedy(hf, asks, 5)
    assert engine_greedy(Engine(str(copy), dtype="float32", kernel_block_size=8), asks, 5) == ref


# -- the cache it declares, and transformers' defaults ------------------------------------------


def _declared(config: dict) -> list[tuple]:
    from hybridkv.models.config_helpers import resolve_cache_dtypes
    from hybridkv.models.registry import build_on_meta

    model = build_on_meta(config)
    assert all(p.is_meta for p in model.parameters())
    rows = []
    for layer in model.cache_layers(resolve_cache_dtypes(config)):
        spec = layer.spec
        if spec.kind == "mamba1":
            rows.append((layer.layer_index, "mamba1", *(t.shape for t in spec.tensors)))
        else:
            rows.append((layer.layer_index, spec.kind, spec.num_kv_heads, spec.head_dim))
    return sorted(rows)


def _expected(config: dict) -> list[tuple]:
    """Worked out from transformers' own config object."""
    from transformers import JambaConfig

    hf = JambaConfig(**{k: v for k, v in config.items() if k not in ("architectures",)})
    d_inner = hf.mamba_expand * hf.hidden_size
    rows = []
    for i, kind in enumerate(hf.layers_block_type):
        if kind == "mamba":
            rows.append((i, "mamba1", (d_inner, hf.mamba_d_conv - 1), (d_inner, hf.mamba_d_state)))
        else:
            rows.append((i, "attention", hf.num_key_value_heads,
                         hf.hidden_size // hf.num_attention_heads))  # fmt: skip
    return rows


def test_jamba_v01_declares_what_transformers_implies_and_plans(capsys):
    from hybridkv.entrypoints.cli import main as cli_main
    from hybridkv.kv.presets import load_preset

    config = load_preset(PRESET)
    want = _expected(config)
    assert _declared(config) == want
    assert [r[0] for r in want if r[1] == "attention"] == [4, 12, 20, 28]
    assert cli_main(["plan", "--model", PRESET, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layers = sorted((i, g["spec"]["kind"]) for g in plan["groups"] for i in g["layer_ids"])
    assert layers == [(r[0], r[1]) for r in want]
    # 8192 x 16 ssm + 8192 x 3 conv, bf16: 311,296 B per layer over 4,096 B per token
    assert plan["page_tokens"] == 80


def test_a_config_without_optional_keys_takes_transformers_defaults():
    from transformers import JambaConfig as HFJambaConfig

    from hybridkv.models.jamba import JambaConfig

    assert _declared({"architectures": ["JambaForCausalLM"]}) == _expected({})
    ours, theirs = JambaConfig.from_hf({}), HFJambaConfig()
    compared = 0
    for field in dataclasses.fields(ours):
        if hasattr(theirs, field.name):
            assert getattr(ours, field.name) == getattr(theirs, field.name), field.name
            compared += 1
    assert compared >= 20
    assert JambaConfig.from_hf({"num_local_experts": 4}).num_experts == 4  # the attribute map
