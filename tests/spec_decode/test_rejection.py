"""Verification: greedy is exact; rejection sampling keeps the target's distribution."""

from __future__ import annotations

import pytest
import torch

from hybridkv.spec_decode.rejection import (
    PAD,
    VerifyResult,
    greedy_verify,
    pad_drafts,
    rejection_sample,
)

V = 6
# chi-square quantile for V - 1 = 5 degrees of freedom at 1 - 1e-4: a correct sampler exceeds
# it once in 10,000 seeds (the seeds here are fixed, so the tests are deterministic)
CHI2_5DOF_1E4 = 25.74


def chi2(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Pearson's statistic of the token counts against the distribution p ([V])."""
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    expected = tokens.shape[0] * p.double()
    return float(((counts - expected) ** 2 / expected).sum())


def tv(tokens: torch.Tensor, p: torch.Tensor) -> float:
    """Total-variation distance of the empirical distribution of tokens from p."""
    counts = torch.bincount(tokens, minlength=p.shape[0]).double()
    return float((counts / tokens.shape[0] - p.double()).abs().sum() / 2)


def sequential_greedy(target: list[int], drafts: list[int]) -> list[int]:
    """The definition, one position at a time."""
    out = []
    for i, d in enumerate(drafts):
        if d != target[i]:
            return [*out, target[i]]
        out.append(d)
    return [*out, target[len(drafts)]]


# -- greedy ---------------------------------------------------------------------------------------


def test_greedy_cases():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    drafts = torch.tensor([[5, 6, 7], [5, 0, 7], [1, 6, 7], [5, 6, 7]])
    num = torch.tensor([3, 3, 3, 1])
    r = greedy_verify(target, drafts, num)
    assert r.num_accepted.tolist() == [3, 1, 0, 1]
    assert r.token_lists() == [[5, 6, 7, 8], [5, 6], [5], [5, 6]]
    assert r.num_tokens.tolist() == [4, 2, 1, 2]
    # columns after the output are PAD; drafts past num_drafts (row 3) are ignored
    assert r.tokens[1].tolist() == [5, 6, PAD, PAD]
    assert r.tokens[3].tolist() == [5, 6, PAD, PAD]


def test_greedy_matches_the_sequential_definition():
    g = torch.Generator().manual_seed(0)
    n, k = 500, 4
    target = torch.randint(0, 3, (n, k + 1), generator=g)
    drafts = torch.where(
        torch.rand(n, k, generator=g) < 0.7, target[:, :k], torch.randint(0, 3, (n, k), generator=g)
    )
    num = torch.randint(0, k + 1, (n,), generator=g)
    r = greedy_verify(target, drafts, num)
    lists = r.token_lists()
    for i in range(n):
        d = int(num[i])
        expected = sequential_greedy(target[i].tolist(), drafts[i, :d].tolist())
        assert lists[i] == expected
        # the output is the target's own argmax prefix: what decoding without drafts gives
        assert lists[i] == target[i, : len(expected)].tolist()
    assert 0 < float(r.num_accepted.float().mean()) < k


def test_greedy_without_drafts():
    r = greedy_verify(torch.tensor([[3], [4]]), torch.zeros(2, 0, dtype=torch.int64),
                      torch.tensor([0, 0]))  # fmt: skip
    assert r.token_lists() == [[3], [4]]


def test_shapes_checked():
    target = torch.zeros(2, 4, dtype=torch.int64)
    with pytest.raises(ValueError, match="draft_tokens must be"):
        greedy_verify(target, torch.zeros(2, 2, dtype=torch.int64), torch.tensor([1, 1]))
    with pytest.raises(ValueError, match="num_drafts must lie"):
        greedy_verify(target, torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 4]))
    with pytest.raises(ValueError, match="num_drafts must be"):
        greedy_verify(target, torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1]))
    probs = torch.full((2, 4, V), 1 / V)
    with pytest.raises(ValueError, match="draft_probs must be"):
        rejection_sample(probs, torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 1]),
                         torch.full((2, 3, V + 1), 1.0))  # fmt: skip
    with pytest.raises(ValueError, match="1 generators for 2 requests"):
        rejection_sample(probs, torch.zeros(2, 3, dtype=torch.int64), torch.tensor([1, 1]),
                         generators=[None])  # fmt: skip


# -- rejection sampling ---------------------------------------------------------------------------


def test_one_hot_target_is_greedy():
    """With p = onehot(argmax) rejection sampling is greedy verification."""
    g = torch.Generator().manual_seed(1)
    n, k = 300, 3
    target = torch.randint(0, V, (n, k + 1), generator=g)
    drafts = torch.where(
        torch.rand(n, k, generator=g) < 0.6, target[:, :k], torch.randint(0, V, (n, k), generator=g)
    )
    num = torch.randint(0, k + 1, (n,), generator=g)
    probs = torch.nn.functional.one_hot(target, V).float()
    for q in (None, torch.softmax(torch.randn(n, k, V, generator=g), -1)):
        r = rejection_sample(probs, drafts, num, q, generator=g)
        e = greedy_verify(target, drafts, num)
        assert torch.equal(r.num_accepted, e.num_accepted)
        assert torch.equal(r.tokens, e.tokens)


P0 = torch.tensor([0.30, 0.25, 0.18, 0.12, 0.09, 0.06])
P1 = torch.tensor([0.05, 0.10, 0.15, 0.20, 0.22, 0.28])
R = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.25, 0.35])  # where point-mass drafts come from


def _batch(n: int, draft_dist: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    """n trials, k = 2: target p_0 = P0, p_1 = P1, p_2 = P0; drafts i.i.d. from draft_dist."""
    probs = torch.stack([P0, P1, P0])[None].expand(n, 3, V).contiguous()
    drafts = torch.multinomial(draft_dist, 2 * n, replacement=True, generator=g).view(n, 2)
    return probs, drafts, torch.full((n,), 2, dtype=torch.int64)


def test_point_mass_drafts_keep_the_distribution():
    """ngram drafts (q = onehot(x)), drawn from a distribution unlike the target's: the first
    output token is distributed as p_0, the second (when the first draft was accepted) as p_1,
    and draft 0 is accepted with probability sum_x R(x) p_0(x)."""
    g = torch.Generator().manual_seed(2)
    n = 40_000
    probs, drafts, num = _batch(n, R, g)
    r = rejection_sample(probs, drafts, num, None, generator=g)
    first = r.tokens[:, 0]
    assert chi2(first, P0) < CHI2_5DOF_1E4
    assert tv(first, P0) < 0.015
    second = r.tokens[r.num_accepted >= 1, 1]
    assert second.shape[0] > 4_000  # about 40_000 x 0.113
    assert chi2(second, P1) < CHI2_5DOF_1E4
    rate = float((r.num_accepted >= 1).double().mean())
    assert abs(rate - float((R * P0).sum())) < 0.01
    # a rejected point-mass draft is never the token that replaces it
    rows = torch.nonzero(r.num_accepted < num)[:, 0]
    at = r.num_accepted[rows]
    assert not bool((r.tokens[rows, at] == drafts[rows, at]).any())
    # the test has power: taking the drafts as they are fails it by far
    assert chi2(drafts[:, 0], P0) > 100 * CHI2_5DOF_1E4


def test_general_draft_distribution_keeps_the_distribution():
    """MTP drafts sampled from q: the output is distributed as p and draft 0 is accepted with
    probability sum_x min(p_0(x), q_0(x))."""
    g = torch.Generator().manual_seed(3)
    n = 40_000
    q_rows = torch.stack([R, torch.tensor([0.4, 0.3, 0.1, 0.1, 0.05, 0.05])])  # [k, V]
    probs, _, num = _batch(n, R, g)
    drafts = torch.stack(
        [torch.multinomial(q_rows[i], n, replacement=True, generator=g) for i in range(2)], 1
    )
    q = q_rows[None].expand(n, 2, V).contiguous()
    r = rejection_sample(probs, drafts, num, q, generator=g)
    assert chi2(r.tokens[:, 0], P0) < CHI2_5DOF_1E4
    assert tv(r.tokens[:, 0], P0) < 0.015
    assert chi2(r.tokens[r.num_accepted >= 1, 1], P1) < CHI2_5DOF_1E4
    rate = float((r.num_accepted >= 1).double().mean())
    assert abs(rate - float(torch.minimum(P0, R).sum())) < 0.01
    bonus = r.tokens[r.num_accepted == 2, 2]  # after both drafts: a bonus token from p_2 = P0
    assert bonus.shape[0] > 3_000
    assert chi2(bonus, P0) < CHI2_5DOF_1E4


def test_rows_without_drafts_sample_the_target():
    g = torch.Generator().manual_seed(4)
    n = 20_000
    probs, drafts, _ = _batch(n, R, g)
    r = rejection_sample(probs, drafts, torch.zeros(n, dtype=torch.int64), generator=g)
    assert int(r.num_accepted.sum()) == 0
    assert chi2(r.tokens[:, 0], P0) < CHI2_5DOF_1E4
    assert bool((r.tokens[:, 1:] == PAD).all())


def test_impossible_and_certain_drafts():
    probs = torch.zeros(2, 3, V)
    probs[:, :, 0] = 1.0  # the target is certain of token 0 everywhere
    drafts = torch.tensor([[0, 0], [3, 0]])
    r = rejection_sample(probs, drafts, torch.tensor([2, 2]), generator=torch.Generator())
    assert r.token_lists() == [[0, 0, 0], [0]]  # p(x) = 1 always accepts, p(x) = 0 never


def test_seeded_rows_reproducible_and_independent_of_the_batch():
    g = torch.Generator().manual_seed(5)
    n, k = 8, 4
    probs = torch.softmax(torch.randn(n, k + 1, V, generator=g) * 0.5, -1)
    drafts = torch.randint(0, V, (n, k), generator=g)
    num = torch.tensor([4, 3, 0, 4, 2, 4, 1, 4])

    def gens() -> list[torch.Generator | None]:
        return [torch.Generator().manual_seed(100 + i) if i % 2 == 0 else None for i in range(n)]

    a = rejection_sample(probs, drafts, num, generators=gens(), generator=g)
    b = rejection_sample(probs, drafts, num, generators=gens(), generator=g)
    seeded = [0, 2, 4, 6]
    assert torch.equal(a.tokens[seeded], b.tokens[seeded])
    # row 4 alone, with a fresh generator of the same seed: the same result as in the batch
    alone = rejection_sample(probs[4:5], drafts[4:5], num[4:5],
                             generators=[torch.Generator().manual_seed(104)])  # fmt: skip
    assert torch.equal(alone.tokens[0], a.tokens[4])
    # and different seeds do differ somewhere over many rows
    m = 200
    many = probs[:1].expand(m, k + 1, V).contiguous()
    d = drafts[:1].expand(m, k).contiguous()
    n4 = torch.full((m,), 4)
    x = rejection_sample(
        many, d, n4, generators=[torch.Generator().manual_seed(i) for i in range(m)]
    )
    assert len({tuple(row) for row in x.tokens.tolist()}) > 10


def test_pad_drafts_and_token_lists():
    tokens, lengths = pad_drafts([[4, 5], [], [1, 2, 3]], 3)
    assert tokens.tolist() == [[4, 5, 0], [0, 0, 0], [1, 2, 3]]
    assert lengths.tolist() == [2, 0, 3]
    with pytest.raises(ValueError, match="more than k = 2"):
        pad_drafts([[1, 2, 3]], 2)
    r = VerifyResult(torch.tensor([0, 2]), torch.tensor([[7, PAD, PAD], [1, 2, 9]]))
    assert r.token_lists() == [[7], [1, 2, 9]]
