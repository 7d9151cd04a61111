"""Per-position states through every state kind's ops (`ops.positions` for the PyTorch ops and
the Triton ones, which run through them; the native kernels in C): a step mixing a prefill
chunk (no scratch row), speculating requests of several lengths and a one-token decode keeps,
for each speculating request and each of its tokens but the last, the state that stepping its
tokens one at a time leaves; outputs and pages equal those of the same step without positions
(PyTorch: one token at a time for the speculating requests, at once for the others)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.forward_batch import StateMetadata  # noqa: E402
from hybridkv.ops import native  # noqa: E402
from hybridkv.ops.gdn_ops import NativeGDNOps, TorchGDNOps, TritonGDNOps  # noqa: E402
from hybridkv.ops.kda_ops import NativeKdaOps, TorchKdaOps, TritonKdaOps  # noqa: E402
from hybridkv.ops.mamba1_ops import (  # noqa: E402
    Mamba1Params,
    NativeMamba1Ops,
    TorchMamba1Ops,
    TritonMamba1Ops,
)
from hybridkv.ops.mamba2_ops import (  # noqa: E402
    CompiledMamba2Ops,
    NativeMamba2Ops,
    ScanParams,
    TorchMamba2Ops,
    TritonMamba2Ops,
)

# requests of the step: a prefill chunk from nothing, speculating ones, a one-token decode
LENS, PAGES, HAS, ROWS = [6, 4, 1, 3, 2], [4, 1, 0, 3, 2], [0, 1, 1, 1, 1], [-1, 2, -1, 0, 1]
DEPTH, NUM_PAGES = 4, 5


def meta(lens, pages, has, rows=None, device="cpu") -> StateMetadata:
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return StateMetadata(
        torch.tensor(pages, device=device), torch.tensor(has, dtype=torch.bool, device=device),
        qsl.to(device), max(lens), None if rows is None else torch.tensor(rows, device=device),
    )  # fmt: skip


def mamba2_case(g):
    H, P, N, G = 4, 8, 16, 2
    x, dt = torch.randn(sum(LENS), H, P, generator=g), torch.randn(sum(LENS), H, generator=g)
    B, C = (torch.randn(sum(LENS), G, N, generator=g) for _ in range(2))
    p = ScanParams(-torch.rand(H, generator=g) - 0.5, torch.randn(H, generator=g),
                   torch.randn(H, generator=g), 4, (0.0, float("inf")))  # fmt: skip
    state = torch.randn(NUM_PAGES, H, P, N, generator=g)

    def call(ops, tokens, st, m, kept=None):
        on = p._replace(A=p.A.to(st.device), D=p.D.to(st.device), dt_bias=p.dt_bias.to(st.device))
        return ops.scan(*tokens, st, m, on, torch.float32, kept)

    return (x, dt, B, C), state, call


def mamba1_case(g):
    Di, N = 24, 8
    x, dt, z = (torch.randn(sum(LENS), Di, generator=g) for _ in range(3))
    B, C = (torch.randn(sum(LENS), N, generator=g) for _ in range(2))
    p = Mamba1Params(-torch.rand(Di, N, generator=g) - 0.2, torch.randn(Di, generator=g),
                     torch.randn(Di, generator=g) - 1.0)  # fmt: skip
    state = torch.randn(NUM_PAGES, Di, N, generator=g)

    def call(ops, tokens, st, m, kept=None):
        x, dt, B, C, z = tokens
        on = Mamba1Params(*(t if t is None else t.to(st.device) for t in p))
        return ops.scan(x, dt, B, C, z, st, m, on, torch.float32, kept)

    return (x, dt, B, C, z), state, call


def rule_case(g, per_channel: bool):
    Hk, Hv, K, V = (2, 2, 8, 8) if per_channel else (1, 3, 8, 12)
    T = sum(LENS)
    q, k = (torch.randn(T, Hk, K, generator=g) for _ in range(2))
    v = torch.randn(T, Hv, V, generator=g)
    gate = -torch.rand((T, Hv, K) if per_channel else (T, Hv), generator=g)
    beta = torch.rand(T, Hv, generator=g)
    state = 0.5 * torch.randn(NUM_PAGES, Hv, K, V, generator=g)

    def call(ops, tokens, st, m, kept=None):
        return ops.rule(*tokens, st, m, kept)

    return (q, k, v, gate, beta), state, call


CASES = {
    "mamba2": (mamba2_case, [TorchMamba2Ops, TritonMamba2Ops, CompiledMamba2Ops, NativeMamba2Ops]),
    "mamba1": (mamba1_case, [TorchMamba1Ops, TritonMamba1Ops, NativeMamba1Ops]),
    "gdn": (lambda g: rule_case(g, False), [TorchGDNOps, TritonGDNOps, NativeGDNOps]),
    "kda": (lambda g: rule_case(g, True), [TorchKdaOps, TritonKdaOps, NativeKdaOps]),
}


def _param(kind: str, cls: type) -> object:
    # the Triton ops run compiled on a GPU when there is one (marked: conftest leaves it seen)
    marks = [pytest.mark.triton] if cls.__name__.startswith("Triton") else []
    return pytest.param(kind, cls, marks=marks, id=f"{kind}-{cls.__name__}")


PARAMS = [_param(kind, cls) for kind, (_, classes) in CASES.items() for cls in classes]


@pytest.mark.parametrize("kind, ops_class", PARAMS)
@torch.inference_mode()
def test_kept_states_are_one_token_at_a_time(kind, ops_class):
    if ops_class.__name__.startswith("Native") and native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    assert ops_class.keeps_positions
    dev = "cuda" if ops_class.__name__.startswith("Triton") and torch.cuda.is_available() else "cpu"
    make, _ = CASES[kind]
    tokens, state0, call = make(torch.Generator().manual_seed(3))
    tokens = [t if t is None else t.to(dev) for t in tokens]
    state0 = state0.to(dev)
    ops = ops_class()
    if ops_class is CompiledMamba2Ops:
        torch._dynamo.reset()  # count this test's graphs only (another test may have compiled)
    graphs = _compiled_graphs()
    state = state0.clone()
    kept = torch.full((3, DEPTH, *state0.shape[1:]), float("nan"), device=dev)
    out = call(ops, tokens, state, meta(LENS, PAGES, HAS, ROWS, dev), kept)
    plain_state = state0.clone()
    plain = call(ops, tokens, plain_state, meta(LENS, PAGES, HAS, device=dev))
    # the same PyTorch ops on the same rows give the same bits (Mamba1's step contracts over
    # the batch: its rounding may depend on how many requests share the sub-batch)
    exact = ops_class in (TorchMamba2Ops, TorchGDNOps, TorchKdaOps)
    tol = dict(rtol=1e-4, atol=1e-5)
    first = [0, *torch.tensor(LENS).cumsum(0).tolist()]
    for s, (n, page, row) in enumerate(zip(LENS, PAGES, ROWS, strict=True)):
        rows = slice(first[s], first[s] + n)
        if row < 0:  # run as in the step without positions
            torch.testing.assert_close(out[rows], plain[rows], **tol)
            torch.testing.assert_close(state[page], plain_state[page], **tol)
            continue
        ref = state0.clone()
        for i in range(n):  # its tokens one at a time, from its page
            token = [t if t is None else t[first[s] + i : first[s] + i + 1] for t in tokens]
            y = call(ops, token, ref, meta([1], [page], [HAS[s] or i > 0], device=dev))
            if exact:
                assert torch.equal(out[first[s] + i], y[0]), (s, i)
            torch.testing.assert_close(out[first[s] + i], y[0], **tol)
            if i < n - 1:
                torch.testing.assert_close(kept[row, i], ref[page], **tol)
                if exact:
                    assert torch.equal(kept[row, i], ref[page]), (s, i)
        torch.testing.assert_close(state[page], ref[page], **tol)
        assert kept[row, n - 1 :].isnan().all()
    assert not kept[[2, 0, 1]][:, 0].isnan().any()  # every speculating request wrote position 0
    if ops_class is CompiledMamba2Ops:  # one compiled graph for steps of 1 and of 3 requests
        assert _compiled_graphs() - graphs == 1


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_the_schedule_is_worked_out_once_per_step():
    """Every state layer of a group gets the same metadata in a step: its sub-steps are worked
    out once and shared; another step's metadata gets its own (all requests, every token)."""
    from hybridkv.ops.positions import schedule

    step = meta(LENS, PAGES, HAS, ROWS)
    subs = schedule(step)
    assert schedule(step) is subs
    other = meta(LENS, PAGES, HAS, ROWS)
    assert schedule(other) is not subs and schedule(other) is schedule(other)
    tokens = sorted(t for sub in subs for t in sub.tokens.tolist())
    assert tokens == list(range(sum(LENS)))  # each token in exactly one sub-step
    # positions 0 .. 3 of the speculating requests (lengths 4, 3, 2), then the others at once
    assert [sub.position for sub in subs] == [-1, 0, 1, 2, 3]
    assert subs[4].keep is None  # the longest request's last token: its page holds it
