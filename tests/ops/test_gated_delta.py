"""The gated delta rule: the PyTorch reference (ops.gated_delta) against transformers, and the
native CPU kernel (ops.native.gdn.gated_delta_rule, NativeGDNOps) against the reference.

Pages are handed out in random order; the pages of requests without an initial state hold NaN
bit patterns (they must never be read), and pages of nobody must stay bit for bit untouched.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from hybridkv.kv.plan import DEFAULT_CAPABILITIES, select_state_ops
from hybridkv.kv.specs import CacheDtypes
from hybridkv.layers.gated_delta_net import GDN_OPS, GatedDeltaNet
from hybridkv.ops import gated_delta as ref
from hybridkv.ops import native
from hybridkv.ops.gdn_ops import NativeGDNOps, TorchGDNOps
from hybridkv.ops.native import gdn as native_gdn
from tests.conftest import state_meta

BF16 = torch.bfloat16


def needs_native() -> None:
    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler, or HYBRIDKV_NATIVE=0)")


class Problem:
    """Packed requests of `lens` tokens: raw q, k [T, Hk, K] and v [T, Hv, V] as column slices of
    one projection (token rows strided, as in the layer), gates, and a paged state whose pages
    of requests without an initial state (and one page of nobody) are NaN."""

    def __init__(self, lens, has, hk=2, hv=4, kd=16, vd=8, seed=0, dtype=torch.float32,
                 state_dtype=torch.float32):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        t = sum(lens)
        qkv = torch.randn(t, 2 * hk * kd + hv * vd + 3, generator=gen).to(dtype)
        self.q = qkv[:, : hk * kd].view(t, hk, kd)
        self.k = qkv[:, hk * kd : 2 * hk * kd].view(t, hk, kd)
        self.v = qkv[:, 2 * hk * kd : 2 * hk * kd + hv * vd].view(t, hv, vd)
        a, b = torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen)
        self.g, self.beta = ref.gdn_gates(a, b, torch.randn(hv, generator=gen) * 0.5,
                                          torch.randn(hv, generator=gen))  # fmt: skip
        num_pages = 2 * len(lens) + 3
        self.state = torch.randn(num_pages, hv, kd, vd, generator=gen).to(state_dtype)
        self.pages = torch.randperm(num_pages, generator=gen)[: len(lens)]
        self.has = torch.tensor(has, dtype=torch.bool)
        self.state[self.pages[~self.has]] = float("nan")
        nobody = torch.ones(num_pages, dtype=torch.bool)
        nobody[self.pages] = False
        self.state[torch.nonzero(nobody)[0]] = float("nan")
        self.lens = lens
        self.qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def inputs(self):
        return self.q, self.k, self.v, self.g, self.beta

    def reference(self):
        """-> (o, state after) of the PyTorch reference, on a copy of the state."""
        state = self.state.clone()
        o = ref.gated_delta_rule_varlen(
            *self.inputs(), state, self.pages, self.has, self.qsl, max(max(self.lens), 1)
        )
        return o, state

    def native(self):
        """-> (o, state after) of the native kernel, on a copy of the state."""
        state = self.state.clone()
        o = native_gdn.gated_delta_rule(*self.inputs(), state, self.pages, self.has, self.qsl)
        assert o is not None, "the kernel declined"
        return o, state

    def used(self):
        """Indices of the pages that requests with tokens update."""
        lens = torch.tensor(self.lens)
        return self.pages[lens > 0]

    def assert_untouched(self, state):
        """Pages of nobody and of zero-length requests: the same bits as before."""
        keep = torch.ones(state.shape[0], dtype=torch.bool)
        keep[self.used()] = False
        before, after = self.state[keep], state[keep]
        assert torch.equal(before.view(torch.uint8), after.view(torch.uint8))


def check_native(p: Problem, o_tol=1e-5, state_tol=1e-5):
    o_ref, s_ref = p.reference()
    o, s = p.native()
    valid = torch.zeros(o.shape[0], dtype=torch.bool)
    for i, n in enumerate(p.lens):
        valid[int(p.qsl[i]) : int(p.qsl[i]) + n] = True
    assert not torch.isnan(o[valid]).any(), "a NaN page of a request without state was read"
    torch.testing.assert_close(o[valid], o_ref[valid], rtol=o_tol, atol=o_tol)
    used = p.used()
    assert not torch.isnan(s[used]).any()
    torch.testing.assert_close(s[used].float(), s_ref[used].float(), rtol=state_tol,
                               atol=state_tol)  # fmt: skip
    p.assert_untouched(s)


# -- the reference against transformers ------------------------------------------------------


@pytest.mark.parametrize(("hk", "hv", "kd", "vd"), [(2, 4, 16, 8), (1, 3, 24, 40), (2, 2, 8, 8)])
def test_reference_matches_transformers(hk, hv, kd, vd):
    """Each request alone through transformers' chunked (several tokens) or recurrent (one)
    function, from its initial state (zeros without one): outputs and final states."""
    lens, has = [70, 1, 5, 1, 33], [True, True, False, False, True]
    p = Problem(lens, has, hk, hv, kd, vd, seed=hk + kd)
    o_ref, s_ref = p.reference()
    for i, n in enumerate(lens):
        sl = slice(int(p.qsl[i]), int(p.qsl[i]) + n)
        page = int(p.pages[i])
        h0 = p.state[page] if has[i] else torch.zeros_like(p.state[page])
        fn = torch_chunk_gated_delta_rule if n > 1 else torch_recurrent_gated_delta_rule
        o, h = fn(
            p.q[sl][None], p.k[sl][None], p.v[sl][None], p.g[sl][None], p.beta[sl][None],
            initial_state=h0[None].clone(), output_final_state=True, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        torch.testing.assert_close(o_ref[sl], o[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s_ref[page], h[0], rtol=1e-5, atol=1e-5)


# -- the native kernel against the reference -------------------------------------------------

SHAPES = [  # (Hk, Hv, K, V): grouped heads, K != V, V below / not a multiple of the vector width
    (2, 4, 16, 8),
    (1, 3, 24, 40),
    (4, 8, 64, 64),
    (2, 2, 5, 300),
    (1, 2, 128, 128),
]


@pytest.mark.parametrize(("hk", "hv", "kd", "vd"), SHAPES)
def test_native_mixed_batch_matches_reference(hk, hv, kd, vd):
    """Prefills, decode steps and zero-length requests in one call, with and without states."""
    needs_native()
    lens = [9, 1, 0, 40, 1, 2, 0, 1]
    has = [False, True, True, True, False, True, False, True]
    check_native(Problem(lens, has, hk, hv, kd, vd, seed=kd + vd))


@pytest.mark.parametrize(("hk", "hv", "kd", "vd"), SHAPES[:3])
def test_native_decode_step_matches_reference(hk, hv, kd, vd):
    """One token per request (the reference's recurrence path)."""
    needs_native()
    check_native(Problem([1] * 6, [True, False, True, True, False, True], hk, hv, kd, vd))


def sequential64(p: Problem):
    """Each request token by token in float64 (transformers' recurrent function; the decays
    clamped at exp(-80) as in both implementations) -> (o, state after)."""
    o_all = torch.zeros(p.v.shape, dtype=torch.float64)
    state = p.state.double()
    for i, n in enumerate(p.lens):
        sl, page = slice(int(p.qsl[i]), int(p.qsl[i]) + n), int(p.pages[i])
        h0 = state[page] if p.has[i] else torch.zeros_like(state[page])
        q, k, v, g, beta = (x[sl][None].double() for x in p.inputs())
        o, h = torch_recurrent_gated_delta_rule(
            q, k, v, g.clamp(min=-80.0), beta, initial_state=h0[None], output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        o_all[sl], state[page] = o[0], h[0]
    return o_all, state


def test_native_long_requests_rescale_and_extreme_gates():
    """Hundreds of tokens (the kernel's scaled state rescales many times), and gates at the
    edges: no decay, decays that underflow (clamped at exp(-80)), beta 0 and 1. Against float64
    token by token: the chunked reference itself is off by up to 3e-5 here (exp of very negative
    cumulative decays), the kernel by 2e-7."""
    needs_native()
    p = Problem([300, 257], [True, False], 2, 4, 32, 48, seed=5)
    p.g[::7] = 0.0
    p.g[3::11] = -200.0
    p.g[5::13] = -30.0
    p.beta[::5] = 0.0
    p.beta[1::9] = 1.0
    o_exact, s_exact = sequential64(p)
    o, s = p.native()
    torch.testing.assert_close(o.double(), o_exact, rtol=2e-6, atol=2e-6)
    used = p.used()
    torch.testing.assert_close(s[used].double(), s_exact[used], rtol=2e-6, atol=2e-6)
    p.assert_untouched(s)
    o_ref, s_ref = p.reference()
    torch.testing.assert_close(o, o_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_native_bfloat16_inputs_and_states(dtype, state_dtype):
    """bf16 q/k/v and/or a bf16 state: both paths compute in float32 from the same rounded
    values; a bf16 state's rounding on the way back may differ in its last bit."""
    needs_native()
    lens, has = [17, 1, 0, 30, 1], [True, True, False, False, True]
    p = Problem(lens, has, 2, 4, 24, 40, seed=11, dtype=dtype, state_dtype=state_dtype)
    check_native(p, o_tol=1e-4, state_tol=1e-5 if state_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("state_dtype", [torch.float32, BF16])
def test_native_chunked_prefill_equals_one_shot(state_dtype):
    """A prefill in three pieces (the later ones continuing from the state) gives the outputs
    and the final state of the whole prefill in one call."""
    needs_native()
    lens = [50, 23]
    whole = Problem(lens, [True, False], 2, 4, 16, 24, seed=7, state_dtype=state_dtype)
    o_all, s_all = whole.native()
    state = whole.state.clone()
    cuts = [0, 17, 18, None]  # a one-token piece in the middle
    outs = []
    for piece in range(3):
        lo, hi = cuts[piece], cuts[piece + 1]
        parts = [(int(whole.qsl[i]) + lo, int(whole.qsl[i]) + (n if hi is None else hi))
                 for i, n in enumerate(lens)]  # fmt: skip
        tok = torch.cat([torch.arange(a, b) for a, b in parts])
        sizes = [b - a for a, b in parts]
        qsl = torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32)
        has = torch.tensor([True, piece > 0])
        q, k, v, g, beta = (x[tok] for x in whole.inputs())
        outs.append(
            (tok, native_gdn.gated_delta_rule(q, k, v, g, beta, state, whole.pages, has, qsl))
        )
    o = torch.empty_like(o_all)
    for tok, piece_out in outs:
        o[tok] = piece_out
    tol = 1e-5 if state_dtype == torch.float32 else 2e-2  # bf16: the state is rounded between
    torch.testing.assert_close(o, o_all, rtol=tol, atol=tol)
    torch.testing.assert_close(state.float(), s_all.float(), rtol=tol, atol=tol, equal_nan=True)


def test_native_declines_what_it_does_not_take():
    needs_native()
    p = Problem([3, 1], [True, True])
    q, k, v, g, beta = p.inputs()
    args = (p.state.clone(), p.pages, p.has, p.qsl)
    assert native_gdn.gated_delta_rule(q.half(), k.half(), v.half(), g, beta, *args) is None
    assert native_gdn.gated_delta_rule(q.to(BF16), k, v, g, beta, *args) is None  # mixed dtypes
    assert native_gdn.gated_delta_rule(q, k, v, g, beta, p.state.half(), *args[1:]) is None
    assert native_gdn.gated_delta_rule(q, k, v, g, beta, args[0], p.pages + 100, *args[2:]) is None
    long = torch.tensor([0, 3, 9], dtype=torch.int32)  # tokens beyond q
    assert native_gdn.gated_delta_rule(q, k, v, g, beta, args[0], p.pages, p.has, long) is None
    with pytest.raises(RuntimeError, match="plan should not have chosen"):
        NativeGDNOps().rule(q.half(), k.half(), v.half(), g, beta, args[0],
                            state_meta(p.pages, p.has, p.qsl, 3))  # fmt: skip


# -- the ops classes and the declaration -----------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
def test_gdn_ops_match_the_reference(gdn_ops, dtype):
    """conv1d (native for float32, PyTorch for bf16 in NativeGDNOps) and the rule of the ops a
    state group would run, against the PyTorch reference ops, on a mixed batch."""
    lens, has = [6, 1, 0, 11], [True, False, True, True]
    p = Problem(lens, has, 2, 4, 16, 8, seed=3, dtype=dtype, state_dtype=dtype)
    meta = state_meta(p.pages, p.has, p.qsl, max(lens))
    gen = torch.Generator().manual_seed(1)
    channels = 2 * 2 * 16 + 4 * 8
    x = torch.randn(sum(lens), channels, generator=gen).to(dtype)
    weight = torch.randn(channels, 4, generator=gen).to(dtype)
    conv = torch.randn(p.state.shape[0], channels, 3, generator=gen).to(dtype)
    conv[p.pages[~p.has]] = float("nan")
    expected = TorchGDNOps()
    conv_ref, conv_got = conv.clone(), conv.clone()
    y_ref = expected.conv1d(x, weight, None, conv_ref, meta, "silu")
    y = gdn_ops.conv1d(x, weight, None, conv_got, meta, "silu")
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(conv_got, conv_ref, rtol=tol, atol=tol, equal_nan=True)
    s_ref, s = p.state.clone(), p.state.clone()
    o_ref = expected.rule(*p.inputs(), s_ref, meta)
    o = gdn_ops.rule(*p.inputs(), s, meta)
    torch.testing.assert_close(o[: lens[0] + 1], o_ref[: lens[0] + 1], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o[-lens[3] :], o_ref[-lens[3] :], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(s[p.used()].float(), s_ref[p.used()].float(), rtol=tol, atol=tol)


def _spec(dtype: str):
    layer = GatedDeltaNet(64, 2, 4, 16, 8)
    return layer.cache_spec(CacheDtypes(kv=dtype, conv=dtype, ssm=dtype))


def test_declaration_prefers_native_on_the_cpu():
    """Native first on the CPU (fla, first in the list, runs on CUDA only), for float32 and
    bfloat16 (float16 and machines without the kernels get another entry); PyTorch last, for
    everything."""
    assert [o.name for o in GDN_OPS] == ["fla", "native", "triton", "torch"]
    assert GDN_OPS[0].platforms == frozenset({"cuda"})
    caps = DEFAULT_CAPABILITIES
    assert select_state_ops(_spec("float32"), "cpu", "float32", caps) == "native"
    assert select_state_ops(_spec("bfloat16"), "cpu", "bfloat16", caps) == "native"
    assert select_state_ops(_spec("float32"), "cpu", "bfloat16", caps) == "native"
    assert select_state_ops(_spec("float16"), "cpu", "float16", caps) == "torch"
    assert select_state_ops(_spec("float32"), "cpu", "float32", frozenset()) == "torch"
    assert select_state_ops(_spec("float32"), "cuda", "float32", frozenset()) == "torch"
