"""Zamba2 against transformers, on every cache setting of `conformance.CASES`.

Two tiny models:

- "adapters": transformers' defaults but for sizes (gelu MLP of 4 x hidden, no RoPE, tied
  embeddings; Mamba2 chunk 32), with the attention adapters on and 2 shared blocks called by 3
  hybrid layers (calls 0 and 2 run block 0 with different adapters, call 1 runs block 1);
- "gqa_rope_untied": 3 query heads on 1 KV head, RoPE (theta 500), no attention adapters, one
  block called twice, Mamba2 with 2 groups and chunk 16, biases on, silu MLP, untied embeddings
  (transformers 5.24 then gives every hybrid layer a block of its own, which is followed here).

A_log, dt_bias, D and every norm are drawn at random, away from their initial values.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridkv.config import CacheConfig
from hybridkv.engine import Engine
from hybridkv.kv.presets import load_preset
from hybridkv.layers.attention.layer import PagedAttention
from hybridkv.models.config_helpers import resolve_cache_dtypes
from hybridkv.models.registry import build_on_meta, plan_for_config
from hybridkv.models.zamba2 import Zamba2Config, Zamba2HybridLayer

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
            if name.endswith(("A_log", "dt_bias", ".D")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


def _adapters():
    """chunk_size 32, not 256: transformers' scan pads every forward to whole chunks (4x the
    time of the reference tokens at 256)."""
    from transformers import Zamba2Config as HFZamba2Config

    return HFZamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        layers_block_type=["mamba", "hybrid", "hybrid", "hybrid"], n_mamba_heads=4,
        mamba_d_state=8, num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4,
        chunk_size=32, initializer_range=0.1, **NO_IDS,
    )  # fmt: skip


def _gqa_rope_untied():
    from transformers import Zamba2Config as HFZamba2Config

    return HFZamba2Config(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=3, num_attention_heads=3,
        attention_head_dim=12,  # stored, not 2 * hidden / heads = 16: transformers honours it
        num_key_value_heads=1, layers_block_type=["hybrid", "mamba", "hybrid"],
        n_mamba_heads=6, mamba_ngroups=2, mamba_d_state=8, chunk_size=16, use_mem_rope=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0}, add_bias_linear=True,
        hidden_act="silu", intermediate_size=40, adapter_rank=4, tie_word_embeddings=False,
        initializer_range=0.1, **NO_IDS,
    )  # fmt: skip


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread for these tiny models (transformers' reference included): with two
    on a busy 2-core machine every tiny op waits for the other thread's time slice (measured:
    2.8 ms per 32-wide linear, 165 s for the reference tokens of one model instead of 5 s).
    tests/conftest.py's OMP_NUM_THREADS=1 comes after torch is imported, so it does not."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


BUILDERS = {"adapters": _adapters, "gqa_rope_untied": _gqa_rope_untied}
# seeds whose greedy tokens keep a top-2 margin above MIN_MARGIN (gqa_rope_untied's seed 0 has
# 1.3e-4 since its attention_head_dim is stored: its bf16 tokens then flip)
SEEDS: dict[str, int] = {"gqa_rope_untied": 2}


def build(tmp_path_factory, name: str, seed: int = 0):
    from transformers import Zamba2ForCausalLM

    hf = seeded(Zamba2ForCausalLM, BUILDERS[name](), seed=seed)
    _randomise(hf, seed)
    return save_model(hf, tmp_path_factory.mktemp(name)), hf


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param, SEEDS.get(request.param, 0))


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def _weight(layer: Zamba2HybridLayer) -> torch.Tensor:
    return layer.shared_transformer.self_attn.q_proj.weight


def test_the_variants_are_what_they_claim(checkpoint):
    folder, hf = checkpoint
    model = Engine(str(folder), dtype="float32", kernel_block_size=8).runner.model
    hybrid = [m for m in model.model.layers if isinstance(m, Zamba2HybridLayer)]
    kv = [m for _, m in model.cache_owners() if isinstance(m, PagedAttention)]
    assert kv == [layer.attn for layer in hybrid]  # one KV cache per call
    assert all(not list(m.parameters()) for m in kv)  # holding no weights
    if hf.config.use_shared_attention_adapter:  # calls 0, 1, 2 -> blocks 0, 1, 0
        assert [layer.call for layer in hybrid] == [0, 1, 2]
        assert hybrid[0].shared_transformer is hybrid[2].shared_transformer
        assert hybrid[0].shared_transformer is not hybrid[1].shared_transformer
        assert model.rotary is None and kv[0].num_kv_heads == 4 and kv[0].head_dim == 16
        assert kv[0].scale == pytest.approx(8**-0.5)  # (head_dim / 2) ** -0.5
    else:  # untied: one block per layer, as transformers builds it
        assert hybrid[0].shared_transformer is not hybrid[1].shared_transformer
        assert not torch.equal(_weight(hybrid[0]), _weight(hybrid[1]))
        assert model.rotary is not None and (kv[0].num_heads, kv[0].num_kv_heads) == (3, 1)
        assert kv[0].head_dim == 12 and kv[0].scale == pytest.approx(6**-0.5)  # stored size


def test_shared_weights_named_under_every_call_load_once(checkpoint, tmp_path):
    """transformers' in-memory state dict names a tied block's weights under every layer that
    calls it; such a checkpoint runs as the one that names them once."""
    from safetensors.torch import save_file

    folder, hf = checkpoint
    if not hf.config.tie_word_embeddings:
        pytest.skip("untied models hold a block per layer")
    copy = tmp_path / "every-call"
    shutil.copytree(folder, copy)
    state = {k: v.contiguous().clone() for k, v in hf.state_dict().items()}
    state.pop("lm_head.weight")
    assert "model.layers.3.shared_transformer.self_attn.q_proj.weight" in state
    save_file(state, copy / "model.safetensors", metadata={"format": "pt"})
    asks = prompts(VOCAB, [13, 30], seed=3)
    ref, _ = reference_greedy(hf, asks, 5)
    assert engine_greedy(Engine(str(copy), dtype="float32", kernel_block_size=8), asks, 5) == ref


def test_an_untied_checkpoint_naming_a_block_once_shares_it(checkpoint, tmp_path):
    """An untied checkpoint without layer 2's block copy: layer 2 runs layer 0's block (the
    block the checkpoint shares), where transformers would leave it randomly initialised."""
    from safetensors.torch import load_file, save_file

    folder, hf = checkpoint
    if hf.config.tie_word_embeddings:
        pytest.skip("tied models share their blocks anyway")
    copy = tmp_path / "named-once"
    shutil.copytree(folder, copy)
    state = load_file(folder / "model.safetensors")
    dropped = [k for k in state if k.startswith("model.layers.2.shared_transformer.")]
    assert len(dropped) >= 8
    save_file({k: v for k, v in state.items() if k not in dropped}, copy / "model.safetensors")
    model = Engine(str(copy), dtype="float32", kernel_block_size=8).runner.model
    first, second = model.model.layers[0], model.model.layers[2]
    for (name, a), (_, b) in zip(
        first.shared_transformer.named_parameters(),
        second.shared_transformer.named_parameters(),
        strict=True,
    ):
        assert torch.equal(a, b), name


def test_mlp_adapters_can_be_off(checkpoint, tmp_path):
    """`use_shared_mlp_adapter` false (Zyphra's key; transformers 5.24 always builds them): a
    checkpoint without gate_up adapters runs as transformers with those adapters at zero."""
    from safetensors.torch import load_file, save_file

    folder, hf = checkpoint
    copy = tmp_path / "no-mlp-adapters"
    shutil.copytree(folder, copy)
    state = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in state.items() if "gate_up_proj_adapter_list" not in k}
    assert len(kept) < len(state)
    save_file(kept, copy / "model.safetensors")
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "use_shared_mlp_adapter": False}))
    zeroed = type(hf)(hf.config).eval()
    zeroed.load_state_dict(hf.state_dict())
    with torch.no_grad():
        for name, p in zeroed.named_parameters():
            if "gate_up_proj_adapter_list" in name:
                p.zero_()
    asks = prompts(VOCAB, [13, 30], seed=3)
    ref, _ = reference_greedy(zeroed, asks, 5)
    assert engine_greedy(Engine(str(copy), dtype="float32", kernel_block_size=8), asks, 5) == ref


def test_bfloat16_model_runs_close_to_transformers(checkpoint):
    """bfloat16 weights and activations (float32 state, as "auto" picks): most greedy tokens
    equal transformers' bfloat16 ones."""
    from transformers import Zamba2ForCausalLM

    folder, _ = checkpoint
    hf = Zamba2ForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).eval()
    asks = prompts(VOCAB, [21, 9], seed=7)
    ref, _ = reference_greedy(hf, asks, 4)
    got = engine_greedy(Engine(str(folder), dtype="bfloat16", kernel_block_size=8), asks, 4)
    same = sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True))
    assert same >= 6


# -- config and declared cache (no weights) ----------------------------------------------------


def _declared(config: dict) -> list[tuple]:
    """(layer index, kind, dims) of every cache layer the model built on meta declares."""
    dtypes = resolve_cache_dtypes(config)
    rows = []
    for layer in build_on_meta(config).cache_layers(dtypes):
        spec = layer.spec
        if spec.kind == "mamba2":
            rows.append((layer.layer_index, "mamba2", *(t.shape for t in spec.tensors)))
        else:
            rows.append((layer.layer_index, spec.kind, spec.num_kv_heads, spec.head_dim))
    return sorted(rows)


def _implied(hf) -> list[tuple]:
    """The same, worked out from transformers' config object."""
    inner = hf.mamba_expand * hf.hidden_size
    conv = (inner + 2 * hf.mamba_ngroups * hf.mamba_d_state, hf.mamba_d_conv - 1)
    ssm = (hf.n_mamba_heads, hf.mamba_headdim, hf.mamba_d_state)
    rows = [(i, "mamba2", conv, ssm) for i in range(len(hf.layers_block_type))]
    kv = (hf.num_key_value_heads, hf.attention_head_dim)
    rows += [(i, "attention", *kv) for i in hf.hybrid_layer_ids]
    return sorted(rows)


@pytest.mark.parametrize("preset", [None, "Zyphra/Zamba2-2.7B"])
def test_declared_cache_is_what_transformers_config_implies(preset):
    from transformers import Zamba2Config as HFZamba2Config

    config = load_preset(preset) if preset else {"architectures": ["Zamba2ForCausalLM"]}
    keys = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    assert _declared(config) == _implied(HFZamba2Config(**keys))


# `hybridkv plan` of the real configs as the plan-only reader gave it before Zamba2 ran:
# page_tokens, layers_per_group, and (kind, layer ids) of every group.
PLANS_BEFORE = {
    "Zyphra/Zamba2-1.2B": (80, 6, [("mamba2", list(range(j, 38, 7))) for j in range(7)]
                           + [("attention", [5, 11, 17, 23, 29, 35])]),
    "Zyphra/Zamba2-2.7B": (48, 9, [("mamba2", list(range(j, 54, 6))) for j in range(6)]
                           + [("attention", [6, 12, 18, 24, 30, 36, 42, 47, 51])]),
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PLANS_BEFORE))
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_real_configs_plan_as_before(preset, platform):
    """Zamba2-1.2B's config is in Zyphra's first key names (state_size, expansion_factor,
    mamba_headdim without n_mamba_heads, layer types m / g): read as what they mean."""
    plan = plan_for_config(load_preset(preset), CacheConfig(platform=platform))
    page_tokens, per_group, groups = PLANS_BEFORE[preset]
    assert (plan.page_tokens, plan.layers_per_group) == (page_tokens, per_group)
    assert [(g.kind, list(g.layer_ids)) for g in plan.groups] == groups


def test_typed_config_defaults_are_transformers_defaults():
    from transformers import Zamba2Config as HFZamba2Config

    ours, theirs = Zamba2Config.from_hf({}), HFZamba2Config()
    fields = ("vocab_size", "max_position_embeddings", "hidden_size", "mamba_d_state",
              "mamba_d_conv", "mamba_expand", "mamba_ngroups", "time_step_min", "n_mamba_heads",
              "mamba_headdim", "chunk_size", "add_bias_linear", "intermediate_size", "hidden_act",
              "num_attention_heads", "num_key_value_heads", "num_mem_blocks", "adapter_rank",
              "use_shared_attention_adapter", "use_mem_rope", "rms_norm_eps",
              "use_long_context", "tie_word_embeddings", "attention_head_dim")  # fmt: skip
    for name in fields:
        assert getattr(ours, name) == getattr(theirs, name), name
    assert list(ours.hybrid_layer_ids) == theirs.hybrid_layer_ids
    roles = {"linear_attention": "mamba", "hybrid": "hybrid"}
    assert list(ours.layers_block_type) == [roles[t] for t in theirs.layers_block_type]
    assert ours.rope["rope_theta"] == theirs.rope_parameters["rope_theta"]
    long = Zamba2Config.from_hf({"use_long_context": True})
    assert (
        long.max_position_embeddings
        == HFZamba2Config(use_long_context=True).max_position_embeddings
    )


BAD_CONFIGS = [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "must be a multiple of num_key_value"),
    ({"use_shared_attention_adapter": True, "num_key_value_heads": 2}, "adapter needs"),
    ({"hidden_size": 30, "n_mamba_heads": 8}, r"mamba_expand \* hidden_size \(60\) must be"),
    ({"n_mamba_heads": 8, "mamba_ngroups": 3}, "must be a multiple of mamba_ngroups"),
    ({"layers_block_type": ["mamba", "attention"]}, "unknown layer type 'attention'"),
    ({"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
    ({"use_mem_rope": True, "hidden_size": 30}, "even attention_head_dim"),
    ({"use_mem_rope": True, "head_dim": 7}, "even attention_head_dim, got 7"),
    ({"attention_head_dim": 0}, "attention_head_dim must be >= 1"),
    ({"use_shared_attention_adapter": True, "head_dim": 4}, r"\(4 \* 4\) == 2 \* hidden_size"),
]


@pytest.mark.parametrize(("keys", "message"), BAD_CONFIGS, ids=[m for _, m in BAD_CONFIGS])
def test_bad_config_is_one_line(tmp_path, keys, message):
    config = {"architectures": ["Zamba2ForCausalLM"], "hidden_size": 32,
              "num_attention_heads": 4, "n_mamba_heads": 4, "mamba_d_state": 8,
              "layers_block_type": ["mamba", "hybrid"], "vocab_size": VOCAB, **keys}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as err:
        Engine(str(tmp_path), dtype="float32")
    assert "\n" not in str(err.value)
