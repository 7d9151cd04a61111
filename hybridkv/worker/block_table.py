"""Per-group block tables in kernel-block ids, and vectorised slot mapping.

One int32 tensor per group, `[max_num_seqs, max_kernel_blocks_per_seq]`; row i holds the kernel
block ids of the request in batch row i. There is no parallel page table: in page mode a page p is
appended as its kernel blocks p*r .. p*r+r-1 (r = blocks_per_page).

Slot mapping, for a token of row `row` at position `pos` (kbs = kernel_block_size):

    block index  b = pos // kbs          offset o = pos % kbs
    kernel block k = table[row, b]        slot    = k * kbs + o

When a row owns whole pages this equals page-space `page * page_tokens + pos % page_tokens`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from hybridkv.kv.plan import pages_to_kernel_blocks

PAD_SLOT = -1


class BlockTable:
    def __init__(
        self,
        max_num_seqs: int,
        max_kernel_blocks_per_seq: int,
        kernel_block_size: int,
        blocks_per_page: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        if min(max_num_seqs, max_kernel_blocks_per_seq, kernel_block_size, blocks_per_page) <= 0:
            raise ValueError("block table sizes must be positive")
        self.kernel_block_size = kernel_block_size
        self.blocks_per_page = blocks_per_page
        self.max_kernel_blocks_per_seq = max_kernel_blocks_per_seq
        self.device = torch.device(device)
        # table: [max_num_seqs, max_kernel_blocks_per_seq] kernel-block ids
        self.table = torch.zeros(
            (max_num_seqs, max_kernel_blocks_per_seq), dtype=torch.int32, device=self.device
        )
        self.num_blocks = np.zeros(max_num_seqs, dtype=np.int64)  # filled entries per row

    @property
    def max_num_seqs(self) -> int:
        return self.table.shape[0]

    # -- row edits -----------------------------------------------------------------------------

    def append_blocks(self, row: int, kernel_block_ids: Sequence[int]) -> None:
        n = len(kernel_block_ids)
        if n == 0:
            return
        start = int(self.num_blocks[row])
        if start + n > self.max_kernel_blocks_per_seq:
            raise ValueError(
                f"row {row} would hold {start + n} kernel blocks; the table has room "
                f"for {self.max_kernel_blocks_per_seq}"
            )
        ids = torch.as_tensor(list(kernel_block_ids), dtype=torch.int32)
        self.table[row, start : start + n] = ids.to(self.device)
        self.num_blocks[row] = start + n

    def append_pages(self, row: int, page_ids: Sequence[int]) -> None:
        self.append_blocks(row, pages_to_kernel_blocks(page_ids, self.blocks_per_page))

    def clear_row(self, row: int) -> None:
        self.num_blocks[row] = 0

    def move_row(self, src: int, dst: int) -> None:
        n = int(self.num_blocks[src])
        self.table[dst, :n] = self.table[src, :n]
        self.num_blocks[dst] = n
        self.num_blocks[src] = 0

    def swap_rows(self, a: int, b: int) -> None:
        self.table[[a, b]] = self.table[[b, a]]
        self.num_blocks[[a, b]] = self.num_blocks[[b, a]]

    def row(self, row: int) -> list[int]:
        return self.table[row, : int(self.num_blocks[row])].tolist()

    # -- slot mapping --------------------------------------------------------------------------

    def host_table(self) -> np.ndarray | None:
        """The table as a NumPy array sharing its memory (a CPU table), else None."""
        return self.table.numpy() if self.device.type == "cpu" else None

    def slot_mapping_host(self, rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """`slot_mapping` of a CPU table in NumPy (tiny arrays cost microseconds there, tens
        of microseconds as tensor ops). rows, positions: [num_tokens] int64."""
        kbs, table = self.kernel_block_size, self.table.numpy()
        safe_rows = np.maximum(rows, 0)
        block_idx = np.maximum(positions, 0) // kbs
        valid = (rows >= 0) & (positions >= 0) & (block_idx < self.num_blocks[safe_rows])
        kb = table[safe_rows, np.where(valid, block_idx, 0)].astype(np.int64)
        return np.where(valid, kb * kbs + positions % kbs, PAD_SLOT)

    def slot_mapping(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Slots for tokens given as (row, position) pairs; row -1 marks padding (slot -1).

        rows, positions: [num_tokens] int64  ->  slots: [num_tokens] int64
        A position past the row's filled blocks also maps to -1 (nothing may be written there).
        """
        kbs = self.kernel_block_size
        rows = rows.to(self.device, torch.int64)
        positions = positions.to(self.device, torch.int64)
        safe_rows = rows.clamp(min=0)
        block_idx = positions.clamp(min=0) // kbs
        filled = torch.from_numpy(self.num_blocks).to(self.device)[safe_rows]
        valid = (rows >= 0) & (positions >= 0) & (block_idx < filled)
        block_idx = torch.where(valid, block_idx, torch.zeros_like(block_idx))
        # kernel block id of each token: [num_tokens]
        kb = self.table[safe_rows, block_idx].to(torch.int64)
        slots = kb * kbs + positions % kbs
        return torch.where(valid, slots, torch.full_like(slots, PAD_SLOT))
