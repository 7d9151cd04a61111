"""OpenAI Responses (`POST /v1/responses`) and Anthropic Messages (`POST /v1/messages`) as thin
adapters over chat completions: pure conversions of request bodies, response objects and
stream chunks (dicts in, dicts out). The server validates the converted chat body as usual.

Every request field is either honoured, accepted because it cannot change the output here
(listed as "accepted, no effect"), or refused with a 400 naming it (`OpenAIError.param`). A
refused field set to null, or to its neutral value in brackets, passes. Unknown fields are
refused too.

Responses API (`responses_to_chat`, `chat_to_response`, `chat_stream_to_response_events`):

    honoured   model; input (a string, or items: message {role user|system|developer|
               assistant, content a string or input_text/output_text parts}, function_call
               {call_id, name, arguments}, function_call_output {call_id, output a string or
               input_text parts}, reasoning {content reasoning_text parts} -> the next
               assistant message's reasoning_content); instructions (a system message first);
               max_output_tokens (-> max_completion_tokens); temperature; top_p; stream
               (chat chunks with usage); tools of type "function" {name, description,
               parameters, strict}; tool_choice none|auto|required|{type: function, name};
               parallel_tool_calls; text.format text|json_object|json_schema {name, schema,
               strict, description} (-> response_format); user; safety_identifier;
               prompt_cache_key
    no effect  metadata (echoed, not kept); store (nothing is ever stored, true or false);
               max_tool_calls (limits built-in tools, and there are none); stream_options
               {include_obfuscation: false}; reasoning {} or with null effort/summary
               (whether the model reasons is up to its chat template: reasoning it produces
               comes back as a reasoning item with reasoning_text content)
    refused    previous_response_id, conversation (nothing is stored); background [false],
               background_options; include [[]]; truncation ["disabled"]; top_logprobs;
               prompt; context_management; moderation; image; access_programs;
               prompt_cache_options; prompt_cache_retention ["in_memory"]; service_tier
               ["auto", "default"]; reasoning.effort / summary / other keys; text.verbosity;
               stream_options.include_obfuscation true; tools of any other type (web_search,
               file_search, mcp, custom, ...) and function tools' defer_loading,
               allowed_callers, output_schema, async, namespace; tool_choice allowed_tools and
               hosted-tool choices; input items other than the above (item_reference,
               images, files, audio, refusals, computer/shell/MCP calls, ...); a reasoning
               item's encrypted_content

Anthropic Messages API (`messages_to_chat`, `chat_to_message`, `chat_stream_to_message_events`,
`anthropic_error`):

    honoured   model; messages (user: text, tool_result {tool_use_id, content a string or
               text blocks, is_error}; assistant: text, tool_use {id, name, input}, thinking
               (-> reasoning_content)); max_tokens (required); system (a string or text
               blocks); stop_sequences (-> stop); temperature; top_p; top_k; tools (custom
               tools {name, description, input_schema, strict}); tool_choice auto|any|tool|
               none and disable_parallel_tool_use (-> parallel_tool_calls); stream;
               metadata.user_id (-> user); output_config.format {type: json_schema, schema}
               (-> response_format)
    no effect  cache_control, top-level and on blocks (the prefix cache is automatic);
               thinking {type: adaptive} (the model's chat template decides whether it thinks;
               reasoning comes back as thinking blocks with an empty signature); a text
               block's citations [null]
    refused    thinking enabled (budget_tokens cannot be honoured) or disabled (cannot be
               promised); output_config.effort; container; diagnostics; inference_geo; speed
               ["standard"]; service_tier ["auto", "standard_only"]; user_profile_id;
               workspace_id; mcp_servers; context_management; a final assistant message
               (prefill); image, document, search_result, redacted_thinking and server-tool
               blocks; server tools (bash, text_editor, web_search, ...) and custom tools'
               defer_loading, input_examples, eager_input_streaming, allowed_callers

A tool_result with is_error true becomes a tool message whose text starts with "Error: ".
Anthropic's usage counts cached prompt tokens apart: input_tokens = prompt_tokens -
cached_tokens and cache_read_input_tokens = cached_tokens. A tool call whose arguments are not
a JSON object becomes tool_use input {"arguments": <the text>} (non-streaming; streamed
fragments pass through as they are).

What the chat side may provide: `reasoning_content` in messages/deltas (reasoning items,
thinking blocks); `usage.prompt_tokens_details.cached_tokens`; and, in a choice (the message's
or the final chunk's), `stop_reason`: the matched stop string (-> Anthropic stop_reason
"stop_sequence" and stop_sequence) or token id. Without it a stop string reads as "end_turn".
"""

from __future__ import annotations

import copy
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable
from typing import Any

from hybridkv.entrypoints.protocol import OpenAIError

Json = dict[str, Any]
# field -> (neutral values that pass, why it is refused)
Refusals = dict[str, tuple[tuple[Any, ...], str]]

_NOT_STORED = "nothing is stored here: send the whole conversation in `input`"
_RESPONSES_REFUSED: Refusals = {
    "previous_response_id": ((), _NOT_STORED),
    "conversation": ((), _NOT_STORED),
    "background": ((False,), "background responses are not supported"),
    "background_options": ((), "background responses are not supported"),
    "include": (([],), "no additional output data is available"),
    "truncation": (("disabled",), "inputs are never truncated (a prompt too long is a 400)"),
    "top_logprobs": ((), "log-probs are not available here: use /v1/chat/completions"),
    "prompt": ((), "stored prompt templates are not supported"),
    "context_management": ((), "context management is not supported"),
    "moderation": ((), "moderation is not available"),
    "image": ((), "image generation is not available"),
    "access_programs": ((), "access programs are not supported"),
    "prompt_cache_options": ((), "the prefix cache is automatic and not configurable"),
    "prompt_cache_retention": (("in_memory",), "cached prefixes live in memory only"),
    "service_tier": (("auto", "default"), "there is one service tier"),
}
# fmt: off
_RESPONSES_FIELDS = {
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream",
    "tools", "tool_choice", "parallel_tool_calls", "text", "user", "safety_identifier",
    "prompt_cache_key", "metadata", "store", "max_tool_calls", "stream_options", "reasoning",
}
# fmt: on
_MESSAGES_REFUSED: Refusals = {
    "container": ((), "code-execution containers are not available"),
    "diagnostics": ((), "cache diagnostics are not available"),
    "inference_geo": ((), "there is one inference location"),
    "speed": (("standard",), "there is one inference speed"),
    "service_tier": (("auto", "standard_only"), "there is one service tier"),
    "user_profile_id": ((), "user profiles are not supported"),
    "workspace_id": ((), "workspaces are not supported"),
    "mcp_servers": ((), "MCP connectors are not available"),
    "context_management": ((), "context management is not supported"),
}
# fmt: off
_MESSAGES_FIELDS = {
    "model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p",
    "top_k", "tools", "tool_choice", "stream", "metadata", "cache_control", "thinking",
    "output_config",
}
# fmt: on


# An error the chat path raises names a chat field: the field of the adapted request that set
# it instead (first matching pattern; `structured output` is the grammar of text.format /
# output_config.format, or else of the forced tool call). Message indices are not kept: the
# conversion merges and splits messages.
_RESPONSES_NAMES = [
    (r"max_completion_tokens", "max_output_tokens"),
    (r"messages(\..*)?", "input"),
    (r"tools\.(\d+)\.function(\..*)?", r"tools.\1\2"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"(response_format|structured output)(\..*)?", "text.format"),
    (r"stream_options(\..*)?", "stream"),
]
_MESSAGES_NAMES = [
    (r"max_completion_tokens", "max_tokens"),
    (r"stop(\..*)?", r"stop_sequences\1"),
    (r"user", "metadata.user_id"),
    (r"messages(\..*)?", "messages"),
    (r"tools\.(\d+)\.function\.parameters(\..*)?", r"tools.\1.input_schema\2"),
    (r"tools\.(\d+)\.function(\..*)?", r"tools.\1\2"),
    (r"tool_choice\.function\.name", "tool_choice.name"),
    (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
    (r"(response_format|structured output)(\..*)?", "output_config.format"),
    (r"stream_options(\..*)?", "stream"),
]


def rename_chat_error(exc: OpenAIError, chat: dict, api: str) -> OpenAIError:
    """`exc`, raised for chat body `chat` (converted by the "responses" or "messages"
    adapter), with its param and the param's mentions in its message renamed to the field the
    client sent ("max_completion_tokens" -> "max_output_tokens" / "max_tokens")."""
    old = exc.param
    if old is None:
        return exc
    if old == "structured output" and "response_format" not in chat:
        new = "tools"
    else:
        new = old
        for pattern, repl in _RESPONSES_NAMES if api == "responses" else _MESSAGES_NAMES:
            if re.fullmatch(pattern, old):
                new = re.sub(f"^{pattern}$", repl, old)
                break
    if new == old:
        return exc
    message = re.sub(rf"(?<![\w.]){re.escape(old)}(?!\w)", new, exc.message)
    return OpenAIError(message, exc.status, new, exc.code, exc.kind)


def _new_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


def _check_fields(body: Json, known: set[str], refused: Refusals, param: str = "") -> None:
    """400 for an unknown field or a refused one set to a non-neutral value (null passes)."""
    for name, value in body.items():
        where = f"{param}{name}"
        if name in known or value is None:
            continue
        rule = refused.get(name)
        if rule is None:
            raise OpenAIError(f"unknown or unsupported field '{where}'", param=where)
        neutral, why = rule
        if not any(value == v and type(value) is type(v) for v in neutral):
            raise OpenAIError(f"'{where}' is not supported ({why})", param=where)


def _need(value: Any, kinds: type | tuple[type, ...], param: str, what: str) -> Any:
    """`value` if it has one of `kinds` (bool is not an int here), else a 400."""
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise OpenAIError(f"'{param}' must be {what}", param=param)
    if not isinstance(value, kinds):
        raise OpenAIError(f"'{param}' must be {what}", param=param)
    return value


def _body(body: Any) -> Json:
    return _need(body, dict, "body", "a JSON object")


def _copy(src: Json, dst: Json, names: Iterable[str]) -> None:
    for name in names:
        if src.get(name) is not None:
            dst[name] = src[name]


def _text_parts(parts: Any, kinds: tuple[str, ...], param: str) -> str:
    """The joined text of a string or a list of text parts of the given types."""
    if isinstance(parts, str):
        return parts
    _need(parts, list, param, "a string or a list of content parts")
    texts = []
    for k, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in kinds or not isinstance(part.get("text"), str):
            raise OpenAIError(
                f"only text content parts ({' / '.join(kinds)}) are supported, got {kind!r}",
                param=f"{param}.{k}.type",
            )
        texts.append(part["text"])
    return "".join(texts)


# =============================================================================================
# OpenAI Responses API: request
# =============================================================================================


def responses_to_chat(body: dict) -> dict:
    """A Responses request body -> a chat completions request body (400 for what is refused)."""
    body = _body(body)
    _check_fields(body, _RESPONSES_FIELDS, _RESPONSES_REFUSED)
    _check_responses_extras(body)
    model = _need(body.get("model"), str, "model", "a string")
    chat: Json = {"model": model, "messages": _responses_messages(body)}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    _copy(body, chat, ("temperature", "top_p", "parallel_tool_calls", "user"))
    _copy(body, chat, ("safety_identifier", "prompt_cache_key"))
    if body.get("tools") is not None:
        chat["tools"] = _responses_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _responses_tool_choice(body["tool_choice"])
    fmt = (body.get("text") or {}).get("format")
    if fmt is not None:
        chat["response_format"] = _responses_format(fmt)
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _check_responses_extras(body: Json) -> None:
    """The honoured fields with parts that are refused: reasoning, text, stream_options."""
    reasoning = body.get("reasoning")
    if reasoning is not None:
        _need(reasoning, dict, "reasoning", "an object")
        for key, value in reasoning.items():
            if value is not None:
                raise OpenAIError(
                    f"'reasoning.{key}' is not supported (whether and how much the model "
                    "reasons is decided by its chat template)",
                    param=f"reasoning.{key}",
                )
    text = body.get("text")
    if text is not None:
        _check_fields(_need(text, dict, "text", "an object"), {"format"}, {}, "text.")
    options = body.get("stream_options")
    if options is not None:
        _need(options, dict, "stream_options", "an object")
        refused = {"include_obfuscation": ((False,), "streams are never obfuscated")}
        _check_fields(options, set(), refused, "stream_options.")
    if body.get("instructions") is not None:
        _need(body["instructions"], str, "instructions", "a string")
    if body.get("max_output_tokens") is not None:
        _need(body["max_output_tokens"], int, "max_output_tokens", "an integer")
    if body.get("stream") is not None:
        _need(body["stream"], bool, "stream", "a boolean")


def _responses_messages(body: Json) -> list[Json]:
    messages: list[Json] = []
    if body.get("instructions"):
        messages.append({"role": "system", "content": body["instructions"]})
    items = body.get("input")
    if isinstance(items, str):
        messages.append({"role": "user", "content": items})
        return messages
    if items is None:
        raise OpenAIError("'input' is required", param="input")
    _need(items, list, "input", "a string or a list of input items")
    reasoning: str | None = None
    for k, item in enumerate(items):
        reasoning = _input_item(
            _need(item, dict, f"input.{k}", "an object"), k, messages, reasoning
        )
    if reasoning is not None:
        raise OpenAIError(
            "a reasoning item must be followed by an assistant message or a function_call",
            param=f"input.{len(items) - 1}",
        )
    return messages


def _input_item(item: Json, k: int, messages: list[Json], reasoning: str | None) -> str | None:
    """Append chat messages for input item `k`; the reasoning waiting for the next assistant
    message is passed through (and returned)."""
    kind = item.get("type", "message")
    if kind == "message":
        message = _input_message(item, k)
        if message["role"] != "assistant":
            if reasoning is not None:
                raise OpenAIError(
                    "a reasoning item must be followed by an assistant message or a function_call",
                    param=f"input.{k}",
                )
            messages.append(message)
            return None
        _attach_reasoning(message, reasoning)
        messages.append(message)
        return None
    if kind == "function_call":
        _input_call(item, k, messages, reasoning)
        return None
    if kind == "function_call_output":
        messages.append(_input_call_output(item, k))
        return reasoning
    if kind == "reasoning":
        return _input_reasoning(item, k, reasoning)
    raise OpenAIError(
        f"input items of type {kind!r} are not supported (only message, function_call, "
        "function_call_output and reasoning)",
        param=f"input.{k}.type",
    )


def _attach_reasoning(message: Json, reasoning: str | None) -> None:
    if reasoning is not None:
        message["reasoning_content"] = reasoning


def _input_message(item: Json, k: int) -> Json:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise OpenAIError(
            f"message role must be user, system, developer or assistant, got {role!r}",
            param=f"input.{k}.role",
        )
    kinds = ("output_text",) if role == "assistant" else ("input_text",)
    if role == "assistant":
        kinds += ("input_text",)  # a lenient client may echo either
    content = _text_parts(item.get("content"), kinds, f"input.{k}.content")
    return {"role": role, "content": content}


def _input_call(item: Json, k: int, messages: list[Json], reasoning: str | None) -> None:
    for name in ("call_id", "name", "arguments"):
        _need(item.get(name), str, f"input.{k}.{name}", "a string")
    if item.get("namespace") is not None:
        raise OpenAIError("function namespaces are not supported", param=f"input.{k}.namespace")
    call = {
        "id": item["call_id"],
        "type": "function",
        "function": {"name": item["name"], "arguments": item["arguments"]},
    }
    last = messages[-1] if messages else None
    if reasoning is None and last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)  # the same assistant turn
        return
    message: Json = {"role": "assistant", "content": None, "tool_calls": [call]}
    _attach_reasoning(message, reasoning)
    messages.append(message)


def _input_call_output(item: Json, k: int) -> Json:
    call_id = _need(item.get("call_id"), str, f"input.{k}.call_id", "a string")
    output = _text_parts(item.get("output"), ("input_text", "output_text"), f"input.{k}.output")
    return {"role": "tool", "tool_call_id": call_id, "content": output}


def _input_reasoning(item: Json, k: int, reasoning: str | None) -> str:
    if item.get("encrypted_content") is not None:
        raise OpenAIError(
            "encrypted reasoning is never produced here, so cannot be read back",
            param=f"input.{k}.encrypted_content",
        )
    text = _text_parts(item.get("content") or [], ("reasoning_text",), f"input.{k}.content")
    return text if reasoning is None else reasoning + text


_FUNCTION_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}


def _responses_tools(tools: Any) -> list[Json]:
    out = []
    for k, tool in enumerate(_need(tools, list, "tools", "a list")):
        _need(tool, dict, f"tools.{k}", "an object")
        if tool.get("type") != "function":
            raise OpenAIError(
                f"tools of type {tool.get('type')!r} are not available (only function tools)",
                param=f"tools.{k}.type",
            )
        _check_fields(tool, _FUNCTION_TOOL_KEYS, {}, f"tools.{k}.")
        fn: Json = {"name": _need(tool.get("name"), str, f"tools.{k}.name", "a string")}
        _copy(tool, fn, ("description", "parameters", "strict"))
        out.append({"type": "function", "function": fn})
    return out


def _responses_tool_choice(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = _need(choice.get("name"), str, "tool_choice.name", "a string")
        return {"type": "function", "function": {"name": name}}
    raise OpenAIError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", '
        '"name": ...} (allowed_tools and hosted tools are not supported)',
        param="tool_choice",
    )


def _responses_format(fmt: Any) -> Json:
    kind = _need(fmt, dict, "text.format", "an object").get("type")
    if kind in ("text", "json_object"):
        _check_fields(fmt, {"type"}, {}, "text.format.")
        return {"type": kind}
    if kind == "json_schema":
        _check_fields(fmt, {"type", "name", "schema", "strict", "description"}, {}, "text.format.")
        inner: Json = {"name": _need(fmt.get("name"), str, "text.format.name", "a string")}
        inner["schema"] = _need(fmt.get("schema"), dict, "text.format.schema", "an object")
        _copy(fmt, inner, ("strict", "description"))
        return {"type": "json_schema", "json_schema": inner}
    raise OpenAIError(
        f"text.format type must be text, json_object or json_schema, got {kind!r}",
        param="text.format.type",
    )


# =============================================================================================
# OpenAI Responses API: response
# =============================================================================================


def _response_object(
    body: Json, ids: Json, output: list[Json], status: str, usage: Json | None
) -> Json:
    """A Responses `response` object with the request's settings echoed."""
    text = body.get("text") if isinstance(body.get("text"), dict) else {}
    return {
        "id": ids["id"],
        "object": "response",
        "created_at": ids["created_at"],
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "max_tool_calls": body.get("max_tool_calls"),
        "metadata": body.get("metadata") or {},
        "model": ids["model"],
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": None,
        "reasoning": body.get("reasoning"),
        "service_tier": "default",
        "store": False,
        "temperature": body.get("temperature"),
        "text": {"format": (text or {}).get("format") or {"type": "text"}},
        "tool_choice": body.get("tool_choice") or "auto",
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": body.get("user"),
    }


def _response_usage(usage: Json | None) -> Json | None:
    if not usage:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": usage.get("prompt_tokens", 0),
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage.get("completion_tokens", 0),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.get("total_tokens", 0),
    }


def _reasoning_item(item_id: str, text: str, status: str) -> Json:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> Json:
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Json:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _ids(chat: Json, body: Json) -> Json:
    created = chat.get("created")
    return {
        "id": _new_id("resp_"),
        "created_at": created if isinstance(created, int | float) else int(time.time()),
        "model": chat.get("model") or body.get("model") or "",
    }


def chat_to_response(chat: dict, body: dict) -> dict:
    """A chat completion response -> a Responses `response` object for request `body`."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    status = "incomplete" if choice.get("finish_reason") == "length" else "completed"
    output: list[Json] = []
    if message.get("reasoning_content"):
        output.append(_reasoning_item(_new_id("rs_"), message["reasoning_content"], status))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        output.append(_message_item(_new_id("msg_"), message.get("content") or "", status))
    for call in calls:
        fn = call.get("function") or {}
        output.append(
            _call_item(
                _new_id("fc_"),
                call.get("id") or _new_id("call_"),
                fn.get("name", ""),
                fn.get("arguments", ""),
                "completed",
            )
        )
    usage = _response_usage(chat.get("usage"))
    return _response_object(body, _ids(chat, body), output, status, usage)


class _ResponseEvents:
    """The state of one streamed response: open output items and the events made so far."""

    def __init__(self, body: Json) -> None:
        self.body = body
        self.ids = _ids({}, body)
        self.seq = 0
        self.output: list[Json] = []  # items in output order (their final state once done)
        self.open: dict[int, Json] = {}  # output index -> item still in progress
        self.text_item: int | None = None  # the open message or reasoning item
        self.calls: dict[int, int] = {}  # chat tool-call index -> output index
        self.finish: str | None = None
        self.usage: Json | None = None

    def event(self, kind: str, **fields: Any) -> Json:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def response(self, status: str) -> Json:
        usage = _response_usage(self.usage)
        output = copy.deepcopy(self.output)
        return _response_object(self.body, self.ids, output, status, usage)

    def start(self) -> list[Json]:
        created = self.response("in_progress")
        return [
            self.event("response.created", response=created),
            self.event("response.in_progress", response=created),
        ]

    def add_item(self, item: Json) -> list[Json]:
        index = len(self.output)
        self.output.append(item)
        self.open[index] = item
        item = copy.deepcopy(item)
        return [self.event("response.output_item.added", output_index=index, item=item)]

    def text(self, kind: str, delta: str) -> list[Json]:
        """A content ("message") or reasoning_content ("reasoning") fragment."""
        events: list[Json] = []
        current = self.output[self.text_item] if self.text_item is not None else None
        if current is None or current["type"] != kind:
            events += self.close_text()
            events += self.open_text(kind)
        index = self.text_item
        assert index is not None
        part = self.output[index]["content"][0]
        part["text"] += delta
        name = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(
            self.event(
                name,
                item_id=self.output[index]["id"],
                output_index=index,
                content_index=0,
                delta=delta,
                **extra,
            )
        )
        return events

    def open_text(self, kind: str) -> list[Json]:
        if kind == "message":
            item = _message_item(_new_id("msg_"), None, "in_progress")
            part: Json = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = _reasoning_item(_new_id("rs_"), "", "in_progress")
            item["content"] = []
            part = {"type": "reasoning_text", "text": ""}
        events = self.add_item(item)
        self.text_item = len(self.output) - 1
        events.append(
            self.event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=self.text_item,
                content_index=0,
                part=dict(part),
            )
        )
        item["content"] = [part]
        return events

    def close_text(self) -> list[Json]:
        index, self.text_item = self.text_item, None
        if index is None:
            return []
        item = self.output[index]
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "message":
            events = [
                self.event("response.output_text.done", text=part["text"], logprobs=[], **where)
            ]
        else:
            events = [self.event("response.reasoning_text.done", text=part["text"], **where)]
        events.append(self.event("response.content_part.done", part=dict(part), **where))
        return events + self.close_item(index)

    def close_item(self, index: int) -> list[Json]:
        item = self.open.pop(index)
        item["status"] = "incomplete" if self.finish == "length" else "completed"
        if item["type"] == "function_call":
            item["status"] = "completed"
        item = copy.deepcopy(item)
        return [self.event("response.output_item.done", output_index=index, item=item)]

    def tool_call(self, fragment: Json) -> list[Json]:
        events: list[Json] = []
        fn = fragment.get("function") or {}
        chat_index = fragment.get("index", 0)
        if chat_index not in self.calls:
            events += self.close_text()
            call_id = fragment.get("id") or _new_id("call_")
            item = _call_item(_new_id("fc_"), call_id, fn.get("name") or "", "", "in_progress")
            events += self.add_item(item)
            self.calls[chat_index] = len(self.output) - 1
        index = self.calls[chat_index]
        delta = fn.get("arguments") or ""
        if delta:
            self.output[index]["arguments"] += delta
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self.output[index]["id"],
                    output_index=index,
                    delta=delta,
                )
            )
        return events

    def chunk(self, chunk: Json) -> list[Json]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[Json] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self.text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                events += self.text("message", delta["content"])
            for fragment in delta.get("tool_calls") or []:
                events += self.tool_call(fragment)
            if choice.get("finish_reason"):
                self.finish = choice["finish_reason"]
        return events

    def end(self) -> list[Json]:
        if not self.calls and not any(i["type"] == "message" for i in self.output):
            events = self.close_text() + self.open_text("message")  # an empty message
        else:
            events = []
        events += self.close_text()
        for index in sorted(self.open):
            item = self.output[index]
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    arguments=item["arguments"],
                )
            )
            events += self.close_item(index)
        status = "incomplete" if self.finish == "length" else "completed"
        events.append(self.event(f"response.{status}", response=self.response(status)))
        return events


def _error_fields(chunk: Json) -> Json:
    error = chunk.get("error")
    error = error if isinstance(error, dict) else {"message": str(error)}
    return {
        "message": str(error.get("message") or "the stream failed"),
        "code": error.get("code"),
        "param": error.get("param"),
    }


async def chat_stream_to_response_events(
    chunks: AsyncIterator[dict], body: dict
) -> AsyncIterator[dict]:
    """Chat completion chunk dicts -> Responses stream events (dicts with "type" and
    "sequence_number"). An error chunk ({"error": ...}) -> one "error" event, then the end."""
    state = _ResponseEvents(body)
    for event in state.start():
        yield event
    async for chunk in chunks:
        if "error" in chunk:
            yield state.event("error", **_error_fields(chunk))
            return
        for event in state.chunk(chunk):
            yield event
    for event in state.end():
        yield event


# =============================================================================================
# Anthropic Messages API: request
# =============================================================================================


def messages_to_chat(body: dict) -> dict:
    """An Anthropic Messages request body -> a chat completions request body."""
    body = _body(body)
    _check_fields(body, _MESSAGES_FIELDS, _MESSAGES_REFUSED)
    _check_thinking(body.get("thinking"))
    if body.get("max_tokens") is None:
        raise OpenAIError("'max_tokens' is required", param="max_tokens")
    chat: Json = {
        "model": _need(body.get("model"), str, "model", "a string"),
        "messages": _system_messages(body.get("system")) + _anthropic_messages(body),
        "max_completion_tokens": _need(body["max_tokens"], int, "max_tokens", "an integer"),
    }
    _copy(body, chat, ("temperature", "top_p", "top_k"))
    if body.get("stop_sequences") is not None:
        chat["stop"] = _need(body["stop_sequences"], list, "stop_sequences", "a list of strings")
    metadata = body.get("metadata")
    if metadata is not None:
        user = _need(metadata, dict, "metadata", "an object").get("user_id")
        if user is not None:
            chat["user"] = user
    if body.get("tools") is not None:
        chat["tools"] = _anthropic_tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat |= _anthropic_tool_choice(body["tool_choice"])
    _output_config(body.get("output_config"), chat)
    if body.get("stream"):
        chat["stream"] = _need(body["stream"], bool, "stream", "a boolean")
        chat["stream_options"] = {"include_usage": True}
    return chat


def _check_thinking(thinking: Any) -> None:
    if thinking is None:
        return
    kind = _need(thinking, dict, "thinking", "an object").get("type")
    if kind != "adaptive":
        raise OpenAIError(
            f"thinking {kind!r} is not supported: whether the model thinks is decided by its "
            'chat template (send {"type": "adaptive"} or no thinking)',
            param="thinking.type",
        )
    _check_fields(
        thinking, {"type"}, {"display": ((), "thinking display is not configurable")}, "thinking."
    )


def _output_config(config: Any, chat: Json) -> None:
    if config is None:
        return
    _need(config, dict, "output_config", "an object")
    refused = {"effort": ((), "effort is not configurable")}
    _check_fields(config, {"format"}, refused, "output_config.")
    fmt = config.get("format")
    if fmt is None:
        return
    _need(fmt, dict, "output_config.format", "an object")
    if fmt.get("type") != "json_schema":
        raise OpenAIError(
            "output_config.format type must be json_schema", param="output_config.format.type"
        )
    _check_fields(fmt, {"type", "schema"}, {}, "output_config.format.")
    schema = _need(fmt.get("schema"), dict, "output_config.format.schema", "an object")
    chat["response_format"] = {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }


def _system_messages(system: Any) -> list[Json]:
    if system is None or system == "":
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    blocks = _need(system, list, "system", "a string or a list of text blocks")
    return [{"role": "system", "content": _block_texts(blocks, "system")}]


def _block_texts(blocks: list[Any], param: str) -> str:
    """The joined text of text blocks (cache_control ignored)."""
    texts = []
    for k, block in enumerate(blocks):
        _need(block, dict, f"{param}.{k}", "an object")
        if block.get("type") != "text":
            raise OpenAIError(
                f"{block.get('type')!r} blocks are not supported here (only text)",
                param=f"{param}.{k}.type",
            )
        texts.append(_text_block(block, f"{param}.{k}"))
    return "".join(texts)


def _text_block(block: Json, param: str) -> str:
    _check_fields(
        block,
        {"type", "text", "cache_control"},
        {"citations": (([],), "citations are not supported")},
        f"{param}.",
    )
    return _need(block.get("text"), str, f"{param}.text", "a string")


def _anthropic_messages(body: Json) -> list[Json]:
    messages = _need(body.get("messages"), list, "messages", "a list of messages")
    if not messages:
        raise OpenAIError("'messages' must not be empty", param="messages")
    out: list[Json] = []
    for k, message in enumerate(messages):
        _need(message, dict, f"messages.{k}", "an object")
        role = message.get("role")
        if role == "user":
            out += _user_turn(message.get("content"), f"messages.{k}.content")
        elif role == "assistant":
            out.append(_assistant_turn(message.get("content"), f"messages.{k}.content"))
        else:
            raise OpenAIError(
                f"role must be user or assistant, got {role!r}", param=f"messages.{k}.role"
            )
    if messages[-1].get("role") == "assistant":
        raise OpenAIError(
            "a final assistant message (prefill) is not supported",
            param=f"messages.{len(messages) - 1}",
        )
    return out


def _blocks(content: Any, param: str) -> list[Json]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    content = _need(content, list, param, "a string or a list of content blocks")
    return [_need(b, dict, f"{param}.{k}", "an object") for k, b in enumerate(content)]


def _user_turn(content: Any, param: str) -> list[Json]:
    """Tool results (as tool messages, first) and the text of a user turn."""
    tools: list[Json] = []
    texts: list[str] = []
    for k, block in enumerate(_blocks(content, param)):
        kind = block.get("type")
        if kind == "text":
            texts.append(_text_block(block, f"{param}.{k}"))
        elif kind == "tool_result":
            tools.append(_tool_result(block, f"{param}.{k}"))
        else:
            raise OpenAIError(
                f"{kind!r} blocks are not supported (only text and tool_result)",
                param=f"{param}.{k}.type",
            )
    if texts or not tools:
        tools.append({"role": "user", "content": "".join(texts)})
    return tools


def _tool_result(block: Json, param: str) -> Json:
    _check_fields(
        block, {"type", "tool_use_id", "content", "is_error", "cache_control"}, {}, f"{param}."
    )
    call_id = _need(block.get("tool_use_id"), str, f"{param}.tool_use_id", "a string")
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    else:
        text = _block_texts(_need(content, list, f"{param}.content", "a list"), f"{param}.content")
    if block.get("is_error"):
        text = "Error: " + text
    return {"role": "tool", "tool_call_id": call_id, "content": text}


def _assistant_turn(content: Any, param: str) -> Json:
    message: Json = {"role": "assistant", "content": None}
    texts, calls, thinking = [], [], []
    for k, block in enumerate(_blocks(content, param)):
        kind, where = block.get("type"), f"{param}.{k}"
        if kind == "text":
            texts.append(_text_block(block, where))
        elif kind == "tool_use":
            calls.append(_tool_use(block, where))
        elif kind == "thinking":
            thinking.append(_need(block.get("thinking"), str, f"{where}.thinking", "a string"))
        else:
            raise OpenAIError(
                f"{kind!r} blocks are not supported in assistant turns (only "
                "text, tool_use and thinking)",
                param=f"{where}.type",
            )
    if texts:
        message["content"] = "".join(texts)
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return message


def _tool_use(block: Json, param: str) -> Json:
    _check_fields(block, {"type", "id", "name", "input", "cache_control"}, {}, f"{param}.")
    call_id = _need(block.get("id"), str, f"{param}.id", "a string")
    name = _need(block.get("name"), str, f"{param}.name", "a string")
    arguments = json.dumps(
        _need(block.get("input", {}), dict, f"{param}.input", "an object"), ensure_ascii=False
    )
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


_TOOL_KEYS = {"type", "name", "description", "input_schema", "strict", "cache_control"}


def _anthropic_tools(tools: Any) -> list[Json]:
    out = []
    for k, tool in enumerate(_need(tools, list, "tools", "a list")):
        _need(tool, dict, f"tools.{k}", "an object")
        if tool.get("type") not in (None, "custom"):
            raise OpenAIError(
                f"tools of type {tool.get('type')!r} are not available (only custom tools)",
                param=f"tools.{k}.type",
            )
        _check_fields(tool, _TOOL_KEYS, {}, f"tools.{k}.")
        fn: Json = {"name": _need(tool.get("name"), str, f"tools.{k}.name", "a string")}
        _copy(tool, fn, ("description", "strict"))
        fn["parameters"] = _need(
            tool.get("input_schema"), dict, f"tools.{k}.input_schema", "a JSON schema object"
        )
        out.append({"type": "function", "function": fn})
    return out


def _anthropic_tool_choice(choice: Any) -> Json:
    kind = _need(choice, dict, "tool_choice", "an object").get("type")
    _check_fields(choice, {"type", "name", "disable_parallel_tool_use"}, {}, "tool_choice.")
    out: Json = {}
    if kind in ("auto", "any", "none"):
        out["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    elif kind == "tool":
        name = _need(choice.get("name"), str, "tool_choice.name", "a string")
        out["tool_choice"] = {"type": "function", "function": {"name": name}}
    else:
        raise OpenAIError(
            "tool_choice type must be auto, any, tool or none", param="tool_choice.type"
        )
    if choice.get("disable_parallel_tool_use") is not None and kind != "none":
        disable = _need(
            choice["disable_parallel_tool_use"],
            bool,
            "tool_choice.disable_parallel_tool_use",
            "a boolean",
        )
        out["parallel_tool_calls"] = not disable
    return out


# =============================================================================================
# Anthropic Messages API: response
# =============================================================================================


def _stop_reason(choice: Json) -> tuple[str | None, str | None]:
    """(Anthropic stop_reason, stop_sequence) of a chat choice."""
    finish = choice.get("finish_reason")
    if finish == "tool_calls":
        return "tool_use", None
    if finish == "length":
        return "max_tokens", None
    matched = choice.get("stop_reason")
    if isinstance(matched, str):
        return "stop_sequence", matched
    return ("end_turn" if finish else None), None


def _anthropic_usage(usage: Json | None) -> Json:
    usage = usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {
        "input_tokens": max(usage.get("prompt_tokens", 0) - cached, 0),
        "output_tokens": usage.get("completion_tokens", 0),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_input(arguments: str) -> Json:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        value = None
    return value if isinstance(value, dict) else {"arguments": arguments}


def chat_to_message(chat: dict, body: dict) -> dict:
    """A chat completion response -> an Anthropic Message for request `body`."""
    choice = (chat.get("choices") or [{}])[0]
    message = choice.get("message") or {}
    content: list[Json] = []
    if message.get("reasoning_content"):
        content.append(
            {"type": "thinking", "thinking": message["reasoning_content"], "signature": ""}
        )
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") or _new_id("toolu_"),
                "name": fn.get("name", ""),
                "input": _tool_input(fn.get("arguments") or ""),
            }
        )
    stop_reason, stop_sequence = _stop_reason(choice)
    return {
        "id": _new_id("msg_"),
        "type": "message",
        "role": "assistant",
        "model": chat.get("model") or body.get("model") or "",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _anthropic_usage(chat.get("usage")),
    }


Event = tuple[str, Json]


class _MessageEvents:
    """The state of one streamed Anthropic message: the open content block."""

    def __init__(self, body: Json) -> None:
        self.body = body
        self.index = -1  # the last block started
        self.kind: str | None = None  # the open block's type
        self.call: int | None = None  # the chat tool-call index of an open tool_use block
        self.done_calls: set[int] = set()
        self.choice: Json = {}
        self.usage: Json | None = None

    def start(self) -> list[Event]:
        message = {
            "id": _new_id("msg_"),
            "type": "message",
            "role": "assistant",
            "model": self.body.get("model") or "",
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _anthropic_usage(None),
        }
        return [("message_start", {"type": "message_start", "message": message})]

    def open(self, block: Json) -> list[Event]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        data = {"type": "content_block_start", "index": self.index, "content_block": block}
        return events + [("content_block_start", data)]

    def close(self) -> list[Event]:
        if self.kind is None:
            return []
        events: list[Event] = []
        if self.kind == "thinking":
            events.append(self.delta({"type": "signature_delta", "signature": ""}))
        if self.call is not None:
            self.done_calls.add(self.call)
        self.kind, self.call = None, None
        stop = {"type": "content_block_stop", "index": self.index}
        return events + [("content_block_stop", stop)]

    def delta(self, delta: Json) -> Event:
        return (
            "content_block_delta",
            {"type": "content_block_delta", "index": self.index, "delta": delta},
        )

    def text(self, kind: str, text: str) -> list[Event]:
        events: list[Event] = []
        if self.kind != kind:
            block = (
                {"type": "text", "text": ""}
                if kind == "text"
                else {"type": "thinking", "thinking": "", "signature": ""}
            )
            events += self.open(block)
        if kind == "text":
            return events + [self.delta({"type": "text_delta", "text": text})]
        return events + [self.delta({"type": "thinking_delta", "thinking": text})]

    def tool_call(self, fragment: Json) -> list[Event]:
        events: list[Event] = []
        fn = fragment.get("function") or {}
        index = fragment.get("index", 0)
        if index in self.done_calls:
            raise OpenAIError(
                "a tool call's arguments continued after the next block began", status=500
            )
        if self.call != index:
            block = {
                "type": "tool_use",
                "id": fragment.get("id") or _new_id("toolu_"),
                "name": fn.get("name") or "",
                "input": {},
            }
            events += self.open(block)
            self.call = index
        if fn.get("arguments"):
            events.append(self.delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events

    def chunk(self, chunk: Json) -> list[Event]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        events: list[Event] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                events += self.text("thinking", delta["reasoning_content"])
            if delta.get("content"):
                events += self.text("text", delta["content"])
            for fragment in delta.get("tool_calls") or []:
                events += self.tool_call(fragment)
            if choice.get("finish_reason"):
                self.choice = choice
        return events

    def end(self) -> list[Event]:
        events = self.close()
        stop_reason, stop_sequence = _stop_reason(self.choice)
        usage = _anthropic_usage(self.usage)
        data = {
            "type": "message_delta",
            "usage": usage,
            "delta": {"stop_reason": stop_reason or "end_turn", "stop_sequence": stop_sequence},
        }
        return events + [("message_delta", data), ("message_stop", {"type": "message_stop"})]


async def chat_stream_to_message_events(
    chunks: AsyncIterator[dict], body: dict
) -> AsyncIterator[tuple[str, dict]]:
    """Chat completion chunk dicts -> Anthropic stream events (event name, data). An error
    chunk ({"error": ...}) -> one ("error", ...) event, then the end."""
    state = _MessageEvents(body)
    for event in state.start():
        yield event
    async for chunk in chunks:
        try:
            if "error" in chunk:
                raise OpenAIError(_error_fields(chunk)["message"], status=500)
            events = state.chunk(chunk)
        except OpenAIError as exc:
            yield ("error", anthropic_error(exc.status, exc.message))
            return
        for event in events:
            yield event
    for event in state.end():
        yield event


_ANTHROPIC_ERRORS = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict:
    """Anthropic's error body for an HTTP status: {"type": "error", "error": {type, message}}."""
    kind = _ANTHROPIC_ERRORS.get(status)
    if kind is None:
        kind = "api_error" if status >= 500 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": message}}
