"""Sampling parameters of one request (validated before the request enters the engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MAX_SEED = 2**64 - 1  # what torch.Generator.manual_seed takes
MAX_TOKENS = 2**31 - 1
MAX_TOKEN_ID = 2**31 - 1
MAX_LOGPROBS = 20
MAX_CHOICES = 32  # n (and the server's best_of)


def choice_seed(seed: int | None, k: int) -> int | None:
    """Choice k's seed of an n > 1 request: seed + k (mod 2**64), so n seeded choices differ
    and repeat (an invalid seed is passed on for SamplingParams to refuse, naming it)."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        return seed
    return (seed + k) % (MAX_SEED + 1)


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
    log-probabilities of the chosen token and of the top n tokens at every step;
    `prompt_logprobs` = n those of every prompt token after the first (such a request computes
    its whole prompt: it skips the prefix cache for itself, and still fills it for others).

    Logits processing, in this order (as vLLM): `logit_bias` (token id -> added to its logit,
    in [-100, 100]); `repetition_penalty` (> 1 discourages every token of the prompt and the
    output: positive logits divided by it, negative ones multiplied); `frequency_penalty` and
    `presence_penalty` (in [-2, 2], OpenAI's: subtracted per occurrence / once per token of the
    output); the grammar of `structured` (a `hybridkv.structured.GrammarSpec`: only tokens
    that keep the output valid); then temperature, `min_p` (drop tokens less likely than
    min_p times the most likely one), top_k and top_p. Log-probs are those of the model's raw
    distribution, before any of these.
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
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias); a dict is converted
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    structured: Any = None  # hybridkv.structured.GrammarSpec
    # choices per prompt (vLLM's n): `LLM.generate` runs them as n engine requests, the first's
    # prefill shared through the prefix cache, choice k seeded seed + k; the engine takes n = 1
    n: int = 1
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
        self._check_processing()
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        # Every integer within what the engine's tensors and generators hold (int64 / uint64).
        self._check_int("max_tokens", self.max_tokens, 1, MAX_TOKENS)
        self._check_int("min_tokens", self.min_tokens, 0, MAX_TOKENS)
        self._check_int("top_k", self.top_k, -1, MAX_TOKENS)
        self._check_int("n", self.n, 1, MAX_CHOICES)
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

    def _check_processing(self) -> None:
        """The logits-processing fields (logit_bias as a dict becomes sorted pairs)."""
        bias = self.logit_bias
        if isinstance(bias, dict):
            bias = tuple(sorted(bias.items()))
        if not isinstance(bias, list | tuple) or not all(
            isinstance(p, list | tuple) and len(p) == 2 for p in bias
        ):
            raise ValueError(f"logit_bias must map token ids to numbers, got {bias!r}")
        for token, value in bias:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {token!r}")
            if not _is_number(value) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {value!r}")
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in bias))
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be a number in [-2, 2], got {value!r}")
        rp = self.repetition_penalty
        if not _is_number(rp) or not 0 < rp <= 100:
            raise ValueError(f"repetition_penalty must be a number in (0, 100], got {rp!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty) or (
            self.repetition_penalty != 1.0
        )

    @property
    def processes_logits(self) -> bool:
        """Anything between the raw logits and temperature (bias, penalties, a grammar)."""
        return bool(self.logit_bias) or self.has_penalties or self.structured is not None

    @staticmethod
    def _check_int(name: str, value: object, minimum: int, maximum: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
        if not minimum <= value <= maximum:
            raise ValueError(f"{name} must be in [{minimum}, {maximum}], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
