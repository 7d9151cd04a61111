"""Qwen3-Next in bfloat16 on the native CPU kernels: the AMX experts (routed and shared,
ops.native.moe), the gated delta rule's one-pass decode step (ops.native.gdn_decode) and its AMX
prefill chunks (ops.native.gdn_chunk). Prefill logits as close to transformers' float32 ones as
transformers' own bfloat16 model's; the same logits (up to float32 rounding in the rule) and
greedy tokens as the engine without those kernels (its PyTorch MoE and the general rule kernel),
which round at the same points."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.ops.native import gdn_chunk, gdn_decode, moe

from .test_qwen3_next import COMMON, VOCAB, _randomise
from .utils import (
    check_bf16_as_close_as_transformers,
    engine_greedy,
    engine_prefill_logits,
    prompts,
    save_model,
    seeded,
)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # MoE on every layer; intermediate sizes no multiple of the AMX tiles (24: a tile and a
    # half; 40: two and a half; transformers' bf16 grouped GEMM wants rows of 16 bytes)
    # (linear head dims of 32: the AMX chunk kernel's tiles; 16 and 8 elsewhere in these tests)
    common = {**COMMON, "linear_key_head_dim": 32, "linear_value_head_dim": 32}
    cfg = Qwen3NextConfig(**common, intermediate_size=48, moe_intermediate_size=24,
                          shared_expert_intermediate_size=40, num_experts=6,
                          num_experts_per_tok=2)  # fmt: skip
    hf = seeded(Qwen3NextForCausalLM, cfg, seed=2)
    _randomise(hf, 2)
    return save_model(hf, tmp_path_factory.mktemp("qwen3next-bf16")), hf


def _engine(folder, chunk=2048):
    return Engine(str(folder), dtype="bfloat16", max_num_batched_tokens=chunk,
                  enable_prefix_caching=False)  # fmt: skip


def _without_new_kernels(monkeypatch):
    monkeypatch.setattr(moe, "available", lambda: False)  # (gdn_chunk asks it too)
    monkeypatch.setattr(gdn_decode, "gdn_decode", lambda *a, **k: None)


@pytest.mark.parametrize("chunk", [2048, 12])  # one prefill step; chunks from a bf16 state
def test_bf16_as_close_as_transformers(qwen3_next, chunk):
    from transformers import Qwen3NextForCausalLM

    folder, hf32 = qwen3_next
    hf16 = Qwen3NextForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16)
    (ids,) = prompts(VOCAB, [45], seed=3)
    check_bf16_as_close_as_transformers(_engine(folder, chunk), hf32, hf16, ids)


def test_new_kernels_equal_the_engine_without_them(qwen3_next, monkeypatch):
    """Prefill logits and decode steps (a batch of requests: the experts' decode sizes and the
    rule's decode kernel) with and without the new kernels."""
    if not moe.available():
        pytest.skip("no AMX-BF16 kernel here")
    folder, _ = qwen3_next
    (ids,) = prompts(VOCAB, [40], seed=4)
    asks = prompts(VOCAB, [9, 17, 5, 30, 12, 21], seed=6)
    calls = {"moe": 0, "rule": 0, "chunk": 0}
    routed, rule, chunk = moe.routed_experts, gdn_decode.gdn_decode, gdn_chunk.gdn_chunk
    monkeypatch.setattr(moe, "routed_experts", lambda *a, **k: calls.__setitem__(
        "moe", calls["moe"] + 1) or routed(*a, **k))  # fmt: skip
    monkeypatch.setattr(gdn_decode, "gdn_decode", lambda *a, **k: calls.__setitem__(
        "rule", calls["rule"] + 1) or rule(*a, **k))  # fmt: skip
    monkeypatch.setattr(gdn_chunk, "gdn_chunk", lambda *a, **k: calls.__setitem__(
        "chunk", calls["chunk"] + 1) or chunk(*a, **k))  # fmt: skip
    engine = _engine(folder)
    new_logits, new_tokens = engine_prefill_logits(engine, ids), engine_greedy(engine, asks, 8)
    assert calls["moe"] > 0 and calls["rule"] > 0 and calls["chunk"] > 0
    with monkeypatch.context() as m:
        _without_new_kernels(m)
        engine = _engine(folder)
        old_logits, old_tokens = engine_prefill_logits(engine, ids), engine_greedy(engine, asks, 8)
    scale = old_logits.abs().max()
    assert (new_logits - old_logits).abs().max() <= 0.01 * scale
    agree = sum(a == b for x, y in zip(new_tokens, old_tokens, strict=True)
                for a, b in zip(x, y, strict=True))  # fmt: skip
    assert agree >= 0.9 * 8 * len(asks)


def test_captured_decode_equals_eager(qwen3_next, monkeypatch):
    """With the native experts, router, gates and decode kernels every op of a bfloat16 decode
    step is a native kernel call, so steps are captured and replayed (hybridkv.worker.graphs):
    the same tokens and log-probabilities as eager steps, bit for bit, as the batch shrinks from
    6 requests to 1."""
    if not moe.available():
        pytest.skip("no AMX-BF16 kernel here (the MoE routing stays in PyTorch: eager steps)")
    from hybridkv import LLM, SamplingParams

    folder, _ = qwen3_next
    asks = prompts(VOCAB, [9, 17, 5, 30, 12, 21], seed=7)
    params = [
        SamplingParams(max_tokens=6 + 4 * i, temperature=0, logprobs=1, ignore_eos=True)
        for i in range(6)
    ]
    runs = {}
    for eager in (True, False):
        llm = LLM(str(folder), dtype="bfloat16", enforce_eager=eager)
        runs[eager] = [(o.token_ids, o.logprobs) for o in llm.generate(asks, params)]
        graphs = llm.engine.runner.graphs
    assert graphs.disabled is None, graphs.disabled
    assert graphs.replays > 0
    assert runs[False] == runs[True]
