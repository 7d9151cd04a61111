"""The native float32 linear for small batches (hybridkv/ops/native/f32_linear.c): against a
float64 reference within float32 accumulation error, for every tile shape (M = 1, 2 and 4-row
tiles with 1..3 rows left), K with a masked tail, N with a partial last block, with and without
bias, strided rows of x and y, one thread and the team; what it declines; PackedLinear taking it
up to small_m() rows and oneDNN above; and a float32 LLM whose greedy tokens are the same on it as
on oneDNN alone."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridkv.layers.linear import PackedLinear, prepack_available
from hybridkv.ops import native, registry
from hybridkv.ops.native import f32_linear as native_f32
from tests.layers.test_linear import _onednn
from tests.models.utils import engine_prefill_logits
from tests.ops.test_bf16_linear import reference

pytestmark = pytest.mark.skipif(
    native_f32.kernel() is None, reason="no native f32 kernel (AVX2 or AVX-512) here"
)
needs_onednn = pytest.mark.skipif(not prepack_available(), reason="no oneDNN in this torch build")

U = 2.0**-24  # float32 unit roundoff


def check(y, x, w, bias):
    """y within float32 accumulation error of the exact sum: each of the at most K + 2 roundings
    (FMAs along k, the reduction tree, the bias) moves it by at most U of the sum of |terms|."""
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    ref, mag = reference(x, w, bias)
    bound = mag * (x.shape[1] + 2) * U + 1e-30
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), float((err / bound).max())


def case(m, k, n, bias, seed=0, pad=5):
    """x as a column slice of wider rows (row stride k + pad, unaligned start)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + pad, generator=g)[:, 3 : 3 + k]
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    return x, w, b


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("k", [24, 100, 768, 1000])
@pytest.mark.parametrize("n", [5, 37])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64_reference_for_every_tile(k, n, bias, threads):
    for m in range(1, 18):
        x, w, b = case(m, k, n, bias, seed=m)
        assert x.stride(0) == k + 5  # strided rows, read in place
        check(native_f32.f32_linear(x, w, b), x, w, b)


@pytest.mark.parametrize("m", [1, 2, 3, 7, 16])
def test_many_blocks_per_thread(m, threads):
    """Weights large enough for the team and several blocks (and prefetches) per thread, the
    last block partial (331 = 20 x 16 + 11 rows)."""
    x, w, b = case(m, 768, 331, True, seed=11)
    check(native_f32.f32_linear(x, w, b), x, w, b)


def test_output_row_stride():
    """y at a row stride wider than N: the columns past N are not written."""
    x, w, b = case(5, 100, 37, True)
    y = torch.full((5, 40), 7.0)
    native_f32.kernel()(x.data_ptr(), x.stride(0), w.data_ptr(), b.data_ptr(), 5, 37, 100,
                        y.data_ptr(), 40)  # fmt: skip
    check(y[:, :37], x, w, b)
    assert (y[:, 37:] == 7.0).all()


def test_tiny_and_empty_shapes():
    for m, k, n in [(1, 1, 1), (3, 1, 2), (2, 15, 1), (5, 17, 3), (17, 16, 16)]:
        x, w, b = case(m, k, n, True, seed=k)
        check(native_f32.f32_linear(x, w, b), x, w, b)
    x, w, b = case(0, 8, 4, True)
    assert native_f32.f32_linear(x, w, b).shape == (0, 4)
    x, w, b = case(3, 0, 4, True)  # no products: the bias, or zeros
    assert torch.equal(native_f32.f32_linear(x, w, b), b.expand(3, 4))
    assert torch.equal(native_f32.f32_linear(x, w, None), torch.zeros(3, 4))


def test_inputs_with_a_column_stride_are_copied():
    x, w, b = case(4, 48, 9, True)
    xt = x.t().contiguous().t()  # same values, column stride 4
    assert xt.stride(1) != 1
    assert torch.equal(native_f32.f32_linear(xt, w, b), native_f32.f32_linear(x, w, b))


def test_declines_what_it_does_not_take():
    x, w, b = case(2, 16, 8, True)
    assert native_f32.f32_linear(x.bfloat16(), w, b) is None  # bfloat16 x
    assert native_f32.f32_linear(x, w.bfloat16(), None) is None  # bfloat16 weight
    assert native_f32.f32_linear(x, w, b.double()) is None  # float64 bias
    assert native_f32.f32_linear(x, w.t().contiguous().t(), b) is None  # strided weight
    assert native_f32.f32_linear(x[:, :8], w, b) is None  # K mismatch
    assert native_f32.f32_linear(x, w, b[:4]) is None  # bias of another length


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_x_of_another_width_raises_instead_of_reading_past_its_rows(dtype):
    """`run` (PackedLinear's per-call path) on x whose K is not the weight's: a RuntimeError,
    as F.linear gives, where it used to read K values of each row (past the rows of a narrower
    x, the garbage returned as [M, N])."""
    from hybridkv.ops.native import bf16_linear as native_bf16

    small = native_f32 if dtype == torch.float32 else native_bf16
    if small.kernel() is None:
        pytest.skip("no native kernel for this dtype here")
    torch.manual_seed(0)
    lin = nn.Linear(100, 37).to(dtype)
    packed = PackedLinear.from_linear(lin)
    assert packed.small is small
    with torch.inference_mode():
        for k in (50, 150):
            x = torch.randn(2, k, dtype=dtype)
            with pytest.raises(RuntimeError):
                nn.functional.linear(x, lin.weight, lin.bias)
            with pytest.raises(RuntimeError, match="does not fit"):
                small.run(small.kernel(), x, lin.weight, lin.bias)
            with pytest.raises(RuntimeError):
                packed(x)
        assert packed(torch.randn(2, 100, dtype=dtype)).shape == (2, 37)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    assert native.library() is None and native_f32.kernel() is None
    x, w, b = case(2, 16, 8, True)
    assert native_f32.f32_linear(x, w, b) is None


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_runs_the_kernel_up_to_small_m(bias):
    """Up to small_m() rows (the build's: AVX-512 or AVX2) a float32 PackedLinear's output is
    the kernel's, bit for bit (2-D rows, strided rows and 3-D inputs); more rows, or autograd
    on, take oneDNN."""
    torch.manual_seed(0)
    lin = nn.Linear(100, 37, bias=bias)
    packed = PackedLinear.from_linear(lin)
    assert packed.small_kernel is not None and packed.small is native_f32
    with torch.inference_mode():
        for m in range(1, native_f32.small_m() + 3):
            wide = torch.randn(m, 107)
            for x in (wide[:, :100].contiguous(), wide[:, 7:]):
                out = packed(x)
                if m <= native_f32.small_m():
                    assert torch.equal(out, native_f32.f32_linear(x, lin.weight, lin.bias))
                else:
                    assert torch.equal(out, _onednn(packed, x))
                torch.testing.assert_close(out, nn.functional.linear(x, lin.weight, lin.bias))
        x3 = torch.randn(2, 3, 100)
        expect = native_f32.f32_linear(x3.reshape(6, 100), lin.weight, lin.bias)
        assert torch.equal(packed(x3), expect.reshape(2, 3, 37))
    x = torch.randn(2, 100)
    with torch.enable_grad():
        assert torch.equal(packed(x), _onednn(packed, x))


@needs_onednn
def test_packed_linear_without_the_kernel_keeps_onednn(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    packed = PackedLinear.from_linear(nn.Linear(16, 8))
    assert packed.small_kernel is None
    x = torch.randn(3, 16)
    with torch.inference_mode():
        assert torch.equal(packed(x), _onednn(packed, x))


PROMPTS = [
    "def fibonacci(n):\n    ",
    "class Queue:\n    def __init__(self, maxsize=0):\n        self.",
]
NEW_TOKENS = 24
MAX_LOGIT_ERROR = 1e-4  # of the largest logit (measured 6e-7..1.5e-6; outputs 1.02x: 2.4e-2)


@needs_onednn
def test_float32_llm_on_the_native_linear_gives_the_same_greedy_tokens(monkeypatch):
    """The built-in default model in float32: decode steps and prefills of up to small_m() tokens
    run the PackedLinears on the kernel; the same LLM on oneDNN alone (the kernel withheld
    before it is built) gives the same greedy tokens, and prefill logits within float32 noise
    (the logits catch what the tokens may not: outputs scaled 1.02x left these tokens as they
    were)."""
    from hybridkv import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    kwargs = {"dtype": "float32", "memory_bytes": 2**27, "max_num_seqs": 4}
    calls = []
    run = native_f32.run
    monkeypatch.setattr(native_f32, "run", lambda *a: calls.append(a[1].shape[0]) or run(*a))

    def generate(llm):
        tokens = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        with torch.inference_mode():
            engine = llm.engine
            ids = [engine.tokenizer.encode(p)[: native_f32.small_m()] for p in PROMPTS]
            return tokens, [engine_prefill_logits(engine, i) for i in ids]

    llm = LLM(None, **kwargs)
    linears = [m for m in llm.engine.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.small_kernel is not None for m in linears)
    calls.clear()  # (the prepacking probes)
    ours, our_logits = generate(llm)
    assert calls and max(calls) <= native_f32.small_m()
    monkeypatch.setattr(native_f32, "kernel", lambda: None)  # every linear on oneDNN
    ref_llm = LLM(None, **kwargs)
    linears = [m for m in ref_llm.engine.model.modules() if isinstance(m, PackedLinear)]
    assert linears and all(m.small_kernel is None for m in linears)
    count = len(calls)
    ref, ref_logits = generate(ref_llm)
    assert len(calls) == count
    assert [len(t) for t in ours] == [NEW_TOKENS] * len(PROMPTS)
    assert ours == ref
    for logits, expect in zip(our_logits, ref_logits, strict=True):
        assert float((logits - expect).abs().max() / expect.abs().max()) <= MAX_LOGIT_ERROR
