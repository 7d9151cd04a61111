"""`benchmarks/throughput.py` on its Qwen3-Next model path: tiny sizes, a few seconds."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"


def _module():
    spec = importlib.util.spec_from_file_location("throughput_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_qwen3next_100m_shape():
    """The benchmark's Qwen3-Next model: 3 gated-delta-net layers per attention layer, linear
    key/value head dim 128 (what vLLM-CPU's bf16 kernel takes), a MoE on every layer."""
    import transformers

    module = _module()
    arch, fields = module.MODELS["qwen3next-100m"]
    config_class, _, common = module.ARCHITECTURES[arch]
    cfg = getattr(transformers, config_class)(**fields, **common)
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"] * 1 + [
        "linear_attention"
    ] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.linear_key_head_dim == cfg.linear_value_head_dim == 128
    assert cfg.hidden_size == 768 and cfg.vocab_size == 32000
    assert cfg.num_experts > 0 and cfg.decoder_sparse_step == 1 and not cfg.mlp_only_layers


def test_qwen3next_tiny_bf16_run(capsys):
    module = _module()
    argv = ["--models", "qwen3next-tiny", "--requests", "2", "--new-tokens", "4"]
    assert module.main([*argv, "--dtype", "bfloat16", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by = {r["engine"]: r for r in rows}
    assert set(by) == {"transformers", "hybridkv"}
    assert by["transformers"]["dtype"] == "float32"  # --transformers-dtype's default
    assert by["hybridkv"]["dtype"] == "bfloat16"
    for r in rows:
        assert r["model"] == "qwen3next-tiny" and r["output_tokens"] == 8
        assert r["tokens_per_s"] > 0 and r["vs_transformers"] > 0
