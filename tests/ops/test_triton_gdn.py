"""The Triton gated-delta decode kernel against the PyTorch reference (ops.gated_delta).

Compiled on a GPU when there is one, else through Triton's interpreter on the CPU. Pages are
handed out in random order and start as NaN bit patterns on even pages: a request without an
initial state must never read its page, and pages of nobody must stay untouched.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.ops import gated_delta as ref  # noqa: E402
from hybridkv.ops import triton_gdn as tri  # noqa: E402

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

pytestmark = pytest.mark.triton


def case(num_seqs, hk, hv, kd, vd, seed):
    gen = torch.Generator().manual_seed(seed)
    num_pages = 2 * num_seqs + 2
    state = torch.randn(num_pages, hv, kd, vd, generator=gen)
    state[::2] = float("nan")
    pages = torch.randperm(num_pages, generator=gen)[:num_seqs]
    has = pages % 2 == 1
    q, k = (
        torch.randn(num_seqs, hk, kd, generator=gen),
        torch.randn(num_seqs, hk, kd, generator=gen),
    )
    v = torch.randn(num_seqs, hv, vd, generator=gen)
    a, b = torch.randn(num_seqs, hv, generator=gen), torch.randn(num_seqs, hv, generator=gen)
    g, beta = ref.gdn_gates(a, b, torch.randn(hv, generator=gen) * 0.5, torch.zeros(hv))
    inputs = ref.rule_inputs(q, k, v, g, beta)
    return state, pages, has, inputs


@pytest.mark.parametrize(
    ("hk", "hv", "kd", "vd"), [(2, 4, 16, 8), (1, 3, 24, 40), (4, 4, 128, 128), (2, 2, 8, 300)]
)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_gdn_decode_matches_pytorch(hk, hv, kd, vd, state_dtype) -> None:
    state, pages, has, inputs = case(5, hk, hv, kd, vd, seed=hk * 100 + kd + vd)
    state = state.to(state_dtype)
    expected = state.clone()
    o_ref = ref.decode_rows(expected, pages, has, inputs)  # on the CPU

    got = state.to(DEV)
    o = tri.gdn_decode(
        got, pages.to(DEV), has.to(DEV), ref.RuleInputs(*(x.to(DEV) for x in inputs))
    )
    got = got.cpu()
    assert not torch.isnan(o).any(), "a NaN page of a request without state was read"
    torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-5, atol=1e-5)
    # bf16 pages: both round the same float32 state, which may differ in its last bit
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[pages], expected[pages], rtol=tol, atol=tol)
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[pages] = False
    assert torch.equal(got[untouched].view(torch.uint8), expected[untouched].view(torch.uint8))


def test_varlen_rule_routes_one_token_requests_to_the_kernel() -> None:
    """The reference's varlen function with the kernel as its decode step: mixed batches."""
    gen = torch.Generator().manual_seed(3)
    lens, has = [9, 1, 4, 1, 1], [False, True, True, False, True]
    hk, hv, kd, vd = 2, 4, 16, 8
    total = sum(lens)
    q, k = torch.randn(total, hk, kd, generator=gen), torch.randn(total, hk, kd, generator=gen)
    v = torch.randn(total, hv, vd, generator=gen)
    a, b = torch.randn(total, hv, generator=gen), torch.randn(total, hv, generator=gen)
    g, beta = ref.gdn_gates(a, b, torch.zeros(hv), torch.zeros(hv))
    state = torch.randn(8, hv, kd, vd, generator=gen)
    pages = torch.tensor([1, 3, 5, 0, 7])
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k, v, g, beta)
    expected = state.clone()
    o_ref = ref.gated_delta_rule_varlen(*args, expected, pages, torch.tensor(has), qsl, 9)
    calls = []

    def kernel(*a):
        calls.append(a[1].numel())
        return tri.gdn_decode(*a)

    o = ref.gated_delta_rule_varlen(*args, state, pages, torch.tensor(has), qsl, 9, decode=kernel)
    assert calls == [3]  # the three one-token requests, in one launch
    torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected, rtol=1e-5, atol=1e-5)
