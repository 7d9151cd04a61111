"""OpenAI-compatible request bodies and the error shape (pydantic, strict types)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIError(Exception):
    """A request error answered as {"error": {...}} with an HTTP 4xx status."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.kind = (
            message,
            status,
            param,
            code,
            kind,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False  # extension
    min_tokens: int = 0  # extension
    stop_token_ids: list[int] | None = None  # extension
    user: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def message_text(message: ChatMessage) -> str:
    """The text of a chat message (content parts of type "text" are joined)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for part in message.content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError("only text content parts are supported", param="messages")
        parts.append(part["text"])
    return "".join(parts)
