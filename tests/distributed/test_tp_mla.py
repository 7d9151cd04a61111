"""Tensor parallelism for the MLA families on this CPU: DeepSeek-V3 (q LoRA), DeepSeek-V2 (no q
LoRA, biased MLPs, group-limited softmax routing) and Kimi-Linear (KDA + MLA) at TP=2 over two
gloo processes give transformers' greedy tokens, and so TP=1's. Decodes run 16 tokens past
prompts of up to 48 over kernel blocks of 8, so the latent-space decode (W_UK absorbed, W_UV
after, the rank's heads only) reads contexts of several blocks.

Per rank: MLA heads split (the latent and rope key replicated, so the MLASpec is the full one),
KDA heads split (its three conv states and recurrent state per rank), experts and MLPs by
intermediate size, vocabulary rows halved. The head split of the MLA ops is checked without
processes: the rank's heads of q and kv_b_proj give the rank's heads of the full output."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.kv.specs import MLASpec
from hybridkv.ops import mla, registry
from hybridkv.sampling_params import SamplingParams
from tests.models.conformance import MIN_MARGIN
from tests.models.utils import engine_greedy, prompts, reference_greedy, save_model
from tests.ops.mla_cases import make_case

NEW_TOKENS = 16
LENGTHS = [5, 17, 33, 48, 9, 40]
KBS = 8  # kernel block size: every decode here spans several blocks


def deepseek_v3(tmp_path_factory):
    """4 heads (2 per rank), q LoRA 24 (replicated), 16 experts of 16 (8 per rank) + one
    shared, the first 3 of 4 layers dense (48: 24 per rank)."""
    from tests.models.test_deepseek_v3 import build_default

    hf = build_default()
    return save_model(hf, tmp_path_factory.mktemp("deepseek-v3-tp")), hf


def deepseek_v2(tmp_path_factory):
    """4 heads, plain q_proj, biased dense and shared MLPs (the down biases added once)."""
    from tests.models.test_deepseek_v3 import build_v2

    hf = build_v2()
    return save_model(hf, tmp_path_factory.mktemp("deepseek-v2-tp")), hf


def kimi_linear(tmp_path_factory):
    """2 KDA heads of 16 (one per rank), MLA of 4 heads at layer 2 (NoPE, rope key 4)."""
    from tests.models.test_kimi_linear import SEEDS, build

    return build(tmp_path_factory, "kimi_linear", SEEDS["kimi_linear"])


def kimi_linear_lora(tmp_path_factory):
    """q LoRA, MLA on the last layer, conv kernel 3, 2 shared experts, two dense layers."""
    from tests.models.test_kimi_linear import SEEDS, build

    return build(tmp_path_factory, "kimi_linear_lora", SEEDS["kimi_linear_lora"])


def check_rank0_shapes(engine: Engine, hf) -> None:
    """Rank 0's modules hold half of every split dimension; its MLA specs are the full ones."""
    cfg = hf.config
    model = engine.model
    assert engine.plan.tensor_parallel_size == 2
    assert model.lm_head.weight.shape == (cfg.vocab_size // 2, cfg.hidden_size)
    mlas = [m for m in model.modules() if type(m).__name__ == "MultiHeadLatentAttention"]
    assert mlas
    for m in mlas:
        assert m.heads == m.attn.num_heads == cfg.num_attention_heads // 2
        assert m.kv_a_proj_with_mqa.weight.shape[0] == cfg.kv_lora_rank + cfg.qk_rope_head_dim
        v_rows = m.heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        assert m.kv_b_proj.weight.shape == (v_rows, cfg.kv_lora_rank)
    mla_specs = {g.spec for g in engine.plan.groups if g.kind == "mla"}
    assert mla_specs == {MLASpec(cfg.kv_lora_rank, cfg.qk_rope_head_dim, "float32")}


def check_one_reduce_per_block(engine: Engine, hf, prompt: list[int]) -> None:
    """One decode step of one request all-reduces one hidden vector for the embedding and one
    per mixer and per MLP / MoE (the experts' and shared experts' partial sums together)."""
    counter = engine.tp.counter
    engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()  # prefill
    counter.reset()
    engine.step()  # one decode token
    layers = hf.config.num_hidden_layers
    assert counter.all_reduce_calls == 1 + 2 * layers
    assert counter.all_reduce_bytes == (1 + 2 * layers) * hf.config.hidden_size * 4
    while engine.has_unfinished:
        engine.step()


KIMI = (kimi_linear, kimi_linear_lora)


@pytest.mark.parametrize(
    "build", [deepseek_v3, deepseek_v2, *KIMI], ids=["deepseek_v3", "deepseek_v2", "kimi",
                                                      "kimi_lora"]
)  # fmt: skip
def test_tp2_matches_transformers_and_tp1(build, tmp_path_factory) -> None:
    folder, hf = build(tmp_path_factory)
    ids = prompts(hf.config.vocab_size, LENGTHS)
    ref, margin = reference_greedy(hf, ids, NEW_TOKENS)
    assert margin > MIN_MARGIN
    single = Engine(str(folder), dtype="float32", kernel_block_size=KBS)
    assert engine_greedy(single, ids, NEW_TOKENS) == ref
    engine = Engine(str(folder), dtype="float32", tensor_parallel_size=2, kernel_block_size=KBS)
    try:
        check_rank0_shapes(engine, hf)
        if build in KIMI:
            check_kda_rank_specs(engine, single)
        assert engine_greedy(engine, ids, NEW_TOKENS) == ref
        check_one_reduce_per_block(engine, hf, ids[1])
        if build in KIMI:  # a second round: prefix hits on blocks and KDA snapshots
            hits = engine.cache.stats.hit_tokens
            turns = [p + r for p, r in zip(ids[:3], ref[:3], strict=True)]
            turn_ref, _ = reference_greedy(hf, turns, 4)
            assert engine_greedy(engine, turns, 4) == turn_ref
            assert engine.cache.stats.hit_tokens - hits >= sum(map(len, ids[:3]))
    finally:
        engine.shutdown()


def check_kda_rank_specs(engine: Engine, single: Engine) -> None:
    """KDA at TP=2: every state tensor of one rank is half the full one along the heads (the
    three convs' channels, the recurrent heads); the page shrinks with them."""
    full = {t.name: t.shape for t in single.plan.state_groups[0].spec.tensors}
    half = {t.name: t.shape for t in engine.plan.state_groups[0].spec.tensors}
    assert set(half) == {"conv_q", "conv_k", "conv_v", "recurrent"}
    for name in ("conv_q", "conv_k", "conv_v"):
        assert half[name] == (full[name][0] // 2, full[name][1])
    assert half["recurrent"] == (full["recurrent"][0] // 2, *full["recurrent"][1:])
    kda = engine.model.model.layers[0].self_attn
    assert (kda.num_heads, kda.A_log.shape, kda.dt_bias.shape) == (1, (1, 1, 1, 1), (16,))
    assert kda.f_a_proj.weight.shape == (16, 48) and kda.f_b_proj.weight.shape == (16, 16)


@pytest.mark.parametrize("native", ["0", "1"])
def test_a_ranks_heads_give_its_slice_of_the_output(native: str, monkeypatch) -> None:
    """The MLA ops on the rank's heads of q and of kv_b_proj (rows [nope | v] per head) give
    those heads of the full output, for decode rows (native or PyTorch latent decode) and
    prefill chunks alike."""
    from hybridkv.ops.native import mla as native_mla

    monkeypatch.setenv("HYBRIDKV_NATIVE", native)
    registry.reset_all()  # op choices follow the new setting
    if native == "1" and not native_mla.available():
        pytest.skip("native kernels unavailable (no compiler)")
    heads, size = 6, 2
    case = make_case([1, 1, 5, 1], [1, 70, 12, 33], KBS, heads=heads, seed=4)
    args = (case.cache, case.table, case.query_start_loc, case.seq_lens, case.scale)
    full = mla.mla_paged_attention(case.q_nope, case.q_rope, *args, case.w_kv_b, case.nope)
    per_head = case.w_kv_b.shape[0] // heads
    local = heads // size
    for rank in range(size):
        hs = slice(rank * local, (rank + 1) * local)
        rows = case.w_kv_b[rank * local * per_head : (rank + 1) * local * per_head]
        got = mla.mla_paged_attention(case.q_nope[:, hs], case.q_rope[:, hs], *args, rows,
                                      case.nope)  # fmt: skip
        torch.testing.assert_close(got, full[:, hs], rtol=1e-5, atol=1e-6)
