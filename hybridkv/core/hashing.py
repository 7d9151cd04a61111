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

Keys are the same in every process (a router in another process computes the keys a replica
caches under, `hybridkv.serving.router`): the root is a constant integer, CPython hashes ints
and tuples of ints without PYTHONHASHSEED's randomization, and `extra_keys` (often strings,
whose `hash()` is randomized per process) are folded into the root once per request by a
stable digest (blake2b of their repr), never per block. So extra keys must have a repr that is
the same in every process (str, int, bytes, tuples of them; not objects with an id in it).
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

# A constant (hash(str) is randomized per process): blake2b-64("hybridkv-prefix-root") >> 1.
ROOT = 0x2C60_A4F1_0C4C_3E38


def root_hash(extra_keys: Sequence[Hashable] = ()) -> int:
    """The parent of block 0: ROOT, or a stable digest of ROOT and the extra keys."""
    if not extra_keys:
        return ROOT
    data = repr((ROOT, tuple(extra_keys))).encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)


def extend_hashes(
    hashes: list[int],
    token_ids: Sequence[int],
    block_tokens: int,
    extra_keys: Sequence[Hashable] = (),
) -> list[int]:
    """Append the hashes of every newly full block of `token_ids` to `hashes` (in place)."""
    parent = hashes[-1] if hashes else root_hash(extra_keys)
    start = len(hashes) * block_tokens
    end = len(token_ids) // block_tokens * block_tokens
    if end <= start:
        return hashes
    new = tuple(token_ids[start:end])  # one copy; slicing a tuple gives tuples directly
    append = hashes.append
    for i in range(0, end - start, block_tokens):
        parent = hash((parent, new[i : i + block_tokens]))
        append(parent)
    return hashes


class PrefixKeys:
    """The prefix keys of one request, extended lazily as its tokens become known.

    `keys(L)` is the key of the first L tokens (L a multiple of `block_tokens`) or None if they
    are not all known; `keys.unit_keys(t, i, j)` the keys of units i..j-1 of t tokens each.
    """

    __slots__ = ("tokens", "block_tokens", "extra_keys", "hashes")

    def __init__(
        self,
        tokens: Sequence[int],
        block_tokens: int,
        extra_keys: Sequence[Hashable],
        hashes: list[int],
    ) -> None:
        self.tokens, self.block_tokens, self.extra_keys = tokens, block_tokens, extra_keys
        self.hashes = hashes

    def _extend(self, num_blocks: int) -> None:
        if num_blocks > len(self.hashes):
            extend_hashes(self.hashes, self.tokens, self.block_tokens, self.extra_keys)

    def __call__(self, length: int) -> int | None:
        idx = length // self.block_tokens - 1
        self._extend(idx + 1)
        return self.hashes[idx] if 0 <= idx < len(self.hashes) else None

    def unit_keys(self, unit_tokens: int, start: int, end: int) -> list[int]:
        r = unit_tokens // self.block_tokens
        self._extend(end * r)
        return self.hashes[(start + 1) * r - 1 : end * r : r]
