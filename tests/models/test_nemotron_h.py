import json

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.kv.specs import ConfigError
from hybridkv.models.loader import iter_weights
from hybridkv.models.nemotron_h import NemotronHForCausalLM

from .conformance import (  # noqa: F401
    check_prefill_logits,
    family,
    test_captured_decode_equals_eager,
    test_greedy_matches_transformers,
)
from .utils import (
    save_model,
    seeded,
)

# checkpoints whose decode steps must be captured (test_captured_decode_equals_eager)
CAPTURED = ("dense", "moe")  # (MoE: the native router and relu2 experts, a CPU with AVX2)
CAPTURED_BF16 = CAPTURED

VOCAB = 96
# "latent": MoE experts between fc1/fc2_latent_proj (moe_latent_size); prefill test only
PATTERNS = {"dense": "M*M-", "moe": "ME*E", "latent": "EM*E"}
# seeds whose greedy tokens keep a top-2 logit margin above 1e-3 (some others fall below 1e-4)
SEEDS = {"dense": 2, "moe": 3, "latent": 0}
# dense: a clamp on both sides (the key honoured); the others: transformers 5.25's default
LIMITS = {"dense": (0.05, 0.5), "moe": (0.0, float("inf")), "latent": (0.0, float("inf"))}


def build(tmp_path_factory, variant: str, seed: int | None = None):
    from transformers import NemotronHConfig
    from transformers import NemotronHForCausalLM as HFNemotronH

    latent = 48 if variant == "latent" else None
    cfg = NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, hybrid_override_pattern=PATTERNS[variant],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=48,
        mamba_num_heads=6, mamba_head_dim=16, ssm_state_size=8, n_groups=2, chunk_size=16,
        time_step_limit=LIMITS[variant], n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, moe_shared_expert_intermediate_size=40, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, moe_latent_size=latent,
        initializer_range=0.1, mamba_ssm_cache_dtype="float32", max_position_embeddings=512,
    )  # fmt: skip
    hf = seeded(HFNemotronH, cfg, seed=SEEDS[variant] if seed is None else seed)
    with torch.no_grad():  # a non-zero selection bias, so that its role is tested
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0.0, 0.05)
    folder = save_model(hf, tmp_path_factory.mktemp(f"nemotron_h_{variant}"))
    return folder, hf


@pytest.fixture(scope="module", params=["moe", "dense"])
def checkpoint(request, tmp_path_factory):
    return build(tmp_path_factory, request.param)


def test_prefill_logits_match(checkpoint):
    check_prefill_logits(*checkpoint)


def test_prefill_logits_match_latent_moe(tmp_path_factory):
    check_prefill_logits(*build(tmp_path_factory, "latent"))


def _fresh_model(folder, dtype=torch.float32) -> NemotronHForCausalLM:
    config = json.loads((folder / "config.json").read_text())
    return NemotronHForCausalLM(NemotronHForCausalLM.config_class.from_hf(config)).to(dtype)


def test_loads_transformers_in_memory_names(checkpoint):
    """`model.*` names with stacked experts (transformers' own form) load like the checkpoint."""
    folder, hf = checkpoint
    model = _fresh_model(folder)
    model.load_weights((n, t.detach()) for n, t in hf.state_dict().items())
    reference = _fresh_model(folder)
    reference.load_weights(iter_weights(folder))
    for (name, got), (_, want) in zip(
        model.state_dict().items(), reference.state_dict().items(), strict=True
    ):
        assert torch.equal(got, want), name


def test_router_stays_float32(checkpoint):
    """bf16 model, float32 router (transformers' `_keep_in_fp32_modules_strict`)."""
    folder, hf = checkpoint
    model = _fresh_model(folder, torch.bfloat16)
    model.load_weights(iter_weights(folder))
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    router = {name: dtype for name, dtype in dtypes.items() if ".mixer.gate." in name}
    assert len(router) == 2 * hf.config.layers_block_type.count("moe")
    assert set(router.values()) <= {torch.float32}
    assert dtypes["backbone.norm_f.weight"] == torch.bfloat16


def test_config_as_transformers_saves_it(checkpoint):
    """transformers 5 saves NemotronH configs without num_hidden_layers; the layout list
    gives the count."""
    folder, _ = checkpoint
    assert "num_hidden_layers" not in json.loads((folder / "config.json").read_text())
    engine = Engine(str(folder), dtype="float32")
    assert engine.plan.attention_groups


def test_dt_limit_reads_time_step_limit_as_transformers_5_25_does():
    """dt_limit = time_step_limit (alias mamba_dt_limit), default (0, inf); time_step_min is an
    initialisation key only since transformers 5.25. A malformed limit is a one-line error."""
    config_class = NemotronHForCausalLM.config_class
    assert config_class.from_hf({}).dt_limit == (0.0, float("inf"))
    assert config_class.from_hf({"time_step_min": 0.3}).dt_limit == (0.0, float("inf"))
    assert config_class.from_hf({"time_step_limit": [0.01, 2]}).dt_limit == (0.01, 2.0)
    assert config_class.from_hf({"mamba_dt_limit": [0.02, 3.0]}).dt_limit == (0.02, 3.0)
    model = NemotronHForCausalLM(config_class.from_hf({
        "hidden_size": 32, "hybrid_override_pattern": "M", "mamba_num_heads": 4,
        "mamba_head_dim": 8, "n_groups": 2, "ssm_state_size": 8, "vocab_size": 16,
        "time_step_limit": [0.01, 2],
    }), )  # fmt: skip
    mixers = [m for m in model.modules() if hasattr(m, "dt_limit")]
    assert mixers and all(m.dt_limit == (0.01, 2.0) for m in mixers)
    with pytest.raises(ConfigError, match="time_step_limit must be two numbers"):
        config_class.from_hf({"time_step_limit": [0.1]})
