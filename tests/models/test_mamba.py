"""Mamba and Falcon Mamba (pure Mamba1 models, no attention) against transformers, on every
cache setting of `conformance.CASES`.

Four tiny models: for each architecture one with every config key at transformers' default but
the sizes (time_step_rank "auto", conv bias on, projection bias off, residual in float32, tied
embeddings, conv kernel 4), and one with odd sizes and the switches turned (time_step_rank 5,
conv bias off, projection biases on, residual in the model dtype, untied embeddings, conv
kernel 3; Falcon Mamba with mixer_rms_eps 1e-3). A_log, D, the dt_proj bias and the norm
weights are drawn at random, away from their initial values, and the mixers' input projections
scaled up (`randomise`).

For a model without attention, the cases that set a kernel block size (ratio1-3, prefix-block,
multi-turn, chunked, preempt) have no attention group to split: page_tokens alone is the block
at which state snapshots are taken and prefix hits land; the preempt case becomes a pool with
room for three requests' states (`conformance.check_small_state_pool`).
"""

from __future__ import annotations

import dataclasses

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

# checkpoints whose decode steps must be captured (test_captured_decode_equals_eager)
CAPTURED = ("mamba_defaults", "mamba_odd", "falcon_defaults", "falcon_odd")
CAPTURED_BF16 = CAPTURED  # (the Mamba1 conv and scan round bf16 results natively)

VOCAB = 96


def randomise(hf, seed: int) -> None:
    """A_log, D, dt_proj bias and norm weights away from their init values; in_proj and x_proj
    three times larger, or the mixers' outputs are so small beside the embeddings that a
    model with tied embeddings predicts its last token again and again."""
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("in_proj.weight", "x_proj.weight")):
                p.mul_(3.0)
            elif name.endswith(("A_log", ".D")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("dt_proj.bias"):  # softplus of about -1 +- 0.5: dt ~ 0.3
                p.copy_(torch.randn(p.shape, generator=g) * 0.5 - 1.0)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=g) * 0.2)


def _sizes(**odd):
    return dict(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=3, **odd)


ODD = dict(expand=3, time_step_rank=5, use_conv_bias=False, use_bias=True, conv_kernel=3,
           residual_in_fp32=False, tie_word_embeddings=False, layer_norm_epsilon=1e-4)  # fmt: skip


def _mamba_defaults():
    from transformers import MambaConfig

    return MambaConfig(**_sizes())


def _mamba_odd():
    from transformers import MambaConfig

    return MambaConfig(**_sizes(**ODD))


def _falcon_defaults():
    from transformers import FalconMambaConfig

    return FalconMambaConfig(**_sizes())


def _falcon_odd():
    from transformers import FalconMambaConfig

    return FalconMambaConfig(**_sizes(**ODD), mixer_rms_eps=1e-3)


BUILDERS = {
    "mamba_defaults": _mamba_defaults,
    "mamba_odd": _mamba_odd,
    "falcon_defaults": _falcon_defaults,
    "falcon_odd": _falcon_odd,
}
SEEDS = {"mamba_defaults": 1}  # seeds whose greedy tokens keep a top-2 margin above MIN_MARGIN


def hf_class(name: str):
    import transformers

    if "falcon" in name:
        return transformers.FalconMambaForCausalLM
    return transformers.MambaForCausalLM


def build(tmp_path_factory, name: str, seed: int = 0):
    hf = seeded(hf_class(name), BUILDERS[name](), seed=seed)
    randomise(hf, seed)
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
    engine = Engine(str(folder), dtype="float32")
    model, cfg = engine.runner.model, hf.config
    assert type(model).__name__ == type(hf).__name__
    assert not engine.plan.attention_groups
    mixer = model.backbone.layers[0].mixer
    assert mixer.dt_rank == cfg.time_step_rank  # "auto" derived as transformers does
    assert mixer.d_inner == cfg.intermediate_size
    assert (mixer.conv1d.bias is None) == (not cfg.use_conv_bias)
    assert (mixer.in_proj.bias is None) == (not cfg.use_bias)
    want_norms = "falcon_mamba" if "FalconMamba" in type(hf).__name__ else None
    assert mixer.dt_norms == want_norms
    if want_norms:
        assert mixer.norm_eps == cfg.mixer_rms_eps
    assert model.backbone.layers[0].residual_in_fp32 == cfg.residual_in_fp32
    tied = model.lm_head.weight.data_ptr() == model.backbone.embeddings.weight.data_ptr()
    assert tied == cfg.tie_word_embeddings


@pytest.mark.parametrize("arch", ["MambaForCausalLM", "FalconMambaForCausalLM"])
def test_bad_configs_are_one_line(tmp_path, arch):
    base = {"architectures": [arch], "hidden_size": 32, "num_hidden_layers": 2,
            "vocab_size": VOCAB}  # fmt: skip
    bad = [
        ({"time_step_rank": "big"}, "time_step_rank must be an integer or 'auto'"),
        ({"state_size": 0}, "state_size must be a positive integer"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"expand": 1.5}, "'expand' must be int"),
    ]
    check_config_errors(tmp_path, base, bad)


def test_bfloat16_model_is_as_close_to_float32_as_transformers_bfloat16(checkpoint):
    """bfloat16 weights, activations and states: prefill logits (in chunks at the snapshot
    blocks) stay as close to the float32 model's as transformers' own bfloat16 model's are, by
    the median over positions (one position can flip an expert choice whose router
    probabilities bfloat16 cannot tell apart). Greedy tokens are no test here: in bfloat16 the
    step's batch changes the rounding, and these random models have near ties."""
    folder, hf = checkpoint
    hf16 = hf_class(type(hf).__name__.lower()).from_pretrained(str(folder), dtype=torch.bfloat16)
    ids = prompts(VOCAB, [37], seed=7)[0]
    check_bf16_as_close_as_transformers(Engine(str(folder), dtype="bfloat16"), hf, hf16, ids)


def test_old_embedding_name_loads(checkpoint, tmp_path):
    """Older checkpoints spell the embeddings `backbone.embedding.weight`."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder, hf = checkpoint
    copy = tmp_path / "old-names"
    shutil.copytree(folder, copy)
    weights = load_file(str(folder / "model.safetensors"))
    weights["backbone.embedding.weight"] = weights.pop("backbone.embeddings.weight")
    save_file(weights, copy / "model.safetensors", metadata={"format": "pt"})
    asks = prompts(VOCAB, [13, 30], seed=3)
    ref, _ = reference_greedy(hf, asks, 5)
    assert engine_greedy(Engine(str(copy), dtype="float32"), asks, 5) == ref


# -- the cache it declares, and transformers' defaults ------------------------------------------


@pytest.mark.parametrize("arch", ["MambaForCausalLM", "FalconMambaForCausalLM"])
def test_a_config_without_optional_keys_takes_transformers_defaults(arch):
    import transformers

    from hybridkv.models.config_helpers import resolve_cache_dtypes
    from hybridkv.models.registry import build_on_meta, model_class

    theirs = getattr(transformers, arch.replace("ForCausalLM", "Config"))()
    ours = model_class(arch).config_class.from_hf({})
    compared = 0
    for field in dataclasses.fields(ours):
        if hasattr(theirs, field.name):
            assert getattr(ours, field.name) == getattr(theirs, field.name), field.name
            compared += 1
    assert compared >= 12
    config = {"architectures": [arch]}
    layers = build_on_meta(config).cache_layers(resolve_cache_dtypes(config))
    d_inner = theirs.intermediate_size
    want = [(i, "mamba1", (d_inner, theirs.conv_kernel - 1), (d_inner, theirs.state_size))
            for i in range(theirs.num_hidden_layers)]  # fmt: skip
    got = [(c.layer_index, c.spec.kind, *(t.shape for t in c.spec.tensors)) for c in layers]
    assert got == want
