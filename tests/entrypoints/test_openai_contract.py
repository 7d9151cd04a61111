"""The OpenAI contract as agents and evaluators use it, through the real `openai` SDK and raw
HTTP: fields honoured or refused by name, prompt log-probs (echo), n / best_of, logit_bias,
penalties, /tokenize and /detokenize, cached-token usage, structured outputs and tool calls."""

from __future__ import annotations

import json
import math

import httpx
import openai
import pydantic
import pytest

from hybridkv.engine import DEFAULT_MODEL, Engine
from tests.entrypoints.server_utils import assert_error, running_server, sse_events, wait_idle

MODEL = "contract-model"
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n" * 12  # past one cache block


@pytest.fixture(scope="module")
def server():
    engine = Engine(str(DEFAULT_MODEL), dtype="float32", max_num_seqs=32, max_model_len=512)
    with running_server(engine, MODEL) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=60)


# -- nothing silently ignored -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/completions", "suffix", "x"),
        ("/v1/completions", "use_beam_search", True),
        ("/v1/completions", "allowed_token_ids", [1, 2]),
        ("/v1/completions", "skip_special_tokens", False),
        ("/v1/chat/completions", "audio", {"voice": "alloy"}),
        ("/v1/chat/completions", "store", True),
        ("/v1/chat/completions", "functions", [{"name": "f"}]),
        ("/v1/chat/completions", "reasoning_effort", "high"),
        ("/v1/chat/completions", "modalities", ["text", "audio"]),
        ("/v1/chat/completions", "prediction", {"type": "content", "content": "x"}),
    ],
)
def test_unsupported_fields_are_refused_by_name(server, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body |= (
        {"prompt": "x"} if "chat" not in path else {"messages": [{"role": "user", "content": "x"}]}
    )
    assert_error(post(server, path, body), 400, param=field, fragment=f"'{field}'")


def test_neutral_values_and_unknown_fields_pass(server):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 2,
        "store": False,
        "modalities": ["text"],
        "service_tier": "auto",
        "metadata": {"a": "b"},
        "some_future_field": 1,
    }
    assert post(server, "/v1/chat/completions", body).status_code == 200


# -- log-probs ----------------------------------------------------------------------------------


def test_echo_logprobs_score_the_prompt(server, client):
    """lm-eval's log-likelihood request: echo + logprobs + max_tokens 1 returns every prompt
    token's log-prob (the first null) with text offsets into the echoed text. Scored as a
    prompt, a greedy continuation gets the log-probs it was generated with (teacher forcing);
    max_tokens 0 scores the prompt and generates nothing."""
    prompt = "import os\nimport sys\n"
    gen = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=6,
        logprobs=0,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = prompt + gen.choices[0].text
    out = client.completions.create(
        model=MODEL, prompt=full, max_tokens=1, echo=True, logprobs=2, temperature=0
    )
    lp = out.choices[0].logprobs
    ids = server.engine.tokenizer.encode(full)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and out.choices[0].text.startswith(full)
    want = gen.choices[0].logprobs.token_logprobs
    assert lp.token_logprobs[len(ids) - len(want) : len(ids)] == pytest.approx(want, abs=1e-4)
    text = out.choices[0].text
    for k, token in enumerate(lp.tokens):
        assert text[lp.text_offset[k] :].startswith(token)
    assert all(len(top) >= 2 for top in lp.top_logprobs[1:])
    zero = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": full, "max_tokens": 0, "echo": True, "logprobs": 0},
    )
    choice = zero.json()["choices"][0]
    assert choice["text"] == full and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(lp.token_logprobs[:-1], abs=1e-5)
    assert zero.json()["usage"]["completion_tokens"] == 0


def test_vllm_prompt_logprobs_field(server):
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "class A:\n", "max_tokens": 1, "prompt_logprobs": 1},
    )
    entries = r.json()["choices"][0]["prompt_logprobs"]
    ids = server.engine.tokenizer.encode("class A:\n")
    assert entries[0] is None and len(entries) == len(ids)
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry and all(e["logprob"] <= 0 for e in entry.values())
        assert any(e["rank"] == 1 for e in entry.values())


def test_chat_top_logprobs(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=3,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens == 3  # one entry per generated token
    assert all(len(c.top_logprobs) == 3 for c in content)


# -- sampling -----------------------------------------------------------------------------------


def test_n_choices_share_one_prefill_and_count_the_prompt_once(server, client):
    out = client.completions.create(
        model=MODEL, prompt=LONG, max_tokens=6, n=3, seed=11, temperature=1.0
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.text for c in out.choices}) > 1  # seeds seed, seed + 1, seed + 2
    again = client.completions.create(
        model=MODEL, prompt=LONG, max_tokens=6, n=3, seed=11, temperature=1.0
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    ids = server.engine.tokenizer.encode(LONG)
    assert out.usage.prompt_tokens == len(ids)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": LONG}], n=2, max_tokens=4, temperature=0
    )
    assert (
        len(chat.choices) == 2
        and chat.choices[0].message.content == chat.choices[1].message.content
    )
    wait_idle(server)


def test_best_of_returns_the_most_likely(server):
    body = {
        "model": MODEL,
        "prompt": "x = ",
        "max_tokens": 5,
        "temperature": 1.0,
        "seed": 3,
        "logprobs": 0,
    }
    many = post(server, "/v1/completions", body | {"n": 4}).json()["choices"]
    best = post(server, "/v1/completions", body | {"best_of": 4}).json()["choices"]
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in many]
    assert len(best) == 1 and best[0]["text"] == many[scores.index(max(scores))]["text"]
    r = post(server, "/v1/completions", body | {"best_of": 4, "stream": True})
    assert_error(r, 400, param="best_of")


def test_logit_bias_and_penalties_through_the_sdk(client):
    token = 300
    out = client.completions.create(
        model=MODEL,
        prompt="x",
        max_tokens=4,
        temperature=0.8,
        logit_bias={str(token): 100},
        extra_body={"ignore_eos": True},
    )
    assert (
        out.choices[0].text
        == client.completions.create(
            model=MODEL,
            prompt="y",
            max_tokens=4,
            temperature=0,
            logit_bias={str(token): 100},
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    for bad in ({"abc": 1}, {"5": 1000}, {"99999999": 1}):
        with pytest.raises(openai.BadRequestError, match="logit_bias"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias=bad)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, presence_penalty=3)


# -- endpoints ----------------------------------------------------------------------------------


def test_tokenize_and_detokenize(server):
    r = post(
        server, "/tokenize", {"model": MODEL, "prompt": "def f(x):", "return_token_strs": True}
    )
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == 512
    assert "".join(body["token_strs"]) == "def f(x):"
    back = post(server, "/detokenize", {"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": "def f(x):"}
    assert_error(post(server, "/detokenize", {"tokens": [10**9]}), 400, param="tokens")
    assert_error(post(server, "/tokenize", {"prompt": "x", "bogus": 1}), 400)
    chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()
    usage = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
    ).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]
    assert "model_max_length" in httpx.get(server.base_url + "/tokenizer_info").json()


# -- structured outputs ---------------------------------------------------------------------


class Point(pydantic.BaseModel):
    name: str = pydantic.Field(pattern="^[a-z]{1,6}$")
    x: int
    tags: list[bool] = pydantic.Field(max_length=2)


def test_sdk_parse_with_a_pydantic_model(client):
    done = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "a point"}],
        response_format=Point,
        max_completion_tokens=200,
        temperature=0.7,
        seed=1,
    )
    assert isinstance(done.choices[0].message.parsed, Point)


@pytest.mark.parametrize("stream", [False, True])
def test_guided_choice_regex_json_object(server, stream):
    def text_of(body):
        r = post(
            server,
            "/v1/completions",
            {"model": MODEL, "prompt": "q", "stream": stream, "max_tokens": 60, **body},
        )
        if not stream:
            return r.json()["choices"][0]["text"]
        return "".join(e["choices"][0]["text"] for e in sse_events(r)[:-1] if e["choices"])

    assert text_of({"guided_choice": ["yes", "no", "maybe"]}) in ("yes", "no", "maybe")
    assert text_of({"guided_regex": "[0-9]{3}-[a-z]{2}"})[:6][3] == "-"
    value = json.loads(
        text_of(
            {
                "response_format": {"type": "json_object"},
                "max_tokens": 200,
                "temperature": 0,
            }
        )
    )
    assert isinstance(value, dict)


def test_bad_grammar_is_a_400_and_length_cut_says_length(server):
    for body, param in (
        ({"guided_regex": "([a-z"}, "structured output"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nonsense"}},
                }
            },
            "structured output",
        ),
        ({"guided_choice": "yes"}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ):
        r = post(server, "/v1/completions", {"model": MODEL, "prompt": "q", **body})
        assert_error(r, 400, param=param)
    r = post(
        server,
        "/v1/completions",
        {"model": MODEL, "prompt": "q", "max_tokens": 3, "guided_regex": "[a-z]{20}"},
    )
    assert r.json()["choices"][0]["finish_reason"] == "length"
    wait_idle(server)
    server.engine.cache.check_integrity()


# -- tools ------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["required", {"type": "function", "function": {"name": "get_time"}}]
)
def test_forced_tool_calls_always_parse(client, choice):
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER, TIME],
        tool_choice=choice,
        max_tokens=120,
        temperature=0.8,
        seed=4,
    )
    msg = client.chat.completions.create(**kw).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content is None
    for call in msg.message.tool_calls:
        args = json.loads(call.function.arguments)
        assert call.function.name in ("get_weather", "get_time") and isinstance(args, dict)
        assert call.id.startswith("call_")
    if isinstance(choice, dict):
        assert [c.function.name for c in msg.message.tool_calls] == ["get_time"]
    # streamed: the fragments of each call's arguments join into the same JSON
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"name": None, "args": ""})
                entry["name"] = entry["name"] or d.function.name
                entry["args"] += d.function.arguments or ""
    assert finish == "tool_calls"
    streamed = [(e["name"], json.loads(e["args"])) for _, e in sorted(calls.items())]
    whole = [(c.function.name, json.loads(c.function.arguments)) for c in msg.message.tool_calls]
    assert streamed == whole


def test_auto_tool_calls_are_parsed_from_the_model_text(client):
    """tool_choice auto: the model's own Hermes-format text (forced here by a regex, since the
    tiny model knows no tools) comes back as tool_calls, whole and streamed."""
    regex = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{2,6}", "days": [1-9]\}\}\n</tool_call>'  # noqa: E501
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[WEATHER],
        max_tokens=80,
        temperature=0,
        extra_body={"guided_regex": "ok " + regex},
    )
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content.strip() == "ok"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {
        "city",
        "days",
    }
    content, args = "", ""
    for chunk in client.chat.completions.create(stream=True, **kw):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        args += "".join(d.function.arguments or "" for d in delta.tool_calls or [])
    assert content.strip() == "ok" and json.loads(args) == json.loads(call.function.arguments)


def test_reasoning_content_split(server, client):
    server.reasoning_parser = "qwen3"
    try:
        kw = dict(
            model=MODEL,
            messages=[{"role": "user", "content": "think"}],
            max_tokens=60,
            temperature=0,
            extra_body={"guided_regex": "<think>[a-z]{3,9}</think>[a-z]{2,5}"},
        )
        msg = client.chat.completions.create(**kw).choices[0].message
        data = msg.model_dump()
        assert data["reasoning_content"] and msg.content and "<think>" not in msg.content
        parts = {"reasoning_content": "", "content": ""}
        for chunk in client.chat.completions.create(stream=True, **kw):
            delta = chunk.choices[0].delta.model_dump()
            for key in parts:
                parts[key] += delta.get(key) or ""
        assert parts == {"reasoning_content": data["reasoning_content"], "content": msg.content}
    finally:
        server.reasoning_parser = None


def test_no_error_is_a_500_and_pages_return(server):
    wait_idle(server)
    server.engine.cache.check_integrity()
    assert server.engine.cache.usage()["in_use"] == 0
    assert math.isfinite(server.async_engine.stats["usage"]["in_use"])


def test_multi_turn_tool_messages_round_trip_through_the_template(server, client):
    """Assistant tool calls and `tool` results of an earlier turn render through a Hermes-style
    template exactly as transformers renders them (the server's /tokenize of the chat request
    decodes back to transformers' text), and the chat request itself is served."""
    from transformers import PreTrainedTokenizerFast

    from tests.entrypoints.test_chat_template import CALLS, HERMES_TEMPLATE, TOKENIZER, TOOLS

    tok = PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER))
    want = tok.apply_chat_template(
        CALLS, tools=TOOLS, chat_template=HERMES_TEMPLATE, tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    body = {"messages": CALLS, "tools": TOOLS, "chat_template": HERMES_TEMPLATE}
    ids = post(server, "/tokenize", body).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"] == want
    assert "<tool_response>" in want and "get_weather" in want
    short = CALLS[:3] + [{"role": "user", "content": "ok"}]
    body = {"messages": short, "chat_template": HERMES_TEMPLATE}
    ids = post(server, "/tokenize", body).json()["tokens"]
    out = client.chat.completions.create(
        model=MODEL, messages=short, max_tokens=3, extra_body={"chat_template": HERMES_TEMPLATE}
    )
    assert out.usage.prompt_tokens == len(ids)


def test_streamed_n_choices_each_echo_the_prompt_log_probs(server):
    body = {"model": MODEL, "prompt": "import os\nimport re\n", "max_tokens": 3, "n": 3,
            "echo": True, "logprobs": 1, "seed": 2, "temperature": 1.0}  # fmt: skip
    whole = post(server, "/v1/completions", body).json()["choices"]
    events = sse_events(post(server, "/v1/completions", body | {"stream": True}))
    firsts: dict[int, dict] = {}
    for e in events[:-1]:
        for c in e["choices"]:
            firsts.setdefault(c["index"], c)
    assert sorted(firsts) == [0, 1, 2]
    n_prompt = len(server.engine.tokenizer.encode(body["prompt"]))
    for k, c in firsts.items():
        assert c["text"] == body["prompt"]
        got = c["logprobs"]["token_logprobs"]
        assert got[0] is None and len(got) == n_prompt
        want = whole[k]["logprobs"]["token_logprobs"][:n_prompt]
        assert got == pytest.approx(want, abs=1e-5)


def test_unknown_message_keys_are_refused_and_echoed_metadata_passes(server):
    user = {"role": "user", "content": "x"}
    echoed = {"role": "assistant", "content": "y", "refusal": None, "annotations": [],
              "audio": None, "function_call": None}  # fmt: skip
    body = {"model": MODEL, "max_tokens": 2, "messages": [user, echoed, user]}
    assert post(server, "/v1/chat/completions", body).status_code == 200
    body["messages"][1] = echoed | {"audio": {"id": "a1"}}
    r = post(server, "/v1/chat/completions", body)
    assert_error(r, 400, param="messages.1.audio", fragment="'audio'")
