"""Attention logit soft-capping: every kernel against a plain dense softmax of capped scores.

    s_t = scale * q . k_t,   s_t <- c * tanh(s_t / c),   p = softmax(s [, sink]),   out = p v

(the order of transformers' Gemma 2 eager attention: scale, cap, then the mask; a sink, where
there is one, is not capped). The PyTorch path (prefill chunks and decodes, native or PyTorch
decode rows), the native CPU decode kernel and the Triton kernels (interpreted without a GPU,
decode split-K included) run ragged batches over NaN-filled paged caches, with windows, sinks,
grouped queries and odd head counts; the native decode kernel's own tests
(test_decode_attention.py) cover its other paths and builds.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.ops.attention import paged_attention  # noqa: E402
from hybridkv.ops.native import decode_attention as native_attn  # noqa: E402

from .test_attention import make_batch, naive_attention  # noqa: E402
from .test_native import needs_compiler  # noqa: E402

SCALE = 0.6  # scores spread by about 0.6 * sqrt(8) = 1.7: a cap of 1 changes them a lot
CAP = 1.0



def batch_and_reference(q_lens, seq_lens, kbs, heads, kv_heads, window, sinks, cap, seed=0):
    cache, table, q, qsl, sl, qs, ks, vs = make_batch(
        q_lens, seq_lens, kbs, heads, kv_heads, 8, 200, seed=seed
    )
    sink = torch.linspace(-2.0, 1.0, heads) if sinks else None
    ref = torch.cat(
        [naive_attention(qs[i], ks[i], vs[i], SCALE, window, sink, cap) for i in range(len(q_lens))]
    )
    return (q, cache, table, qsl, sl), sink, ref


@pytest.mark.parametrize("kbs", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (5, 5), (7, 1)])
def test_torch_path_matches_dense(kbs, window, sinks, heads, kv_heads, kernels):
    """Prefill chunks in PyTorch, decodes native or in PyTorch (the `kernels` fixture)."""
    args, sink, ref = batch_and_reference(
        [7, 1, 3, 1, 1], [7, 20, 9, 1, 12], kbs, heads, kv_heads, window, sinks, CAP
    )
    out = paged_attention(*args, SCALE, sliding_window=window, sinks=sink, softcap=CAP)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # the cap changes the output; a cap far above every score is no cap
    plain = paged_attention(*args, SCALE, sliding_window=window, sinks=sink)
    assert (plain - out).abs().max() > 1e-2
    loose = paged_attention(*args, SCALE, sliding_window=window, sinks=sink, softcap=1e4)
    torch.testing.assert_close(loose, plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_path_in_bfloat16(dtype):
    """A bfloat16 cache and queries: float32 math, one rounding of the output."""
    args, _, ref = batch_and_reference([5, 1, 1], [9, 30, 2], 4, 6, 2, None, False, CAP, seed=2)
    q, cache, *rest = args
    out = paged_attention(q.to(dtype), cache.to(dtype), *rest, SCALE, softcap=CAP)
    assert out.dtype == dtype
    # the reference of the bfloat16-rounded inputs
    _, _, _, _, _, qs, ks, vs = make_batch([5, 1, 1], [9, 30, 2], 4, 6, 2, 8, 200, seed=2)
    ref = torch.cat(
        [
            naive_attention(
                qs[i].to(dtype).float(), ks[i].to(dtype).float(), vs[i].to(dtype).float(),
                SCALE, cap=CAP,
            )
            for i in range(3)
        ]
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_non_positive_caps_are_refused():
    args, _, _ = batch_and_reference([1], [5], 16, 6, 2, None, False, CAP)
    for cap in (0.0, -1.0):
        with pytest.raises(ValueError, match="softcap must be positive"):
            paged_attention(*args, SCALE, softcap=cap)


@needs_compiler
@pytest.mark.parametrize(("kbs", "window"), [(1, None), (3, 4), (16, 7)])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize(("heads", "kv_heads"), [(6, 2), (5, 5), (9, 3)])
def test_native_decode_matches_dense(kbs, window, sinks, heads, kv_heads):
    args, sink, ref = batch_and_reference(
        [1] * 5, [1, 9, 23, 5, 40], kbs, heads, kv_heads, window, sinks, CAP, seed=3
    )
    q, cache, table, _, sl = args
    out = native_attn.paged_decode_attention(
        q, cache, table, sl, SCALE, window, sinks=sink, softcap=CAP
    )
    assert out is not None and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 6])
def test_native_decode_matches_torch_reference(dtype, window, monkeypatch):
    """The native decode rows against the PyTorch decode rows (HYBRIDKV_NATIVE=0), bf16 too."""
    from hybridkv.ops import registry

    args, sink, _ = batch_and_reference([1] * 4, [3, 70, 33, 129], 16, 6, 2, window, True, CAP)
    q, cache, table, qsl, sl = args
    q, cache = q.to(dtype), cache.to(dtype)
    out = native_attn.paged_decode_attention(
        q, cache, table, sl, SCALE, window, sinks=sink, softcap=CAP
    )
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting
    ref = paged_attention(q, cache, table, qsl, sl, SCALE, window, 1, sinks=sink, softcap=CAP)
    tol = 1e-5 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


@pytest.mark.triton
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
@pytest.mark.parametrize(("q_lens", "splits"), [([9, 1, 4], None), ([1, 1, 1], 1), ([1, 1, 1], 4)])
def test_triton_matches_dense(q_lens, splits, window, sinks):
    from hybridkv.ops import triton_attention as tri

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    seq_lens = [9, 70, 33]
    args, sink, ref = batch_and_reference(q_lens, seq_lens, 16, 6, 2, window, sinks, CAP, seed=5)
    args = tuple(a.to(dev) for a in args)
    kwargs = {} if splits is None else {"num_kv_splits": splits}
    if sink is not None:
        kwargs["sinks"] = sink.to(dev)
    out = tri.paged_attention(*args, SCALE, window, softcap=CAP, **kwargs)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-5, atol=2e-5)


@pytest.mark.triton
def test_triton_tanh_is_accurate_for_small_and_large_caps():
    """Caps far above the scores (tanh near 0, its Taylor branch) and far below (saturated)."""
    from hybridkv.ops import triton_attention as tri

    args, _, _ = batch_and_reference([4, 1], [20, 40], 16, 4, 2, None, False, CAP, seed=7)
    _, _, _, _, _, qs, ks, vs = make_batch([4, 1], [20, 40], 16, 4, 2, 8, 200, seed=7)
    for cap in (1e3, 0.35, 0.05):
        ref = torch.cat([naive_attention(qs[i], ks[i], vs[i], SCALE, cap=cap) for i in range(2)])
        out = tri.paged_attention(*args, SCALE, softcap=cap)
        torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="softcap must be positive"):
        tri.paged_attention(*args, SCALE, softcap=0.0)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backends_pass_the_cap_through(backend):
    """`AttentionImpl.forward(..., softcap=)` of the two implemented backends that declare it."""
    from hybridkv.forward_batch import AttentionMetadata
    from hybridkv.layers.attention.registry import get_backend

    assert get_backend(backend).softcap
    impl = get_backend(backend).load()()
    args, _, ref = batch_and_reference([5, 1], [12, 30], 16, 6, 2, None, False, CAP, seed=4)
    q, cache, table, qsl, sl = args
    meta = AttentionMetadata(table, torch.full((6,), -1), qsl, sl, 5, 30)
    out = impl.forward(q, cache, meta, SCALE, softcap=CAP)
    torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)


def test_self_attention_caps_its_scores():
    """SelfAttention(softcap=c): declared in its spec, applied by its group's backend, in a
    prefill chunk and the decode step after it, against a dense forward of its own weights."""
    from hybridkv.forward_batch import AttentionMetadata, ForwardBatch
    from hybridkv.kv.specs import CacheDtypes
    from hybridkv.layers.attention.self_attention import SelfAttention
    from hybridkv.layers.attention.torch_backend import TorchAttentionBackend
    from hybridkv.layers.cache import AttentionCache

    torch.manual_seed(0)
    hidden, heads, kv_heads, d, kbs, n = 32, 4, 2, 8, 4, 9
    attn = SelfAttention(0, hidden, heads, kv_heads, d, scale=SCALE, softcap=CAP).eval()
    spec = attn.attn.declare(CacheDtypes("float32", "float32", "float32"))
    assert spec.softcap == CAP
    cache = torch.zeros(8, 2, kbs, kv_heads, d)
    attn.attn.bind_cache(AttentionCache(0, cache, TorchAttentionBackend()))
    x = torch.randn(n, hidden)
    table = torch.tensor([[3, 1, 5, 6]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // kbs]) * kbs + p % kbs for p in range(n)])

    def step(first, last):  # tokens first .. last - 1 of the one request
        meta = AttentionMetadata(
            table, slots[first:last], torch.tensor([0, last - first], dtype=torch.int32),
            torch.tensor([last], dtype=torch.int32), last - first, last,
        )  # fmt: skip
        batch = ForwardBatch(
            torch.zeros(last - first, dtype=torch.long), torch.arange(first, last),
            meta.query_start_loc, meta.seq_lens, last - first, torch.tensor([last - first - 1]),
            {0: meta}, {},
        )  # fmt: skip
        return attn(x[first:last], batch)

    with torch.inference_mode():
        out = torch.cat([step(0, n - 1), step(n - 1, n)])
        q = attn.q_proj(x).view(n, heads, d)
        k = attn.k_proj(x).view(n, kv_heads, d)
        v = attn.v_proj(x).view(n, kv_heads, d)
        dense = naive_attention(q, k, v, SCALE, cap=CAP).float().reshape(n, heads * d)
        want = attn.o_proj(dense)
        plain = attn.o_proj(naive_attention(q, k, v, SCALE).float().reshape(n, -1))
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert (plain - want).abs().max() > 1e-2
