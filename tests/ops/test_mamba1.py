"""The Mamba1 selective scan: the PyTorch reference (hybridkv.ops.mamba1) against a float64 token
loop and transformers' MambaMixer slow-path functions, and the native CPU kernel against the
reference.

Every state cache starts with NaN bit patterns on the pages of requests without an initial state
(they must never be read) and random values elsewhere; pages of nobody must stay untouched.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F

from hybridkv.forward_batch import StateMetadata
from hybridkv.ops import native
from hybridkv.ops.mamba1 import mamba1_scan_varlen
from hybridkv.ops.mamba1_ops import Mamba1Params, NativeMamba1Ops, TorchMamba1Ops
from hybridkv.ops.native import ssm as native_ssm

DI, N = 24, 8


class Case:
    """A packed batch: inputs [T, Di] / [T, N], parameters, a NaN-seeded paged state."""

    def __init__(
        self,
        lens: list[int],
        has_init: list[bool],
        seed: int = 0,
        di: int = DI,
        n: int = N,
        num_pages: int = 10,
        state_dtype: torch.dtype = torch.float32,
        in_dtype: torch.dtype = torch.float32,
    ):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.has_init_list = lens, has_init
        total = sum(lens)

        def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
            return torch.randn(*shape, generator=gen) * scale

        # x, dt, z as strided column slices of one projection, as the mixer hands them over
        xdz = rand(total, 3 * di + 5)
        self.x, self.dt, self.z = xdz[:, :di], xdz[:, di : 2 * di] - 1.0, xdz[:, 2 * di + 5 :]
        self.x, self.dt, self.z = (t.to(in_dtype) for t in (self.x, self.dt, self.z))
        bc = rand(total, 2 * n + 3).to(in_dtype)
        self.B, self.C = bc[:, :n], bc[:, n + 3 :]
        self.A = -torch.exp(rand(di, n, scale=0.8))  # [Di, N]
        self.D = rand(di)
        self.dt_bias = rand(di, scale=0.5)
        self.pages = torch.randperm(num_pages, generator=gen)[: len(lens)]
        self.has_init = torch.tensor(has_init)
        state = rand(num_pages, di, n)
        state[self.pages[~self.has_init]] = float("nan")
        self.state = state.to(state_dtype)
        qsl = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])
        self.meta = StateMetadata(self.pages, self.has_init, qsl.to(torch.int32), max(lens))

    def run(self, fn=mamba1_scan_varlen, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
        """(y, the state after) through the function with the varlen signature."""
        state = self.state.clone()
        args = dict(D=self.D, z=self.z, dt_bias=self.dt_bias)
        args.update(overrides)
        y = fn(
            self.x, self.dt, self.A, self.B, self.C, args["D"], args["z"], args["dt_bias"],
            state, self.pages, self.has_init, self.meta.query_start_loc, self.meta.max_query_len,
        )  # fmt: skip
        return y, state

    def run_ops(self, ops) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state.clone()
        p = Mamba1Params(self.A, self.D, self.dt_bias)
        y = ops.scan(self.x, self.dt, self.B, self.C, self.z, state, self.meta, p, torch.float32)
        return y, state

    def loop64(self) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """The float64 token loop: y [T, Di] and each request's final state by page."""
        x, dt, z = self.x.double(), self.dt.double(), self.z.double()
        B, C, A = self.B.double(), self.C.double(), self.A.double()
        y = torch.zeros_like(x)
        finals, start = {}, 0
        for r, length in enumerate(self.lens):
            page = int(self.pages[r])
            h = self.state[page].double() if self.has_init_list[r] else torch.zeros(A.shape)
            h = h.double()
            for t in range(start, start + length):
                d = F.softplus(dt[t] + self.dt_bias.double())
                h = torch.exp(d[:, None] * A) * h + (d * x[t])[:, None] * B[t][None, :]
                y[t] = (h @ C[t] + self.D.double() * x[t]) * F.silu(z[t])
            if length > 0:
                finals[page] = h
            start += length
        return y, finals

    def untouched(self, state: torch.Tensor) -> None:
        """Pages of nobody and of zero-length requests keep their exact bits."""
        busy = {int(p) for p, n in zip(self.pages, self.lens, strict=True) if n > 0}
        for page in range(state.shape[0]):
            if page not in busy:
                assert torch.equal(
                    state[page].view(torch.uint8), self.state[page].view(torch.uint8)
                ), page


MIXED = dict(  # prefill chunks with and without state, decodes, a zero-length request
    lens=[7, 1, 0, 13, 1, 3], has_init=[False, True, True, True, False, False]
)


@pytest.mark.parametrize(
    "case",
    [
        MIXED,
        dict(lens=[1, 1, 1, 1], has_init=[True, False, True, True]),  # pure decode
        dict(lens=[9], has_init=[True]),
        dict(lens=[5, 2], has_init=[False, False]),
    ],
)
def test_reference_matches_float64_loop(case) -> None:
    c = Case(**case)
    y, state = c.run()
    y64, finals = c.loop64()
    assert not torch.isnan(y).any(), "a NaN page of a request without state leaked"
    torch.testing.assert_close(y, y64.float(), rtol=1e-5, atol=1e-5)
    for page, h in finals.items():
        torch.testing.assert_close(state[page], h.float(), rtol=1e-5, atol=1e-5)
    c.untouched(state)


def test_reference_optional_terms_and_dtypes() -> None:
    """No D, no z, no dt_bias: plain h @ C; bf16 state pages round the float32 state; out_dtype."""
    c = Case(**MIXED, seed=3)
    y, _ = c.run(D=None, z=None, dt_bias=None)
    c.D, c.z, c.dt_bias = torch.zeros(DI), torch.full_like(c.z, 50.0), torch.zeros(DI)
    y_same, _ = c.run()  # silu(50) = 50: divide it out
    torch.testing.assert_close(y, y_same / 50.0, rtol=1e-5, atol=1e-6)

    c16 = Case(**MIXED, seed=4, state_dtype=torch.bfloat16)
    c32 = Case(**MIXED, seed=4)
    c32.state = c16.state.float()  # the same starting values
    y16, s16 = c16.run()
    y32, s32 = c32.run()
    torch.testing.assert_close(y16, y32)  # the math is float32 either way
    assert s16.dtype == torch.bfloat16
    torch.testing.assert_close(s16.float(), s32.to(torch.bfloat16).float(), equal_nan=True)
    c16.untouched(s16)
    out = mamba1_scan_varlen(
        c32.x, c32.dt, c32.A, c32.B, c32.C, c32.D, c32.z, c32.dt_bias, c32.state.clone(),
        c32.pages, c32.has_init, c32.meta.query_start_loc, 13, out_dtype=torch.bfloat16,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), y32, rtol=1e-2, atol=1e-2)


def test_empty_batch() -> None:
    c = Case(lens=[0, 0], has_init=[True, False])
    y, state = c.run()
    assert y.shape == (0, DI)
    c.untouched(state)


def _hf_functions():
    from transformers.models.mamba import modeling_mamba as mm

    # their pure-PyTorch fallbacks (mamba_ssm is not installed; kernels are never fetched)
    return mm.mamba_selective_scan, mm.mamba_selective_state_update


def test_reference_matches_transformers_slow_path() -> None:
    """Prefill from zeros against `mamba_selective_scan`, then decode steps against
    `mamba_selective_state_update` continuing from the state it returned."""
    hf_scan, hf_update = _hf_functions()
    c = Case(lens=[11], has_init=[False], seed=5)
    y, state = c.run()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref, h = hf_scan(
            c.x.t()[None], c.dt.t()[None], c.A, c.B.t()[None], c.C.t()[None], D=c.D,
            z=c.z.t()[None], delta_bias=c.dt_bias, delta_softplus=True, return_last_state=True,
        )  # fmt: skip
    torch.testing.assert_close(y, ref[0].t(), rtol=1e-5, atol=1e-5)
    page = int(c.pages[0])
    torch.testing.assert_close(state[page], h[0], rtol=1e-5, atol=1e-5)

    gen = torch.Generator().manual_seed(6)
    hf_state = h.clone()  # [1, Di, N]
    for _ in range(3):
        x, dt, z = (torch.randn(1, DI, generator=gen) for _ in range(3))
        B, C = torch.randn(1, N, generator=gen), torch.randn(1, N, generator=gen)
        ref = hf_update(hf_state, x, dt, c.A, B, C, c.D, dt_bias=c.dt_bias, dt_softplus=True, z=z)
        ours = mamba1_scan_varlen(
            x, dt, c.A, B, C, c.D, z, c.dt_bias, state, c.pages, torch.tensor([True]),
            torch.tensor([0, 1], dtype=torch.int32), 1,
        )  # fmt: skip
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state[page], hf_state[0], rtol=1e-5, atol=1e-5)


def test_split_steps_equal_one_shot() -> None:
    """A request's tokens in several steps (prefill chunk, decode, chunk) equal one shot."""
    c = Case(lens=[10], has_init=[False], seed=7)
    y_all, s_all = c.run()
    state = c.state.clone()
    outs = []
    for a, b in ((0, 4), (4, 5), (5, 10)):
        qsl = torch.tensor([0, b - a], dtype=torch.int32)
        y = mamba1_scan_varlen(
            c.x[a:b], c.dt[a:b], c.A, c.B[a:b], c.C[a:b], c.D, c.z[a:b], c.dt_bias, state,
            c.pages, torch.tensor([a > 0]), qsl, b - a,
        )  # fmt: skip
        outs.append(y)
    torch.testing.assert_close(torch.cat(outs), y_all, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, s_all, rtol=1e-5, atol=1e-6, equal_nan=True)


# ---- the ops classes and the native kernel ---------------------------------------------------


def test_torch_ops_scan_is_the_reference() -> None:
    c = Case(**MIXED, seed=8)
    y, state = c.run_ops(TorchMamba1Ops())
    y_ref, s_ref = c.run()
    assert torch.equal(y, y_ref)
    assert torch.equal(state.nan_to_num(), s_ref.nan_to_num())


needs_native = pytest.mark.skipif(native.library() is None, reason="no native kernels here")


def native_scan(x, dt, A, B, C, D, z, dt_bias, state, pages, has_init, qsl, max_len):
    """The native kernel with the reference's signature (max_len unused)."""
    y = native_ssm.mamba1_scan(x, dt, A, B, C, D, z, dt_bias, state, pages, has_init, qsl)
    assert y is not None, "the native kernel declined"
    return y


@needs_native
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("di", "n", "case"),
    [
        (DI, N, MIXED),
        (70, 5, MIXED),  # two channel blocks, a partial one, odd N
        (130, 16, dict(lens=[1, 1, 0, 1, 1], has_init=[True, False, True, True, True])),
        (64, 3, dict(lens=[40, 2], has_init=[True, False])),
        # whole blocks of N a multiple of the vector lanes: state tiles transposed in registers
        (128, 32, dict(lens=[20, 1, 5], has_init=[True, True, False])),
    ],
)
def test_native_matches_reference(di, n, case, in_dtype, state_dtype) -> None:
    c = Case(**case, seed=di + n, di=di, n=n, state_dtype=state_dtype, in_dtype=in_dtype)
    y_ref, s_ref = c.run()
    y, state = c.run(native_scan)
    assert y.dtype == torch.float32 and not torch.isnan(y).any()
    torch.testing.assert_close(y, y_ref, rtol=2e-5, atol=2e-5)
    if state_dtype == torch.float32:
        torch.testing.assert_close(state, s_ref, rtol=2e-5, atol=2e-5, equal_nan=True)
    else:  # both round float32 states that may differ in their last bits
        diff = (state.float() - s_ref.float()).nan_to_num().abs()
        assert diff.max() <= 1e-2 * s_ref.float().nan_to_num().abs().max()
        assert (diff > 0).float().mean() < 0.05
    c.untouched(state)


@needs_native
def test_native_optional_terms_and_extremes() -> None:
    """No D / z / dt_bias; dt far into both tails of softplus (vs float64); empty batches."""
    c = Case(**MIXED, seed=11)
    y_ref, s_ref = c.run(D=None, z=None, dt_bias=None)
    y, state = c.run(native_scan, D=None, z=None, dt_bias=None)
    torch.testing.assert_close(y, y_ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state, s_ref, rtol=2e-5, atol=2e-5, equal_nan=True)

    c = Case(lens=[6, 1], has_init=[True, True], seed=12)
    c.dt = c.dt * 40.0  # softplus from about e^-160 (decay 1) to about 160 (decay 0)
    c.dt[0, :3] = torch.tensor([30.0, -100.0, 0.0])
    y, state = c.run(native_scan)
    y64, finals = c.loop64()
    torch.testing.assert_close(y, y64.float(), rtol=1e-4, atol=1e-4)
    for page, h in finals.items():
        torch.testing.assert_close(state[page], h.float(), rtol=1e-4, atol=1e-4)

    c = Case(lens=[0, 0], has_init=[True, False])
    y, state = c.run(native_scan)
    assert y.shape == (0, DI)
    c.untouched(state)


@needs_native
def test_native_declines_what_it_cannot_run() -> None:
    c = Case(lens=[3], has_init=[True])
    args = (c.A, c.B, c.C, c.D, c.z, c.dt_bias)
    meta = (c.pages, c.has_init, c.meta.query_start_loc)
    assert native_ssm.mamba1_scan(c.x.half(), c.dt, *args, c.state, *meta) is None
    assert native_ssm.mamba1_scan(c.x, c.dt, *args, c.state.double(), *meta) is None
    assert native_ssm.mamba1_scan(c.x, c.dt, c.A[:, :-1], *args[1:], c.state, *meta) is None
    bad_page = torch.tensor([c.state.shape[0]])
    assert native_ssm.mamba1_scan(c.x, c.dt, *args, c.state, bad_page, *meta[1:]) is None


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_ops_match_torch_ops(dtype) -> None:
    """NativeMamba1Ops: the native scan, and the conv1d (native for float32, PyTorch for bf16)
    equal to the torch ops'."""
    c = Case(**MIXED, seed=13, in_dtype=dtype, state_dtype=dtype)
    y, state = c.run_ops(NativeMamba1Ops())
    y_ref, s_ref = c.run_ops(TorchMamba1Ops())
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(state.float(), s_ref.float(), rtol=tol, atol=tol, equal_nan=True)

    gen = torch.Generator().manual_seed(14)
    x = torch.randn(sum(MIXED["lens"]), DI, generator=gen).to(dtype)
    weight, bias = torch.randn(DI, 4, generator=gen).to(dtype), torch.randn(DI).to(dtype)
    conv = torch.randn(10, DI, 3, generator=gen).to(dtype)
    conv[c.pages[~c.has_init]] = float("nan")
    conv_ref = conv.clone()
    out = NativeMamba1Ops().conv1d(x, weight, bias, conv, c.meta, "silu")
    ref = TorchMamba1Ops().conv1d(x, weight, bias, conv_ref, c.meta, "silu")
    assert out.dtype == dtype and not torch.isnan(out).any()
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(conv, conv_ref, rtol=tol, atol=tol, equal_nan=True)
