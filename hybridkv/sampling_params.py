"""Sampling parameters of one request (validated before the request enters the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy. `top_k` <= 0 and `top_p` = 1 disable those filters. `seed` makes a
    request's sampling reproducible whatever else is in the batch. `logprobs` = n returns the
    log-probabilities of the chosen token and of the top n tokens at every step.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_int("max_tokens", self.max_tokens, 1)
        self._check_int("min_tokens", self.min_tokens, 0)
        self._check_int("top_k", self.top_k, None)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not isinstance(self.temperature, int | float) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, int | float) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            self._check_int("seed", self.seed, 0)
        if self.logprobs is not None:
            self._check_int("logprobs", self.logprobs, 0)
            if self.logprobs > 20:
                raise ValueError(f"logprobs must be at most 20, got {self.logprobs}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)!r}"
            )

    @staticmethod
    def _check_int(name: str, value: object, minimum: int | None) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if minimum is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
