"""The Triton KDA decode kernel against the PyTorch reference (ops.kda).

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

from hybridkv.ops import kda as ref  # noqa: E402
from hybridkv.ops import triton_kda as tri  # noqa: E402

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

pytestmark = pytest.mark.triton


def _raw(tokens, heads, kd, vd, gen):
    q = torch.randn(tokens, heads, kd, generator=gen)
    k = torch.randn(tokens, heads, kd, generator=gen)
    v = torch.randn(tokens, heads, vd, generator=gen)
    f = torch.randn(tokens, heads * kd, generator=gen)
    g = ref.kda_gate(f, torch.randn(heads, generator=gen) * 0.5, torch.zeros(heads * kd))
    beta = torch.rand(tokens, heads, generator=gen)
    return q, k, v, g, beta


def case(num_seqs, heads, kd, vd, seed):
    gen = torch.Generator().manual_seed(seed)
    num_pages = 2 * num_seqs + 2
    state = torch.randn(num_pages, heads, kd, vd, generator=gen)
    state[::2] = float("nan")
    pages = torch.randperm(num_pages, generator=gen)[:num_seqs]
    has = pages % 2 == 1
    return state, pages, has, ref.kda_inputs(*_raw(num_seqs, heads, kd, vd, gen))


@pytest.mark.parametrize(("heads", "kd", "vd"), [(2, 16, 8), (3, 24, 40), (2, 128, 128)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_kda_decode_matches_pytorch(heads, kd, vd, state_dtype) -> None:
    state, pages, has, inputs = case(5, heads, kd, vd, seed=heads * 100 + kd + vd)
    state = state.to(state_dtype)
    expected = state.clone()
    o_ref = ref.kda_decode_rows(expected, pages, has, inputs)

    got = state.to(DEV)
    o = tri.kda_decode(got, pages.to(DEV), has.to(DEV), ref.KdaInputs(*(x.to(DEV) for x in inputs)))
    got = got.cpu()
    assert not torch.isnan(o).any(), "a NaN page of a request without state was read"
    torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got[pages], expected[pages], rtol=tol, atol=tol)
    untouched = torch.ones(state.shape[0], dtype=torch.bool)
    untouched[pages] = False
    assert torch.equal(got[untouched].view(torch.uint8), expected[untouched].view(torch.uint8))


def test_varlen_rule_routes_one_token_requests_to_the_kernel() -> None:
    """The reference's varlen function with the kernel as its decode step: mixed batches."""
    gen = torch.Generator().manual_seed(3)
    lens, has = [9, 1, 4, 1, 1], torch.tensor([False, True, True, False, True])
    heads, kd, vd = 2, 16, 8
    raw = _raw(sum(lens), heads, kd, vd, gen)
    state = torch.randn(8, heads, kd, vd, generator=gen)
    pages = torch.tensor([1, 3, 5, 0, 7])
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    expected = state.clone()
    o_ref = ref.kda_varlen(*raw, expected, pages, has, qsl, max(lens))
    got = state.to(DEV)
    o = ref.kda_varlen(*(x.to(DEV) for x in raw), got, pages.to(DEV), has.to(DEV), qsl.to(DEV),
                       max(lens), decode=tri.kda_decode)  # fmt: skip
    torch.testing.assert_close(o.cpu(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got.cpu(), expected, rtol=1e-5, atol=1e-5)
