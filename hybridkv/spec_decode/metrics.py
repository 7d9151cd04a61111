"""Counters of speculative decoding: drafts proposed and accepted, per position.

One observation is one request in one verify step that carried at least one draft (a request
decoding without drafts in that step is not counted: it neither proposed nor rejected anything):
`observe(num_drafts, num_accepted)`. Derived numbers:

    acceptance rate             accepted / proposed draft tokens
    acceptance rate at i        accepted at position i / proposed at position i (i = 0 .. k-1;
                                position i is accepted only if 0 .. i-1 were)
    mean accepted length        1 + accepted / verify steps: tokens a verify step yields per
                                request (its accepted drafts plus the corrected or bonus token)

The names follow vLLM's (`vllm:spec_decode_num_drafts`, `..._num_draft_tokens`,
`..._num_accepted_tokens`, `..._num_accepted_tokens_per_pos{position}`) under `prefix`;
`metric_families` gives prometheus_client families that a collector yields as they are (what
`hybridkv.entrypoints.metrics` does with the engine's stats), `render_prometheus` the text
exposition of them alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


def _ints(values: Sequence[int] | torch.Tensor) -> list[int]:
    return values.tolist() if isinstance(values, torch.Tensor) else [int(v) for v in values]


@dataclass
class SpecDecodeStats:
    """Running totals (mutable; `merge` returns a new one). `num_speculative_tokens` is k, the
    length of the per-position lists (grown when a wider observation or merge arrives)."""

    num_speculative_tokens: int = 0
    num_drafts: int = 0  # verify steps x requests with at least one draft
    num_draft_tokens: int = 0  # drafts proposed
    num_accepted_tokens: int = 0  # drafts accepted
    draft_tokens_per_pos: list[int] = field(default_factory=list)  # [k] proposed at position i
    accepted_tokens_per_pos: list[int] = field(default_factory=list)  # [k] accepted at i

    def __post_init__(self) -> None:
        self._widen(self.num_speculative_tokens)

    def _widen(self, k: int) -> None:
        k = max(k, self.num_speculative_tokens, len(self.draft_tokens_per_pos))
        self.num_speculative_tokens = k
        for counts in (self.draft_tokens_per_pos, self.accepted_tokens_per_pos):
            counts.extend([0] * (k - len(counts)))

    # -- recording -----------------------------------------------------------------------------

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify step: it proposed `num_drafts`, the first `num_accepted` of them
        were accepted (0 <= num_accepted <= num_drafts). No drafts: nothing is counted."""
        if num_accepted < 0 or num_accepted > num_drafts:
            raise ValueError(f"accepted {num_accepted} of {num_drafts} drafts")
        if num_drafts == 0:
            return
        self._widen(num_drafts)
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for i in range(num_drafts):
            self.draft_tokens_per_pos[i] += 1
        for i in range(num_accepted):
            self.accepted_tokens_per_pos[i] += 1

    def observe_batch(
        self, num_drafts: Sequence[int] | torch.Tensor, num_accepted: Sequence[int] | torch.Tensor
    ) -> None:
        """A verify step of many requests ([n] each; e.g. a `VerifyResult.num_accepted`)."""
        drafts, accepted = _ints(num_drafts), _ints(num_accepted)
        if len(drafts) != len(accepted):
            raise ValueError(f"{len(drafts)} draft counts for {len(accepted)} accepted counts")
        for d, a in zip(drafts, accepted, strict=True):
            self.observe(d, a)

    def merge(self, other: SpecDecodeStats) -> SpecDecodeStats:
        """The totals of both (e.g. of two engines, or of two intervals)."""
        k = max(self.num_speculative_tokens, other.num_speculative_tokens)
        a, b = self.copy(), other.copy()
        a._widen(k)
        b._widen(k)
        return SpecDecodeStats(
            k,
            a.num_drafts + b.num_drafts,
            a.num_draft_tokens + b.num_draft_tokens,
            a.num_accepted_tokens + b.num_accepted_tokens,
            [x + y for x, y in zip(a.draft_tokens_per_pos, b.draft_tokens_per_pos, strict=True)],
            [
                x + y
                for x, y in zip(a.accepted_tokens_per_pos, b.accepted_tokens_per_pos, strict=True)
            ],
        )

    __add__ = merge

    def copy(self) -> SpecDecodeStats:
        """A snapshot (the engine thread keeps counting; readers take copies)."""
        return SpecDecodeStats(
            self.num_speculative_tokens,
            self.num_drafts,
            self.num_draft_tokens,
            self.num_accepted_tokens,
            list(self.draft_tokens_per_pos),
            list(self.accepted_tokens_per_pos),
        )

    # -- derived -------------------------------------------------------------------------------

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """[k]: accepted / proposed at each draft position (0 where none was proposed)."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_tokens_per_pos, self.draft_tokens_per_pos, strict=True)
        ]

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step and request: 1 + accepted drafts per step (1 before any)."""
        return 1.0 + (self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0)

    def as_dict(self) -> dict[str, int | float | list[int] | list[float]]:
        """Plain values, for the engine's stats snapshot and `hybridkv bench --json`."""
        return {
            "num_speculative_tokens": self.num_speculative_tokens,
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "draft_tokens_per_pos": list(self.draft_tokens_per_pos),
            "accepted_tokens_per_pos": list(self.accepted_tokens_per_pos),
            "acceptance_rate": self.acceptance_rate,
            "acceptance_rate_per_pos": self.acceptance_rate_per_pos,
            "mean_accepted_length": self.mean_accepted_length,
        }

    def summary(self) -> str:
        """One line for `hybridkv bench` and the log."""
        per_pos = " ".join(f"{r:.2f}" for r in self.acceptance_rate_per_pos)
        return (
            f"speculative: {self.num_drafts} verify steps, {self.num_draft_tokens} drafts, "
            f"{self.num_accepted_tokens} accepted ({100 * self.acceptance_rate:.1f}%), "
            f"mean accepted length {self.mean_accepted_length:.2f}, per position [{per_pos}]"
        )

    # -- Prometheus ----------------------------------------------------------------------------

    def metric_families(self, prefix: str = "hybridkv") -> list[Metric]:
        """Counters (exposed with a `_total` suffix) and two derived gauges."""
        p = f"{prefix}_spec_decode"
        out: list[Metric] = [
            CounterMetricFamily(
                f"{p}_num_drafts", "Verify steps x requests with drafts", value=self.num_drafts
            ),
            CounterMetricFamily(
                f"{p}_num_draft_tokens", "Draft tokens proposed", value=self.num_draft_tokens
            ),
            CounterMetricFamily(
                f"{p}_num_accepted_tokens", "Draft tokens accepted", value=self.num_accepted_tokens
            ),
        ]
        for name, counts, doc in (
            ("num_draft_tokens_per_pos", self.draft_tokens_per_pos, "Drafts proposed, by position"),
            (
                "num_accepted_tokens_per_pos",
                self.accepted_tokens_per_pos,
                "Drafts accepted, by position",
            ),
        ):
            family = CounterMetricFamily(f"{p}_{name}", doc, labels=["position"])
            for i, c in enumerate(counts):
                family.add_metric([str(i)], c)
            out.append(family)
        out.append(
            GaugeMetricFamily(
                f"{p}_acceptance_rate",
                "Accepted / proposed draft tokens",
                value=self.acceptance_rate,
            )
        )
        out.append(
            GaugeMetricFamily(
                f"{p}_mean_accepted_length",
                "Tokens per verify step and request (accepted + 1)",
                value=self.mean_accepted_length,
            )
        )
        return out

    def render_prometheus(self, prefix: str = "hybridkv") -> str:
        """The text exposition of `metric_families` alone."""
        registry = CollectorRegistry()
        registry.register(_Families(self.metric_families(prefix)))
        return generate_latest(registry).decode()


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
