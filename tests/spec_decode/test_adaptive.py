"""adaptive_k's policy (hybridkv.spec_decode.adaptive) on synthetic step times."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from hybridkv.spec_decode.adaptive import (
    LEARN_EVERY,
    MIN_SAMPLES,
    PROBE_EVERY,
    WARMUP_RUNS,
    Candidate,
    GoodputPolicy,
)

K = 4


def measure(policy: GoodputPolicy, n: int, cost: Callable[[int, int], float]) -> None:
    """Every shape (n, 1 .. K + 1) run through its warm-up and sampled enough."""
    for q in range(1, K + 2):
        for _ in range(WARMUP_RUNS + MIN_SAMPLES):
            policy.observe_step(n, q, cost(n, q))


def teach(policy: GoodputPolicy, rid: str, rate: float, times: int = 40) -> None:
    """Verified drafts of `rid`: all K accepted with chance `rate` per step, else none."""
    accepted = 0.0
    for _ in range(times):
        accepted += rate
        if accepted >= 1.0:
            accepted -= 1.0
            policy.observe_verify(rid, K, K)
        else:
            policy.observe_verify(rid, K, 0)


def full(rids: list[str], known: int = 1) -> list[Candidate]:
    return [Candidate(r, known, K, K) for r in rids]


def flat(n: int, q: int) -> float:  # a step that streams the weights: rows nearly free
    return 1e-3 * (1 + 0.02 * n * q)


def linear(n: int, q: int) -> float:  # compute-bound: every row costs a decode token's share
    return 1e-4 * n * q


@pytest.mark.parametrize("rewinds", [False, True])
def test_flat_costs_and_good_drafts_take_every_draft(rewinds):
    p = GoodputPolicy(K, rewinds=rewinds)
    measure(p, 1, flat)
    teach(p, "a", 1.0)
    assert p.choose(full(["a"])) == K + 1


def test_compute_bound_steps_take_no_drafts_unless_all_are_right():
    p = GoodputPolicy(K, rewinds=False)
    measure(p, 8, linear)
    rids = [f"r{i}" for i in range(8)]
    for r in rids:
        teach(p, r, 0.5)
    assert p.choose(full(rids)) == 1  # half accepted: rows cost more than they return
    assert not p.worth_proposing(full(rids))  # not even all-accepted drafts would pay
    p2 = GoodputPolicy(K, rewinds=False)
    measure(p2, 8, lambda n, q: 1e-3 + 1e-5 * n * q)  # memory-bound at batch 8 too
    for r in rids:
        teach(p2, r, 0.9)
    assert p2.choose(full(rids)) == K + 1
    assert p2.worth_proposing(full(rids))


def test_each_request_its_own_first_draft_rate():
    """A request that copies keeps drafting next to one whose drafts miss."""
    p = GoodputPolicy(K, rewinds=False)
    measure(p, 1, lambda n, q: 1e-3 * (1 + 0.25 * (q - 1)))
    teach(p, "copies", 1.0)
    teach(p, "misses", 0.0)
    assert p.choose(full(["copies"])) == K + 1
    assert p.choose(full(["misses"])) == 1
    assert p.chain("copies")[1] > 0.85 > 0.15 > p.chain("misses")[1]
    # a request that ran without its drafts still teaches with its first draft
    before = p.chain("misses")[1]
    for _ in range(16):
        p.observe_plain("misses", True)
    assert p.chain("misses")[1] > 0.5 > before
    p.forget("misses")
    assert "misses" not in p.firsts


def test_a_new_request_leans_on_every_requests_rate():
    p = GoodputPolicy(K, rewinds=False)
    assert p.chain("new") == [1.0] * (K + 1)  # no observation at all: drafting is tried
    teach(p, "old", 0.0)
    assert p.chain("new")[1] == pytest.approx(0.0, abs=1e-9)


def test_only_the_drafts_offered_count():
    """A request with 1 draft gains as much from q = 2 as from q = 5: the useful choice is
    the smallest shape that carries its drafts."""
    p = GoodputPolicy(K, rewinds=False)
    measure(p, 1, lambda n, q: 1e-3 * (1 + 0.1 * q))
    teach(p, "a", 1.0)
    assert p.choose([Candidate("a", 1, 1, K)]) == 2
    assert p.choose([Candidate("a", 1, 0, K)]) == 1  # no drafts: a plain step


def test_rewinds_cost_where_the_model_has_state():
    """With state layers a rejected draft (or any filler) rewinds: a next step that costs
    extra. Measured rewind steps that cost a lot keep weak drafts out."""
    costs = lambda n, q: 1e-3 * (1 + 0.05 * (q - 1))  # noqa: E731
    plain, state = GoodputPolicy(K, rewinds=False), GoodputPolicy(K, rewinds=True)
    for p in (plain, state):
        measure(p, 2, costs)
        teach(p, "a", 0.5)
        teach(p, "b", 0.5)
    for _ in range(MIN_SAMPLES):
        state.observe_rewind_step(2, 5e-3)  # 4 ms beyond a plain step
    cands = full(["a", "b"])
    assert plain.choose(cands) > 1
    assert state.choose(cands) == 1
    assert state.rewind_chance(cands, 1) == 0.0
    # a request without drafts next to one with drafts carries fillers: a rewind for sure
    assert state.rewind_chance([Candidate("a", 1, 2, K), Candidate("b", 1, 0, K)], 3) == 1.0


def test_unmeasured_shapes_are_tried_and_warmup_runs_not_counted():
    p = GoodputPolicy(K, rewinds=False)
    cands = full(["a"])
    assert p.choose(cands) == 1  # nothing measured yet: measure the smallest
    for _ in range(WARMUP_RUNS):
        p.observe_step(1, 1, 1.0)  # e.g. eager, then building the captured program
    assert (1, 1) not in p.seconds
    for _ in range(MIN_SAMPLES):
        p.observe_step(1, 1, 1e-3)
    assert p.seconds[(1, 1)].value == pytest.approx(1e-3)
    # the next size up is assumed to cost what the largest measured one below does; sizes
    # are explored one at a time: 2, then (measured as cheap) 3, ...
    assert p.choose(cands) == 2
    for _ in range(WARMUP_RUNS + MIN_SAMPLES):
        p.observe_step(1, 2, 1e-3)
    assert p.choose(cands) == 3
    for _ in range(WARMUP_RUNS + MIN_SAMPLES):
        p.observe_step(1, 3, 1e-1)  # expensive: 4 and 5 are not tried
    assert p.choose(cands) == 2


def sample(policy: GoodputPolicy, n: int, q: int, seconds: float) -> None:
    for _ in range(WARMUP_RUNS + MIN_SAMPLES):
        policy.observe_step(n, q, seconds)


def test_a_steep_cost_curve_stops_the_exploration():
    """Measured at q = 1 and 2 as compute-bound (each row a decode token's cost), q = 3 is
    predicted to cost one row more again, so even drafts that are always right (3 tokens for 3
    rows) are not worth trying it; flat costs keep the optimistic guess."""
    p = GoodputPolicy(K, rewinds=False)
    teach(p, "a", 1.0)
    sample(p, 1, 1, 1e-3)
    sample(p, 1, 2, 2e-3)
    assert p._step_seconds(1, 3) == pytest.approx(3e-3)
    assert p._step_seconds(1, 5) == pytest.approx(5e-3)
    assert p.choose(full(["a"])) in (1, 2)  # all three rates equal: never the unmeasured 3
    q = GoodputPolicy(K, rewinds=False)
    teach(q, "a", 1.0)
    sample(q, 1, 1, 1e-3)
    sample(q, 1, 2, 1.1e-3)
    assert q.choose(full(["a"])) == 3  # rows nearly free: the next size is tried


@pytest.mark.parametrize("cost, explores", [(linear, False), (flat, True)])
def test_other_batch_sizes_predict_an_unmeasured_one(cost, explores):
    """Batch 8 measured at every size; at batch 7 (a request finished) only plain steps are:
    q rows per request relative to one cost what they did at 8, so a compute-bound machine does
    not explore again, and one where rows are nearly free does."""
    p = GoodputPolicy(K, rewinds=False)
    measure(p, 8, cost)
    sample(p, 7, 1, cost(7, 1))
    rids = [f"r{i}" for i in range(7)]
    for rid in rids:
        teach(p, rid, 0.8)
    predicted = p._step_seconds(7, 2)
    assert predicted == pytest.approx(cost(7, 1) * cost(8, 2) / cost(8, 1))
    assert (p.choose(full(rids)) > 1) is explores


def test_a_recent_no_skips_the_candidates_until_the_next_learning_step():
    """`skips`: after `worth_proposing` said no for a batch size and `low`, the next steps
    skip without forming candidates (and count), up to the next learning step; another batch
    size, or a yes, does not skip."""
    p = GoodputPolicy(K, rewinds=False, probe_every=0)
    measure(p, 2, flat)  # (rows nearly free: right drafts would pay, these never are)
    rids = ["a", "b"]
    for rid in rids:
        teach(p, rid, 0.0)
    assert p.worth_proposing(full(rids)) is False  # step 1: decided
    skipped = []
    while p.num_steps < LEARN_EVERY - 1:
        skipped.append(p.skips(2, 1))
    assert all(skipped) and p.num_steps == LEARN_EVERY - 1
    assert p.skips(2, 1) is False and p.num_steps == LEARN_EVERY - 1  # a learning step next
    assert p.worth_proposing(full(rids)) is True  # (it learns)
    assert p.skips(3, 1) is False and p.skips(2, 2) is False  # never decided for these
    q = GoodputPolicy(K, rewinds=False, probe_every=0)
    measure(q, 1, flat)
    teach(q, "a", 1.0)
    assert q.worth_proposing(full(["a"])) is True and q.skips(1, 1) is False


@pytest.mark.parametrize("cost, learns", [(linear, False), (flat, True)])
def test_learning_steps_only_where_right_drafts_could_pay(cost, learns):
    """Every LEARN_EVERY-th step proposes drafts to learn their acceptance, but not where even
    drafts that are always right lose on the measured step times (compute-bound rows): then
    the acceptance cannot change the answer."""
    p = GoodputPolicy(K, rewinds=False, probe_every=0)
    measure(p, 2, cost)
    rids = ["a", "b"]
    for rid in rids:
        teach(p, rid, 0.0)
    answers = [p.worth_proposing(full(rids)) for _ in range(LEARN_EVERY)]
    assert answers[:-1] == [False] * (LEARN_EVERY - 1)
    assert answers[-1] is learns


def test_step_times_are_medians():
    p = GoodputPolicy(K, rewinds=False)
    for s in [9.0, 9.0, 1e-3, 1e-3, 5.0, 1e-3]:  # two warm-up runs, then one outlier
        p.observe_step(1, 1, s)
    assert p.seconds[(1, 1)].value == pytest.approx(1e-3)


def test_probe_reruns_a_neighbour_of_the_choice():
    p = GoodputPolicy(K, rewinds=False, probe_every=PROBE_EVERY)
    measure(p, 1, linear)
    teach(p, "a", 0.0)
    cands = full(["a"])
    picks = []
    for _ in range(PROBE_EVERY):
        p.worth_proposing(cands)
        q = p.choose(cands)
        picks.append(q)
        p.observe_step(1, q, linear(1, q))
    assert picks[-1] == 2 and set(picks[:-1]) == {1}  # one draft more than the choice
