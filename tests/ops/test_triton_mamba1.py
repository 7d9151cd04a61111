"""The Triton Mamba1 decode kernel against the PyTorch reference (hybridkv.ops.mamba1).

Compiled on a GPU when there is one, else through Triton's interpreter on the CPU. Pages are
handed out in random order and the pages of requests without an initial state hold NaN bit
patterns: they must never be read, and pages of nobody must stay untouched.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.forward_batch import StateMetadata  # noqa: E402
from hybridkv.ops import registry
from hybridkv.ops import triton_mamba1 as tri  # noqa: E402
from hybridkv.ops.mamba1 import mamba1_scan_varlen  # noqa: E402
from hybridkv.ops.mamba1_ops import Mamba1Params, TorchMamba1Ops, TritonMamba1Ops  # noqa: E402

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def pytorch_reference(monkeypatch):
    """The reference is the PyTorch path itself, not the native CPU kernels."""
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting


class Batch:
    """Packed requests ([T, Di] / [T, N] inputs as strided column slices) and a paged state
    whose pages of requests without a state hold NaN."""

    def __init__(self, lens, has_init, di, n, seed, in_dtype=torch.float32,
                 state_dtype=torch.float32, num_pages=12):  # fmt: skip
        gen = torch.Generator().manual_seed(seed)
        total = sum(lens)
        xdz = torch.randn(total, 3 * di + 1, generator=gen)
        self.x, self.dt, self.z = xdz[:, :di], xdz[:, di : 2 * di] - 1, xdz[:, 2 * di + 1 :]
        bc = torch.randn(total, 2 * n + 1, generator=gen)
        self.B, self.C = bc[:, :n], bc[:, n + 1 :]
        for name in ("x", "dt", "z", "B", "C"):
            setattr(self, name, getattr(self, name).to(DEV, in_dtype))
        self.A = (-torch.exp(torch.randn(di, n, generator=gen) * 0.8)).to(DEV)
        self.D = torch.randn(di, generator=gen).to(DEV)
        self.dt_bias = (torch.randn(di, generator=gen) * 0.5).to(DEV)
        pages = torch.randperm(num_pages, generator=gen)[: len(lens)]
        has = torch.tensor(has_init)
        state = torch.randn(num_pages, di, n, generator=gen)
        state[pages[~has]] = float("nan")
        self.state = state.to(DEV, state_dtype)
        qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        self.meta = StateMetadata(pages.to(DEV), has.to(DEV), qsl.to(DEV), max(lens))
        self.lens = lens

    def scan(self, ops) -> tuple[torch.Tensor, torch.Tensor]:
        state = self.state.clone()
        p = Mamba1Params(self.A, self.D, self.dt_bias)
        y = ops.scan(self.x, self.dt, self.B, self.C, self.z, state, self.meta, p, torch.float32)
        return y, state

    def check_untouched(self, state: torch.Tensor) -> None:
        busy = {int(p) for p, n in zip(self.meta.state_pages, self.lens, strict=True) if n}
        for page in range(state.shape[0]):
            if page not in busy:
                assert torch.equal(state[page].view(torch.uint8),
                                   self.state[page].view(torch.uint8)), page  # fmt: skip


@pytest.mark.parametrize(("di", "n"), [(24, 8), (70, 5), (300, 16)])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_decode_kernel_matches_reference(di, n, state_dtype) -> None:
    b = Batch([1] * 5, [True, False, True, False, True], di, n, seed=di + n,
              state_dtype=state_dtype)  # fmt: skip
    y_ref, s_ref = b.scan(TorchMamba1Ops())
    y, state = b.scan(TritonMamba1Ops())
    assert not torch.isnan(y).any(), "a NaN page of a request without state was read"
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2
    pages = b.meta.state_pages
    torch.testing.assert_close(state[pages].float(), s_ref[pages].float(), rtol=tol, atol=tol)
    b.check_untouched(state)


def test_decode_kernel_bf16_inputs_and_optional_terms() -> None:
    """bf16 x/dt/z/B/C; without D, z and dt_bias; dt in both tails of softplus."""
    b = Batch([1] * 4, [True, True, False, True], 40, 16, seed=3, in_dtype=torch.bfloat16)
    y_ref, s_ref = b.scan(TorchMamba1Ops())
    y, state = b.scan(TritonMamba1Ops())
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, s_ref, rtol=1e-5, atol=1e-5, equal_nan=True)

    b = Batch([1] * 3, [True, False, True], 33, 7, seed=4)
    b.dt = b.dt * 30.0  # softplus from about e^-120 to about 120
    b.dt[0, :3] = torch.tensor([25.0, -90.0, 19.5])
    pages, has = b.meta.state_pages, b.meta.has_initial_state
    qsl = b.meta.query_start_loc
    ref_state, state = b.state.clone(), b.state.clone()
    y_ref = mamba1_scan_varlen(b.x, b.dt, b.A, b.B, b.C, None, None, None, ref_state, pages,
                               has, qsl, 1)  # fmt: skip
    y = tri.mamba1_decode(state, pages, has, b.x, b.dt, b.A, b.B, b.C, None, None, None)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_mixed_batch_routes_one_token_requests_through_the_kernel() -> None:
    """Prefill chunks in PyTorch and one-token requests in Triton, in one step; a zero-length
    request's page untouched."""
    b = Batch([6, 1, 0, 1, 3], [False, True, True, False, True], 50, 16, seed=5)
    y_ref, s_ref = b.scan(TorchMamba1Ops())
    y, state = b.scan(TritonMamba1Ops())
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, s_ref, rtol=1e-5, atol=1e-5, equal_nan=True)
    b.check_untouched(state)


def test_triton_ops_conv_decode_matches_torch() -> None:
    gen = torch.Generator().manual_seed(6)
    b = Batch([1] * 4, [True, False, True, True], 40, 8, seed=6)
    conv = torch.randn(12, 40, 3, generator=gen).to(DEV)
    conv[b.meta.state_pages[~b.meta.has_initial_state]] = float("nan")
    x = torch.randn(4, 40, generator=gen).to(DEV)
    w, bias = torch.randn(40, 4, generator=gen).to(DEV), torch.randn(40, generator=gen).to(DEV)
    conv_ref = conv.clone()
    out = TritonMamba1Ops().conv1d(x, w, bias, conv, b.meta, "silu")
    ref = TorchMamba1Ops().conv1d(x, w, bias, conv_ref, b.meta, "silu")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_mixer_steps_with_triton_ops_match_transformers() -> None:
    """The Jamba mixer through TritonMamba1Ops: a prefill, a mixed step, decode steps (Triton
    conv and scan decode kernels) against transformers' slow forward of the whole sequence."""
    from tests.layers.test_mamba1 import HIDDEN, Pages, build, hf_outputs, meta_for, rel_err

    hf, ours = build("jamba", seed=4)
    ours = ours.to(DEV)
    seqs = [torch.randn(8, HIDDEN), torch.randn(5, HIDDEN)]
    refs = hf_outputs(hf, seqs)
    pages = Pages(ours)
    pages.conv, pages.ssm = pages.conv.to(DEV), pages.ssm.to(DEV)
    steps = [(5, 0), (1, 3), (1, 1), (1, 1)]  # tokens of each request per step
    done, outs = [0, 0], [[], []]
    for step in steps:
        names = [i for i in (0, 1) if step[i]]
        x = torch.cat([seqs[i][done[i] : done[i] + step[i]] for i in names]).to(DEV)
        meta = meta_for([step[i] for i in names], [3 + i for i in names],
                        [done[i] > 0 for i in names])  # fmt: skip
        tensors = (meta.state_pages, meta.has_initial_state, meta.query_start_loc)
        meta = StateMetadata(*(t.to(DEV) for t in tensors), meta.max_query_len)
        with torch.no_grad():
            y = ours.mix(x, pages.conv, pages.ssm, meta, TritonMamba1Ops())
        for i, part in zip(names, y.split([step[i] for i in names]), strict=True):
            outs[i].append(part.cpu())
            done[i] += step[i]
    assert done == [8, 5]
    for i in (0, 1):
        assert rel_err(torch.cat(outs[i]), refs[i]) <= 1e-5, i
