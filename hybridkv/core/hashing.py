"""Chained hashes of token prefixes, one per full hash block.

    tokens:  | block 0 | block 1 | block 2 | ...        (hash_block_tokens each)
    hash:      h0 = H(root, block 0)
               h1 = H(h0, block 1)
               h2 = H(h1, block 2)

h_i identifies the whole prefix tokens[0 : (i+1) * hash_block_tokens], so a cached unit or a
state snapshot that ends at position L is keyed by h_{L / hash_block_tokens - 1}. `extra_keys`
(an adapter id, a cache salt, ...) enter the root, so every hash of the chain depends on them.
Python's tuple hash is 64-bit and fast; a collision would need two different prefixes with
equal 64-bit chains.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

ROOT = hash(("hybridkv-prefix-root",))


def root_hash(extra_keys: Sequence[Hashable] = ()) -> int:
    return hash((ROOT, tuple(extra_keys))) if extra_keys else ROOT


def extend_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_tokens: int,
    extra_keys: Sequence[Hashable] = (),
) -> list[int]:
    """Append the hashes of every newly full block of `token_ids` to `hashes` (in place)."""
    parent = hashes[-1] if hashes else root_hash(extra_keys)
    start = len(hashes) * block_tokens
    while start + block_tokens <= len(token_ids):
        parent = hash((parent, tuple(token_ids[start : start + block_tokens])))
        hashes.append(parent)
        start += block_tokens
    return hashes
