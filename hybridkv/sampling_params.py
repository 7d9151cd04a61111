"""Sampling parameters of one request (validated before the request enters the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGPROBS = 20


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_unicode(text: str, name: str) -> None:
    """A one-line ValueError for text the tokenizer cannot take (a lone UTF-16 surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} is not valid Unicode: {text[exc.start : exc.end]!r} at character "
            f"{exc.start} is a lone surrogate"
        ) from None


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
        if not isinstance(self.stop, list | tuple) or not isinstance(
            self.stop_token_ids, list | tuple
        ):
            raise ValueError(
                f"stop and stop_token_ids must be lists, got {self.stop!r}, "
                f"{self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # Every integer within what the engine's tensors and generators hold (int64 / uint64).
        self._check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        self._check_int("min_tokens", self.min_tokens, 0, MAX_TOKENS)
        self._check_int("top_k", self.top_k, -1, MAX_TOKENS)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        if not _is_number(self.temperature) or not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be a number in [0, 100], got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            self._check_int("seed", self.seed, 0, MAX_SEED)
        if self.logprobs is not None:
            self._check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {list(self.stop)!r}")
        for text in self.stop:
            check_unicode(text, "stop")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= MAX_TOKEN_ID
            for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be integers in [0, {MAX_TOKEN_ID}], got "
                f"{list(self.stop_token_ids)!r}"
            )

    @staticmethod
    def _check_int(name: str, value: object, minimum: int, maximum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if not minimum <= value <= maximum:
            raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
