"""Kimi delta attention ops: the PyTorch reference (chunked varlen prefill from paged states,
one-step decode) against transformers' torch implementation of the rule, and the native CPU
kernel against the reference."""

from __future__ import annotations

import pytest
import torch
from transformers.models.kimi_linear import modeling_kimi_linear as hf

from hybridkv.ops import kda
from hybridkv.ops.native import kda as native_kda

H, K, V = 3, 16, 8


def _inputs(tokens: int, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, H, K, generator=gen)
    k = torch.randn(tokens, H, K, generator=gen)
    v = torch.randn(tokens, H, V, generator=gen)
    # per-channel log decays from mild to strong (some channels forget within a few tokens)
    g = -torch.rand(tokens, H, K, generator=gen) * torch.logspace(-2, 0.5, K)
    beta = torch.rand(tokens, H, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), g, beta


def _hf_rule(q, k, v, g, beta, S0, chunked: bool):
    """transformers' rule for one request: [L, H, *] -> o [L, H, V], final state [H, K, V]."""
    fn = hf.chunk_kimi_delta_attention if chunked else hf.recurrent_kimi_delta_attention
    args = [x.float()[None] for x in (q, k, v, g, beta)]
    o, S = fn(*args, initial_state=None if S0 is None else S0[None].clone(),
              output_final_state=True, use_qk_l2norm_in_kernel=True)  # fmt: skip
    return o[0], S[0]


def _lens_case():
    return [5, 1, 40, 1, 3, 70]  # decodes between prefills, chunks of 32 cut mid-request


def _pack(lens, seed=1, dtype=torch.float32):
    q, k, v, g, beta = _inputs(sum(lens), seed, dtype)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return (q, k, v, g, beta), qsl


def _pages(n_req: int, seed: int = 2):
    gen = torch.Generator().manual_seed(seed)
    state = torch.randn(n_req * 2 + 1, H, K, V, generator=gen) * 0.3
    pages = torch.arange(n_req, dtype=torch.int64) * 2 + 1  # every other page
    has = torch.tensor([i % 3 != 0 for i in range(n_req)])
    state[pages[~has]] = float("nan")  # pages of fresh requests are never read
    return state, pages, has


def _hf_expected(inputs, qsl, state, pages, has):
    outs, finals = [], []
    for r in range(len(pages)):
        a, b = int(qsl[r]), int(qsl[r + 1])
        S0 = state[pages[r]] if bool(has[r]) else None
        o, S = _hf_rule(*(x[a:b] for x in inputs), S0, chunked=b - a > 1)
        outs.append(o)
        finals.append(S)
    return torch.cat(outs), torch.stack(finals)


def test_gate_matches_transformers_forget_gate():
    cfg = hf.KimiLinearConfig(hidden_size=12, linear_num_heads=H, linear_head_dim=K)
    gate = hf.KimiLinearForgetGate(cfg)
    torch.manual_seed(0)
    for p in gate.parameters():
        torch.nn.init.normal_(p)
    x = torch.randn(1, 7, 12) * 4  # large enough to cross softplus' threshold of 20
    want = gate(x)[0]  # [T, H, K]
    f = gate.f_b_proj(gate.f_a_proj(x[0]))
    got = kda.kda_gate(f, gate.A_log, gate.dt_bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("chunk", [32, 8])
def test_varlen_reference_matches_transformers(chunk):
    lens = _lens_case()
    inputs, qsl = _pack(lens)
    state, pages, has = _pages(len(lens))
    want_o, want_S = _hf_expected(inputs, qsl, state, pages, has)
    untouched = state[0].clone()
    o = kda.kda_varlen(*inputs, state, pages, has, qsl, max(lens), chunk_size=chunk)
    torch.testing.assert_close(o, want_o, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(state[pages], want_S, rtol=1e-4, atol=1e-5)
    assert torch.equal(state[0], untouched)  # pages of no request untouched


def test_decode_batch_matches_transformers_recurrent():
    inputs, qsl = _pack([1] * 4)
    state, pages, has = _pages(4)
    want_o, want_S = _hf_expected(inputs, qsl, state, pages, has)
    o = kda.kda_varlen(*inputs, state, pages, has, qsl, 1)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state[pages], want_S, rtol=1e-5, atol=1e-6)


def test_split_prefill_equals_whole():
    """A prefill cut at an unaligned position continues exactly from the first part's state."""
    inputs, _ = _pack([45])
    whole = torch.zeros(1, H, K, V)
    o_whole = kda.kda_varlen(*inputs, whole, torch.tensor([0]), torch.tensor([False]),
                             torch.tensor([0, 45], dtype=torch.int32), 45)  # fmt: skip
    part = torch.zeros(1, H, K, V)
    o1 = kda.kda_varlen(*(x[:19] for x in inputs), part, torch.tensor([0]),
                        torch.tensor([False]), torch.tensor([0, 19], dtype=torch.int32), 19)
    o2 = kda.kda_varlen(*(x[19:] for x in inputs), part, torch.tensor([0]),
                        torch.tensor([True]), torch.tensor([0, 26], dtype=torch.int32), 26)
    torch.testing.assert_close(torch.cat([o1, o2]), o_whole, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(part, whole, rtol=1e-4, atol=1e-5)


needs_native = pytest.mark.skipif(not native_kda.available(), reason="no native kernels")


@needs_native
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
def test_native_matches_reference(state_dtype, in_dtype):
    lens = _lens_case()
    inputs, qsl = _pack(lens, dtype=in_dtype)
    state, pages, has = _pages(len(lens))
    state = state.to(state_dtype)
    ref_state = state.clone().float()
    want = kda.kda_varlen(*inputs, ref_state, pages, has, qsl, max(lens))
    untouched = state[0].clone()
    got = native_kda.kda_rule(*inputs, state, pages, has, qsl)
    assert got is not None
    tol = 1e-4 if state_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    torch.testing.assert_close(state[pages].float(), ref_state[pages].to(state_dtype).float(),
                               rtol=tol, atol=tol)  # fmt: skip
    assert torch.equal(state[0], untouched)


@needs_native
def test_native_declines_what_it_does_not_take():
    inputs, qsl = _pack([3])
    state, pages, has = _pages(1)
    q, k, v, g, beta = inputs
    assert native_kda.kda_rule(q.double(), k, v, g, beta, state, pages, has, qsl) is None
    assert native_kda.kda_rule(q, k, v, g[..., :-1], beta, state, pages, has, qsl) is None
    bad_pages = torch.tensor([state.shape[0]])
    assert native_kda.kda_rule(q, k, v, g, beta, state, bad_pages, has, qsl) is None


def test_chunks_built_in_slices_give_the_same_result(monkeypatch):
    """A decay budget of one chunk at a time (long prompts on a GPU) changes nothing."""
    lens = _lens_case()
    inputs, qsl = _pack(lens)
    state, pages, has = _pages(len(lens))
    whole_state = state.clone()
    want = kda.kda_varlen(*inputs, whole_state, pages, has, qsl, max(lens), chunk_size=8)
    monkeypatch.setattr(kda, "DECAY_BUDGET", 1)
    got = kda.kda_varlen(*inputs, state, pages, has, qsl, max(lens), chunk_size=8)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(state[pages], whole_state[pages], rtol=1e-6, atol=1e-7)
