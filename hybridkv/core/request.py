"""A request as the scheduler and the cache manager see it."""

from __future__ import annotations

import enum
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from hybridkv.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()
    extra_keys: tuple[Hashable, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    prompt_text: str | None = None  # the prompt as given, when it was text
    stream: bool = False  # report every step it advances, not only when it finishes

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None  # "stop", "length" or "abort"
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prefix-cache hit at the last admission
        self.first_token_time: float | None = None
        self.token_times: list[float] = []
        self.logprobs: list[dict] = []
        self.stop_text: str | None = None  # the output text cut at a matched stop string
        self.error: str | None = None  # why the engine gave up on it (finish_reason "abort")
        # sampling state, owned by the engine (kept across preemptions)
        self.generator: Any = None  # torch.Generator of a seeded request, made at its 1st sample
        self.matcher: Any = None  # grammar matcher (structured outputs)
        self.prompt_logprobs: list[dict[int, float]] = []  # for prompt tokens 1, 2, ...
        # speculative decoding with MTP layers: the pairs of the request's last chunk whose
        # next token is confirmed, (first position, the token after each), which the runner's
        # MTP layers take in the request's next step (None: nothing pending)
        self.mtp_pending: tuple[int, tuple[int, ...]] | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def max_computed_tokens(self) -> int:
        """The most tokens this request can compute: the last sampled token is never fed."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
