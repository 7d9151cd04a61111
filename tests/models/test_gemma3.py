"""Gemma 3 text (Gemma3ForCausalLM, and the text part of a Gemma3ForConditionalGeneration
checkpoint) against transformers, on every cache setting of `conformance.CASES`.

Two tiny variants, both with windows (8 and 12 tokens) shorter than most prompts:
- "defaults": transformers' defaults but the sizes and the pattern (sliding_window_pattern 2,
  local / global alternating: with pattern 6 the 5:1 layout makes 6 cache groups, too many for
  the conformance pool of 14 pages; tied embeddings; query_pre_attn_scalar 256, not head_dim);
- "odd": 3 query heads on 1 KV head of 24, explicit layer_types starting with a global layer,
  untied lm_head, linear-scaled global RoPE, its own local base, final logit soft-capping.
Every norm weight (stored centred on zero) is drawn at random, so a norm read as `weight` rather
than `1 + weight`, or skipped, shows up.
"""

from __future__ import annotations

import json
import logging

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
    engine_greedy,
    engine_prefill_logits,
    max_rel_error,
    prompts,
    reference_greedy,
    reference_logits,
    save_model,
    save_tokenizer,
    seeded,
)

# checkpoints whose decode steps must be captured (test_captured_decode_equals_eager)
CAPTURED = ("defaults", "odd")  # ("odd": its logits soft-capped by the native logits kernel)
CAPTURED_BF16 = CAPTURED

VOCAB = 96


def _randomise_norms(model) -> None:
    torch.manual_seed(5)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.data.uniform_(-0.5, 0.5)


def build_defaults():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=12,
        sliding_window_pattern=2, max_position_embeddings=512, initializer_range=0.1,
    )  # fmt: skip
    model = seeded(Gemma3ForCausalLM, cfg)
    _randomise_norms(model)
    return model


def build_odd():
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    kinds = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    rope = {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 5000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    }
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=4,
        num_attention_heads=3, num_key_value_heads=1, head_dim=24, sliding_window=8,
        layer_types=kinds, rope_parameters=rope, query_pre_attn_scalar=32,
        final_logit_softcapping=3.0, tie_word_embeddings=False, max_position_embeddings=512,
        initializer_range=0.1,
    )  # fmt: skip
    model = seeded(Gemma3ForCausalLM, cfg)
    _randomise_norms(model)
    return model


BUILDERS = {"defaults": build_defaults, "odd": build_odd}


@pytest.fixture(scope="module", params=list(BUILDERS))
def checkpoint(request, tmp_path_factory):
    hf = BUILDERS[request.param]()
    return save_model(hf, tmp_path_factory.mktemp(request.param)), hf


def test_prefill_logits_match(checkpoint):
    folder, hf = checkpoint
    engine = check_prefill_logits(folder, hf)  # 37 tokens: past both windows
    ours = dict(engine.model.named_parameters(remove_duplicate=False))
    assert set(hf.state_dict()) <= set(ours), "checkpoint tensors the model does not load"
    tied = engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert tied == hf.config.tie_word_embeddings
    windows = [layer.self_attn.attn.sliding_window for layer in engine.model.model.layers]
    assert windows == [
        hf.config.sliding_window if kind == "sliding_attention" else None
        for kind in hf.config.layer_types
    ]
    assert None in windows and hf.config.sliding_window in windows


@pytest.mark.parametrize("naming", ["hub", "module"])
def test_conditional_generation_checkpoint_loads_its_text_model(tmp_path, caplog, naming):
    """A checkpoint saved as Gemma3ForConditionalGeneration (vision tower and projector too)
    runs its text model; the vision tensors are skipped with one log line each prefix. "hub":
    the names save_pretrained and the Hub checkpoints use (`language_model.model.`); "module":
    transformers' module paths (`model.language_model.`, `model.vision_tower.`, `lm_head`)."""
    from safetensors.torch import load_file, save_file
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        initializer_range=0.1,
    )  # fmt: skip
    vision = dict(
        model_type="siglip_vision_model", hidden_size=16, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, image_size=16, patch_size=8,
    )  # fmt: skip
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 2,
        boi_token_index=VOCAB - 3, eoi_token_index=VOCAB - 4,
    )  # fmt: skip
    hf = seeded(Gemma3ForConditionalGeneration, config)
    _randomise_norms(hf)
    folder = tmp_path / "vl"
    hf.save_pretrained(folder)
    save_tokenizer(folder, VOCAB)
    saved = json.loads((folder / "config.json").read_text())
    assert saved["architectures"] == ["Gemma3ForConditionalGeneration"]
    weights = load_file(folder / "model.safetensors")
    assert any(name.startswith("language_model.model.") for name in weights)
    prefix = ""
    if naming == "module":
        prefix = "model."
        weights = {
            name.replace("language_model.model.", "language_model.").replace(
                "language_model.lm_head.", "lm_head."
            ) if name.startswith("language_model.") else name: tensor
            for name, tensor in weights.items()
        }  # fmt: skip
        weights = {n if n.startswith("lm_head.") else "model." + n: t for n, t in weights.items()}
        save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="hybridkv"):
        # (a small pool: the config's 131072 positions would size the default 4 GiB one, and
        # zeroing it took 20 s in a worker process of the suite)
        engine = Engine(str(folder), dtype="float32", kernel_block_size=4, memory_bytes=64 * 2**20)
    assert f"under '{prefix}vision_tower.'" in caplog.text
    assert f"under '{prefix}multi_modal_projector.'" in caplog.text
    asks = prompts(VOCAB - 4, [11, 23], seed=4)  # no image / boi / eoi tokens
    with torch.inference_mode():
        ref = []
        for ids in asks:  # the text model's own greedy tokens (full forwards)
            seq = list(ids)
            for _ in range(6):
                logits = hf(input_ids=torch.tensor([seq])).logits[0, -1]
                seq.append(int(logits.argmax()))
            ref.append(seq[len(ids) :])
    assert engine_greedy(engine, asks, 6) == ref


def _write_config(tmp_path, **overrides):
    keys = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    )  # fmt: skip
    config = {"architectures": ["Gemma3ForCausalLM"], **keys, **overrides}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


BAD_CONFIGS = [
    ({"num_attention_heads": 3, "num_key_value_heads": 2}, "must be a multiple of"),
    ({"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true"),
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries"),
    ({"layer_types": ["mamba", "full_attention"]}, "unknown layer type 'mamba'"),
    ({"sliding_window": 0}, "positive sliding_window"),
    ({"rope_parameters": {"rope_type": "linear"}}, "keyed by layer type"),
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "unsupported rope type"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be positive"),
    ({"final_logit_softcapping": 0.0}, "final_logit_softcapping must be positive or null"),
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping must be positive or null"),
]


@pytest.mark.parametrize("overrides, message", BAD_CONFIGS, ids=lambda v: str(v)[:40])
def test_bad_configs_are_one_line(tmp_path, overrides, message):
    folder = _write_config(tmp_path, **overrides)
    with pytest.raises(ValueError, match=message) as err:
        Engine(str(folder), dtype="float32")
    assert "\n" not in str(err.value)


def test_older_config_keys_read_as_transformers_reads_them(checkpoint, tmp_path):
    """A config.json in the first Gemma 3 spelling (`rope_theta`, `rope_local_base_freq`,
    `rope_scaling` for the global layers, `sliding_window_pattern` instead of `layer_types`)
    gives transformers' layout and RoPE, and the same logits from the same weights."""
    import shutil

    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from hybridkv.models.gemma3 import Gemma3TextConfig as Ours

    folder, hf = checkpoint
    old = {
        k: v for k, v in json.loads((folder / "config.json").read_text()).items()
        if k not in ("layer_types", "rope_parameters")
    }  # fmt: skip
    old.update(
        rope_theta=2000.0, rope_local_base_freq=50.0, sliding_window_pattern=3,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )  # fmt: skip
    keys = {k: v for k, v in old.items() if k not in ("architectures", "model_type")}
    theirs = Gemma3TextConfig(**keys)
    ours = Ours.from_hf(old)
    assert list(ours.layer_types) == theirs.layer_types
    for kind in ("full_attention", "sliding_attention"):
        want = {k: v for k, v in theirs.rope_parameters[kind].items() if v is not None}
        assert ours.rope_for(kind) == want
    moved = tmp_path / "old"
    shutil.copytree(folder, moved)
    (moved / "config.json").write_text(json.dumps(old))
    reference = Gemma3ForCausalLM(theirs).eval()
    reference.load_state_dict(hf.state_dict())
    check_prefill_logits(moved, reference)


def test_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(checkpoint):
    """In bfloat16 (the checkpoints' dtype; the embedding scale rounded to it) hybridkv's
    prefill logits stay as close to the float32 ones as transformers' own bfloat16 run."""
    import copy

    folder, hf = checkpoint
    ids = prompts(VOCAB, [37])[0]
    ref32 = reference_logits(hf, ids)
    ref16 = reference_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)
    engine = Engine(str(folder), dtype="bfloat16", kernel_block_size=4, enable_prefix_caching=False)
    ours = engine_prefill_logits(engine, ids)
    assert max_rel_error(ours, ref32) <= 2 * max_rel_error(ref16, ref32) + 1e-3


SOFTCAP = 0.3  # against scores of about +-0.5 here: applied, it changes the logits a lot


def build_softcapped(cap: float = SOFTCAP):
    """The "defaults" model with `attn_logit_softcapping` set, the same weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        **{k: v for k, v in build_defaults().config.to_dict().items() if k in _KEYS},
        attn_logit_softcapping=cap,
    )
    model = seeded(Gemma3ForCausalLM, cfg)
    _randomise_norms(model)
    return model


_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "sliding_window", "layer_types",
    "max_position_embeddings", "initializer_range",
)  # fmt: skip


def test_attn_logit_softcapping_is_read_as_transformers_reads_it(tmp_path, caplog):
    """transformers 5.25's Gemma 3 stores `attn_logit_softcapping` but never applies it (its
    attention function is not given `softcap=`): the prefill logits and greedy tokens of a
    Gemma 3 with the key set are transformers', i.e. those of the same model without the key,
    and the engine says once that it does not apply it."""
    hf = build_softcapped()
    plain = build_defaults()
    ids = prompts(VOCAB, [37])[0]
    with torch.inference_mode():
        same = hf(torch.tensor([ids])).logits
        assert torch.equal(same, plain(torch.tensor([ids])).logits)  # transformers ignores it
    folder = save_model(hf, tmp_path / "softcapped")
    assert json.loads((folder / "config.json").read_text())["attn_logit_softcapping"] == SOFTCAP
    with caplog.at_level(logging.WARNING, logger="hybridkv"):
        engine = check_prefill_logits(folder, hf)
    assert f"attn_logit_softcapping={SOFTCAP} is not applied" in caplog.text
    assert all(layer.self_attn.attn.softcap is None for layer in engine.model.model.layers)
    asks = prompts(VOCAB, [9, 30], seed=3)
    want, margin = reference_greedy(hf, asks, 8)
    assert margin > 1e-3
    assert engine_greedy(engine, asks, 8) == want


def test_soft_capped_attention_matches_transformers_eager_softcap(tmp_path, monkeypatch):
    """The soft-capping kernels inside a whole model: the Gemma 3 above with its layers' cap
    switched on in hybridkv (`PagedAttention.softcap`: the PyTorch prefill and the native
    decode) against transformers' own eager attention given `softcap=` (the path Gemma 2
    takes): prefill logits and greedy tokens; and the cap changes those logits."""
    import functools

    from transformers.models.gemma3 import modeling_gemma3

    hf = build_softcapped()
    hf.set_attn_implementation("eager")
    eager = modeling_gemma3.eager_attention_forward

    def capped(module, *args, **kwargs):
        return eager(module, *args, **kwargs, softcap=module.attn_logit_softcapping)

    ids = prompts(VOCAB, [37])[0]
    uncapped = reference_logits(hf, ids)
    monkeypatch.setattr(modeling_gemma3, "eager_attention_forward", functools.wraps(eager)(capped))
    ref = reference_logits(hf, ids)
    assert max_rel_error(uncapped, ref) > 0.05  # the cap matters at this size
    folder = save_model(hf, tmp_path / "capped")
    engine = Engine(str(folder), dtype="float32", kernel_block_size=4, enable_prefix_caching=False)
    for layer in engine.model.model.layers:
        layer.self_attn.attn.softcap = SOFTCAP
    assert max_rel_error(engine_prefill_logits(engine, ids), ref) <= 1e-4
    asks = prompts(VOCAB, [9, 30], seed=3)
    want, margin = reference_greedy(hf, asks, 8)
    assert margin > 1e-3
    assert engine_greedy(engine, asks, 8) == want
