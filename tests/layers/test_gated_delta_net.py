"""GatedDeltaNet's per-position states for speculative decoding (`NativeGDNOps`, which declares
`keeps_positions`): a verify step with scratch rows keeps, after each of a request's tokens but
its last, the states that decoding those tokens one at a time leaves (conv: exactly its last
inputs; the rule's state: the same recurrence), through the native conv and, for long conv
kernels, the PyTorch conv; float32 and bfloat16; odd head counts and sizes."""

from __future__ import annotations

import pytest
import torch

from hybridkv.forward_batch import StateMetadata
from hybridkv.layers.gated_delta_net import GatedDeltaNet
from hybridkv.ops import native
from hybridkv.ops.conv1d import CONV_MAX_HISTORY
from hybridkv.ops.gdn_ops import NativeGDNOps, TorchGDNOps

HIDDEN = 40


def meta(lens: list[int], pages: list[int], rows: list[int] | None = None) -> StateMetadata:
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return StateMetadata(
        torch.tensor(pages, dtype=torch.int64), torch.ones(len(lens), dtype=torch.bool), qsl,
        max(lens), None if rows is None else torch.tensor(rows, dtype=torch.int64),
    )  # fmt: skip


@pytest.mark.parametrize("conv_kernel", [4, CONV_MAX_HISTORY + 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hk", "hv", "kd", "vd"), [(2, 4, 16, 8), (1, 3, 24, 40)])
@torch.inference_mode()
def test_native_rule_keeps_the_state_after_every_position(hk, hv, kd, vd, dtype, conv_kernel):
    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    assert NativeGDNOps.keeps_positions and TorchGDNOps.keeps_positions
    torch.manual_seed(kd + vd)
    layer = GatedDeltaNet(HIDDEN, hk, hv, kd, vd, conv_kernel, 1e-6, "qwen3_next")
    for p in layer.parameters():
        p.copy_(torch.randn(p.shape) * 0.4)
    layer = layer.to(dtype)
    ops = NativeGDNOps()
    g = torch.Generator().manual_seed(3)
    conv0 = torch.randn(5, layer.conv_dim, conv_kernel - 1, generator=g).to(dtype)
    rec0 = (0.3 * torch.randn(5, hv, kd, vd, generator=g)).to(dtype)
    lens, pages, rows = [4, 1, 6], [3, 0, 1], [1, -1, 0]
    x = torch.randn(sum(lens), HIDDEN, generator=g).to(dtype)
    prep = layer._prep(x)  # the prefixes below run on the same inputs

    def run(first: int, lens: list[int], pages: list[int], rows=None, kept=None, start=None):
        """The layer on tokens first .. first + sum(lens) - 1 from `start` (conv, recurrent
        pages; default the states above), copied."""
        conv, rec = (c.clone() for c in (start or (conv0, rec0)))
        end = first + sum(lens)
        layer._prep = lambda _: tuple(t[first:end] for t in prep)
        out = layer.mix(x[first:end], conv, rec, meta(lens, pages, rows), ops, kept)
        del layer._prep
        return out, conv, rec

    kept = (
        torch.full((2, 5, *conv0.shape[1:]), float("nan"), dtype=dtype),
        torch.full((2, 5, *rec0.shape[1:]), float("nan"), dtype=dtype),
    )
    out, conv, rec = run(0, lens, pages, rows, kept)
    plain_out, plain_conv, _ = run(0, lens, pages)
    assert torch.equal(conv, plain_conv)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(out, plain_out, **tol)
    for req, first, row in ((0, 0, 1), (2, 5, 0)):
        conv_ref, rec_ref = conv0.clone(), rec0.clone()
        refs = []
        for i in range(lens[req]):  # decoding the request's tokens one at a time
            _, conv_ref, rec_ref = run(first + i, [1], [pages[req]], start=(conv_ref, rec_ref))
            refs.append((conv_ref[pages[req]].clone(), rec_ref[pages[req]].clone()))
        for i in range(lens[req] - 1):
            assert torch.equal(kept[0][row, i], refs[i][0]), (req, i)
            torch.testing.assert_close(kept[1][row, i], refs[i][1], **tol)
            # and it is that position's state, not a neighbour's
            gaps = [(kept[1][row, i].float() - r[1].float()).abs().max() for r in refs]
            assert min(range(len(refs)), key=lambda j: gaps[j]) == i
        assert kept[0][row, lens[req] - 1 :].isnan().all()
        assert kept[1][row, lens[req] - 1 :].isnan().all()
        # the page holds the state after the request's last token
        torch.testing.assert_close(rec[pages[req]], refs[-1][1], **tol)

