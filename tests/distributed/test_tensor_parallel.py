"""Tensor parallelism on this CPU: 2 processes over gloo give transformers' greedy tokens (and
so TP=1's) for the sharded families, under block and page allocation, prefix caching with a
second round that extends the first, and a pool small enough to preempt; a dead or stopped
worker ends the run within the timeout with a clear error.

Spawning a rank costs seconds, so each engine serves several checks."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hybridkv.distributed.runtime import TensorParallelError
from hybridkv.engine import Engine
from hybridkv.sampling_params import SamplingParams
from tests.models.conformance import MIN_MARGIN, NEW_TOKENS, make_family
from tests.models.utils import engine_greedy, prompts, reference_greedy, save_model, seeded

VOCAB = 96


def granite(tmp_path_factory):
    """Granite MoE with RoPE: one Mamba2 group (replicated on both ranks, its gated norm
    spanning them), 2 KV heads (one per rank), vocabulary split 48 + 48."""
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    cfg = GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=32, shared_intermediate_size=48,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        layer_types=["mamba", "attention", "mamba", "attention"], mamba_n_heads=8,
        mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16,
        num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope",
        initializer_range=0.1, attention_multiplier=0.25, embedding_multiplier=2.0,
        residual_multiplier=0.7, logits_scaling=1.5, max_position_embeddings=512,
    )  # fmt: skip
    hf = seeded(GraniteMoeHybridForCausalLM, cfg)
    return save_model(hf, tmp_path_factory.mktemp("granite-tp")), hf


@pytest.fixture(scope="module")
def granite_family(tmp_path_factory):
    folder, hf = granite(tmp_path_factory)
    return make_family(folder, hf, VOCAB)


def tp2(folder, **kwargs) -> Engine:
    return Engine(str(folder), dtype="float32", tensor_parallel_size=2, **kwargs)


def test_granite_block_mode_and_multi_turn(granite_family) -> None:
    """Block mode: every prompt as transformers; then a second turn that extends the first
    turn's prompts and answers hits the prefix cache (blocks and state snapshots)."""
    fam = granite_family
    engine = tp2(fam.folder, kernel_block_size=4)
    try:
        assert engine.plan.tensor_parallel_size == 2
        mixer = engine.model.model.layers[0].mamba
        assert (mixer.n_heads, mixer.n_groups, mixer.norm_spans_ranks) == (4, 1, True)
        assert engine.model.lm_head.weight.shape == (VOCAB // 2, 64)
        assert engine_greedy(engine, fam.plain, NEW_TOKENS) == fam.plain_ref
        hits = engine.cache.stats.hit_tokens
        assert engine_greedy(engine, fam.turns, NEW_TOKENS) == fam.turn_ref
        assert engine.cache.stats.hit_tokens - hits >= sum(map(len, fam.plain[:4]))
    finally:
        engine.shutdown()


def test_granite_page_mode_shared_prefix(granite_family) -> None:
    fam = granite_family
    engine = tp2(fam.folder, allocation="page")
    try:
        assert engine_greedy(engine, fam.shared[:3], NEW_TOKENS) == fam.shared_ref[:3]
        assert engine_greedy(engine, fam.shared, NEW_TOKENS) == fam.shared_ref
        # prompt log-probs (every rank computes the same lm_head slices) and logits
        # processing (on rank 0's gathered logits) as in one process
        single = Engine(str(fam.folder), dtype="float32", allocation="page")
        params = SamplingParams(max_tokens=4, prompt_logprobs=2, logprobs=1, temperature=0,
                                presence_penalty=1.5, logit_bias={3: 2.0})  # fmt: skip
        got, want = (_run_one(e, fam.plain[1], params) for e in (engine, single))
        assert got.token_ids == want.token_ids
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a.keys() == b.keys()
            assert all(abs(a[k] - b[k]) < 1e-4 for k in a)
    finally:
        engine.shutdown()


def _run_one(engine: Engine, prompt: list[int], params: SamplingParams):
    req = engine.add_request(prompt, params)
    while engine.has_unfinished:
        for out in engine.step():
            if out.request_id == req.request_id and out.finished:
                return out
    raise AssertionError("the request did not finish")


def test_granite_small_pool_preempts(granite_family) -> None:
    fam = granite_family
    engine = tp2(fam.folder, num_pages=14, kernel_block_size=8, max_num_batched_tokens=13)
    try:
        assert engine_greedy(engine, fam.plain, NEW_TOKENS) == fam.plain_ref
        assert engine.scheduler.num_preemptions > 0, "the small pool never preempted"
    finally:
        engine.shutdown()


def llama_checkpoint(tmp_path_factory):
    """Llama with one KV head (replicated on both ranks), biases (a row-parallel bias is added
    once), an odd vocabulary (the second rank's rows padded) tied to the embeddings."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, attention_bias=True, mlp_bias=True,
        initializer_range=0.1, max_position_embeddings=512, tie_word_embeddings=True,
    )  # fmt: skip
    hf = seeded(LlamaForCausalLM, cfg)
    return save_model(hf, tmp_path_factory.mktemp("llama-tp")), hf


def bamba_checkpoint(tmp_path_factory):
    """Bamba with 2 Mamba2 groups (one per rank: the norm groups stay local)."""
    from transformers import BambaConfig, BambaForCausalLM

    cfg = BambaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, attn_layer_indices=[1, 3],
        mamba_n_heads=8, mamba_d_head=16, mamba_expand=2, mamba_d_state=8, mamba_n_groups=2,
        mamba_chunk_size=16, initializer_range=0.1, max_position_embeddings=512,
    )  # fmt: skip
    hf = seeded(BambaForCausalLM, cfg)
    return save_model(hf, tmp_path_factory.mktemp("bamba-tp")), hf


def qwen3_next_checkpoint(tmp_path_factory):
    """Qwen3-Next: gated attention, gated delta net (2 key / 4 value heads: one / two per
    rank), MoE with a shared expert, restacked experts loaded whole and sliced."""
    from tests.models.test_qwen3_next import build

    return build(tmp_path_factory, "qwen3_next")


def qwen3_checkpoint(tmp_path_factory):
    """Qwen3 with per-head q/k norms and sliding-window layers (max_window_layers)."""
    from tests.models.test_llama import build_qwen3

    hf = build_qwen3(sliding=True)
    return save_model(hf, tmp_path_factory.mktemp("qwen3-tp")), hf


def qwen3_5_checkpoint(tmp_path_factory):
    """Qwen3.5 dense: gated delta net with separate projections and a dense MLP."""
    from tests.models.test_qwen3_next import build

    return build(tmp_path_factory, "qwen3_5")


def qwen3_5_moe_checkpoint(tmp_path_factory):
    """Qwen3.5 MoE: the gated delta net's separate qkv / z / b / a projections."""
    from tests.models.test_qwen3_next import build

    return build(tmp_path_factory, "qwen3_5_moe")


def nemotron_h_checkpoint(tmp_path_factory):
    """Nemotron-H MoE ("ME*E"): 6 Mamba2 heads in 2 groups (one group per rank, the norm
    grouped by them), sigmoid-routed experts and the shared expert reduced once."""
    from tests.models.test_nemotron_h import build

    return build(tmp_path_factory, "moe")


def gemma3_checkpoint(tmp_path_factory):
    """Gemma 3: sliding and global layers, (1 + weight) q/k norms, GELU MLP."""
    from tests.models.test_gemma3 import build_defaults

    hf = build_defaults()
    return save_model(hf, tmp_path_factory.mktemp("gemma3-tp")), hf


def gpt_oss_checkpoint(tmp_path_factory):
    """gpt-oss: attention sinks split by head, interleaved gate/up experts with biases (the
    down bias added once), sliding and full layers."""
    from tests.models.test_gpt_oss import build_default

    hf = build_default()
    return save_model(hf, tmp_path_factory.mktemp("gpt-oss-tp")), hf


def mamba2_checkpoint(tmp_path_factory):
    """Pure Mamba2 (no attention: one state page per request), 8 groups: 4 per rank."""
    from tests.models.test_mamba2 import build

    return build(tmp_path_factory, "defaults")


def falcon_h1_checkpoint(tmp_path_factory):
    """Falcon-H1 with every muP multiplier (the Mamba2 projection's per-slice scales taken per
    rank), biases, 2 groups with the norm, tied embeddings."""
    from tests.models.test_falcon_h1 import _mup, build

    def four_heads():  # the family test's muP model has 3 attention heads
        cfg = _mup()
        cfg.num_attention_heads = 4
        return cfg

    return build(tmp_path_factory, "mup", builder=four_heads, seed=1)


@pytest.mark.parametrize(
    "build",
    [llama_checkpoint, qwen3_checkpoint, bamba_checkpoint, qwen3_next_checkpoint,
     qwen3_5_checkpoint, qwen3_5_moe_checkpoint, nemotron_h_checkpoint, gemma3_checkpoint,
     gpt_oss_checkpoint, mamba2_checkpoint, falcon_h1_checkpoint],
    ids=["llama", "qwen3", "bamba", "qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h",
         "gemma3", "gpt_oss", "mamba2", "falcon_h1"],
)  # fmt: skip
def test_family_matches_transformers_and_tp1(build, tmp_path_factory) -> None:
    folder, hf = build(tmp_path_factory)
    ids = prompts(hf.config.vocab_size, [5, 17, 33, 48, 9, 40])
    ref, margin = reference_greedy(hf, ids, 16)
    assert margin > MIN_MARGIN
    single = Engine(str(folder), dtype="float32", kernel_block_size=8)
    assert engine_greedy(single, ids, 16) == ref
    engine = tp2(folder, kernel_block_size=8)
    try:
        assert engine_greedy(engine, ids, 16) == ref
    finally:
        engine.shutdown()


def test_unsharded_family_is_refused(tmp_path_factory, monkeypatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    import hybridkv.models.llama

    monkeypatch.setattr(hybridkv.models.llama.LlamaForCausalLM, "tensor_parallel", False)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
                      num_hidden_layers=1, num_attention_heads=2)  # fmt: skip
    folder = save_model(seeded(LlamaForCausalLM, cfg), tmp_path_factory.mktemp("unsharded"))
    with pytest.raises(ValueError, match="does not run with tensor_parallel_size > 1") as err:
        tp2(folder)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("fault", ["killed", "stopped"])
def test_lost_worker_ends_the_run(granite_family, fault: str) -> None:
    """A killed worker fails the next step at once; a stopped (hung) one within the
    collective timeout. Either way the engine raises a clear error and stays failed."""
    timeout = 4.0
    engine = tp2(granite_family.folder, distributed_timeout_s=timeout)
    worker = engine.runner.group.processes[0]
    try:
        engine_greedy(engine, granite_family.plain[:2], 4)  # it works first
        if fault == "killed":
            worker.kill()
            worker.join(5)
        else:
            os.kill(worker.pid, signal.SIGSTOP)
        engine.add_request(granite_family.plain[0])
        start = time.monotonic()
        with pytest.raises(TensorParallelError, match="rank 1|did not answer") as err:
            while engine.has_unfinished:
                engine.step()
        assert time.monotonic() - start < timeout + 10
        assert "\n" not in str(err.value)
        with pytest.raises(TensorParallelError):
            engine.step()
    finally:
        if fault == "stopped" and worker.is_alive():
            os.kill(worker.pid, signal.SIGCONT)
        engine.shutdown()
    assert not worker.is_alive()


def test_collectives_are_counted(granite_family) -> None:
    """The all-reduce wrapper counts bytes: one decode step of one request moves, per layer,
    one hidden vector per all-reduce (attention/mixer, MLP) plus the embedding and norm sums."""
    engine = tp2(granite_family.folder)
    try:
        counter = engine.tp.counter
        engine_greedy(engine, [granite_family.plain[0]], 2)
        counter.reset()
        engine.add_request(granite_family.plain[1], None)
        engine.step()  # prefill of 17 tokens
        prefill = counter.all_reduce_bytes
        assert prefill > 0 and counter.gather_bytes > 0
        counter.reset()
        engine.step()  # one decode token
        hidden = 64 * torch.float32.itemsize
        # embedding + 4 mixers + 4 MLPs = 9 hidden vectors; 2 gated norms of 1 group each
        assert counter.all_reduce_bytes == 9 * hidden + 2 * 1 * 4
        assert prefill == 17 * counter.all_reduce_bytes
    finally:
        engine.shutdown()


def test_qwen3_next_reduces_each_moe_once(tmp_path_factory) -> None:
    """Every layer MoE: a decode step all-reduces the embedding, then per layer the mixer and
    the routed experts with the gated shared expert together (the gate is replicated)."""
    from tests.models.test_qwen3_next import build

    folder, hf = build(tmp_path_factory, "qwen3_next_all_moe", seed=1)
    engine = tp2(folder)
    try:
        counter = engine.tp.counter
        engine.add_request(prompts(hf.config.vocab_size, [9])[0], None)
        engine.step()  # prefill
        counter.reset()
        engine.step()  # one decode token
        assert counter.all_reduce_calls == 1 + 2 * hf.config.num_hidden_layers
    finally:
        engine.shutdown()


def test_failed_setup_leaves_no_worker(granite_family) -> None:
    """A pool too small for any request fails the set-up in one line; the worker rank 0
    started is gone with it."""
    import multiprocessing

    with pytest.raises(ValueError, match="is too small") as err:
        tp2(granite_family.folder, num_pages=2)
    assert "\n" not in str(err.value)
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not multiprocessing.active_children()
