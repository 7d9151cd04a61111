import math

import pytest

from hybridkv.config import CacheConfig
from hybridkv.kv.plan import (
    PlanError,
    PlanTarget,
    hybrid_page_tokens,
    layers_per_group_for,
    make_plan,
    pages_to_kernel_blocks,
    select_kernel_block_size,
    select_state_ops,
    split_bucket,
)
from hybridkv.kv.presets import load_preset, preset_ids
from hybridkv.kv.specs import (
    AttentionSpec,
    CacheLayer,
    StateOps,
    StateSpec,
    StateTensor,
    mamba2_state,
)
from hybridkv.layers.attention.registry import (
    BACKENDS,
    AttentionBackendInfo,
    KernelBlockSizes,
    get_backend,
)
from hybridkv.models.registry import plan_for_config

GIB = 2**30
ATTN_SPEC = AttentionSpec(1, 8, "float32")  # 64 bytes per token per layer


def plan(model_id, **cache):
    cache.setdefault("platform", "cuda")
    cache.setdefault("memory_bytes", 40 * GIB)
    return plan_for_config(load_preset(model_id), CacheConfig(**cache))


def attention_group(p):
    return next(g for g in p.groups if g.kind == "attention")


@pytest.mark.parametrize(
    ("model_id", "page_tokens", "kernel", "per_page"),
    [
        ("Qwen/Qwen3-Next-80B-A3B-Instruct", 544, 32, 17),
        ("ibm-granite/granite-4.0-h-small", 528, 16, 33),
        ("nvidia/NVIDIA-Nemotron-Nano-9B-v2", 672, 32, 21),
        # granite-4.0-tiny-preview has the geometry of granite-4.0-h-tiny (no config of its own).
        ("ibm-granite/granite-4.0-h-tiny", 400, 16, 25),
    ],
)
def test_worked_numbers(model_id, page_tokens, kernel, per_page):
    p = plan(model_id, attention_backend="flashinfer", state_dtype="bfloat16")
    g = attention_group(p)
    assert (p.page_tokens, g.kernel_block_size, g.blocks_per_page) == (
        page_tokens,
        kernel,
        per_page,
    )


def test_granite_small_groups_and_pages():
    p = plan("ibm-granite/granite-4.0-h-small", attention_backend="flashinfer")
    assert p.layers_per_group == 4
    assert [g.kind for g in p.groups].count("mamba2") == 9
    assert p.page_bytes == 528 * 4096
    assert p.num_pages == 40 * GIB // (p.page_bytes * 4)
    assert p.state_padding_bytes == 528 * 4096 - 2147840
    # capacity counts the one growing group only, never divided by the 9 state groups
    assert p.attention_token_capacity == (p.num_pages - 1) * 528


@pytest.mark.parametrize("model_id", [m for m in preset_ids()])
@pytest.mark.parametrize("backend", ["flashinfer", None])
def test_every_hybrid_preset_is_consistent(model_id, backend):
    if backend == "flashinfer" and model_id.split("/")[0] in ("deepseek-ai", "moonshotai"):
        backend = "flashmla"
    p = plan(model_id, attention_backend=backend)
    for g in p.groups:
        if g.is_state:
            assert p.page_bytes >= g.spec.state_bytes
            assert g.padding_bytes == p.page_bytes - g.spec.state_bytes
        else:
            assert g.page_tokens * g.spec.bytes_per_token == p.page_bytes
            assert g.page_tokens % g.kernel_block_size == 0
            assert get_backend(g.backend).accepts(g.kernel_block_size, g.spec.head_dim, p.context)
    if p.is_hybrid:
        a = p.attention_bytes_per_token
        assert p.page_tokens * a >= p.state_bytes
        # the smallest aligned size that fits: one alignment step less would not hold the state
        assert (p.page_tokens - p.align) * a < p.state_bytes
        assert p.page_tokens % p.align == 0
        assert p.state_padding_bytes == p.page_bytes - p.state_bytes


def test_non_hybrid_defaults():
    assert plan("meta-llama/Llama-3.1-8B").page_tokens == 16
    assert plan("meta-llama/Llama-3.1-8B", page_tokens=32).page_tokens == 32
    assert plan("deepseek-ai/DeepSeek-V3").page_tokens == 64  # flashmla
    assert plan("deepseek-ai/DeepSeek-V3", attention_backend="cutlass_mla").page_tokens == 128
    assert plan("meta-llama/Llama-3.1-8B", platform="cpu").page_tokens == 16


def test_user_page_tokens_is_exact_when_it_fits():
    p = plan("ibm-granite/granite-4.0-h-small", page_tokens=1024, attention_backend="flashinfer")
    assert p.page_tokens == 1024 and attention_group(p).kernel_block_size == 64


def test_page_tokens_too_small_for_state():
    with pytest.raises(
        PlanError, match=r"page_tokens=256 is too small for the mamba2 state.*>= 525"
    ):
        plan("ibm-granite/granite-4.0-h-small", page_tokens=256)


def test_budget_too_small():
    with pytest.raises(PlanError, match="memory budget 1000000 bytes is too small"):
        plan("ibm-granite/granite-4.0-h-small", memory_bytes=1_000_000)
    with pytest.raises(PlanError, match="num_pages=5 is too small"):
        plan("ibm-granite/granite-4.0-h-small", memory_bytes=None, num_pages=5)
    assert plan("ibm-granite/granite-4.0-h-small", memory_bytes=None, num_pages=11).num_pages == 11


def test_fp32_state_changes_flash_attn_sizes():
    # vLLM's FlashAttention accepts any multiple of 16, but 16/32/64 for hybrid fp32-state models.
    nano = plan("nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16", attention_backend="flash_attn")
    assert nano.page_tokens == 2096 and attention_group(nano).kernel_block_size == 16
    bf16 = plan(
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        attention_backend="flash_attn",
        state_dtype="bfloat16",
    )
    assert attention_group(bf16).kernel_block_size == bf16.page_tokens


def test_exclusion_raises_alignment():
    # flashinfer refuses (16, head dim 256): Qwen3.5-27B aligns pages to 32 instead of failing.
    p = plan("Qwen/Qwen3.5-27B", attention_backend="flashinfer")
    assert p.align == 32 and attention_group(p).kernel_block_size == 32


# -- kernel block selection rule -------------------------------------------------------------

A = AttentionBackendInfo("a", KernelBlockSizes((48, 64)))
B = AttentionBackendInfo("b", KernelBlockSizes(multiple_of=16))
C = AttentionBackendInfo("c", KernelBlockSizes((16, 32)))


def test_page_tokens_taken_when_every_backend_accepts():
    assert select_kernel_block_size(96, [B], 128) == 96
    assert select_kernel_block_size(64, [A, B], 128) == 64


def test_largest_declared_int_that_divides():
    assert select_kernel_block_size(544, [BACKENDS["flashinfer"]], 128) == 32
    assert select_kernel_block_size(528, [BACKENDS["flashinfer"]], 128) == 16


def test_only_common_size_is_an_int_of_one_and_a_multiple_of_the_other():
    # a accepts 48/64, b any multiple of 16; page 96: 96 is not a's, 64 does not divide, 48 does.
    assert select_kernel_block_size(96, [A, B], 128) == 48
    assert select_kernel_block_size(96, [B, A], 128) == 48


def test_no_common_size_is_an_error():
    with pytest.raises(
        PlanError, match=r"no kernel block size divides page_tokens=96.*a: 48/64; c: 16/32"
    ):
        select_kernel_block_size(96, [A, C], 128)


def test_requested_size_validated():
    assert select_kernel_block_size(528, [B], 128, requested=48) == 48
    with pytest.raises(PlanError, match="kernel_block_size=40 does not divide page_tokens=528"):
        select_kernel_block_size(528, [B], 128, requested=40)
    with pytest.raises(PlanError, match="kernel_block_size=8 is not accepted by b"):
        select_kernel_block_size(528, [B], 128, requested=8)


def test_excluded_combination():
    fi = BACKENDS["flashinfer"]
    assert select_kernel_block_size(528, [fi], 128) == 16
    with pytest.raises(PlanError):
        select_kernel_block_size(528, [fi], 256)
    with pytest.raises(PlanError, match="not accepted"):
        select_kernel_block_size(64, [fi], 256, requested=16)


def test_user_kernel_block_size_through_plan():
    p = plan("ibm-granite/granite-4.0-h-small", kernel_block_size=48, attention_backend="triton")
    assert attention_group(p).kernel_block_size == 48 and attention_group(p).blocks_per_page == 11
    with pytest.raises(PlanError, match="kernel_block_size=32 does not divide page_tokens=528"):
        plan("ibm-granite/granite-4.0-h-small", kernel_block_size=32)


def test_backend_that_cannot_serve_kind():
    with pytest.raises(PlanError, match="'flashmla' cannot serve attention layers"):
        plan("meta-llama/Llama-3.1-8B", attention_backend="flashmla")
    with pytest.raises(PlanError, match="runs dtypes"):
        plan("meta-llama/Llama-3.1-8B", attention_backend="flashinfer", kv_cache_dtype="float32")
    with pytest.raises(ValueError, match="unknown attention backend 'nope'; valid: torch"):
        CacheConfig(attention_backend="nope")


def test_soft_capped_attention_gets_only_a_backend_that_declares_it():
    capped = AttentionSpec(1, 8, "bfloat16", softcap=30.0)
    layers = [CacheLayer("layers.0.attention", 0, capped)]
    assert [n for n, b in BACKENDS.items() if b.impl and b.softcap] == ["torch", "triton"]
    p = make_plan(layers, CacheConfig(num_pages=8, platform="cpu"))
    assert attention_group(p).spec.softcap == 30.0
    for name in ("cpu_attn", "rocm_attn"):
        assert not BACKENDS[name].softcap
        with pytest.raises(PlanError, match=f"'{name}' cannot serve .* no attention logit soft"):
            make_plan(layers, CacheConfig(num_pages=8, platform="cpu", attention_backend=name))
    # the same layer without a cap is served by them; capped and uncapped layers never share
    # a group (their specs differ)
    plain = AttentionSpec(1, 8, "bfloat16")
    assert BACKENDS["cpu_attn"].why_not(plain.kind, plain.dtype, plain.head_dim) is None
    both = make_plan(
        layers + [CacheLayer("layers.1.attention", 1, plain)], CacheConfig(num_pages=8)
    )
    assert sorted(str(g.spec.softcap) for g in both.groups) == ["30.0", "None"]
    with pytest.raises(ValueError, match="softcap must be positive"):
        AttentionSpec(1, 8, "float32", softcap=0.0)


# -- grouping ----------------------------------------------------------------------------------


def test_layers_per_group_rule():
    assert layers_per_group_for([4, 36]) == 4
    assert layers_per_group_for([36, 36]) == 36
    assert layers_per_group_for([10, 14]) == 14  # 14 < 1.5 * 10
    assert layers_per_group_for([10, 15]) == 10


def test_split_bucket_strided():
    names = [f"l{i}" for i in range(10)]
    assert split_bucket(names, 4) == [
        ("l0", "l3", "l6", "l9"),
        ("l1", "l4", "l7"),
        ("l2", "l5", "l8"),
    ]
    assert split_bucket(names, 10) == [tuple(names)]


def test_hybrid_page_tokens_formula():
    assert hybrid_page_tokens(2147840, 4096, 16) == 528
    assert hybrid_page_tokens(16 * 4096, 4096, 16) == 16
    assert hybrid_page_tokens(16 * 4096 + 1, 4096, 16) == 32


def test_pages_to_kernel_blocks():
    assert pages_to_kernel_blocks([2, 5], 3) == [6, 7, 8, 15, 16, 17]
    assert pages_to_kernel_blocks([4], 1) == [4]


def test_tiny_plan_by_hand():
    state = mamba2_state(2, 4, 8, 1, 4, "float32", "float32")  # (8+16)*3 + 64 = 136 elems
    attn = AttentionSpec(1, 4, "float32")  # 32 bytes per token
    layers = [
        CacheLayer("layers.0.mamba", 0, state),
        CacheLayer("layers.1.attention", 1, attn),
        CacheLayer("layers.2.mamba", 2, state),
    ]
    p = make_plan(layers, CacheConfig(num_pages=8, kernel_block_size=4))
    assert p.page_tokens == 32 and p.page_bytes == 1024  # 136*4=544 B -> 17 tokens -> 32
    assert p.layers_per_group == 1 and len(p.groups) == 3
    assert attention_group(p).blocks_per_page == 8
    assert math.isclose(p.state_padding_pct, 100 * (1024 - 544) / 1024)


def test_pure_state_plan_one_state_per_page():
    """No attention layer (Mamba, Mamba2): a page is the largest state rounded up to 64 bytes,
    page_tokens only the prefix-hash block (16 unless given), every group a state group."""
    small = mamba2_state(2, 4, 8, 1, 4, "float32", "float32")  # 136 elements: 544 bytes
    big = mamba2_state(3, 4, 8, 1, 4, "float32", "float32")  # 96 + 28*3 = 180: 720 bytes
    layers = [CacheLayer(f"layers.{i}.mixer", i, s) for i, s in enumerate([small, big, small])]
    p = make_plan(layers, CacheConfig(num_pages=8))
    assert p.page_bytes == 768 and p.state_bytes == 720 and p.attention_bytes_per_token == 0
    assert p.page_tokens == p.hash_block_tokens == p.hit_tokens == 16
    assert not p.attention_groups and len(p.state_groups) == 3  # buckets of 2 and 1: 1 per group
    assert p.attention_token_capacity is None
    assert p.pages_for_one_request(10_000, 256) == len(p.groups)  # nothing grows with length
    assert make_plan(layers, CacheConfig(num_pages=8, page_tokens=48)).hit_tokens == 48
    with pytest.raises(PlanError, match="no cache layers"):
        make_plan([], CacheConfig(num_pages=8))


def test_plan_json_keys():
    j = plan("ibm-granite/granite-4.0-h-small").to_json()
    for key in (
        "page_tokens",
        "page_bytes",
        "num_pages",
        "layers_per_group",
        "state_padding_bytes",
        "groups",
    ):
        assert key in j
    assert set(j["groups"][0]) >= {"kind", "layers", "kernel_block_size", "blocks_per_page"}
    kinds = {g["kind"] for g in j["groups"]}
    assert kinds == {"mamba2", "attention"}


def test_state_spec_layout_is_aligned_and_packed():
    s = StateSpec("mamba2", mamba2_state(3, 4, 5, 1, 4, "bfloat16", "float32").tensors)
    layout = s.layout
    assert [t.name for t, _ in layout] == ["ssm", "conv"]
    assert layout[0][1] == 0 and layout[1][1] == 3 * 4 * 5 * 4


# -- state ops chosen from the layer kind's declaration ------------------------------------------

NATIVE = StateOps("native", "m:N", frozenset({"cpu"}), frozenset({"float32"}), needs="native")
TRITON = StateOps("triton", "m:T", frozenset({"cuda", "rocm"}), needs="triton")
TORCH = StateOps("torch", "m:P")


def _state(dtype="float32", ops=(NATIVE, TRITON, TORCH)):
    return StateSpec("mamba2", (StateTensor("h", (4, 4), dtype),), ops)


@pytest.mark.parametrize(
    ("platform", "state_dtype", "compute", "caps", "chosen"),
    [
        ("cpu", "float32", "float32", {"native"}, "native"),
        ("cpu", "float32", "float32", set(), "torch"),  # no C compiler here
        ("cpu", "bfloat16", "float32", {"native"}, "torch"),  # a bf16 state
        ("cpu", "float32", "bfloat16", {"native"}, "torch"),  # a bf16 model
        ("cuda", "float32", "bfloat16", {"triton"}, "triton"),
        ("cuda", "float32", "float32", set(), "torch"),  # no Triton installed
    ],
)
def test_state_ops_follow_the_declaration(platform, state_dtype, compute, caps, chosen):
    assert select_state_ops(_state(state_dtype), platform, compute, frozenset(caps)) == chosen


def test_requested_state_ops_are_validated():
    spec = _state()
    assert select_state_ops(spec, "cpu", "float32", frozenset(), "torch") == "torch"
    with pytest.raises(PlanError, match="state_backend='fast' is not declared .* native, triton"):
        select_state_ops(spec, "cpu", "float32", frozenset(), "fast")
    with pytest.raises(PlanError, match="'triton' cannot run .* runs on cuda, rocm, not cpu"):
        select_state_ops(spec, "cpu", "float32", frozenset({"triton"}), "triton")
    with pytest.raises(PlanError, match="no declared ops can run"):
        select_state_ops(_state(ops=(NATIVE,)), "cpu", "float32", frozenset(), None)
    assert select_state_ops(_state(ops=()), "cpu", "float32") is None  # plan-only kinds


@pytest.mark.parametrize(
    ("compute", "caps", "chosen"),
    [
        ("bfloat16", {"triton", "fla"}, "fla"),  # flash-linear-attention installed
        ("float16", {"triton", "fla"}, "fla"),
        ("float32", {"triton", "fla"}, "triton"),  # its matrix products would round to TF32
        ("bfloat16", {"triton"}, "triton"),  # not installed
    ],
)
@pytest.mark.parametrize("kind", ["gdn", "kda"])
def test_linear_attention_ops_take_fla_where_installed_for_half_precision(
    kind, compute, caps, chosen
):
    """GDN takes fla by default where it runs; KDA's fla ops are opt-in (declared after
    triton: their accuracy on a GPU is not understood yet), the same rules when asked for."""
    from hybridkv.layers.gated_delta_net import GDN_OPS
    from hybridkv.layers.kda import KDA_OPS

    ops = {"gdn": GDN_OPS, "kda": KDA_OPS}[kind]
    spec = StateSpec(kind, (StateTensor("recurrent", (2, 8, 8), "float32"),), ops)
    if kind == "kda":
        assert select_state_ops(spec, "cuda", compute, frozenset(caps)) == "triton"
        if chosen == "fla":
            assert select_state_ops(spec, "cuda", compute, frozenset(caps), "fla") == "fla"
    else:
        assert select_state_ops(spec, "cuda", compute, frozenset(caps)) == chosen
    assert select_state_ops(spec, "cpu", compute, frozenset({"fla", "native"})) != "fla"
    with pytest.raises(PlanError, match="'fla' cannot run .* computes in bfloat16, float16, "
                       "not float32"):  # fmt: skip
        select_state_ops(spec, "cuda", "float32", frozenset(caps), "fla")


def test_plan_shows_units_and_prefix_granularity():
    layers = [CacheLayer("a", 0, ATTN_SPEC), CacheLayer("s", 1, _state())]
    block = make_plan(layers, CacheConfig(num_pages=8, kernel_block_size=16, page_tokens=64))
    page = make_plan(
        layers, CacheConfig(num_pages=8, kernel_block_size=16, page_tokens=64, allocation="page")
    )
    (attn,) = block.attention_groups
    assert (attn.unit_tokens, attn.blocks_per_unit, attn.units_per_page) == (16, 1, 4)
    assert (block.hash_block_tokens, block.hit_tokens) == (16, 16)
    (attn,) = page.attention_groups
    assert (attn.unit_tokens, attn.blocks_per_unit, attn.units_per_page) == (64, 4, 1)
    assert (page.hash_block_tokens, page.hit_tokens) == (64, 64)
    j = block.to_json()
    assert j["hit_tokens"] == 16 and j["groups"][1]["spec"]["ops"] == ["native", "triton", "torch"]
    assert block.state_groups[0].backend == "native" and page.groups[1].layer_ids == (1,)


def test_automatic_budget_sizes_the_pool_for_max_num_seqs():
    layers = [CacheLayer("a", 0, ATTN_SPEC), CacheLayer("s", 1, _state())]
    plan = make_plan(layers, CacheConfig(page_tokens=64), target=PlanTarget(256, 10))
    # per request: 2 state pages + 256 / 64 attention pages; one null page
    assert plan.num_pages == 10 * (2 + 4) + 1
    with pytest.raises(PlanError, match="max_model_len=.* lower max_model_len"):
        make_plan(layers, CacheConfig(page_tokens=64), target=PlanTarget(2**40, 10))
