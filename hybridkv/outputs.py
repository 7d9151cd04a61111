"""What `LLM.generate` returns (vLLM-shaped: `.outputs[0]`, with shortcuts on the request)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" (see RequestOutput.error) or None
    stop_reason: int | str | None = None  # the eos / stop token id or the stop string
    logprobs: list[dict[int, float]] | None = None  # per token: chosen + top-n log-probs
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # set when the engine gave up on this request alone (one line)
    # SamplingParams.prompt_logprobs: per prompt token, None for the first, then the prompt
    # token's log-prob and the top-n (vLLM's shape); set once the whole prompt is computed
    prompt_logprobs: list[dict[int, float] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        return self.outputs[0].logprobs
