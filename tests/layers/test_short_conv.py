"""ShortConv (LFM2's gated short convolution) against transformers' `Lfm2ShortConv` with the
same weights: packed ragged requests, prefilled in chunks and then decoded one token at a time
through the paged conv state, on the PyTorch and the native conv ops; and the spec it declares."""

from __future__ import annotations

import pytest
import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.kv.specs import CacheDtypes, short_conv_state
from hybridkv.layers.short_conv import ShortConv
from hybridkv.ops import native
from hybridkv.ops.mamba2_ops import NativeMamba2Ops, TorchMamba2Ops
from hybridkv.ops.native import ssm as native_ssm

HIDDEN = 24
FP32 = CacheDtypes("float32", "float32", "float32")


def pair(l_cache: int, bias: bool, seed: int = 0):
    from transformers import Lfm2Config
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    cfg = Lfm2Config(hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4,
                     conv_L_cache=l_cache, conv_bias=bias, layer_types=["conv"])  # fmt: skip
    torch.manual_seed(seed)
    theirs = Lfm2ShortConv(cfg, layer_idx=0).eval()
    ours = ShortConv(HIDDEN, l_cache, bias, layer_index=0)
    missing, unexpected = ours.load_state_dict(theirs.state_dict(), strict=True)
    assert not missing and not unexpected
    return ours, theirs


def meta(pages: list[int], has_state: list[bool], lengths: list[int]) -> StateMetadata:
    starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return StateMetadata(
        torch.tensor(pages), torch.tensor(has_state), starts, max(lengths)
    )  # fmt: skip


OPS = [TorchMamba2Ops()]
if native.library() is not None:
    OPS.append(NativeMamba2Ops())


@pytest.mark.parametrize("ops", OPS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("l_cache, bias", [(3, False), (4, True), (2, False)])
@torch.inference_mode()
def test_chunked_prefill_and_decode_match_transformers(ops, l_cache, bias):
    ours, theirs = pair(l_cache, bias)
    lengths = [7, 1, 12]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n + 4, HIDDEN, generator=g) for n in lengths]  # + 4 decode tokens
    want = [theirs(s[None])[0] for s in seqs]  # [n + 4, hidden] each, no cache
    # pages hold NaN where a request starts from nothing: it must be ignored
    state = torch.full((5, HIDDEN, l_cache - 1), float("nan"))
    pages = [3, 0, 4]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    # prefill in two chunks (the second continues from the state the first left)
    cuts = [(0, n // 2) for n in lengths], [(n // 2, n) for n in lengths]
    for step, chunk in enumerate(cuts):
        parts = [s[a:b] for s, (a, b) in zip(seqs, chunk, strict=True)]
        has = [step > 0 and a > 0 for a, _ in chunk]
        x = torch.cat(parts)
        out = ours.mix(x, state, meta(pages, has, [p.shape[0] for p in parts]), ops)
        for i, piece in enumerate(out.split([p.shape[0] for p in parts])):
            got[i].append(piece)
    for t in range(4):  # decode: one token per request
        x = torch.stack([s[n + t] for s, n in zip(seqs, lengths, strict=True)])
        out = ours.mix(x, state, meta(pages, [True] * 3, [1, 1, 1]), ops)
        for i in range(3):
            got[i].append(out[i : i + 1])
    for i, pieces in enumerate(got):
        torch.testing.assert_close(torch.cat(pieces), want[i], rtol=1e-5, atol=1e-5)
    assert torch.isnan(state[1]).all() and torch.isnan(state[2]).all()  # other pages untouched


def test_zero_length_chunks_of_a_request_are_fine():
    ours, _ = pair(3, False)
    state = torch.zeros(2, HIDDEN, 2)
    out = ours.mix(torch.zeros(0, HIDDEN), state, meta([1], [True], [0]), TorchMamba2Ops())
    assert out.shape == (0, HIDDEN)


def test_the_spec_is_the_plan_only_short_conv_state():
    spec = ShortConv(HIDDEN, 3).cache_spec(FP32)
    plan_only = short_conv_state(HIDDEN, 3, "float32")
    assert (spec.kind, spec.tensors) == (plan_only.kind, plan_only.tensors)
    assert spec.tensors[0].name == "conv" and spec.tensors[0].shape == (HIDDEN, 2)
    assert [o.name for o in spec.ops] == ["native", "triton", "torch"]
    long = ShortConv(HIDDEN, native_ssm.CONV_MAX_HISTORY + 2).cache_spec(FP32)
    assert "native" not in [o.name for o in long.ops]  # the C conv keeps at most 8 columns


def test_l_cache_below_two_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"conv_L_cache must be at least 2 \(one .*\), got 1"):
        ShortConv(HIDDEN, 1)


@pytest.mark.parametrize("l_cache", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_native_conv_keeps_the_state_after_every_position(l_cache, dtype):
    """Speculative decoding's per-position states: with scratch rows, the native conv also
    writes the state a chunk ending at each of a request's tokens but its last leaves (its last
    L - 1 inputs, old columns shifted in for the first ones), without changing the outputs or
    the pages; rows -1 write nothing."""
    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    ours, _ = pair(l_cache, bias=True)
    ours = ours.to(dtype)
    ops = NativeMamba2Ops()
    g = torch.Generator().manual_seed(7)
    state0 = torch.randn(4, HIDDEN, l_cache - 1, generator=g).to(dtype)
    lengths, pages, rows = [5, 2, 3], [1, 3, 0], [0, -1, 1]
    x = torch.randn(sum(lengths), HIDDEN, generator=g).to(dtype)
    kept = torch.full((2, 4, HIDDEN, l_cache - 1), float("nan"), dtype=dtype)
    step = meta(pages, [True] * 3, lengths)
    with_rows = StateMetadata(**{**step.__dict__, "scratch_rows": torch.tensor(rows)})
    state = state0.clone()
    out = ours.mix(x, state, with_rows, ops, kept)
    plain_state = state0.clone()
    assert torch.equal(out, ours.mix(x, plain_state, step, ops))
    assert torch.equal(state, plain_state)
    b, _, xs = ours.in_proj(x).chunk(3, dim=-1)
    inputs = (b * xs).to(dtype)  # what the conv reads (B * x)
    for req, first, row in ((0, 0, 0), (2, 7, 1)):
        history = state0[pages[req]].t()  # [L - 1, C], oldest first
        seen = torch.cat([history, inputs[first : first + lengths[req]]])
        for i in range(lengths[req] - 1):
            want = seen[i + 1 : i + l_cache].t()  # the last L - 1 inputs after token i
            assert torch.equal(kept[row, i], want), (req, i)
        assert kept[row, lengths[req] - 1 :].isnan().all()
