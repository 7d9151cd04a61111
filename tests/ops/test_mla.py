"""The PyTorch MLA ops (hybridkv.ops.mla) against a float64 reference that expands every latent
to K and V: decode in latent space (W_UK absorbed, W_UV after) and prefill by expansion, over
page-mode block tables of shuffled pages with NaN everywhere nothing was written."""

from __future__ import annotations

import pytest
import torch

from hybridkv.ops import mla, registry

from .mla_cases import absorbed, expanded_reference, make_case


@pytest.fixture(autouse=True)
def pytorch_only(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")  # native tests below set it back
    registry.reset_all()  # op choices follow the new setting


@pytest.mark.parametrize("kbs", [1, 4, 16, 64])
def test_mixed_batch_matches_the_expanded_reference(kbs):
    # two decodes, a prefill chunk after cached context, a whole prompt, another decode
    case = make_case([1, 1, 5, 9, 1], [1, 70, 12, 9, 33], kbs, seed=kbs)
    out = mla.mla_paged_attention(
        case.q_nope, case.q_rope, case.cache, case.table, case.query_start_loc, case.seq_lens,
        case.scale, case.w_kv_b, case.nope,
    )  # fmt: skip
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), expanded_reference(case), rtol=1e-5, atol=1e-5)


def test_decode_returns_the_attention_weighted_latent():
    case = make_case([1, 1, 1], [5, 40, 17], 16, ratio=3, seed=3)
    q = absorbed(case, [0, 1, 2])
    got = mla.mla_decode(q, case.cache, case.table, case.seq_lens, case.scale, case.rank)
    for s, lat in enumerate(case.latents):
        probs = torch.softmax((q[s].double() @ lat.double().T) * case.scale, -1)  # [heads, n]
        want = probs @ lat.double()[:, : case.rank]
        torch.testing.assert_close(got[s].double(), want, rtol=1e-5, atol=1e-6)


def test_write_by_slot_skips_padding():
    cache = torch.zeros(4, 8, 5)
    rows = torch.arange(15.0).view(3, 5)
    mla.write_mla_cache(rows, cache, torch.tensor([9, -1, 31]))
    assert torch.equal(cache[1, 1], rows[0]) and torch.equal(cache[3, 7], rows[2])
    assert cache.count_nonzero() == 2 * 5 - 1  # rows[0] starts with a zero


def test_invisible_positions_read_the_null_block():
    cache = torch.full((3, 4, 2), float("nan"))
    cache[0] = 0
    cache[2] = 1
    table = torch.tensor([[2, 1]], dtype=torch.int32)
    visible = torch.tensor([[True] * 3 + [False] * 5])
    rows = mla.gather_latent(cache, table, visible)[0]
    assert torch.equal(rows[:3], torch.ones(3, 2)) and torch.equal(rows[3:], torch.zeros(5, 2))


def test_bfloat16_cache_is_close():
    case = make_case([1, 4, 1], [30, 11, 64], 16, dtype=torch.bfloat16, seed=5)
    out = mla.mla_paged_attention(
        case.q_nope, case.q_rope, case.cache, case.table, case.query_start_loc, case.seq_lens,
        case.scale, case.w_kv_b, case.nope,
    )  # fmt: skip
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expanded_reference(case), rtol=0.05, atol=0.05)


def _native_on(monkeypatch):
    from hybridkv.ops.native import mla as native_mla

    monkeypatch.setenv("HYBRIDKV_NATIVE", "1")
    registry.reset_all()  # op choices follow the new setting
    if not native_mla.available():
        pytest.skip("native kernels unavailable (no compiler)")
    return native_mla


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", [(3, 20, 6, 10, 7), (5, 33, 0, 9, 13), (1, 17, 2, 3, 1)])
def test_native_absorbed_decode_rows_match_pytorch(shape, dtype, tol, monkeypatch):
    """hkv_mla_decode_absorbed (absorb, attend, expand in one call) against the PyTorch decode
    rows (absorb_query, mla_decode, W_UV), odd sizes and no rope part too, q_nope / q_rope as
    strided views of one projection as the layer passes them."""
    native_mla = _native_on(monkeypatch)
    heads, rank, rope, nope, v_dim = shape
    case = make_case([1] * 4, [1, 70, 129, 33], 16, ratio=3, heads=heads, rank=rank, rope=rope,
                     nope=nope, v_dim=v_dim, dtype=dtype, seed=rank)  # fmt: skip
    q = torch.cat([case.q_nope, case.q_rope], dim=-1)  # [S, heads, nope + rope]
    q_nope, q_rope = q[..., :nope], q[..., nope:]
    args = (case.cache, case.table, case.seq_lens, case.scale, case.w_kv_b, nope)
    want = mla.torch_mla_decode_rows(q_nope, q_rope, *args)
    got = native_mla.decode_absorbed(q_nope, q_rope, *args)
    assert got is not None and got.dtype == dtype and got.shape == want.shape
    assert not got.isnan().any()
    # the kernel keeps float32 between its phases (PyTorch rounds each in bfloat16)
    ref = expanded_reference(case).to(dtype) if dtype == torch.bfloat16 else want
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)


def test_native_decode_only_batches_take_the_absorbed_kernel(monkeypatch):
    """mla_paged_attention of a decode-only batch (max_query_len 1) goes through
    MLA_DECODE_ROWS' native link and computes what the mixed-batch path computes."""
    _native_on(monkeypatch)
    assert mla.MLA_DECODE_ROWS.chain("cpu", "float32").links[0].impl.name == "native"
    case = make_case([1, 1, 1], [9, 40, 3], 4, seed=11)
    args = (case.q_nope, case.q_rope, case.cache, case.table, case.query_start_loc,
            case.seq_lens, case.scale, case.w_kv_b, case.nope)  # fmt: skip
    fast = mla.mla_paged_attention(*args, max_query_len=1)
    mixed = mla.mla_paged_attention(*args)
    assert torch.equal(fast, mixed)
    torch.testing.assert_close(fast.double(), expanded_reference(case), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_write_rows_equals_the_cat_and_scatter(dtype, monkeypatch):
    native_mla = _native_on(monkeypatch)
    g = torch.Generator().manual_seed(2)
    ckv = torch.randn(5, 27, generator=g).to(dtype)  # [T, rank 21 + rope 6], strided views
    c, k_rope = ckv[:, :21], ckv[:, 21:]
    slots = torch.tensor([9, -1, 31, 0, 17])
    want, got = torch.zeros(4, 8, 27, dtype=dtype), torch.zeros(4, 8, 27, dtype=dtype)
    mla.torch_write_mla(c, k_rope, want, slots)
    assert native_mla.write_rows(c, k_rope, got, slots)
    assert torch.equal(got, want)
    assert not native_mla.write_rows(c, k_rope, got.double(), slots)  # dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim"), [(1, 6), (3, 8), (5, 2)])
def test_native_rope_pairs_equal_pytorch(heads, dim, dtype, monkeypatch):
    """DeepSeek's interleaved RoPE: the kernel rounds as PyTorch's bfloat16 ops (bit-equal)."""
    from hybridkv.layers import rotary

    native_mla = _native_on(monkeypatch)
    g = torch.Generator().manual_seed(dim)
    q = torch.randn(7, heads, 3 + dim, generator=g).to(dtype)[..., 3:]  # a strided view
    angles = torch.randn(7, dim // 2, generator=g)
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    got = native_mla.rope_pairs(q, cos, sin)
    assert got is not None and got.is_contiguous()
    assert torch.equal(got, rotary.torch_rope_pairs(q, cos, sin))
    assert native_mla.rope_pairs(q, cos.float() if dtype == torch.bfloat16 else cos.bfloat16(),
                                 sin) is None  # fmt: skip
