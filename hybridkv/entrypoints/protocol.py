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


# Fields of the OpenAI schemas (and vLLM's extensions) that hybridkv does not honour: a
# request that sets one to anything but the listed neutral values gets a 400 naming it.
# Any other field that no schema here declares is ignored (README: "Request fields").
_REFUSED_BOTH: dict[str, tuple[tuple[Any, ...], str]] = {
    "use_beam_search": ((False,), "beam search is not implemented"),
    "length_penalty": ((1, 1.0), "length_penalty applies to beam search, not implemented"),
    "bad_words": (([],), "bad_words is not implemented; use logit_bias"),
    "allowed_token_ids": ((), "allowed_token_ids is not implemented; use logit_bias"),
    "logits_processors": (([],), "custom logits processors are not supported"),
    "priority": ((0,), "priority scheduling is not implemented"),
    "skip_special_tokens": ((True,), "special tokens are always skipped in output text"),
    "spaces_between_special_tokens": ((True,), "not configurable here"),
    "guided_whitespace_pattern": ((), "not configurable here"),
    "kv_transfer_params": ((), "disaggregated prefill is not implemented"),
    "vllm_xargs": ((), "not supported"),
    "mm_processor_kwargs": ((), "multimodal inputs are not supported"),
    "prompt_embeds": ((), "prompt embeddings are not supported"),
    "logprobs_mode": ((), "log-probs are always those of the raw distribution"),
}
_REFUSED_COMPLETION = {
    **_REFUSED_BOTH,
    "suffix": (("",), "suffix (fill-in-the-middle) is not supported"),
    "add_special_tokens": ((True,), "prompts are always tokenized with special tokens"),
}
_REFUSED_CHAT = {
    **_REFUSED_BOTH,
    "audio": ((), "audio output is not supported"),
    "modalities": ((["text"],), "only the text modality is supported"),
    "prediction": ((), "predicted outputs are not supported"),
    "reasoning_effort": ((), "reasoning effort is not configurable; see chat_template_kwargs"),
    "verbosity": ((), "verbosity is not configurable"),
    "web_search_options": ((), "built-in web search is not available"),
    "functions": ((), "the deprecated `functions` is not supported: use `tools`"),
    "function_call": ((), "the deprecated `function_call` is not supported: use `tool_choice`"),
    "store": ((False,), "this server stores nothing"),
    "service_tier": (("auto", "default"), "there is one service tier"),
    "echo": ((False,), "echo is not supported on chat completions"),
    "continue_final_message": ((False,), "continue_final_message is not implemented"),
    "add_special_tokens": ((False,), "chat prompts are tokenized without added special tokens"),
    "documents": ((), "documents (RAG templates) are not supported"),
}


def refused_fields(extra: dict[str, Any] | None, refused: dict[str, tuple[tuple, str]]) -> None:
    """400 for the first field of `refused` set to a value other than its neutral ones (null
    always passes)."""
    for name, value in (extra or {}).items():
        rule = refused.get(name)
        if rule is None or value is None:
            continue
        neutral, why = rule
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise OpenAIError(f"'{name}' is not supported ({why})", param=name)


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_decoding_backend: str | None = None
    cache_salt: str | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False
    request_id: str | None = None


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
    best_of: int | None = None
    prompt_logprobs: int | None = None

    def refuse_unsupported(self) -> None:
        refused_fields(self.model_extra, _REFUSED_COMPLETION)


class ChatMessage(BaseModel):
    """One chat message. Keys no field here declares are refused when set (a 400 naming
    messages.<k>.<key>), except output metadata a client echoes back from a response
    (`annotations`, `refusal`: they say nothing to the model); null always passes."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # assistant
    tool_call_id: str | None = None  # tool
    reasoning_content: str | None = None  # assistant (an extension: earlier reasoning)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    metadata: dict[str, Any] | None = None  # kept by OpenAI for stored completions: unused here
    prompt_cache_key: str | None = None  # a routing hint: the prefix cache needs none
    safety_identifier: str | None = None
    # vLLM's extensions
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True

    def refuse_unsupported(self) -> None:
        refused_fields(self.model_extra, _REFUSED_CHAT)


ECHOED_MESSAGE_KEYS = frozenset({"annotations", "refusal"})


def refuse_message_extras(message: ChatMessage, index: int) -> None:
    for key, value in (message.model_extra or {}).items():
        if value is not None and key not in ECHOED_MESSAGE_KEYS:
            raise OpenAIError(
                f"'{key}' is not supported in chat messages",
                param=f"messages.{index}.{key}",
            )


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


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a completion prompt, or chat messages rendered by the template."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    tokens: list[int]
