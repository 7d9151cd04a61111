"""The gated delta rule's AMX prefill chunks (ops.native.gdn_chunk) against transformers'
recurrence in float64 and the general native kernel: bfloat16 q, k, v with float32 and bfloat16
states, head dims of 32..256, requests across chunk boundaries (63, 64, 65, 128 tokens), with
and without an initial state, one-token and empty requests left alone, pages of nobody untouched,
extreme gates; NativeGDNOps sending a mixed step's long requests here and its one-token ones to
the decode kernel. Skipped on a CPU without AMX."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops.gdn_ops import NativeGDNOps
from hybridkv.ops.native import gdn_chunk, gdn_decode, moe
from tests.conftest import state_meta
from tests.ops.test_gated_delta import BF16, Problem, sequential64

LENS = [100, 64, 1, 130, 0, 7, 2, 63, 65]
HAS = [True, False, True, True, False, True, False, True, False]


def needs_amx() -> None:
    if not moe.available():
        pytest.skip("no AMX-BF16 kernel here")


def _long(p: Problem) -> torch.Tensor:
    """Token rows of the requests of two or more tokens."""
    rows = torch.zeros(p.v.shape[0], dtype=torch.bool)
    for i, n in enumerate(p.lens):
        if n > 1:
            rows[int(p.qsl[i]) : int(p.qsl[i]) + n] = True
    return rows


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
@pytest.mark.parametrize(
    ("hk", "hv", "kd", "vd"), [(2, 4, 128, 128), (1, 2, 64, 96), (2, 2, 32, 32)]
)
def test_chunks_match_float64(hk, hv, kd, vd, state_dtype):
    needs_amx()
    p = Problem(LENS, HAS, hk, hv, kd, vd, seed=kd + vd, dtype=BF16, state_dtype=state_dtype)
    s = p.state.clone()
    o = torch.full((p.v.shape[0], hv, vd), 7.0)  # rows of short requests must stay 7
    assert gdn_chunk.gdn_chunk(*p.inputs(), s, p.pages, p.has, p.qsl, out=o) is o
    o_exact, s_exact = sequential64(p)
    rows = _long(p)
    assert bool((o[~rows] == 7.0).all())
    long_pages = p.pages[torch.tensor(p.lens) > 1]
    # float32 math from the same bfloat16 inputs, the big products on AMX in two bfloat16 parts
    # (2^-16): a few 1e-6 of the largest output; a bfloat16 state is rounded once on the way out
    torch.testing.assert_close(
        o[rows].double(), o_exact[rows], rtol=1e-5, atol=1e-5 * o_exact.abs().max().item()
    )
    s_tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(s[long_pages].double(), s_exact[long_pages], rtol=s_tol, atol=s_tol)
    keep = torch.ones(s.shape[0], dtype=torch.bool)
    keep[long_pages] = False  # pages of nobody, and of one-token and empty requests: untouched
    assert torch.equal(s[keep].view(torch.uint8), p.state[keep].view(torch.uint8))


def test_extreme_gates():
    """No decay, decays that underflow (clamped at exp(-80) per token), beta 0 and 1."""
    needs_amx()
    p = Problem([150, 70], [True, False], 2, 4, 64, 64, seed=5, dtype=BF16)
    p.g[::7] = 0.0
    p.g[3::11] = -200.0
    p.g[5::13] = -30.0
    p.beta[::5] = 0.0
    p.beta[1::9] = 1.0
    s = p.state.clone()
    o = gdn_chunk.gdn_chunk(*p.inputs(), s, p.pages, p.has, p.qsl)
    o_exact, s_exact = sequential64(p)
    torch.testing.assert_close(
        o.double(), o_exact, rtol=1e-5, atol=1e-5 * o_exact.abs().max().item()
    )
    used = p.pages
    torch.testing.assert_close(s[used].double(), s_exact[used], rtol=1e-5, atol=1e-5)


def test_native_ops_split_a_mixed_step(monkeypatch):
    """bfloat16 q, k, v: long requests through the chunks, one-token ones through the decode
    kernel, the same o and states as the general kernel up to float32 rounding."""
    needs_amx()
    calls = []
    real = gdn_chunk.gdn_chunk
    monkeypatch.setattr(gdn_chunk, "gdn_chunk", lambda *a, **k: calls.append(1) or real(*a, **k))
    p = Problem(LENS, HAS, 2, 4, 64, 32, seed=3, dtype=BF16, state_dtype=BF16)
    s = p.state.clone()
    o = NativeGDNOps().rule(*p.inputs(), s, state_meta(p.pages, p.has, p.qsl, max(LENS)))
    assert calls == [1]
    o_ref, s_ref = p.native()
    valid = torch.tensor([n > 0 for n in p.lens for _ in range(n)])
    torch.testing.assert_close(o[valid], o_ref[valid], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s[p.used()].float(), s_ref[p.used()].float(), rtol=1e-2, atol=1e-2)
    p.assert_untouched(s)


def test_declines_what_it_does_not_take():
    needs_amx()
    p = Problem([5, 3], [True, True], 2, 4, 32, 32, dtype=BF16)
    args = (p.state.clone(), p.pages, p.has, p.qsl)
    q, k, v, g, beta = p.inputs()
    assert gdn_chunk.gdn_chunk(q.float(), k.float(), v.float(), g, beta, *args) is None
    assert not gdn_chunk.applies(q.float(), v, args[0])  # float32 q: the general kernel
    odd = Problem([5], [True], 1, 1, 48, 32, dtype=BF16)  # K no multiple of 32
    assert gdn_chunk.gdn_chunk(*odd.inputs(), odd.state, odd.pages, odd.has, odd.qsl) is None
    assert gdn_chunk.gdn_chunk(q, k, v, g, beta, args[0], p.pages + 100, *args[2:]) is None
    assert gdn_decode.gdn_decode(q, k, v, g, beta, *args, out=torch.empty(1)) is None
