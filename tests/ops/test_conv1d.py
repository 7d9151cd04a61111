import pytest
import torch
import torch.nn.functional as F

from tests.conftest import state_meta


def run_conv(ops, x, weight, bias, conv_state, pages, has, qsl, max_query_len, activation="silu"):
    """The conv of a Mamba2 ops backend (native or PyTorch, from the `mamba2_ops` fixture)."""
    return ops.conv1d(x, weight, bias, conv_state, state_meta(pages, has, qsl, max_query_len),
                      activation)  # fmt: skip


def naive_conv(x, weight, bias, state, activation):
    """One request, token by token. x: [L, C]; state: [C, K-1] -> y [L, C], new state."""
    window = state.clone()
    ys = []
    for t in range(x.shape[0]):
        full = torch.cat([window, x[t][:, None]], dim=1)  # [C, K]
        y = (full * weight).sum(-1) + (0 if bias is None else bias)
        ys.append(F.silu(y) if activation == "silu" else y)
        window = full[:, 1:]
    return torch.stack(ys) if ys else x.new_zeros(0, x.shape[1]), window


def make_batch(q_lens, has_init, channels, k, num_pages=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(q_lens), channels, generator=g)
    conv_state = torch.randn(num_pages, channels, k - 1, generator=g)
    pages = torch.randperm(num_pages, generator=g)[: len(q_lens)]
    has = torch.tensor(has_init)
    conv_state[pages[~has]] = float("nan")  # stale bit patterns: must never be read
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return x, conv_state, pages, has, qsl


def run_reference(x, weight, bias, conv_state, pages, has, qsl, activation):
    ys, states = [], []
    for s in range(len(pages)):
        st = conv_state[pages[s]] if has[s] else torch.zeros_like(conv_state[0])
        y, new = naive_conv(x[qsl[s] : qsl[s + 1]], weight, bias, st, activation)
        ys.append(y)
        states.append(new)
    return torch.cat(ys), torch.stack(states)


@pytest.mark.parametrize(
    "q_lens,has_init",
    [
        ([7, 1, 2, 5, 1, 3], [False, True, True, False, False, True]),  # mixed, short chunks
        ([1, 1, 1, 1], [True, False, True, True]),  # decode fast path
        ([1, 1, 1], [True, True, True]),  # decode, every request with a state (native kernel)
        ([2], [True]),  # fewer than K-1 new tokens
    ],
)
@pytest.mark.parametrize("activation,use_bias", [("silu", True), (None, False)])
def test_matches_sequential_reference(q_lens, has_init, activation, use_bias, mamba2_ops):
    channels, k = 6, 4
    x, conv_state, pages, has, qsl = make_batch(q_lens, has_init, channels, k)
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(channels, k, generator=g)
    bias = torch.randn(channels, generator=g) if use_bias else None
    ref_y, ref_state = run_reference(x, weight, bias, conv_state, pages, has, qsl, activation)

    untouched = torch.ones(conv_state.shape[0], dtype=torch.bool)
    untouched[pages] = False
    before = conv_state[untouched].clone()
    y = run_conv(
        mamba2_ops, x, weight, bias, conv_state, pages, has, qsl, max(q_lens), activation=activation
    )
    assert not torch.isnan(y).any()
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv_state[pages], ref_state, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(conv_state[untouched], before, equal_nan=True)


def test_chunked_prefill_equals_one_shot(mamba2_ops):
    """Cutting sequences at arbitrary points and carrying the page gives the one-shot result."""
    channels, k = 5, 4
    g = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(channels, k, generator=g), torch.randn(channels, generator=g)
    seqs = [torch.randn(n, channels, generator=g) for n in (11, 6)]
    cuts = [[0, 1, 3, 4, 9, 11], [0, 2, 2, 5, 6, 6]]  # per step; empty steps allowed

    one_shot_state = torch.full((4, channels, k - 1), float("nan"))
    pages = torch.tensor([2, 0])
    x = torch.cat(seqs)
    qsl = torch.tensor([0, 11, 17], dtype=torch.int32)
    no_init = torch.tensor([False, False])
    y_full = run_conv(mamba2_ops, x, weight, bias, one_shot_state, pages, no_init, qsl, 11)

    state = torch.full((4, channels, k - 1), float("nan"))
    outs = [[], []]
    for step in range(len(cuts[0]) - 1):
        parts = [seqs[s][cuts[s][step] : cuts[s][step + 1]] for s in range(2)]
        lens = [p.shape[0] for p in parts]
        qsl = torch.tensor([0, lens[0], lens[0] + lens[1]], dtype=torch.int32)
        has = torch.tensor([step > 0, step > 0])
        y = run_conv(mamba2_ops, torch.cat(parts), weight, bias, state, pages, has, qsl, max(lens))
        outs[0].append(y[: lens[0]])
        outs[1].append(y[lens[0] :])
    torch.testing.assert_close(torch.cat(outs[0] + outs[1]), y_full, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(state[pages], one_shot_state[pages], rtol=1e-6, atol=1e-6)


def test_matches_torch_conv_without_state(mamba2_ops):
    """A fresh request equals a zero-padded causal F.conv1d (what transformers runs)."""
    channels, k, n = 8, 4, 9
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, channels, generator=g)
    weight, bias = torch.randn(channels, k, generator=g), torch.randn(channels, generator=g)
    state = torch.zeros(1, channels, k - 1)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    y = run_conv(
        mamba2_ops, x, weight, bias, state, torch.tensor([0]), torch.tensor([False]), qsl, n
    )
    ref = F.conv1d(x.t()[None], weight[:, None], bias, padding=k - 1, groups=channels)
    torch.testing.assert_close(y, F.silu(ref[0, :, :n].t()), rtol=1e-6, atol=1e-6)


def test_native_conv_declines_what_it_would_read_out_of_bounds():
    """The native conv takes only a state of the weight's width and pages and tokens inside
    its tensors (a narrower state once corrupted the heap); the PyTorch path raises."""
    from hybridkv.ops import native
    from hybridkv.ops.native import ssm as native_ssm

    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    x = torch.randn(5, 12)
    weight, state = torch.randn(12, 4), torch.zeros(3, 12, 3)
    pages, has = torch.tensor([0, 2]), torch.tensor([True, False])
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    assert native_ssm.conv1d(x, weight, None, state, pages, has, qsl) is not None
    narrow = torch.zeros(3, 8, 3)  # 8 channels where the weight has 12
    assert native_ssm.conv1d(x, weight, None, narrow, pages, has, qsl) is None
    outside = torch.tensor([0, 3])  # page 3 of 3
    assert native_ssm.conv1d(x, weight, None, state, outside, has, qsl) is None
    past = torch.tensor([0, 3, 6], dtype=torch.int32)  # token 5 of 5
    assert native_ssm.conv1d(x, weight, None, state, pages, has, past) is None
