import math

import pytest
import torch
import torch.nn.functional as F

from hybridkv.ops.mamba2_ops import ScanParams, TorchMamba2Ops
from tests.conftest import state_meta


def naive_scan(x, dt, A, B, C, D, dt_bias, h0, dt_limit):
    """One request, token by token, in float64. x: [L, H, P]; B, C: [L, G, N]; h0: [H, P, N]."""
    x, dt, B, C, h = x.double(), dt.double(), B.double(), C.double(), h0.double()
    A, D, dt_bias = A.double(), D.double(), dt_bias.double()
    hpg = x.shape[1] // B.shape[1]
    Bh, Ch = B.repeat_interleave(hpg, dim=1), C.repeat_interleave(hpg, dim=1)  # [L, H, N]
    dt = F.softplus(dt + dt_bias).clamp(*dt_limit)
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)[:, None, None]
        h = decay * h + (dt[t][:, None] * x[t])[..., None] * Bh[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, Ch[t]) + D[:, None] * x[t])
    return torch.stack(ys), h


class Problem:
    """Random Mamba2 scan inputs for packed requests with q_lens; pages without state are NaN."""

    def __init__(self, q_lens, has_init, heads=4, head_dim=3, groups=2, d_state=5, seed=0):
        g = torch.Generator().manual_seed(seed)
        t = sum(q_lens)
        self.x = torch.randn(t, heads, head_dim, generator=g)
        self.dt = torch.randn(t, heads, generator=g)
        self.B = torch.randn(t, groups, d_state, generator=g)
        self.C = torch.randn(t, groups, d_state, generator=g)
        self.A = -torch.rand(heads, generator=g) * 2 - 0.1
        self.D = torch.randn(heads, generator=g)
        self.dt_bias = torch.randn(heads, generator=g) * 0.5
        num_pages = len(q_lens) + 5
        self.ssm_state = torch.randn(num_pages, heads, head_dim, d_state, generator=g)
        self.pages = torch.randperm(num_pages, generator=g)[: len(q_lens)]
        self.has = torch.tensor(has_init)
        self.ssm_state[self.pages[~self.has]] = float("nan")
        self.q_lens = q_lens
        self.qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)

    def run(self, chunk_size, dt_limit=(0.0, math.inf), ops=None):
        """The scan of a Mamba2 ops backend (default: the PyTorch reference)."""
        ops = ops or TorchMamba2Ops()
        meta = state_meta(self.pages, self.has, self.qsl, max(self.q_lens))
        params = ScanParams(self.A, self.D, self.dt_bias, chunk_size, dt_limit)
        return ops.scan(
            self.x, self.dt, self.B, self.C, self.ssm_state, meta, params, self.x.dtype
        )

    def reference(self, dt_limit=(0.0, math.inf)):
        ys, hs = [], []
        for s, page in enumerate(self.pages.tolist()):
            sl = slice(int(self.qsl[s]), int(self.qsl[s + 1]))
            h0 = self.ssm_state[page] if self.has[s] else torch.zeros_like(self.ssm_state[0])
            y, h = naive_scan(
                self.x[sl], self.dt[sl], self.A, self.B[sl], self.C[sl], self.D,
                self.dt_bias, h0, dt_limit,
            )  # fmt: skip
            ys.append(y)
            hs.append(h)
        return torch.cat(ys).float(), torch.stack(hs).float()


@pytest.mark.parametrize(
    "q_lens,has_init,chunk_size",
    [
        ([9, 1, 3, 12, 1, 2], [False, True, True, False, False, True], 4),  # ragged + decodes
        ([5, 7], [True, False], 16),  # one chunk each, shorter than chunk_size
        ([1, 1, 1], [True, False, True], 8),  # decode fast path
        ([8, 4], [True, True], 4),  # exact multiples of the chunk
    ],
)
def test_matches_sequential_reference(q_lens, has_init, chunk_size, mamba2_ops):
    p = Problem(q_lens, has_init)
    ref_y, ref_h = p.reference()
    y = p.run(chunk_size, ops=mamba2_ops)
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p.ssm_state[p.pages], ref_h, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "q_lens,has_init,shape",
    [
        # multiples of 16: the native kernel's register-blocked path for spans of 8+ tokens,
        # next to short spans; 300 tokens cross its 256-token segments
        ([300, 1, 9, 7], [True, False, False, True], dict(head_dim=32, d_state=32)),
        ([8, 40], [False, True], dict(heads=2, head_dim=16, groups=1, d_state=48)),
        ([20], [True], dict(head_dim=16, d_state=20)),  # d_state not a multiple: the row path
    ],
)
def test_long_spans_match_sequential_reference(q_lens, has_init, shape, mamba2_ops):
    p = Problem(q_lens, has_init, **shape)
    ref_y, ref_h = p.reference()
    y = p.run(chunk_size=64, ops=mamba2_ops)
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(p.ssm_state[p.pages], ref_h, rtol=1e-4, atol=1e-4)


def test_dt_limit_and_single_group():
    p = Problem([6, 1, 3], [False, True, False], groups=1)
    limit = (0.3, 0.9)
    ref_y, ref_h = p.reference(limit)
    y = p.run(4, dt_limit=limit)
    torch.testing.assert_close(y, ref_y, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(p.ssm_state[p.pages], ref_h, rtol=1e-4, atol=1e-5)


def test_chunked_prefill_equals_one_shot(mamba2_ops):
    """Cuts at non-aligned positions, carrying the state through the page, give one-shot."""
    full = Problem([13, 10], [False, False], seed=3)
    y_full = full.run(chunk_size=4)
    h_full = full.ssm_state[full.pages].clone()

    cuts = [[0, 3, 4, 9, 10, 13], [0, 1, 6, 7, 7, 10]]  # includes a 1-token and a 0-token step
    state = torch.full_like(full.ssm_state, float("nan"))
    outs = [[], []]
    starts = [0, 13]
    for step in range(len(cuts[0]) - 1):
        idx = [
            torch.arange(starts[s] + cuts[s][step], starts[s] + cuts[s][step + 1]) for s in range(2)
        ]
        lens = [len(i) for i in idx]
        tok = torch.cat(idx)
        qsl = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
        meta = state_meta(full.pages, torch.tensor([step > 0] * 2), qsl, max(lens))
        params = ScanParams(full.A, full.D, full.dt_bias, 4, (0.0, math.inf))
        y = mamba2_ops.scan(
            full.x[tok], full.dt[tok], full.B[tok], full.C[tok], state, meta, params, torch.float32
        )
        outs[0].append(y[: lens[0]])
        outs[1].append(y[lens[0] :])
    torch.testing.assert_close(torch.cat(outs[0] + outs[1]), y_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state[full.pages], h_full, rtol=1e-5, atol=1e-5)


def test_matches_transformers_chunk_scan():
    """Against transformers' pure-PyTorch chunked scan (with initial and final states)."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    q_lens = [37, 20]
    p = Problem(q_lens, [True, True], heads=8, head_dim=4, groups=2, d_state=8, seed=5)
    h0 = p.ssm_state[p.pages].clone()
    y = p.run(chunk_size=16)
    for s in range(2):
        sl = slice(int(p.qsl[s]), int(p.qsl[s + 1]))
        ref_y, ref_h = mamba2_chunk_scan(
            p.x[None, sl], p.dt[None, sl], p.A, p.B[None, sl], p.C[None, sl], chunk_size=16,
            D=p.D, dt_bias=p.dt_bias, initial_states=h0[s : s + 1], dt_softplus=True,
            return_final_states=True,
        )  # fmt: skip
        err_y = ((y[sl] - ref_y[0]).abs().max() / ref_y.abs().max()).item()
        err_h = ((p.ssm_state[p.pages[s]] - ref_h[0]).abs().max() / ref_h.abs().max()).item()
        assert err_y < 1e-5 and err_h < 1e-5, (err_y, err_h)


def test_decode_in_place_matches_ssd_step_and_leaves_other_pages():
    from hybridkv.ops.mamba2 import decode_in_place, ssd_step

    g = torch.Generator().manual_seed(5)
    R, H, P, N, G = 3, 4, 5, 6, 2
    pages = torch.tensor([4, 0, 2])
    state = torch.randn(6, H, P, N, generator=g)
    x, dt = torch.randn(R, H, P, generator=g), torch.rand(R, H, generator=g)
    A, D = -torch.rand(H, generator=g), torch.randn(H, generator=g)
    B, C = torch.randn(R, G, N, generator=g), torch.randn(R, G, N, generator=g)
    y_ref, h_ref = ssd_step(x, dt, A, B, C, D, state[pages].clone())
    new = state.clone()
    y = decode_in_place(new, pages, x, dt, A, B, C, D)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(new[pages], h_ref, rtol=1e-5, atol=1e-5)
    untouched = torch.tensor([1, 3, 5])
    assert torch.equal(new[untouched], state[untouched])
