"""The Triton MLA decode kernel against the PyTorch reference (hybridkv.ops.mla), through
Triton's interpreter without a GPU (TRITON_INTERPRET=1, set before the kernels are imported),
compiled on one with a GPU: kernel blocks of 64 (FlashMLA's size), 128, 32, 16 and one that is
not a multiple of the tile (48), pages of several kernel blocks, NaN in every unwritten slot."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hybridkv.layers.attention.registry import get_backend  # noqa: E402
from hybridkv.ops import mla as ref  # noqa: E402
from hybridkv.ops import registry
from hybridkv.ops import triton_mla as tri  # noqa: E402

from .mla_cases import absorbed, expanded_reference, make_case  # noqa: E402

DEV = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

pytestmark = pytest.mark.triton


@pytest.fixture(autouse=True)
def pytorch_reference(monkeypatch):
    monkeypatch.setenv("HYBRIDKV_NATIVE", "0")
    registry.reset_all()  # op choices follow the new setting


@pytest.mark.parametrize(("kbs", "ratio"), [(64, 1), (64, 3), (128, 1), (32, 2), (16, 2), (48, 2)])
def test_decode_matches_the_reference(kbs, ratio):
    case = make_case([1] * 4, [1, 70, 129, 33], kbs, ratio=ratio, heads=3, seed=kbs + ratio)
    q = absorbed(case, [0, 1, 2, 3])
    want = ref.mla_decode(q, case.cache, case.table, case.seq_lens, case.scale, case.rank)
    got = tri.mla_decode(
        q.to(DEV), case.cache.to(DEV), case.table.to(DEV), case.seq_lens.to(DEV), case.scale,
        case.rank,
    )  # fmt: skip
    assert not got.isnan().any()
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_more_heads_than_one_block_and_no_rope():
    """17 heads (two head blocks, the second mostly masked) and rope dim 0 (Kimi-Linear's NoPE
    layers keep no rotary key)."""
    case = make_case([1, 1], [40, 7], 64, heads=17, rank=32, rope=0, seed=9)
    q = absorbed(case, [0, 1])
    want = ref.mla_decode(q, case.cache, case.table, case.seq_lens, case.scale, case.rank)
    got = tri.mla_decode(
        q.to(DEV), case.cache.to(DEV), case.table.to(DEV), case.seq_lens.to(DEV), case.scale,
        case.rank,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


def test_mixed_batch_through_the_triton_ops():
    case = make_case([1, 6, 1], [65, 6, 20], 64, seed=4)
    got = tri.mla_paged_attention(
        case.q_nope.to(DEV), case.q_rope.to(DEV), case.cache.to(DEV), case.table.to(DEV),
        case.query_start_loc.to(DEV), case.seq_lens.to(DEV), case.scale, case.w_kv_b.to(DEV),
        case.nope,
    )  # fmt: skip
    torch.testing.assert_close(got.cpu().double(), expanded_reference(case), rtol=1e-5, atol=1e-5)


def test_declared_mla_backends_run_on_triton():
    for name, size in (("flashmla", 64), ("cutlass_mla", 128), ("flashinfer_mla", 32)):
        info = get_backend(name)
        assert info.runner == "triton" and info.block_sizes.accepts(size)
        assert info.load().name == "triton"
    assert get_backend("torch").runner == "torch"
    assert get_backend("flashinfer").runner is None
    with pytest.raises(ValueError, match="declared for planning only"):
        get_backend("flashinfer").load()
