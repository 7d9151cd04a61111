"""`LLM(..., quantization="int8")` and `"w8a8"`: the engine quantizes the loaded linears, its
greedy tokens mostly agree with the float engine's and its prefill logits stay within a stated
bound (on the built-in default model: trained, real text), the linear weights shrink ~4x
(float32) / ~2x (bfloat16), the cache keeps its dtypes, and bad values are one-line errors."""

from __future__ import annotations

import pytest
import torch

from hybridkv.engine import Engine
from hybridkv.entrypoints.llm import LLM
from hybridkv.layers.quantization import Int8Linear, W8A8Linear
from tests.models.utils import engine_greedy, engine_prefill_logits

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.",
    "    for key, value in sorted(items.items()):\n        if",
]
NEW_TOKENS = 24
# The default model's int8 prefill logits differ from the float model's by 1.5e-2 (fp32) and
# 2.2e-2 (bf16) of the largest logit (docs/quantization.md); a bug is far beyond 0.06.
MAX_LOGIT_ERROR = 0.06
MIN_AGREEMENT = 0.8  # fraction of greedy tokens equal to the float engine's (measured: 1.0)


@pytest.fixture(scope="module", params=["float32", "bfloat16", "float16"])
def engines(request):
    kwargs = {"dtype": request.param, "memory_bytes": 2**27, "max_num_seqs": 4}
    return Engine(None, **kwargs), Engine(None, quantization="int8", **kwargs)


def check_agreement(plain: Engine, quantized: Engine, max_logit_error: float) -> None:
    """Greedy tokens mostly the float engine's; prefill logits within the bound, not equal."""
    ids = [plain.tokenizer.encode(p) for p in PROMPTS]
    ref, ours = engine_greedy(plain, ids, NEW_TOKENS), engine_greedy(quantized, ids, NEW_TOKENS)
    same = sum(a == b for r, o in zip(ref, ours, strict=True) for a, b in zip(r, o, strict=True))
    assert same / (len(ids) * NEW_TOKENS) >= MIN_AGREEMENT
    top1 = []
    for prompt in ids:
        ref_logits = engine_prefill_logits(plain, prompt)
        logits = engine_prefill_logits(quantized, prompt)
        error = float((logits - ref_logits).abs().max() / ref_logits.abs().max())
        assert 0 < error <= max_logit_error  # 0 would mean nothing was quantized
        top1 += (logits.argmax(-1) == ref_logits.argmax(-1)).tolist()
    assert sum(top1) / len(top1) >= MIN_AGREEMENT  # over all prompt positions


def test_int8_engine_agrees_with_the_float_engine(engines):
    check_agreement(*engines, MAX_LOGIT_ERROR)


def test_int8_engine_quantizes_the_linears_and_keeps_the_cache_dtypes(engines):
    plain, int8 = engines
    report = int8.quantization
    assert plain.quantization is None and report is not None
    linears = [n for n, m in int8.model.named_modules() if isinstance(m, Int8Linear)]
    assert sorted(linears) == sorted(report.quantized) and "lm_head" in linears
    assert len(linears) == 1 + 6 * 2 + 2 * 4 + 4 * 2  # head, 6 MLPs, 2 attn q/k/v/o, 4 mamba
    ratio = report.float_bytes / report.int8_bytes
    expect = 4 if plain.dtype == "float32" else 2
    assert expect * 0.97 < ratio <= expect
    # tied embeddings: the embedding keeps its float weight, the rest is freed
    emb = int8.model.get_input_embeddings().weight
    assert report.freed_bytes == report.float_bytes - emb.numel() * emb.element_size()
    assert plain.plan == int8.plan  # the same cache: KV and state dtypes unchanged
    assert emb.dtype == torch.float32 if plain.dtype == "float32" else torch.bfloat16


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("int4", "quantization must be None or one of 'int8', 'w8a8', got 'int4'"),
        ("INT8", "got 'INT8'"),
        (True, "got True"),
        (8, "got 8"),
    ],
)
def test_bad_quantization_is_a_one_line_error(value, message):
    with pytest.raises(ValueError) as err:
        LLM(None, quantization=value)
    assert message in str(err.value) and "\n" not in str(err.value)


# w8a8 also rounds every linear's input to 8 bits per token: measured on the default model
# 1.8e-2 .. 4.3e-2 (fp32) and 1.8e-2 .. 3.5e-2 (bf16) of the largest logit over PROMPTS
MAX_W8A8_LOGIT_ERROR = 0.1


@pytest.fixture(scope="module", params=["float32", "bfloat16", "float16"])
def w8a8_engines(request):
    kwargs = {"dtype": request.param, "memory_bytes": 2**27, "max_num_seqs": 4}
    return Engine(None, **kwargs), Engine(None, quantization="w8a8", **kwargs)


def test_w8a8_engine_agrees_with_the_float_engine(w8a8_engines):
    check_agreement(*w8a8_engines, MAX_W8A8_LOGIT_ERROR)


def test_w8a8_engine_packs_the_int8_weights_of_the_int8_mode(w8a8_engines, engines):
    plain, w8a8 = w8a8_engines
    report = w8a8.quantization
    assert report is not None and report.method == "w8a8"
    layers = dict(w8a8.model.named_modules())
    linears = [n for n, m in layers.items() if isinstance(m, W8A8Linear)]
    assert sorted(linears) == sorted(report.quantized) and "lm_head" in linears
    ratio = report.float_bytes / report.int8_bytes  # the packing pads to 16 rows x 64 inputs
    expect = 4 if plain.dtype == "float32" else 2
    assert expect * 0.9 < ratio <= expect
    assert plain.plan == w8a8.plan
    int8 = next(e for e in engines if e.quantization is not None)
    if int8.dtype == plain.dtype:  # the same rounded weights, only stored otherwise
        for name in ("lm_head", linears[1]):
            same = int8.model.get_submodule(name)
            assert torch.equal(layers[name].qweight, same.qweight)
            assert torch.equal(layers[name].scale, same.scale)


def test_int8_on_cuda_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError) as err:
        Engine(None, device="cuda", quantization="int8")
    assert "runs on the CPU only" in str(err.value) and "\n" not in str(err.value)
