"""The n-gram proposer: the documented rule, the incremental index against the O(L) reference."""

from __future__ import annotations

import time

import numpy as np
import pytest

from hybridkv.spec_decode import ngram
from hybridkv.spec_decode.config import SpeculativeConfig
from hybridkv.spec_decode.ngram import (
    NgramIndex,
    NgramProposer,
    gram_hash,
    gram_hashes,
    latest_match,
    propose_ngram,
)

A, B, C, D, E, X, Y = 1, 2, 3, 4, 5, 8, 9


def test_docstring_example():
    """t = A B C A B C A B, n = 3: the match ends at 4, period 3, drafts C A B C A."""
    t = [A, B, C, A, B, C, A, B]
    assert latest_match(np.array(t), len(t), 3) == 4
    assert propose_ngram(t, 5, 3, 3) == [C, A, B, C, A]
    assert NgramProposer(5, 3, 3).propose("r", t) == [C, A, B, C, A]


def test_most_recent_occurrence_wins():
    # "A B" occurs twice before the suffix: followed by X, then by Y (the more recent)
    t = [A, B, X, D, A, B, Y, E, C, A, B]
    assert propose_ngram(t, 2, 2, 2) == [Y, E]
    assert NgramProposer(2, 2, 2).propose("r", t) == [Y, E]


def test_longest_ngram_wins_over_a_more_recent_shorter_one():
    # suffix ... C A B: the 3-gram C A B occurs early (followed by X); "A B" more recently (by Y)
    t = [C, A, B, X, E, A, B, Y, D, C, A, B]
    assert propose_ngram(t, 2, 1, 3) == [X, E]
    assert propose_ngram(t, 2, 1, 2) == [Y, D]  # with n <= 2 the recent "A B" wins
    assert NgramProposer(2, 1, 3).propose("r", t) == [X, E]
    assert NgramProposer(2, 1, 2).propose("s", t) == [Y, D]


def test_no_match_and_short_contexts_give_no_drafts():
    assert propose_ngram([A, B, C, D], 3, 1, 3) == []
    assert NgramProposer(3, 1, 3).propose("r", [A, B, C, D]) == []
    for t in ([], [A], [A, A]):
        assert propose_ngram(t, 3, 2, 2) == []
        assert NgramProposer(3, 2, 2).propose(str(len(t)), t) == []
    # min_n bounds the shortest n: a 1-gram match does not count with min_n = 2
    assert propose_ngram([A, B, C, A], 2, 2, 3) == []
    assert propose_ngram([A, B, C, A], 2, 1, 3) == [B, C]


def test_continuation_past_the_end_repeats_the_period():
    """A loop of one token drafts k copies; a loop of two alternates."""
    assert propose_ngram([X, A, A, A], 4, 1, 2) == [A, A, A, A]
    assert propose_ngram([X, A, B, A, B], 5, 2, 2) == [A, B, A, B, A]
    assert NgramProposer(4, 1, 2).propose("r", [X, A, A, A]) == [A, A, A, A]


def test_num_drafts_caps_and_batch():
    p = NgramProposer(4, 1, 2)
    t1 = [A, B, C, D, A, B]
    t2 = [X, Y, X]
    t3 = [C, D, E]
    assert p.propose_batch([("1", t1), ("2", t2), ("3", t3)]) == [[C, D, A, B], [Y, X, Y, X], []]
    assert p.propose_batch([("1", t1), ("2", t2), ("3", t3)], [2, 0, 4]) == [[C, D], [], []]
    assert p.propose("1", t1, num_drafts=9) == [C, D, A, B]  # never more than k
    with pytest.raises(ValueError, match="2 draft caps for 3 requests"):
        p.propose_batch([("1", t1), ("2", t2), ("3", t3)], [1, 1])


def _random_tokens(rng: np.random.Generator, n: int, vocab: int) -> np.ndarray:
    """Tokens with many repeats: random text with copied spans (as code and quotes have)."""
    out: list[int] = []
    while len(out) < n:
        if out and rng.random() < 0.5:
            start = int(rng.integers(0, len(out)))
            out.extend(out[start : start + int(rng.integers(2, 12))])
        else:
            out.extend(rng.integers(0, vocab, size=int(rng.integers(1, 6))).tolist())
    return np.array(out[:n], dtype=np.int64)


@pytest.mark.parametrize(("min_n", "max_n"), [(1, 1), (1, 4), (2, 5), (3, 3)])
def test_incremental_index_equals_reference(min_n, max_n):
    """Random appends (single tokens and bulks, crossing the bulk threshold) on repetitive
    sequences: after every append the index proposes exactly what the O(L) rule proposes."""
    rng = np.random.default_rng(min_n * 10 + max_n)
    for trial in range(6):
        tokens = _random_tokens(rng, 400, vocab=5 + 3 * trial)
        p = NgramProposer(5, min_n, max_n)
        length = int(rng.integers(0, 40))
        matched = 0
        while length <= tokens.shape[0]:
            t = tokens[:length]
            got = p.propose("r", t.tolist())
            assert got == propose_ngram(t, 5, min_n, max_n), (trial, length)
            matched += bool(got)
            length += int(rng.choice([1, 1, 1, 2, 3, 9, 30]))
        assert matched > 10  # the sequences do repeat: the test compared real proposals
        assert p.indexes["r"].fallback_scans == 0


def test_numpy_and_list_inputs_agree():
    rng = np.random.default_rng(3)
    t = _random_tokens(rng, 300, vocab=7)
    a, b = NgramProposer(4, 1, 3), NgramProposer(4, 1, 3)
    for n in range(1, 300, 7):
        assert a.propose("r", t[:n]) == b.propose("r", t[:n].tolist())


def test_hash_paths_agree():
    """The bulk (NumPy) and one-by-one (Python) hashes are one function."""
    rng = np.random.default_rng(0)
    t = rng.integers(0, 2**31 - 1, size=64, dtype=np.int64)
    ends = np.arange(10, 64, dtype=np.int64)
    hashes = gram_hashes(t, ends, 6)
    for n in range(1, 7):
        for j, e in enumerate(ends.tolist()):
            assert int(hashes[n - 1][j]) == gram_hash(t, e, n)
    # different n-grams get different hashes here (a sanity check, not a guarantee)
    assert len({int(h) for h in hashes[2]}) == ends.shape[0]


def test_hash_collision_falls_back_to_the_exact_scan():
    """A table entry pointing at a different n-gram (a collision) is detected and the exact
    scan answers."""
    t = [A, B, C, X, Y, A, B, C, E, D, A, B, C]
    p = NgramProposer(2, 3, 3)
    assert p.propose("r", t) == [E, D]
    index = p.indexes["r"]
    key = gram_hash(t, len(t) - 1, 3)
    index.tables[0][key] = 4  # ends at Y: "C X Y", not "A B C"
    assert index.propose(2) == [E, D]
    assert index.fallback_scans == 1
    t2 = [X, Y, Y, A, B, C]  # and no real match: the scan finds none -> no drafts
    q = NgramProposer(2, 3, 3)
    q.propose("s", t2)
    q.indexes["s"].tables[0][gram_hash(t2, len(t2) - 1, 3)] = 2
    assert q.indexes["s"].propose(2) == []


def test_changed_tokens_rebuild_the_index():
    p = NgramProposer(2, 1, 2)
    assert p.propose("r", [A, B, C, A]) == [B, C]
    # the same id with a different history (shorter, or a different last indexed token)
    assert p.propose("r", [X, Y, X]) == [Y, X]
    assert p.propose("r", [C, D, E, C, D, E]) == [C, D]
    assert p.indexes["r"].length == 6
    p.discard("r")
    p.discard("r")  # idempotent
    assert "r" not in p.indexes


def test_appends_cost_only_the_new_tokens(monkeypatch):
    """After the prompt is indexed, a step registers only the new ends and never scans."""
    rng = np.random.default_rng(1)
    tokens = _random_tokens(rng, 20_000, vocab=50).tolist()
    p = NgramProposer(4, 2, 4)
    p.propose("r", tokens[:10_000])
    index = p.indexes["r"]
    registered: list[int] = []
    real = NgramIndex._register_one

    def counting(self: NgramIndex, end: int) -> None:
        registered.append(end)
        real(self, end)

    def no_scan(*args: object) -> int:
        raise AssertionError("an O(L) scan ran")

    monkeypatch.setattr(NgramIndex, "_register_one", counting)
    monkeypatch.setattr(ngram, "latest_match", no_scan)
    t0 = time.perf_counter()
    for n in range(10_001, 12_001):
        p.propose("r", tokens[:n])
    elapsed = time.perf_counter() - t0
    assert registered == list(range(9_999, 11_999))  # one end per appended token
    assert index.length == 12_000
    # generous: ~10 us per step here; O(context) work would be ~100x more
    assert elapsed < 2.0


def test_from_config():
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    )
    p = NgramProposer.from_config(c)
    assert (p.k, p.min_n, p.max_n) == (3, 2, 2)
    with pytest.raises(ValueError, match="needs method 'ngram'"):
        NgramProposer.from_config(SpeculativeConfig.from_dict({"method": "mtp"}))
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(2, 3, 2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(0, 1, 2)
