"""Helpers of the server tests: a uvicorn server in a thread, idle waits, SSE reading, metrics
and random request bodies for the fuzz and soak tests."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx

from hybridkv.engine import Engine
from hybridkv.entrypoints.server import Server, build_app

ERROR_KEYS = {"message", "type", "param", "code"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(engine: Engine, model: str, **server_kw: Any) -> Iterator[Server]:
    """A Server over `engine` behind uvicorn in a thread; `.base_url` is set."""
    import uvicorn

    srv = Server(engine, model, **server_kw)
    port = free_port()
    config = uvicorn.Config(build_app(srv), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started and time.time() < deadline:
        time.sleep(0.05)
    srv.base_url = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    try:
        yield srv
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def wait_idle(server: Server, timeout: float = 20.0) -> None:
    """Until the engine has nothing running or waiting and every page is free or cached."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = server.async_engine.stats
        idle = not s["running"] and not s["waiting"] and s["usage"]["in_use"] == 0
        if idle and not server.engine.has_unfinished and not server.engine.requests:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {server.async_engine.stats}")


def assert_error(response: httpx.Response, status: int, param: Any = ..., fragment: str = ""):
    """An error in OpenAI's shape, with this status (and param, and message fragment)."""
    assert response.status_code == status, (response.status_code, response.text)
    body = response.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"] and "\n" not in err["message"]
    want = "server_error" if status >= 500 else "invalid_request_error"
    assert err["type"] == want, err
    if param is not ...:
        assert err["param"] == param, err
    assert fragment in err["message"], err
    return err


def sse_events(response: httpx.Response) -> list[Any]:
    """The `data:` payloads of an event stream: parsed JSON, or "[DONE]"."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def metric_values(base_url: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values


def delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def post_raw(base_url: str, path: str, body: Any, timeout: float = 60) -> httpx.Response:
    """POST a body as JSON text (lone surrogates written as \\ud800 escapes, which httpx's
    own JSON encoding refuses) or as given bytes."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    return httpx.post(base_url + path, content=content, headers=headers, timeout=timeout)


# -- random bodies ----------------------------------------------------------------------------

COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stream",
    "stream_options", "stop", "seed", "ignore_eos", "min_tokens", "stop_token_ids", "user",
    "logprobs", "echo", "unknown_field", "logit_bias", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_p", "best_of", "prompt_logprobs", "guided_choice",
    "guided_regex", "response_format", "suffix", "truncate_prompt_tokens",
]  # fmt: skip
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "n", "stream", "stream_options", "stop", "seed", "ignore_eos", "min_tokens",
    "stop_token_ids", "user", "logprobs", "top_logprobs", "unknown_field", "logit_bias",
    "presence_penalty", "min_p", "tools", "tool_choice", "response_format", "guided_json",
    "parallel_tool_calls", "chat_template_kwargs", "store", "n",
]  # fmt: skip


VALID = {
    "prompt": ["t1", "t2 t3 t4", [1, 2, 3], ["t5", "t6 t7"], [[4, 5], [6]]],
    "messages": [
        [{"role": "system", "content": "t9"}, {"role": "user", "content": "t3"}],
        [{"role": "user", "content": [{"type": "text", "text": "t4"}]}],
        [{"role": "user", "content": None}],
    ],
    "max_tokens": [1, 2, 5, None],
    "max_completion_tokens": [1, 4, None],
    "temperature": [0, 0.0, 0.7, 1, None],
    "top_p": [0.5, 1, 1.0, None],
    "top_k": [0, -1, 1, 5, None],
    "n": [1],
    "stream": [True, False],
    "stream_options": [{"include_usage": True}, {}, None],
    "stop": ["t5", ["t6", "t7"], [], None],
    "seed": [0, 7, 2**64 - 1, None],
    "ignore_eos": [True, False],
    "min_tokens": [0, 1],
    "stop_token_ids": [[], [5, 6], None],
    "user": ["someone"],
    "logprobs": [0, 2, 5, None, True, False],
    "top_logprobs": [0, 3, None],
    "echo": [True, False],
    "logit_bias": [{"5": 10}, {}, {"7": -100, "8": 1.5}],
    "presence_penalty": [0, 1.5, -2],
    "frequency_penalty": [0.5, None],
    "repetition_penalty": [1.2, 1],
    "min_p": [0, 0.1],
    "best_of": [1, 2, None],
    "prompt_logprobs": [0, 2, None],
    "guided_choice": [["t1", "t2"], None],
    "guided_regex": ["t[0-9]", None],
    "response_format": [{"type": "text"}, {"type": "json_object"}, None],
    "guided_json": [{"type": "object", "properties": {"a": {"type": "integer"}}}, None],
    "tools": [[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"enum": [1, 2]}}, "required": ["x"]}}}], None],
    "tool_choice": ["auto", "none", "required", {"type": "function", "function": {"name": "f"}}],
    "parallel_tool_calls": [True, False],
    "chat_template_kwargs": [{}, {"enable_thinking": False}],
    "store": [False],
    "suffix": [None, ""],
    "truncate_prompt_tokens": [1, 4, None],
}


def _nested(rng: random.Random, depth: int) -> Any:
    value: Any = rng.choice([1, "t1", None, []])
    for _ in range(depth):
        value = [value] if rng.random() < 0.5 else {"k": value}
    return value


def random_value(rng: random.Random) -> Any:
    """A JSON value of a random kind: wrong types, huge and negative integers, floats, strings
    that look like numbers, lone surrogates, nested objects, empty lists."""
    choices = [
        lambda: None,
        lambda: rng.choice([True, False]),
        lambda: rng.choice([0, -1, 1, 2, 3, 7, 16, 255, 256, 10**6]),
        lambda: rng.choice([2**31 - 1, 2**31, 2**63, 2**64 - 1, 2**64, 10**30, -(10**30)]),
        lambda: rng.choice([0.0, -0.0, 0.5, 1.5, -2.5, 1e-300, 1e308, 3.0]),
        lambda: rng.choice(["NaN", "Infinity", "-Infinity", "1e999", "0x10", "16", ""]),
        lambda: rng.choice(["t1 t2", "hello", "\U0001f4a5" * 5, "a\ud800b", "\udfff", "\x00"]),
        lambda: rng.choice([[], [[]], [1, 2], [-1], [2**64], ["t1", 5], ["t1", "t2"], [""]]),
        lambda: rng.choice([[[1, 2], [3]], [[1], []], ["a\ud800"], [True], [1.5], [None]]),
        lambda: rng.choice([{}, {"a": 1}, {"include_usage": True}, {"include_usage": "yes"}]),
        lambda: [{"role": "user", "content": rng.choice(["t1", 5, None, [], "a\ud800"])}],
        lambda: [{"role": rng.choice(["user", "wizard", 3]), "content": "t2"}],
        lambda: [{"role": "user", "content": [{"type": "text", "text": "t3"}, {"type": "img"}]}],
        lambda: [{"content": "t1"}],
        lambda: _nested(rng, rng.choice([3, 30, 300])),
    ]
    return rng.choice(choices)()


def random_body(rng: random.Random, chat: bool, model: str) -> dict[str, Any] | bytes:
    """A small request with two to five fields set to a valid value or a random one (mostly
    wrong); now and then
    a body that is not JSON at all, not UTF-8, NaN, an array, or nested thousands deep."""
    if rng.random() < 0.08:
        return rng.choice(
            [
                b"{not json",
                b'{"model": "x", "prompt": "\xff\xfe"}',
                b'{"temperature": NaN}',
                b"[1, 2, 3]",
                b"[" * 5000 + b"]" * 5000,
                b'{"max_tokens": ' + b"9" * 5000 + b"}",
                b"",
            ]
        )
    if chat:
        body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": "t3"}]}
    else:
        body = {"model": model, "prompt": "t1 t2 t3"}
    body["max_tokens"] = 3
    fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in rng.sample(fields, rng.randint(2, 5)):
        valid = rng.random() < 0.6 and name in VALID
        body[name] = rng.choice(VALID[name]) if valid else random_value(rng)
    return body
