"""A bfloat16 engine on the native small-batch linear (hybridkv/ops/native/bf16_linear.c, taken
by PackedLinear up to SMALL_M rows: decode steps and short prefills) against the same engine on
oneDNN alone: greedy tokens and prefill logits agree within bfloat16 noise, on the built-in
default model (trained, real text)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.layers.linear import PackedLinear, prepack_dtypes
from hybridkv.ops.native import bf16_linear as native_bf16
from tests.models.utils import engine_greedy, engine_prefill_logits

pytestmark = pytest.mark.skipif(
    native_bf16.kernel() is None or torch.bfloat16 not in prepack_dtypes(),
    reason="needs the native bf16 kernel and oneDNN's bf16 linear (an AVX2 CPU has no oneDNN "
    "bf16: the kernel takes every M there, tests/layers/test_linear.py)",
)

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.",
    "    for key, value in sorted(items.items()):\n        if",
]
NEW_TOKENS = 24
MIN_AGREEMENT = 0.9  # of greedy tokens (measured 96/96; bf16 rounding may flip a near-tie)
MAX_LOGIT_ERROR = 0.02  # of the largest logit (measured 0.002-0.006; a wrong product is ~1)


def test_bf16_engine_on_the_native_linear_agrees_with_onednn(monkeypatch):
    engine = Engine(None, dtype="bfloat16", memory_bytes=2**27, max_num_seqs=4)
    linears = [m for m in engine.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.small_kernel is not None for m in linears)
    calls = []
    run = native_bf16.run
    monkeypatch.setattr(native_bf16, "run", lambda *a: calls.append(a[1].shape[0]) or run(*a))
    ids = [engine.tokenizer.encode(p)[:12] for p in PROMPTS]  # one prompt's prefill: kernel
    ours = engine_greedy(engine, ids, NEW_TOKENS)
    with torch.inference_mode():
        our_logits = [engine_prefill_logits(engine, i) for i in ids]
    assert calls and max(calls) <= native_bf16.SMALL_M
    count = len(calls)
    monkeypatch.setattr(native_bf16, "SMALL_M", 0)  # every call on oneDNN
    ref = engine_greedy(engine, ids, NEW_TOKENS)
    with torch.inference_mode():
        ref_logits = [engine_prefill_logits(engine, i) for i in ids]
    assert len(calls) == count
    same = sum(a == b for r, o in zip(ref, ours, strict=True) for a, b in zip(r, o, strict=True))
    assert same / (len(ids) * NEW_TOKENS) >= MIN_AGREEMENT
    for logits, expect in zip(our_logits, ref_logits, strict=True):
        error = float((logits.float() - expect.float()).abs().max() / expect.float().abs().max())
        assert error <= MAX_LOGIT_ERROR
