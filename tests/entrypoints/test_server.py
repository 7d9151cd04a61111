"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import openai
import pytest

from hybridkv.engine import DEFAULT_MODEL, Engine
from hybridkv.entrypoints.server import Server, build_app

MODEL = "test-model"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    import uvicorn

    folder = DEFAULT_MODEL if (DEFAULT_MODEL / "model.safetensors").is_file() else tiny_model_dir
    engine = Engine(str(folder), dtype="float32", max_num_seqs=32, max_model_len=256)
    srv = Server(engine, MODEL)
    port = _free_port()
    config = uvicorn.Config(build_app(srv), host="127.0.0.1", port=port, log_level="warning")
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started and time.time() < deadline:
        time.sleep(0.05)
    srv.base_url = f"http://127.0.0.1:{port}"
    yield srv
    uv.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)


def wait_idle(server, timeout: float = 10.0) -> None:
    """Until the engine has nothing running and every page is free or cached."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = server.async_engine.stats
        idle = not s["running"] and not s["waiting"] and s["usage"]["in_use"] == 0
        if idle and not server.engine.has_unfinished:
            return
        time.sleep(0.05)
    raise AssertionError(f"engine not idle: {server.async_engine.stats}")


def test_models_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.base_url + "/health").json() == {"status": "ok"}


def test_models_retrieve(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model" and card.owned_by == "hybridkv"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("other-model")
    assert err.value.body["code"] == "model_not_found" and "other-model" in err.value.message
    # Hugging Face ids hold a slash: the whole path is the id, not another route.
    r = httpx.get(server.base_url + "/v1/models/org/name")
    assert r.status_code == 404 and "`org/name` does not exist" in r.json()["error"]["message"]


def test_completion(client):
    out = client.completions.create(
        model=MODEL, prompt="t1 t2 t3", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.text
    assert out.usage.completion_tokens == 6 and out.usage.prompt_tokens > 0


def test_chat(client):
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "t5 t6"}],
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


def test_streaming_equals_non_streaming(client):
    kw = dict(
        model=MODEL, prompt="t7 t8 t9", max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = client.completions.create(**kw).choices[0].text
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    chat_kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "t3"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.chat.completions.create(**chat_kw).choices[0].message.content
    parts = list(client.chat.completions.create(stream=True, **chat_kw))
    assert "".join(p.choices[0].delta.content or "" for p in parts) == whole


def test_sse_ends_with_done_and_usage(server):
    body = {
        "model": MODEL,
        "prompt": "t1",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    usage = json.loads(lines[-2][len("data: ") :])["usage"]
    assert usage["completion_tokens"] == 3


def test_sixteen_concurrent_streaming_clients(server):
    async def one(i: int) -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(
            base_url=server.base_url + "/v1", api_key="none", max_retries=0
        )
        kw = dict(
            model=MODEL,
            prompt=f"t{i} t{i + 1}",
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        stream = await aclient.completions.create(stream=True, **kw)
        text = "".join([c.choices[0].text async for c in stream if c.choices])
        whole = (await aclient.completions.create(**kw)).choices[0].text
        await aclient.close()
        return text, whole

    async def all_of_them():
        return await asyncio.gather(*(one(i) for i in range(16)))

    results = asyncio.run(all_of_them())
    assert all(text == whole and text for text, whole in results)
    wait_idle(server)


def test_client_disconnect_returns_pages(server):
    body = {
        "model": MODEL,
        "prompt": "t2 t4",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body) as r:
        got = 0
        for line in r.iter_lines():
            got += line.startswith("data: ")
            if got >= 3:
                break  # leave mid-stream
    wait_idle(server)
    server.engine.cache.check_integrity()
    assert server.engine.cache.usage()["in_use"] == 0


@pytest.mark.parametrize(
    ("body", "status", "fragment"),
    [
        ({"model": "nope", "prompt": "t1"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "t1", "max_tokens": -1}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "t1", "max_tokens": 10**6}, 400, "maximum context length"),
        ({"model": MODEL, "prompt": "t1 " * 300}, 400, "max_model_len is 256"),
        ({"model": MODEL, "prompt": "t1", "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "t1", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": 12}, 400, "prompt"),
        ({"model": MODEL}, 400, "prompt"),
        ({"model": MODEL, "prompt": "t1", "n": 100}, 400, "n must be in [1, 32]"),
        ({"model": MODEL, "prompt": "t1", "n": 2, "best_of": 1}, 400, "best_of must be in"),
        ({"model": MODEL, "prompt": "t1", "top_p": 5.0}, 400, "top_p"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt is empty"),
    ],
)
def test_bad_completion_requests(server, body, status, fragment):
    r = httpx.post(server.base_url + "/v1/completions", json=body)
    assert r.status_code == status
    err = r.json()["error"]
    assert fragment in err["message"] and err["type"] == "invalid_request_error"


def test_bad_chat_and_malformed_json(server, client):
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
    )
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = httpx.post(server.base_url + "/v1/chat/completions", json={"model": MODEL, "messages": []})
    assert r.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    # the server keeps serving after all of that
    ok = client.completions.create(model=MODEL, prompt="t1", max_tokens=2, temperature=0)
    assert ok.choices[0].text is not None
    wait_idle(server)


def test_metrics(server, client):
    client.completions.create(
        model=MODEL, prompt="t9 t9", max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    httpx.post(server.base_url + "/v1/completions", json={"model": "nope", "prompt": "x"})
    wait_idle(server)
    text = httpx.get(server.base_url + "/metrics").text
    for name in (
        "hybridkv_requests_total",
        "hybridkv_prompt_tokens_total",
        "hybridkv_generation_tokens_total",
        "hybridkv_requests_running",
        "hybridkv_requests_waiting",
        'hybridkv_cache_pages{state="free"}',
        "hybridkv_cache_group_pages",
        "hybridkv_prefix_cache_queries_total",
        "hybridkv_prefix_cache_hit_tokens_total",
        "hybridkv_time_to_first_token_seconds_bucket",
        "hybridkv_time_per_output_token_seconds_bucket",
    ):
        assert name in text, name
    lines = {
        ln.split(" ")[0]: ln.split(" ")[1]
        for ln in text.splitlines()
        if ln and not ln.startswith("#")
    }
    assert float(lines['hybridkv_requests_total{status="length"}']) >= 1
    assert float(lines['hybridkv_requests_total{status="error_404"}']) >= 1
    assert float(lines["hybridkv_generation_tokens_total"]) >= 3
    assert float(lines["hybridkv_requests_running"]) == 0


def test_streaming_never_shows_a_stop_string(client):
    kw = dict(
        model=MODEL,
        prompt="def fibonacci(n):",
        max_tokens=16,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**kw).choices[0].text
    # a stop string from the middle of the text, likely spanning a token boundary
    cut = next(i for i in range(len(full) // 3, len(full) - 3) if full[i : i + 3] not in full[:i])
    stop = full[cut : cut + 3]
    whole = client.completions.create(stop=[stop], **kw).choices[0]
    assert whole.finish_reason == "stop" and whole.text == full[:cut]
    parts = [
        c.choices[0].text
        for c in client.completions.create(stop=[stop], stream=True, **kw)
        if c.choices
    ]
    assert "".join(parts) == whole.text and all(
        stop not in "".join(parts[: i + 1]) for i in range(len(parts))
    )
