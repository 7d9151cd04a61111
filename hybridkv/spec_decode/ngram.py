"""N-gram (prompt lookup) drafts: copy what followed the last earlier occurrence of the suffix.

The rule, for a request whose tokens so far (prompt + output) are t[0 .. L-1], k drafts wanted,
n-gram bounds [min_n, max_n]:

    for n = max_n, max_n - 1, ..., min_n  (n <= L - 1):
        g = t[L-n .. L-1]                              the suffix n-gram
        e = the largest end position <= L - 2 with t[e-n+1 .. e] == g
            (the MOST RECENT earlier occurrence; ending at L - 2 at the latest means at least
            one token followed it)
        if there is one: stop; the longest n that occurs wins
    none: no drafts (an empty list)

    drafts[j] = t[e + 1 + j] for j = 0 .. k-1, where positions at or past L continue with the
    drafts themselves: the match says the text repeats with period p = L - 1 - e, so
    drafts[j] = t[L - p + (j mod p)]. A match therefore always yields k drafts; fewer only when
    the caller asks for fewer (`num_drafts`), and none without a match or when L <= min_n.

Example, L = 8, n = 3:  t = A B C A B C A B, suffix C A B, most recent earlier occurrence ends
at e = 4 (t[2..4]); p = 3; drafts (k = 5) = C A B C A.

Speed: a per-request index maps, for every n in [min_n, max_n], the hash of each n-gram that
has a follower to the end position of its most recent occurrence. Appending tokens updates it
in O(new tokens x (max_n - min_n + 1)); a proposal is one dictionary look-up per n plus an
n-token comparison, independent of the context length. The first call of a request indexes its
prompt in one vectorised pass. Hashes are 64-bit; a candidate is always checked token by token,
and a collision (a different n-gram stored under the same hash, never seen in practice) falls
back to an exact NumPy scan, so the rule above holds exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridkv.spec_decode.config import SpeculativeConfig

TokenIds = Sequence[int] | np.ndarray

_MASK = (1 << 64) - 1
_BASE = 0x100000001B3  # odd: multiplication by it is a bijection mod 2^64
_BULK_MIN = 8  # new ends from which the NumPy path beats the Python loop


def _mix_py(t: int) -> int:
    """splitmix64 of a token id (a Python int), so the polynomial below sees random words."""
    z = (t + 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _mix_np(t: np.ndarray) -> np.ndarray:
    """splitmix64 of token ids: [m] int64 -> [m] uint64 (wrapping arithmetic, as _mix_py)."""
    z = t.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def gram_hashes(tokens: np.ndarray, ends: np.ndarray, max_n: int) -> list[np.ndarray]:
    """Hashes of the n-grams ending at each of `ends`, for n = 1 .. max_n.

    tokens: [L] int64; ends: [m] int64 positions -> a list of max_n arrays, entry n - 1 of
    shape [m] uint64 (h_1 = mix(t[e]), h_n = h_{n-1} * BASE + mix(t[e-n+1]) mod 2^64); entries
    whose n-gram would start before position 0 are garbage and must be masked by the caller."""
    out = []
    h = np.zeros(ends.shape[0], dtype=np.uint64)
    for n in range(1, max_n + 1):
        src = np.maximum(ends - (n - 1), 0)
        h = h * np.uint64(_BASE) + _mix_np(tokens[src])
        out.append(h.copy())
    return out


def gram_hash(tokens: Sequence[int] | np.ndarray, end: int, n: int) -> int:
    """The hash of the n-gram tokens[end-n+1 .. end] (Python ints; equal to `gram_hashes`)."""
    h = 0
    for i in range(n):
        h = (h * _BASE + _mix_py(int(tokens[end - i]))) & _MASK
    return h


def latest_match(tokens: np.ndarray, length: int, n: int) -> int:
    """The exact scan (reference and collision fallback): the largest end e <= length - 2 with
    tokens[e-n+1 .. e] == tokens[length-n .. length-1], or -1. tokens: [>= length] int64."""
    if n > length - 1:
        return -1
    suffix = tokens[length - n : length]
    # windows of the tokens that have a follower: [length - n, n], window i ends at i + n - 1
    windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)
    hits = np.flatnonzero((windows == suffix).all(axis=1))
    return int(hits[-1]) + n - 1 if hits.size else -1


def continue_from(tokens: np.ndarray, length: int, end: int, k: int) -> list[int]:
    """k drafts after a match ending at `end`: t[end + 1 + j], periodic past the context end."""
    period = length - 1 - end  # >= 1
    idx = (length - period) + np.arange(k) % period
    return tokens[idx].tolist()


def propose_ngram(tokens: TokenIds, k: int, min_n: int, max_n: int) -> list[int]:
    """The rule of this module, stateless and O(L) per call (the reference the index matches)."""
    t = np.asarray(tokens, dtype=np.int64)
    length = t.shape[0]
    if k <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        end = latest_match(t, length, n)
        if end >= 0:
            return continue_from(t, length, end, k)
    return []


class NgramIndex:
    """One request's tokens and, per n in [min_n, max_n], n-gram hash -> most recent end
    position among the n-grams that have a follower."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self.tokens = np.zeros(64, dtype=np.int64)  # [capacity], the first `length` are used
        self.length = 0
        self.registered = 0  # ends < registered are in the tables
        self.tables: list[dict[int, int]] = [{} for _ in range(max_n - min_n + 1)]
        self.fallback_scans = 0  # collisions met (a test checks this stays 0)

    def extend(self, new: TokenIds) -> None:
        """Append tokens and register every n-gram that now has a follower."""
        m = len(new)
        if m == 0:
            return
        need = self.length + m
        if need > self.tokens.shape[0]:
            grown = np.zeros(max(need, 2 * self.tokens.shape[0]), dtype=np.int64)
            grown[: self.length] = self.tokens[: self.length]
            self.tokens = grown
        self.tokens[self.length : need] = np.asarray(new, dtype=np.int64)
        self.length = need
        first, last = self.registered, self.length - 1  # ends first .. last - 1 get a follower
        if last - first >= _BULK_MIN:
            self._register_bulk(first, last)
        else:
            for end in range(first, last):
                self._register_one(end)
        self.registered = max(self.registered, last)

    def _register_one(self, end: int) -> None:
        t, h = self.tokens, 0
        for n in range(1, min(self.max_n, end + 1) + 1):
            h = (h * _BASE + _mix_py(int(t[end - n + 1]))) & _MASK
            if n >= self.min_n:
                self.tables[n - self.min_n][h] = end

    def _register_bulk(self, first: int, last: int) -> None:
        ends = np.arange(first, last, dtype=np.int64)  # [m]
        hashes = gram_hashes(self.tokens, ends, self.max_n)
        for n in range(self.min_n, self.max_n + 1):
            ok = ends >= n - 1  # the n-gram starts inside the context
            # later ends overwrite earlier ones: the most recent occurrence wins
            self.tables[n - self.min_n].update(
                zip(hashes[n - 1][ok].tolist(), ends[ok].tolist(), strict=True)
            )

    def propose(self, k: int) -> list[int]:
        """Up to k drafts by the rule of this module (k if any n-gram matches)."""
        length, t = self.length, self.tokens
        if k <= 0:
            return []
        h = 0
        hashes = []
        for n in range(1, min(self.max_n, length - 1) + 1):  # suffix hashes, shortest first
            h = (h * _BASE + _mix_py(int(t[length - n]))) & _MASK
            hashes.append(h)
        for n in range(len(hashes), self.min_n - 1, -1):
            end = self.tables[n - self.min_n].get(hashes[n - 1], -1)
            if end < 0:
                continue
            if not np.array_equal(t[end - n + 1 : end + 1], t[length - n : length]):
                self.fallback_scans += 1
                end = latest_match(t, length, n)
                if end < 0:
                    continue
            return continue_from(t, length, end, k)
        return []


class NgramProposer:
    """Prompt-lookup drafts for many requests, each with its own incremental index.

    Call `propose` / `propose_batch` every step with each request's full token list (prompt +
    output so far; a list or a NumPy array): only the tokens appended since the last call are
    indexed. Call `discard` when a request finishes or is aborted (a preempted request keeps
    its index: its tokens do not change)."""

    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                f"({prompt_lookup_max})"
            )
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        if config.method != "ngram":
            raise ValueError(f"an ngram proposer needs method 'ngram', got {config.method!r}")
        assert config.num_speculative_tokens is not None
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        return cls(
            config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
        )

    def _index(self, request_id: str, token_ids: TokenIds) -> NgramIndex:
        index = self.indexes.get(request_id)
        n = len(token_ids)
        # a different token list under a known id (shorter, or its last indexed token differs):
        # start over
        if index is not None and (
            n < index.length
            or (index.length and int(token_ids[index.length - 1]) != index.tokens[index.length - 1])
        ):
            index = None
        if index is None:
            index = self.indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        if n > index.length:
            index.extend(token_ids[index.length :])
        return index

    def propose(
        self, request_id: str, token_ids: TokenIds, num_drafts: int | None = None
    ) -> list[int]:
        """Drafts for one request: at most `num_drafts` (default k), none without a match."""
        k = self.k if num_drafts is None else min(num_drafts, self.k)
        index = self._index(request_id, token_ids)
        return index.propose(k)

    def propose_batch(
        self,
        requests: Sequence[tuple[str, TokenIds]],
        num_drafts: Sequence[int] | None = None,
    ) -> list[list[int]]:
        """Drafts for every (request id, token ids) pair, in order; `num_drafts[i]` caps
        request i's (0: none, e.g. a request about to reach max_tokens)."""
        if num_drafts is not None and len(num_drafts) != len(requests):
            raise ValueError(f"{len(num_drafts)} draft caps for {len(requests)} requests")
        return [
            self.propose(rid, ids, None if num_drafts is None else num_drafts[i])
            for i, (rid, ids) in enumerate(requests)
        ]

    def discard(self, request_id: str) -> None:
        """Forget a request's index (finished or aborted)."""
        self.indexes.pop(request_id, None)
