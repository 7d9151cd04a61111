"""Plans of MLA models for the cuda MLA backends: the page tokens and kernel block sizes each
accepts (FlashMLA 64, CUTLASS MLA 128, FlashInfer MLA 32/64), that their groups run on the
triton backend (and the plan says so), and one-line errors where no size fits."""

from __future__ import annotations

import json

import pytest

from hybridkv.config import CacheConfig
from hybridkv.entrypoints.cli import main as cli_main
from hybridkv.kv.plan import PlanError, PlanTarget, make_plan
from hybridkv.kv.presets import load_preset
from hybridkv.kv.specs import CacheLayer, MLASpec
from hybridkv.models.registry import plan_for_config

DEEPSEEK = "deepseek-ai/DeepSeek-V3"
KIMI = "moonshotai/Kimi-Linear-48B-A3B-Instruct"
GIB = 2**30

# (model, backend) -> (page_tokens, kernel_block_size, blocks_per_page) of the MLA group
EXPECTED = {
    (DEEPSEEK, "flashmla"): (64, 64, 1),
    (DEEPSEEK, "cutlass_mla"): (128, 128, 1),
    (DEEPSEEK, "flashinfer_mla"): (32, 32, 1),
    # Kimi-Linear: the page holds one KDA state; the MLA group splits it into kernel blocks
    (KIMI, "flashmla"): (1024, 64, 16),
    (KIMI, "cutlass_mla"): (1024, 128, 8),
    (KIMI, "flashinfer_mla"): (992, 32, 31),
}


def mla_group(plan):
    return next(g for g in plan.groups if g.kind == "mla")


@pytest.mark.parametrize(("model", "backend"), list(EXPECTED))
def test_plan_cli_shows_page_tokens_and_kernel_blocks(model, backend, capsys):
    args = ["plan", "--model", model, "--platform", "cuda", "--backend", backend]
    assert cli_main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    group = next(g for g in out["groups"] if g["kind"] == "mla")
    got = (group["page_tokens"], group["kernel_block_size"], group["blocks_per_page"])
    assert got == EXPECTED[(model, backend)]
    assert (group["backend"], group["runs"]) == (backend, "triton")
    assert cli_main(args) == 0
    text = capsys.readouterr().out
    assert f"{backend} (runs triton)" in text


def test_cuda_defaults_to_flashmla_sizes():
    plan = plan_for_config(load_preset(DEEPSEEK), CacheConfig(platform="cuda", memory_bytes=GIB))
    group = mla_group(plan)
    assert (group.backend, group.runner, group.kernel_block_size) == ("flashmla", "triton", 64)
    cpu = plan_for_config(load_preset(DEEPSEEK), CacheConfig(platform="cpu", memory_bytes=GIB))
    assert mla_group(cpu).runner == "torch"


def test_float32_mla_on_cuda_takes_the_next_default_that_serves_it():
    """FlashMLA's declaration takes half precision and fp8 only: a float32 MLA model on CUDA
    (a test model on a GPU) gets the triton backend, the platform's next default, instead of
    an error; asked for by name, flashmla still refuses it in one line."""
    layers = [CacheLayer("model.layers.0.self_attn.attn", 0, MLASpec(32, 8, "float32"))]
    target = PlanTarget(compute_dtype="float32")
    plan = make_plan(layers, CacheConfig(platform="cuda", num_pages=8), "M", target)
    group = mla_group(plan)
    assert (group.backend, group.runner) == ("triton", "triton")
    assert group.kernel_block_size % 16 == 0
    cache = CacheConfig(platform="cuda", attention_backend="flashmla", num_pages=8)
    with pytest.raises(PlanError, match="'flashmla' cannot serve mla layers: it runs dtypes"):
        make_plan(layers, cache, "M", target)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--backend", "flashmla", "--kernel-block-size", "32"], "not accepted by flashmla"),
        (["--backend", "cutlass_mla", "--page-tokens", "96"], "no kernel block size divides"),
        (["--backend", "flashinfer_mla", "--page-tokens", "48"], "no kernel block size divides"),
        (["--backend", "flashinfer"], "cannot serve mla layers"),
    ],
)
def test_no_size_fits_is_one_line_exit_2(extra, message, capsys):
    code = cli_main(["plan", "--model", DEEPSEEK, "--platform", "cuda", *extra])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1


def test_a_machine_without_triton_is_refused_the_triton_run_mla_backends():
    layers = [CacheLayer("model.layers.0.self_attn.attn", 0, MLASpec(32, 8, "bfloat16"))]
    cache = CacheConfig(platform="cuda", attention_backend="flashmla", num_pages=8)
    target = PlanTarget(compute_dtype="bfloat16", capabilities=frozenset({"native"}))
    with pytest.raises(PlanError, match="needs triton") as info:
        make_plan(layers, cache, "DeepseekV3ForCausalLM", target)
    assert "\n" not in str(info.value)
