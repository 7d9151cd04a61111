"""float16 checkpoints (`dtype="float16"`, or "auto" on a checkpoint saved in float16) run every
registered architecture on the CPU: where a call mixes dtypes (a Mamba2 scan's float32 output
into the gated norm, a residual kept in float32 into the RMSNorm, a float16 query over an MLA
cache of another dtype) its op chain is chosen for all of them (`OpFamily.of`), so no native
kernel declared for float32 and bfloat16 is handed a float16 tensor. Each architecture's tiny
model (the config-fidelity base config, real seeded weights), with the KV cache in the model's
dtype, float32 and bfloat16: prefill logits about as close to transformers' float32 ones as
transformers' own float16 model's, and a batched greedy decode that finishes with the cache
intact.

And bfloat16 on every architecture (tests/models/test_bf16_native.py holds the deeper Granite
checks): prefill logits in chunks of 8 (each chunk starts from the bfloat16 state the last one
left) as close to transformers' float32 ones as transformers' own bfloat16 model's, by the
median over three prompts (one prompt can flip an expert choice of a tiny random MoE: measured
once 4.7x, the other two prompts of that model 1.2x and 0.8x; every other model 0.7-1.24x)."""

from __future__ import annotations

import json

import pytest
import torch

from hybridkv.engine import Engine

from .test_config_fidelity import COVERED, config_dict, hf_classes
from .utils import (
    engine_greedy,
    engine_prefill_logits,
    position_errors,
    prompts,
    reference_logits,
    save_model,
    seeded,
)

# A cache in another dtype than the model's: the ops that read and write it take a mixed chain
# (`OpFamily.of`: a float16 query over a bfloat16 or float32 MLA cache runs PyTorch's).
KV_CACHE_DTYPES = ["auto", "float32", "bfloat16"]
# how much further from float32 than transformers' float16 model the logits may be (median over
# positions): measured 0.75-1.23x with a float16 or float32 cache; a bfloat16 cache rounds to an
# 8-bit mantissa against float16's 11 (2^3 coarser): measured 0.92-3.8x. A wrong read of the
# cache is off by the logits' own size, hundreds of times more.
SLACK = {"auto": 1.5, "float32": 1.5, "bfloat16": 8.0}


@pytest.mark.parametrize("kv_cache_dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("arch", COVERED)
def test_float16_as_close_as_transformers(arch, kv_cache_dtype, tmp_path):
    config_class, model_class = hf_classes(arch)
    hf32 = seeded(model_class, config_class(**config_dict(arch), initializer_range=0.1))
    folder = save_model(hf32.half(), tmp_path / "model")  # a checkpoint saved in float16
    hf32.float()
    assert json.loads((folder / "config.json").read_text())["dtype"] == "float16"
    hf16 = seeded(model_class, hf32.config)
    hf16.load_state_dict(hf32.state_dict())
    hf16.half()
    if hf16._can_set_experts_implementation():
        # transformers' grouped-GEMM experts refuse float16 strides of these tiny sizes on the CPU
        hf16.set_experts_implementation("eager")
    # dtype "auto": the checkpoint's
    engine = Engine(str(folder), kernel_block_size=4, kv_cache_dtype=kv_cache_dtype)
    assert engine.runtime.dtype == "float16"
    ids = prompts(hf32.config.vocab_size, [13, 5], seed=3)
    ref32 = reference_logits(hf32, ids[0])
    ours, theirs = engine_prefill_logits(engine, ids[0]), reference_logits(hf16, ids[0])
    ours_error, theirs_error = position_errors(ours, ref32), position_errors(theirs, ref32)
    assert 0 < ours_error.median() <= SLACK[kv_cache_dtype] * theirs_error.median()
    answers = engine_greedy(engine, ids, 6)  # asserts no request failed, the cache intact
    assert [len(a) for a in answers] == [6, 6]
    assert torch.isfinite(ours).all()


@pytest.mark.parametrize("arch", COVERED)
def test_bfloat16_as_close_as_transformers(arch, tmp_path):
    config_class, model_class = hf_classes(arch)
    hf32 = seeded(model_class, config_class(**config_dict(arch), initializer_range=0.1))
    folder = save_model(hf32, tmp_path / "model")
    hf16 = seeded(model_class, hf32.config)
    hf16.load_state_dict(hf32.state_dict())
    hf16.to(torch.bfloat16)
    if hf16._can_set_experts_implementation():
        hf16.set_experts_implementation("eager")  # (as above)
    engine = Engine(
        str(folder), dtype="bfloat16", kernel_block_size=4, max_num_batched_tokens=8,
        enable_prefix_caching=False,
    )  # fmt: skip
    ratios = []
    for seed in (3, 4, 5):
        (ids,) = prompts(hf32.config.vocab_size, [24], seed=seed)
        ref32 = reference_logits(hf32, ids)
        ours = position_errors(engine_prefill_logits(engine, ids), ref32).median()
        theirs = position_errors(reference_logits(hf16, ids), ref32).median()
        assert ours > 0
        ratios.append(float(ours / theirs))
    assert sorted(ratios)[1] <= 1.5, ratios
