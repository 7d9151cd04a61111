"""The gated delta rule's one-pass decode kernel (ops.native.gdn_decode) against the PyTorch
reference (ops.gated_delta) and transformers' recurrence in float64: float32 and bfloat16 inputs
and states, odd head sizes, values wider than one 128-column block, requests with and without an
initial state, pages of nobody untouched; and NativeGDNOps taking it for decode-only steps."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops.gdn_ops import NativeGDNOps
from hybridkv.ops.native import gdn_decode
from tests.conftest import state_meta
from tests.ops.test_gated_delta import BF16, Problem, needs_native, sequential64

HAS = [True, False, True, True, False, True, True]


def run(p: Problem):
    state = p.state.clone()
    o = gdn_decode.gdn_decode(*p.inputs(), state, p.pages, p.has, p.qsl)
    assert o is not None, "the kernel declined"
    return o, state


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize(
    ("hk", "hv", "kd", "vd"),
    [(2, 4, 16, 8), (1, 3, 24, 40), (2, 2, 128, 128), (1, 2, 33, 17), (1, 1, 8, 200)],
)
def test_decode_matches_float64_and_the_reference(hk, hv, kd, vd, dtype, state_dtype):
    needs_native()
    p = Problem([1] * len(HAS), HAS, hk, hv, kd, vd, seed=kd + vd, dtype=dtype,
                state_dtype=state_dtype)  # fmt: skip
    o, s = run(p)
    o_exact, s_exact = sequential64(p)
    used = p.used()
    assert not torch.isnan(o).any() and not torch.isnan(s[used]).any()
    # float32 math from the same (rounded) inputs; a bf16 state is rounded once on the way out
    s_tol = 2e-6 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o.double(), o_exact, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(s[used].double(), s_exact[used], rtol=s_tol, atol=s_tol)
    p.assert_untouched(s)
    o_ref, s_ref = p.reference()
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s[used].float(), s_ref[used].float(), rtol=s_tol, atol=s_tol)


def test_extreme_gates():
    """No decay, decays that underflow (clamped at exp(-80) as everywhere), beta 0 and 1."""
    needs_native()
    p = Problem([1] * 12, [True] * 6 + [False] * 6, 2, 4, 32, 48, seed=5)
    p.g[::3] = 0.0
    p.g[1::4] = -200.0
    p.beta[::5] = 0.0
    p.beta[1::3] = 1.0
    o, s = run(p)
    o_exact, s_exact = sequential64(p)
    torch.testing.assert_close(o.double(), o_exact, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(s[p.used()].double(), s_exact[p.used()], rtol=2e-6, atol=2e-6)


def test_declines_what_it_does_not_take():
    needs_native()
    p = Problem([1, 1], [True, True])
    q, k, v, g, beta = p.inputs()
    args = (p.state.clone(), p.pages, p.has, p.qsl)
    assert gdn_decode.gdn_decode(q.half(), k.half(), v.half(), g, beta, *args) is None
    assert gdn_decode.gdn_decode(q.to(BF16), k, v, g, beta, *args) is None  # mixed dtypes
    assert gdn_decode.gdn_decode(q, k, v, g, beta, args[0], p.pages + 100, *args[2:]) is None
    big = Problem([1], [True], 1, 1, gdn_decode.MAX_K + 8, 4)
    assert gdn_decode.gdn_decode(*big.inputs(), big.state, big.pages, big.has, big.qsl) is None


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_native_ops_take_it_for_decode_steps(dtype, monkeypatch):
    """NativeGDNOps.rule: a decode-only step goes to this kernel (same results as the general
    kernel's up to float32 rounding), a step with a prefill does not."""
    needs_native()
    calls = []
    kernel = gdn_decode.gdn_decode
    monkeypatch.setattr(gdn_decode, "gdn_decode", lambda *a: calls.append(1) or kernel(*a))
    p = Problem([1] * 5, [True, False, True, True, True], 2, 4, 16, 24, seed=2, dtype=dtype,
                state_dtype=dtype)  # fmt: skip
    s = p.state.clone()
    o = NativeGDNOps().rule(*p.inputs(), s, state_meta(p.pages, p.has, p.qsl, 1))
    assert calls == [1]
    o_ref, s_ref = p.native()  # the general kernel
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s[p.used()].float(), s_ref[p.used()].float(), rtol=tol, atol=tol)
    mixed = Problem([3, 1], [True, True], seed=4)
    NativeGDNOps().rule(*mixed.inputs(), mixed.state.clone(),
                        state_meta(mixed.pages, mixed.has, mixed.qsl, 3))  # fmt: skip
    assert calls == [1]


@pytest.mark.parametrize(("hv", "vd"), [(4, 128), (3, 40)])
def test_fused_gated_norm_equals_rule_then_norm(hv, vd):
    """norm=(z, weight, eps): each head's o through Qwen3-Next's gated norm in the kernel, as
    `ops.norm.gated_rms_norm(bf16(o), z, weight, eps, V, norm_before_gate=True)` gives it."""
    from hybridkv.ops.norm import gated_rms_norm

    needs_native()
    p = Problem([1] * 6, [True, False, True, True, True, False], 1, hv, 32, vd, seed=9,
                dtype=BF16, state_dtype=BF16)  # fmt: skip
    gen = torch.Generator().manual_seed(4)
    z = (torch.randn(6, hv * vd, generator=gen) * 2).to(BF16)
    weight = torch.randn(vd, generator=gen)
    s1, s2 = p.state.clone(), p.state.clone()
    y = gdn_decode.gdn_decode(*p.inputs(), s1, p.pages, p.has, p.qsl, norm=(z, weight, 1e-6))
    o = gdn_decode.gdn_decode(*p.inputs(), s2, p.pages, p.has, p.qsl)
    ref = gated_rms_norm(o.to(BF16).reshape(-1, vd), z.reshape(-1, vd), weight, 1e-6, vd,
                         norm_before_gate=True).reshape(6, hv * vd)  # fmt: skip
    assert y.dtype == BF16 and y.shape == (6, hv * vd)
    assert torch.equal(s1.view(torch.uint8), s2.view(torch.uint8))  # the same state
    diff = (y.float() - ref.float()).abs()
    assert diff.max() <= 0.01 * ref.float().abs().max()  # a last bit here and there
    assert (diff == 0).float().mean() >= 0.95
