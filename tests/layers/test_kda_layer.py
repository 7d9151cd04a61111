"""KimiDeltaAttention (the KDA layer) against transformers' `KimiLinearDeltaAttention` with the
same weights: packed ragged requests prefilled in two chunks (cut at unaligned positions) and
then decoded through the paged conv and recurrent states, on every ops class that runs here;
and the spec it declares."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.forward_batch import StateMetadata  # noqa: E402
from hybridkv.kv.specs import CacheDtypes, kda_state  # noqa: E402
from hybridkv.layers.kda import CONVS, KimiDeltaAttention  # noqa: E402
from hybridkv.ops import native  # noqa: E402
from hybridkv.ops.kda_ops import NativeKdaOps, TorchKdaOps, TritonKdaOps  # noqa: E402
from tests.layers.replay import recording_linears, replaying, with_scratch_rows  # noqa: E402

HIDDEN, HEADS, DIM = 24, 2, 8
FP32 = CacheDtypes("float32", "float32", "float32")


def checkpoint_names(hf_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> the checkpoint's (three convs, no forget_gate.)."""
    out = {}
    for name, t in hf_state.items():
        if name == "conv1d.weight":
            for prefix, part in zip("qkv", t.chunk(3, dim=0), strict=True):
                out[f"{prefix}_conv1d.weight"] = part
        else:
            out[name.removeprefix("forget_gate.")] = t
    return out


def pair(kernel: int = 4, seed: int = 0):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg = KimiLinearConfig(hidden_size=HIDDEN, linear_num_heads=HEADS, linear_head_dim=DIM,
                           linear_conv_kernel_dim=kernel, num_hidden_layers=1,
                           layer_types=["linear_attention"], pad_token_id=0)  # fmt: skip
    torch.manual_seed(seed)
    theirs = KimiLinearDeltaAttention(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in theirs.parameters():
            p.normal_(0, 0.3)
        theirs.forget_gate.A_log.uniform_(-1, 1)
    ours = KimiDeltaAttention(HIDDEN, HEADS, DIM, kernel, cfg.rms_norm_eps)
    ours.load_state_dict(checkpoint_names(theirs.state_dict()), strict=True)
    return ours, theirs


def meta(pages, has_state, lengths) -> StateMetadata:
    starts = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    return StateMetadata(torch.tensor(pages), torch.tensor(has_state), starts, max(lengths))


OPS = [TorchKdaOps(), TritonKdaOps()]
if native.library() is not None:
    OPS.append(NativeKdaOps())


@pytest.mark.parametrize("ops", OPS, ids=lambda o: type(o).__name__)
@pytest.mark.parametrize("kernel", [4, 3])
@torch.inference_mode()
def test_chunked_prefill_and_decode_match_transformers(ops, kernel):
    ours, theirs = pair(kernel)
    lengths = [7, 1, 40]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randn(n + 3, HIDDEN, generator=g) for n in lengths]  # + 3 decode tokens
    want = [theirs(s[None])[0] for s in seqs]  # no cache: the whole sequence at once
    convs = tuple(torch.full((5, HEADS * DIM, kernel - 1), float("nan")) for _ in CONVS)
    rec = torch.full((5, HEADS, DIM, DIM), float("nan"))
    pages = [3, 0, 4]
    got: list[list[torch.Tensor]] = [[] for _ in seqs]
    cuts = [(0, n // 2) for n in lengths], [(n // 2, n) for n in lengths]
    for step, chunk in enumerate(cuts):
        parts = [s[a:b] for s, (a, b) in zip(seqs, chunk, strict=True)]
        has = [step > 0 and a > 0 for a, _ in chunk]
        m = meta(pages, has, [p.shape[0] for p in parts])
        out = ours.mix(torch.cat(parts), convs, rec, m, ops)
        for i, piece in enumerate(out.split([p.shape[0] for p in parts])):
            got[i].append(piece)
    for t in range(3):
        x = torch.stack([s[n + t] for s, n in zip(seqs, lengths, strict=True)])
        out = ours.mix(x, convs, rec, meta(pages, [True] * 3, [1, 1, 1]), ops)
        for i in range(3):
            got[i].append(out[i : i + 1])
    for i, pieces in enumerate(got):
        torch.testing.assert_close(torch.cat(pieces), want[i], rtol=1e-4, atol=1e-5)
    assert torch.isnan(rec[1]).all() and torch.isnan(convs[0][2]).all()  # others untouched


def test_the_spec_is_the_plan_only_kda_state():
    spec = KimiDeltaAttention(HIDDEN, HEADS, DIM, 4).cache_spec(FP32)
    plan_only = kda_state(HEADS, DIM, 4, "float32", "float32")
    assert (spec.kind, spec.tensors) == (plan_only.kind, plan_only.tensors)
    assert [o.name for o in spec.ops] == ["native", "triton", "fla", "torch"]


def test_conv_kernel_below_two_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"short_conv_kernel_size must be at least 2, got 1"):
        KimiDeltaAttention(HIDDEN, HEADS, DIM, 1)


@pytest.mark.parametrize("kernel", [4, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_native_kda_keeps_the_state_after_every_position(kernel, dtype):
    """Speculative decoding's per-position states (`NativeKdaOps.keeps_positions`): with
    scratch rows, the three convs and the rule keep, after each of a request's tokens but its
    last, the states that running its tokens up to there leaves in its pages (the projections
    replayed from the full step, so only the state ops differ); rows -1 write nothing."""
    if native.library() is None:
        pytest.skip("native kernels unavailable here (no C compiler)")
    assert NativeKdaOps.keeps_positions and TorchKdaOps.keeps_positions
    ours, _ = pair(kernel, seed=5)
    ours = ours.to(dtype)
    ops, g = NativeKdaOps(), torch.Generator().manual_seed(6)
    width = HEADS * DIM
    convs0 = [torch.randn(4, width, kernel - 1, generator=g).to(dtype) for _ in CONVS]
    rec0 = (0.3 * torch.randn(4, HEADS, DIM, DIM, generator=g)).to(dtype)
    lens, pages, rows = [5, 1, 3], [2, 0, 3], [0, -1, 1]
    x = torch.randn(sum(lens), HIDDEN, generator=g).to(dtype)

    def run(first, lens, pages, rows=None, kept=None):
        convs, rec = tuple(c.clone() for c in convs0), rec0.clone()
        step = meta(pages, [True] * len(lens), lens)
        if rows is not None:
            step = with_scratch_rows(step, rows)
        out = ours.mix(x[first : first + sum(lens)], convs, rec, step, ops, kept)
        return out, convs, rec

    (plain_out, plain_convs, _), full = recording_linears(ours, lambda: run(0, lens, pages))
    kept = tuple(torch.full((2, 4, *t.shape[1:]), float("nan"), dtype=dtype)
                 for t in (*convs0, rec0))  # fmt: skip
    out, convs, _ = run(0, lens, pages, rows, kept)
    assert torch.equal(out, plain_out)  # (token by token either way)
    assert all(torch.equal(a, b) for a, b in zip(convs, plain_convs, strict=True))
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for req, first, row in ((0, 0, 0), (2, 6, 1)):
        refs = []
        for i in range(lens[req] - 1):
            with replaying(full, first, first + i + 1):  # the prefix's projections: the step's
                _, ref_convs, ref_rec = run(first, [i + 1], [pages[req]])
            for t, ref in zip(kept[:3], ref_convs, strict=True):  # the inputs, exactly
                assert torch.equal(t[row, i], ref[pages[req]]), (req, i)
            # (the gates are PyTorch element-wise ops, whose rounding may depend on the size)
            torch.testing.assert_close(kept[3][row, i], ref_rec[pages[req]], **tol)
            refs.append(ref_rec[pages[req]].float())
        for i, ref in enumerate(refs):  # each kept state is its own position's
            gaps = [(kept[3][row, j].float() - ref).abs().max() for j in range(len(refs))]
            assert min(range(len(refs)), key=lambda j: gaps[j]) == i
        assert all(t[row, lens[req] - 1 :].isnan().all() for t in kept)


def _glue_layer(heads: int, dim: int, dtype: torch.dtype, seed: int) -> KimiDeltaAttention:
    layer = KimiDeltaAttention(16, heads, dim, layer_index=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.A_log.copy_(torch.randn(layer.A_log.shape, generator=g))
        layer.dt_bias.copy_(torch.randn(layer.dt_bias.shape, generator=g))
        layer.o_norm.weight.copy_(1 + 0.3 * torch.randn(dim, generator=g))
    return layer.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "heads", "dim"), [(1, 2, 8), (5, 3, 7), (9, 1, 33)])
def test_native_gates_and_out_norm_match_pytorch(tokens, heads, dim, dtype):
    """KDA_GATES and KDA_OUT_NORM's native links against their PyTorch forms: f large enough
    to take softplus's linear branch, rows as strided views; beta is the sigmoid rounded to the
    model dtype (transformers'), the norm rounds the rule's float32 output first."""
    from hybridkv.layers import kda

    if native.library() is None:
        pytest.skip("native kernels unavailable (no compiler)")
    layer = _glue_layer(heads, dim, dtype, seed=dim)
    g = torch.Generator().manual_seed(tokens)
    fb = (torch.randn(tokens, heads * dim + heads + 3, generator=g) * 8).to(dtype)
    f, b = fb[:, : heads * dim], fb[:, heads * dim : heads * dim + heads]  # strided rows
    got = kda._native_kda_gates(layer, f, b)
    want = kda.torch_kda_gates(layer, f, b)
    assert got is not None
    torch.testing.assert_close(got[0], want[0], rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-7)
    o = torch.randn(tokens * heads, dim, generator=g)  # [T * H, D] float32
    gate = torch.randn(tokens * heads, dim + 2, generator=g).to(dtype)[:, 1 : dim + 1]
    got = kda._native_kda_out_norm(layer, o, gate)
    want = kda.torch_kda_out_norm(layer, o, gate)
    assert got is not None and got.dtype == dtype
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-6
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_kda_glue_is_native_on_the_cpu():
    from hybridkv.layers import kda

    if native.library() is None:
        pytest.skip("native kernels unavailable (no compiler)")
    for family in (kda.KDA_GATES, kda.KDA_OUT_NORM):
        for dtype in ("float32", "bfloat16"):
            assert family.chain("cpu", dtype).links[0].impl.name == "native"
