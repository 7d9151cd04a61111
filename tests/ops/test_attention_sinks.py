"""Attention sinks (gpt-oss): every kernel against a plain softmax with one more logit per head.

    p_t = exp(s_t) / (exp(sink_h) + sum_u exp(s_u)),   out = sum_t p_t v_t   (the sink has no value)

The PyTorch path (prefill chunks and decodes), the native CPU decode kernel and the Triton
kernels (interpreted without a GPU; decode split-K included, where only one split may count
the sink) run ragged batches over NaN-filled paged caches, with and without a window.
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

SCALE = 0.3


def batch_and_reference(q_lens, seq_lens, kbs, heads, kv_heads, window, seed=0):
    cache, table, q, qsl, sl, qs, ks, vs = make_batch(
        q_lens, seq_lens, kbs, heads, kv_heads, 8, 200, seed=seed
    )
    # large sinks next to small ones: some heads give the sink most of the mass
    sinks = torch.linspace(-2.0, 3.0, heads)
    ref = torch.cat(
        [naive_attention(qs[i], ks[i], vs[i], SCALE, window, sinks) for i in range(len(q_lens))]
    )
    return (q, cache, table, qsl, sl), sinks, ref


@pytest.mark.parametrize("kbs", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 5])
def test_torch_path_matches_reference(kbs, window, kernels):
    """Prefill chunks in PyTorch, decodes native or in PyTorch (the `kernels` fixture)."""
    args, sinks, ref = batch_and_reference([7, 1, 3, 1, 1], [7, 20, 9, 1, 12], kbs, 6, 2, window)
    out = paged_attention(*args, SCALE, sliding_window=window, sinks=sinks)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # the sinks change the output (with them all at -inf it is plain softmax)
    plain = paged_attention(*args, SCALE, sliding_window=window)
    assert (plain - out).abs().max() > 1e-2
    no_sink = paged_attention(*args, SCALE, sliding_window=window, sinks=torch.full((6,), -1e30))
    torch.testing.assert_close(no_sink, plain, rtol=1e-5, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize(("kbs", "window"), [(1, None), (3, 4), (16, 7)])
def test_native_decode_matches_reference(kbs, window):
    args, sinks, ref = batch_and_reference([1] * 5, [1, 9, 23, 5, 40], kbs, 6, 2, window, seed=3)
    q, cache, table, _, sl = args
    out = native_attn.paged_decode_attention(q, cache, table, sl, SCALE, window, sinks=sinks)
    assert out is not None and not out.isnan().any()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.triton
@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize(("q_lens", "splits"), [([9, 1, 4], None), ([1, 1, 1], 1), ([1, 1, 1], 4)])
def test_triton_matches_reference(q_lens, splits, window):
    from hybridkv.ops import triton_attention as tri

    dev = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    seq_lens = [9, 70, 33]
    args, sinks, ref = batch_and_reference(q_lens, seq_lens, 16, 6, 2, window, seed=5)
    args = tuple(a.to(dev) for a in args)
    kwargs = {} if splits is None else {"num_kv_splits": splits}
    out = tri.paged_attention(*args, SCALE, window, sinks=sinks.to(dev), **kwargs)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double().cpu(), ref, rtol=2e-5, atol=2e-5)


def test_triton_refuses_sinks_of_the_wrong_shape():
    from hybridkv.ops import triton_attention as tri

    args, _, _ = batch_and_reference([1], [5], 16, 6, 2, None)
    with pytest.raises(ValueError, match=r"sinks must have shape \(6,\), got \(3,\)"):
        tri.paged_attention(*args, SCALE, sinks=torch.zeros(3))
