"""Per-rank memory plans: each module declares its shard's spec, so the plan follows the
tensor-parallel size. Checked against the reference rule (DESIGN.md section 3) computed here
from the real configs by hand: KV heads split until each rank has one, then replicated; state
heads keep splitting; Mamba2 groups replicated when the size exceeds them."""

from __future__ import annotations

import math

import pytest

from hybridkv.config import CacheConfig
from hybridkv.entrypoints.cli import main
from hybridkv.kv.presets import load_model_config
from hybridkv.models.registry import plan_for_config

SIZES = (1, 2, 4, 8)


def kv_per_rank(kv: int, size: int) -> int:
    return kv // size if kv >= size else 1


def mamba2_bytes(c: dict, size: int, ssm_bytes: int) -> int:
    """conv [I/size + 2 * groups_per_rank * N, d_conv - 1] bf16 + ssm [H/size, P, N]."""
    heads = c.get("mamba_n_heads") or c["mamba_num_heads"]
    head_dim = c.get("mamba_d_head") or c["mamba_head_dim"]
    groups = c.get("mamba_n_groups") or c["n_groups"]
    state = c.get("mamba_d_state") or c["ssm_state_size"]
    d_conv = c.get("mamba_d_conv") or c["conv_kernel"]
    groups_per_rank = groups // size if groups % size == 0 else 1
    conv_dim = heads * head_dim // size + 2 * groups_per_rank * state
    return conv_dim * (d_conv - 1) * 2 + heads // size * head_dim * state * ssm_bytes


def gdn_bytes(c: dict, size: int) -> int:
    hk, hv = c["linear_num_key_heads"] // size, c["linear_num_value_heads"] // size
    k, v = c["linear_key_head_dim"], c["linear_value_head_dim"]
    conv = (2 * hk * k + hv * v) * (c["linear_conv_kernel_dim"] - 1) * 2
    return conv + hv * k * v * 2


def reference_page_tokens(model: str, size: int, align: int) -> tuple[int, int]:
    """(page_tokens, page_bytes) of one rank by the reference rule."""
    c = load_model_config(model)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    attention = 2 * kv_per_rank(c["num_key_value_heads"], size) * head_dim * 2
    if "linear_num_key_heads" in c:
        state = gdn_bytes(c, size)
    else:
        ssm_bytes = 4 if c.get("mamba_ssm_cache_dtype") == "float32" else 2
        state = mamba2_bytes(c, size, ssm_bytes)
    tokens = align * math.ceil(state / (align * attention))
    return tokens, tokens * attention


def plan(model: str, size: int, backend: str):
    cache = CacheConfig(memory_bytes=40 * 2**30, platform="cuda", attention_backend=backend)
    return plan_for_config(load_model_config(model), cache, tensor_parallel_size=size)


@pytest.mark.parametrize("size", SIZES)
def test_qwen3_next_per_rank_pages(size: int) -> None:
    """544 tokens at TP 1 and 2, 272 at 4, 144 at 8 with 16-token alignment (FlashAttention,
    Triton; vLLM's FlashInfer off Blackwell). hybridkv's FlashInfer declaration refuses
    16-token blocks at head dim 256 (align 32): 544, 544, 288, 160."""
    model = "Qwen/Qwen3-Next-80B-A3B-Instruct"
    got = plan(model, size, "flash_attn")
    assert got.tensor_parallel_size == size
    assert (got.page_tokens, got.page_bytes) == reference_page_tokens(model, size, 16)
    assert got.page_tokens == {1: 544, 2: 544, 4: 272, 8: 144}[size]
    flashinfer = plan(model, size, "flashinfer")
    assert flashinfer.page_tokens == reference_page_tokens(model, size, 32)[0]
    assert flashinfer.page_tokens == {1: 544, 2: 544, 4: 288, 8: 160}[size]
    for group in flashinfer.attention_groups:
        assert group.kernel_block_size == 32
        assert group.blocks_per_page == flashinfer.page_tokens // 32


@pytest.mark.parametrize(
    "model,sizes",
    [
        ("ibm-granite/granite-4.0-h-small", SIZES),
        ("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", SIZES),
        ("ibm-granite/granite-4.0-h-tiny", (1, 2, 4)),  # 12 heads: TP 8 does not divide
    ],
)
def test_mamba2_hybrids_per_rank_pages(model: str, sizes: tuple[int, ...]) -> None:
    for size in sizes:
        got = plan(model, size, "flashinfer")
        assert (got.page_tokens, got.page_bytes) == reference_page_tokens(model, size, 16), size
        for group in got.attention_groups:
            assert group.page_tokens == got.page_tokens
            assert group.kernel_block_size * group.blocks_per_page == got.page_tokens
            assert group.kernel_block_size in (16, 32, 64)


def test_state_specs_are_per_rank() -> None:
    """Granite-4.0-H-Small at TP 8: 16 Mamba2 heads, the one group replicated (conv channels
    1024 + 2 * 128), one KV head (8 / 8) of head dim 128."""
    got = plan("ibm-granite/granite-4.0-h-small", 8, "flashinfer").to_json()
    attention = next(g for g in got["groups"] if g["kind"] == "attention")
    mamba = next(g for g in got["groups"] if g["kind"] == "mamba2")
    shapes = {t["name"]: t["shape"] for t in mamba["spec"]["tensors"]}
    assert shapes == {"conv": [1024 + 256, 3], "ssm": [16, 64, 128]}
    assert attention["spec"]["num_kv_heads"] == 1


def test_cli_prints_the_per_rank_plan(capsys) -> None:
    assert main(["plan", "--model", "Qwen/Qwen3-Next-80B-A3B-Instruct", "--backend",
                 "triton", "--tensor-parallel-size", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "per rank of tensor_parallel_size 4" in out
    assert "page_tokens         272" in out


KIMI, DEEPSEEK = "moonshotai/Kimi-Linear-48B-A3B-Instruct", "deepseek-ai/DeepSeek-V3"
MLA_ALIGN = {"flashmla": 64, "flashinfer_mla": 32}  # smallest kernel block each accepts


def mla_bytes(c: dict) -> int:
    """Bytes per token of one MLA layer: the latent and the rope key, bf16, no K/V pair. Every
    rank caches the whole row (the latent is shared by the heads), at any size."""
    return (c["kv_lora_rank"] + c["qk_rope_head_dim"]) * 2


def kda_bytes(c: dict, size: int) -> int:
    """One rank's KDA state: 3 convs [H/size * D, kernel - 1] + recurrent [H/size, D, D], bf16."""
    linear = c["linear_attn_config"]
    heads, dim = linear["num_heads"] // size, linear["head_dim"]
    return 3 * heads * dim * (linear["short_conv_kernel_size"] - 1) * 2 + heads * dim * dim * 2


# Kimi-Linear-48B-A3B by hand: A = (512 + 64) * 2 = 1152 bytes per token; the KDA state at size
# s is M = (3 * 4096 * 3 * 2 + 32 * 128 * 128 * 2) / s = 1122304 / s bytes, so M / A = 974.2 / s
# tokens: page_tokens = align * ceil(974.2 / (s * align)) -> (page_tokens, kernel block,
# blocks per page, state padding bytes) per backend and size.
KIMI_PAGES = {
    "flashmla": {1: (1024, 64, 16, 57344), 2: (512, 64, 8, 28672), 4: (256, 64, 4, 14336),
                 8: (128, 64, 2, 7168)},
    "flashinfer_mla": {1: (992, 32, 31, 20480), 2: (512, 64, 8, 28672),
                       4: (256, 64, 4, 14336), 8: (128, 64, 2, 7168)},
}  # fmt: skip


@pytest.mark.parametrize("backend", list(MLA_ALIGN))
def test_mla_models_per_rank_plans(backend: str) -> None:
    """The MLA bytes per token stay 1152 per rank at every size (the latent replicated); the
    KDA states shrink with the size, so Kimi-Linear's page follows them:
    page_tokens = align * ceil(M / (align * A)). DeepSeek-V3 has no state: its page is the
    backend's smallest kernel block (64 FlashMLA, 32 FlashInfer MLA) at every size."""
    kimi, deepseek, align = load_model_config(KIMI), load_model_config(DEEPSEEK), MLA_ALIGN[backend]
    assert mla_bytes(kimi) == mla_bytes(deepseek) == 1152
    for size in SIZES:
        got = plan(KIMI, size, backend)
        a, m = mla_bytes(kimi), kda_bytes(kimi, size)
        assert (got.attention_bytes_per_token, got.state_bytes) == (a, m) == (1152, 1122304 // size)
        tokens = align * math.ceil(m / (align * a))
        group = got.attention_groups[0]
        seen = (got.page_tokens, group.kernel_block_size, group.blocks_per_page,
                got.state_padding_bytes)  # fmt: skip
        assert seen == KIMI_PAGES[backend][size] and got.page_tokens == tokens, size
        assert got.page_bytes == tokens * a
        assert {g.spec.kind for g in got.attention_groups} == {"mla"}
        assert {g.spec.kv_lora_rank for g in got.attention_groups} == {512}
        shapes = {t.name: t.shape for t in got.state_groups[0].spec.tensors}
        assert shapes["recurrent"] == (32 // size, 128, 128)
        assert shapes["conv_q"] == shapes["conv_k"] == shapes["conv_v"] == (4096 // size, 3)
        ds = plan(DEEPSEEK, size, backend)
        assert (ds.attention_bytes_per_token, ds.state_bytes) == (1152, 0)
        assert (ds.page_tokens, ds.page_bytes) == (align, align * 1152), size
        assert ds.attention_groups[0].kernel_block_size == align
        assert ds.tensor_parallel_size == got.tensor_parallel_size == size


@pytest.mark.parametrize(
    "model,size,message",
    [
        ("ibm-granite/granite-4.0-h-tiny", 8, "does not divide num_attention_heads=12"),
        ("ibm-granite/granite-4.0-h-small", 3, "does not divide mamba n_heads=128"),
        ("ibm-granite/granite-4.0-h-small", 0, "tensor_parallel_size must be an integer >= 1"),
        ("moonshotai/Kimi-Linear-48B-A3B-Instruct", 3,
         "does not divide linear_attn_config.num_heads=32"),
        ("deepseek-ai/DeepSeek-V3", 3, "does not divide num_attention_heads=128"),
    ],
)
def test_cli_refuses_sizes_that_do_not_divide(capsys, model: str, size: int, message: str):
    assert main(["plan", "--model", model, "--tensor-parallel-size", str(size)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1  # one line
