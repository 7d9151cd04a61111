"""hybridkv.entrypoints.adapters: Responses / Anthropic Messages <-> chat completions, checked
against the real SDK models (openai, anthropic) and the chat request schema."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

pytest.importorskip("anthropic")

from anthropic.lib.streaming._messages import accumulate_event  # noqa: E402
from anthropic.types import Message, RawMessageStreamEvent  # noqa: E402
from openai import omit  # noqa: E402
from openai.lib.streaming.responses._responses import ResponseStreamState  # noqa: E402
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402

from hybridkv.entrypoints import adapters  # noqa: E402
from hybridkv.entrypoints.protocol import ChatCompletionRequest, OpenAIError  # noqa: E402
from hybridkv.entrypoints.structured import check_tools, grammar_of, tool_mode  # noqa: E402

Json = dict[str, Any]
RESPONSE_EVENT: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
MESSAGE_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}


def valid_chat(chat: Json) -> ChatCompletionRequest:
    """The converted body passes the server's own chat checks."""
    request = ChatCompletionRequest.model_validate(chat)
    request.refuse_unsupported()
    tools = check_tools(request.tools)
    tool_mode(request.tool_choice, tools)
    grammar_of(request)
    return request


def run_stream(convert: Any, chunks: list[Json], body: Json) -> list[Any]:
    async def feed() -> AsyncIterator[Json]:
        for chunk in chunks:
            yield chunk

    async def collect() -> list[Any]:
        return [event async for event in convert(feed(), body)]

    return asyncio.run(collect())


def chat_response(message: Json, finish: str = "stop", cached: int = 3, **choice: Any) -> Json:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish, **choice}],
        "usage": {
            "prompt_tokens": 10,
            "completion_tokens": 7,
            "total_tokens": 17,
            "prompt_tokens_details": {"cached_tokens": cached},
        },
    }


def chunk(delta: Json, finish: str | None = None, **choice: Any) -> Json:
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **choice}
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [choice],
    }


USAGE_CHUNK = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [],
    "usage": {
        "prompt_tokens": 10,
        "completion_tokens": 7,
        "total_tokens": 17,
        "prompt_tokens_details": {"cached_tokens": 4},
    },
}


def tool_chunks(text: str = "", reasoning: str = "", finish: str = "tool_calls") -> list[Json]:
    """A chat stream: reasoning, text, then two tool calls with arguments in fragments."""
    out = [chunk({"role": "assistant", "content": ""})]
    out += [chunk({"reasoning_content": p}) for p in _pieces(reasoning)]
    out += [chunk({"content": p}) for p in _pieces(text)]
    for k, (cid, city) in enumerate((("call_a", "Paris"), ("call_b", "Oslo"))):
        args = json.dumps({"city": city, "unit": "c"})
        first = {
            "index": k,
            "id": cid,
            "type": "function",
            "function": {"name": "get_weather", "arguments": args[:5]},
        }
        out.append(chunk({"tool_calls": [first]}))
        for piece in _pieces(args[5:], 4):
            out.append(chunk({"tool_calls": [{"index": k, "function": {"arguments": piece}}]}))
    return out + [chunk({}, finish), USAGE_CHUNK]


def _pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


# =============================================================================================
# Responses: requests
# =============================================================================================


def test_responses_text_request() -> None:
    body = {
        "model": "m",
        "input": "Hi",
        "instructions": "Be brief.",
        "max_output_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "user": "u1",
        "stream": True,
        "store": False,
        "metadata": {"k": "v"},
        "reasoning": {"effort": None},
        "truncation": "disabled",
        "include": [],
        "background": False,
        "service_tier": "auto",
    }
    chat = adapters.responses_to_chat(body)
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 20,
        "temperature": 0.5,
        "top_p": 0.9,
        "user": "u1",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    valid_chat(chat)


def test_responses_multi_turn_tools() -> None:
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather.",
        "parameters": WEATHER,
        "strict": True,
    }
    body = {
        "model": "m",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Weather in "},
                    {"type": "input_text", "text": "Paris and Oslo?"},
                ],
            },
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Two calls."}],
            },
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
                "id": "fc_1",
                "status": "completed",
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "get_weather",
                "arguments": '{"city": "Oslo"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "18C"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "9C"}],
            },
            {
                "type": "message",
                "role": "assistant",
                "id": "msg_1",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": "Paris 18C, Oslo 9C.", "annotations": []}
                ],
            },
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [tool],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "parallel_tool_calls": False,
    }
    chat = adapters.responses_to_chat(body)
    call = {"type": "function", "function": {"name": "get_weather"}}
    assert chat["messages"] == [
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {
                    "id": "c1",
                    **call,
                    "function": {**call["function"], "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    **call,
                    "function": {**call["function"], "arguments": '{"city": "Oslo"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "9C"},
        {"role": "assistant", "content": "Paris 18C, Oslo 9C."},
        {"role": "user", "content": "Thanks"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather.",
                "parameters": WEATHER,
                "strict": True,
            },
        }
    ]
    assert chat["tool_choice"] == call
    assert chat["parallel_tool_calls"] is False
    valid_chat(chat)


def test_responses_text_after_message_joins_its_calls() -> None:
    """An assistant message followed by function calls is one chat assistant turn."""
    chat = adapters.responses_to_chat(
        {
            "model": "m",
            "input": [
                {"role": "user", "content": "x"},
                {"role": "assistant", "content": "Let me check."},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "ok"},
            ],
        }
    )
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant", "tool"]
    assert chat["messages"][1]["content"] == "Let me check."
    assert chat["messages"][1]["tool_calls"][0]["id"] == "c1"


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ({"type": "text"}, {"type": "text"}),
        ({"type": "json_object"}, {"type": "json_object"}),
        (
            {"type": "json_schema", "name": "w", "schema": WEATHER, "strict": True},
            {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": WEATHER, "strict": True},
            },
        ),
    ],
)
def test_responses_text_format(fmt: Json, expected: Json) -> None:
    chat = adapters.responses_to_chat({"model": "m", "input": "x", "text": {"format": fmt}})
    assert chat["response_format"] == expected
    request = valid_chat(chat)
    spec = grammar_of(request)
    assert (spec is None) == (fmt["type"] == "text")


@pytest.mark.parametrize("choice", ["none", "auto", "required"])
def test_responses_tool_choice_strings(choice: str) -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    chat = adapters.responses_to_chat(
        {"model": "m", "input": "x", "tools": tools, "tool_choice": choice}
    )
    assert chat["tool_choice"] == choice
    valid_chat(chat)


RESPONSES_REFUSED = [
    ("previous_response_id", "resp_1", "previous_response_id"),
    ("conversation", "conv_1", "conversation"),
    ("background", True, "background"),
    ("background_options", {"completion_window": "2h"}, "background_options"),
    ("include", ["reasoning.encrypted_content"], "include"),
    ("truncation", "auto", "truncation"),
    ("top_logprobs", 3, "top_logprobs"),
    ("prompt", {"id": "pmpt_1"}, "prompt"),
    ("context_management", [{"type": "compaction"}], "context_management"),
    ("moderation", {"model": "x"}, "moderation"),
    ("image", {"x": 1}, "image"),
    ("access_programs", {"cyber": "standard"}, "access_programs"),
    ("prompt_cache_options", {"ttl": "30m"}, "prompt_cache_options"),
    ("prompt_cache_retention", "24h", "prompt_cache_retention"),
    ("service_tier", "flex", "service_tier"),
    ("some_future_field", 1, "some_future_field"),
    ("reasoning", {"effort": "high"}, "reasoning.effort"),
    ("reasoning", {"summary": "auto"}, "reasoning.summary"),
    ("text", {"format": {"type": "text"}, "verbosity": "low"}, "text.verbosity"),
    ("text", {"format": {"type": "grammar"}}, "text.format.type"),
    ("stream_options", {"include_obfuscation": True}, "stream_options.include_obfuscation"),
    ("tools", [{"type": "web_search"}], "tools.0.type"),
    ("tools", [{"type": "mcp", "server_label": "x"}], "tools.0.type"),
    ("tools", [{"type": "custom", "name": "x"}], "tools.0.type"),
    ("tools", [{"type": "function", "name": "f", "defer_loading": True}], "tools.0.defer_loading"),
    ("tool_choice", {"type": "allowed_tools", "mode": "auto", "tools": []}, "tool_choice"),
    ("tool_choice", {"type": "web_search_preview"}, "tool_choice"),
    ("max_output_tokens", "10", "max_output_tokens"),
    ("instructions", ["x"], "instructions"),
    ("input", [{"type": "item_reference", "id": "msg_1"}], "input.0.type"),
    (
        "input",
        [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
        "input.0.content.0.type",
    ),
    (
        "input",
        [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}],
        "input.0.content.0.type",
    ),
    (
        "input",
        [{"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]}],
        "input.0.content.0.type",
    ),
    ("input", [{"role": "tool", "content": "x"}], "input.0.role"),
    (
        "input",
        [
            {"type": "reasoning", "summary": [], "encrypted_content": "e"},
            {"role": "assistant", "content": "x"},
        ],
        "input.0.encrypted_content",
    ),
    ("input", [{"type": "reasoning", "summary": [], "content": []}], "input.0"),
    ("input", [{"type": "function_call", "call_id": "c", "name": "f"}], "input.0.arguments"),
    ("input", [{"type": "computer_call_output", "call_id": "c", "output": {}}], "input.0.type"),
    ("input", None, "input"),
    ("model", None, "model"),
]


@pytest.mark.parametrize(("field", "value", "param"), RESPONSES_REFUSED)
def test_responses_refused(field: str, value: Any, param: str) -> None:
    body = {"model": "m", "input": "x", field: value}
    with pytest.raises(OpenAIError) as info:
        adapters.responses_to_chat(body)
    assert (info.value.status, info.value.param) == (400, param)


def test_responses_neutral_values_pass() -> None:
    body = {
        "model": "m",
        "input": "x",
        "store": True,
        "max_tool_calls": 3,
        "metadata": {},
        "prompt_cache_key": "k",
        "safety_identifier": "s",
        "previous_response_id": None,
        "prompt_cache_retention": "in_memory",
        "stream_options": {"include_obfuscation": False},
        "reasoning": {},
        "service_tier": "default",
    }
    valid_chat(adapters.responses_to_chat(body))


# =============================================================================================
# Responses: response objects and streams
# =============================================================================================


def test_chat_to_response_text() -> None:
    body = {
        "model": "m",
        "input": "Hi",
        "instructions": "Be brief.",
        "temperature": 0.3,
        "metadata": {"k": "v"},
        "text": {"format": {"type": "json_object"}},
    }
    msg = {"role": "assistant", "content": "Hello", "reasoning_content": "Greet."}
    out = adapters.chat_to_response(chat_response(msg), body)
    resp = Response.model_validate(out)
    assert resp.id.startswith("resp_") and resp.status == "completed"
    assert resp.output_text == "Hello"
    assert [i.type for i in resp.output] == ["reasoning", "message"]
    assert resp.output[0].content[0].text == "Greet."
    assert resp.usage is not None
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (
        10,
        7,
        17,
    )
    assert resp.usage.input_tokens_details.cached_tokens == 3
    assert resp.instructions == "Be brief." and resp.temperature == 0.3
    assert resp.metadata == {"k": "v"} and resp.text.format.type == "json_object"


def test_chat_to_response_tool_calls_and_length() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    body = {"model": "m", "input": "x", "tools": tools, "tool_choice": "required"}
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        }
    ]
    msg = {"role": "assistant", "content": None, "tool_calls": calls}
    resp = Response.model_validate(
        adapters.chat_to_response(chat_response(msg, "tool_calls"), body)
    )
    assert [i.type for i in resp.output] == ["function_call"]
    call = resp.output[0]
    assert (call.call_id, call.name, call.arguments) == (
        "call_1",
        "get_weather",
        '{"city": "Oslo"}',
    )
    assert resp.tools[0].name == "get_weather" and resp.tool_choice == "required"

    cut = adapters.chat_to_response(
        chat_response({"role": "assistant", "content": "Hel"}, "length"), body
    )
    cut_resp = Response.model_validate(cut)
    assert cut_resp.status == "incomplete"
    assert cut_resp.incomplete_details is not None
    assert cut_resp.incomplete_details.reason == "max_output_tokens"
    assert cut_resp.output[0].status == "incomplete"


def _validated_response_events(chunks: list[Json], body: Json) -> list[Any]:
    events = run_stream(adapters.chat_stream_to_response_events, chunks, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    parsed = [RESPONSE_EVENT.validate_python(e) for e in events]
    state: ResponseStreamState[Any] = ResponseStreamState(
        input_tools=body.get("tools") or [], text_format=omit
    )
    handled = [out for event in parsed for out in state.handle_event(event)]
    final = handled[-1]
    if final.type == "response.completed":  # the SDK's own accumulation agrees
        assert final.response.output_text == parsed[-1].response.output_text
    return parsed


def test_response_stream_text_and_reasoning() -> None:
    body = {"model": "m", "input": "Hi", "stream": True}
    chunks = tool_chunks(text="Hello there, friend.", reasoning="Think first.", finish="stop")
    chunks = [c for c in chunks if "tool_calls" not in (c["choices"] or [{}])[0].get("delta", {})]
    events = _validated_response_events(chunks, body)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello there, friend."
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert thought == "Think first."
    done = events[-1].response
    assert done.output_text == "Hello there, friend."
    assert [i.type for i in done.output] == ["reasoning", "message"]
    assert done.usage.input_tokens_details.cached_tokens == 4
    assert events[0].response.output == [] and events[0].response.status == "in_progress"
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ):
        assert kind in kinds


def test_response_stream_tool_calls_match_non_streamed() -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    body = {"model": "m", "input": "x", "stream": True, "tools": tools}
    events = _validated_response_events(tool_chunks(text="Checking."), body)
    done = {
        e.item_id: e.arguments for e in events if e.type == "response.function_call_arguments.done"
    }
    assert len(done) == 2
    for item_id, arguments in done.items():
        deltas = [
            e.delta
            for e in events
            if e.type == "response.function_call_arguments.delta" and e.item_id == item_id
        ]
        assert "".join(deltas) == arguments
        assert json.loads(arguments)["unit"] == "c"
    final = events[-1].response
    assert [i.type for i in final.output] == ["message", "function_call", "function_call"]
    assert [i.call_id for i in final.output[1:]] == ["call_a", "call_b"]
    assert [json.loads(i.arguments)["city"] for i in final.output[1:]] == ["Paris", "Oslo"]
    assert all(i.status == "completed" for i in final.output)


def test_response_stream_length_and_empty() -> None:
    body = {"model": "m", "input": "x"}
    events = _validated_response_events([chunk({"content": "Hel"}), chunk({}, "length")], body)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    empty = _validated_response_events(
        [chunk({"role": "assistant", "content": ""}), chunk({}, "stop")], body
    )
    assert empty[-1].response.output_text == ""
    assert [i.type for i in empty[-1].response.output] == ["message"]


def test_response_stream_error() -> None:
    chunks = [
        chunk({"content": "Hi"}),
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": None}},
        chunk({"content": "never"}),
    ]
    events = run_stream(adapters.chat_stream_to_response_events, chunks, {"model": "m"})
    assert events[-1]["type"] == "error" and events[-1]["message"] == "boom"
    RESPONSE_EVENT.validate_python(events[-1])
    assert not any(e["type"] == "response.completed" for e in events)


# =============================================================================================
# Anthropic Messages: requests
# =============================================================================================


def test_messages_text_request() -> None:
    body = {
        "model": "m",
        "max_tokens": 64,
        "stream": True,
        "temperature": 0.2,
        "top_p": 0.8,
        "top_k": 5,
        "stop_sequences": ["END"],
        "metadata": {"user_id": "u1"},
        "system": [
            {"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "brief."},
        ],
        "messages": [{"role": "user", "content": "Hi"}],
        "thinking": {"type": "adaptive"},
        "cache_control": {"type": "ephemeral"},
    }
    chat = adapters.messages_to_chat(body)
    assert chat == {
        "model": "m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_completion_tokens": 64,
        "temperature": 0.2,
        "top_p": 0.8,
        "top_k": 5,
        "stop": ["END"],
        "user": "u1",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    valid_chat(chat)


def test_messages_multi_turn_tools() -> None:
    tools = [{"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}]
    body = {
        "model": "m",
        "max_tokens": 100,
        "system": "Use tools.",
        "tools": tools,
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Paris and Oslo?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Two calls.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {
                        "type": "tool_use",
                        "id": "t1",
                        "name": "get_weather",
                        "input": {"city": "Paris"},
                    },
                    {
                        "type": "tool_use",
                        "id": "t2",
                        "name": "get_weather",
                        "input": {"city": "Oslo"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": "18C"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "t2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "no data"}],
                    },
                    {"type": "text", "text": "And now?"},
                ],
            },
        ],
    }
    chat = adapters.messages_to_chat(body)
    fn = {"type": "function"}
    assert chat["messages"] == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Paris and Oslo?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {
                    "id": "t1",
                    **fn,
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "t2",
                    **fn,
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "18C"},
        {"role": "tool", "tool_call_id": "t2", "content": "Error: no data"},
        {"role": "user", "content": "And now?"},
    ]
    assert chat["tools"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
        }
    ]
    assert chat["tool_choice"] == "auto" and chat["parallel_tool_calls"] is False
    valid_chat(chat)


@pytest.mark.parametrize(
    ("choice", "expected"),
    [
        ({"type": "auto"}, "auto"),
        ({"type": "any"}, "required"),
        ({"type": "none"}, "none"),
        ({"type": "tool", "name": "f"}, {"type": "function", "function": {"name": "f"}}),
    ],
)
def test_messages_tool_choice(choice: Json, expected: Any) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}],
        "tool_choice": choice,
    }
    chat = adapters.messages_to_chat(body)
    assert chat["tool_choice"] == expected
    valid_chat(chat)


def test_messages_output_format() -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "json_schema", "schema": WEATHER}},
    }
    chat = adapters.messages_to_chat(body)
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": WEATHER},
    }
    assert grammar_of(valid_chat(chat)) is not None


USER = [{"role": "user", "content": "x"}]
MESSAGES_REFUSED = [
    ("max_tokens", None, "max_tokens"),
    ("model", None, "model"),
    ("max_tokens", 1.5, "max_tokens"),
    ("thinking", {"type": "enabled", "budget_tokens": 2048}, "thinking.type"),
    ("thinking", {"type": "disabled"}, "thinking.type"),
    ("output_config", {"effort": "high"}, "output_config.effort"),
    ("output_config", {"format": {"type": "regex"}}, "output_config.format.type"),
    ("container", "c1", "container"),
    ("diagnostics", {"previous_message_id": "m"}, "diagnostics"),
    ("inference_geo", "us", "inference_geo"),
    ("speed", "fast", "speed"),
    ("service_tier", "priority", "service_tier"),
    ("user_profile_id", "p", "user_profile_id"),
    ("workspace_id", "w", "workspace_id"),
    ("mcp_servers", [{"name": "x"}], "mcp_servers"),
    ("something_new", 1, "something_new"),
    ("tools", [{"type": "web_search_20250305", "name": "web_search"}], "tools.0.type"),
    ("tools", [{"type": "bash_20250124", "name": "bash"}], "tools.0.type"),
    ("tools", [{"name": "f", "input_schema": {}, "defer_loading": True}], "tools.0.defer_loading"),
    ("tools", [{"name": "f"}], "tools.0.input_schema"),
    ("tool_choice", {"type": "whatever"}, "tool_choice.type"),
    ("system", [{"type": "image", "source": {}}], "system.0.type"),
    (
        "messages",
        [{"role": "user", "content": [{"type": "image", "source": {}}]}],
        "messages.0.content.0.type",
    ),
    (
        "messages",
        [{"role": "user", "content": [{"type": "document", "source": {}}]}],
        "messages.0.content.0.type",
    ),
    (
        "messages",
        [
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "t",
                        "content": [{"type": "image", "source": {}}],
                    }
                ],
            }
        ],
        "messages.0.content.0.content.0.type",
    ),
    (
        "messages",
        USER
        + [{"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}]}]
        + USER,
        "messages.1.content.0.type",
    ),
    ("messages", USER + [{"role": "assistant", "content": "The answer is"}], "messages.1"),
    ("messages", [{"role": "system", "content": "x"}], "messages.0.role"),
    ("messages", [], "messages"),
]


@pytest.mark.parametrize(("field", "value", "param"), MESSAGES_REFUSED)
def test_messages_refused(field: str, value: Any, param: str) -> None:
    body: Json = {"model": "m", "max_tokens": 10, "messages": USER, field: value}
    if value is None:
        del body[field]
    with pytest.raises(OpenAIError) as info:
        adapters.messages_to_chat(body)
    assert (info.value.status, info.value.param) == (400, param)


# =============================================================================================
# Anthropic Messages: response objects and streams
# =============================================================================================


def test_chat_to_message_text_and_stop_reasons() -> None:
    body = {"model": "m", "max_tokens": 10, "messages": USER, "stop_sequences": ["END"]}
    msg = {"role": "assistant", "content": "Hello", "reasoning_content": "Greet."}
    out = Message.model_validate(adapters.chat_to_message(chat_response(msg), body))
    assert out.id.startswith("msg_") and out.stop_reason == "end_turn"
    assert [b.type for b in out.content] == ["thinking", "text"]
    assert out.content[1].text == "Hello"
    assert (out.usage.input_tokens, out.usage.output_tokens) == (7, 7)
    assert out.usage.cache_read_input_tokens == 3

    stopped = adapters.chat_to_message(chat_response(msg, "stop", stop_reason="END"), body)
    assert (stopped["stop_reason"], stopped["stop_sequence"]) == ("stop_sequence", "END")
    by_token = adapters.chat_to_message(chat_response(msg, "stop", stop_reason=2), body)
    assert by_token["stop_reason"] == "end_turn" and by_token["stop_sequence"] is None
    cut = adapters.chat_to_message(chat_response(msg, "length"), body)
    assert Message.model_validate(cut).stop_reason == "max_tokens"


def test_chat_to_message_tool_use() -> None:
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": "get_weather", "arguments": "not json"},
        },
    ]
    msg = {"role": "assistant", "content": None, "tool_calls": calls}
    out = Message.model_validate(adapters.chat_to_message(chat_response(msg, "tool_calls"), {}))
    assert out.stop_reason == "tool_use"
    assert [(b.type, b.id, b.input) for b in out.content] == [
        ("tool_use", "call_1", {"city": "Oslo"}),
        ("tool_use", "call_2", {"arguments": "not json"}),
    ]


def _validated_message_events(chunks: list[Json], body: Json) -> tuple[list[Any], Any]:
    events = run_stream(adapters.chat_stream_to_message_events, chunks, body)
    parsed = []
    for name, data in events:
        assert name == data["type"]
        parsed.append(MESSAGE_EVENT.validate_python(data))
    snapshot, bufs = None, {}
    for event in parsed:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    return parsed, snapshot


def test_message_stream_text_and_thinking() -> None:
    chunks = tool_chunks(text="Hello there.", reasoning="Think.", finish="stop")
    chunks = [c for c in chunks if "tool_calls" not in (c["choices"] or [{}])[0].get("delta", {})]
    chunks[-2]["choices"][0]["stop_reason"] = "END"
    events, snapshot = _validated_message_events(chunks, {"model": "m", "max_tokens": 5})
    assert [e.type for e in events][0] == "message_start"
    assert [e.type for e in events][-2:] == ["message_delta", "message_stop"]
    assert [b.type for b in snapshot.content] == ["thinking", "text"]
    assert snapshot.content[0].thinking == "Think." and snapshot.content[1].text == "Hello there."
    assert snapshot.stop_reason == "stop_sequence" and snapshot.stop_sequence == "END"
    assert snapshot.usage.output_tokens == 7 and snapshot.usage.cache_read_input_tokens == 4
    assert snapshot.usage.input_tokens == 6


def test_message_stream_tool_use_matches_non_streamed() -> None:
    events, snapshot = _validated_message_events(tool_chunks(text="Checking."), {"model": "m"})
    assert [b.type for b in snapshot.content] == ["text", "tool_use", "tool_use"]
    assert [(b.id, b.input) for b in snapshot.content[1:]] == [
        ("call_a", {"city": "Paris", "unit": "c"}),
        ("call_b", {"city": "Oslo", "unit": "c"}),
    ]
    assert snapshot.stop_reason == "tool_use"
    for index in (1, 2):
        partial = "".join(
            e.delta.partial_json
            for e in events
            if e.type == "content_block_delta" and e.index == index
        )
        assert json.loads(partial) == snapshot.content[index].input
    starts = [e.index for e in events if e.type == "content_block_start"]
    stops = [e.index for e in events if e.type == "content_block_stop"]
    assert starts == stops == [0, 1, 2]


def test_message_stream_error() -> None:
    chunks = [chunk({"content": "Hi"}), {"error": {"message": "boom", "type": "server_error"}}]
    events = run_stream(adapters.chat_stream_to_message_events, chunks, {"model": "m"})
    assert events[-1] == (
        "error",
        {"type": "error", "error": {"type": "api_error", "message": "boom"}},
    )
    assert not any(name == "message_stop" for name, _ in events)


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (422, "invalid_request_error"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (503, "api_error"),
        (529, "overloaded_error"),
    ],
)
def test_anthropic_error(status: int, kind: str) -> None:
    assert adapters.anthropic_error(status, "m") == {
        "type": "error",
        "error": {"type": kind, "message": "m"},
    }
