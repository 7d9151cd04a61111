"""`adaptive_k`: how many drafts a step's verify chunks carry, chosen for tokens per second.

A draft costs its row in the verify step whether it is accepted or not. Where a step streams
the weights (a large model at a small batch) a few more rows are nearly free; where it is
compute-bound (a CPU at batch 8, a tiny model) every row costs about what a decode token does,
and drafts accepted half the time make the step slower than plain decoding
(benchmarks/README.md: 0.4-0.7x at batch 8 with k = 4). No single k is right for both, and
`disable_by_batch_size` / `num_speculative_tokens_per_batch_size` need the user to know the
machine. This policy measures instead (the "goodput" criterion of SmartSpec, Liu et al. 2024):

    steps of n requests with q tokens each  ->  seconds(n, q): lower quartile of the latest
                                                step times
    (one shape per step: core/scheduler.py)
    verified drafts                         ->  a_j: the chance that draft j is accepted once
                                                drafts 1 .. j - 1 were (over all requests);
                                                b_i: request i's own chance for its first

    expected tokens(q) = sum over requests i of 1 + P_i(1) + ... + P_i(m_i),
                         P_i(j) = b_i a_2 ... a_j (drafts 1 .. j accepted),
                         m_i = min(d_i, q - u_i)  (u_i: tokens it computes anyway, d_i: its
                         drafts)
    cost(q)            = seconds(n, q) + P(a rewind | q) * rewind seconds(n)
    chosen q           = argmax expected tokens(q) / cost(q),  q in [max u_i, max u_i + cap_i]

Whether a first draft is right depends on the request (n-gram drafts are right for a request
that copies, wrong for one that does not): b_i is a moving average over its last
REQUEST_WINDOW first drafts, leaning on a_1 (PRIOR_WEIGHT observations' worth) until it has its
own. Once a first draft is right the next ones mostly are (a copied passage goes on), which the
shared a_j for j >= 2 hold. A request whose drafts were cut from a step still teaches: the
token it then samples shows whether its first draft was right (`observe_plain`). When no draft
would pay the proposer is not even run, but for every LEARN_EVERY-th step (to keep learning).

With state layers a rejected draft (fillers included: the rows that pad a request to the step's
shape are its last token repeated, rejected but for chance) rewinds the request: the next step
restores its state and recomputes its known and accepted tokens (docs/speculative-decoding.md),
a step of mixed chunk lengths that runs eagerly. `rewind seconds(n)` is what such steps took
beyond a plain step (measured: steps with restores; one plain step's time until then), and
P(a rewind | q) = 1 - prod_i P(request i has none).

An unmeasured shape (n, q) is predicted from the measured ones, and runs when that prediction
wins, one size at a time upwards (the smallest unmeasured size is the largest considered):

    t(n, q) ~ max( t(n, q') + (q - q') * max(0, t(n, q') - t(n, q' - 1)),   q' the largest
                                                    measured size below q: its last row's cost
                                                    goes on (0 when q' - 1 is unmeasured: the
                                                    first size up is free, the optimistic guess)
                   t(n, 1) * t(n', q) / t(n', 1) )  n' the nearest batch size where q and 1
                                                    are measured: the cost of q rows per
                                                    request relative to one scales across
                                                    batch sizes

so a size that could pay is tried once, and a cost curve measured as steep (on a CPU each
verify row costs what a decode token does) stops the exploration, at this batch size and at
the others (a batch that shrinks as requests finish need not explore again). A shape's first
two runs (building its captured program, and one more) are not counted, two more make its
first estimate: the lower quartile of its samples, not their median, because a neighbour on a
shared machine only ever adds time (with two samples the median is their mean, which one step
slowed by another process moves by half its delay, enough to make a shape look steep and end
the exploration of longer ones). Every `probe_every` steps the neighbour of the choice (one
draft more or fewer) measured longest ago runs instead, so the choice follows the machine's
load. Whether drafting could pay at all is decided once per LEARN_EVERY steps and batch size.
Only which drafts are verified changes, never a token: greedy output stays equal to decoding
without drafts.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

TIME_WINDOW = 32  # step times a shape's estimate is taken over (the latest)
POSITION_WINDOW = 64  # verified drafts a position's acceptance average weighs
REQUEST_WINDOW = 16  # first drafts a request's own average weighs
PRIOR_WEIGHT = 2.0  # observations' worth of the all-request rate in a request's estimate
PROBE_EVERY = 512  # steps between re-measurements of a neighbour of the chosen shape
# runs of a shape not counted: the one that builds its captured program (hybridkv.worker.graphs:
# a verify shape at its first step, a decode shape at its second, after an eager one) and one
# more
WARMUP_RUNS = 2
MIN_SAMPLES = 2  # samples of a shape (after its warm-up runs) before its estimate is trusted
LEARN_EVERY = 8  # steps between proposals made only to learn each request's first drafts


@dataclass
class MovingMean:
    """A mean of the first `window` samples, then an exponential moving average (1 / window)."""

    window: int
    value: float = 0.0
    count: int = 0

    def add(self, sample: float) -> None:
        self.count += 1
        self.value += (sample - self.value) / min(self.count, self.window)


@dataclass
class StepTimes:
    """A shape's latest TIME_WINDOW step times and their lower quartile: a step that a
    collection, another process or a page fault slowed down only adds time, so a low quantile
    estimates the shape's own cost (and moves little), where a mean moves a lot and a median of
    two samples is their mean."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=TIME_WINDOW))
    last_step: int = 0  # the policy step of the latest sample
    # the estimate, computed when read (a step adds a sample, few steps read one: a batch
    # whose drafts do not pay skips the policy's reads for LEARN_EVERY steps)
    _estimate: float | None = None

    @property
    def count(self) -> int:
        return len(self.samples)

    @property
    def value(self) -> float:
        if self._estimate is None:
            ordered = sorted(self.samples)
            # lower quartile: the lowest of up to 4 samples, the 2nd of 5-8, ...
            self._estimate = ordered[(len(ordered) - 1) // 4] if ordered else 0.0
        return self._estimate

    def add(self, seconds: float, step: int) -> None:
        self.samples.append(seconds)
        self._estimate = None
        self.last_step = step


@dataclass(frozen=True)
class Candidate:
    """One request of the step that may carry drafts: `known` tokens it computes anyway,
    `drafts` real drafts offered (fillers excluded), at most `cap` drafts allowed."""

    request_id: str
    known: int
    drafts: int
    cap: int


class GoodputPolicy:
    """Chooses a step's tokens per verify chunk (module docstring). The scheduler calls
    `worth_proposing`, then (if so) `choose`; it reports verified drafts (`observe_verify`),
    first drafts of requests that ran without them (`observe_plain`) and finished requests
    (`forget`); the engine reports step times (`observe_step`)."""

    def __init__(self, max_drafts: int, rewinds: bool, probe_every: int = PROBE_EVERY) -> None:
        self.max_drafts = max_drafts
        self.rewinds = rewinds  # the model has state layers: a rejection recomputes
        self.probe_every = probe_every
        self.seconds: dict[tuple[int, int], StepTimes] = {}
        self._runs: dict[tuple[int, int], int] = {}  # warm-up runs seen per shape
        self.rewind_steps: dict[int, StepTimes] = {}  # steps with restores, by batch size
        # (batch size, tokens the rows compute anyway) -> (worth proposing, the step it was
        # decided at)
        self._worth: dict[tuple[int, int], tuple[bool, int]] = {}
        # a_j (index j - 1): draft j accepted once 1 .. j - 1 were, over every request
        self.positions = [MovingMean(POSITION_WINDOW) for _ in range(max_drafts)]
        self.firsts: dict[str, MovingMean] = {}  # b_i: first drafts per live request
        self.num_steps = 0

    # -- measurements --------------------------------------------------------------------------

    def observe_step(self, num_requests: int, tokens_each: int, seconds: float) -> None:
        key = (num_requests, tokens_each)
        runs = self._runs.get(key, 0)
        if runs < WARMUP_RUNS:
            self._runs[key] = runs + 1
            return
        times = self.seconds.get(key)
        if times is None:  # (not setdefault: that builds a StepTimes every step)
            times = self.seconds[key] = StepTimes()
        times.add(seconds, self.num_steps)

    def observe_rewind_step(self, num_requests: int, seconds: float) -> None:
        """A step that restored rewound requests (its chunks of mixed lengths)."""
        self.rewind_steps.setdefault(num_requests, StepTimes()).add(seconds, self.num_steps)

    def observe_verify(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """The request verified `num_drafts` real drafts and accepted the first
        `num_accepted`: drafts 1 .. num_accepted + 1 were reached, the last one rejected."""
        for j in range(min(num_drafts, num_accepted + 1, self.max_drafts)):
            accepted = 1.0 if j < num_accepted else 0.0
            self.positions[j].add(accepted)
            if j == 0:
                self.firsts.setdefault(request_id, MovingMean(REQUEST_WINDOW)).add(accepted)

    def observe_plain(self, request_id: str, first_draft_right: bool) -> None:
        """The request ran without its drafts; its sampled token tells about its first."""
        sample = 1.0 if first_draft_right else 0.0
        self.positions[0].add(sample)
        self.firsts.setdefault(request_id, MovingMean(REQUEST_WINDOW)).add(sample)

    def forget(self, request_id: str) -> None:
        self.firsts.pop(request_id, None)

    def first_rate(self, request_id: str) -> float:
        """b_i: the request's own first-draft rate leaning on a_1 (a rate without
        observations reads as 1.0: drafting is tried first)."""
        first = self.positions[0]
        prior = first.value if first.count else 1.0
        own = self.firsts.get(request_id)
        if own is None or not own.count:
            return prior
        weight = min(own.count, own.window)
        return (own.value * weight + prior * PRIOR_WEIGHT) / (weight + PRIOR_WEIGHT)

    def _tail(self) -> list[float]:
        """tail[j] = a_2 ... a_{j+1} (tail[0] = 1): P(drafts 1 .. j + 1 accepted) / b_i."""
        tail = [1.0]
        for m in self.positions[1:]:
            tail.append(tail[-1] * (m.value if m.count else 1.0))
        return tail

    def chain(self, request_id: str) -> list[float]:
        """chain[j]: the chance that the request's drafts 1 .. j are all accepted (chain[0] =
        1)."""
        b = self.first_rate(request_id)
        return [1.0] + [b * t for t in self._tail()]

    # -- expectations --------------------------------------------------------------------------
    # With tail sums S[m] = tail[0] + ... + tail[m - 1], a request with m drafts expects
    # 1 + b_i S[m] tokens (the target's + the accepted drafts) and keeps them all (no rewind)
    # with chance b_i tail[m - 1] (1 for m = 0).

    def expected_tokens(self, candidates: Sequence[Candidate], tokens_each: int) -> float:
        firsts = [self.first_rate(c.request_id) for c in candidates]
        return self._gain(candidates, firsts, _prefix_sums(self._tail()), tokens_each)

    @staticmethod
    def _gain(
        candidates: Sequence[Candidate], firsts: list[float], sums: list[float], q: int
    ) -> float:
        total = 0.0
        for c, b in zip(candidates, firsts, strict=True):
            total += 1.0 + b * sums[max(0, min(c.drafts, c.cap, q - c.known))]
        return total

    def rewind_chance(self, candidates: Sequence[Candidate], tokens_each: int) -> float:
        firsts = [self.first_rate(c.request_id) for c in candidates]
        return self._rewind_chance(candidates, firsts, self._tail(), tokens_each)

    @staticmethod
    def _rewind_chance(
        candidates: Sequence[Candidate], firsts: list[float], tail: list[float], q: int
    ) -> float:
        """The chance that some request of the step rewinds (state layers only): one with a
        draft, real or filler, that is rejected (a filler is, but for chance)."""
        none = 1.0
        for c, b in zip(candidates, firsts, strict=True):
            m = max(0, min(c.cap, q - c.known))  # drafts, fillers included
            if m > min(c.drafts, m):
                return 1.0  # a filler
            if m:
                none *= b * tail[m - 1]
        return 1.0 - none

    # -- step times ----------------------------------------------------------------------------

    def _step_seconds(self, n: int, q: int) -> float | None:
        """Measured seconds of shape (n, q); unmeasured, predicted from the measured shapes
        (module docstring); None: nothing measured at or below it at batch size n."""
        below = next((size for size in range(q, 0, -1) if self._trusted(n, size)), None)
        if below is None:
            return None
        seconds = self.seconds[(n, below)].value
        if below == q:
            return seconds
        last_row = 0.0  # what the largest measured size's last token per request cost
        if below > 1 and self._trusted(n, below - 1):
            last_row = max(0.0, seconds - self.seconds[(n, below - 1)].value)
        return max(seconds + (q - below) * last_row, self._scaled_from_other_sizes(n, q))

    def _scaled_from_other_sizes(self, n: int, q: int) -> float:
        """t(n, 1) * t(n', q) / t(n', 1) at the nearest batch size n' where both are measured
        (0.0: none, or t(n, 1) unmeasured)."""
        if not self._trusted(n, 1):
            return 0.0
        others = [m for (m, size) in self.seconds if size == q and m != n]
        others = [m for m in others if self._trusted(m, q) and self._trusted(m, 1)]
        if not others:
            return 0.0
        m = min(others, key=lambda m: (abs(m - n), m))
        ratio = self.seconds[(m, q)].value / max(self.seconds[(m, 1)].value, 1e-12)
        return self.seconds[(n, 1)].value * ratio

    def _trusted(self, n: int, q: int) -> bool:
        times = self.seconds.get((n, q))
        return times is not None and times.count >= MIN_SAMPLES

    def _rewind_seconds(self, n: int) -> float:
        """What a step with rewinds takes beyond a plain step at batch n (module docstring)."""
        plain = self._step_seconds(n, 1) or 0.0
        times = self.rewind_steps.get(n)
        if times is None or times.count < MIN_SAMPLES:
            return plain
        return max(0.0, times.value - plain)

    def _last_step(self, n: int, q: int) -> int:
        times = self.seconds.get((n, q))
        return -1 if times is None else times.last_step

    # -- the choice ----------------------------------------------------------------------------

    def worth_proposing(self, candidates: Sequence[Candidate]) -> bool:
        """Called once per step before drafts are made: False when drafts for every row up to
        its cap would not beat the smallest shape at the acceptance expected, on the shapes
        measured so far (nor is a probe due), so the proposer's work is skipped too. Every
        LEARN_EVERY steps drafts are made anyway: a request that then runs without them still
        shows by its sampled token whether its first was right (`observe_plain`), unless not
        even drafts that are always right could pay (`_right_drafts_could_pay`)."""
        self.num_steps += 1
        if self.num_steps % LEARN_EVERY == 0:  # learn, unless not even right drafts could pay
            return self._right_drafts_could_pay(candidates)
        if self._probing():
            return True
        # the answer for this batch size stands for LEARN_EVERY steps (it changes slowly)
        low = max(c.known for c in candidates)
        key = (len(candidates), low)
        cached = self._worth.get(key)
        if cached is not None and self.num_steps - cached[1] < LEARN_EVERY:
            return cached[0]
        upper = [Candidate(c.request_id, c.known, c.cap, c.cap) for c in candidates]
        worth = self.choose(upper, measured_only=True) != low
        self._worth[key] = (worth, self.num_steps)
        return worth

    def _right_drafts_could_pay(self, candidates: Sequence[Candidate]) -> bool:
        """Whether drafts that are always right, up to every cap, could beat the smallest shape
        on the step times measured or predicted (`_step_seconds`; True while unknown). Where
        not (a CPU at batch 8: verify rows cost what decode rows do), learning how often drafts
        are right cannot change the answer, and the proposer's learning steps are skipped."""
        n = len(candidates)
        low = max(c.known for c in candidates)
        base = self._step_seconds(n, low)
        if base is None:
            return True

        def tokens(q: int) -> int:  # every draft accepted, the bonus token included
            return sum(1 + max(0, min(c.cap, q - c.known)) for c in candidates)

        rate = tokens(low) / base
        for q in range(low + 1, max(c.known + c.cap for c in candidates) + 1):
            seconds = self._step_seconds(n, q)
            if seconds is None or tokens(q) / seconds > rate:
                return True
        return False

    def choose(self, candidates: Sequence[Candidate], measured_only: bool = False) -> int:
        """Tokens per chunk for this step: max known .. max(known + cap); the smallest when
        no request was offered a draft (a plain decode step). `measured_only`: shapes not
        measured yet are not options (no exploring)."""
        low = max(c.known for c in candidates)
        high = max(c.known + c.cap for c in candidates)
        if high <= low or not any(c.drafts for c in candidates):
            return low
        n = len(candidates)
        options = range(low, high + 1)
        firsts = [self.first_rate(c.request_id) for c in candidates]
        tail = self._tail()
        sums = _prefix_sums(tail)
        rewind = self._rewind_seconds(n) if self.rewinds else 0.0
        best, best_rate, previous = low, -1.0, -1.0
        for q in options:
            gain = self._gain(candidates, firsts, sums, q)
            if gain <= previous:
                continue  # no more tokens than q - 1 would give
            previous = gain
            trusted = self._trusted(n, q)
            if measured_only and not trusted:
                continue
            seconds = self._step_seconds(n, q)
            if seconds is None:
                return q  # nothing measured at or below it: measure it
            if rewind:
                seconds += self._rewind_chance(candidates, firsts, tail, q) * rewind
            if gain / seconds > best_rate:
                best, best_rate = q, gain / seconds
            if not trusted and not measured_only:
                break  # sizes are explored one at a time, upwards
        if self._probing() and not measured_only:
            # the choice's neighbours, the one measured longest ago: measured again
            near = [q for q in (best - 1, best + 1) if q in options]
            return min(near, key=lambda q: self._last_step(n, q), default=best)
        return best  # if unmeasured, its prediction won: running it measures it

    def _probing(self, step: int | None = None) -> bool:
        every, step = self.probe_every, self.num_steps if step is None else step
        return every > 0 and step > 0 and step % every == 0

    def skips(self, num_requests: int, low: int) -> bool:
        """Called once per step before the scheduler forms the candidates (their caps cost a
        pass over the requests): True when this step is neither a learning nor a probing one
        and `worth_proposing`'s answer for this batch size and `low` (the most tokens a request
        computes anyway), decided within LEARN_EVERY steps, was no. The step then counts, as
        `worth_proposing`'s call would have counted it; on False nothing changes."""
        step = self.num_steps + 1
        if step % LEARN_EVERY == 0 or self._probing(step):
            return False
        cached = self._worth.get((num_requests, low))
        if cached is None or cached[0] or step - cached[1] >= LEARN_EVERY:
            return False
        self.num_steps = step
        return True


def _prefix_sums(values: list[float]) -> list[float]:
    """[0, v0, v0 + v1, ...]"""
    out, acc = [0.0], 0.0
    for v in values:
        acc += v
        out.append(acc)
    return out
