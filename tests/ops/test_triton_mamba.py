"""The Triton Mamba2 decode kernels against the PyTorch path (hybridkv.ops.mamba2 / conv1d).

Compiled on a GPU when there is one, else through Triton's interpreter on the CPU. Pages are
handed out in random order; every page starts as NaN bit patterns, so a request without an
initial state must never read its page, and pages of nobody must stay untouched.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.ops import conv1d as ref_conv  # noqa: E402
from hybridkv.ops import mamba2 as ref_ssm  # noqa: E402
from hybridkv.ops import registry
from hybridkv.ops import triton_mamba as tri  # noqa: E402

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def pytorch_reference(monkeypatch):
    """The reference is the PyTorch path itself, not the native CPU kernels."""
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting


def nan_pages(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """A state cache whose odd pages hold random values and even pages NaN bit patterns."""
    cache = torch.randn(shape, generator=gen).to(DEV, dtype)
    cache[::2] = float("nan")
    return cache


def pages_and_flags(num_seqs: int, num_pages: int, gen: torch.Generator):
    """Distinct random pages; requests on odd pages have a state, those on NaN pages do not."""
    pages = torch.randperm(num_pages, generator=gen)[:num_seqs]
    return pages.to(DEV), (pages % 2 == 1).to(DEV)


@pytest.mark.parametrize(
    ("heads", "groups", "head_dim", "d_state"), [(8, 2, 16, 8), (6, 1, 24, 12), (4, 4, 64, 128)]
)
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_ssm_decode_matches_pytorch(heads, groups, head_dim, d_state, state_dtype) -> None:
    gen = torch.Generator().manual_seed(heads * 1000 + head_dim)
    num_seqs, num_pages = 5, 12
    state = nan_pages((num_pages, heads, head_dim, d_state), state_dtype, gen)
    pages, has_state = pages_and_flags(num_seqs, num_pages, gen)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEV)

    x, B, C = (
        rand(num_seqs, heads, head_dim),
        rand(num_seqs, groups, d_state),
        rand(num_seqs, groups, d_state),
    )
    dt = torch.rand(num_seqs, heads, generator=gen).to(DEV) * 0.5
    A, D = -torch.rand(heads, generator=gen).to(DEV) - 0.1, rand(heads)

    expected_state = state.clone()
    h0 = ref_ssm._initial_ssm_state(expected_state, pages, has_state)
    y_ref, h = ref_ssm.ssd_step(x, dt, A, B, C, D, h0)
    expected_state.index_copy_(0, pages, h.to(state_dtype))

    y = tri.ssm_decode(state, pages, has_state, x, dt, A, B, C, D)
    assert not torch.isnan(y).any(), "a NaN page of a request without state was read"
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    # bf16 pages: both round the same float32 state, which may differ in its last bit
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(state[pages], expected_state[pages], rtol=tol, atol=tol)
    untouched = torch.ones(num_pages, dtype=torch.bool)
    untouched[pages.cpu()] = False
    assert torch.equal(state[untouched.to(DEV)].view(torch.uint8),
                       expected_state[untouched.to(DEV)].view(torch.uint8))  # fmt: skip


@pytest.mark.parametrize(("channels", "width"), [(40, 4), (300, 4), (17, 2), (33, 3)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
def test_conv1d_decode_matches_pytorch(channels, width, bias, activation) -> None:
    gen = torch.Generator().manual_seed(channels + width)
    num_seqs, num_pages = 6, 14
    state = nan_pages((num_pages, channels, width - 1), torch.float32, gen)
    pages, has_state = pages_and_flags(num_seqs, num_pages, gen)
    x = torch.randn(num_seqs, channels, generator=gen).to(DEV)
    weight = torch.randn(channels, width, generator=gen).to(DEV)
    b = torch.randn(channels, generator=gen).to(DEV) if bias else None

    expected_state = state.clone()
    y_ref = ref_conv.causal_conv1d_decode(
        x, weight, b, expected_state, pages, has_state, activation
    )
    y = tri.conv1d_decode(x, weight, b, state, pages, has_state, activation)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0, equal_nan=True)


def test_conv1d_decode_strided_rows_and_bf16_state() -> None:
    """x as a strided column slice of the mixer's in_proj output; a bfloat16 state cache."""
    gen = torch.Generator().manual_seed(7)
    zxbcdt = torch.randn(4, 100, generator=gen).to(DEV)
    x = zxbcdt[:, 10:74]  # [S, 64], row stride 100
    state = nan_pages((9, 64, 3), torch.bfloat16, gen)
    pages, has_state = pages_and_flags(4, 9, gen)
    weight = torch.randn(64, 4, generator=gen).to(DEV)
    expected_state = state.clone()
    y_ref = ref_conv.causal_conv1d_decode(x, weight, None, expected_state, pages, has_state)
    y = tri.conv1d_decode(x, weight, None, state, pages, has_state)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    # the new column is x rounded to bfloat16: to nearest even on a GPU and in torch, by
    # truncation in Triton's interpreter (one bf16 step, 2^-7 relative, apart)
    torch.testing.assert_close(state, expected_state, rtol=2**-7, atol=0, equal_nan=True)
    torch.testing.assert_close(state[..., :2], expected_state[..., :2], rtol=0, atol=0,
                               equal_nan=True)  # fmt: skip


def test_empty_batches_and_bad_activation() -> None:
    state = torch.zeros(2, 4, 8, 16, device=DEV)
    x = torch.zeros(0, 4, 8, device=DEV)
    bc = torch.zeros(0, 1, 16, device=DEV)
    per_head = torch.zeros(4, device=DEV)
    none = torch.zeros(0, dtype=torch.int64, device=DEV)
    flags = torch.zeros(0, dtype=torch.bool, device=DEV)
    y = tri.ssm_decode(state, none, flags, x, x[:, :, 0], per_head, bc, bc, per_head)
    assert y.shape == (0, 4, 8)
    conv_state = torch.zeros(2, 8, 3, device=DEV)
    y = tri.conv1d_decode(x[:, 0], torch.zeros(8, 4, device=DEV), None, conv_state, none, flags)
    assert y.shape == (0, 8)
    with pytest.raises(ValueError, match="unsupported conv1d activation 'gelu'"):
        tri.conv1d_decode(x[:, 0], torch.zeros(8, 4), None, conv_state, none, flags, "gelu")


# --- the "triton" Mamba2 ops (hybridkv.ops.mamba2_ops) route decode steps here -----------------


@pytest.fixture
def triton_ops():
    """The ops a state group runs when its plan says "triton" (on the CPU the kernels run
    through the interpreter)."""
    from hybridkv.ops.mamba2_ops import TritonMamba2Ops

    return TritonMamba2Ops()


@pytest.mark.parametrize(
    ("q_lens", "has_init"),
    [
        ([9, 1, 3, 12, 1, 2], [False, True, True, False, False, True]),  # mixed: decode rows
        ([1, 1, 1], [True, False, True]),  # a decode batch
    ],
)
def test_scan_routes_one_token_requests_to_the_kernel(triton_ops, q_lens, has_init) -> None:
    from tests.ops.test_mamba2 import Problem

    p = Problem(q_lens, has_init, heads=4, head_dim=8, groups=2, d_state=16)
    ref_y, ref_h = p.reference()
    for name in ("x", "dt", "A", "B", "C", "D", "dt_bias", "ssm_state", "pages", "has", "qsl"):
        setattr(p, name, getattr(p, name).to(DEV))
    calls = []
    real = tri.ssm_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tri, "ssm_decode", lambda *a: calls.append(a[1].numel()) or real(*a))
        y = p.run(chunk_size=4, ops=triton_ops)
    assert calls == [q_lens.count(1)]  # every one-token request, in one launch
    torch.testing.assert_close(y.cpu(), ref_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p.ssm_state[p.pages].cpu(), ref_h, rtol=1e-4, atol=1e-5)


def test_conv1d_routes_decode_batches_to_the_kernel(triton_ops) -> None:
    from tests.conftest import state_meta

    gen = torch.Generator().manual_seed(3)
    state = nan_pages((8, 24, 3), torch.float32, gen)
    pages, has_state = pages_and_flags(4, 8, gen)
    x = torch.randn(4, 24, generator=gen).to(DEV)
    weight = torch.randn(24, 4, generator=gen).to(DEV)
    qsl = torch.arange(5, dtype=torch.int32, device=DEV)
    expected_state = state.clone()
    y_ref = ref_conv.causal_conv1d_decode(x, weight, None, expected_state, pages, has_state)
    calls = []
    real = tri.conv1d_decode
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tri, "conv1d_decode", lambda *a: calls.append(1) or real(*a))
        y = triton_ops.conv1d(x, weight, None, state, state_meta(pages, has_state, qsl, 1), "silu")
    assert calls == [1]
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, expected_state, rtol=0, atol=0, equal_nan=True)
