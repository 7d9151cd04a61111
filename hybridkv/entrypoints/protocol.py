"""OpenAI-compatible request bodies and the error shape (pydantic, strict types)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag


def one_line(text: str, limit: int = 2000) -> str:
    """Text safe to put in an error body: one line, at most `limit` characters, lone
    surrogates (which cannot be encoded as UTF-8) written as backslash escapes."""
    text = " ".join(str(text).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class OpenAIError(Exception):
    """A request error answered as {"error": {"message", "type", "param", "code"}} (OpenAI's
    shape) with an HTTP 4xx status, or a 5xx with type "server_error". `param` names the field
    to blame as a path, e.g. "messages.0.content" or "max_tokens"."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        kind: str | None = None,
    ) -> None:
        message = one_line(message)
        super().__init__(message)
        self.message, self.status, self.code = message, status, code
        self.param = one_line(param, 200) if param is not None else None
        self.kind = kind or ("server_error" if status >= 500 else "invalid_request_error")

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


def _prompt_kind(value: Any) -> str | None:
    """Which form a prompt has, read from its first element: only that form is validated
    (pydantic's default would try every form, and a list of a million token ids checked as
    strings first holds the GIL for a third of a second)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else 0
        return (
            "texts" if isinstance(first, str) else "id_lists" if isinstance(first, list) else "ids"
        )
    return None


Prompt = Annotated[
    Annotated[str, Tag("text")]
    | Annotated[list[str], Tag("texts")]
    | Annotated[list[int], Tag("ids")]
    | Annotated[list[list[int]], Tag("id_lists")],
    Discriminator(
        _prompt_kind,
        custom_error_type="prompt_type",
        custom_error_message="Input should be a string, a list of strings, a list of token ids "
        "or a list of lists of token ids",
    ),
]


class CompletionRequest(_Request):
    prompt: Prompt
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


def message_text(message: ChatMessage, index: int = 0) -> str:
    """The text of chat message number `index` (content parts of type "text" are joined)."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for k, part in enumerate(message.content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise OpenAIError(
                'only text content parts ({"type": "text", "text": "..."}) are supported',
                param=f"messages.{index}.content.{k}",
            )
        parts.append(part["text"])
    return "".join(parts)
