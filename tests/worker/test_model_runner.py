"""The model runner's batch description, and the engine on the Triton backend."""

from __future__ import annotations

import pytest
import torch

from hybridkv.core.request import Request
from hybridkv.engine import Engine
from hybridkv.sampling_params import SamplingParams
from tests.models.utils import engine_greedy, reference_greedy


def test_forward_batch_of_a_mixed_step(tiny_model_dir):
    eng = Engine(
        str(tiny_model_dir),
        dtype="float32",
        kernel_block_size=4,
        enable_prefix_caching=False,
        max_num_batched_tokens=9,
    )
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=4))
    b = Request("b", list(range(10, 22)), SamplingParams(max_tokens=4))
    eng.scheduler.add_request(a)
    eng.scheduler.add_request(b)
    out = eng.scheduler.schedule()  # a: 3 prompt tokens; b: the first 6 (budget 9)
    eng.runner._apply_allocations(out)
    batch = eng.runner.build_batch(out.chunks)
    assert batch.input_ids.tolist() == [1, 2, 3, 10, 11, 12, 13, 14, 15]
    assert batch.positions.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 5]
    assert batch.query_start_loc.tolist() == [0, 3, 9]
    assert batch.seq_lens.tolist() == [3, 6]
    assert batch.logits_indices.tolist() == [2]  # only a samples; b's prompt is not done
    (gid,) = batch.attention
    meta = batch.attention[gid]
    table = eng.runner.tables[gid]
    for row, req in enumerate([a, b]):
        blocks = eng.cache.table_row(req, gid)
        assert meta.block_table[row, : len(blocks)].tolist() == blocks
    slots = meta.slot_mapping.tolist()
    kbs = table.kernel_block_size
    for tok, (req_i, pos) in enumerate([(0, 0), (0, 1), (0, 2)] + [(1, p) for p in range(6)]):
        blocks = eng.cache.table_row([a, b][req_i], gid)
        assert slots[tok] == blocks[pos // kbs] * kbs + pos % kbs
    for sid, smeta in batch.state.items():
        assert smeta.has_initial_state.tolist() == [False, False]
        assert smeta.state_pages.tolist() == [eng.cache.table_row(r, sid)[0] for r in (a, b)]


@pytest.mark.triton  # device "auto": on a GPU when there is one, else interpreted on the CPU
def test_engine_selects_the_triton_backend_by_declaration(tiny_model_dir, monkeypatch):
    """The engine on every Triton kernel: attention (chosen by declaration) and the Mamba2
    decode steps (the ops' GPU route, forced here so that the CPU takes it too)."""
    from transformers import AutoModelForCausalLM

    from hybridkv import engine as engine_module
    from hybridkv.ops import triton_mamba

    # A CUDA plan on this machine: the interpreter stands in for the GPU Triton needs.
    monkeypatch.setattr(engine_module, "_capabilities", lambda *a: frozenset({"triton"}))
    calls = []
    real = triton_mamba.ssm_decode
    monkeypatch.setattr(triton_mamba, "ssm_decode", lambda *a: calls.append(1) or real(*a))
    eng = Engine(
        str(tiny_model_dir),
        dtype="float32",
        platform="cuda",
        kernel_block_size=16,
        max_num_batched_tokens=24,
    )
    assert {g.backend for g in eng.plan.groups} == {"triton"}  # attention and Mamba2, declared
    assert {type(b).__name__ for b in eng.runner.attention_backends.values()} == {
        "TritonAttentionBackend"
    }
    assert {type(o).__name__ for o in eng.runner.state_ops.values()} == {"TritonMamba2Ops"}
    assert all(g.kernel_block_size % 16 == 0 for g in eng.plan.attention_groups)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6] * 5, [2, 7, 1, 8]]
    ref, _ = reference_greedy(hf, prompts, 6)
    assert engine_greedy(eng, prompts, 6) == ref
    assert calls  # the Mamba2 decode steps ran the Triton kernel


def test_compiled_decode_matches_transformers(tiny_model_dir):
    """`compile=True` lets the "compiled" Mamba2 ops (a torch.compile'd fused decode step) be
    chosen; here they are asked for by name, as where the native kernels cannot run."""
    from transformers import AutoModelForCausalLM

    eng = Engine(str(tiny_model_dir), dtype="float32", compile=True, state_backend="compiled")
    assert {g.backend for g in eng.plan.state_groups} == {"compiled"}
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    prompts = [[5, 4, 3, 2, 1] * 4, [7, 7, 1]]
    ref, _ = reference_greedy(hf, prompts, 8)
    assert engine_greedy(eng, prompts, 8) == ref
