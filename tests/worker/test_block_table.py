import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.worker.block_table import PAD_SLOT, BlockTable


def page_space_slots(pages, positions, page_tokens):
    """The reference: slots computed in page space (vLLM before the decoupling)."""
    return [pages[p // page_tokens] * page_tokens + p % page_tokens for p in positions]


@pytest.mark.parametrize("ratio", [1, 2, 3, 17, 33])
@pytest.mark.parametrize("kernel_block_size", [1, 4, 16])
def test_kernel_block_slots_equal_page_space_slots(ratio, kernel_block_size):
    page_tokens = ratio * kernel_block_size
    rows_pages = {0: [5, 2, 9], 1: [7], 2: [1, 3]}
    bt = BlockTable(4, 3 * ratio, kernel_block_size, ratio)
    for row, pages in rows_pages.items():
        bt.append_pages(row, pages)
    rows, positions, expected = [], [], []
    for row, pages in rows_pages.items():
        pos = list(range(0, len(pages) * page_tokens, max(1, page_tokens // 5)))
        rows += [row] * len(pos)
        positions += pos
        expected += page_space_slots(pages, pos, page_tokens)
    slots = bt.slot_mapping(torch.tensor(rows), torch.tensor(positions))
    assert slots.tolist() == expected


def test_padding_and_out_of_range_slots():
    bt = BlockTable(2, 4, 4, 2)
    bt.append_pages(0, [3])  # kernel blocks 6, 7 -> positions 0..7
    slots = bt.slot_mapping(torch.tensor([0, -1, 0, 1]), torch.tensor([7, 0, 8, 0]))
    assert slots.tolist() == [7 * 4 + 3, PAD_SLOT, PAD_SLOT, PAD_SLOT]


def test_append_blocks_directly_and_row_ops():
    bt = BlockTable(3, 6, 2, 3)
    bt.append_blocks(0, [11, 4])
    bt.append_pages(0, [2])
    assert bt.row(0) == [11, 4, 6, 7, 8]
    bt.append_blocks(1, [1])
    bt.swap_rows(0, 1)
    assert bt.row(0) == [1] and bt.row(1) == [11, 4, 6, 7, 8]
    bt.move_row(1, 2)
    assert bt.row(2) == [11, 4, 6, 7, 8] and bt.row(1) == []
    bt.clear_row(2)
    assert bt.row(2) == []
    with pytest.raises(ValueError, match="room for 6"):
        bt.append_blocks(0, list(range(6)))
    assert bt.table.dtype == torch.int32 and tuple(bt.table.shape) == (3, 6)


@settings(max_examples=60, deadline=None)
@given(
    kbs=st.integers(1, 8),
    ratio=st.sampled_from([1, 2, 3, 17, 33]),
    data=st.data(),
)
def test_slot_mapping_matches_naive_reference(kbs, ratio, data):
    n_rows = data.draw(st.integers(1, 4))
    bt = BlockTable(n_rows, 40, kbs, ratio)
    tables = []
    for row in range(n_rows):
        ids = data.draw(st.lists(st.integers(0, 500), min_size=0, max_size=40))
        bt.append_blocks(row, ids)
        tables.append(ids)
    tokens = data.draw(
        st.lists(st.tuples(st.integers(-1, n_rows - 1), st.integers(-1, 45 * kbs)), max_size=50)
    )
    rows = torch.tensor([t[0] for t in tokens], dtype=torch.int64)
    pos = torch.tensor([t[1] for t in tokens], dtype=torch.int64)
    got = bt.slot_mapping(rows, pos).tolist()
    for (r, p), slot in zip(tokens, got, strict=True):
        if r < 0 or p < 0 or p // kbs >= len(tables[r]):
            assert slot == PAD_SLOT
        else:
            assert slot == tables[r][p // kbs] * kbs + p % kbs
