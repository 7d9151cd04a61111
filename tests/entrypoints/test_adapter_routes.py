"""/v1/responses and /v1/messages end to end: the real `openai` and `anthropic` SDKs against a
running server (text, instructions/system, max-token cuts, stop sequences, streaming, tool
calls and their results, structured output, refused fields and unknown models), then the
engine idle with a consistent cache, also after a client left mid-stream."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pydantic
import pytest

from hybridkv.engine import DEFAULT_MODEL, Engine
from tests.entrypoints.server_utils import delta, metric_values, running_server, wait_idle

MODEL = "adapter-model"
GREEDY = {"temperature": 0}  # the anthropic SDK's create() has no temperature argument
PROMPT = "def fibonacci(n):"
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server():
    engine = Engine(str(DEFAULT_MODEL), dtype="float32", max_num_seqs=16, max_model_len=512)
    with running_server(engine, MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def ant(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)


# -- OpenAI Responses ---------------------------------------------------------------------------


def test_responses_text_cut_by_max_output_tokens(oai):
    r = oai.responses.create(model=MODEL, input=PROMPT, max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.model == MODEL
    assert r.status == "incomplete"
    assert r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.output_text and isinstance(r.output_text, str)
    assert [item.type for item in r.output] == ["message"]
    assert r.usage is not None and r.usage.output_tokens == 8
    assert r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens


def test_responses_instructions_reach_the_prompt(oai):
    plain = oai.responses.create(model=MODEL, input=PROMPT, max_output_tokens=2)
    told = oai.responses.create(
        model=MODEL, input=PROMPT, instructions="You write Python.", max_output_tokens=2
    )
    assert told.instructions == "You write Python."
    assert told.usage.input_tokens > plain.usage.input_tokens


def test_responses_stream_events(oai):
    events = list(
        oai.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=6, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = [e for e in events if e.type == "response.output_text.done"]
    assert len(done) == 1 and done[0].text == text and text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 6
    # greedy: the same text as without streaming
    plain = oai.responses.create(model=MODEL, input=PROMPT, max_output_tokens=6, temperature=0)
    assert plain.output_text == text


def test_responses_stream_helper(oai):
    # get_final_response() needs response.completed: a JSON object that ends by itself
    with oai.responses.stream(
        model=MODEL,
        input="The weather in Paris, as JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed"
    assert final.output_text == "".join(deltas) and deltas
    assert set(json.loads(final.output_text)) == {"city", "days"}
    # cut by max_output_tokens: the helper's last event is response.incomplete
    with oai.responses.stream(model=MODEL, input=PROMPT, max_output_tokens=5) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.output_text and events[-1].response.usage.output_tokens == 5


RESPONSES_TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "The weather forecast for a city.",
        "parameters": WEATHER,
        "strict": True,
    },
    {
        "type": "function",
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_responses_function_calls_and_their_outputs(oai, choice):
    question = "What is the weather in Paris for 3 days?"
    r = oai.responses.create(
        model=MODEL,
        input=question,
        tools=RESPONSES_TOOLS,
        tool_choice=choice,
        parallel_tool_calls=False,
        max_output_tokens=60,
        temperature=0,
    )
    assert r.status == "completed", r
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1, r.output
    call = calls[0]
    if choice != "required":
        assert call.name == "get_weather"
    assert call.name in ("get_weather", "get_time")
    assert isinstance(json.loads(call.arguments), dict)
    assert call.call_id
    # the second turn: the call and its output go back
    second = oai.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": question},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"},
        ],
        tools=RESPONSES_TOOLS,
        max_output_tokens=4,
    )
    assert second.status in ("incomplete", "completed")
    assert second.usage.input_tokens > r.usage.input_tokens
    assert any(item.type == "message" for item in second.output)


def test_responses_streamed_function_call(oai):
    events = list(
        oai.responses.create(
            model=MODEL,
            input="weather?",
            tools=RESPONSES_TOOLS,
            tool_choice={"type": "function", "name": "get_time"},
            max_output_tokens=40,
            stream=True,
        )
    )
    assert events[-1].type == "response.completed"
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [item.type for item in added] == ["function_call"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == args
    assert json.loads(args)["zone"] in ("UTC", "CET")
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.name == "get_time" and call.arguments == args


def test_responses_json_schema_output(oai):
    r = oai.responses.create(
        model=MODEL,
        input="The weather in Paris, as JSON.",
        text={"format": {"type": "json_schema", "name": "weather", "schema": WEATHER}},
        max_output_tokens=60,
        temperature=0,
    )
    assert r.status == "completed", r
    value = json.loads(r.output_text)
    assert set(value) == {"city", "days"} and isinstance(value["days"], int)


def test_responses_refused_field_is_a_400_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.responses.create(
            model=MODEL, input=PROMPT, max_output_tokens=2, previous_response_id="x"
        )
    assert info.value.status_code == 400
    err = info.value.body
    assert err["param"] == "previous_response_id" and "previous_response_id" in err["message"]
    assert err["type"] == "invalid_request_error"


def test_responses_unknown_model_is_a_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.responses.create(model="no-such-model", input=PROMPT, max_output_tokens=2)
    assert info.value.status_code == 404
    assert "no-such-model" in info.value.body["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_output_tokens": 100000}, "max_output_tokens"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x " * 600}, "input"),
        ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "f"}},
         "tool_choice.name"),
        ({"text": {"format": {"type": "json_schema", "name": "w", "schema": {"type": "no"}}}},
         "text.format"),
    ],
)  # fmt: skip
def test_responses_errors_of_the_chat_path_name_the_sent_field(server, fields, param):
    """Checked after conversion, they name the Responses field, not the chat one."""
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 2} | fields
    r = httpx.post(server.base_url + "/v1/responses", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "max_completion_tokens" not in err["message"] and "function.name" not in err["message"]


# -- Anthropic Messages ---------------------------------------------------------------------------


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_messages_text_cut_by_max_tokens(ant):
    m = ant.messages.create(model=MODEL, max_tokens=8, messages=user(PROMPT), extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.usage.output_tokens == 8 and m.usage.input_tokens > 0


def test_messages_system_prompt_reaches_the_prompt(ant):
    plain = ant.messages.create(model=MODEL, max_tokens=2, messages=user(PROMPT))
    told = ant.messages.create(
        model=MODEL,
        max_tokens=2,
        system=[{"type": "text", "text": "You write Python."}],
        messages=user(PROMPT),
    )
    total = told.usage.input_tokens + (told.usage.cache_read_input_tokens or 0)
    assert total > plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)


def test_messages_stop_sequence(ant):
    free = ant.messages.create(model=MODEL, max_tokens=12, messages=user(PROMPT), extra_body=GREEDY)
    text = free.content[0].text
    stop = text.strip()[:3] if len(text.strip()) >= 3 else text
    assert stop
    m = ant.messages.create(
        model=MODEL, max_tokens=12, messages=user(PROMPT), extra_body=GREEDY, stop_sequences=[stop]
    )
    assert m.stop_reason == "stop_sequence", (text, stop, m)
    assert m.stop_sequence == stop
    got = m.content[0].text if m.content else ""
    assert stop not in got and text.startswith(got)
    # streamed: the same stop
    with ant.messages.stream(
        model=MODEL, max_tokens=12, messages=user(PROMPT), extra_body=GREEDY, stop_sequences=[stop]
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_messages_stream_helper(ant):
    with ant.messages.stream(
        model=MODEL, max_tokens=6, messages=user(PROMPT), extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    plain = ant.messages.create(model=MODEL, max_tokens=6, messages=user(PROMPT), extra_body=GREEDY)
    assert plain.content[0].text == text


def test_messages_raw_stream_events(ant):
    events = list(
        ant.messages.create(
            model=MODEL, max_tokens=5, messages=user(PROMPT), extra_body=GREEDY, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert kinds[1] == "content_block_start" and "content_block_stop" in kinds
    assert events[-2].delta.stop_reason == "max_tokens"
    assert events[-2].usage.output_tokens == 5
    assert all(e.delta.type == "text_delta" for e in events if e.type == "content_block_delta")


ANTHROPIC_TOOLS = [
    {"name": "get_weather", "description": "The weather forecast.", "input_schema": WEATHER},
    {
        "name": "get_time",
        "input_schema": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
]


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_messages_tool_use_and_tool_result(ant, choice):
    question = user("What is the weather in Paris for 3 days?")
    m = ant.messages.create(
        model=MODEL,
        max_tokens=60,
        messages=question,
        tools=ANTHROPIC_TOOLS,
        tool_choice=choice | {"disable_parallel_tool_use": True},
        extra_body=GREEDY,
    )
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1
    use = uses[0]
    assert isinstance(use.input, dict) and use.id
    if choice["type"] == "tool":
        assert use.name == "get_weather" and set(use.input) == {"city", "days"}
    second = ant.messages.create(
        model=MODEL,
        max_tokens=4,
        tools=ANTHROPIC_TOOLS,
        messages=question
        + [
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"},
                    {"type": "text", "text": "And tomorrow?"},
                ],
            },
        ],
    )
    assert second.stop_reason in ("max_tokens", "end_turn")
    assert second.usage.input_tokens + (second.usage.cache_read_input_tokens or 0) > (
        m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    )


def test_messages_streamed_tool_use(ant):
    with ant.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=user("time?"),
        tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "tool", "name": "get_time"},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (use,) = [b for b in final.content if b.type == "tool_use"]
    assert use.name == "get_time" and use.input["zone"] in ("UTC", "CET")


def test_messages_missing_max_tokens_is_a_400(server):
    # the SDK requires max_tokens itself: send the body raw, then through the SDK's own client
    body = {"model": MODEL, "messages": user(PROMPT)}
    r = httpx.post(server.base_url + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    client = anthropic.Anthropic(base_url=server.base_url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    assert "max_tokens" in str(info.value)


def test_messages_errors_have_anthropics_shape(server, ant):
    url = server.base_url + "/v1/messages"
    body = {"model": MODEL, "max_tokens": 2, "messages": user(PROMPT), "container": "c1"}
    r = httpx.post(url, json=body, timeout=30)
    assert r.status_code == 400
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert "container" in err["error"]["message"]

    r = httpx.post(url, json=body | {"container": None, "model": "nope"}, timeout=30)
    assert r.status_code == 404
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"

    with pytest.raises(anthropic.NotFoundError) as info:
        ant.messages.create(model="nope", max_tokens=2, messages=user(PROMPT))
    assert info.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as bad:
        ant.messages.create(
            model=MODEL, max_tokens=2, messages=user(PROMPT), thinking={"type": "disabled"}
        )
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "thinking" in bad.value.body["error"]["message"]


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"max_tokens": 100000}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"stop_sequences": [5]}, "stop_sequences"),
        ({"metadata": {"user_id": 5}}, "metadata.user_id"),
    ],
)
def test_messages_errors_of_the_chat_path_name_the_sent_field(ant, fields, name):
    body = {"model": MODEL, "max_tokens": 2, "messages": user(PROMPT)} | fields
    with pytest.raises(anthropic.BadRequestError) as info:
        ant.post("/v1/messages", body=body, cast_to=anthropic.types.Message)
    err = info.value.body
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert name in err["error"]["message"], err
    assert "max_completion_tokens" not in err["error"]["message"]


def _sse(response: httpx.Response) -> list[tuple[str | None, dict]]:
    """(event name, data) of each event of a stream."""
    events, name = [], None
    for line in response.iter_lines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            events.append((name, json.loads(line[len("data: ") :])))
    return events


@pytest.mark.parametrize("tools", [False, True])
@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_raw_objects_and_events_validate_against_the_sdk_types(server, path, tools):
    """Strict checks beyond what the SDKs' lenient parsing shows: every object and event
    validates against the SDK's pydantic type, and each SSE event name is its data's type."""
    if path == "/v1/responses":
        body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 40}
        if tools:
            body |= {"tools": RESPONSES_TOOLS, "tool_choice": "required"}
        whole = openai.types.responses.Response
        event = pydantic.TypeAdapter(openai.types.responses.ResponseStreamEvent)
    else:
        body = {"model": MODEL, "messages": user(PROMPT), "max_tokens": 40}
        if tools:
            body |= {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any"}}
        whole = anthropic.types.Message
        event = pydantic.TypeAdapter(anthropic.types.RawMessageStreamEvent)
    r = httpx.post(server.base_url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    whole.model_validate(r.json())
    with httpx.stream("POST", server.base_url + path, json=body | {"stream": True}) as r:
        events = _sse(r)
    assert events
    for name, data in events:
        assert name == data["type"]
        event.validate_python(data)


# -- the engine afterwards --------------------------------------------------------------------


def _leave_a_stream(server, path: str, body: dict) -> None:
    """Open a stream, read its first event, leave; the request is aborted, its pages freed."""
    before = metric_values(server.base_url)
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", server.base_url + path, json=body) as r,
    ):
        assert r.status_code == 200
        first = next(line for line in r.iter_lines() if line.startswith("data: "))
        assert json.loads(first[len("data: ") :])["type"] in ("response.created", "message_start")
    wait_idle(server)
    after = metric_values(server.base_url)
    assert delta(before, after, 'hybridkv_requests_total{status="abort"}') == 1
    server.engine.cache.check_integrity()
    assert server.engine.cache.usage()["in_use"] == 0


def test_client_leaving_a_responses_stream_is_aborted(server):
    body = {"model": MODEL, "input": PROMPT, "max_output_tokens": 480, "stream": True}
    _leave_a_stream(server, "/v1/responses", body)


def test_client_leaving_a_messages_stream_is_aborted(server):
    body = {"model": MODEL, "messages": user(PROMPT), "max_tokens": 480, "stream": True}
    _leave_a_stream(server, "/v1/messages", body)


def test_engine_idle_and_cache_consistent_afterwards(server):
    wait_idle(server)
    server.engine.cache.check_integrity()
    assert server.engine.cache.usage()["in_use"] == 0
